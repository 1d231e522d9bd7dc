"""The ingress's one generate path (`ChatIngress._prepare`) for every row of the dialect
table (serve_app/dialects/table.py), no Ray: an adapter named as `model` is attached the
same way for all, token ids outside the vocabulary are a 400 wherever a dialect can carry
them (/lm/v2 cannot: its request model has no token-id fields, and unknown fields are
ignored), and image parts meet a text-only model's refusal on every dialect that carries
them, named in the dialect's own fields."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest

from serve_app.config.app_config import AppConfig
from serve_app.dialects.chat.route import CHAT
from serve_app.dialects.completions import COMPLETIONS
from serve_app.dialects.lm_v2 import LM_V2
from serve_app.dialects.messages.route import MESSAGES
from serve_app.dialects.responses.route import RESPONSES
from serve_app.dialects.table import DIALECTS
from serve_app.http.errors import APIError
from serve_app.ingress import ChatIngress
from serve_app.lora.adapters import AdapterCatalog
from serve_app.media.images import MediaResolver
from serve_app.schema.dialect import Dialect
from workers.contract.lora import LoraRequest
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.contract.worker_info import ModelInfo

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's pydantic models

VOCAB = 100
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}

# A valid body of each dialect, without `model`.
BODIES: dict[str, dict[str, Any]] = {
    CHAT.path: {"messages": [{"role": "user", "content": "Hi"}]},
    LM_V2.path: {"messages": [{"role": "user", "content": "Hi"}]},
    COMPLETIONS.path: {"prompt": "Once"},
    RESPONSES.path: {"input": "Hi"},
    MESSAGES.path: {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
}


# The ingress's generate-path methods on a plain class: Serve's replica wrapper (with its
# own async __init__ and __del__) is not needed to run them.
_PATH_METHODS = ("_prepare", "_target", "_worker", "_check_token_ids", "_with_images", "_info")
IngressState = type("IngressState", (), {name: getattr(ChatIngress.func_or_class, name) for name in _PATH_METHODS})


def ingress() -> Any:
    """The ingress's instance state that `_prepare` reads, without Serve: one text-only
    model, `base`, with a configured adapter `fixed`."""
    ingress = IngressState()
    base = {"id": "base", "lora": {"adapters": {"fixed": "/srv/fixed"}}}
    ingress.config = AppConfig.model_validate({"models": [base]})
    ingress.adapters = AdapterCatalog(ingress.config, None)
    ingress.media = MediaResolver(ingress.config.server.media)
    ingress.workers = {"base": None}
    ingress.transports = {"base": "the transport of base"}
    ingress._infos = {"base": ModelInfo(id="base", max_model_len=64, vocab_size=VOCAB, kv_cache_blocks=4,
                                        block_size=16)}
    ingress.dialect_states = {d.path: d.state(ingress.config.server) for d in DIALECTS if d.state is not None}
    return ingress


def prepare(dialect: Dialect, model: str = "base", stream: bool = False, **fields):
    req = dialect.request_model.model_validate({**BODIES[dialect.path], "model": model, **fields})
    # A fresh context: no metrics record an earlier test left in this thread's context.
    return contextvars.Context().run(asyncio.run, ingress()._prepare(dialect, req, stream))


def test_every_route_of_the_table_is_a_dialect_row():
    assert [d.path for d in DIALECTS] == [CHAT.path, LM_V2.path, COMPLETIONS.path, RESPONSES.path, MESSAGES.path]
    assert set(BODIES) == {d.path for d in DIALECTS}


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.path)
def test_every_dialect_attaches_an_adapter_the_same_way(dialect):
    prepared = prepare(dialect, model="fixed")
    assert prepared.transport == "the transport of base"
    assert prepared.request.lora == LoraRequest.of("fixed", "/srv/fixed")
    assert prepare(dialect).request.lora is None


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.path)
def test_every_dialect_builds_its_streamer_or_its_accumulator(dialect):
    assert hasattr(prepare(dialect, stream=True).output, "events")
    accumulator = prepare(dialect).output
    assert hasattr(accumulator, "add") and hasattr(accumulator, "result")


@pytest.mark.parametrize("dialect", [d for d in DIALECTS if "logit_bias" in d.request_model.model_fields],
                         ids=lambda d: d.path)
@pytest.mark.parametrize("param, value", [("logit_bias", {str(VOCAB): 1.0}), ("stop_token_ids", [VOCAB + 5])])
def test_token_ids_outside_the_vocabulary_are_a_400_on_every_dialect_that_carries_them(dialect, param, value):
    with pytest.raises(APIError) as info:
        prepare(dialect, **{param: value})
    assert (info.value.status, info.value.param) == (400, param)
    assert prepare(dialect, **{param: {"1": 1.0} if param == "logit_bias" else [1]}).request.params


def test_lm_v2_carries_no_token_ids_so_the_check_finds_none():
    assert not {"logit_bias", "stop_token_ids"} & set(LM_V2.request_model.model_fields)
    prepared = prepare(LM_V2, logit_bias={str(VOCAB): 1.0}, stop_token_ids=[VOCAB + 5])  # ignored, as any unknown field
    assert (prepared.request.params.logit_bias, prepared.request.params.stop_token_ids) == ({}, ())


def test_the_token_id_check_applies_to_any_row():
    """A new dialect gets the check without code of its own: it lives in the path, not the rows."""
    def translate(req, request_id, model):
        return GenerateRequest(request_id=request_id, params=SamplingParams(stop_token_ids=(VOCAB,)), prompt="x")

    row = Dialect(path=COMPLETIONS.path, request_model=COMPLETIONS.request_model, new_id=lambda: "new-1",
                  translate=translate, output=COMPLETIONS.output)
    with pytest.raises(APIError) as info:
        prepare(row)
    assert (info.value.status, info.value.param) == (400, "stop_token_ids")


def test_a_text_only_model_refuses_images_on_every_dialect_that_carries_them():
    with pytest.raises(APIError) as info:
        prepare(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, IMAGE]}])
    assert (info.value.status, info.value.code) == (400, "invalid_image")
    assert info.value.param == "messages.0.content.1.image_url"
    image_input = [{"role": "user", "content": [{"type": "input_text", "text": "What?"},
                                                {"type": "input_image", "image_url": IMAGE["image_url"]["url"]}]}]
    with pytest.raises(APIError) as info:
        prepare(RESPONSES, input=image_input)
    assert (info.value.status, info.value.code) == (400, "invalid_image")
    assert info.value.param == "input"  # named in the Responses fields, as every `messages` error
