"""The worker's one error type: each failure's status, code and field, and how a refusal
names the field in the request's own terms."""

from __future__ import annotations

import pytest

from tests.support.engines import chat_request
from workers.contract.chunks import ErrorInfo
from workers.contract.errors import WorkerError
from workers.contract.grammar import GuidedDecodingError
from workers.contract.lora import LoraAdapterError
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import CapacityError, PriorityError
from workers.engine.resume import ContinuationError
from workers.model.multimodal import ImageEncodeError
from workers.serving.async_engine import EngineDeadError
from workers.serving.request_processor import _refusal
from workers.text.prompts import PromptError


def test_a_plain_worker_error_is_a_400_with_what_its_raiser_gave():
    assert WorkerError("bad", param="stop", code="x").info() == ErrorInfo(400, "bad", "invalid_request_error",
                                                                          "stop", "x")
    assert WorkerError("bad").info("messages").param == "messages"


@pytest.mark.parametrize("error, expected", [
    (ContinuationError("id 9 is past the end"),
     ErrorInfo(400, "the request cannot be resumed: id 9 is past the end", param="resume",
               code="invalid_continuation")),
    (GuidedDecodingError("no output at all"),
     ErrorInfo(400, "the output constraint cannot be used: no output at all", code="invalid_grammar")),
    (PriorityError(3), ErrorInfo(400, str(PriorityError(3)), param="priority")),
    (LoraAdapterError("gone"), ErrorInfo(400, "gone", param="model", code="invalid_lora_adapter")),
    (PromptError("bad template", "messages", "invalid_template"),
     ErrorInfo(400, "bad template", param="messages", code="invalid_template")),
    (EngineDeadError("stopped"), ErrorInfo(503, "stopped", "server_error", code="engine_dead")),
    (ImageEncodeError("tower"), ErrorInfo(500, "tower", "internal_error", code="engine_error")),
])
def test_each_failure_fixes_its_status_code_and_field(error, expected):
    assert error.info() == expected


def test_the_old_builtin_bases_still_catch_them():
    assert isinstance(PromptError("x"), ValueError) and isinstance(EngineDeadError("x"), RuntimeError)


def _completion(max_tokens: int | None) -> GenerateRequest:
    return GenerateRequest(request_id="r", params=SamplingParams(), prompt="hi", max_tokens=max_tokens)


def test_a_refusal_names_the_prompt_field_of_the_request_it_refuses():
    too_long = CapacityError("no room", prompt_alone=True)
    assert _refusal(chat_request("hi", 5), too_long).error.param == "messages"
    assert _refusal(_completion(5), too_long).error.param == "prompt"


def test_an_output_budget_is_blamed_only_when_the_client_set_it():
    budget = CapacityError("needs more KV cache")
    assert _refusal(_completion(5000), budget).error.param == "max_tokens"
    assert _refusal(_completion(None), budget).error.param == "prompt"
    assert _refusal(chat_request("hi", None), budget).error.code == "context_length_exceeded"
