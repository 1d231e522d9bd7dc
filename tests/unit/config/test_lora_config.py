"""The `lora` block of a model's config, and the engine limits it sets."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.contract.model_config import LoraConfig, ModelConfig
from workers.core.limits import LoraLimits, engine_limits


def test_defaults_and_limits():
    config = ModelConfig(id="m", lora={"adapters": {"sql": "/a/sql"}, "max_loras": 2, "max_lora_rank": 8})
    assert engine_limits(config, 512).lora == LoraLimits(max_loras=2, max_rank=8)
    assert engine_limits(ModelConfig(id="m"), 512).lora is None
    assert LoraConfig().max_loras == 4 and LoraConfig().adapter_dir is None


@pytest.mark.parametrize("lora, message", [
    ({"adapters": {"bad name": "/a"}}, "adapter name 'bad name' must be"),
    ({"adapters": {"m": "/a"}}, r"adapter names \['m'\] are the model's own names"),
    ({"max_loras": 0}, "greater than or equal to 1"),
    ({"max_lora_rank": 1024}, "less than or equal to 512"),
    ({"adapter_dir": ""}, "at least 1 character"),
    ({"adapters_dir": "/a"}, "Extra inputs are not permitted"),
])
def test_bad_lora_configs_are_named(lora, message):
    with pytest.raises(ValidationError, match=message):
        ModelConfig(id="m", lora=lora)
