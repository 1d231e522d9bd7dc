"""What every proposer shares: which sequences may be checked several tokens at a time,
how many tokens one proposes (paced by its own recent rate of accepted proposals), and
the counters /metrics reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from workers.core.limits import SpeculativeLimits
from workers.core.sequence import Sequence

MAX_PAUSE_STEPS = 32  # the longest a sequence goes without proposals after repeated rejections

# A proposed token costs the target model a share of a step (the row it adds), and an
# accepted one saves its sequence a step: the j-th proposal pays while the chance that all
# j are taken, about rate ** j, is above that share. The share is measured on the engine's
# own steps (StepCost): it differs by machine and path, e.g. the default model on a 2-core
# AVX2 EPYC, 0.2 of a step with a Python call per operation (fixed costs dominate) and 0.75
# in one C call a step (the products' integer work dominates). ROW_COST is the share before
# any measurement.
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
    step_cost: StepCost  # the engine records its decode and verification steps here

    def prepare(self, running: list[Sequence]) -> None:
        """Called once a step that proposes, before any `propose`, with the running sequences."""

    def propose(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """At most `room` proposed tokens to follow `seq`'s last one (empty: decode plainly)."""

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verification's outcome: `accepted` of the `proposed` tokens were the model's own."""

    def finished(self, seq: Sequence) -> None:
        """`seq` ended (its finish_reason says how); its output is final."""


FIT_DECAY = 0.97  # the weight of a step timing after each newer one (~30 steps' memory)
MIN_ROW_SPREAD = 0.05  # the variance of rows a step that a line's slope needs
SHARE_RANGE = (0.02, 2.0)


class StepCost:
    """What one more row costs a step of decode and verification rows, as a share of the
    step's time per running sequence: a line through the engine's recent (rows, seconds),
    each step weighted FIT_DECAY times less than the next. A step with B sequences costs
    a + b (B + proposals); an accepted proposal saves its sequence (a + b B) / B, so a
    proposal pays while its chance beats b B / (a + b B). Until the rows have varied
    enough to fit a line, the share is `prior` (always, with `learn` off: a fixed price, for
    tests that want proposals at any rate of acceptance)."""

    def __init__(self, prior: float = ROW_COST, learn: bool = True):
        self.prior, self.learn = prior, learn
        self._sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows * seconds
        self._fit: tuple[float, float] | None = None  # seconds a step, a row

    def record(self, rows: int, seconds: float) -> None:
        if not self.learn:
            return
        w, n, t, nn, nt = (FIT_DECAY * v for v in self._sums)
        w, n, t, nn, nt = w + 1, n + rows, t + seconds, nn + rows * rows, nt + rows * seconds
        self._sums = [w, n, t, nn, nt]
        spread = w * nn - n * n
        if spread > MIN_ROW_SPREAD * w * w:
            slope = max((w * nt - n * t) / spread, 0.0)
            self._fit = (max((t - slope * n) / w, 0.0), slope)

    @property
    def fitted(self) -> bool:
        """Whether the share is measured (else the prior)."""
        return self._fit is not None

    def share(self, sequences: int) -> float:
        """A row's cost as a share of a step's time per sequence, with `sequences` running."""
        if self._fit is None or sequences <= 0:
            return self.prior
        fixed, per_row = self._fit
        per_sequence = (fixed + per_row * sequences) / sequences
        if per_sequence <= 0:
            return self.prior
        return min(max(per_row / per_sequence, SHARE_RANGE[0]), SHARE_RANGE[1])


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
    """Whether a decoding sequence's next rows may be checked together: not for beams, nor
    before its first new token (choices fork then, and that token's event carries the
    request's first-token facts). The rest follows the rows: the scheduler keeps the
    proposals a grammar takes and those a thinking budget forces nothing after, and each
    row gets the grammar's mask, the penalties' counts and min_tokens' bans as of the
    proposals before it (the engine's `_draw` drafts and pending rows). Except a guided
    request still under min_tokens: a plain step lifts the ban once the grammar is
    complete, which a row cannot see when the proposals before it complete it."""
    params = seq.params
    return (seq.num_output_tokens > seq.num_resumed_tokens and not params.use_beam_search
            and not (seq.guide is not None and seq.num_output_tokens < params.min_tokens))


def output_room(seq: Sequence) -> int:
    """Tokens `seq` may still propose: its output cap and the window, less the one token
    every step yields anyway."""
    return min(seq.params.max_tokens - seq.num_output_tokens, seq.max_model_len - seq.num_tokens) - 1
