"""What one request asks of the sampler and of the stopping rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class GuidedDecoding:
    """A constraint on the output text, enforced token by token (workers/sampling/guided.py).

    `kind` says how `spec` reads: "json_schema" (the JSON text of a JSON schema),
    "lark" (a llguidance Lark grammar, which may embed schemas with `%json {...}`), or
    "regex". Built at the API edge (response_format, tool_choice, strict tools).
    """

    kind: Literal["json_schema", "lark", "regex"]
    spec: str
    param: str | None = None  # the request field it comes from, named in errors


@dataclass(frozen=True)
class Pooling:
    """An embedding request: nothing is sampled; the final (normed) hidden states of the
    prompt pool into one vector (workers/engine/pooling.py): the last token's, or the mean
    of every token's; `normalize`: to unit length."""

    kind: Literal["last", "mean"] = "last"
    normalize: bool = True


@dataclass(frozen=True)
class ThinkingBudget:
    """A cap on the tokens of the output's reasoning section (vLLM's thinking_token_budget,
    Anthropic's thinking.budget_tokens): once `tokens` have been generated since `start`
    opened it (or since the output began, when the prompt leaves it open) without `end`,
    the engine makes the next tokens those of `end` (workers/core/thinking.py). The ingress
    gives the tags as text; the worker fills in their token ids."""

    tokens: int
    start: str
    end: str
    start_ids: tuple[int, ...] = ()
    end_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """Validated per-request generation settings (validation happens at the API edge).

    temperature == 0 means greedy; top_k <= 0 means no top-k cut; top_p == 1 means no
    nucleus cut; min_p == 0 means no min-p cut. Penalties follow OpenAI (presence and
    frequency: additive, over generated tokens) and CTRL / vLLM (repetition:
    multiplicative, over prompt and generated tokens). `stop` strings are matched on
    text by the request processor; token-level rules (EOS, stop_token_ids,
    min_tokens, max_tokens) are applied by the engine.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob plus the top k
    prompt_logprobs: int | None = None  # None: off; k >= 0: per prompt token, plus the top k
    n: int = 1  # independent samples sharing one prefill (or: beams returned)
    use_beam_search: bool = False
    best_of: int | None = None  # beam width; default n
    length_penalty: float = 1.0
    guided: GuidedDecoding | None = None  # constrained decoding (structured output, forced tool calls)
    # Scheduling, not sampling: with the engine's `priority` policy, lower values are admitted
    # first and preempted last (vLLM's meaning); it rides here to reach every choice's Sequence.
    priority: int = 0
    pooling: Pooling | None = None  # an embedding request (no output tokens)
    thinking_budget: ThinkingBudget | None = None  # a cap on the reasoning section's tokens

    @property
    def beam_width(self) -> int:
        return max(self.n, self.best_of or self.n)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
