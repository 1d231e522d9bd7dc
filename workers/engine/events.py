"""What a step hands out: one `TokenEvent` per sampled token of a request's choice."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.sequence import FinishReason

TopList = list[tuple[int, float]]


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of one choice of one request, produced by one step."""

    request_id: int
    index: int  # the choice (0 .. n-1)
    token_id: int
    finish_reason: FinishReason | None
    stop_token_id: int | None
    time: float  # perf_counter() when the step finished
    logprob: float | None = None  # when the request asks for logprobs
    top_logprobs: TopList | None = None
    # On a request's first event only, when asked: (token id, logprob, top) per prompt token after the first.
    prompt_logprobs: list[tuple[int, float, TopList]] | None = None
    beam_token_ids: list[int] | None = None  # beam search: a whole finished beam (token_id is -1)
    request_finished: bool = False  # the request's last event
    error: str | None = None  # the request failed inside a model step (token_id is -1)
    error_is_grammar: bool = False  # ... because its output constraint reached a dead end
    queue_time: float | None = None  # seconds waiting before the first step; on the first event
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache; on the first event

