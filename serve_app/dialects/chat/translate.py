"""`/v1/chat/completions` request -> the worker's `GenerateRequest` (sampling, tools, grammar)."""

from __future__ import annotations

import dataclasses
import uuid

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.http.errors import APIError
from serve_app.output.reasoning_parsers import REASONING_PARSERS
from serve_app.output.tool_parsers import PARSERS, HermesToolParser, ToolParser
from serve_app.schema.common import openai_sampling_kwargs, or_default
from workers.contract.grammar import grammar_error
from workers.contract.model_config import ModelConfig
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import (
    GuidedDecoding,
    SamplingParams,
    ThinkingBudget,
)


def new_request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def to_generate_request(req: ChatCompletionRequest, request_id: str,
                        model: ModelConfig | None = None) -> GenerateRequest:
    """`model` (the served model's config) picks the tool-call format and the reasoning tag.
    `req` has passed every rule of the dialect (its validation); what is left to fail here
    is a grammar llguidance cannot build (400, naming `tools` or `response_format`)."""
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    parser = PARSERS[model.tool_call_parser] if model is not None else HermesToolParser
    tools = req.tools_in_play
    params = sampling_params(req)  # guided by response_format, if any
    if (constraint := tool_constraint(req, parser)) is not None:  # never both (ChatCompletionRequest._tool_error)
        params = dataclasses.replace(params, guided=constraint)
    if tools and parser.special_tags:  # as vLLM does: the calls' tags are special tokens
        params = dataclasses.replace(params, skip_special_tokens=False)
    reasoning = REASONING_PARSERS[model.reasoning_parser] if model is not None and model.reasoning_parser else None
    if reasoning is not None and reasoning.special_tags:  # harmony's channels are special tokens
        params = dataclasses.replace(params, skip_special_tokens=False)
    if req.thinking_token_budget is not None and reasoning is not None:
        params = dataclasses.replace(params, thinking_budget=ThinkingBudget(req.thinking_token_budget, reasoning.START,
                                                                            reasoning.END))
    return GenerateRequest(
        request_id=request_id,
        params=params,
        messages=messages,
        max_tokens=req.output_cap,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        tools=[t.model_dump(exclude_none=True) for t in tools] or None,
        tool_prompt=parser.tool_prompt(tools),
        reasoning_start=reasoning.START if reasoning is not None else None,
    )


def tool_constraint(req: ChatCompletionRequest, parser: type[ToolParser]) -> GuidedDecoding | None:
    """The grammar that forces calls (`required`, a named function) or binds strict
    functions' arguments; None when the tools leave the output free."""
    if not req.guided_tools:
        return None
    grammar = parser.grammar(req.tools_in_play, req.effective_tool_choice, req.parallel_tool_calls is not False)
    if grammar is None:
        return None
    guided = GuidedDecoding(kind="lark", spec=grammar, param="tools")
    if (problem := grammar_error(guided)) is not None:  # e.g. a schema with a look-ahead pattern
        raise APIError(400, f"the tools' parameters cannot be enforced by constrained decoding: "
                       f"{problem.splitlines()[0]}", param="tools", code="unsupported_schema")
    return guided


def sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    """The request's sampling fields with OpenAI's defaults for those left out."""
    return SamplingParams(
        **openai_sampling_kwargs(req),
        temperature=0.0 if req.use_beam_search else or_default(req.temperature, 1.0),
        logprobs=or_default(req.top_logprobs, 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        n=req.n,
        use_beam_search=bool(req.use_beam_search),
        best_of=req.best_of,
        length_penalty=or_default(req.length_penalty, 1.0),
    )

