"""Beam-search requests across steps: each beam's log-probabilities wait until its sibling
beams have theirs, then the request's `BeamGroup` says which beams fork, go on or drop."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from workers.core.events import TokenEvent
from workers.core.request_table import RequestTable
from workers.core.sequence import FinishReason, Sequence
from workers.engine.beam_search import BeamGroup
from workers.engine.scheduler import Scheduler


class BeamCoordinator:
    def __init__(self, scheduler: Scheduler, requests: RequestTable, seq_ids: Iterator[int],
                 abort: Callable[[int], None]) -> None:
        """`requests` and `seq_ids` are the engine's own: beams are choices of their request.
        `abort` is the engine's, which also forgets the request here."""
        self.scheduler = scheduler
        self.requests = requests
        self.seq_ids = seq_ids
        self.abort = abort
        self.groups: dict[int, BeamGroup] = {}  # beam-search requests
        self.pending_rows: dict[int, torch.Tensor] = {}  # seq id -> logprobs, until siblings catch up

    def start(self, seq: Sequence, eos_token_ids: frozenset[int]) -> None:
        params = seq.params
        ends = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.groups[seq.request_id] = BeamGroup(params.beam_width, params.n, params.length_penalty, ends)

    def forget(self, request_id: int, seqs: list[Sequence]) -> None:
        self.groups.pop(request_id, None)
        for seq in seqs:
            self.pending_rows.pop(seq.seq_id, None)

    def step(self, seqs: list[Sequence], logits: torch.Tensor) -> list[TokenEvent]:
        """Park each beam's log-probabilities; advance every request whose live beams all have theirs."""
        for seq, row in zip(seqs, torch.log_softmax(logits, dim=-1)):
            self.pending_rows[seq.seq_id] = row
        events: list[TokenEvent] = []
        for request_id in dict.fromkeys(s.request_id for s in seqs):
            live = self.requests.choices(request_id)
            if live and all(s.seq_id in self.pending_rows for s in live):
                rows = torch.stack([self.pending_rows.pop(s.seq_id) for s in live])
                events.extend(self._advance(request_id, live, rows))
        return events

    def _advance(self, request_id: int, live: list[Sequence], rows: torch.Tensor) -> list[TokenEvent]:
        group = self.groups[request_id]
        chosen = group.step(rows, [s.cum_logprob for s in live], [s.output_token_ids for s in live])
        targets: list[tuple[Sequence, int, float]] = []
        used: set[int] = set()
        for cont in chosen:  # fork first: a child copies its parent before the parent appends
            parent = live[cont.beam]
            if cont.beam in used:
                child = parent.fork(next(self.seq_ids), parent.index)
                self.scheduler.fork(parent, [child])
                targets.append((child, cont.token_id, cont.cum_logprob))
            else:
                used.add(cont.beam)
                targets.append((parent, cont.token_id, cont.cum_logprob))
        for beam, seq in enumerate(live):
            if beam not in used:
                self.scheduler.drop(seq)
        next_live = []
        for seq, token, cum in targets:
            seq.cum_logprob = cum
            if seq.append_token(token) is FinishReason.LENGTH:
                group.finish_live([(seq.output_token_ids, cum)], "length")
                self.scheduler.end_running(seq, FinishReason.LENGTH)
            else:
                next_live.append(seq)
        self.requests.replace(request_id, next_live)
        if not group.is_done([(s.cum_logprob, s.num_output_tokens) for s in next_live]):
            return []
        return self._finish(request_id, group, live[0].num_cached_tokens)

    def _finish(self, request_id: int, group: BeamGroup, cached_tokens: int | None) -> list[TokenEvent]:
        self.abort(request_id)  # drops the beams still live and the group
        now = time.perf_counter()
        best = group.best()
        return [
            TokenEvent(
                request_id=request_id,
                index=i,
                token_id=-1,
                finish_reason=FinishReason(h.finish_reason),
                stop_token_id=None,
                time=now,
                logprob=h.cum_logprob,
                beam_token_ids=h.token_ids,
                request_finished=i == len(best) - 1,
                cached_tokens=cached_tokens if i == 0 else None,
            )
            for i, h in enumerate(best)
        ]
