"""Encoder embedding models (`runner: pooling`): `auto` deciding the runner from the
checkpoint, the encoder's pooled vectors equal to transformers' own run of each input alone
(CLS, and MEAN from a sentence-transformers config, RoBERTa's offset positions), the worker
replica's embed / tokenize / info / stats built outside Serve, concurrent requests sharing
batches, a failing input contained to its request, and the config refusals."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from serve_app.app import resolve_runners
from serve_app.config.app_config import ConfigError, parse_app_config
from tests.support.tiny_models import write_tiny_encoder_dir, write_tiny_model_dir
from workers.contract.chunks import ErrorInfo
from workers.contract.embeddings import EmbedRequest
from workers.contract.model_config import ModelConfig, PoolerConfig
from workers.contract.tokenize import TokenizeRequest
from workers.model.encoder import load_encoder
from workers.model.loader import load_model
from workers.model.model_kind import own_pooling, resolved_runner
from workers.serving.deployment import decoder_pooler
from workers.serving.embeddings import EngineStepError
from workers.serving.encoder_batches import EncoderBatches
from workers.serving.encoder_worker import EncoderWorker

TEXTS = ["The quick brown fox.", "Hello!", "Paris is the capital of France. Berlin is the capital of Germany."]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return write_tiny_encoder_dir(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def roberta_mean_dir(tmp_path_factory):
    return write_tiny_encoder_dir(tmp_path_factory.mktemp("roberta"), "roberta", seed=1,
                                  pooling="pooling_mode_mean_tokens")


def encoder_config(path, **fields) -> ModelConfig:
    engine = fields.pop("engine", {"torch_threads": 1})
    return ModelConfig(id="enc", source=str(path), runner="pooling", dtype="float32", engine=engine, **fields)


def transformers_vector(path, text: str, pooling: str) -> list[float]:
    """The reference: transformers' own forward of one unpadded input, pooled and normalized."""
    model, tokenizer = AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        hidden = model(input_ids=ids).last_hidden_state[0]
    return F.normalize(hidden[0] if pooling == "CLS" else hidden.mean(dim=0), dim=-1).tolist()


def close(a, b) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_auto_runner_reads_the_checkpoint(bert_dir, tmp_path):
    llama = write_tiny_model_dir(tmp_path / "llama")
    assert resolved_runner("auto", str(bert_dir)) == "pooling"
    assert resolved_runner("auto", str(llama)) == "generate"
    assert resolved_runner("auto", "builtin:smollm2-135m-instruct") == "generate"
    assert resolved_runner("generate", str(bert_dir)) == "generate"
    config = resolve_runners(parse_app_config({"models": [{"id": "a", "source": str(bert_dir)},
                                                          {"id": "b", "source": str(llama)}]}))
    assert [m.runner for m in config.models] == ["pooling", "generate"]


@pytest.mark.parametrize("pooling", ["CLS", "MEAN"])
def test_pooled_batches_equal_transformers_alone(bert_dir, roberta_mean_dir, pooling):
    path = bert_dir if pooling == "CLS" else roberta_mean_dir  # MEAN: read from the sentence-transformers config
    encoder = load_encoder(encoder_config(path))
    assert encoder.pooling == pooling and encoder.max_input_tokens == (66 if pooling == "CLS" else 65)
    batch = encoder.pool([encoder.tokenizer(t)["input_ids"] for t in TEXTS])
    for vector, text in zip(batch, TEXTS):
        assert close(vector, transformers_vector(path, text, pooling))


def test_own_pooling_and_the_decoders_pooler(roberta_mean_dir, tmp_path):
    assert own_pooling(roberta_mean_dir) == "MEAN" and own_pooling(tmp_path) is None
    last = write_tiny_encoder_dir(tmp_path / "last", pooling="pooling_mode_lasttoken")
    assert decoder_pooler(PoolerConfig(), last).pooling_type == "LAST"
    assert decoder_pooler(PoolerConfig(), roberta_mean_dir).pooling_type == "MEAN"
    assert decoder_pooler(PoolerConfig(pooling_type="LAST"), roberta_mean_dir).pooling_type == "LAST"
    with pytest.raises(ValueError, match="pooler_config.pooling_type: CLS"):
        decoder_pooler(PoolerConfig(pooling_type="CLS"), tmp_path)


def test_each_runner_refuses_the_other_kind_of_checkpoint(bert_dir, tmp_path):
    llama = write_tiny_model_dir(tmp_path / "llama")
    with pytest.raises(ValueError, match="runner: pooling serves encoder families"):
        load_encoder(encoder_config(llama))
    with pytest.raises(ValueError, match="is an encoder .bert.*runner: pooling"):
        load_model(str(bert_dir))


def test_an_encoder_refuses_decoding_features(bert_dir, tmp_path):
    with pytest.raises(ValueError, match="runner: pooling: .*remove speculative"):
        encoder_config(bert_dir, speculative={"method": "ngram", "num_speculative_tokens": 2})
    args = {"models": [{"id": "a", "source": str(bert_dir), "lora": {"adapters": {}}}]}
    with pytest.raises(ConfigError, match=r"models\.0\.runner: .* is an encoder .*remove lora"):
        resolve_runners(parse_app_config(args))


def test_worker_embeds_tokenizes_and_reports(bert_dir):
    worker = EncoderWorker.func_or_class(encoder_config(bert_dir).model_dump())
    reference = [transformers_vector(bert_dir, t, "CLS") for t in TEXTS]
    ids = worker.encoder.tokenizer(TEXTS[0])["input_ids"]

    async def calls():
        texts = await worker.embed(EmbedRequest("r1", texts=tuple(TEXTS)))
        by_ids = await worker.embed(EmbedRequest("r2", token_ids=(tuple(ids),)))
        too_long = await worker.embed(EmbedRequest("r3", token_ids=(tuple([5] * 67),)))
        shorter = await worker.embed(EmbedRequest("r4", texts=("x",), dimensions=8))
        counted = await worker.tokenize(TokenizeRequest(prompt=TEXTS[0]))
        refused = [chunk async for chunk in worker.generate(None)]
        return texts, by_ids, too_long, shorter, counted, refused

    texts, by_ids, too_long, shorter, counted, refused = asyncio.run(calls())
    assert all(close(v, r) for v, r in zip(texts.embeddings, reference))
    assert texts.prompt_tokens == sum(len(worker.encoder.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert close(by_ids.embeddings[0], reference[0]) and by_ids.prompt_tokens == len(ids)
    assert isinstance(too_long, ErrorInfo) and too_long.status == 400 and too_long.code == "context_length_exceeded"
    assert isinstance(shorter, ErrorInfo) and shorter.param == "dimensions"
    assert counted.tokens == ids and counted.max_model_len == 66
    assert refused[0][0].error.status == 400 and refused[0][0].error.param == "model"
    info, stats = worker.info(), worker.stats()
    assert (info.id, info.max_model_len, info.vocab_size, info.dtype) == ("enc", 66, len(worker.encoder.tokenizer),
                                                                          "float32")
    assert stats.engine_steps == 2 and stats.waiting == stats.running == stats.active_requests == 0


def test_concurrent_requests_share_batches_within_the_budget(bert_dir):
    engine = {"torch_threads": 1, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    worker = EncoderWorker.func_or_class(encoder_config(bert_dir, engine=engine).model_dump())
    requests = [EmbedRequest(f"r{i}", texts=(f"input {i}", f"and {i} more")) for i in range(12)]

    async def calls():
        return await asyncio.gather(*(worker.embed(r) for r in requests))

    results = asyncio.run(calls())
    alone = asyncio.run(worker.embed(EmbedRequest("a", texts=("input 7", "and 7 more"))))
    assert all(len(r.embeddings) == 2 for r in results) and close(results[7].embeddings, alone.embeddings)
    assert worker.stats().engine_steps < len(requests)  # requests shared batches (24 inputs, 8 a batch at most)


def test_a_failing_input_fails_only_its_own_request():
    def run_batch(batch: list[list[int]]) -> list[list[float]]:
        if [13] in batch:
            raise RuntimeError("poisoned input")
        return [[float(len(ids))] for ids in batch]

    async def calls():
        from concurrent.futures import ThreadPoolExecutor

        batches = EncoderBatches(run_batch, ThreadPoolExecutor(1), 16, max_seqs=4, max_batched_tokens=16)
        good = [batches.pool([[1, 2], [3]]), batches.pool([[4, 5, 6]])]
        bad = batches.pool([[13]])
        results = await asyncio.gather(*good, bad, return_exceptions=True)
        assert batches.alive and batches.waiting == batches.running == 0
        return results

    first, second, bad = asyncio.run(calls())
    assert [p.vector for p in first] == [[2.0], [1.0]] and [p.vector for p in second] == [[3.0]]
    assert isinstance(bad, EngineStepError) and "poisoned input" in str(bad) and bad.status == 500


def test_batches_take_a_rounds_inputs_shortest_first_while_the_padded_size_fits():
    async def calls():
        from concurrent.futures import ThreadPoolExecutor

        seen: list[list[int]] = []

        def run_batch(batch):
            seen.append([len(ids) for ids in batch])
            return [[float(len(ids))] for ids in batch]

        batches = EncoderBatches(run_batch, ThreadPoolExecutor(1), 16, max_seqs=3, max_batched_tokens=16)
        first = await asyncio.gather(batches.pool([[1] * 4, [1] * 16, [1] * 4, [1] * 2, [1] * 4]),
                                     batches.pool([[1] * 3]))
        return seen, first

    seen, (first, second) = asyncio.run(calls())
    # One round, shortest first: 3 inputs at most and 16 padded tokens a batch.
    assert seen == [[2, 3, 4], [4, 4], [16]]
    assert [p.vector for p in first] == [[4.0], [16.0], [4.0], [2.0], [4.0]] and second[0].vector == [3.0]
