"""`/v1/chat/completions` request models: messages, tools (defined in serve_app/schema/tools.py),
and the rules between fields."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from serve_app.http.errors import APIError
from serve_app.schema.common import (
    MAX_LOGPROBS,
    RequestModel,
    SamplingFields,
    beam_search_error,
    field_error,
    length_penalty_error,
)
from serve_app.schema.tools import NamedToolChoice, Tool, ToolChoice


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str
    detail: str | None = None


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: str | ImageURL  # seed 001 passes a bare string (a local path)


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCallIn(RequestModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(RequestModel):
    """A call the assistant made earlier in the conversation (seed 001, request sample 2)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")  # name, ... reach the chat template
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_match_role(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self


class ChatPrompt(RequestModel):
    """What a chat request asks of which model."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)


# ChatPrompt is the last base so its fields come first: a request with several bad fields
# is answered about the first, and the model and messages lead, as in OpenAI's order.
class ChatCompletionRequest(SamplingFields, ChatPrompt):
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the template's ending. continue_final_message leaves the last (assistant)
    # message open, and the answer continues it (needs add_generation_prompt false).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: at most this many tokens of reasoning, then the model's end tag is forced
    # (a model served with a reasoning_parser; others have no section to count)
    thinking_token_budget: int | None = Field(None, ge=1)

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # None: true

    def broken_rule(self) -> APIError | None:
        return self._tool_error() or self._choices_error() or self._ending_error() or super().broken_rule()

    def _ending_error(self) -> APIError | None:
        if self.continue_final_message and self.add_generation_prompt:
            return field_error("continue_final_message", "continue_final_message needs add_generation_prompt to "
                               "be false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            return field_error("continue_final_message", "continue_final_message needs the last message to be "
                               "the assistant's")
        return None

    def _tool_error(self) -> APIError | None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            return field_error("tools", "function names in tools must be unique")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            return field_error("tool_choice", "tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return field_error("tool_choice",
                               f"tool_choice names {choice.function.name!r}, which is not among the tools {names}")
        if self.guided_tools and self.use_beam_search:
            return field_error("tool_choice", "forced or strict tool calls are not available with beam search")
        if self.guided_tools and self.response_format is not None and self.response_format.type != "text":
            # One grammar a request: the calls' format or the answer's, not both.
            return field_error("response_format", "response_format cannot be combined with forced or strict tool calls")
        if self.guided_tools and (asked := self.structured_output()) is not None:
            return field_error(asked[0], f"{asked[0]} cannot be combined with forced or strict tool calls")
        return None

    def _choices_error(self) -> APIError | None:
        """n, best_of, beam search and logprobs; beam search has rules of its own."""
        if self.use_beam_search and self.thinking_token_budget is not None:
            return field_error("thinking_token_budget", "thinking_token_budget is not available with beam search")
        if self.use_beam_search:
            return beam_search_error(self, asks_logprobs=bool(self.logprobs))
        if self.best_of is not None:
            return field_error("best_of", "best_of is only supported with use_beam_search")
        if (error := length_penalty_error(self.length_penalty)) is not None:
            return error
        if self.n > 1 and (self.temperature == 0 or self.top_k == 1):
            return field_error("n", "n > 1 needs sampling: greedy decoding (temperature 0 or top_k 1) would give n "
                               "identical choices")
        if self.top_logprobs is not None and not self.logprobs:
            return field_error("top_logprobs", "top_logprobs needs logprobs to be true")
        return None

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def tools_in_play(self) -> list[Tool]:
        """The tools the model is shown and may call (none with tool_choice "none")."""
        return [] if self.effective_tool_choice == "none" else list(self.tools or [])

    @property
    def forced_tool_calls(self) -> bool:
        """Whether the grammar forces the output to be calls (`required`, a named function)."""
        choice = self.effective_tool_choice
        return bool(self.tools_in_play) and (choice == "required" or isinstance(choice, NamedToolChoice))

    @property
    def guided_tools(self) -> bool:
        """Whether the tool calls must be constrained by a grammar."""
        return self.forced_tool_calls or any(t.function.strict for t in self.tools_in_play)

    @property
    def output_cap(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
