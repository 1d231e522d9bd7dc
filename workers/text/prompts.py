"""Turn chat messages or a plain prompt into token ids with the model's own template.

Tools: a template that renders `tools` gets them (and earlier calls with their
arguments as objects, as such templates expect). A template that ignores tools (the
default SmolLM2 is one) gets chatserve's own rendering instead, from the request's
`ToolPrompt`: the tool list and calling convention appended to the system prompt,
earlier calls written in the model's call format, tool results as user turns. So every
model can call tools, and the parser at the ingress reads the format it was taught.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from workers.contract.errors import WorkerError
from workers.contract.json_text import loads_json_text
from workers.contract.requests import GenerateRequest, ToolPrompt
from workers.contract.tokenize import TokenizeRequest
from workers.core.images import ImageInputs


class PromptError(WorkerError, ValueError):
    """The messages or prompt cannot be templated or tokenized (the field in `param`)."""


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the rendered chat prompt; None for a plain prompt
    images: ImageInputs | None = None  # vision models: pixel inputs and placeholder positions


class PromptBuilder:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self._has_template = bool(template)
        # A template that never mentions `tools` cannot render them.
        self.template_renders_tools = "tools" in str(template or "")

    def build(self, request: GenerateRequest) -> Prompt:
        if request.prompt_token_ids is not None:
            return Prompt(self._checked_ids(request.prompt_token_ids), None)
        if request.prompt is not None:
            text = None
            ids = self.tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
        else:
            text = self.chat_text(request, request.add_generation_prompt, request.continue_final_message)
            # The template already wrote BOS and friends; do not add them twice.
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise PromptError("the prompt is empty after tokenization", "prompt" if request.prompt is not None else "messages")
        return Prompt(list(ids), text)

    def _checked_ids(self, ids: tuple[int, ...]) -> list[int]:
        """A token-id prompt, fed as is: every id must be one of the tokenizer's."""
        vocab = len(self.tokenizer)
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside this model's vocabulary (0..{vocab - 1})", "prompt")
        if not ids:
            raise PromptError("the prompt is empty", "prompt")
        return list(ids)

    def chat_text(self, request: GenerateRequest | TokenizeRequest, add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> str:
        """The rendered chat prompt of a chat request (or of POST /tokenize's `messages`,
        which may ask for the template's other two endings)."""
        if not self._has_template:
            raise PromptError("this model has no chat template; use /v1/completions", "messages")
        messages = [self._render_message(m, i) for i, m in enumerate(request.messages or [])]
        kwargs = dict(request.chat_template_kwargs)
        if self.template_renders_tools:
            messages = [_arguments_as_objects(m) for m in messages]
            if request.tools:
                kwargs["tools"] = request.tools
        elif request.tool_prompt is not None:
            messages = tools_as_text(messages, request.tools or [], request.tool_prompt)
        if continue_final_message:  # only when asked: a chat request may pass it in chat_template_kwargs
            kwargs["continue_final_message"] = True
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # jinja raises for conversations the template rejects
            raise PromptError(f"the model's chat template rejected the messages: {exc}", "messages") from exc

    @staticmethod
    def _render_message(message: dict[str, Any], index: int) -> dict[str, Any]:
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") in ("image", "image_url"):
                    param = f"messages.{index}.content.{j}.image_url"
                    raise PromptError(f"{param}: this model is text-only and does not accept images", param)
                if part.get("type") != "text":
                    raise PromptError(
                        f"content part type {part.get('type')!r} is not supported by this text-only model",
                        f"messages.{index}.content",
                    )
                texts.append(part.get("text", ""))
            content = "".join(texts)
        rendered = dict(message)
        rendered["content"] = content or ""
        return rendered


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Tool-aware templates (Qwen, Llama 3) write `arguments | tojson`: give them the object,
    not the JSON text the API carries, or the arguments would be encoded twice."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        try:
            function["arguments"] = loads_json_text(function["arguments"])
        except (TypeError, ValueError):
            pass  # not JSON: the template gets the text as it is
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def tools_as_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]], fmt: ToolPrompt) -> list[dict[str, Any]]:
    """The conversation with tools, calls and results written as plain text turns."""
    out = [_message_as_text(m, fmt) for m in messages]
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + fmt.system_section).lstrip()}
        else:
            out.insert(0, {"role": "system", "content": fmt.system_section})
    return out


def _message_as_text(message: dict[str, Any], fmt: ToolPrompt) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": fmt.result_open + message["content"] + fmt.result_close}
    if message["role"] == "assistant" and message.get("tool_calls"):
        calls = [_call_text(call["function"], fmt) for call in message["tool_calls"]]
        text = "\n".join(part for part in [message["content"], *calls] if part)
        return {"role": "assistant", "content": text}
    return {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}


def _call_text(function: dict[str, Any], fmt: ToolPrompt) -> str:
    try:
        arguments = loads_json_text(function["arguments"])
    except (TypeError, ValueError):
        arguments = function["arguments"]
    body = json.dumps({"name": function["name"], fmt.arguments_key: arguments}, ensure_ascii=False)
    return fmt.call_open + body + fmt.call_close
