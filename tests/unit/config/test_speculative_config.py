"""The `speculative` config: vLLM's names, the engine limits it sets, and what it refuses,
named by its dotted path."""

from __future__ import annotations

import pytest

from serve_app.config.app_config import ConfigError, parse_app_config
from workers.contract.model_config import ModelConfig
from workers.core.limits import SpeculativeLimits, engine_limits


def test_ngram_sets_the_engine_limits():
    model = ModelConfig(id="m", source="/models/m", speculative={"method": "ngram", "num_speculative_tokens": 5,
                                                                  "prompt_lookup_max": 6})
    limits = engine_limits(model, 2048)
    assert limits.speculative == SpeculativeLimits(num_tokens=5, lookup_min=2, lookup_max=6, disable_by_batch_size=3)
    assert engine_limits(ModelConfig(id="m", source="/models/m"), 2048).speculative is None
    assert ModelConfig.model_validate(model.model_dump()) == model  # the ingress re-reads the dumped config


def test_suffix_keeps_earlier_answers_and_ngram_keeps_none():
    spec = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_cached_requests": 32}
    limits = engine_limits(ModelConfig(id="m", source="/models/m", speculative=spec), 2048).speculative
    assert (limits.method, limits.history_requests, limits.lookup_min, limits.lookup_max) == ("suffix", 32, 2, 4)
    default = engine_limits(ModelConfig(id="m", source="/models/m", speculative={**spec, "method": "suffix",
                                        "suffix_decoding_max_cached_requests": 256}), 2048).speculative
    assert default.history_requests == 256
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    assert engine_limits(ModelConfig(id="m", source="/models/m", speculative=ngram), 2048).speculative.history_requests == 0


def test_draft_sets_the_method_and_refuses_a_split_model():
    spec = {"method": "draft", "num_speculative_tokens": 4, "draft_source": "/models/small"}
    limits = engine_limits(ModelConfig(id="m", source="/models/m", speculative=spec), 2048)
    assert limits.speculative.method == "draft" and limits.speculative.num_tokens == 4
    with pytest.raises(ConfigError, match=r"models\.0.*'draft' is not available on a model split over shards"):
        parse_app_config(_app({"speculative": spec, "parallel": {"tensor_parallel_size": 2}}))


def test_speculation_turns_async_scheduling_off():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    gpu = {"id": "m", "source": "/models/m", "device": "cuda", "deployment": {"ray_actor_options": {"num_gpus": 1}}}
    assert engine_limits(ModelConfig(**gpu), 2048).async_scheduling
    assert not engine_limits(ModelConfig(**gpu, speculative=spec), 2048).async_scheduling


def _app(model_fields: dict) -> dict:
    return {"models": [{"id": "m", "source": "/models/m", **model_fields}]}


@pytest.mark.parametrize(("speculative", "message"), [
    ({"method": "draft", "num_speculative_tokens": 3}, r"models\.0\.speculative.*'draft' needs draft_source"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_source": "/models/d"},
     r"models\.0\.speculative.*draft_source is for method 'draft'"),
    ({"method": "suffix", "num_speculative_tokens": 3, "draft_source": "/models/d"},
     r"models\.0\.speculative.*draft_source is for method 'draft'; method 'suffix'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "suffix_decoding_max_cached_requests": 8},
     r"models\.0\.speculative.*suffix_decoding_max_cached_requests is for method 'suffix'"),
    ({"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_cached_requests": 0},
     r"models\.0\.speculative\.suffix_decoding_max_cached_requests"),
    ({"method": "eagle", "num_speculative_tokens": 3}, r"models\.0\.speculative\.method"),
    ({"method": "ngram"}, r"models\.0\.speculative\.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"models\.0\.speculative\.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     r"models\.0\.speculative.*prompt_lookup_min \(5\) is above prompt_lookup_max \(3\)"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
     r"models\.0\.speculative\.draft_tensor_parallel_size"),
])
def test_what_speculation_cannot_do_is_a_config_error(speculative, message):
    with pytest.raises(ConfigError, match=message):
        parse_app_config(_app({"speculative": speculative}))
