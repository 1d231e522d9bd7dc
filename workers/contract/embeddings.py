"""What `POST /v1/embeddings` asks of a worker, and what it answers: one vector per input,
pooled from the served model's final hidden states (workers/serving/embeddings.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EmbedRequest:
    """Exactly one of `texts` (tokenized with the model's special tokens, as a completion
    prompt is) or `token_ids` (fed as they are)."""

    request_id: str
    texts: tuple[str, ...] | None = None
    token_ids: tuple[tuple[int, ...], ...] | None = None
    dimensions: int | None = None  # keep the first `dimensions` values (Matryoshka models only)
    trace_context: dict[str, str] | None = None  # the ingress span's W3C context (a sampled, traced request)


@dataclass(frozen=True)
class EmbedResult:
    embeddings: list[list[float]]  # one per input, in order
    prompt_tokens: int  # all inputs' tokens
