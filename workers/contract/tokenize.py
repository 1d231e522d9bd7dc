"""What the ingress asks of a worker for POST /tokenize and /detokenize, and the answers.

The ingress holds no tokenizer: it sends these to the model's worker, which tokenizes
with the model's own tokenizer and chat prompt builder (workers/serving/tokenization.py).
Plain frozen dataclasses: cheap to pickle across Ray, no HTTP objects, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.contract.requests import ToolPrompt


@dataclass(frozen=True)
class TokenizeRequest:
    """Exactly one of `prompt` (plain text) or `messages` (a chat, templated as a chat
    request's are: the same fields as `GenerateRequest`'s, the same builder)."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # chat only
    continue_final_message: bool = False  # chat only: the last (assistant) message is left open
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    tool_prompt: ToolPrompt | None = None  # used when the chat template ignores tools
    return_token_strs: bool = False


@dataclass(frozen=True)
class TokenizeResult:
    tokens: list[int]
    max_model_len: int
    token_strs: list[str] | None = None  # when asked: each token as the tokenizer's vocabulary writes it


@dataclass(frozen=True)
class DetokenizeRequest:
    tokens: list[int]  # non-negative (checked by the ingress); the worker checks the vocabulary


@dataclass(frozen=True)
class DetokenizeResult:
    prompt: str
