"""tools.bench.spec_peers: chatserve's speculative config is one the server takes, llama.cpp
gets each speculation variant's flags, and the table sets each variant against its own
server without speculation, first request and all requests apart."""

from __future__ import annotations

import yaml

from tools.bench.compare import resolve_model, serve_config
from tools.bench.spec_peers import (
    CHATSERVE_NGRAM,
    CHATSERVE_SUFFIX,
    llamacpp_spec_flags,
    table,
    with_speculation,
)
from workers.contract.model_config import ModelConfig


def test_the_speculative_config_is_the_bench_spec_one_and_valid(tmp_path):
    config = with_speculation(serve_config(resolve_model("default", tmp_path), "float32", tmp_path), tmp_path)
    spec = yaml.safe_load(config.read_text())["applications"][0]["args"]["models"][0]
    model = ModelConfig(**spec)
    assert model.speculative.method == "ngram" and model.speculative.num_speculative_tokens == 4
    assert spec["speculative"] == CHATSERVE_NGRAM and (model.speculative.prompt_lookup_min,
                                                       model.speculative.prompt_lookup_max) == (2, 4)
    suffix = with_speculation(serve_config(resolve_model("default", tmp_path), "float32", tmp_path), tmp_path,
                              CHATSERVE_SUFFIX)
    model = ModelConfig(**yaml.safe_load(suffix.read_text())["applications"][0]["args"]["models"][0])
    assert model.speculative.method == "suffix" and suffix != config


def test_llama_cpp_variants_become_its_flags():
    assert llamacpp_spec_flags("ngram-mod") == ["--spec-type", "ngram-mod"]
    assert llamacpp_spec_flags("ngram-simple:spec-ngram-simple-size-n=3,spec-ngram-simple-size-m=4") == [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4"]


def level(tok_s: float) -> dict:
    return {"output_tok_s": tok_s, "tpot_median_ms": 1.0, "tpot_p99_ms": 2.0}


def test_each_variant_is_set_against_its_own_server_without_speculation():
    results = {
        "chatserve, off": {"edit": {"first": level(100.0), "all": level(100.0)}},
        "chatserve, ngram k=4": {"edit": {"first": level(130.0), "all": level(150.0)}},
        "llama.cpp, none": {"edit": {"first": level(50.0), "all": level(50.0)}},
        "llama.cpp, ngram-mod": {"edit": {"first": level(45.0), "all": level(95.0)}},
    }
    baselines = {"chatserve, off": "chatserve, off", "chatserve, ngram k=4": "chatserve, off",
                 "llama.cpp, none": "llama.cpp, none", "llama.cpp, ngram-mod": "llama.cpp, none"}
    text = table(results, baselines)
    assert "| chatserve, ngram k=4 | edit | 130.0 | 1.30x | 150.0 | 1.50x | 1.0 / 2.0 |" in text
    assert "| llama.cpp, ngram-mod | edit | 45.0 | 0.90x | 95.0 | 1.90x | 1.0 / 2.0 |" in text
    assert "| llama.cpp, none | edit | 50.0 | 1.00x | 50.0 | 1.00x |" in text
