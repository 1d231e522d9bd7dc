"""The engine on a background thread, with an asyncio stream per request.

The engine thread only schedules, runs the model and samples. Callers on the event
loop add and abort requests through a command queue (drained between steps, so the
scheduler is only ever touched by its own thread), and receive each step's tokens in
one `call_soon_threadsafe` per step. Tokenizing, detokenizing and serialisation happen
on the event-loop side, never on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.contract.errors import WorkerError
from workers.contract.lora import LoraAdapterError
from workers.contract.sampling_params import SamplingParams
from workers.core.events import TokenEvent
from workers.core.images import ImageInputs
from workers.core.limits import EngineLimits
from workers.engine.engine_info import EngineDescription, EngineStats
from workers.engine.llm_engine import LLMEngine
from workers.engine.resume import ResumedChoice
from workers.lora.peft_files import LoraAdapter
from workers.sampling.guided import GuideState

logger = logging.getLogger(__name__)


class EngineDeadError(WorkerError, RuntimeError):
    """The engine thread stopped; no request can make progress."""

    status = 503
    type = "server_error"
    code = "engine_dead"


@dataclass
class _Add:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: "RequestStream"
    guide: GuideState | None
    images: ImageInputs | None = None
    resume: list[ResumedChoice] | None = None
    lora: str | None = None  # a registered adapter's key


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future


@dataclass
class _Abort:
    stream: "RequestStream"


@dataclass
class _AddLora:
    adapter: LoraAdapter


@dataclass
class _RemoveLora:
    key: str


class RequestStream:
    """Tokens of one request (all its choices), as the engine produces them: handed to
    `sink` on the event loop, a step's events of the request (or the exception that failed
    it) in one call, with no task switch in between. The caller of `add_request` sets
    `sink` before its event loop runs again (events arrive by the loop, never sooner)."""

    def __init__(self) -> None:
        self.request_id: int | None = None
        self.finished = False  # set by the sink's owner when the request's last event arrived
        self.sink: Callable[[list[TokenEvent | BaseException]], None] | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, thread: threading.Thread | None = None) -> None:
        """`thread`: the (already running) thread that built `engine` and will run it; see
        `start_on_own_thread`. Without it, `start` runs the engine on a new thread."""
        self._engine = engine  # touched by the engine thread only, except its thread-safe reads below
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, RequestStream] = {}
        self._lora_keys: set[str] = set()  # adapters registered, as callers see them (the command order)
        self._stopped = False
        self.error: BaseException | None = None
        self.steps = 0
        self._step_started: float | None = None  # set while a step runs: hang detection
        self._thread = thread or threading.Thread(target=self._run, name="chatserve-engine", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    @classmethod
    def start_on_own_thread(cls, build: Callable[[], LLMEngine], loop: asyncio.AbstractEventLoop) -> "AsyncEngine":
        """Build the engine on a new thread and run it there; returns once it is built
        (re-raising what `build` raised).

        Why the engine thread must also load the model: torch's OpenMP runtime (libgomp)
        gives every thread that opens a parallel region its own pool of workers, and once
        there are more such workers than cores it stops spinning between regions. A model
        loaded on one thread and stepped on another then decodes at one-thread speed:
        SmolLM2 on 2 cores took 58 ms a step instead of 33 ms (measured)."""
        built: queue.SimpleQueue[AsyncEngine | BaseException] = queue.SimpleQueue()

        def run() -> None:
            try:
                engine = cls(build(), threading.current_thread())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                built.put(exc)
                return
            engine._loop = loop
            built.put(engine)
            engine._run()

        threading.Thread(target=run, name="chatserve-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stuck_for(self) -> float:
        """Seconds the current model step has been running (0 when none is)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def limits(self) -> EngineLimits:
        return self._engine.limits

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise CapacityError if the request can never run here (see LLMEngine.check_request)."""
        self._engine.check_request(prompt_token_ids, params)

    def compile_guide(self, params: SamplingParams) -> GuideState | None:
        """The grammar state for a guided request, compiled on the caller's thread (see
        LLMEngine.compile_guide)."""
        return self._engine.compile_guide(params)

    def replay_output(self, prompt_token_ids: list[int], params: SamplingParams, outputs: dict[int, list[int]],
                      guide: GuideState | None) -> list[ResumedChoice]:
        """A resumed request's choices, on the caller's thread (see LLMEngine.replay_output)."""
        return self._engine.replay_output(prompt_token_ids, params, outputs, guide)

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def describe(self) -> EngineDescription:
        return self._engine.describe()

    def check_lora(self, adapter: LoraAdapter) -> None:
        """Raise LoraAdapterError unless the engine can serve `adapter` (see LLMEngine.check_lora)."""
        self._engine.check_lora(adapter)

    def add_lora(self, adapter: LoraAdapter) -> None:
        """Check `adapter` against the model now (raises LoraAdapterError), then register it;
        a request queued after this call finds it (commands run in order)."""
        self.check_lora(adapter)
        self._lora_keys.add(adapter.key)
        self._commands.put(_AddLora(adapter))
        self._wake.set()

    def remove_lora(self, key: str) -> None:
        """Forget an adapter for later requests (queued and running ones finish with it)."""
        self._lora_keys.discard(key)
        self._commands.put(_RemoveLora(key))
        self._wake.set()

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, guide: GuideState | None = None, *,
        images: ImageInputs | None = None, resume: list[ResumedChoice] | None = None, lora: str | None = None,
    ) -> RequestStream:
        """Check the request now (raises CapacityError, GuidedDecodingError for a grammar
        that does not compile, or LoraAdapterError for an adapter not registered), then queue
        it for the engine thread. A guided request's grammar is compiled here, on the
        caller's thread, unless `guide` or `resume` (whose choices carry their own, from
        replay_output) is given."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        self.check_request(prompt_token_ids, params)
        if lora is not None and lora not in self._lora_keys:
            raise LoraAdapterError(f"LoRA adapter {lora!r} is not loaded on this worker")
        if guide is None and resume is None:
            guide = self.compile_guide(params)
        stream = RequestStream()
        self._commands.put(_Add(prompt_token_ids, params, stream, guide, images, resume, lora))
        self._wake.set()
        if self.error is not None:
            # The engine died after the check above; its last drain may have missed this command.
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        return stream

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """`fn(engine)` on the engine thread between two steps (the engine is not thread-safe);
        its result, or what it raised."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        done = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, done))
        self._wake.set()
        return await done

    def abort(self, stream: RequestStream) -> None:
        if not stream.finished:
            self._commands.put(_Abort(stream))
            self._wake.set()

    # --- engine thread -------------------------------------------------------------

    def _run(self) -> None:
        # `self._streams` (request id -> stream) belongs to this thread alone.
        try:
            while not self._stopped:
                self._drain_commands()
                if not self._engine.has_work():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._step_started = time.monotonic()
                events = self._engine.step()
                self._step_started = None
                self.steps += 1
                if events:
                    self._loop.call_soon_threadsafe(_deliver, self._route(events))
        except BaseException as exc:  # noqa: BLE001 - every stream must learn the engine died
            logger.exception("engine thread failed")
            self.error = exc
            dead = EngineDeadError(f"engine thread failed: {exc!r}")
            failed = [(s, dead) for s in self._streams.values()]
            # Requests queued while the failing step ran never reached the engine: fail them too.
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, _Add):
                    failed.append((cmd.stream, dead))
                elif isinstance(cmd, _Call):
                    self._loop.call_soon_threadsafe(_settle, cmd.done, None, dead)
            self._loop.call_soon_threadsafe(_deliver, failed)
            self._streams.clear()

    def _route(self, events: list[TokenEvent]) -> list[tuple[RequestStream, TokenEvent]]:
        routed = []
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            if event.request_finished:
                del self._streams[event.request_id]
            routed.append((stream, event))
        return routed

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    request_id = self._engine.add_request(cmd.prompt_token_ids, cmd.params, cmd.guide,
                                                          images=cmd.images, resume=cmd.resume, lora=cmd.lora)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    self._loop.call_soon_threadsafe(_deliver, [(cmd.stream, exc)])
                    continue
                cmd.stream.request_id = request_id
                self._streams[request_id] = cmd.stream
            elif isinstance(cmd, _Call):
                self._call(cmd)
            elif isinstance(cmd, _AddLora):
                self._engine.lora.add(cmd.adapter)  # checked once, on the caller's thread (add_lora)
            elif isinstance(cmd, _RemoveLora):
                self._engine.remove_lora(cmd.key)
            elif cmd.stream.request_id is not None:
                self._engine.abort_request(cmd.stream.request_id)
                self._streams.pop(cmd.stream.request_id, None)


    def _call(self, cmd: _Call) -> None:
        try:
            result = cmd.fn(self._engine)
        except Exception as exc:  # noqa: BLE001 - the caller's to handle
            self._loop.call_soon_threadsafe(_settle, cmd.done, None, exc)
            return
        self._loop.call_soon_threadsafe(_settle, cmd.done, result, None)


def _settle(done: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


def _deliver(routed: list[tuple[RequestStream, TokenEvent | BaseException]]) -> None:
    """Runs on the event loop: hand each stream its share of a step, in one piece."""
    by_stream: dict[RequestStream, list[TokenEvent | BaseException]] = {}
    for stream, item in routed:
        by_stream.setdefault(stream, []).append(item)
    for stream, items in by_stream.items():
        try:
            stream.sink(items)
        except Exception:  # noqa: BLE001 - the sink fails its own request; the step's others go on
            logger.exception("delivering a step's events failed for one request")
