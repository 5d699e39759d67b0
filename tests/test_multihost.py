"""Multi-host on one machine: 2 processes x 4 fake CPU devices joined by jax.distributed on loopback
run one engine tensor-parallel over all 8 devices (process 0 schedules and broadcasts each step;
process 1 follows). Greedy tokens equal one process's (the HF reference, which the single-process
engine matches in test_engine_parity), and the processes agree on the KV cache size. Also the step
codec, the leader/follower protocol and the channel's handshake, on their own.

Run as a script, this file is one of those processes: `python tests/test_multihost.py ID PORT`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama3_gqa4_tied"  # 8 q / 2 kv heads: kv heads replicated at T=8
NUM_PROCESSES, DEVICES_PER_PROCESS = 2, 4
TIMEOUT_S = 240
CPU_NUM_BLOCKS = (128, 96)  # by process: as if their devices had different free memory; both must use 96


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def _engine_config(process_id: int, port: int, speculative: bool = False):
    from jaxserve.config import EngineConfig, ParallelConfig

    config = EngineConfig().with_overrides(
        model=FIXTURE, dtype="float32", skip_tokenizer_init=True, max_model_len=96, block_size=4,
        cpu_num_blocks=CPU_NUM_BLOCKS[process_id], max_num_batched_tokens=16, max_num_seqs=4, token_buckets=[16],
        request_buckets=[4], precompile=not speculative, compilation_cache_dir=None,
        speculative_config=SPEC if speculative else None)
    return dataclasses.replace(config, parallel=ParallelConfig(
        model=NUM_PROCESSES * DEVICES_PER_PROCESS, coordinator_address=f"127.0.0.1:{port}",
        num_processes=NUM_PROCESSES, process_id=process_id))


def _run_process(process_id: int, port: int, speculative: bool) -> None:
    from jaxserve import LLM, SamplingParams
    from jaxserve.distributed import run_follower

    config = _engine_config(process_id, port, speculative)
    if process_id != 0:
        calls = run_follower(config)  # follows process 0's steps until it closes the channel
        print(f"FOLLOWED {calls}", flush=True)
        return
    llm = LLM(config=config, progress=False)
    prompts = json.loads((FIXTURE / "reference.json").read_text())["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outputs]), flush=True)
    print(f"NUM_BLOCKS {llm.engine.runner.num_blocks}", flush=True)
    print(f"ACCEPTED {llm.engine.scheduler.num_accepted_tokens}", flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_two_processes_match_one(speculative):
    """Greedy tokens over two processes equal transformers'; with n-gram speculation too (the guesses travel
    in the broadcast SchedulerOutput, and every process verifies them). The plain engine precompiles: every
    process compiles and runs its programs once, in one order (their collectives meet)."""
    port = _free_port()
    # each process its share of the fake devices; the suite's other XLA flags kept
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}".strip(),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port), str(int(speculative))], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(NUM_PROCESSES)]
    try:
        logs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
    tokens = json.loads(next(line for line in logs[0].splitlines() if line.startswith("TOKENS "))[7:])
    assert tokens == json.loads((FIXTURE / "reference.json").read_text())["generated"]
    assert f"NUM_BLOCKS {min(CPU_NUM_BLOCKS)}" in logs[0].splitlines()
    accepted = int(next(line for line in logs[0].splitlines() if line.startswith("ACCEPTED "))[9:])
    assert (accepted > 0) == speculative
    assert "TOKENS" not in logs[1] and "FOLLOWED" in logs[1], "the follower runs run_follower, not the program"


def test_only_process_0_builds_an_engine():
    """A library never takes over the process: the follower loop is run_follower's, not Engine's or LLM's."""
    from jaxserve import LLM

    with pytest.raises(ValueError, match="run_follower"):
        LLM(config=_engine_config(1, _free_port()), progress=False)


def scheduler_output(step: int):
    from jaxserve.core.sched_types import NewRequestData, ScheduledRequest, SchedulerOutput
    from jaxserve.sampling_params import SamplingParams

    new = NewRequestData([5, 6, 7], 3, SamplingParams(temperature=0.7, top_k=5, stop=["x"], logprobs=2), seed=2**62,
                         eos_token_ids=(1, 2), max_tokens=9)
    item = ScheduledRequest(**{"request_id": "a", "row": 3, "num_computed_tokens": 0, "num_new_tokens": 3,
                               "new_block_ids": [4, 5], "new": new, "samples": True})
    values = {"scheduled": [item], "num_scheduled_tokens": 4, "finished_request_ids": {"b", "c"}, "step": step,
              "decode_ids": ["d"], "decode_rows": [0], "decode_positions": [11], "decode_new_blocks": [(0, 9)]}
    return SchedulerOutput(**{f.name: values[f.name] for f in dataclasses.fields(SchedulerOutput) if f.name in values})


def test_codec_round_trips_scheduler_output():
    from jaxserve import distributed

    out = scheduler_output(7)
    back = distributed.decode(json.loads(json.dumps(distributed.encode(out))), distributed.codec_types())
    assert back == out
    assert isinstance(back.finished_request_ids, set) and back.scheduled[0].new.eos_token_ids == (1, 2)
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    back_array = distributed.decode(json.loads(json.dumps(distributed.encode(array))), {})
    assert back_array.dtype == np.int32 and (back_array == array).all()


class Handle:
    def __init__(self, step: int):
        self.step = step


class Recorder:
    """A runner that records its calls, and how many of its handles are alive at each precompile."""

    num_blocks = 17

    def __init__(self):
        self.calls = []
        self.handles = []  # weak references to the handles it returned
        self.live_handles = []

    def dispatch(self, out):
        self.calls.append(("dispatch", out.step))
        handle = Handle(out.step)  # only its identity travels back
        self.handles.append(weakref.ref(handle))
        return handle

    def collect(self, handle):
        self.calls.append(("collect", handle.step))

    def precompile(self, progress=True):
        self.calls.append(("precompile", progress))
        self.live_handles.append(sum(ref() is not None for ref in self.handles))


def start_follower(runner):
    """A follower thread on one end of a socket pair; returns (leader channel, thread, raised errors)."""
    from jaxserve import distributed

    leader_sock, follower_sock = socket.socketpair()
    errors = []

    def run():
        try:
            distributed.follow(runner, distributed.Channel([follower_sock], 1))
        except Exception as err:
            errors.append(err)
        follower_sock.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return distributed.Channel([leader_sock], 0), thread, errors


def test_follower_mirrors_calls_and_releases_collected_handles():
    from jaxserve import distributed

    follower = Recorder()
    channel, thread, errors = start_follower(follower)
    leader = distributed.BroadcastingRunner(Recorder(), channel)
    leader.precompile(progress=False)
    first, second = leader.dispatch(scheduler_output(1)), leader.dispatch(scheduler_output(2))  # overlap: 2 in flight
    leader.collect(first)
    assert [number for _, number in leader._handles.values()] == [1]  # only the uncollected one is kept
    leader.precompile(progress=False)
    leader.collect(second)
    leader.precompile(progress=False)
    assert leader._handles == {}
    assert leader.num_blocks == 17  # everything else is the real runner's
    leader.channel.close()
    thread.join(10)
    assert not thread.is_alive() and not errors
    assert follower.calls == leader.runner.calls == [
        ("precompile", False), ("dispatch", 1), ("dispatch", 2), ("collect", 1), ("precompile", False),
        ("collect", 2), ("precompile", False)]
    assert follower.live_handles == [0, 1, 0]  # the follower drops each handle once collected


def test_leader_raises_a_follower_failure():
    from jaxserve import distributed

    class Failing(Recorder):
        def collect(self, handle):
            raise RuntimeError("device lost")

    channel, thread, errors = start_follower(Failing())
    leader = distributed.BroadcastingRunner(Recorder(), channel)
    leader.collect(leader.dispatch(scheduler_output(1)))
    thread.join(10)
    assert not thread.is_alive() and [str(err) for err in errors] == ["device lost"]
    with pytest.raises(RuntimeError, match=r"process 1 failed: RuntimeError: device lost \(after 1 runner calls\)"):
        leader.dispatch(scheduler_output(2))

    leader_sock, follower_sock = socket.socketpair()
    follower_sock.close()  # gone without a report
    with pytest.raises(RuntimeError, match="process 1 failed: it closed its connection"):
        distributed.BroadcastingRunner(Recorder(), distributed.Channel([leader_sock], 0)).precompile()
    leader_sock.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_accept_drops_bogus_peers_and_takes_the_follower(monkeypatch):
    from jaxserve import distributed

    monkeypatch.setattr(distributed, "HELLO_TIMEOUT_S", 0.2)
    token = os.urandom(distributed.TOKEN_BYTES)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    joined = []
    leader = threading.Thread(target=lambda: joined.extend(distributed.Channel._accept(server, token, 2, 30)),
                              daemon=True)
    leader.start()

    def hello(payload: bytes) -> bytes:
        return struct.pack(">Q", len(payload)) + payload

    valid = json.dumps({"process_id": 1, "token": token.hex()})
    frames = {
        "silent": b"",
        "partial": hello(b"x" * 100)[:20],
        "huge length prefix": struct.pack(">Q", 2**63) + b"{}",
        "garbage": hello(b"\xff\x00 not json"),
        "deep nesting": hello(b"[" * 4000),
        "infinite id": hello(valid.replace("1", "Infinity", 1).encode()),
        "wrong token": hello(json.dumps({"process_id": 1, "token": "00" * distributed.TOKEN_BYTES}).encode()),
        "leader's id": hello(valid.replace("1", "0", 1).encode()),
    }
    peers = {}
    for name, frame in frames.items():
        peers[name] = socket.create_connection(("127.0.0.1", port))
        peers[name].sendall(frame)
    for name, peer in peers.items():  # each dropped; the silent ones after HELLO_TIMEOUT_S
        assert _closed_by_peer(peer), name
        peer.close()
    assert leader.is_alive()
    follower = distributed.Channel([distributed.Channel._connect("127.0.0.1", port, token, 1, 10)], 1)
    leader.join(10)
    assert not leader.is_alive() and len(joined) == 1
    channel = distributed.Channel(joined, 0)
    channel.send({"method": "precompile", "args": [], "kwargs": {}})
    assert follower.recv() == {"method": "precompile", "args": [], "kwargs": {}}
    channel.close()
    follower.close()


def test_follower_refuses_an_oversized_frame():
    from jaxserve import distributed

    leader_sock, follower_sock = socket.socketpair()
    leader_sock.sendall(struct.pack(">Q", distributed.MAX_FRAME_BYTES + 1))
    with pytest.raises(ValueError, match="over the limit"):
        distributed.Channel([follower_sock], 1).recv()
    leader_sock.close()
    follower_sock.close()


def test_codec_refuses_unknown_types():
    from jaxserve import distributed

    with pytest.raises(ValueError, match="not part of SchedulerOutput"):
        distributed.decode({"type": "os.system", "fields": {}}, distributed.codec_types())
    with pytest.raises(TypeError, match="cannot encode"):
        distributed.encode(object())


if __name__ == "__main__":
    _run_process(int(sys.argv[1]), int(sys.argv[2]), bool(int(sys.argv[3])))
