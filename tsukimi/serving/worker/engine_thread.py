"""The engine thread of a worker (tsukimi/serving/worker/server.py): the one thread that owns an
`LLMEngine`, and the channel between it and the HTTP side's asyncio event loop.

    event loop                                   engine thread (the only one touching the engine)
    submit(AddCommand)   -> inbox -------------> engine.add_request -> Verdict (accepted, or
                                                  the error that refused it)
    RequestStream.queue  <- call_soon_threadsafe  engine.step() outputs (StepOutput), or a
                                                  Verdict with the error that ends the request
    submit(AbortCommand) -> inbox -------------> engine.abort
    EngineThread.load    <- Load, published after every iteration
    submit(PauseCommand) -> inbox -------------> drain, then action(engine) (a live weight
                                                  update), then resume; `done` resolves

A pause (tsukimi/serving/worker/weight_update.py) stops admitting: requests arriving meanwhile are
held (not yet accepted) and are applied after the action, so they run on what it changed;
the requests already in the engine run to their end first (so they never mix two weights),
and those still running at `drain_timeout_s` end with WorkerUnavailable (vLLM's
`pause_generation`, waiting for in-flight requests, with a bound).

A failing step fails only the request that made it fail: the engine is replaced (its state may
be inconsistent), each request is stepped alone to find the culprit, which ends with the error,
and the others go on where they stopped (tsukimi/serving/worker/step_isolation.py). The thread keeps
serving. Closing fails every unfinished request. Engines come from `make_engine`, the worker's
engine factory (tsukimi/serving/worker/engine_factory.py: fault tests give it one whose step fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from tsukimi.clock import WallClock
from tsukimi.engine.engine import LLMEngine, StepOutput
from tsukimi.engine.sampling import SamplingParams
from tsukimi.errors import ClosedError, InvalidArgument, TsukimiError, WorkerError, WorkerUnavailable
from tsukimi.serving.kv_events import KvEventPublisher
from tsukimi.serving.protocol import Load
from tsukimi.serving.worker.step_isolation import Admitted, find_culprits, resume

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A request's first event: accepted (`error` None; on `weights_version`) or the error
    that refused it (InvalidArgument, DuplicateRequest, WorkerUnavailable); later, the error
    that ends it."""

    error: TsukimiError | None = None
    weights_version: str = ""


EngineEvent = StepOutput | Verdict


@dataclass(slots=True)
class RequestStream:
    """One request's channel from the engine thread to the event loop."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineEvent]
    prompt_tokens: int
    started: bool = False  # engine side: a first output was produced
    finished: bool = False  # loop side: the last line was read

    def send(self, event: EngineEvent) -> None:
        """Thread-safe; a closed loop means nobody listens any more."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


@dataclass(frozen=True, slots=True)
class AddCommand:
    """Add a request; the engine thread answers with a `Verdict` on its stream. A request
    with a `weights_version` other than the engine's is refused (WorkerUnavailable)."""

    prompt: tuple[int, ...]
    params: SamplingParams
    stream: RequestStream
    weights_version: str = ""


@dataclass(frozen=True, slots=True)
class AbortCommand:
    """Abort the stream's request (its client went away); ignored once it finished."""

    stream: RequestStream


@dataclass(frozen=True, slots=True)
class PauseCommand:
    """Run `action` on the drained engine (on the engine thread; see the module); `done` gets
    its outcome (None or its exception, ClosedError when the worker shuts down first)."""

    action: Callable[[LLMEngine], None]
    done: Future[None]
    drain_timeout_s: float = 30.0


Command = AddCommand | AbortCommand | PauseCommand


class WorkerMetrics:
    """The worker's Prometheus metrics, in a registry of its own (tests run several workers)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.waiting = Gauge("tsukimi_worker_waiting_requests", "Requests accepted, no token yet", registry=r)
        self.running = Gauge("tsukimi_worker_running_requests", "Requests producing tokens", registry=r)
        self.free_blocks = Gauge("tsukimi_worker_free_kv_blocks", "KV cache blocks free or reusable", registry=r)
        self.requests = Counter("tsukimi_worker_requests", "Finished requests", ["finish_reason"], registry=r)
        self.generated = Counter("tsukimi_worker_generated_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("tsukimi_worker_prompt_tokens", "Prompt tokens received", registry=r)
        self.pool = Counter("tsukimi_worker_pool_prompt_tokens", "Prompt tokens with KV from the pool", registry=r)
        self.local = Counter("tsukimi_worker_local_prompt_tokens", "Prompt tokens with KV cached here", registry=r)

    def record(self, out: StepOutput, stream: RequestStream) -> None:
        """Account one engine output (from the engine thread)."""
        if not stream.started:
            self.prompt.inc(stream.prompt_tokens)
            self.pool.inc(out.pool_tokens)
            self.local.inc(out.cached_tokens - out.pool_tokens)
        self.generated.inc(len(out.token_ids))
        if out.finish_reason is not None:
            self.requests.labels(out.finish_reason).inc()


class EngineThread:
    """The one thread that owns an `LLMEngine`: takes commands from an inbox, steps the engine
    while it has work, sleeps on a condition otherwise, and routes outputs to their streams.

    A failing step fails the request that made it fail, and no other (see the module).
    """

    def __init__(
        self,
        make_engine: Callable[[], LLMEngine],
        metrics: WorkerMetrics,
        threads: int,
        name: str,
        events: KvEventPublisher | None = None,
    ) -> None:
        self._make_engine, self._metrics, self._threads, self._events = make_engine, metrics, threads, events
        self._engine = self._new_engine()
        self._cond = threading.Condition()
        self._inbox: deque[Command] = deque()
        self._active: dict[str, RequestStream] = {}
        self._admitted: dict[str, Admitted] = {}  # NOTE: the same keys as _active: to resume them
        self._blameless = False  # a failed step's probe found no culprit, and no step succeeded since
        self._held: deque[AddCommand] = deque()  # arrived while a pause waits
        self._pause: PauseCommand | None = None
        self._pause_deadline = 0.0
        self._clock = WallClock()
        self._stopping = False
        self.weights_version = "initial"  # NOTE: set by a pause's action (a live weight update)
        self.load = Load(0, 0, self._engine.cache.pool.num_free, self._engine.cache.pool.num_blocks)
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: Command) -> None:
        """Queue a command for the engine thread (thread-safe). Raises ClosedError once closing."""
        with self._cond:
            if self._stopping:
                raise ClosedError("the worker is shutting down")
            self._inbox.append(command)
            self._cond.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the current step; every unfinished request ends with an error. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("engine thread %s did not stop within %.1f s", self._thread.name, timeout_s)

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        while (commands := self._next_commands()) is not None:
            for command in commands:
                self._route(command)
            if self._engine.has_work():
                self._guarded(self._step, probe=True)
            if self._pause is not None:
                self._try_pause(self._pause)
            self._publish()
        self._shut_down()

    def _route(self, command: Command) -> None:
        """Apply `command` now, or hold or start a pause (see the module)."""
        if isinstance(command, PauseCommand):
            if self._pause is not None:
                command.done.set_exception(InvalidArgument("another pause of the engine is under way"))
                return
            self._pause, self._pause_deadline = command, self._clock.now() + command.drain_timeout_s
            logger.info("pausing: draining %d requests", len(self._active))
        elif isinstance(command, AddCommand) and self._pause is not None:
            self._held.append(command)
        else:
            if isinstance(command, AbortCommand):  # NOTE: a held request whose client went away
                self._held = deque(held for held in self._held if held.stream is not command.stream)
            self._guarded(self._apply, command)

    def _try_pause(self, pause: PauseCommand) -> None:
        """Run the pause's action once the engine is drained (or its drain timed out), then
        apply the requests held meanwhile."""
        if self._engine.has_work():
            if self._clock.now() < self._pause_deadline:
                return
            logger.warning(
                "pausing: %d requests still running after %.1f s: failing them",
                len(self._active),
                pause.drain_timeout_s,
            )
            self._fail_all(WorkerUnavailable("aborted: the worker paused for a weight update"))
        self._pause = None
        try:
            pause.action(self._engine)
        except Exception as exc:  # NOTE: the caller owns the outcome: it gets the error
            pause.done.set_exception(exc)
        else:
            pause.done.set_result(None)
        held, self._held = self._held, deque()
        logger.info("resuming with %d requests that arrived during the pause", len(held))
        for command in held:
            self._guarded(self._apply, command)

    def _shut_down(self) -> None:
        closing = WorkerUnavailable("the worker is shutting down")
        self._fail_all(closing)
        for command in self._held:
            command.stream.send(Verdict(closing))
        if self._pause is not None:
            self._pause.done.set_exception(ClosedError("the worker shut down before the pause"))

    def _next_commands(self) -> list[Command] | None:
        """Sleep until there is something to do; the commands queued, or None when stopping."""
        with self._cond:
            while not (self._inbox or self._stopping or self._engine.has_work()):
                self._cond.wait()
            commands = list(self._inbox)
            self._inbox.clear()
        if not self._stopping:
            return commands
        for command in commands:
            if isinstance(command, AddCommand):
                command.stream.send(Verdict(WorkerUnavailable("the worker is shutting down")))
            elif isinstance(command, PauseCommand):
                command.done.set_exception(ClosedError("the worker is shutting down"))
        return None

    def _guarded(self, action: Callable[..., None], *args: AddCommand | AbortCommand, probe: bool = False) -> None:
        try:
            action(*args)
        except Exception as exc:  # NOTE: recover with the cause instead of dying silently
            logger.exception("the engine failed with %d requests in it", len(self._active))
            self._recover(exc, probe)

    def _recover(self, exc: Exception, probe: bool) -> None:
        """After a failed step (`probe`: find its culprits) or command (the request concerned
        already has its error): a fresh engine where the others go on (see the module)."""
        error = WorkerError(f"the engine failed: {type(exc).__name__}: {exc}")
        culprits: dict[str, Exception] = {}
        if probe and self._blameless:  # NOTE: no culprit last time, and it failed again at once
            self._engine = self._fresh_engine()
            self._fail_all(error)
            return
        if probe:
            culprits, self._engine = find_culprits(self._fresh_engine, self._admitted)
        else:
            self._engine = self._fresh_engine()
        for rid, cause in culprits.items():
            self._end(rid, WorkerError(f"the engine failed on this request: {type(cause).__name__}: {cause}"))
        self._blameless = probe and not culprits
        try:
            resume(self._engine, self._admitted)
        except Exception:  # NOTE: the fresh engine refuses what it took before: give up on them
            logger.exception("resuming %d requests failed: failing them", len(self._admitted))
            self._engine = self._fresh_engine()
            self._fail_all(error)
        else:
            logger.warning("%d requests failed the engine, %d go on", len(culprits), len(self._admitted))

    def _fresh_engine(self) -> LLMEngine:
        """A new engine in place of one whose state may be inconsistent (the router's prefix index
        hears that this cache is empty)."""
        engine = self._new_engine()
        if self._events is not None:
            self._events.clear()
        return engine

    def _new_engine(self) -> LLMEngine:
        """A fresh engine whose block pool journals its cache changes when events are published."""
        engine = self._make_engine()
        if self._events is not None:
            engine.cache.pool.journal = []
        return engine

    def _end(self, rid: str, error: TsukimiError) -> None:
        """End a request with `error` (it is no longer in the engine)."""
        stream = self._active.pop(rid)
        del self._admitted[rid]
        self._metrics.requests.labels("abort").inc()
        stream.send(Verdict(error))

    def _apply(self, command: AddCommand | AbortCommand) -> None:
        stream = command.stream
        rid = stream.request_id
        if isinstance(command, AbortCommand):
            if self._active.get(rid) is stream:  # NOTE: not a later request that reuses the id
                del self._active[rid], self._admitted[rid]
                self._metrics.requests.labels("abort").inc()
                self._engine.abort(rid)
            return
        if command.weights_version and command.weights_version != self.weights_version:
            why = f"its first token came from weights {command.weights_version}, this worker has {self.weights_version}"
            stream.send(Verdict(WorkerUnavailable(f"the weights changed under request {rid}: {why}; retry it")))
            return
        try:  # NOTE: the engine owns request ids: it refuses one already running (DuplicateRequest)
            self._engine.add_request(rid, command.prompt, command.params)
        except InvalidArgument as exc:
            stream.send(Verdict(exc))
            return
        except Exception as exc:  # the engine failed: this request ends here, _guarded fails the rest
            stream.send(Verdict(WorkerError(f"the engine failed: {type(exc).__name__}: {exc}")))
            raise
        self._active[rid], self._admitted[rid] = stream, Admitted(command.prompt, command.params)
        stream.send(Verdict(weights_version=self.weights_version))
        logger.debug("accepted %s (%d prompt tokens)", rid, len(command.prompt))

    def _step(self) -> None:
        outputs = self._engine.step()
        self._blameless = False
        self._flush_events()  # NOTE: before the tokens: the router hears of the blocks first
        for out in outputs:
            stream = self._active.get(out.request_id)
            if stream is None:
                continue
            self._metrics.record(out, stream)
            stream.started = True
            self._admitted[out.request_id].generated += out.token_ids
            if out.finish_reason is not None:
                del self._active[out.request_id], self._admitted[out.request_id]
            stream.send(out)

    def _flush_events(self) -> None:
        """Publishes the cache changes journalled since the last call as one batch."""
        pool = self._engine.cache.pool
        if pool.journal and self._events is not None:
            self._events.publish(pool.journal)
            pool.journal = []

    def _fail_all(self, error: TsukimiError) -> None:
        for rid in list(self._active):
            with contextlib.suppress(Exception):  # NOTE: best effort on an engine that just failed
                self._engine.abort(rid)
            self._end(rid, error)

    def _publish(self) -> None:
        waiting = sum(not s.started for s in self._active.values())
        self._flush_events()
        pool = self._engine.cache.pool
        self.load = Load(waiting, len(self._active) - waiting, pool.num_free, pool.num_blocks)
        self._metrics.waiting.set(waiting)
        self._metrics.running.set(len(self._active) - waiting)
        self._metrics.free_blocks.set(pool.num_free)
