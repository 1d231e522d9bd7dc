"""What the ingress asks of a worker: one generation request, with its images, tool prompt
and (when it resumes a broken stream) what its client has already received.

Plain frozen dataclasses: cheap to pickle across Ray, no HTTP objects, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.contract.continuation import Continuation
from workers.contract.kv_handoff import KVHandoff
from workers.contract.lora import LoraRequest
from workers.contract.sampling_params import SamplingParams


@dataclass(frozen=True)
class ImageData:
    """One image of a chat request: its encoded file (PNG, JPEG, ...), already fetched and
    size-capped by the ingress (serve_app/media/images.py); the worker decodes and checks it."""

    data: bytes
    param: str  # where the request put it, e.g. "messages.0.content.1.image_url" (named in errors)


@dataclass(frozen=True)
class ToolPrompt:
    """How tools and earlier calls are written as text for a model whose chat template
    ignores tools (workers/text/prompts.py). Built at the ingress by the model's tool-call
    parser (serve_app/output/tool_parsers.py), the one module that knows the call format."""

    system_section: str  # the tool list and the calling convention, added to the system prompt
    call_open: str  # an earlier call is written call_open + {"name", arguments_key} JSON + call_close
    call_close: str
    arguments_key: str
    result_open: str  # a tool result is a user turn: result_open + content + result_close
    result_close: str


@dataclass(frozen=True)
class GenerateRequest:
    """Exactly one of `messages` (chat), `prompt` or `prompt_token_ids` (plain completion).

    An image sits in its message as `{"type": "image", "image_index": k}`; its bytes are
    `images[k]`.
    """

    request_id: str
    params: SamplingParams
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # a completion prompt already tokenized, fed as is
    max_tokens: int | None = None  # None: the model's default_max_tokens, within the context window
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The template's ending (chat only, vLLM's names): the assistant's turn opened, or the
    # last (assistant) message left open for the answer to continue.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    images: tuple[ImageData, ...] = ()
    tools: list[dict[str, Any]] | None = None  # OpenAI tool objects the model may call
    tool_prompt: ToolPrompt | None = None  # used when the chat template ignores tools
    reasoning_start: str | None = None  # e.g. "<think>": the worker reports a prompt ending with it
    # The ingress replica that sent it: its chunks go by that ingress's channel when the
    # worker replica has one open (serve_app/transport/channels.py), else by the call itself.
    ingress_id: str | None = None
    resume: Continuation | None = None  # go on from output already delivered (workers/contract/continuation.py)
    # Prefill/decode disaggregation (workers/contract/kv_handoff.py): run only until each
    # choice has its first token, then hand the prompt's KV blocks over ...
    prefill_only: bool = False
    kv_handoff: KVHandoff | None = None  # ... and, on the decode side, where to take them from
    lora: LoraRequest | None = None  # the adapter `model` named (None: the base model)
    # Keeps a conversation on one worker replica (the router's prefix-aware choice,
    # serve_app/transport/prefix_routing.py): the `x-session-id` header, else the body's `user`.
    session_key: str | None = None
    # The W3C `traceparent` (and `tracestate`) of the ingress's span for this request, set
    # only when that span is sampled (workers/contract/tracing.py): the worker's spans are
    # its children. None: the request is not traced.
    trace_context: dict[str, str] | None = None

