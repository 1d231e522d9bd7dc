"""Models whose attention is not Llama's, through the paged engine, against transformers'
own eager generate: a sliding window on every layer (Mistral), soft-capped attention
logits with alternating sliding and full layers (Gemma 2); attention sinks (gpt-oss)
are refused with a clear error rather than computed wrong."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from tests.support.engines import make_engine
from workers.contract.sampling_params import SamplingParams
from workers.model.attention import LayerAttention, register_paged_attention

pytestmark = pytest.mark.gpu  # CPU here; on a GPU also through its graphs (tests/gpu)
VOCAB = 300
WINDOW = 6
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _init(model):
    torch.manual_seed(0)
    with torch.no_grad():  # larger weights than the default init: logits far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.eval()


def mistral():
    return _init(MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=WINDOW)))


def gemma2():
    config = Gemma2Config(**SHAPE, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                          final_logit_softcapping=30.0, query_pre_attn_scalar=16)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    return _init(Gemma2ForCausalLM(config))


def reference(model, prompt: list[int], n: int) -> list[tuple[int, float]]:
    """transformers' eager greedy decoding: (token, its log-probability) per step."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = eager.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return [(t, torch.log_softmax(step[0].float(), -1)[t].item()) for t, step in zip(tokens, out.logits)]


def engine_outputs(engine, batch: list[list[int]], max_tokens: list[int]) -> list[list[tuple[int, float]]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=0))
           for p, m in zip(batch, max_tokens)]
    out: dict[int, list] = {i: [] for i in ids}
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id].append((ev.token_id, ev.logprob))
    return [out[i] for i in ids]


def assert_same(got: list[tuple[int, float]], ref: list[tuple[int, float]]) -> None:
    # Greedy tokens are robust here (one token dominates), so the log-probabilities carry the
    # check: ignoring the window or the soft cap moves them by whole units.
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref)) < 1e-4


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(3, VOCAB, (21,), generator=gen).tolist()
    # Longer than the window, shorter, and one sharing a prefix (blocks from the prefix cache).
    return [base, base[:4], base[:16] + [7, 8, 9], torch.randint(3, VOCAB, (11,), generator=gen).tolist()]


@pytest.mark.parametrize("build", [mistral, gemma2], ids=["mistral-sliding-window", "gemma2-softcap-local-global"])
@pytest.mark.parametrize("budget", [64, 5], ids=["whole-prompts", "chunked-prefill"])
def test_engine_matches_transformers_eager(build, budget):
    model = build()
    paged = copy.deepcopy(model)
    paged.set_attn_implementation(register_paged_attention())
    batch = prompts()
    max_tokens = [12, 14, 9, 10]  # decodes run well past the window
    engine = make_engine(paged, num_blocks=64, max_num_batched_tokens=budget)
    got = engine_outputs(engine, batch[:1], max_tokens[:1])  # first alone: the third then hits its prefix
    got += engine_outputs(engine, batch[1:], max_tokens[1:])
    assert engine.blocks.hit_tokens > 0
    for tokens, prompt, n in zip(got, batch, max_tokens):
        assert_same(tokens, reference(model, prompt, n))


@pytest.mark.parametrize("build,change", [(mistral, {"sliding_window": None}), (gemma2, {"sliding_window": 10**6}),
                                          (gemma2, {"attn_logit_softcapping": None})])
def test_the_reference_depends_on_what_is_checked(build, change):
    """Without the window (or the cap) the reference moves: the test above would catch an
    engine that ignored it."""
    model = build()
    other = _rebuild(build, change)
    prompt = prompts()[0]
    with pytest.raises(AssertionError):
        assert_same(reference(other, prompt, 12), reference(model, prompt, 12))


def _rebuild(build, change):
    """The same weights (same seed) under a changed config."""
    model = build()
    config = model.config
    for key, value in change.items():
        setattr(config, key, value)
    return _init(type(model)(config))


def test_attention_sinks_are_refused():
    with pytest.raises(NotImplementedError, match="attention sinks"):
        LayerAttention.of(64, None, {"s_aux": torch.zeros(4)})
    plain = LayerAttention.of(64, None, {"sliding_window": None, "softcap": None})
    assert plain == LayerAttention(scale=0.125, window=None, softcap=None)
