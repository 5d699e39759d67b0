"""A prefill or decode instance: the engine, plus its side of KV transfers (an engine client, as Engine).

    router -> prefill instance: the request with signed kv_transfer_params {transfer_id, decode_address}
      enqueue:   max_tokens forced to 1 (n to 1); a "reserve" (the prompt's token ids) goes to the decode
                 instance on a sender thread while the prompt runs
      finished:  its output is held back; with the reply ("reserved": skip the first `skip` blocks, which the
                 decode instance has, and send `num_blocks`) the blocks are pinned (a lease), gathered, and
                 sent as a "ready" (server.kv_transfer_method: device -> the ready names chunks the decode
                 instance pulls from this one's transfer server, device_transfer.py; host -> the ready
                 carries their bytes); the decode side's "ack" frees the lease (no answer within
                 server.kv_transfer_timeout_s of the request's arrival: "timeout", the lease freed)
      resolved:  the output is released with stop_reason "kv_transfer:<outcome>" (sent | refused |
                 unreachable | failed | timeout | aborted), which the router reads
    router -> decode instance: the same request with the same kv_transfer_params
      control thread: reserve -> blocks reserved (or "refused"); ready -> blocks pulled or bytes read,
                 checked, scattered into the reserved blocks (paced: with requests running, about
                 server.kv_install_blocks_per_step blocks between two steps), registered in the prefix
                 cache -> "ack"; abort -> freed
      enqueue:   the request claims its READY transfer (same prompt): the blocks are its prefix-cache hit,
                 so it computes only the tail of its prompt; without one (transfer failed or timed out) it
                 prefills locally

Control messages are handled on the control server's threads but every block-pool change runs on the
engine thread (commands run at the start of step()), as the scheduler's do. Deadlines (reservations,
leases, transfers) are checked every step; an idle instance with open transfers steps every few ms.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.engine import Engine
from jaxserve.engine_client import EngineStats, PreparedRequest
from jaxserve.outputs import RequestOutput
from jaxserve.pd import protocol as proto
from jaxserve.pd.device_transfer import DeviceEndpoint, check_chunks
from jaxserve.pd.reservations import DecodeReservations, PrefillLeases, Refused
from jaxserve.pd.step_log import DecodeStepLog, DeviceWaits
from jaxserve.pd.transfer import BlockMover, TransferError, chunk_sizes, pack, unpack
from jaxserve.request import RequestStatus

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0  # one small control exchange (reserve, abort)
IDLE_WAIT_S = 0.005  # an idle instance with open transfers waits this long for news between steps
OUTCOME_PREFIX = "kv_transfer:"


@dataclasses.dataclass
class _Install:
    """A decode instance's transfer being written into its reserved blocks, piece by piece."""

    transfer_id: str
    targets: list[int]  # the reservation's blocks when queued: written only while it still holds them
    pieces: collections.deque  # (target block ids, device chunk or host blocks [c, L, *block]), in order
    done: concurrent.futures.Future  # -> the answer to the "ready": ("ack", {}) or ("nack", {...})


@dataclasses.dataclass
class _Outgoing:
    """A prefill instance's transfer of one request."""

    transfer_id: str
    decode_address: str
    request_id: str
    token_ids: list[int]
    cache_salt: str | None
    deadline: float
    reserve: concurrent.futures.Future | None = None
    send: concurrent.futures.Future | None = None
    output: RequestOutput | None = None  # the finished output, held back until the transfer resolves
    outcome: str | None = None
    offered: list | None = None  # the device path's registered chunks, referenced until the transfer resolves


def refuse_unsupported(config: EngineConfig, engine: Engine) -> None:
    parallel = config.parallel
    reasons = [why for bad, why in [
        (not config.cache.enable_prefix_caching, "cache.enable_prefix_caching: false (transferred blocks are "
                                                 "installed as prefix-cache hits)"),
        (parallel.data > 1 or parallel.expert > 1 or parallel.num_processes > 1,
         "parallel.data, parallel.expert or parallel.num_processes > 1"),
        (not isinstance(engine.kv_cache, KVCacheManager), "a sharded KV cache"),
        (config.speculative.uses_model,
         f"speculative.method: {config.speculative.method} (only the target's KV travels between instances, so "
         f"the draft's would be missing for every transferred prompt; ngram speculation works)")] if bad]
    if reasons:
        raise ValueError(f"server.pd_role={config.server.pd_role} is not supported with {', '.join(reasons)}; "
                         f"change those settings or run colocated (pd_role: null)")


class PDEngine:
    """`engine` in the role config.server.pd_role; implements engine_client.EngineClient."""

    def __init__(self, engine: Engine, config: EngineConfig):
        server = config.server
        refuse_unsupported(config, engine)
        self.engine = engine
        self.role = server.pd_role
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.sampling_defaults = engine.sampling_defaults
        self.key = proto.derive_key(server.kv_transfer_token)
        self.timeout_s = server.kv_transfer_timeout_s
        self.block_size = config.cache.block_size
        self.mover = BlockMover(engine.runner)
        self.method = server.kv_transfer_method
        self.install_blocks_per_step = server.kv_install_blocks_per_step
        self._installs: collections.deque[_Install] = collections.deque()  # engine thread only
        if config.runner.precompile:
            engine.num_compiled += self.mover.warm(
                -(-self.max_model_len // self.block_size), gather=self.role == "prefill",
                scatter=self.role == "decode")
        self._transfer_host = proto.split_address(server.kv_transfer_address)[0]
        self._endpoint: DeviceEndpoint | None = None
        self._endpoint_lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()  # transfer outcomes (and decode events)
        self._cond = threading.Condition()
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._notified = False
        self._wake: Callable[[], None] = lambda: None
        self.kv_transfer_address: str | None = None
        self.step_log = DecodeStepLog()
        self._install_s = 0.0  # seconds the engine thread spent installing blocks (decode)
        self._install_pieces = 0  # install programs dispatched (decode)
        self._pulls = 0  # pulls from prefill instances in flight, and started (decode, control threads)
        self._pulls_started = 0
        self._pull_lock = threading.Lock()
        self._logged = (0, 0.0, 0)  # (install pieces, install seconds, pulls started) at the last logged step
        self._device_waits = DeviceWaits()
        if self.role == "decode":
            proto.check_bind(server.kv_transfer_address, server.kv_transfer_token)
            self.reservations = DecodeReservations(engine.kv_cache, hold_s=self.timeout_s)
            engine.add_observer(self._device_waits)
            self.control = proto.ControlServer(
                server.kv_transfer_address, self.key, self._on_message, timeout_s=self.timeout_s,
                max_payload_bytes=engine.runner.num_blocks * self.mover.block_bytes).start()
            self.kv_transfer_address = self.control.address
        else:
            self.leases = PrefillLeases(engine.kv_cache)
            self._transfers: dict[str, _Outgoing] = {}  # by request id
            self._released: list[RequestOutput] = []
            self._senders = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="jaxserve-pd-send")
            # aborts are best effort (a reservation expires on its own) and may wait CONTROL_TIMEOUT_S on a
            # busy decode instance: their own threads, so that they never hold up a live transfer's reserve
            self._aborts = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxserve-pd-abort")
            if self.method == "device":  # started now: a backend without transfer support fails at start
                self._device_endpoint()

    # ---- the engine client surface ----
    def prepare_request(self, *args, **kwargs) -> PreparedRequest:
        return self.engine.prepare_request(*args, **kwargs)

    def add_request(self, prompt, params=None, **kwargs) -> str:
        prepared = self.prepare_request(prompt, params, **kwargs)
        self.enqueue(prepared)
        return prepared.request_id

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def num_free_blocks(self) -> int:
        return self.engine.kv_cache.num_free_blocks

    @property
    def num_open_transfers(self) -> int:
        return len(self.reservations) if self.role == "decode" else len(self._transfers)

    def info(self) -> dict:
        """GET /pd/info's body (jaxserve/pd/serve.py)."""
        return {"role": self.role, "kv_transfer_address": self.kv_transfer_address, "block_size": self.block_size,
                "kv_layout": self.mover.layout, "num_free_blocks": self.num_free_blocks,
                "open_transfers": self.num_open_transfers, "outcomes": dict(self.counts)} | (
            {"steps": self.step_log.summary()} if self.role == "decode" else {})

    def set_waker(self, wake: Callable[[], None]) -> None:
        """`wake()` makes the engine's driver call step() again (the server bridge's)."""
        self._wake = wake

    def accept_kv_transfer_params(self, prepared: PreparedRequest, params: Any, index: int) -> None:
        """Checks the router's signed kv_transfer_params (ValueError naming what is wrong) and binds prompt
        `index`'s transfer to `prepared`; a prefill instance computes one token."""
        proto.bind_transfer(prepared, params, index, self.key, self.role)

    def enqueue(self, prepared: PreparedRequest) -> None:
        transfer = prepared.kv_transfer_params
        if transfer is None:
            self.engine.enqueue(prepared)
            return
        if self.role == "decode":
            n = prepared.params.n
            first = prepared.request_id if n == 1 else f"0_{prepared.request_id}"
            claimed = self.reservations.claim(transfer["transfer_id"], first, prepared.prompt_token_ids,
                                              prepared.cache_salt)
            self.counts["claimed" if claimed else "recomputed"] += 1
            self.engine.enqueue(prepared)
            return
        self.engine.enqueue(prepared)
        out = _Outgoing(transfer["transfer_id"], transfer["decode_address"], prepared.request_id,
                        list(prepared.prompt_token_ids), prepared.cache_salt, time.monotonic() + self.timeout_s)
        self._transfers[prepared.request_id] = out
        out.reserve = self._senders.submit(self._send_reserve, out)
        out.reserve.add_done_callback(lambda _: self._notify())

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine.abort_request(ids)
        if self.role == "prefill":
            for request_id in ids:
                out = self._transfers.get(request_id)
                if out is not None and out.outcome is None:
                    self._resolve(out, "aborted", tell_decode=True)

    def has_unfinished_requests(self) -> bool:
        if self.engine.has_unfinished_requests() or self._commands or self._installs:
            return True
        return bool(self.reservations) if self.role == "decode" else bool(self._transfers or self._released)

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        started, started_cpu, waited = time.perf_counter(), time.thread_time(), self._device_waits.seconds
        pulling = self._pulls > 0
        self._run_commands()
        if self.role == "decode":
            self._advance_installs()
            self.reservations.expire()
            self.reservations.release_claims(self._waiting)
        else:
            self._advance()
        if not self.engine.has_unfinished_requests():
            self._idle_wait()
            outputs = []
        else:
            outputs = self.engine.step(final_only)
            if self.role == "decode":
                self._log_step(time.perf_counter() - started, pulling, time.thread_time() - started_cpu,
                               self._device_waits.seconds - waited)
        if self.role == "prefill":
            outputs = self._hold_finished(outputs)
            self._advance()
            outputs += self._released
            self._released = []
        return outputs

    def close(self) -> None:
        if self.role == "decode":
            self.control.close()
        else:
            self._senders.shutdown(wait=False, cancel_futures=True)
            self._aborts.shutdown(wait=False, cancel_futures=True)

    def _log_step(self, seconds: float, pulling: bool, cpu_seconds: float, wait_seconds: float) -> None:
        """Adds a decode step to step_log, with the install pieces written and pulls since the last logged
        step (an idle step's install is scattered before the next step's forward)."""
        logged = self._logged
        now = (self._install_pieces, self._install_s, self._pulls_started)
        self.step_log.add(seconds, now[1] - logged[1], now[0] - logged[0],
                          pulling or self._pulls > 0 or now[2] != logged[2], cpu_seconds, wait_seconds)
        self._logged = now

    # ---- engine-thread plumbing ----
    def _notify(self) -> None:
        with self._cond:
            self._notified = True
            self._cond.notify_all()
        self._wake()

    def _idle_wait(self) -> None:
        with self._cond:
            if not self._notified and not self._commands:
                self._cond.wait(IDLE_WAIT_S)
            self._notified = False

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Runs `fn` on the engine thread (at its next step) and returns its result (control threads)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._commands.append((fn, future))
        self._notify()
        return future.result(timeout=self.timeout_s)

    def _run_commands(self) -> None:
        while self._commands:
            with self._cond:
                fn, future = self._commands.popleft()
            try:
                future.set_result(fn())
            except Exception as err:  # noqa: BLE001 - the control thread answers the peer with it
                future.set_exception(err)

    def _waiting(self, request_id: str) -> bool:
        request = self.engine.scheduler.requests.get(request_id)
        return request is not None and request.status == RequestStatus.WAITING

    # ---- decode side: control messages ----
    def _on_message(self, header: dict, payload: bytes) -> tuple[str, dict]:
        kind, transfer_id = header["type"], header["transfer_id"]
        if kind == "reserve":
            tokens, salt = header.get("token_ids"), header.get("cache_salt")
            if (not isinstance(tokens, list) or not tokens or len(tokens) > self.max_model_len
                    or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in tokens)
                    or not (salt is None or isinstance(salt, str))):
                return "refused", {"reason": "reserve needs token_ids (in vocabulary, at most max_model_len) "
                                             "and cache_salt (a string or null)"}
            if header.get("layout") != self.mover.layout:
                return "refused", {"reason": f"KV layout mismatch: sender {header.get('layout')}, this instance "
                                             f"{self.mover.layout}; run the same model, dtype and block size"}
            timeout = min(float(header.get("timeout_s", self.timeout_s)), self.timeout_s)
            return self._call(lambda: self._reserve(transfer_id, tokens, salt, timeout))
        if kind == "ready":
            with self._pull_lock:
                self._pulls += 1
                self._pulls_started += 1
            try:
                data = self._receive(header, payload)
            except (TransferError, ValueError, TypeError) as err:
                self._call(lambda: self.reservations.abort(transfer_id))
                self.counts["failed"] += 1
                return "nack", {"reason": str(err)}
            finally:
                with self._pull_lock:
                    self._pulls -= 1
            try:
                return self._call(lambda: self._install(transfer_id, data)).result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:  # the reservation's expiry drops the install on its own
                self.counts["failed"] += 1
                return "nack", {"reason": "the blocks were not installed in time"}
        if kind == "abort":
            return "ack", {"aborted": self._call(lambda: self.reservations.abort(transfer_id))}
        return "nack", {"reason": f"a decode instance does not take {kind!r} messages"}

    def _receive(self, header: dict, payload: bytes):
        """A "ready" message's blocks: pulled device to device when it names a pull, else its payload's bytes."""
        count, pull = int(header.get("num_blocks", -1)), header.get("pull")
        if pull is None:
            return unpack(payload, count, header.get("layout"), self.mover.layout)
        unpack(b"", 0, header.get("layout"), self.mover.layout)  # the layout check
        if not isinstance(pull, dict) or not isinstance(pull.get("address"), str) or not isinstance(pull.get("uuid"), int):
            raise TransferError(f"a malformed pull: {pull!r}")
        proto.split_address(pull["address"])
        chunks = check_chunks(pull.get("chunks"), count)
        timeout = min(float(header.get("timeout_s", self.timeout_s)), self.timeout_s)
        return self._device_endpoint().pull(pull["address"], pull["uuid"], chunks, self.mover.block_shape,
                                            self.mover.dtype, time.monotonic() + timeout)

    def _device_endpoint(self) -> DeviceEndpoint:
        """This instance's transfer server, started on first use (a decode instance serving host-path
        transfers only never starts one)."""
        with self._endpoint_lock:
            if self._endpoint is None:
                self._endpoint = DeviceEndpoint(self.mover.first_device, self._transfer_host)
            return self._endpoint

    def _reserve(self, transfer_id: str, tokens: list[int], salt: str | None, timeout: float) -> tuple[str, dict]:
        try:
            reservation = self.reservations.reserve(transfer_id, tokens, salt, timeout)
        except Refused as err:
            self.counts["refused"] += 1
            return "refused", {"reason": str(err)}
        return "reserved", {"skip": reservation.skip, "num_blocks": len(reservation.target_ids)}

    def _install(self, transfer_id: str, data) -> concurrent.futures.Future:
        """Queues a ready transfer's blocks for writing (_advance_installs); -> the future of its answer."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        targets = self.reservations.targets(transfer_id)
        if targets is None or any(job.transfer_id == transfer_id for job in self._installs):
            self.counts["late"] += 1
            done.set_result(("nack", {"reason": "unknown, expired or already installed transfer"}))
            return done
        count = sum(len(chunk) for chunk in data) if isinstance(data, list) else len(data)
        if len(targets) != count:
            self.reservations.abort(transfer_id)
            self.counts["failed"] += 1
            done.set_result(("nack", {"reason": f"{count} blocks sent for {len(targets)} reserved"}))
            return done
        pieces = collections.deque(BlockMover.pieces(targets, data))
        self._installs.append(_Install(transfer_id, targets, pieces, done))
        return done

    def _advance_installs(self) -> None:
        """Writes queued pieces into their reserved blocks, oldest transfer first: with requests running
        (and a limit), pieces until about install_blocks_per_step blocks (at least one piece); else all. A
        transfer whose last piece is written is registered and acked; one whose reservation ended meanwhile
        (expired, aborted) is dropped before another piece is written into blocks it no longer holds."""
        at_once = not self.engine.has_unfinished_requests() or not self.install_blocks_per_step
        budget, written = (float("inf") if at_once else self.install_blocks_per_step), 0
        while self._installs and (written < budget or not self._installs[0].pieces):
            job = self._installs[0]
            if self.reservations.targets(job.transfer_id) != job.targets:
                self._installs.popleft()
                self.counts["late"] += 1
                job.done.set_result(("nack", {"reason": "the reservation expired or was aborted while its "
                                                        "blocks were written"}))
                continue
            if job.pieces:
                ids, chunk = job.pieces.popleft()
                started = time.perf_counter()
                try:
                    self.mover.scatter_piece(ids, chunk)
                except Exception as err:  # noqa: BLE001 - (device memory, XLA) this transfer fails, not the engine
                    if any(cache.is_deleted() for cache in self.mover.runner.kv_caches):
                        raise  # the donated caches are gone: nothing can serve any more
                    logger.warning("PD: installing transfer %s failed: %s", job.transfer_id, err)
                    self._installs.popleft()
                    self.reservations.abort(job.transfer_id)
                    self.counts["failed"] += 1
                    job.done.set_result(("nack", {"reason": f"installing the blocks failed: {err}"}))
                    continue
                self._install_s += time.perf_counter() - started
                self._install_pieces += 1
                written += len(ids)
            if not job.pieces:
                self._installs.popleft()
                self.reservations.mark_ready(job.transfer_id)
                self.counts["installed"] += 1
                job.done.set_result(("ack", {}))

    # ---- prefill side: outgoing transfers ----
    def _send_reserve(self, out: _Outgoing) -> dict:
        remaining = out.deadline - time.monotonic()
        if remaining <= 0:  # (a sender thread busy past the deadline: nothing was sent)
            raise proto.ProtocolError(f"transfer {out.transfer_id}: its deadline passed before the reserve was sent")
        message = proto.encode(self.key, "reserve", out.transfer_id, token_ids=out.token_ids,
                               cache_salt=out.cache_salt, timeout_s=remaining, layout=self.mover.layout)
        return proto.request(out.decode_address, self.key, message, min(remaining, CONTROL_TIMEOUT_S))

    def _send_ready(self, out: _Outgoing, gathered, count: int) -> dict:
        remaining = out.deadline - time.monotonic()
        if self.method == "device" and count:
            pull = {"address": self._device_endpoint().address, "uuid": self._device_endpoint().offer(gathered),
                    "chunks": [len(chunk) for chunk in gathered]}
            message = proto.encode(self.key, "ready", out.transfer_id, num_blocks=count, layout=self.mover.layout,
                                   pull=pull, timeout_s=remaining)
        else:
            payload = pack(gathered) if count else b""
            message = proto.encode(self.key, "ready", out.transfer_id, payload, num_blocks=count,
                                   layout=self.mover.layout)
        return proto.request(out.decode_address, self.key, message, max(1e-3, out.deadline - time.monotonic()))

    def _send_abort(self, out: _Outgoing) -> None:
        def send():
            try:
                proto.request(out.decode_address, self.key, proto.encode(self.key, "abort", out.transfer_id),
                              CONTROL_TIMEOUT_S)
            except (OSError, proto.ProtocolError) as err:  # its reservation expires on its own
                logger.info("PD: abort of transfer %s not delivered: %s", out.transfer_id, err)
        self._aborts.submit(send)

    def _hold_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        kept = []
        for output in outputs:
            out = self._transfers.get(output.request_id)
            if out is None or not output.finished:
                kept.append(output)
            elif out.outcome is not None:
                self._release(out, output)
            else:
                out.output = output
        return kept

    def _advance(self) -> None:
        now = time.monotonic()
        for out in list(self._transfers.values()):
            if out.outcome is not None:
                continue
            if now >= out.deadline:
                self._resolve(out, "timeout", tell_decode=True)
            elif out.send is not None:
                if out.send.done():
                    self._finish_send(out)
            elif out.output is not None and out.reserve.done():
                self._start_send(out)

    def _start_send(self, out: _Outgoing) -> None:
        try:
            reply = out.reserve.result()
        except (OSError, proto.ProtocolError) as err:
            # No connection: the instance is gone ("unreachable"); connected but no answer in time: "timeout".
            timed_out = isinstance(err, (proto.ProtocolError, TimeoutError))
            logger.warning("PD: decode instance %s %s for transfer %s: %s", out.decode_address,
                           "did not answer" if timed_out else "unreachable", out.transfer_id, err)
            self._resolve(out, "timeout" if timed_out else "unreachable", tell_decode=timed_out)
            return
        except Exception:  # noqa: BLE001 - a sender's failure ends its transfer, never the engine
            logger.exception("PD: the reserve of transfer %s failed", out.transfer_id)
            self._resolve(out, "failed", tell_decode=True)
            return
        if reply["type"] == "refused":
            logger.info("PD: decode instance %s refused transfer %s: %s", out.decode_address, out.transfer_id,
                        reply.get("reason"))
            self._resolve(out, "refused", tell_decode=False)
            return
        if reply["type"] != "reserved":
            self._resolve(out, "failed", tell_decode=True)
            return
        if out.output.outputs and out.output.outputs[0].finish_reason == "abort":
            self._resolve(out, "aborted", tell_decode=True)
            return
        skip, count = int(reply.get("skip", 0)), int(reply.get("num_blocks", -1))
        ids = self.leases.pin(out.transfer_id, out.token_ids, out.cache_salt, skip, out.deadline - time.monotonic())
        if ids is None or len(ids) != count:
            self._resolve(out, "failed", tell_decode=True)
            return
        gathered = self.mover.gather_chunks(ids, chunk_sizes(len(ids))) if ids else None
        if self.method == "device":
            out.offered = gathered
        out.send = self._senders.submit(self._send_ready, out, gathered, count)
        out.send.add_done_callback(lambda _: self._notify())

    def _finish_send(self, out: _Outgoing) -> None:
        try:
            reply = out.send.result()
        except (OSError, proto.ProtocolError) as err:
            logger.warning("PD: sending transfer %s to %s failed: %s", out.transfer_id, out.decode_address, err)
            self._resolve(out, "failed", tell_decode=True)
            return
        except Exception:  # noqa: BLE001 - a sender's failure ends its transfer, never the engine
            logger.exception("PD: sending transfer %s failed", out.transfer_id)
            self._resolve(out, "failed", tell_decode=True)
            return
        if reply["type"] == "ack":
            self._resolve(out, "sent", tell_decode=False)
        else:
            logger.warning("PD: decode instance %s did not take transfer %s: %s", out.decode_address,
                           out.transfer_id, reply.get("reason"))
            self._resolve(out, "failed", tell_decode=True)

    def _resolve(self, out: _Outgoing, outcome: str, tell_decode: bool) -> None:
        """The transfer's end: the lease freed, the decode side told to free its reservation (best effort;
        it expires on its own), and the held output released."""
        out.outcome = outcome
        out.offered = None
        self.counts[outcome] += 1
        self.leases.release(out.transfer_id)
        if tell_decode:
            self._send_abort(out)
        if out.output is not None:
            self._release(out, out.output)

    def _release(self, out: _Outgoing, output: RequestOutput) -> None:
        for completion in output.outputs:
            completion.stop_reason = OUTCOME_PREFIX + out.outcome
        self._released.append(output)
        del self._transfers[out.request_id]
