"""tools.bench.compare starts the Serve path the way `make serve` does."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tools.bench.compare import (
    DEFAULT_EDGE,
    EDGES,
    SERVE_ENV,
    SERVE_PORT,
    llamacpp_command,
    serve_command,
    serve_environment,
    summary,
)

MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"


def makefile_serve_env() -> dict[str, str]:
    text = MAKEFILE.read_text().replace("\\\n", " ")
    words = shlex.split(re.search(r"^SERVE_ENV := (.*)$", text, re.M).group(1))
    return dict(word.split("=", 1) for word in words)


def test_the_benchmark_starts_serve_with_make_serves_environment():
    edge_env, _ = EDGES[DEFAULT_EDGE]
    assert makefile_serve_env() == {**SERVE_ENV, **edge_env}


def test_make_serve_uses_that_environment_and_command():
    recipe = re.search(r"^serve: .*\n\t(.*)$", MAKEFILE.read_text(), re.M).group(1)
    words = recipe.replace("$(if $(DASHBOARD),--dashboard) ", "").split()
    assert words[0] == "$(SERVE_ENV)" and words[1] == "$(BIN)/python"
    config = Path("configs/default.yaml")
    assert words[2:] == serve_command(config)[1:]  # the benchmark's command, less its interpreter
    assert serve_command(config, plain=True)[1:] == ["run", "configs/default.yaml"]


def test_make_serves_start_and_the_plain_one():
    env, port = serve_environment(DEFAULT_EDGE)
    assert env == makefile_serve_env() and port == SERVE_PORT
    assert serve_environment(DEFAULT_EDGE, plain=True) == ({}, SERVE_PORT)  # as typed by hand: Serve's proxy


def test_llama_server_gets_a_slot_per_stream_and_the_files_own_template():
    cmd = llamacpp_command("/bin/llama-server", Path("/m/model.gguf"), "m", slots=64, context_per_slot=512)
    args = dict(zip(cmd[1::2], cmd[2::2]))
    assert args["-m"] == "/m/model.gguf" and args["-np"] == "64" and args["-c"] == str(64 * 512)
    assert args["--host"] == "127.0.0.1" and "--jinja" in cmd and "--no-repack" in cmd


def test_the_table_compares_with_llama_cpp_when_vllm_did_not_run():
    level = {"output_tok_s": 10.0, "ttft_median_ms": 1.0, "ttft_p99_ms": 2.0, "tpot_median_ms": 1.0,
             "tpot_p99_ms": 1.0}
    table = summary({"serve": {1: level}, "llamacpp": {1: {**level, "output_tok_s": 20.0}}})
    assert "vs llama.cpp" in table and "| serve | 1 | 10.0 | - | 0.50x |" in table


def test_the_serve_config_carries_the_chosen_quantization(tmp_path):
    import yaml

    from tools.bench.compare import resolve_model, serve_config
    from workers.contract.model_config import ModelConfig

    model = resolve_model("default", tmp_path)
    for quantization in ("auto", "none"):
        config = yaml.safe_load(serve_config(model, "float32", tmp_path, quantization).read_text())
        spec = config["applications"][0]["args"]["models"][0]
        assert ModelConfig(**spec).quantization == quantization and spec["dtype"] == "float32"


def test_vllm_serves_the_float_copy_in_the_dtype_auto_gives_float_weights_here(monkeypatch):
    import argparse

    import torch

    import tools.bench.compare as compare

    def args(**given):
        return argparse.Namespace(**{"vllm_dtype": None, "quantization": "auto", "dtype": "float32", **given})

    for native_bf16, picked in ((True, "bfloat16"), (False, "float32")):
        def auto(dtype, device, quantized=False, native=native_bf16):
            return torch.bfloat16 if native and not quantized else torch.float32

        monkeypatch.setattr(compare, "resolve_dtype", auto)
        assert compare.vllm_dtype(args()) == picked  # chatserve on the blocks: vLLM's best on this CPU
        assert compare.vllm_dtype(args(quantization="none")) == "float32"  # the same weights as chatserve
        assert compare.vllm_dtype(args(vllm_dtype="bfloat16", quantization="none")) == "bfloat16"
