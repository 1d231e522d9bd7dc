"""Checking proposed tokens in the step that feeds them.

A sequence that feeds its last token and k proposed ones gets k + 1 logits rows: row j
is the model's distribution for the token after proposal j (row 0: after the last
token). Each row is sampled as an ordinary decode row would be, at its own output
position (a seeded request's draws are by position), and the proposals are taken while
they equal the row's own sample; the first row that differs gives its sample instead,
and when all are taken the last row gives one more. Because a proposal here is a single
token rather than a distribution, "sample the row and compare" is exactly the rejection
rule of speculative sampling: the proposal is kept with the probability the model gives
it, and otherwise the token is drawn from the model's distribution without it. So every
emitted token has the distribution (greedy: the token, seeded: the draw) it has without
speculation, given the same earlier tokens."""

from __future__ import annotations

from dataclasses import dataclass

from workers.core.batch import ScheduledChunk
from workers.core.sequence import Sequence


@dataclass(frozen=True)
class Group:
    """One sequence's run of rows in the sampled batch."""

    seq: Sequence
    first: int  # its first row in the sampled batch
    draft: tuple[int, ...]  # what its rows check (empty: one ordinary row)


@dataclass(frozen=True)
class VerifyRows:
    """The rows a step samples when some sequences are drafted: a run of k + 1 for a
    drafted sequence, one row for every other."""

    seqs: list[Sequence]  # the sequence of each row
    logit_rows: list[int]  # each row's row in the step's logits
    pending: list[int]  # tokens between the sequence's end and the row's position (0..k)
    groups: list[Group]

    @classmethod
    def of(cls, seqs: list[Sequence], sampling_rows: list[int], drafted: list[ScheduledChunk],
           draft_base: int) -> "VerifyRows":
        """`sampling_rows[i]`: the logits row `seqs[i]` samples from without speculation (a
        drafted sequence's last row); `drafted`: the verification chunks in the model
        runner's order, whose first k rows it packed from `draft_base` on."""
        first_row: dict[int, tuple[int, tuple[int, ...]]] = {}  # id(seq) -> (first draft row, draft)
        for chunk in drafted:
            first_row[id(chunk.seq)] = (draft_base, chunk.draft)
            draft_base += len(chunk.draft)
        row_seqs: list[Sequence] = []
        logit_rows: list[int] = []
        pending: list[int] = []
        groups: list[Group] = []
        for seq, row in zip(seqs, sampling_rows):
            first, draft = first_row.get(id(seq), (0, ()))
            groups.append(Group(seq, len(row_seqs), draft))
            run = [*range(first, first + len(draft)), row]
            row_seqs.extend([seq] * len(run))
            logit_rows.extend(run)
            pending.extend(range(len(run)))
        return cls(row_seqs, logit_rows, pending, groups)


def accepted_count(samples: list[int], draft: tuple[int, ...]) -> int:
    """How many leading proposals equal the rows' own samples."""
    count = 0
    while count < len(draft) and samples[count] == draft[count]:
        count += 1
    return count


def rows_ahead(num_rows: int, drafts: dict[int, tuple[int, ...]]) -> list[list[int]]:
    """By row of a verification batch, the proposals before it: `drafts` maps a drafted
    sequence's first row to its proposals, and its row first + j follows the first j."""
    ahead: list[list[int]] = [[] for _ in range(num_rows)]
    for first, draft in drafts.items():
        for j in range(1, len(draft) + 1):
            ahead[first + j] = list(draft[:j])
    return ahead
