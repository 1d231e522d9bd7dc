"""Embedding requests in the engine: their prompts are prefilled like any other, chunk by
chunk beside generation, and each chunk's final hidden states (the runner's pooled rows)
add up here into one vector; the chunk that ends the prompt finishes the sequence with
that vector instead of a sampled token."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from workers.core.batch import PoolRows
from workers.core.events import TokenEvent
from workers.core.request_table import RequestTable
from workers.core.sequence import FinishReason, Sequence
from workers.engine.scheduler import Scheduler


class Pooler:
    """The running sums of mean-pooled sequences, by sequence id, until their prompt ends."""

    def __init__(self) -> None:
        self._sums: dict[int, torch.Tensor] = {}

    def add(self, pooled: list[tuple[PoolRows, torch.Tensor]]) -> list[tuple[Sequence, torch.Tensor]]:
        """Take one step's pooled rows; returns the sequences whose vector is whole, with it."""
        whole = []
        for rows, hidden in pooled:
            seq = rows.seq
            if rows.restart:
                self._sums.pop(seq.seq_id, None)
            total = hidden.sum(dim=0) if seq.params.pooling.kind == "mean" else hidden[-1]
            if seq.seq_id in self._sums:
                total = total + self._sums.pop(seq.seq_id)
            if not rows.final:
                self._sums[seq.seq_id] = total
                continue
            vector = total / seq.num_prompt_tokens if seq.params.pooling.kind == "mean" else total
            whole.append((seq, F.normalize(vector, dim=-1) if seq.params.pooling.normalize else vector))
        return whole

    def forget(self, seqs: list[Sequence]) -> None:
        """Aborted sequences: their partial sums go."""
        for seq in seqs:
            self._sums.pop(seq.seq_id, None)


def embedding_events(whole: list[tuple[Sequence, torch.Tensor]], scheduler: Scheduler,
                     requests: RequestTable) -> list[TokenEvent]:
    """Finish each sequence with its vector: its one event ends the request."""
    now = time.perf_counter()
    events = []
    for seq, vector in whole:
        scheduler.end_running(seq, FinishReason.STOP)
        requests.retire(seq)
        events.append(TokenEvent(request_id=seq.request_id, index=seq.index, token_id=-1,
                                 finish_reason=FinishReason.STOP, stop_token_id=None, time=now,
                                 request_finished=seq.request_id not in requests, queue_time=seq.queue_time,
                                 cached_tokens=seq.num_cached_tokens, embedding=vector.tolist()))
    return events
