"""Containing a failed step: undo it, then re-run its requests one at a time (the
suspects), so only the request that makes a step fail is failed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.contract.grammar import GuidedDecodingError
from workers.core.batch import ScheduledBatch
from workers.core.events import TokenEvent
from workers.core.request_table import RequestTable
from workers.core.sequence import FinishReason, Sequence
from workers.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class StepSnapshot:
    """What a step may change, so a failed step can be undone before it is retried."""

    request_ids: list[int]
    seqs: list[tuple[Sequence, int, int, float]]  # (seq, num_computed, num_tokens, cum_logprob)
    groups: dict[int, list[Sequence]]
    pending_beam_rows: dict[int, torch.Tensor]

    @classmethod
    def take(cls, batch: ScheduledBatch, requests: RequestTable, pending: dict[int, torch.Tensor]) -> "StepSnapshot":
        seqs = [c.seq for c in batch.decodes + batch.prefills]
        request_ids = list(dict.fromkeys(s.request_id for s in seqs))
        return cls(
            request_ids=request_ids,
            seqs=[(s, s.num_computed_tokens, s.num_tokens, s.cum_logprob) for s in seqs],
            groups={r: list(requests.choices(r)) for r in request_ids},
            pending_beam_rows=dict(pending),
        )

    def restore(self, scheduler: Scheduler, requests: RequestTable, pending: dict[int, torch.Tensor]) -> bool:
        """Undo the step; False when a sequence already finished (its events would be lost)."""
        if any(seq.is_finished for seq, *_ in self.seqs):
            return False
        for request_id, before in self.groups.items():
            known = {id(s) for s in before}
            for seq in requests.choices(request_id):
                if id(seq) not in known:  # forked during the failed step
                    scheduler.drop(seq)
            requests.replace(request_id, before)
        for seq, computed, length, cum in self.seqs:
            # Blocks the failed step registered in the prefix cache stay: they were only
            # registered after the forward pass wrote them, so their K/V are right.
            seq.num_computed_tokens = computed
            seq.truncate(length, scheduler.blocks.block_size)
            seq.cum_logprob = cum
            if seq.guide is not None:
                seq.guide.truncate(seq.output_token_ids)
        pending.clear()
        pending.update(self.pending_beam_rows)
        return True


class StepRecovery:
    def __init__(self, scheduler: Scheduler, requests: RequestTable, pending_beam_rows: dict[int, torch.Tensor],
                 abort: Callable[[int], None]) -> None:
        """The engine's scheduler, live requests and parked beam rows (restored in place),
        and its `abort`, which fails a request."""
        self.scheduler = scheduler
        self.requests = requests
        self.pending_beam_rows = pending_beam_rows
        self.abort = abort
        self._suspects: list[int] = []  # requests of a failed step, re-run one at a time

    def snapshot(self, batch: ScheduledBatch) -> StepSnapshot:
        return StepSnapshot.take(batch, self.requests, self.pending_beam_rows)

    def contain(self, snapshot: StepSnapshot, exc: Exception) -> list[TokenEvent]:
        """After a step raised: undo it and isolate its requests, or fail the one it ran."""
        request_ids = snapshot.request_ids
        if len(request_ids) > 1 and snapshot.restore(self.scheduler, self.requests, self.pending_beam_rows):
            self._suspects = [r for r in request_ids if r in self.requests]
            self.scheduler.run_alone(self._suspects[0])
            return []
        # Alone (or not restorable): these requests fail; everyone else goes on.
        logger.exception("model step failed for request(s) %s", request_ids)
        now = time.perf_counter()
        events = []
        for request_id in request_ids:
            if request_id in self.requests:
                self.abort(request_id)
                events.append(TokenEvent(request_id, 0, -1, FinishReason.ABORT, None, now,
                                         request_finished=True, error=f"{type(exc).__name__}: {exc}",
                                         error_is_grammar=isinstance(exc, GuidedDecodingError)))
        self.next_suspect()
        return events

    def next_suspect(self) -> None:
        """After a step, while suspects run alone: the next live one runs alone (none: all run)."""
        if self.scheduler.only_request is not None:
            self._suspects = [r for r in self._suspects[1:] if r in self.requests]
            self.scheduler.run_alone(self._suspects[0] if self._suspects else None)
