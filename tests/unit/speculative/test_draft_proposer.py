"""Speculative decoding with a draft model, on the tiny random model in float32: the same
tokens as without it (greedy and seeded) whether the draft agrees with the target
(its own weights) or often not (its weights perturbed), with long prompts caught up in
chunks, preemptions, stops and n > 1; a failing draft costs only its proposals; the
draft's blocks come back; a draft whose proposals could not be the target's ids is
refused; a worker's config loads the draft."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.engines import (
    greedy,
    make_engine,
    record_preemptions,
    run_to_completion,
    tokens_by_choice,
)
from workers.contract.model_config import ModelConfig
from workers.contract.sampling_params import SamplingParams, ThinkingBudget
from workers.core.limits import EngineLimits, SpeculativeLimits
from workers.core.sequence import FinishReason
from workers.engine.model_setup import draft_step_share, proposer
from workers.serving.engine_build import build_engine, same_tokenizer
from workers.speculative.draft_proposer import DraftProposer
from workers.speculative.proposals import ROW_COST, StepCost

DRAFT = SpeculativeLimits(num_tokens=4, lookup_min=1, lookup_max=3, disable_by_batch_size=None, method="draft")


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    texts = ["the cat sat on the mat", "a b c d e f g h i j k l m n o p", "hello",
             "one two three four five six seven eight nine ten " * 6]
    return [tiny_tokenizer.encode(t) for t in texts] * 3


@pytest.fixture(scope="module")
def drafts(tiny_model, paged_attn_name) -> dict[str, torch.nn.Module]:
    """The target's own weights (agrees nearly always), and the same perturbed (agrees
    on part of the tokens), on the paged attention."""
    same = copy.deepcopy(tiny_model)
    same.set_attn_implementation(paged_attn_name)
    perturbed = copy.deepcopy(same)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for weight in perturbed.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * 0.1)
    return {"same": same, "perturbed": perturbed}


def _engine(model, draft=None, num_blocks=1200, **limits):
    engine = make_engine(model, num_blocks=num_blocks, draft_model=draft,
                         speculative=DRAFT if draft is not None else None, **limits)
    if draft is not None:
        _price_as_free(engine.proposer)
    return engine


def _price_as_free(proposer: DraftProposer) -> None:
    """The drafts here are as large as their target: their steps priced as free and a row at
    the fixed prior (not the machine's measured cost), so that they propose."""
    proposer.draft_share, proposer.step_cost = 0.0, StepCost(ROW_COST, learn=False)


def _outputs(model, prompts, params, draft=None, **limits):
    engine = _engine(model, draft, **limits)
    ids = [engine.add_request(p, params) for p in prompts]
    events = run_to_completion(engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [tokens_by_choice(events[i]) for i in ids], [[e.finish_reason for e in events[i]] for i in ids], engine


@pytest.mark.parametrize("which", ["same", "perturbed"])
@pytest.mark.parametrize("limits", [dict(block_size=4), dict(block_size=1, max_num_batched_tokens=8),
                                    dict(block_size=4, max_num_seqs=12, num_blocks=90)],
                         ids=["roomy", "chunked", "preempting"])
def test_greedy_tokens_equal_without_speculation(paged_model, drafts, prompts, which, limits):
    plain, reasons, _ = _outputs(paged_model, prompts, greedy(24), **limits)
    engine = _engine(paged_model, drafts[which], **limits)
    preempted = record_preemptions(engine)
    ids = [engine.add_request(p, greedy(24)) for p in prompts]
    events = run_to_completion(engine)
    assert [tokens_by_choice(events[i]) for i in ids] == plain
    assert [[e.finish_reason for e in events[i]] for i in ids] == reasons
    assert bool(preempted) == ("num_blocks" in limits)
    counts = engine.proposer.counts
    assert counts.accepted_tokens > 0
    if which == "same":
        assert counts.accepted_tokens > 0.95 * counts.draft_tokens  # the same weights: near ties aside, all
    else:
        assert counts.draft_tokens - counts.accepted_tokens > 10  # refusals too
    engine.proposer.prepare([])  # nothing running: every shadow's blocks come back
    assert engine.proposer.blocks.num_free_blocks == engine.proposer.blocks.num_blocks


def test_seeded_sampling_and_n_choices_give_the_same_tokens(paged_model, drafts, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=7, n=2)
    plain, _, _ = _outputs(paged_model, prompts, params)
    spec, _, engine = _outputs(paged_model, prompts, params, drafts["perturbed"])
    assert spec == plain
    assert engine.proposer.counts.accepted_tokens > 0


def test_a_stop_token_inside_accepted_proposals_ends_there(paged_model, drafts, prompts):
    plain, _, _ = _outputs(paged_model, prompts, greedy(24))
    stop = plain[3][0][10]
    expected = [{0: t[0][: t[0].index(stop) + 1]} if stop in t[0] else t for t in plain]
    spec, reasons, _ = _outputs(paged_model, prompts, greedy(24, stop_token_ids=[stop]), drafts["same"])
    assert spec == expected
    assert all(r[-1] is FinishReason.STOP for t, r in zip(spec, reasons) if stop in t[0])


def test_a_thinking_budget_and_min_tokens_keep_their_tokens(paged_model, drafts, prompts):
    """The draft knows nothing of the budget: its proposals are cut before the forced end
    tag, which comes where it does without a draft."""
    budget = ThinkingBudget(5, "<think>", "</think>", start_ids=(50,), end_ids=(60, 61))
    params = greedy(24, thinking_budget=budget, min_tokens=8)
    opened = [p + [50] for p in prompts]
    plain, _, _ = _outputs(paged_model, opened, params)
    spec, _, engine = _outputs(paged_model, opened, params, drafts["same"])
    assert spec == plain and engine.proposer.counts.accepted_tokens > 0
    assert all(t[0][5:7] == [60, 61] for t in plain)


class _Broken(torch.nn.Module):
    def forward(self, decodes, prefills):
        raise RuntimeError("draft model failure")


def test_a_failing_draft_costs_only_its_proposals(paged_model, drafts, prompts):
    plain, _, _ = _outputs(paged_model, prompts[:4], greedy(12))
    engine = _engine(paged_model, drafts["same"])
    engine.proposer.model = _Broken()
    ids = [engine.add_request(p, greedy(12)) for p in prompts[:4]]
    events = run_to_completion(engine)
    assert [tokens_by_choice(events[i]) for i in ids] == plain
    assert engine.proposer.counts.drafts == 0
    assert engine.proposer.blocks.num_free_blocks == engine.proposer.blocks.num_blocks


def test_the_draft_is_priced_by_its_weights_and_must_fit_the_vocabulary(paged_model, drafts):
    assert draft_step_share(drafts["same"], paged_model) == pytest.approx(1.0)
    half = copy.deepcopy(paged_model)
    del half.model.layers[1:]
    assert draft_step_share(half, paged_model) < 0.9
    limits = EngineLimits(speculative=DRAFT)
    built = proposer(limits, paged_model, half, 16, torch.device("cpu"))
    assert isinstance(built, DraftProposer) and built.draft_share == pytest.approx(draft_step_share(half, paged_model))
    wider = copy.deepcopy(paged_model)
    wider.resize_token_embeddings(paged_model.config.vocab_size + 8)
    with pytest.raises(ValueError, match="vocabulary"):
        proposer(limits, paged_model, wider, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs the draft model"):
        proposer(limits, paged_model, None, 16, torch.device("cpu"))


def test_tokenizers_compare_by_their_vocabulary(tiny_tokenizer):
    other = copy.deepcopy(tiny_tokenizer)
    assert same_tokenizer(tiny_tokenizer, other)
    other.add_tokens(["<brand-new-token>"])
    assert not same_tokenizer(tiny_tokenizer, other)
    assert not same_tokenizer(tiny_tokenizer, None) and same_tokenizer(None, None)


def test_a_worker_config_loads_the_draft_beside_its_model(tiny_model_dir, tiny_tokenizer):
    spec = {"method": "draft", "num_speculative_tokens": 3, "draft_source": str(tiny_model_dir)}
    config = ModelConfig(id="tiny", source=str(tiny_model_dir), speculative=spec,
                         engine={"kv_cache_memory_gib": 0.01, "max_model_len": 256})
    built = build_engine(config)
    engine = built.engine
    assert isinstance(engine.proposer, DraftProposer)
    assert engine.proposer.draft_share == pytest.approx(1.0)  # the draft is the model itself here
    _price_as_free(engine.proposer)
    params = greedy(16)
    prompt = tiny_tokenizer.encode("the cat sat on the mat")
    request = engine.add_request(prompt, params)
    spec_tokens = [e.token_id for e in run_to_completion(engine)[request]]
    plain = build_engine(config.model_copy(update={"speculative": None})).engine
    request = plain.add_request(prompt, params)
    assert spec_tokens == [e.token_id for e in run_to_completion(plain)[request]]
    assert engine.proposer.counts.accepted_tokens > 0
