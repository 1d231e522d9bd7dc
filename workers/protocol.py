"""The typed contract between the ingress and a model worker (what crosses the handle).

Plain dataclasses: cheap to pickle across Ray, no HTTP objects, usable by any Ray app.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.sampling_params import SamplingParams


@dataclass(frozen=True)
class ImageData:
    """One image of a chat request: its encoded file (PNG, JPEG, ...), already fetched and
    size-capped by the ingress (serve_app/media.py); the worker decodes and checks it."""

    data: bytes
    param: str  # where the request put it, e.g. "messages.0.content.1.image_url" (named in errors)


@dataclass(frozen=True)
class ToolPrompt:
    """How tools and earlier calls are written as text for a model whose chat template
    ignores tools (workers/prompts.py). Built at the ingress by the model's tool-call
    parser (serve_app/tool_parsers.py), the one module that knows the call format."""

    system_section: str  # the tool list and the calling convention, added to the system prompt
    call_open: str  # an earlier call is written call_open + {"name", arguments_key} JSON + call_close
    call_close: str
    arguments_key: str
    result_open: str  # a tool result is a user turn: result_open + content + result_close
    result_close: str


@dataclass(frozen=True)
class GenerateRequest:
    """Exactly one of `messages` (chat) or `prompt` (plain completion).

    An image sits in its message as `{"type": "image", "image_index": k}`; its bytes are
    `images[k]`.
    """

    request_id: str
    params: SamplingParams
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None  # None: the rest of the context window
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    images: tuple[ImageData, ...] = ()
    tools: list[dict[str, Any]] | None = None  # OpenAI tool objects the model may call
    tool_prompt: ToolPrompt | None = None  # used when the chat template ignores tools
    reasoning_start: str | None = None  # e.g. "<think>": the worker reports a prompt ending with it


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
    logprobs: list[TokenLogprob] | None = None  # one per token of `text`, when asked
    prompt_logprobs: list[dict[int, TopLogprob] | None] | None = None  # first chunk only, when asked
    reasoning_open: bool = False  # the prompt ends with `reasoning_start`: the output begins inside it
    error: ErrorInfo | None = None


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int
    vocab_size: int
    kv_cache_blocks: int
    block_size: int
    accepts_images: bool = False  # a vision-language model
    dtype: str = ""  # what the weights run in (`auto` resolved), e.g. "bfloat16"
    packed_linear_layers: int = 0  # CPU: layers with oneDNN-packed weights (bfloat16, or float32 where faster)
    fused_projections: int = 0  # groups of sibling projections (q/k/v, gate/up) run as one multiply each
    decode_attention: str = "sdpa"  # "triton": the paged kernel (CUDA); "sdpa": over a gather
    cuda_graph_max_batch: int = 0  # decode steps up to this batch replay CUDA graphs (0: none)


@dataclass(frozen=True)
class WorkerStats:
    active_requests: int
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    engine_steps: int
    prefix_cache_query_tokens: int = 0  # counters: prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # ... and found there
    pid: int = 0  # the replica's process: a new pid means the replica was replaced
    rss_bytes: int = 0  # its resident memory (Linux; 0 elsewhere)
