"""POST /tokenize and /detokenize on the worker: the model's own tokenizer, and for chats
the very prompt builder that generation uses (so a chat's count is its `prompt_tokens`)."""

from __future__ import annotations

from workers.contract.chunks import ErrorInfo
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.contract.tokenize import (
    DetokenizeRequest,
    DetokenizeResult,
    TokenizeRequest,
    TokenizeResult,
)
from workers.text.prompts import PromptBuilder, PromptError
from workers.text.vision_prompts import VisionPromptBuilder


class Tokenization:
    def __init__(self, tokenizer, prompts: PromptBuilder, max_model_len: int,
                 vision: VisionPromptBuilder | None = None) -> None:
        """`prompts` and `vision`: the request processor's own builders."""
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.max_model_len = max_model_len
        self.vision = vision

    def tokenize(self, request: TokenizeRequest) -> TokenizeResult | ErrorInfo:
        """The token ids (nothing is checked against the context window: this only counts)."""
        try:
            ids = self._token_ids(request)
        except PromptError as exc:
            return exc.info()
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResult(ids, self.max_model_len, strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResult | ErrorInfo:
        """The text of the ids, special tokens included (as vLLM's /detokenize)."""
        vocab = len(self.tokenizer)
        if request.tokens and max(request.tokens) >= vocab:
            bad = [t for t in request.tokens if t >= vocab][:5]  # the error path only
            return ErrorInfo(400, f"tokens: token ids {bad} are outside the vocabulary (size {vocab})",
                             param="tokens", code="invalid_token_id")
        return DetokenizeResult(self.tokenizer.decode(request.tokens))

    def _token_ids(self, request: TokenizeRequest) -> list[int]:
        if request.prompt is not None:
            return list(self.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)["input_ids"])
        if self.vision is not None:
            return self._vision_chat_ids(request)
        text = self.prompts.chat_text(request, request.add_generation_prompt, request.continue_final_message)
        return list(self.tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"])

    def _vision_chat_ids(self, request: TokenizeRequest) -> list[int]:
        """A vision model's chat goes through its processor, as in generation, which knows
        only the generation prompt's ending and no added special tokens."""
        for param, value, default in (("add_generation_prompt", request.add_generation_prompt, True),
                                      ("continue_final_message", request.continue_final_message, False),
                                      ("add_special_tokens", request.add_special_tokens, False)):
            if value != default:
                raise PromptError(f"{param}: only {str(default).lower()} is supported for this vision model's chats",
                                  param, "unsupported_parameter")
        chat = GenerateRequest(request_id="tokenize", params=SamplingParams(), messages=request.messages,
                               chat_template_kwargs=request.chat_template_kwargs, tools=request.tools,
                               tool_prompt=request.tool_prompt)
        return self.vision.build(chat).token_ids
