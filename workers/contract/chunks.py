"""What a worker streams back: a request's output as `GenerationChunk`s, and its errors.

Plain dataclasses: cheap to pickle across Ray, no HTTP objects, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.contract.kv_handoff import KVHandoff


@dataclass(frozen=True)
class ErrorInfo:
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class TopLogprob:
    token: str
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model, with the k most likely."""

    token: str
    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob]


@dataclass
class GenerationChunk:
    """New output since the previous chunk of the same choice of a request.

    With n > 1 the chunks of all choices interleave; `index` says whose it is and
    `finish_reason` ends that choice only. Usage counts are per request (all choices).
    `token_ids` are the output tokens consumed since the previous chunk: their text is in
    this chunk, or still held back by the worker (a partial UTF-8 character, a possible
    stop-string start); a resumed request lists every id received
    (workers/contract/continuation.py).
    """

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0  # running total
    # Prompt tokens served from the prefix cache; set from the chunk with the first token
    # on (None before it, and from a worker that does not report it).
    cached_tokens: int | None = None
    prefill_time_ms: float | None = None  # on the chunk that carries the first token
    queue_time_ms: float | None = None  # on that chunk too: waiting before the first model step
    decode_times_ms: list[float] = field(default_factory=list)  # one per later token
    logprobs: list[TokenLogprob] | None = None  # when asked: one per token whose text is in `text` (not EOS)
    prompt_logprobs: list[dict[int, TopLogprob] | None] | None = None  # first chunk only, when asked
    reasoning_open: bool = False  # the prompt ends with `reasoning_start`: the output begins inside it
    error: ErrorInfo | None = None
    # A prefill replica's last chunk of a request it hands over (no output of its own):
    # the ingress goes on with the request on a decode replica (workers/contract/kv_handoff.py).
    handoff: KVHandoff | None = None


