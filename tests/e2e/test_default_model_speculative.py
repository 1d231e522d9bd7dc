"""Speculative decoding on the default model as served (its Q4_1 blocks, int8x2, the
served config's engine limits): greedy tokens equal those without speculation on the
edit prompt of `make bench-spec` and an e2e chat prompt, with proposals taken, for ngram,
for suffix (each prompt twice: the second replays the first answer) and for a draft model (the default model's first 28 of 30 layers, the one model with its
tokenizer at hand: it agrees on about a quarter of its proposals, so both taking and
refusing are exercised)."""

from __future__ import annotations

import pytest
import torch

from tools.bench.engine import SERVE_CONFIG, served_model_config
from tools.bench.spec import EDIT_PROMPT, first_layers
from workers.contract.model_config import SpeculativeConfig
from workers.contract.sampling_params import SamplingParams
from workers.engine.kv_sizing import sized_engine_limits
from workers.engine.llm_engine import LLMEngine
from workers.model.attention import register_paged_attention
from workers.model.loader import load_model
from workers.speculative.proposals import StepCost

pytestmark = pytest.mark.slow

PROMPTS = [EDIT_PROMPT, "What is the capital of France?"]


@pytest.fixture(scope="module")
def served():
    config = served_model_config(SERVE_CONFIG)
    loaded = load_model(config.source, dtype=config.dtype, quantization=config.quantization,
                        quantized_activations=config.quantized_activations)
    loaded.model.set_attn_implementation(register_paged_attention())
    return config, loaded


def _engine(served, speculative: SpeculativeConfig | None, draft=None) -> LLMEngine:
    config, loaded = served
    cpu = torch.device("cpu")
    limits = sized_engine_limits(config.model_copy(update={"speculative": speculative}), loaded.model, cpu)
    return LLMEngine(loaded.model, frozenset(), limits, cpu, draft_model=draft)


def test_greedy_tokens_equal_without_speculation(served):
    tokenizer = served[1].tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in PROMPTS]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outputs = {}
    draft = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_source="first-28-layers")
    suffix = SpeculativeConfig(method="suffix", num_speculative_tokens=8)
    for name, spec in (("plain", None), ("ngram", SpeculativeConfig(method="ngram", num_speculative_tokens=4)),
                       ("draft", draft), ("suffix", suffix)):
        engine = _engine(served, spec, first_layers(served[1].model, 28) if name == "draft" else None)
        if name == "draft":
            # proposing at any rate of acceptance: the test wants refusals too
            engine.proposer.draft_share, engine.proposer.step_cost = 0.0, StepCost(0.05, learn=False)
        elif spec is not None:
            # the prior price, not this machine's measured one (which may all but stop proposals)
            engine.proposer.step_cost = StepCost(learn=False)
        outputs[name] = []
        # suffix: each prompt twice, the second time with the first answer to propose from
        for prompt in [p for p in prompts for _ in range(2 if name == "suffix" else 1)]:
            # one at a time: speculation is off from disable_by_batch_size on
            request = engine.add_request(prompt, params)
            tokens = []
            while engine.has_work():
                tokens += [e.token_id for e in engine.step() if e.request_id == request]
            outputs[name].append(tokens)
        if spec is not None:
            counts = engine.proposer.counts
            assert counts.accepted_tokens > 10 and (name == "ngram" or counts.draft_tokens > counts.accepted_tokens + 10)
    assert outputs["ngram"] == outputs["plain"]
    assert outputs["draft"] == outputs["plain"]
    assert outputs["suffix"] == [tokens for tokens in outputs["plain"] for _ in range(2)]
