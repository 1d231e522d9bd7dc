"""Embedding requests in the engine: the vector of a prompt (last token or mean, normalized
or not) equals the final hidden states transformers computes, through the direct forward
and transformers' own modules, with the prompt chunked over steps, beside generation, after
a preemption, and with the prefix cache; the sequence frees its blocks when it ends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.engines import (
    greedy,
    make_engine,
    prompt_ids,
    record_preemptions,
    reference_greedy,
    run_to_completion,
)
from workers.contract.sampling_params import Pooling, SamplingParams
from workers.core.sequence import FinishReason


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return prompt_ids(tiny_tokenizer)


def embed_params(kind: str = "last", normalize: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=1, pooling=Pooling(kind, normalize))


def reference(model, prompt: list[int], kind: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].float()  # after the final norm, as the LM head reads it
    vector = hidden[-1] if kind == "last" else hidden.mean(dim=0)
    return F.normalize(vector, dim=-1) if normalize else vector


def vectors(engine, prompts, params) -> dict[int, torch.Tensor]:
    ids = [engine.add_request(p, params) for p in prompts]
    events = run_to_completion(engine)
    out = {}
    for i in ids:
        [event] = events[i]
        assert (event.token_id, event.finish_reason, event.request_finished) == (-1, FinishReason.STOP, True)
        out[i] = torch.tensor(event.embedding)
    return dict(zip(range(len(ids)), out.values()))


@pytest.mark.parametrize("direct_forward", [True, False], ids=["direct", "transformers"])
@pytest.mark.parametrize("kind", ["last", "mean"])
@pytest.mark.parametrize("batched_tokens", [512, 5], ids=["whole", "chunked"])
def test_vectors_equal_transformers_final_hidden_states(tiny_model, paged_model, prompts, direct_forward, kind,
                                                        batched_tokens):
    engine = make_engine(paged_model, max_num_batched_tokens=batched_tokens, direct_forward=direct_forward)
    got = vectors(engine, prompts, embed_params(kind))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(got[i], reference(tiny_model, prompt, kind), atol=2e-5, rtol=1e-4)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and engine.num_active == 0


def test_unnormalized_mean(tiny_model, paged_model, prompts):
    got = vectors(make_engine(paged_model), prompts[:2], embed_params("mean", normalize=False))
    torch.testing.assert_close(got[0], reference(tiny_model, prompts[0], "mean", normalize=False), atol=2e-5, rtol=1e-4)
    assert abs(float(got[0].norm()) - 1.0) > 1e-3


def test_embeddings_beside_generation_change_neither(tiny_model, paged_model, prompts):
    engine = make_engine(paged_model, max_num_batched_tokens=7)
    generating = [engine.add_request(p, greedy(8)) for p in prompts[:3]]
    for _ in range(2):  # the generations are under way when the embeddings arrive
        engine.step()
    embedding = {engine.add_request(p, embed_params("mean")): p for p in prompts[3:]}
    events = run_to_completion(engine)
    for request_id, prompt in embedding.items():
        torch.testing.assert_close(torch.tensor(events[request_id][-1].embedding),
                                   reference(tiny_model, prompt, "mean"), atol=2e-5, rtol=1e-4)
    fresh = make_engine(paged_model)
    for request_id, prompt in zip(generating, prompts[:3]):
        assert len(events[request_id]) >= 6  # most tokens came after the embeddings joined
    alone = [reference_greedy(tiny_model, p, 8) for p in prompts[:3]]
    ids = [fresh.add_request(p, greedy(8)) for p in prompts[:3]]
    fresh_events = run_to_completion(fresh)
    assert [[e.token_id for e in fresh_events[i]] for i in ids] == alone


def test_a_preempted_mean_pooled_prompt_starts_its_sum_again(tiny_model, paged_model, prompts):
    # A generation that grows into a small pool preempts the newest sequence, an embedding
    # half way through its chunked prompt, which then computes the prompt again.
    long = prompts[-1]
    engine = make_engine(paged_model, num_blocks=-(-(len(prompts[0]) + 40) // 4) + 2, block_size=4,
                         max_num_batched_tokens=4)
    preempted = record_preemptions(engine)
    generating = engine.add_request(prompts[0], greedy(40))
    early = [e for _ in range(3) for e in engine.step()]
    embedding = engine.add_request(long, embed_params("mean"))
    events = run_to_completion(engine)
    assert any(seq.request_id == embedding for seq in preempted), "the pool was meant to preempt the embedding"
    torch.testing.assert_close(torch.tensor(events[embedding][-1].embedding), reference(tiny_model, long, "mean"),
                               atol=2e-5, rtol=1e-4)
    assert [e.token_id for e in early + events[generating]] == reference_greedy(tiny_model, prompts[0], 40)


def test_the_prefix_cache_serves_last_token_pooling_and_is_skipped_by_mean(tiny_model, paged_model, prompts):
    engine = make_engine(paged_model, enable_prefix_caching=True)
    prompt = prompts[-1]
    vectors(engine, [prompt], embed_params("last"))
    [event] = run_to_completion_of(engine, prompt, embed_params("last"))
    assert event.cached_tokens > 0
    torch.testing.assert_close(torch.tensor(event.embedding), reference(tiny_model, prompt, "last"),
                               atol=2e-5, rtol=1e-4)
    [event] = run_to_completion_of(engine, prompt, embed_params("mean"))
    assert event.cached_tokens == 0


def run_to_completion_of(engine, prompt, params) -> list:
    request_id = engine.add_request(prompt, params)
    return run_to_completion(engine)[request_id]


def test_an_aborted_embedding_leaves_nothing_behind(paged_model, prompts):
    engine = make_engine(paged_model, max_num_batched_tokens=3)
    request_id = engine.add_request(prompts[-1], embed_params("mean"))
    engine.step()
    engine.abort_request(request_id)
    assert not engine.pooler._sums and engine.blocks.num_free_blocks == engine.blocks.num_blocks
