"""Shared fixtures: a tiny tokenizer and a tiny random Llama for the engine unit tests.

The Ray / HTTP fixtures live in tests/support/serve_fixtures.py and start Ray only when a test asks.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.tiny_models import (
    build_tiny_llama,
    build_tokenizer,
    write_tiny_model_dir,
)

# Registering serve_fixtures here makes each session fixture exist once (importing them
# into two test modules would create two session fixtures and start Serve twice).
pytest_plugins = ["tests.support.serve_fixtures", "tests.support.node_client", "tests.support.tools_app"]


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # The tiny model runs ~1.5 ms a step on one thread; with two OpenMP threads on a 2-core
    # machine that is shared with anything else it can be 50x slower. In-process only:
    # Ray workers (the serve tests) set their own thread count.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    """The reference model, default ('sdpa') attention, eval mode. Never switch its attention
    implementation in place: use the `paged_model` fixture (a deep copy) for the paged path."""
    model = build_tiny_llama(len(tiny_tokenizer))
    model.eval()
    assert model.config._attn_implementation == "sdpa"
    return model


@pytest.fixture(scope="session")
def paged_attn_name() -> str:
    from workers.model.attention import register_paged_attention

    return register_paged_attention()


@pytest.fixture
def paged_model(tiny_model, paged_attn_name):
    """A deep copy of `tiny_model` (same weights) running the engine's paged attention."""
    model = copy.deepcopy(tiny_model)
    model.set_attn_implementation(paged_attn_name)
    yield model
    # The shared reference model must still be dense for the next test.
    assert tiny_model.config._attn_implementation == "sdpa"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))

