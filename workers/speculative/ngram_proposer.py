"""Prompt-lookup (ngram) proposals: the tokens that followed the latest earlier occurrence
of a sequence's last few tokens, found in its own prompt and output (no second model);
method suffix also looks in the model's earlier answers (response_history.py).

Each sequence keeps a table from its n-grams to the position after their latest
occurrence, grown by the tokens appended since the last lookup, so a lookup costs a few
dict probes whatever the context's length (scanning a 2,000-token context every step
would put a per-request loop over the context on the decode path)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from workers.core.limits import SpeculativeLimits
from workers.core.sequence import FinishReason, Sequence
from workers.speculative.proposals import (
    ROW_COST,
    ProposalPace,
    SpeculationCounts,
    StepCost,
    can_speculate,
)
from workers.speculative.response_history import ResponseHistory, matched_length


def adapter_key(seq: Sequence) -> str | None:
    """Whose answers a sequence's are: its LoRA adapter's, or the base model's (None)."""
    return seq.lora.key if seq.lora is not None else None


class NgramIndex:
    """A token list's n-grams (lengths `shortest`..`longest`) -> the position after their
    latest occurrence that has a token after it."""

    def __init__(self, shortest: int, longest: int) -> None:
        self.shortest, self.longest = shortest, longest
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the table

    def lookup(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the longest suffix of `tokens` seen earlier."""
        after = self.find(tokens)
        return _copy_on(tokens, after, count) if after is not None else []

    def find(self, tokens: list[int]) -> int | None:
        """The position after the latest earlier occurrence of the longest suffix of `tokens`
        (lengths `longest` down to `shortest`), or None."""
        if len(tokens) < self._indexed:  # the list was cut back (a step undone): start again
            self._next.clear()
            self._indexed = 0
        self._extend(tokens)
        length = len(tokens)
        for n in range(min(self.longest, length - 1), self.shortest - 1, -1):
            after = self._next.get(tuple(tokens[length - n:]))
            if after is not None:
                return after
        return None

    def _extend(self, tokens: list[int]) -> None:
        # An n-gram ending at `end` - 1 is followed by tokens[end]; the sequence's last token
        # has no follower yet, so its n-grams wait for the next lookup.
        table, shortest, longest = self._next, self.shortest, self.longest
        for end in range(max(self._indexed, shortest), len(tokens)):
            for n in range(shortest, min(longest, end) + 1):
                table[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, len(tokens))


def _copy_on(tokens: list[int], start: int, count: int) -> list[int]:
    """`count` tokens copied from `start` on, reading on into the copy itself once the
    list ends (as LZ77 copies): text that repeats with a period shorter than `count`
    (a loop, a table's rows) still gets whole proposals."""
    length = len(tokens)
    out = tokens[start : start + count]
    while len(out) < count:
        out.append(out[start + len(out) - length])
    return out


@dataclass
class _Lookup:
    index: NgramIndex
    pace: ProposalPace


@dataclass
class NgramProposer:
    """Prompt lookup; with a `history` (method suffix), also the model's earlier answers:
    of the two proposals, the one whose source matched more of the sequence's end."""

    limits: SpeculativeLimits
    history: ResponseHistory | None = None
    counts: SpeculationCounts = field(default_factory=SpeculationCounts)
    step_cost: StepCost = field(default_factory=StepCost)
    _lookups: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    _row_cost: float = field(default=ROW_COST, init=False)  # set by prepare each step

    def prepare(self, running: list[Sequence]) -> None:
        """This step's cost of a proposed token; each lookup is made when the scheduler asks."""
        self._row_cost = self.step_cost.share(len(running))

    def propose(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """At most `room` proposed tokens to follow `seq`'s last one (empty: decode plainly)."""
        if room <= 0 or not can_speculate(seq):
            return ()
        lookup = self._lookups.get(seq)
        if lookup is None:
            lookup = self._lookups[seq] = _Lookup(NgramIndex(self.limits.lookup_min, self.limits.lookup_max),
                                                  ProposalPace(self.limits.num_tokens))
        lookup.pace.cost = self._row_cost
        count = lookup.pace.next_length(room)
        if not count:
            return ()
        tokens = seq.token_ids
        after = lookup.index.find(tokens)
        if self.history is not None:
            earlier = self.history.lookup(tokens, count, adapter_key(seq))
            if earlier is not None and (after is None or earlier.length > matched_length(tokens, tokens, after)):
                return tuple(earlier.tokens)
        return tuple(_copy_on(tokens, after, count)) if after is not None else ()

    def finished(self, seq: Sequence) -> None:
        """A sequence ended: a whole answer (not a cancelled one) joins the history."""
        if self.history is not None and seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.history.add(seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids, adapter_key(seq))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verification's outcome: `accepted` of the `proposed` tokens were the model's own."""
        self.counts.record(proposed, accepted)
        lookup = self._lookups.get(seq)
        if lookup is not None:
            lookup.pace.record(proposed, accepted)
