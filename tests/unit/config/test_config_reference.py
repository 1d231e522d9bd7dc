"""docs/CONFIG.md stays what tools/config_reference.py generates from the config models."""

from __future__ import annotations

from tests.support.paths import REPO_ROOT
from tools import config_reference

REGENERATE = "python -m tools.config_reference --write"


def test_config_md_is_generated_from_the_models():
    committed = (REPO_ROOT / "docs" / "CONFIG.md").read_text(encoding="utf-8")
    assert committed == config_reference.render(), (
        f"docs/CONFIG.md differs from the config models: regenerate it with `{REGENERATE}` and commit it")


def test_every_config_field_has_a_description():
    missing = [key.path for key in config_reference.all_keys() if not (key.field.description or "").strip()]
    assert not missing, f"config fields without a description= (docs/CONFIG.md needs one): {missing}"


def test_the_reference_reaches_every_config_model():
    paths = {key.path for key in config_reference.all_keys()}
    for path in ("models[].engine.max_num_seqs", "models[].deployment.autoscaling_config.max_replicas",
                 "ingress.max_ongoing_requests", "server.media.allowed_hosts", "server.api_keys_env"):
        assert path in paths


def test_rows_carry_defaults_constraints_and_literals():
    text = config_reference.render()
    assert "| `models[].engine.block_size` | int | `16` | [1, 1024] |" in text
    assert "| `models[].engine.gpu_memory_utilization` | number | `0.9` | (0, 1] |" in text
    assert "| `models[].device` | string | `cpu` | `cpu`, `cuda` |" in text
    assert "| `ingress.max_ongoing_requests` | int | `1024` |" in text  # the ingress's own default
    assert "| `models[].deployment.max_ongoing_requests` | int | `256` |" in text
    assert "matches `^[A-Za-z_][A-Za-z0-9_]*$`" in text


def test_rendering_is_deterministic():
    assert config_reference.render() == config_reference.render()
