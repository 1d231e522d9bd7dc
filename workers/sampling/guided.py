"""Constrained decoding: each guided sequence's grammar state, and the batch's token mask.

llguidance (Rust) does the grammar work: a `GuidedDecoding` compiles to an `LLMatcher`
against an `LLTokenizer` built once per engine. Each step, the matchers of the rows
that sample fill one int32 bitmask in a single call (llguidance spreads the rows over
its own threads, without the GIL); the sampler turns it into one boolean tensor and
sets every forbidden logit to -inf after bias and penalties, so the mask always wins.
After sampling, each guided sequence feeds its token to its matcher.

End of output: the mask allows an EOS token only where the grammar may end, and only
EOS once the grammar can take nothing more; a sampled EOS ends the sequence (`stop`,
even with ignore_eos). The matcher never consumes that EOS, so it always holds exactly
the sequence's output tokens; undoing a failed step rolls it back to them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch

from workers.contract.grammar import GuidedDecodingError, grammar_text
from workers.contract.sampling_params import GuidedDecoding


class GuideState:
    """One sequence's matcher; it has consumed exactly the sequence's output tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.num_tokens = 0

    def fork(self) -> "GuideState":
        """An independent copy for a sibling choice (n > 1)."""
        child = GuideState(self.matcher.deep_copy(), self.eos_token_ids)
        child.num_tokens = self.num_tokens
        return child

    @property
    def is_complete(self) -> bool:
        """The grammar can take no more tokens: only EOS is allowed now."""
        return self.matcher.is_stopped()

    def advance(self, token_id: int) -> bool:
        """Feed a sampled token; True when it is an EOS that ends the (complete) output."""
        if token_id in self.eos_token_ids:
            if not self.matcher.is_accepting():
                raise GuidedDecodingError(f"EOS sampled where the grammar cannot end ({self._state()})")
            return True
        if not self.matcher.consume_token(token_id):
            raise GuidedDecodingError(f"token {token_id} rejected by the grammar: {self._state()}")
        self.num_tokens += 1
        return False

    def allowed_prefix(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        """The leading `tokens` the grammar takes from here, up to any EOS (speculative
        proposals: a guided sequence feeds only tokens it could emit; an EOS is left to
        the rows' own sampling, as it ends the output rather than being consumed)."""
        allowed = tokens[: self.matcher.validate_tokens(list(tokens))] if tokens else ()
        for index, token in enumerate(allowed):
            if token in self.eos_token_ids:
                return allowed[:index]
        return allowed

    def truncate(self, output_token_ids: list[int]) -> None:
        """Undo tokens fed since the sequence held `output_token_ids` (a failed step)."""
        extra = self.num_tokens - len(output_token_ids)
        if extra == 0:
            return
        if not self.matcher.rollback(extra):
            self.matcher.reset()
            self.matcher.consume_tokens(output_token_ids)
        self.num_tokens = len(output_token_ids)

    def check(self) -> None:
        if self.matcher.is_error():
            raise GuidedDecodingError(f"grammar state is broken: {self._state()}")

    def _state(self) -> str:
        # llguidance appends a multi-line parser dump; its first line says what went wrong.
        return (self.matcher.get_error() or "no error reported").splitlines()[0]


@dataclass
class GuidedMask:
    """Which logits a batch's guided rows may keep."""

    rows: torch.Tensor  # [G] long: the batch rows that are guided
    forbidden: torch.Tensor  # [G, V] bool
    all_rows: bool  # every row of the batch is guided (G == S)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` [S, V] with the forbidden entries of the guided rows at -inf."""
        if self.all_rows:
            return logits.masked_fill(self.forbidden, float("-inf"))
        masked = logits.index_select(0, self.rows).masked_fill_(self.forbidden, float("-inf"))
        return logits.index_copy(0, self.rows, masked)


# Row b of the table: which of the 8 tokens a mask byte of value b forbids. Unpacking by
# table lookup is ~5x faster than shifting every int32 word 32 times. llguidance writes
# little-endian words, so byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7.
assert sys.byteorder == "little"
_FORBIDDEN_BY_BYTE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0


class GuidedDecoder:
    """Per engine: the llguidance tokenizer, grammar compilation and the batched mask."""

    def __init__(self, hf_tokenizer, model_vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        eos = sorted(eos_token_ids) or None  # None: the tokenizer's own EOS
        # The model's logits may be wider than the tokenizer (padded embeddings): ids past
        # the tokenizer have no bytes, so llguidance never allows them.
        n_vocab = max(model_vocab_size, len(hf_tokenizer))
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
        self.eos_token_ids = frozenset(self.tokenizer.eos_tokens)
        self.model_vocab_size = model_vocab_size
        # Masks are filled between forward passes, when the cores are free; but each row
        # takes microseconds for typical JSON grammars, so more threads than this only add
        # dispatch cost (llguidance's default was 4x slower at 16 rows on 2 cores).
        self.executor = llguidance.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))

    def compile(self, guided: GuidedDecoding) -> GuideState:
        """A fresh matcher; raises GuidedDecodingError for a grammar llguidance rejects.
        Thread-safe: the API worker compiles off the engine thread."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(guided), log_level=0)
        if matcher.is_error():
            raise GuidedDecodingError(f"invalid {guided.kind} grammar: {matcher.get_error()}", guided.param)
        # A grammar can be valid and still admit no output at all (`{"$ref": "#"}`); the
        # first mask shows it, and computing it leaves the matcher where it was.
        matcher.compute_bitmask()
        if matcher.is_error():
            raise GuidedDecodingError("it admits no output at all (e.g. a schema that only refers to itself)",
                                      guided.param)
        return GuideState(matcher, self.eos_token_ids)

    def mask(self, guides: list[GuideState | None], device: torch.device,
             drafts: dict[int, tuple[int, ...]] | None = None) -> GuidedMask | None:
        """The mask of a batch whose row i is guided by guides[i] (None: unconstrained).
        `drafts`: a verified sequence's first row -> its proposals; its next len(draft)
        rows (guided by the same guide) get the grammar's masks after each proposal (an
        unguided sequence's entry is not read)."""
        rows = [i for i, g in enumerate(guides) if g is not None]
        if not rows:
            return None
        for i in rows:
            guides[i].check()  # a broken matcher would allow only EOS: fail loudly instead
        words = (self.tokenizer.vocab_size + 31) // 32
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)  # contiguous, on the CPU, as the call needs
        # What llguidance.torch.fill_next_token_bitmask_par does, without importing that
        # module: it defines a torch.compile'd function at import, which loads dynamo and
        # inductor (2.4 s of every worker's start).
        if drafts:
            # llguidance advances a matcher through the draft for the later rows and rolls it back.
            later = {first + j for first, draft in drafts.items() for j in range(1, len(draft) + 1)}
            self.executor.unsafe_compute_mask_ptr_with_draft_token(
                [(guides[i].matcher, k, list(drafts.get(i, ()))) for k, i in enumerate(rows) if i not in later],
                bitmask.data_ptr(), words * 4, len(rows))
        else:
            self.executor.unsafe_compute_mask_ptr([(guides[i].matcher, k) for k, i in enumerate(rows)],
                                                  bitmask.data_ptr(), words * 4, len(rows))
        by_byte = bitmask.view(torch.uint8).view(-1).int()
        forbidden = _FORBIDDEN_BY_BYTE.index_select(0, by_byte).view(len(rows), words * 32)[:, : self.model_vocab_size]
        return GuidedMask(torch.tensor(rows, device=device), forbidden.to(device), len(rows) == len(guides))
