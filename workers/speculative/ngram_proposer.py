"""Prompt-lookup (ngram) proposals: the tokens that followed the latest earlier occurrence
of a sequence's last few tokens, found in its own prompt and output (no second model).

Each sequence keeps a table from its n-grams to the position after their latest
occurrence, grown by the tokens appended since the last lookup, so a lookup costs a few
dict probes whatever the context's length (scanning a 2,000-token context every step
would put a per-request loop over the context on the decode path)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from workers.core.limits import SpeculativeLimits
from workers.core.sequence import Sequence

MAX_PAUSE_STEPS = 32  # the longest a sequence goes without proposals after repeated rejections


class NgramIndex:
    """A token list's n-grams (lengths `shortest`..`longest`) -> the position after their
    latest occurrence that has a token after it."""

    def __init__(self, shortest: int, longest: int) -> None:
        self.shortest, self.longest = shortest, longest
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the table

    def lookup(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the longest suffix of `tokens` seen earlier."""
        if len(tokens) < self._indexed:  # the list was cut back (a step undone): start again
            self._next.clear()
            self._indexed = 0
        self._extend(tokens)
        length = len(tokens)
        for n in range(min(self.longest, length - 1), self.shortest - 1, -1):
            after = self._next.get(tuple(tokens[length - n:]))
            if after is not None:
                return _copy_on(tokens, after, count)
        return []

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


# A proposed token costs about this share of a one-token step (the default model on a
# 2-core AVX2 CPU: a step of 1 / 2 / 3 / 5 fed tokens took 22.5 / 27.1 / 31.4 / 37.1 ms), and
# an accepted one saves a whole step: the j-th proposal pays while the chance that all j
# are taken, about rate ** j, is above it.
ROW_COST = 0.2
DECAY = 0.7  # the weight of a sequence's earlier verifications in its acceptance rate
PRIOR = (2.0, 2.5)  # (taken, tried) before any verification: a rate of 0.8, so proposals start long


@dataclass
class _Pace:
    """One sequence's proposal length, from its recent rate of taken proposals, and the
    steps it waits while that rate is too low to pay for even one."""

    index: NgramIndex
    most: int
    taken: float = PRIOR[0]
    tried: float = PRIOR[1]
    pause: int = 0  # steps left without proposals
    backoff: int = 1  # the next pause's length

    @property
    def length(self) -> int:
        rate, length = self.taken / self.tried, 0
        while length < self.most and rate ** (length + 1) > ROW_COST:
            length += 1
        return length

    def record(self, proposed: int, accepted: int) -> None:
        # Proposals are tried in order until one is refused: that one was tried, not those after it.
        self.taken = DECAY * self.taken + accepted
        self.tried = DECAY * self.tried + min(proposed, accepted + 1)
        if self.length:
            self.backoff = 1
        else:  # one proposal would not pay: wait, then try one again (longer each time, up to a limit)
            self.pause, self.backoff = self.backoff, min(MAX_PAUSE_STEPS, self.backoff * 2)


@dataclass
class SpeculationCounts:
    """Counters: verification chunks run, tokens proposed in them, and tokens accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class NgramProposer:
    limits: SpeculativeLimits
    counts: SpeculationCounts = field(default_factory=SpeculationCounts)
    _paces: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def batch_allows(self, running: int) -> bool:
        """Whether a step with `running` sequences proposes at all."""
        cap = self.limits.disable_by_batch_size
        return cap is None or running < cap

    def propose(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """At most `room` proposed tokens to follow `seq`'s last one (empty: decode plainly)."""
        if room <= 0 or not _can_speculate(seq):
            return ()
        pace = self._paces.get(seq)
        if pace is None:
            pace = self._paces[seq] = _Pace(NgramIndex(self.limits.lookup_min, self.limits.lookup_max),
                                            self.limits.num_tokens)
        if pace.pause:
            pace.pause -= 1
            return ()
        # After a pause, one proposal: enough to tell whether the rate has come back.
        return tuple(pace.index.lookup(seq.token_ids, min(room, max(1, pace.length))))

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verification's outcome: `accepted` of the `proposed` tokens were the model's own."""
        self.counts.drafts += 1
        self.counts.draft_tokens += proposed
        self.counts.accepted_tokens += accepted
        pace = self._paces.get(seq)
        if pace is not None:
            pace.record(proposed, accepted)


def _can_speculate(seq: Sequence) -> bool:
    """Whether a decoding sequence's next rows may be checked together: not while its
    sampling depends on the output so far in ways one step's rows do not follow
    (penalties, min_tokens' bans, a grammar, a thinking budget's forced end), nor for beams,
    nor before its first new token (choices fork then, and that token's event carries the
    request's first-token facts)."""
    params = seq.params
    return (seq.num_output_tokens > seq.num_resumed_tokens and seq.guide is None and not params.use_beam_search
            and not params.has_penalties and seq.num_output_tokens >= params.min_tokens
            and params.thinking_budget is None)
