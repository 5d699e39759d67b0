"""Devices of an engine, and one engine over several processes (hosts) with jax.distributed.

    every process: engine_devices(parallel) -> jax.distributed.initialize (before any device is used)
                   -> the same mesh over every process's devices -> the same params and caches
    process 0:     Engine -> connect(runner) -> BroadcastingRunner: each runner call that runs device
                   code (execute / dispatch / collect / precompile) is first sent to the others, then made
    the others:    run_follower(config) (their entry point; `jaxserve serve` / `generate` call it) -> the
                   same runner -> follow(): receive each call, make it on their own runner (the same SPMD
                   program on their devices), until process 0 closes the channel; then it returns

Every process runs the same program; only process 0 schedules. The channel is TCP from process 0
(listening on the coordinator's host, on a free port) to each other process; the port and a random
32-byte token reach the others through one broadcast_one_to_all over the devices, and a follower
must show the token when it connects. Process 0 reads every connection's hello side by side, and
drops one that is not a follower of this run (a wrong token, a malformed or oversized hello, or none
within HELLO_TIMEOUT_S) without holding up the others. Messages are length-prefixed JSON, each frame
capped (MAX_FRAME_BYTES): `encode` writes any dataclass field by field (numpy arrays as lists with
their dtype), and `decode` rebuilds only the dataclasses and enums named in SchedulerOutput's type
hints. No pickle. The coordination service of jax.distributed is itself unauthenticated: keep the
hosts on a private network.

Each side keeps the handles of dispatched steps until they are collected (two at most, with overlap
scheduling). A follower whose runner call fails reports the error to process 0 and closes its
channel; process 0 raises it at its next runner call. Limit: if process 0 is already waiting on a
step's collectives that the failed follower never joined, it waits until jax.distributed's heartbeat
timeout (100 s by default) ends the processes.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import hmac
import itertools
import json
import logging
import secrets
import select
import selectors
import socket
import struct
import time
import typing
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import ParallelConfig
from jaxserve.core.sched_types import SchedulerOutput
from jaxserve.runner.model_runner import ModelRunner
from sharding import EXPERT_PARALLEL, TensorParallel, expert_mesh, make_mesh
from sharding.expert_parallel import ExpertSharding

logger = logging.getLogger(__name__)

# Runner methods that run device code: every process must make the same calls in the same order.
BROADCAST_METHODS = ("execute", "dispatch", "collect", "precompile")
HANDLE_METHODS = ("dispatch",)  # their result is passed back later (to collect)
RELEASE_METHODS = ("collect",)  # the handles passed to them are not passed again
CONNECT_TIMEOUT_S = 300.0
TOKEN_BYTES = 32
HELLO_MAX_BYTES = 4096  # a follower's hello: its process id and the token
HELLO_TIMEOUT_S = 5.0  # a connection that has not sent its whole hello by then is dropped
MAX_FRAME_BYTES = 256 << 20  # one runner call from process 0
REPORT_MAX_BYTES = 64 << 10  # a follower's failure report


def engine_devices(parallel: ParallelConfig, mesh: Mesh | None = None) -> TensorParallel | None:
    """The mesh an engine runs on: `mesh` (a data-parallel replica's), else the first parallel.model (times
    parallel.expert) devices of all processes. None for one device of one process: the plain single-device
    path. With parallel.expert > 1 the devices form an [expert, model] mesh under the expert-parallel rules."""
    if parallel.num_processes > 1 and not jax.distributed.is_initialized():
        jax.distributed.initialize(parallel.coordinator_address, parallel.num_processes, parallel.process_id)
    if mesh is None:
        if parallel.model == 1 and parallel.expert == 1 and parallel.num_processes == 1:
            return None
        mesh = make_mesh(1, parallel.model, expert=parallel.expert)
    processes = {device.process_index for device in mesh.devices.flat}
    if len(processes) != parallel.num_processes:
        raise ValueError(f"the mesh of parallel.model={parallel.model} devices covers {len(processes)} of the "
                         f"{parallel.num_processes} processes; every process must hold part of it (set "
                         f"parallel.model to num_processes x devices per process = {jax.device_count()})")
    if parallel.expert > 1:
        return TensorParallel(expert_mesh(mesh.devices.flat, parallel.expert, parallel.model), EXPERT_PARALLEL,
                              expert=ExpertSharding(parallel.num_redundant_experts, parallel.expert_dispatch))
    return TensorParallel(mesh)


def check_leader(parallel: ParallelConfig) -> None:
    """ValueError unless this process builds engines: process 0 (or the only one)."""
    if parallel.num_processes > 1 and parallel.process_id != 0:
        raise ValueError(f"parallel.process_id={parallel.process_id}: only process 0 of a multi-process engine builds "
                         "an Engine (or LLM); the others follow its steps: call "
                         "jaxserve.distributed.run_follower(config) there (jaxserve serve and jaxserve generate do)")


def connect(runner, parallel: ParallelConfig) -> BroadcastingRunner:
    """Process 0: the runner wrapped to lead the others (who run `run_follower`)."""
    check_leader(parallel)
    channel = Channel.open(parallel)
    atexit.register(channel.close)
    return BroadcastingRunner(runner, channel)


def run_follower(config) -> int:
    """The entry point of every process but 0 of a multi-process engine (parallel.num_processes > 1): builds
    the same runner (model, caches) on this process's devices, then makes process 0's runner calls until it
    closes the channel. Returns the number of calls; raises what a call raised (process 0 is told first)."""
    parallel = config.parallel
    if parallel.num_processes < 2 or parallel.process_id == 0:
        raise ValueError(f"run_follower is for processes 1..{parallel.num_processes - 1} of a multi-process engine "
                         f"(parallel.process_id={parallel.process_id}, num_processes={parallel.num_processes}); "
                         "process 0 builds the Engine")
    runner = ModelRunner(config, engine_devices(parallel))
    channel = Channel.open(parallel)
    try:
        return follow(runner, channel)
    finally:
        channel.close()


# ---- the codec ----
def codec_types(root: type = SchedulerOutput) -> dict[str, type]:
    """Every dataclass and enum reachable from `root`'s field type hints, by qualified name."""
    found: dict[str, type] = {}

    def visit(hint) -> None:
        for arg in typing.get_args(hint):
            visit(arg)
        if not isinstance(hint, type) or not (dataclasses.is_dataclass(hint) or issubclass(hint, enum.Enum)):
            return
        name = f"{hint.__module__}.{hint.__qualname__}"
        if name not in found:
            found[name] = hint
            if dataclasses.is_dataclass(hint):
                for field_hint in typing.get_type_hints(hint).values():
                    visit(field_hint)

    visit(root)
    return found


def encode(obj: Any) -> Any:
    """A JSON-able form of `obj`. Every JSON object in it is a tagged node, so decoding is unambiguous."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, enum.Enum):
        cls = type(obj)
        return {"enum": f"{cls.__module__}.{cls.__qualname__}", "value": encode(obj.value)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        return {"type": f"{cls.__module__}.{cls.__qualname__}",
                "fields": {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, np.ndarray):
        return {"ndarray": obj.tolist(), "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, list):
        return [encode(item) for item in obj]
    if isinstance(obj, tuple):
        return {"tuple": [encode(item) for item in obj]}
    if isinstance(obj, (set, frozenset)):
        return {"set": [encode(item) for item in obj]}
    if isinstance(obj, dict):
        return {"dict": [[encode(key), encode(value)] for key, value in obj.items()]}
    raise TypeError(f"cannot encode a {type(obj).__name__} for the other processes; add it to "
                    "jaxserve/distributed.py encode/decode")


def decode(data: Any, types: dict[str, type]) -> Any:
    if not isinstance(data, (list, dict)):
        return data
    if isinstance(data, list):
        return [decode(item, types) for item in data]
    if "type" in data:
        cls = types.get(data["type"])
        if cls is None or not dataclasses.is_dataclass(cls):
            raise ValueError(f"message names type {data['type']!r}, which is not part of SchedulerOutput")
        obj = object.__new__(cls)  # the sender's exact state: no __init__ / __post_init__ re-run
        for name, value in data["fields"].items():
            object.__setattr__(obj, name, decode(value, types))
        return obj
    if "enum" in data:
        cls = types.get(data["enum"])
        if cls is None or not issubclass(cls, enum.Enum):
            raise ValueError(f"message names enum {data['enum']!r}, which is not part of SchedulerOutput")
        return cls(decode(data["value"], types))
    if "ndarray" in data:
        return np.asarray(data["ndarray"], dtype=np.dtype(data["dtype"])).reshape(data["shape"])
    if "tuple" in data:
        return tuple(decode(item, types) for item in data["tuple"])
    if "set" in data:
        return {decode(item, types) for item in data["set"]}
    if "dict" in data:
        return {decode(key, types): decode(value, types) for key, value in data["dict"]}
    raise ValueError(f"unknown node in message: keys {sorted(data)}")


# ---- the channel ----
def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">Q", len(payload)) + payload)


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket, max_bytes: int) -> bytes | None:
    """The next frame; None once the peer closed. ValueError for a frame over `max_bytes`."""
    header = _recv_exact(sock, 8)
    if header is None:
        return None
    size = struct.unpack(">Q", header)[0]
    if size > max_bytes:
        raise ValueError(f"the peer announced a message of {size} bytes, over the limit of {max_bytes}: it is not "
                         "a jaxserve process of this run, or the channel is corrupt; restart every process")
    return _recv_exact(sock, size)


def _hello_process_id(frame: bytes, token: bytes, num_processes: int) -> int:
    """The follower a hello comes from; ValueError unless it shows the token and a follower's process id."""
    message = json.loads(frame)
    process_id = message["process_id"]
    if type(process_id) is not int or not 0 < process_id < num_processes:
        raise ValueError(f"process_id {process_id!r} is not a follower of {num_processes} processes")
    if not hmac.compare_digest(bytes.fromhex(message["token"]), token):
        raise ValueError("wrong token")
    return process_id


class _Hello:
    """A connection to process 0 whose hello frame is still arriving (read without blocking)."""

    def __init__(self, sock: socket.socket, address):
        sock.setblocking(False)
        self.sock, self.address = sock, address
        self.expiry = time.monotonic() + HELLO_TIMEOUT_S
        self.data = bytearray()
        self.size: int | None = None  # of the frame, once its header arrived

    def read(self) -> bytes | None:
        """Takes what has arrived; the hello once whole, else None. ValueError for a closed connection or
        an oversized hello."""
        chunk = self.sock.recv((8 if self.size is None else 8 + self.size) - len(self.data))
        if not chunk:
            raise ValueError("closed before its hello")
        self.data += chunk
        if self.size is None and len(self.data) == 8:
            self.size = struct.unpack(">Q", self.data)[0]
            if self.size > HELLO_MAX_BYTES:
                raise ValueError(f"a hello of {self.size} bytes (at most {HELLO_MAX_BYTES})")
        return bytes(self.data[8:]) if self.size is not None and len(self.data) == 8 + self.size else None


class Channel:
    """Process 0 -> every other process: JSON messages over TCP. Process 0 sends; the others receive (and
    send back one report if they fail)."""

    def __init__(self, sockets: list[socket.socket], process_id: int):
        self.sockets = sockets
        self.process_id = process_id

    @classmethod
    def open(cls, parallel: ParallelConfig, timeout_s: float = CONNECT_TIMEOUT_S) -> Channel:
        host = parallel.coordinator_address.rpartition(":")[0]
        leader = parallel.process_id == 0
        server = socket.create_server((host, 0)) if leader else None
        secret = np.zeros(2 + TOKEN_BYTES, np.uint8)
        if leader:
            secret[:] = np.frombuffer(struct.pack(">H", server.getsockname()[1]) + secrets.token_bytes(TOKEN_BYTES),
                                      np.uint8)
        from jax.experimental import multihost_utils
        secret = np.asarray(multihost_utils.broadcast_one_to_all(secret)).astype(np.uint8).tobytes()
        port, token = struct.unpack(">H", secret[:2])[0], secret[2:]
        if leader:
            return cls(cls._accept(server, token, parallel.num_processes, timeout_s), 0)
        return cls([cls._connect(host, port, token, parallel.process_id, timeout_s)], parallel.process_id)

    @staticmethod
    def _accept(server: socket.socket, token: bytes, num_processes: int, timeout_s: float) -> list[socket.socket]:
        """The followers' connections, in process order. Hellos are read side by side, so a connection that
        sends nothing, garbage or too much is dropped without holding up the others."""
        followers: dict[int, socket.socket] = {}
        hellos: dict[socket.socket, _Hello] = {}
        deadline = time.monotonic() + timeout_s
        with server, selectors.DefaultSelector() as selector:

            def drop(hello: _Hello, reason: str) -> None:
                logger.warning("refused a connection from %s: not a process of this run (%s)", hello.address, reason)
                selector.unregister(hello.sock)
                del hellos[hello.sock]
                hello.sock.close()

            server.setblocking(False)
            selector.register(server, selectors.EVENT_READ)
            try:
                while len(followers) < num_processes - 1:
                    now = time.monotonic()
                    if now >= deadline:
                        raise TimeoutError(f"only {len(followers)} of {num_processes - 1} processes connected to "
                                           f"process 0 within {timeout_s:.0f} s; start every process with the "
                                           "same config")
                    for hello in [h for h in hellos.values() if h.expiry <= now]:
                        drop(hello, f"no hello within {HELLO_TIMEOUT_S:g} s")
                    wake = min([deadline, *(hello.expiry for hello in hellos.values())])
                    for key, _ in selector.select(max(wake - now, 0.001)):
                        if key.fileobj is server:
                            try:
                                hello = _Hello(*server.accept())
                            except (BlockingIOError, ConnectionAbortedError):
                                continue
                            hellos[hello.sock] = hello
                            selector.register(hello.sock, selectors.EVENT_READ)
                            continue
                        hello = hellos[key.fileobj]
                        try:
                            frame = hello.read()
                            if frame is None:
                                continue
                            process_id = _hello_process_id(frame, token, num_processes)
                            if process_id in followers:
                                raise ValueError(f"process {process_id} is already connected")
                        except Exception as err:  # whatever a peer sends, it must not stop the others joining
                            drop(hello, f"{type(err).__name__}: {err}")
                            continue
                        selector.unregister(hello.sock)
                        del hellos[hello.sock]
                        hello.sock.setblocking(True)
                        hello.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        followers[process_id] = hello.sock
            finally:
                for hello in hellos.values():
                    hello.sock.close()
        return [followers[i] for i in sorted(followers)]

    @staticmethod
    def _connect(host: str, port: int, token: bytes, process_id: int, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=10)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"process {process_id} could not reach process 0 at {host}:{port} within "
                                       f"{timeout_s:.0f} s") from None
                time.sleep(0.2)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send_frame(sock, json.dumps({"process_id": process_id, "token": token.hex()}).encode())
        return sock

    def send(self, message: dict[str, Any]) -> None:
        """Process 0: `message` to every follower; RuntimeError if one failed or is gone."""
        self._check_followers()
        payload = json.dumps(message, separators=(",", ":")).encode()
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"runner.{message['method']} makes a message of {len(payload) >> 20} MiB for the other "
                             f"processes, over the limit of {MAX_FRAME_BYTES >> 20} MiB; schedule fewer new requests "
                             "per step (lower scheduler.max_num_seqs or scheduler.max_num_batched_tokens)")
        for process_id, sock in enumerate(self.sockets, start=1):
            try:
                _send_frame(sock, payload)
            except OSError as err:
                raise RuntimeError(f"process {process_id} is gone ({err}); the multi-host engine cannot continue "
                                   "without it, restart every process") from None

    def _check_followers(self) -> None:
        """Raises the failure of a follower that sent its report or closed its connection (a follower sends
        nothing else, so any readable connection is one)."""
        poller = select.poll()
        for sock in self.sockets:
            poller.register(sock, select.POLLIN)
        for fd, _ in poller.poll(0):
            process_id, sock = next((i, sock) for i, sock in enumerate(self.sockets, start=1) if sock.fileno() == fd)
            sock.settimeout(1.0)
            try:
                report = _recv_frame(sock, REPORT_MAX_BYTES)
                error = json.loads(report)["error"] if report is not None else "it closed its connection"
            except (OSError, ValueError, KeyError, TypeError) as err:
                error = f"its connection broke ({err})"
            raise RuntimeError(f"process {process_id} failed: {error}; the multi-host engine cannot continue "
                               "without it, restart every process (see that process's log)")

    def recv(self) -> dict[str, Any] | None:
        """A follower: the next message from process 0; None once it closed the channel."""
        payload = _recv_frame(self.sockets[0], MAX_FRAME_BYTES)
        return None if payload is None else json.loads(payload)

    def report(self, error: str) -> None:
        """A follower: tells process 0 that it failed (best effort: process 0 may be gone already)."""
        try:
            _send_frame(self.sockets[0], json.dumps({"error": error[:4000]}).encode())  # < REPORT_MAX_BYTES
        except OSError:
            logger.warning("process %d could not report its failure to process 0", self.process_id)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets = []


# ---- leader and followers ----
class BroadcastingRunner:
    """Process 0's runner: each call that runs device code goes to the other processes first (so they
    enqueue the same SPMD step), then to the real runner. Everything else is the real runner's."""

    def __init__(self, runner, channel: Channel):
        self.runner = runner
        self.channel = channel
        # id(handle) -> (handle, number) of the dispatched steps not yet collected; holding the handle keeps
        # its id from being reused meanwhile.
        self._handles: dict[int, tuple[Any, int]] = {}
        self._numbers = itertools.count()

    def __getattr__(self, name: str):
        method = getattr(self.runner, name)
        if name not in BROADCAST_METHODS:
            return method

        def broadcast(*args, **kwargs):
            message = {"method": name, "args": [self._ref(a) for a in args],
                       "kwargs": {key: self._ref(value) for key, value in kwargs.items()}}
            number = next(self._numbers) if name in HANDLE_METHODS else None
            if number is not None:
                message["handle"] = number
            self.channel.send(message)
            result = method(*args, **kwargs)
            if number is not None:
                self._handles[id(result)] = (result, number)
            if name in RELEASE_METHODS:
                for value in (*args, *kwargs.values()):
                    self._handles.pop(id(value), None)
            return result

        return broadcast

    def _ref(self, value):
        entry = self._handles.get(id(value))
        return {"handle": entry[1]} if entry is not None else encode(value)


def _is_ref(value) -> bool:
    return isinstance(value, dict) and set(value) == {"handle"}


def follow(runner, channel: Channel) -> int:
    """A follower's loop: make process 0's runner calls on `runner` until it closes; returns the count. If a
    call fails, the error goes to process 0 (which raises it at its next call) and is raised here."""
    types = codec_types(SchedulerOutput)
    handles: dict[int, Any] = {}  # number -> handle of the dispatched steps not yet collected

    def resolve(value):
        return handles[value["handle"]] if _is_ref(value) else decode(value, types)

    calls = 0
    try:
        while (message := channel.recv()) is not None:
            name = message["method"]
            if name not in BROADCAST_METHODS:
                raise ValueError(f"process 0 asked for runner.{name}, which is not a step method")
            args, kwargs = message["args"], message["kwargs"]
            result = getattr(runner, name)(*[resolve(a) for a in args],
                                           **{key: resolve(value) for key, value in kwargs.items()})
            if "handle" in message:
                handles[message["handle"]] = result
            if name in RELEASE_METHODS:
                for value in (*args, *kwargs.values()):
                    if _is_ref(value):
                        del handles[value["handle"]]
            calls += 1
    except Exception as err:
        channel.report(f"{type(err).__name__}: {err} (after {calls} runner calls)")
        raise
    logger.info("process %d: process 0 closed the channel after %d steps", channel.process_id, calls)
    return calls
