"""tools.bench.embeddings on the tiny model: distinct inputs of the asked sizes, and the
engine's rate at batch 1 and 4 counts every input's vector."""

from __future__ import annotations

from tests.support.engines import make_engine
from tools.bench.embeddings import engine_rate, sentences
from workers.contract.sampling_params import Pooling, SamplingParams


def test_sentences_are_distinct_and_sized():
    texts = sentences(40, (5, 9))
    assert len(set(texts)) == 40 and all(5 <= len(t.split()) <= 9 for t in texts)


def test_engine_rate_embeds_every_input(paged_model, tiny_tokenizer):
    engine = make_engine(paged_model, num_blocks=200)
    prompts = [tiny_tokenizer(t)["input_ids"] for t in sentences(8, (3, 6))]
    params = SamplingParams(max_tokens=1, pooling=Pooling("mean"))
    for batch in (1, 4):
        assert engine_rate(engine, prompts, params, batch) > 0
    assert engine.num_active == 0 and engine.blocks.num_free_blocks == engine.blocks.num_blocks
