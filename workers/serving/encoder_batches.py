"""An encoder's continuous batching: the inputs of every request waiting here are gathered
into padded batches (at most engine.max_num_seqs inputs and engine.max_num_batched_tokens
padded tokens), run one at a time on the model's own thread while the event loop goes on
taking requests. Inputs go in rounds: all those waiting when a round starts, shortest
first, so that a batch holds inputs of like lengths (a batch costs its longest input times
its size: on 128 inputs of 15-45 words, 1.09x the real tokens against 1.44x in arrival
order, 1.37x the inputs/s); what arrives meanwhile waits for the next round. A batch that
fails is run again an input at a time, so one bad input fails only its own request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from workers.serving.embeddings import EngineStepError, PooledInput

logger = logging.getLogger(__name__)


@dataclass
class _Input:
    ids: list[int]
    done: asyncio.Future
    queued_at: float


class EncoderBatches:
    def __init__(self, run_batch: Callable[[list[list[int]]], list[list[float]]], executor: Executor,
                 max_input_tokens: int, max_seqs: int, max_batched_tokens: int) -> None:
        """`run_batch` runs on `executor` (one thread: the model's); an input of up to
        `max_input_tokens` always fits a batch of its own."""
        self._run_batch = run_batch
        self._executor = executor
        self._max_input_tokens = max_input_tokens
        self._max_seqs = max_seqs
        self._max_batched_tokens = max_batched_tokens
        self._queue: deque[_Input] = deque()  # arrived since the round started
        self._round: deque[_Input] = deque()  # the round's inputs not yet run, shortest first
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.steps = 0  # batches run (a counter)
        self.running = 0  # inputs in the batch running now
        self.step_started: float | None = None  # monotonic start of the running batch

    @property
    def longest_input(self) -> int:
        return self._max_input_tokens

    @property
    def waiting(self) -> int:
        return len(self._queue) + len(self._round)

    @property
    def queued_tokens(self) -> int:
        return sum(len(item.ids) for item in self._queue) + sum(len(item.ids) for item in self._round)

    @property
    def alive(self) -> bool:
        return self._loop_task is None or not self._loop_task.done()

    def stuck_for(self) -> float:
        """Seconds the running batch has been running (0 when none is)."""
        return 0.0 if self.step_started is None else time.monotonic() - self.step_started

    async def pool(self, prompts: list[list[int]]) -> list[PooledInput]:
        """The prompts' vectors, in order; a caller that leaves takes its queued inputs along."""
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        items = [_Input(ids, loop.create_future(), now) for ids in prompts]
        self._queue.extend(items)
        if self._loop_task is None or self._loop_task.done():
            # The first request; or the loop it ran on was closed (a test's asyncio.run).
            self._wake = asyncio.Event()
            self._loop_task = loop.create_task(self._run_forever())
        self._wake.set()
        try:
            return list(await asyncio.gather(*(item.done for item in items)))
        finally:
            for item in items:
                item.done.cancel()  # a no-op once settled; else the batcher skips it

    async def _run_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while batch := self._take():
                await self._run(batch)

    def _take(self) -> list[_Input]:
        """The next batch: the round's shortest inputs while the padded batch fits (a new
        round of everything waiting when this one is used up)."""
        if not self._round:
            self._round = deque(sorted(self._queue, key=lambda item: len(item.ids)))
            self._queue.clear()
        batch: list[_Input] = []
        while self._round and len(batch) < self._max_seqs:
            item = self._round[0]
            if item.done.done():  # its request left
                self._round.popleft()
                continue
            if batch and len(item.ids) * (len(batch) + 1) > self._max_batched_tokens:  # it is the longest yet
                break
            batch.append(self._round.popleft())
        return batch

    async def _run(self, batch: list[_Input]) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        self.running, self.step_started = len(batch), time.monotonic()
        try:
            vectors = await loop.run_in_executor(self._executor, self._run_batch, [item.ids for item in batch])
        except Exception as exc:  # noqa: BLE001 - contained: the inputs are retried alone, or fail alone
            if len(batch) > 1:
                logger.warning("an encoder batch of %d inputs failed (%s): running them one at a time",
                               len(batch), exc)
                for item in batch:
                    await self._run([item])
            else:
                _settle(batch[0], EngineStepError(f"this input failed inside the model ({type(exc).__name__}: "
                                                  f"{exc})"))
            return
        finally:
            self.running, self.step_started = 0, None
            self.steps += 1
        done = time.perf_counter()
        for item, vector in zip(batch, vectors):
            _settle(item, PooledInput(vector, started - item.queued_at, done))


def _settle(item: _Input, outcome: PooledInput | BaseException) -> None:
    if item.done.done():
        return
    if isinstance(outcome, BaseException):
        item.done.set_exception(outcome)
    else:
        item.done.set_result(outcome)
