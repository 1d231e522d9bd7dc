"""Embeddings throughput (`make bench-embeddings`): inputs/s of the default model's
/v1/embeddings work at batch 1 (one input at a time) and batch 64 (64 inputs submitted
together), in the engine alone and, with `--url`, through a running server's HTTP route.

    python -m tools.bench.embeddings --batch 1 64 --rounds 3
    python -m tools.bench.embeddings --batch 1 64 --url http://127.0.0.1:8000 --model default

Inputs are sentences of 20-60 tokens (a RAG chunk's order of size is larger: `--words`);
the engine takes configs/default.yaml's limits and pooler. Each figure is the median of
`--rounds` rounds of `--inputs` inputs."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tools.bench.engine import SERVE_CONFIG, served_model_config
from workers.contract.sampling_params import Pooling, SamplingParams
from workers.engine.kv_sizing import sized_engine_limits
from workers.engine.llm_engine import LLMEngine
from workers.model.attention import register_paged_attention
from workers.model.loader import load_model
from workers.serving.deployment import decoder_pooler
from workers.serving.host_memory import keep_freed_memory

WORDS = ("serve model batch token cache vector prompt layer stream replica engine query document search "
         "index chunk answer cluster device memory").split()


def sentences(count: int, words: tuple[int, int]) -> list[str]:
    """`count` different inputs of words[0]..words[1] words (a fixed pattern: runs compare)."""
    low, high = words
    return [" ".join([f"#{i}"] + [WORDS[(i * 7 + j) % len(WORDS)] for j in range(low - 1 + i * 13 % (high - low + 1))])
            for i in range(count)]


def engine_rate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, batch: int) -> float:
    """Inputs/s with `batch` inputs submitted at a time, each group finished before the next."""
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        pending = {engine.add_request(p, params) for p in prompts[first:first + batch]}
        while pending:
            for event in engine.step():
                assert event.embedding is not None, event
                pending.discard(event.request_id)
    return len(prompts) / (time.perf_counter() - start)


def http_rate(url: str, model: str, texts: list[str], batch: int) -> float:
    import httpx

    start = time.perf_counter()
    with httpx.Client(timeout=600) as client:
        for first in range(0, len(texts), batch):
            resp = client.post(url + "/v1/embeddings", json={"model": model, "input": texts[first:first + batch],
                                                              "encoding_format": "base64"})
            resp.raise_for_status()
    return len(texts) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--inputs", type=int, default=128)
    parser.add_argument("--words", type=int, nargs=2, default=[15, 45])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", default=None, help="also measure this server's /v1/embeddings")
    parser.add_argument("--model", default="default", help="the served model id (with --url)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    texts = sentences(args.inputs, tuple(args.words))
    results: dict[str, dict[int, float]] = {}
    if args.url:
        results["http"] = {b: statistics.median(http_rate(args.url, args.model, texts, b) for _ in range(args.rounds))
                           for b in args.batch}
    keep_freed_memory()
    config = served_model_config(SERVE_CONFIG)
    loaded = load_model(args.source, dtype=config.dtype, quantization=config.quantization,
                        quantized_activations=config.quantized_activations)
    loaded.model.set_attn_implementation(register_paged_attention())
    cpu = torch.device("cpu")
    engine = LLMEngine(loaded.model, frozenset(), sized_engine_limits(config, loaded.model, cpu), cpu)
    pooler = decoder_pooler(config.pooler_config, loaded.path)
    params = SamplingParams(max_tokens=1, pooling=Pooling(pooler.pooling_type.lower(), pooler.normalize))
    prompts = [loaded.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    engine_rate(engine, prompts[:4], params, 4)  # warm-up
    results["engine"] = {b: statistics.median(engine_rate(engine, prompts, params, b) for _ in range(args.rounds))
                         for b in args.batch}
    tokens = sum(map(len, prompts)) / len(prompts)
    for path, rates in results.items():
        for batch, rate in rates.items():
            print(f"{path:<6} batch={batch:<3} inputs/s={rate:8.1f}  ({rate * tokens:8.0f} prompt tok/s, "
                  f"{tokens:.0f} tokens an input, dtype {config.dtype})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_threads": torch.get_num_threads(), "tokens_per_input": tokens, "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
