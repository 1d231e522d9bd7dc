"""The worker's /v1/embeddings half without a model: inputs submitted together and gathered
in order, `dimensions` only for Matryoshka models (trimmed, then at unit length again),
the refusals, a failed input's error, and the request forms the ingress sends."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from serve_app.dialects.embeddings import EmbeddingsRequest, to_embed_request
from tests.support.tiny_models import build_tokenizer
from workers.contract.chunks import ErrorInfo
from workers.contract.embeddings import EmbedRequest
from workers.contract.model_config import PoolerConfig
from workers.core.events import TokenEvent
from workers.core.sequence import FinishReason
from workers.serving.async_engine import RequestStream
from workers.serving.embeddings import Embeddings, EnginePooling


class FakeEngine:
    """Answers each prompt with the vector [len(prompt), 1, 0, 0] (or an error), a step later."""

    def __init__(self, fail_len: int | None = None) -> None:
        self.limits = SimpleNamespace(max_model_len=64)
        self.added: list[list[int]] = []
        self.aborted = 0
        self.fail_len = fail_len

    def add_request(self, ids, params) -> RequestStream:
        assert params.pooling is not None and params.max_tokens == 1
        self.added.append(ids)
        stream = RequestStream()
        error = "boom" if len(ids) == self.fail_len else None
        event = TokenEvent(0, 0, -1, FinishReason.STOP, None, 0.0, request_finished=True, error=error,
                           embedding=None if error else [float(len(ids)), 1.0, 0.0, 0.0])
        asyncio.get_running_loop().call_soon(lambda: stream.sink([event]))
        return stream

    def abort(self, stream: RequestStream) -> None:
        self.aborted += not stream.finished


def embed(request: EmbedRequest, pooler=PoolerConfig(), refusal=None, engine=None):
    engine = engine or FakeEngine()
    pooler = pooler.model_copy(update={"pooling_type": pooler.pooling_type or "LAST"})  # as the replica decides it
    worker = Embeddings(EnginePooling(engine, pooler), build_tokenizer(), pooler, hidden_size=4, refusal=refusal)
    return asyncio.run(worker.embed(request)), engine


def test_inputs_are_submitted_together_and_answered_in_order():
    result, engine = embed(EmbedRequest("r", token_ids=((1, 2, 3), (4,), (5, 6))))
    assert [v[0] for v in result.embeddings] == [3.0, 1.0, 2.0] and result.prompt_tokens == 6
    assert engine.added == [[1, 2, 3], [4], [5, 6]] and engine.aborted == 0


def test_dimensions_need_a_matryoshka_model_and_are_renormalized():
    result, _ = embed(EmbedRequest("r", token_ids=((1, 2, 3),), dimensions=2), PoolerConfig(is_matryoshka=True))
    assert result.embeddings == [[3 / math.sqrt(10), 1 / math.sqrt(10)]]
    raw, _ = embed(EmbedRequest("r", token_ids=((1, 2, 3),), dimensions=2),
                   PoolerConfig(is_matryoshka=True, normalize=False))
    assert raw.embeddings == [[3.0, 1.0]]
    refused, engine = embed(EmbedRequest("r", token_ids=((1,),), dimensions=2))
    assert isinstance(refused, ErrorInfo) and refused.param == "dimensions" and not engine.added
    too_many, _ = embed(EmbedRequest("r", token_ids=((1,),), dimensions=5), PoolerConfig(is_matryoshka=True))
    assert isinstance(too_many, ErrorInfo) and too_many.param == "dimensions"


@pytest.mark.parametrize(("request_", "words"), [
    (EmbedRequest("r", token_ids=((1,), ())), "input.1: the input is empty"),
    (EmbedRequest("r", token_ids=((1,), (10**6,))), "input.1: token ids"),
    (EmbedRequest("r", token_ids=(tuple(range(1, 65)),)), "at most 63 tokens"),
])
def test_bad_inputs_are_400_naming_the_input(request_, words):
    error, engine = embed(request_)
    assert isinstance(error, ErrorInfo) and (error.status, error.param) == (400, "input") and words in error.message
    assert not engine.added


def test_a_refusing_replica_and_a_failed_step():
    refused, _ = embed(EmbedRequest("r", texts=("hi",)), refusal="it is split over devices")
    assert isinstance(refused, ErrorInfo) and "split over devices" in refused.message
    failed, engine = embed(EmbedRequest("r", token_ids=((1,), (1, 2))), engine=FakeEngine(fail_len=2))
    assert isinstance(failed, ErrorInfo) and (failed.status, failed.code) == (500, "engine_error")


@pytest.mark.parametrize(("input_", "texts", "token_ids"), [
    ("one", ("one",), None),
    (["a", "b"], ("a", "b"), None),
    ([1, 2, 3], None, ((1, 2, 3),)),
    ([[1], [2, 3]], None, ((1,), (2, 3))),
])
def test_request_forms(input_, texts, token_ids):
    request = to_embed_request(EmbeddingsRequest(model="m", input=input_, dimensions=3))
    assert (request.texts, request.token_ids, request.dimensions) == (texts, token_ids, 3)
