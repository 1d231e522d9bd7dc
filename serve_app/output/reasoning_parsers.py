"""The reasoning parsers by the name a model config gives (`reasoning_parser`, vLLM's names):
`<think>` tags (serve_app/output/reasoning.py) and gpt-oss's harmony channels (harmony.py)."""

from __future__ import annotations

from serve_app.output.harmony import GptOssReasoningParser
from serve_app.output.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

ReasoningParser = DeepSeekR1ReasoningParser | GptOssReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser, "openai_gptoss": GptOssReasoningParser}
