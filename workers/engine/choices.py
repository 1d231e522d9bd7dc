"""A request's n choices: choices 1..n-1 fork from choice 0 once its prompt is computed, so
all n draw their first token from the one prefill and share the prompt's KV blocks."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from workers.core.request_table import RequestTable
from workers.core.sequence import Sequence
from workers.engine.scheduler import Scheduler


def fork_choices(seqs: list[Sequence], scheduler: Scheduler, requests: RequestTable,
                 seq_ids: Iterator[int]) -> tuple[list[Sequence], list[int]]:
    """Every sequence that samples this step, forks included, and the row (into `seqs`)
    whose logits each samples from."""
    out_seqs: list[Sequence] = []
    rows: list[int] = []
    for row, seq in enumerate(seqs):
        out_seqs.append(seq)
        rows.append(row)
        if seq.needs_fork:
            children = [seq.fork(next(seq_ids), i) for i in range(1, seq.params.n)]
            scheduler.fork(seq, children)
            requests.add_forks(seq.request_id, children)
            out_seqs.extend(children)
            rows.extend([row] * len(children))
    return out_seqs, rows


def choice_logits(logits: torch.Tensor, sampling_rows: list[int], rows: list[int]) -> torch.Tensor:
    """The logits row of each sampled sequence: `rows` index into `sampling_rows` (the
    chunks that sample), which index into `logits`. In the common step (no beams, no
    forks) that is the first len(rows) rows in order: a view, not a copy of [S, V]."""
    index = [sampling_rows[r] for r in rows]
    if index == list(range(len(index))):
        return logits[: len(index)]
    return logits[index]
