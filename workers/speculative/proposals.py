"""What every proposer shares: which sequences may be checked several tokens at a time,
how many tokens one proposes (paced by its own recent rate of accepted proposals), and
the counters /metrics reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from workers.core.limits import SpeculativeLimits
from workers.core.sequence import Sequence

MAX_PAUSE_STEPS = 32  # the longest a sequence goes without proposals after repeated rejections

# A proposed token costs the target model about this share of a one-token step (the default
# model on a 2-core AVX2 CPU: a step of 1 / 2 / 3 / 5 fed tokens took 22.5 / 27.1 / 31.4 /
# 37.1 ms), and an accepted one saves a whole step: the j-th proposal pays while the chance
# that all j are taken, about rate ** j, is above its cost.
ROW_COST = 0.2
DECAY = 0.7  # the weight of a sequence's earlier verifications in its acceptance rate
PRIOR = (2.0, 2.5)  # (taken, tried) before any verification: a rate of 0.8, so proposals start long


@dataclass
class SpeculationCounts:
    """Counters: verification chunks run, tokens proposed in them, and tokens accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted


class Proposer(Protocol):
    """What the scheduler and the engine ask of a proposer (ngram_proposer, draft_proposer)."""

    limits: SpeculativeLimits
    counts: SpeculationCounts

    def prepare(self, running: list[Sequence]) -> None:
        """Called once a step that proposes, before any `propose`, with the running sequences."""

    def propose(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """At most `room` proposed tokens to follow `seq`'s last one (empty: decode plainly)."""

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verification's outcome: `accepted` of the `proposed` tokens were the model's own."""


def batch_allows(limits: SpeculativeLimits, running: int) -> bool:
    """Whether a step with `running` sequences proposes at all."""
    cap = limits.disable_by_batch_size
    return cap is None or running < cap


@dataclass
class ProposalPace:
    """One sequence's proposal length, from its recent rate of taken proposals and what a
    proposed token costs (a share of a step), and the steps it waits while that rate is too
    low to pay for even one."""

    most: int
    cost: float = ROW_COST
    taken: float = PRIOR[0]
    tried: float = PRIOR[1]
    pause: int = 0  # steps left without proposals
    backoff: int = 1  # the next pause's length

    @property
    def length(self) -> int:
        rate, length = self.taken / self.tried, 0
        while length < self.most and rate ** (length + 1) > self.cost:
            length += 1
        return length

    def next_length(self, room: int) -> int:
        """Tokens to propose this step (0: none), at most `room`; a paused sequence counts
        down its pause. After a pause, one proposal: enough to tell whether the rate has come
        back."""
        if room <= 0:
            return 0
        if self.pause:
            self.pause -= 1
            return 0
        return min(room, max(1, self.length))

    def record(self, proposed: int, accepted: int) -> None:
        # Proposals are tried in order until one is refused: that one was tried, not those after it.
        self.taken = DECAY * self.taken + accepted
        self.tried = DECAY * self.tried + min(proposed, accepted + 1)
        if self.length:
            self.backoff = 1
        else:  # one proposal would not pay: wait, then try one again (longer each time, up to a limit)
            self.pause, self.backoff = self.backoff, min(MAX_PAUSE_STEPS, self.backoff * 2)


def can_speculate(seq: Sequence) -> bool:
    """Whether a decoding sequence's next rows may be checked together: not while its
    sampling depends on the output so far in ways one step's rows do not follow
    (penalties, min_tokens' bans, a grammar, a thinking budget's forced end), nor for beams,
    nor before its first new token (choices fork then, and that token's event carries the
    request's first-token facts)."""
    params = seq.params
    return (seq.num_output_tokens > seq.num_resumed_tokens and seq.guide is None and not params.use_beam_search
            and not params.has_penalties and seq.num_output_tokens >= params.min_tokens
            and params.thinking_budget is None)


def output_room(seq: Sequence) -> int:
    """Tokens `seq` may still propose: its output cap and the window, less the one token
    every step yields anyway."""
    return min(seq.params.max_tokens - seq.num_output_tokens, seq.max_model_len - seq.num_tokens) - 1
