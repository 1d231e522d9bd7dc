"""One request's token state as the engine sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from workers.contract.sampling_params import SamplingParams
from workers.core.images import ImageFeatures
from workers.core.seed_streams import stream_key
from workers.core.thinking import ThinkingState


class GrammarState(Protocol):
    """A sequence's grammar state, as the engine drives it (workers/sampling/guided.py makes it)."""

    @property
    def is_complete(self) -> bool: ...

    def advance(self, token_id: int) -> bool: ...

    def fork(self) -> "GrammarState": ...

    def truncate(self, output_token_ids: list[int]) -> None: ...


class Adapter(Protocol):
    """A sequence's LoRA adapter, as the engine holds it (workers/lora/peft_files.py reads it)."""

    @property
    def name(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def rank(self) -> int: ...


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or (set by the request processor) a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the caller


@dataclass(eq=False)
class Sequence:
    """Tokens, cache position and finish state of one request.

    `token_ids` holds prompt + generated tokens in one list so a prefill after
    preemption recomputes exactly what was there. `num_computed_tokens` counts the
    tokens whose K/V are in the cache; the rest are fed to the model next. A resumed
    choice (workers/engine/resume.py) starts with output tokens produced elsewhere:
    they are prefilled with the prompt but count as output.
    """

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    request_id: int = -1  # shared by the n choices of one request; -1: same as seq_id
    index: int = 0  # which choice of its request
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    # Its first new token carries the request's queue time and cached tokens: choice 0,
    # or the first choice of a resumed request.
    lead: bool = True
    num_resumed_tokens: int = 0  # output tokens it started with (produced before a resume)
    seed_key: tuple[int, int] | None = None  # seeded: its draws' key (seed, choice), set from params
    cum_logprob: float = 0.0  # beam search only
    arrival_time: float = 0.0  # perf_counter() when the engine took the request
    queue_time: float | None = None  # seconds from arrival to its first scheduled step
    # (token_id, logprob, top [(id, logprob)]) per prompt position after the first.
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    # Prefix cache: mixed into the first block's hash, so equal token ids with different
    # hidden content (image placeholders of different images, another LoRA adapter's
    # K/V) never share blocks.
    cache_salt: bytes = b""
    image_features: ImageFeatures | None = None  # vision models: by prompt position, fed by the model runner
    guide: GrammarState | None = None  # the grammar state when params.guided is set
    lora: Adapter | None = None  # its adapter (held here, so unloading it never strands a queued request)
    lora_slot: int | None = None  # the adapter's device slot while the sequence runs (LoraManager.admit)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hash of each full block, memoised
    num_cached_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    # params.thinking_budget's state; None until asked for, and again whenever the tokens
    # change other than by appending (built from them: workers/core/thinking.py)
    _thinking: ThinkingState | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.arrival_time = self.arrival_time or time.perf_counter()
        if self.request_id < 0:
            self.request_id = self.seq_id
        if self.params.seed is not None:
            # Draws hash (seed, choice, output position): choices differ, and a choice's k-th
            # token draws the same number whatever its batch, preemption or resumption.
            self.seed_key = stream_key(self.params.seed, self.index)

    def fork(self, seq_id: int, index: int) -> "Sequence":
        """A sibling choice: same tokens and cache progress; blocks are shared by the caller."""
        child = Sequence(
            seq_id=seq_id,
            token_ids=list(self.token_ids),
            params=self.params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            request_id=self.request_id,
            index=index,
            lead=False,
            cache_salt=self.cache_salt,
            image_features=self.image_features,
            lora=self.lora,
        )
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.guide = self.guide.fork() if self.guide is not None else None
        child.block_hashes = list(self.block_hashes)
        child.num_cached_blocks = self.num_cached_blocks
        child.num_cached_tokens = self.num_cached_tokens
        return child

    def truncate(self, num_tokens: int, block_size: int) -> None:
        """Drop tokens past `num_tokens` (undoing a failed step), and the hashes of blocks they completed."""
        self._thinking = None
        del self.token_ids[num_tokens:]
        del self.block_hashes[num_tokens // block_size :]

    @property
    def needs_fork(self) -> bool:
        """Choice 0 of an n > 1 request that has just finished its prompt."""
        params = self.params
        return params.n > 1 and not params.use_beam_search and self.index == 0 and self.num_output_tokens == 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def forced_token(self) -> int | None:
        """The token its thinking budget makes the next one (None: sampled freely). Not
        under a grammar, which governs every token of the output itself."""
        budget = self.params.thinking_budget
        if budget is None or self.guide is not None:
            return None
        if self._thinking is None:
            self._thinking = ThinkingState(budget, self.token_ids[:self.num_prompt_tokens], self.output_token_ids)
        return self._thinking.forced_token()

    def unforced_prefix(self, draft: tuple[int, ...]) -> tuple[int, ...]:
        """The leading part of proposed tokens `draft` that its thinking budget forces nothing
        after (all of it without a budget; none when the next token is forced): each
        verification row is then drawn freely, as the same row of a plain step would be."""
        if self.params.thinking_budget is None or self.guide is not None:
            return draft
        if self.forced_token() is not None:
            return ()
        return draft[: self._thinking.free_run(draft)]

    def append_token(self, token_id: int) -> FinishReason | None:
        """Add a sampled token and return why the sequence ends now, if it does."""
        self.token_ids.append(token_id)
        if self._thinking is not None:
            self._thinking.push(token_id)
        if self.guide is not None and self.guide.advance(token_id):
            return FinishReason.STOP  # EOS where the grammar is complete (also with ignore_eos)
        params = self.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            self.stop_token_id = token_id
            return FinishReason.STOP
        if self.reaches_length_limit():
            return FinishReason.LENGTH
        return None

    def reaches_length_limit(self, pending: int = 0) -> bool:
        """Whether max_tokens or the context window is reached once `pending` more tokens
        are appended (async scheduling knows one token is on its way)."""
        return (self.num_output_tokens + pending >= self.params.max_tokens
                or self.num_tokens + pending >= self.max_model_len)
