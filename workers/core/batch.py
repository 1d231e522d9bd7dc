"""The data of one step: which chunks of which sequences it computes (`ScheduledBatch`),
and which extra logits rows score prompt tokens (speculative decoding's rows that check
proposals come after those). The scheduler builds it, the model
runner reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.core.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at its first uncomputed position.

    `samples` is fixed when scheduled: the chunk reaches the end of the sequence, so
    the step yields a token for it.
    """

    seq: Sequence
    num_tokens: int
    samples: bool
    # Speculative decoding: proposed tokens fed after the sequence's last one (num_tokens is
    # 1 + len(draft)); the step's logits at every fed position check them.
    draft: tuple[int, ...] = ()

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> "ScheduledChunk":
        return cls(seq, num_tokens, seq.num_computed_tokens + num_tokens == seq.num_tokens)

    @classmethod
    def verifying(cls, seq: Sequence, draft: tuple[int, ...]) -> "ScheduledChunk":
        """A decoding sequence's last token and the proposed tokens after it."""
        return cls(seq, 1 + len(draft), True, draft)

    def fed_token_ids(self) -> list[int]:
        """The token ids this chunk feeds, from its first uncomputed position."""
        start = self.seq.num_computed_tokens
        return self.seq.token_ids[start : start + self.num_tokens - len(self.draft)] + list(self.draft)


@dataclass(frozen=True)
class PromptLogitRows:
    """Logits rows (after the S sampling rows) that score prompt tokens of one chunk."""

    seq: Sequence
    first_position: int  # the row for position p predicts prompt token p + 1
    count: int


@dataclass(frozen=True)
class PoolRows:
    """The last `count` rows of one chunk of an embedding sequence, whose final hidden
    states pool into its vector; `final`: the chunk ends the prompt (the vector is whole);
    `restart`: the chunk starts the prompt (a preempted sequence computes it again)."""

    seq: Sequence
    count: int
    final: bool
    restart: bool = False


@dataclass
class ScheduledBatch:
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    def add(self, chunk: ScheduledChunk) -> None:
        # A decode is one query token that samples; everything else is a prefill span (an
        # embedding's last prompt token too: it pools, never samples, so the decode-only
        # paths (CUDA graphs, async scheduling) never see it).
        if chunk.num_tokens == 1 and chunk.samples and chunk.seq.params.pooling is None:
            self.decodes.append(chunk)
        else:
            self.prefills.append(chunk)

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        """Chunks that yield a token this step, in the model runner's logits order."""
        return self.decodes + [c for c in self.prefills if c.samples]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def drafted(self) -> list[ScheduledChunk]:
        """Chunks that feed proposed tokens, in the model runner's order of their draft rows."""
        return [c for c in self.prefills if c.draft]

