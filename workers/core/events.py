"""What a step hands out: one `TokenEvent` per sampled token of a request's choice, and
how a step's sampled tokens become events."""

from __future__ import annotations

import time
from dataclasses import dataclass

from workers.core.request_table import RequestTable
from workers.core.sequence import FinishReason, Sequence

TopList = list[tuple[int, float]]
StepResult = tuple[Sequence, int, "FinishReason | None"]  # (choice, sampled token, why it ended)


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
    embedding: list[float] | None = None  # an embedding request's vector (its one event; token_id is -1)


def token_events(results: list[StepResult], logprobs: dict[int, tuple[float, TopList]],
                 requests: RequestTable) -> list[TokenEvent]:
    """The events of a step's sampled tokens (`logprobs` by row, when asked). A choice that
    ended leaves `requests` first, so its request's last choice says the request finished."""
    now = time.perf_counter()
    events = []
    for row, (seq, token, reason) in enumerate(results):
        if reason is not None:
            requests.retire(seq)
        lp, top = logprobs.get(row, (None, None))
        first_token = seq.lead and seq.num_output_tokens == seq.num_resumed_tokens + 1
        first = first_token and seq.params.prompt_logprobs is not None
        events.append(
            TokenEvent(
                request_id=seq.request_id,
                index=seq.index,
                token_id=token,
                finish_reason=reason,
                stop_token_id=seq.stop_token_id,
                time=now,
                logprob=lp,
                top_logprobs=top,
                prompt_logprobs=list(seq.prompt_logprobs) if first else None,
                request_finished=reason is not None and seq.request_id not in requests,
                queue_time=seq.queue_time if first_token else None,
                cached_tokens=_cached_prompt_tokens(seq) if first_token else None,
            )
        )
    return events


def _cached_prompt_tokens(seq: Sequence) -> int | None:
    """Prompt tokens found in the prefix cache (a resumed sequence may also find some of
    its given output there, which is not prompt)."""
    cached = seq.num_cached_tokens
    return None if cached is None else min(cached, seq.num_prompt_tokens)
