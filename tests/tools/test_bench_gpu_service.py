"""The GPU-session tool's CPU smoke run (tools/bench/gpu_service.py, `--shape tiny --device
cpu`), so that what a lent GPU machine runs cannot rot between GPU sessions: the checkpoint,
the engine phase in both arrival patterns, the Serve-against-engine table."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from tests.support.engines import make_engine
from tests.support.tiny_models import build_tokenizer
from tools.bench.engine import offline_level
from tools.bench.gpu_service import bench_prompt, main, serve_config, table
from workers.contract.model_config import ModelConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(tokenizer_dir)
    out = tmp_path_factory.mktemp("ckpt")
    main(["checkpoint", "--tokenizer", str(tokenizer_dir), "--out", str(out), "--shape", "tiny", "--device", "cpu"])
    return out


def test_checkpoint_takes_the_tokenizer_vocabulary_in_bfloat16(checkpoint):
    config = AutoConfig.from_pretrained(checkpoint)
    assert config.vocab_size == len(build_tokenizer()) and str(config.dtype).endswith("bfloat16")
    assert (checkpoint / "tokenizer.json").exists()


def test_serve_config_is_the_gpu_config_with_the_checkpoint(checkpoint):
    spec = serve_config(checkpoint, "cpu")["applications"][0]["args"]["models"][0]
    config = ModelConfig.model_validate(spec)  # what `serve run` validates
    assert config.source == str(checkpoint) and config.device == "cpu" and str(config.dtype).endswith("bfloat16")


def test_prompt_reaches_the_asked_length(checkpoint):
    tokenizer = build_tokenizer()
    text = bench_prompt(tokenizer, 200)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    assert 200 <= len(ids) < 240


class FirstTokenSteps:
    """An engine whose steps are counted: how many requests had their first token in each."""

    def __init__(self, engine):
        self.engine, self.seen, self.firsts_per_step = engine, set(), []

    def add_request(self, *args, **kwargs):
        return self.engine.add_request(*args, **kwargs)

    def has_work(self):
        return self.engine.has_work()

    def step(self):
        events = self.engine.step()
        firsts = {e.request_id for e in events} - self.seen
        self.seen |= firsts
        if firsts:
            self.firsts_per_step.append(len(firsts))
        return events


@pytest.mark.parametrize("staggered, firsts", [(False, [4, 2]), (True, [1, 1, 1, 1, 1, 1])])
def test_staggered_arrivals_spread_the_first_requests(tiny_model, staggered, firsts):
    """Lockstep: the first C requests start in one step (and their successors in another);
    staggered: one a step, so they end, and their successors start, one a step."""
    engine = FirstTokenSteps(make_engine(tiny_model))
    report = offline_level(engine, [1, 2, 3, 4, 5], 4, 6, 3, staggered=staggered)
    assert report.requests == 6 and report.output_tok_s > 0
    assert engine.firsts_per_step == firsts


def test_engine_phase_and_table(checkpoint, tmp_path, capsys):
    engine_json = tmp_path / "engine.json"
    main(["engine", "--model", str(checkpoint), "--device", "cpu", "--levels", "2", "--max-tokens", "4",
          "--prompt-tokens", "32", "--json", str(engine_json)])
    (level,) = json.loads(engine_json.read_text())["levels"]
    assert level["concurrency"] == 2 and level["requests"] == 8 and level["output_tok_s"] > 0
    serve_json = tmp_path / "serve.json"  # the shape run_serve writes, from a made-up run
    serve_json.write_text(json.dumps({"levels": [{**level, "output_tok_s": level["output_tok_s"] / 2,
                                                  "outside_cpu_us_per_token": 90.0}]}))
    assert "| 2 |" in table(engine_json, serve_json) and "50%" in table(engine_json, serve_json)
