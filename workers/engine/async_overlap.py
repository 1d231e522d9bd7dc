"""Async scheduling on CUDA: the next decode step is launched from this step's sampled ids
while they are still on the device.

Without it the host's share of a decode step (schedule, inputs, events; docs/BENCHMARKS.md
measures it) sits between the device's steps. Here a plain decode step is launched, and the next one is launched from
its sampled ids on the device; only then are the first step's ids read back and turned
into events. A sequence that stops (EOS, stop token) runs one wasted row in the step
launched behind it; its output is unchanged. A finish by length is known ahead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.core.batch import ScheduledBatch
from workers.core.events import TokenEvent, token_events
from workers.core.request_table import RequestTable
from workers.core.sequence import Sequence
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Copy-on-write, forward and sample a decode-only batch on the device, fed by the given ids
# (None: from the host); returns the sampled ids, still on the device.
LaunchDecodes = Callable[[ScheduledBatch, "torch.Tensor | None"], torch.Tensor]


@dataclass
class InFlight:
    """A decode step launched on the device whose sampled ids are not on the host yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] sampled ids, on the device
    host: torch.Tensor  # [n] their copy on the host (pinned on CUDA), filled asynchronously
    ready: torch.cuda.Event | None  # recorded after that copy (CUDA)

    @classmethod
    def start(cls, seqs: list[Sequence], tokens: torch.Tensor) -> "InFlight":
        if tokens.device.type != "cuda":
            return cls(seqs, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, tokens, host, ready)

    def wait(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # this step's copy only, not the step launched behind it
        return self.host.tolist()


def can_overlap(seq: Sequence) -> bool:
    """A sequence whose next sampling reads nothing of its latest token on the host: no
    grammar, penalties, logprobs, beams or thinking budget, and past its min_tokens bans."""
    params = seq.params
    return (seq.guide is None and not params.has_penalties and params.logprobs is None
            and not params.use_beam_search and seq.num_output_tokens >= params.min_tokens
            and params.thinking_budget is None)


class AsyncOverlap:
    def __init__(self, scheduler: Scheduler, blocks: BlockManager, requests: RequestTable,
                 launch_decodes: LaunchDecodes, enabled: bool) -> None:
        """`launch_decodes` is the engine's device half; `requests` its live requests."""
        self.scheduler = scheduler
        self.blocks = blocks
        self.requests = requests
        self.launch_decodes = launch_decodes
        self.enabled = enabled
        self.in_flight: InFlight | None = None  # a launched step not read back yet
        self.steps = 0  # steps launched from a previous step's tokens still on the device

    def can_start(self, batch: ScheduledBatch) -> bool:
        return (self.enabled and bool(batch.decodes) and not batch.prefills
                and self.scheduler.only_request is None and all(can_overlap(c.seq) for c in batch.decodes))

    def start(self, batch: ScheduledBatch) -> None:
        """Launch `batch`; its tokens come out of the next `step()`."""
        self.in_flight = self._launch(batch)

    def step(self) -> list[TokenEvent]:
        """Launch the step behind the one in flight (if it can go on), then emit that one."""
        flight, self.in_flight = self.in_flight, None
        self.in_flight = self._launch_next(flight)
        return self._complete(flight)

    def _launch(self, batch: ScheduledBatch, token_ids: torch.Tensor | None = None) -> InFlight:
        """Run a decode-only step and sample on the device; the ids come back asynchronously.
        The step counts as computed only once everything is launched, so a failure leaves
        the sequences as they were."""
        seqs = [c.seq for c in batch.decodes]
        flight = InFlight.start(seqs, self.launch_decodes(batch, token_ids))
        self.scheduler.advance(batch)
        return flight

    def _launch_next(self, flight: InFlight) -> InFlight | None:
        """The next decode step, fed by `flight`'s ids on the device; None: drain instead."""
        batch = self.scheduler.continue_decodes(flight.seqs)
        if batch is None:
            return None
        row_of = {id(s): i for i, s in enumerate(flight.seqs)}
        keep = [row_of[id(c.seq)] for c in batch.decodes]
        token_ids = flight.tokens if len(keep) == len(flight.seqs) else flight.tokens[
            torch.tensor(keep, device=flight.tokens.device)]
        try:
            launched = self._launch(batch, token_ids)
        except Exception:  # noqa: BLE001 - drain; the next (synchronous) step contains a failure
            logger.exception("async decode step failed to launch; running the next step synchronously")
            return None
        self.steps += 1
        return launched

    def _complete(self, flight: InFlight) -> list[TokenEvent]:
        """Read a launched step's ids back and emit them; rows of sequences that ended
        (or were aborted) meanwhile are dropped."""
        sampled = flight.wait()
        live = [(s, t) for s, t in zip(flight.seqs, sampled) if not s.is_finished]
        results = self.scheduler.append_tokens([s for s, _ in live], [t for _, t in live])
        for seq, _ in live:
            if not seq.is_finished:  # blocks whose last token just became known
                self.blocks.cache_computed_blocks(seq)
        return token_events(results, {}, self.requests)
