"""Resuming a request from output it already produced (on a replica that went away):
each unfinished choice becomes a sequence whose output starts with the given ids.

The given ids are prefilled with the prompt (the prefix cache makes that cheap where the
blocks survive) but are output in every other respect: they count towards max_tokens
and min_tokens, penalties see them, the grammar state is advanced through them, and a
seeded choice draws at the next output position (workers/sampling/seeded_draws.py), so
greedy and seeded choices go on exactly as an uninterrupted run would. Each choice is a
sequence of its own (their outputs differ, so there is nothing to fork); prompt
log-probabilities were sent with the first run and are not scored again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from workers.contract.errors import WorkerError
from workers.contract.grammar import GuidedDecodingError
from workers.contract.sampling_params import SamplingParams
from workers.core.sequence import FinishReason, Sequence
from workers.sampling.guided import GuideState


class ContinuationError(WorkerError, ValueError):
    """The given output cannot be continued: an id outside the vocabulary, ids past the
    output's own end, or ids the request's grammar rejects."""

    param = "resume"
    code = "invalid_continuation"
    prefix = "the request cannot be resumed: "


@dataclass
class ResumedChoice:
    """One choice of a resumed request, its given output replayed through the stop rules."""

    index: int
    output_ids: list[int]
    guide: GuideState | None = None  # its own grammar state, advanced through output_ids
    finish_reason: FinishReason | None = None  # the given ids already end the choice
    stop_token_id: int | None = None  # ... with this stop token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class OutputRules:
    """What decides where a request's output ends, and which ids exist."""

    eos_token_ids: frozenset[int]
    max_model_len: int
    vocab_size: int


def replay_choices(prompt_ids: list[int], outputs: dict[int, list[int]], params: SamplingParams,
                   guide: GuideState | None, rules: OutputRules) -> list[ResumedChoice]:
    """Each choice's given ids (choice index -> ids) replayed as if sampled: raises
    ContinuationError for a continuation that cannot be. `guide`, the request's compiled
    grammar, is copied for each choice."""
    if params.use_beam_search:
        raise ContinuationError("beam search resumes from the start only")
    return [_replay(prompt_ids, index, ids, params, guide.fork() if guide else None, rules)
            for index, ids in sorted(outputs.items())]


def _replay(prompt_ids: list[int], index: int, output_ids: list[int], params: SamplingParams,
            guide: GuideState | None, rules: OutputRules) -> ResumedChoice:
    if any(not 0 <= t < rules.vocab_size for t in output_ids):
        raise ContinuationError(f"choice {index}: a token id outside the vocabulary")
    # The very rules a sampled token goes through (Sequence.append_token): nothing to keep in sync.
    seq = Sequence(0, list(prompt_ids), params, rules.eos_token_ids, rules.max_model_len, index=index, guide=guide)
    reason = None
    for position, token in enumerate(output_ids):
        if reason is not None:
            raise ContinuationError(f"choice {index}: the given tokens go on after the output ended "
                                    f"(at output position {position})")
        try:
            reason = seq.append_token(token)
        except GuidedDecodingError as exc:
            raise ContinuationError(f"choice {index}: the output constraint rejects the given tokens ({exc})") from exc
    return ResumedChoice(index, list(output_ids), guide, reason, seq.stop_token_id)


def resumed_sequences(template: Sequence, choices: list[ResumedChoice], seq_ids: Iterator[int]) -> list[Sequence]:
    """One sequence per (unfinished) choice, each a copy of `template` (the request's
    prompt, images and limits; not scheduled, and left out) plus its given output. They
    keep the template's request id."""
    if not choices or any(c.finished for c in choices):
        raise ValueError("only unfinished choices are resumed, and at least one")
    params = dataclasses.replace(template.params, n=1, prompt_logprobs=None)
    template.guide = None  # each choice brings its own grammar state, advanced through its output
    seqs = [template.fork(next(seq_ids), c.index) for c in choices]
    seqs[0].lead = True  # its first new token carries the request's queue time and cached tokens
    for seq, choice in zip(seqs, choices):
        seq.params, seq.guide = params, choice.guide
        seq.token_ids.extend(choice.output_ids)
        seq.num_resumed_tokens = len(choice.output_ids)
    return seqs
