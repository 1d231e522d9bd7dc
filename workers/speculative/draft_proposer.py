"""Draft-model proposals: a smaller model with the target's tokenizer continues each
decoding sequence greedily for a few tokens, every drafted sequence in one batched
forward a token, over its own paged KV cache.

Each target sequence has a shadow: the draft's own `Sequence` (the target's tokens, then
this step's proposals) with its own blocks, kept across steps, so a step feeds the draft
only what the target took since the last one (the accepted proposals' KV is already
there; the refused ones' is written over). A proposal is a single token, not a
distribution, so verification (verification.py) keeps the target's distribution whatever
the draft proposes: the draft only decides how many tokens a step yields."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from workers.contract.sampling_params import SamplingParams
from workers.core.batch import ScheduledChunk
from workers.core.limits import SpeculativeLimits
from workers.core.sequence import Sequence
from workers.speculative.proposals import (
    ProposalPace,
    SpeculationCounts,
    StepCost,
    can_speculate,
    output_room,
)

logger = logging.getLogger(__name__)


class DraftModel(Protocol):
    """The draft's model runner (workers/model/runner.py), over its own KV pool."""

    def forward(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> tuple: ...


class DraftBlocks(Protocol):
    """The draft pool's block manager (workers/engine/block_manager.py)."""

    @property
    def num_free_blocks(self) -> int: ...

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int: ...

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]: ...

    def free(self, seq: Sequence) -> None: ...


@dataclass
class _Shadow:
    seq: Sequence  # the draft's copy of a target sequence
    pace: ProposalPace
    synced: int = 0  # leading tokens known to equal the target's
    proposal: tuple[int, ...] = ()  # this step's
    wanted: int = 0  # the proposal's length this step


class DraftProposer:
    def __init__(self, limits: SpeculativeLimits, model: DraftModel, blocks: DraftBlocks, draft_share: float,
                 chunk_tokens: int) -> None:
        """`draft_share`: a draft step's cost as a share of a target step (engine/model_setup.py
        estimates it), added to the target's measured cost of a row to price a proposed token;
        `chunk_tokens`: the most tokens one shadow catches up in one draft forward (a long
        prompt takes several steps, without proposals until it is in)."""
        self.limits = limits
        self.model = model
        self.blocks = blocks
        self.draft_share = draft_share
        self.chunk_tokens = chunk_tokens
        self.counts = SpeculationCounts()
        self.step_cost = StepCost()
        self._shadows: dict[int, _Shadow] = {}  # by the target's seq_id

    def prepare(self, running: list[Sequence]) -> None:
        """Draft this step's proposals for the running sequences that may take some."""
        self._drop_all_but(running)
        cost = self.step_cost.share(len(running)) + self.draft_share
        drafted: list[_Shadow] = []
        for seq in running:
            shadow = self._shadows.get(seq.seq_id)
            if shadow is not None:
                shadow.proposal = ()
            if seq.num_uncomputed_tokens != 1 or not can_speculate(seq) or seq.image_features is not None:
                continue  # the draft sees no images: a vision request's proposals would be noise
            if shadow is None:
                shadow = self._shadows[seq.seq_id] = _Shadow(self._copy(seq), ProposalPace(self.limits.num_tokens))
            shadow.pace.cost = cost
            shadow.wanted = shadow.pace.next_length(output_room(seq))
            if shadow.wanted:
                _sync(shadow, seq)
                drafted.append(shadow)
        if not drafted:
            return
        try:
            self._draft(drafted)
        except Exception:  # a failed draft costs its proposals, never a request
            logger.exception("the draft model failed; its shadows start over")
            self._drop_all_but([])

    def propose(self, seq: Sequence, room: int) -> tuple[int, ...]:
        shadow = self._shadows.get(seq.seq_id)
        return shadow.proposal[: max(room, 0)] if shadow is not None else ()

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.counts.record(proposed, accepted)
        shadow = self._shadows.get(seq.seq_id)
        if shadow is not None:
            shadow.pace.record(proposed, accepted)

    def finished(self, seq: Sequence) -> None:
        """Nothing to keep: a finished sequence's shadow goes at the next step's prepare."""

    @torch.inference_mode()
    def _draft(self, shadows: list[_Shadow]) -> None:
        """One draft forward a proposed token: the first feeds each shadow's catch-up (the
        target's tokens it lacks, a prompt in chunks), the others one proposal each."""
        feeds: list[tuple[_Shadow, int]] = []
        for shadow in shadows:
            lag = shadow.seq.num_uncomputed_tokens
            n = min(lag, self.chunk_tokens)
            if n < lag:
                shadow.wanted = 0  # catching up a long prompt: no proposal this step
            if self.blocks.blocks_needed(shadow.seq, n + max(shadow.wanted - 1, 0)) <= self.blocks.num_free_blocks:
                feeds.append((shadow, n))
        while feeds:
            feeds = self._feed(feeds)

    def _feed(self, feeds: list[tuple[_Shadow, int]]) -> list[tuple[_Shadow, int]]:
        """One draft forward; the shadows that want another proposal after it."""
        for shadow, n in feeds:
            self.blocks.allocate(shadow.seq, n)
        chunks = [(shadow, ScheduledChunk.of(shadow.seq, n)) for shadow, n in feeds]
        decodes = [(s, c) for s, c in chunks if c.num_tokens == 1 and c.samples]
        prefills = [(s, c) for s, c in chunks if not (c.num_tokens == 1 and c.samples)]
        logits = self.model.forward([c for _, c in decodes], [c for _, c in prefills])[0]
        sampled = [shadow for shadow, chunk in decodes + prefills if chunk.samples]  # the logits rows' order
        tokens = logits.max(dim=-1).indices.tolist() if sampled else []
        for shadow, chunk in chunks:
            shadow.seq.num_computed_tokens += chunk.num_tokens
        again = []
        for shadow, token in zip(sampled, tokens):  # only a caught-up shadow samples, and it wants a proposal
            shadow.seq.token_ids.append(token)
            shadow.proposal += (token,)
            if len(shadow.proposal) < shadow.wanted:
                again.append((shadow, 1))
        return again

    def _drop_all_but(self, running: list[Sequence]) -> None:
        """Free the shadows of sequences no longer running (finished, aborted, preempted)."""
        live = {seq.seq_id for seq in running}
        for seq_id in [k for k in self._shadows if k not in live]:
            self.blocks.free(self._shadows.pop(seq_id).seq)

    @staticmethod
    def _copy(seq: Sequence) -> Sequence:
        return Sequence(seq_id=seq.seq_id, token_ids=list(seq.token_ids), params=SamplingParams(),
                        eos_token_ids=frozenset(), max_model_len=seq.max_model_len)


def _sync(shadow: _Shadow, target: Sequence) -> None:
    """Make the shadow's tokens the target's: keep the common start (and its KV), drop
    the rest (last step's refused proposals), add what the target took since."""
    mine, theirs = shadow.seq.token_ids, target.token_ids
    # A target cut back below what was synced (a resume, an undone step) is compared afresh.
    common = shadow.synced if shadow.synced <= len(theirs) else 0
    end = min(len(mine), len(theirs))
    while common < end and mine[common] == theirs[common]:
        common += 1
    del mine[common:]
    mine.extend(theirs[common:])
    # The last token is always fed again: its logits row gives the first proposal (when the
    # target has not moved since the last draft, its K/V is there already and written anew).
    shadow.seq.num_computed_tokens = min(shadow.seq.num_computed_tokens, common, len(theirs) - 1)
    shadow.synced = len(theirs)
