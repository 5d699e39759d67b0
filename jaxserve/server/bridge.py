"""The async bridges between the HTTP event loop and the engine. EngineBridge: the engine loop in a thread of
this process, fed by the event loop (below); ProcessBridge: the engine in its own process (further below).

    event loop                                    engine thread (the only caller of engine mutators)
    ----------                                    -------------
    submit(prepared...) -> RequestGroup  --inbox (+ notify)-->  enqueue / abort
    group.abort()                         --inbox (+ notify)-->  abort_request
    abort_all() (drain timeout)           --inbox (+ notify)-->  abort_request(every tracked request)
                                                                 step() -> RequestOutputs
    RequestGroup queue  <--call_soon_threadsafe (one call per step)--  dispatch
    async for updates in group: {index: latest RequestOutput}

The engine thread sleeps on a condition while it has nothing to do (no busy spin). Outputs are
cumulative, so a consumer that falls behind reads only the latest output of each request: nothing is
lost. Admission: requests accepted but not yet producing tokens are "queued"; more than
`max_queued_requests` answer 429, and after `start_drain()` every new request answers 503.
An exception inside the engine fails every open request and marks the bridge dead (health 503).
The engine is any engine client (jaxserve/engine_client.py): an Engine, a DataParallelEngine
(parallel.data > 1), which routes the same calls to its replicas (an abort to the one holding the request),
or a PDEngine, whose `set_waker(fn)` hook lets its control threads wake an idle engine thread.

ProcessBridge: the same surface for an engine in its own process (ProcessEngineClient), with no engine
thread: the event loop enqueues and aborts itself (each a frame to the engine process), and the client's
reader thread hands each engine step's frame to the event loop, which rebuilds the outputs and delivers
them. One thread hop per direction, none of them waiting for a third thread's turn at the GIL.

    bridge.for_engine(engine, ...)  -> ProcessBridge for a ProcessEngineClient, else EngineBridge
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence

from jaxserve.engine_client import EngineClient, PreparedRequest
from jaxserve.engine_process import EngineProcessError
from jaxserve.outputs import RequestOutput
from jaxserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class AdmissionError(Exception):
    """The request was not accepted; `status` is 429 (queue full) or 503 (draining or engine dead)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(slots=True)
class _Tracked:
    """The bridge's state of one submitted request (the engine thread's; a ProcessBridge's event loop's)."""

    group: RequestGroup
    index: int
    # sequence index -> (generated tokens seen so far, when the latest of them reached the host)
    seen: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict)


class RequestGroup:
    """The requests of one HTTP call (several prompts, or one); iterate for {index: latest output}."""

    def __init__(self, bridge: EngineBridge, request_ids: list[str]):
        self.bridge = bridge
        self.request_ids = request_ids
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.unstarted = set(range(len(request_ids)))  # admitted, no token yet (counted as queued)
        self.unfinished = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        return not self.unfinished

    async def __aiter__(self) -> AsyncIterator[dict[int, RequestOutput]]:
        # NOTE: ends on the final outputs read here, not on `finished`: that is set when they are queued.
        remaining = set(range(len(self.request_ids)))
        while remaining:
            updates = {}
            index, item = await self.queue.get()
            while True:
                if isinstance(item, BaseException):
                    raise item
                updates[index] = item
                if item.finished:
                    remaining.discard(index)
                if self.queue.empty():
                    break
                index, item = self.queue.get_nowait()
            yield updates

    def abort(self) -> None:
        """Abort every request of the group that has not finished (idempotent; e.g. client gone)."""
        if self.unfinished:
            self.bridge.post_abort([self.request_ids[i] for i in self.unfinished])


class EngineBridge:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics, max_queued_requests: int):
        self.engine = engine
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.draining = False
        self.dead: BaseException | None = None
        # Event-loop state (touched only on the loop's thread).
        self.num_queued = 0
        self.num_in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None
        # Shared with the engine thread, under the condition's lock.
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, object]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None  # the engine thread, from start()
        # Engine-thread state.
        self._commands: collections.deque[tuple[str, object]] = collections.deque()  # taken from the inbox
        self._tracked: dict[str, _Tracked] = {}
        if hasattr(engine, "set_waker"):
            engine.set_waker(self.wake)

    # ---- event loop side ----
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Abort what is left, end the engine thread and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def check_admission(self, num_requests: int) -> None:
        """Raise AdmissionError unless `num_requests` more requests would be accepted now."""
        if self.dead is not None:
            raise AdmissionError(503, f"the engine failed and is not serving: {self.dead!r}")
        if self.draining:
            raise AdmissionError(503, "the server is shutting down and accepts no new requests; retry on another "
                                      "replica")
        if self.num_queued + num_requests > self.max_queued_requests:
            raise AdmissionError(429, f"the waiting queue is full ({self.num_queued} requests queued, "
                                      f"max_queued_requests={self.max_queued_requests}); retry later")

    def submit(self, prepared: Sequence[PreparedRequest]) -> RequestGroup:
        """Admit all of `prepared` or none (AdmissionError); outputs arrive on the returned group."""
        self.check_admission(len(prepared))
        group = RequestGroup(self, [p.request_id for p in prepared])
        self.num_queued += len(prepared)
        self.num_in_flight += len(prepared)
        self._idle.clear()
        self._accept(group, prepared)
        return group

    def _accept(self, group: RequestGroup, prepared: Sequence[PreparedRequest]) -> None:
        """The admitted requests to the engine: here, to the engine thread's inbox."""
        self._post([("add", (p, group, i)) for i, p in enumerate(prepared)])

    def post_abort(self, request_ids: list[str]) -> None:
        self._post([("abort", request_ids)])

    def _post(self, commands: list[tuple[str, object]]) -> None:
        with self._cond:
            self._inbox.extend(commands)
            self._cond.notify()

    def abort_all(self) -> None:
        """Abort every request in flight (the drain timed out): each ends with finish_reason "abort" and
        frees its KV blocks."""
        self._post([("abort_all", None)])

    def wake(self) -> None:
        """Have the engine thread look at the engine again (an engine client with work from another thread,
        e.g. a PD instance's control messages, calls this)."""
        with self._cond:
            self._cond.notify()

    def start_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` seconds passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def _deliver(self, batch: list[tuple[RequestGroup, int, RequestOutput | BaseException]]) -> None:
        for group, index, item in batch:
            group.queue.put_nowait((index, item))
            finished = isinstance(item, BaseException) or item.finished
            if index in group.unstarted and (finished or any(c.token_ids for c in item.outputs)):
                group.unstarted.discard(index)
                self.num_queued -= 1
            if finished and index in group.unfinished:
                group.unfinished.discard(index)
                self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    # ---- engine thread ----
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as err:  # noqa: BLE001 - any engine failure ends serving, loudly
            logger.exception("engine loop failed; failing every open request")
            self.dead = err
            self._fail_forever(RuntimeError(f"engine failed: {err!r}"))

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and not engine.has_unfinished_requests():
                    self._cond.wait()
                self._commands.extend(self._inbox)
                self._inbox = []
                stopping = self._stopping
            while self._commands:
                kind, payload = self._commands.popleft()
                if kind == "add":
                    self._add(*payload)
                elif kind == "abort":
                    engine.abort_request(payload)
                else:  # "abort_all"
                    engine.abort_request(list(self._tracked))
            if stopping:
                engine.abort_request(list(self._tracked))
            outputs = engine.step()
            self._dispatch(outputs)
            self.metrics.record_step(engine.stats())
            if stopping and not engine.has_unfinished_requests():
                return

    def _fail_forever(self, error: BaseException) -> None:
        """After an engine failure: fail every open request, then every new one, until stopped."""
        batch = [(t.group, t.index, error) for t in self._tracked.values()]
        self._tracked.clear()
        while True:
            batch += [(group, index, error) for kind, payload in self._commands if kind == "add"
                      for _, group, index in [payload]]
            self._commands.clear()
            if batch:
                self._hand_over(batch)
                batch = []
            with self._cond:
                while not self._inbox and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                self._commands.extend(self._inbox)
                self._inbox = []

    def _add(self, prepared: PreparedRequest, group: RequestGroup, index: int) -> None:
        try:
            self.engine.enqueue(prepared)
        except Exception as err:  # noqa: BLE001 - the request fails either way; only a ValueError is its own
            self._hand_over([(group, index, err)])
            if isinstance(err, ValueError):
                return
            raise
        self._tracked[prepared.request_id] = _Tracked(group, index)
        self.metrics.record_arrival(len(prepared.prompt_token_ids))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        now = time.monotonic()
        batch = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            is_first = not tracked.seen
            num_new = 0
            gaps = []  # (new tokens, seconds since the previous token) of each sequence that had tokens before
            for c in output.outputs:
                num_seen, previous_token_time = tracked.seen.get(c.index, (0, None))
                new = len(c.token_ids) - num_seen
                if new <= 0:
                    continue
                num_new += new
                if previous_token_time is not None:
                    gaps.append((new, now - previous_token_time))
                tracked.seen[c.index] = (len(c.token_ids), now)
            self.metrics.record_tokens(output, num_new, is_first, gaps)
            if output.finished:
                del self._tracked[output.request_id]
                self.metrics.record_finished(output)
            batch.append((tracked.group, tracked.index, output))
        if batch:
            self._hand_over(batch)

    def _hand_over(self, batch: list[tuple[RequestGroup, int, RequestOutput | BaseException]]) -> None:
        """Outputs (or errors) to their groups, from the engine thread."""
        self._loop.call_soon_threadsafe(self._deliver, batch)


class ProcessBridge(EngineBridge):
    """The bridge of a ProcessEngineClient: no engine thread (see the module docstring)."""

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        loop = self._loop
        self.engine.set_output_handler(lambda item: loop.call_soon_threadsafe(self._on_frame, item))

    def stop(self) -> None:
        """Aborts what is left (its groups end with an error) and stops taking the engine's frames."""
        self.engine.set_output_handler(None)
        if self._tracked and self.dead is None:
            with contextlib.suppress(Exception):  # (the engine process may be gone already)
                self.engine.abort_request(list(self._tracked))
        self._fail_open(RuntimeError("the server stopped before the request finished"))

    def _accept(self, group: RequestGroup, prepared: Sequence[PreparedRequest]) -> None:
        for i, p in enumerate(prepared):
            try:
                self._add(p, group, i)
            except EngineProcessError as err:  # the engine process is gone: every request fails
                self._engine_failed(err)
            except Exception:  # noqa: BLE001 - that request failed with it (_add delivered the error)
                logger.exception("sending request %s to the engine process failed", p.request_id)

    def post_abort(self, request_ids: list[str]) -> None:
        if self.dead is None:
            with contextlib.suppress(Exception):  # (gone: its end fails every request anyway)
                self.engine.abort_request(request_ids)

    def abort_all(self) -> None:
        self.post_abort(list(self._tracked))

    def wake(self) -> None:
        pass

    def _hand_over(self, batch: list[tuple[RequestGroup, int, RequestOutput | BaseException]]) -> None:
        self._deliver(batch)  # (already on the event loop)

    def _on_frame(self, item: dict | BaseException) -> None:
        if isinstance(item, BaseException):
            self._engine_failed(item)
            return
        try:
            # A request the engine refused fails with its ValueError, as the engine thread's enqueue would.
            refused = [(tracked.group, tracked.index, err) for request_id, err in self.engine.refusals(item)
                       if (tracked := self._tracked.pop(request_id, None)) is not None]
            self._dispatch(self.engine.outputs_of([item]))
            if refused:
                self._deliver(refused)
            if "stats" in item:
                self.metrics.record_step(self.engine.stats())
        except Exception as err:  # noqa: BLE001 - as an engine thread's failure: every open request fails
            logger.exception("taking the engine's outputs failed")
            self._engine_failed(err)

    def _engine_failed(self, err: BaseException) -> None:
        if self.dead is None:
            logger.error("the engine failed; failing every open request: %s", err)
            self.dead = err
        self._fail_open(RuntimeError(f"engine failed: {err!r}"))

    def _fail_open(self, error: BaseException) -> None:
        batch = [(t.group, t.index, error) for t in self._tracked.values()]
        self._tracked.clear()
        if batch:
            self._deliver(batch)


def for_engine(engine: EngineClient, metrics: ServerMetrics, max_queued_requests: int) -> EngineBridge:
    """The bridge for `engine`: a ProcessBridge for an engine in its own process, else an EngineBridge."""
    cls = ProcessBridge if hasattr(engine, "set_output_handler") else EngineBridge
    return cls(engine, metrics, max_queued_requests)
