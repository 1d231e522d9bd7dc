"""Turn chat messages or a plain prompt into token ids with the model's own template."""

from __future__ import annotations

from typing import Any

from workers.protocol import GenerateRequest


class PromptError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptBuilder:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._has_template = bool(getattr(tokenizer, "chat_template", None))

    def token_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt is not None:
            ids = self.tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = self._chat_ids(request.messages or [], request.chat_template_kwargs)
        if not ids:
            raise PromptError("the prompt is empty after tokenization", "prompt" if request.prompt is not None else "messages")
        return list(ids)

    def _chat_ids(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        if not self._has_template:
            raise PromptError("this model has no chat template; use /v1/completions", "messages")
        rendered = [self._render_message(m, i) for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(
                rendered, tokenize=False, add_generation_prompt=True, **template_kwargs
            )
        except Exception as exc:  # jinja raises for conversations the template rejects
            raise PromptError(f"the model's chat template rejected the messages: {exc}", "messages") from exc
        # The template already wrote BOS and friends; do not add them twice.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

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
