"""Speculation through the servers against llama.cpp's own (`make bench-spec-llamacpp`): the
edit and chat loads of tools.bench.spec over HTTP at concurrency 1, through chatserve's Serve
path with speculation off, ngram and suffix, and through llama.cpp's `llama-server` on the
same GGUF with none and with its n-gram speculation types.

    python -m tools.bench.spec_peers --num-requests 8 --max-tokens 128

chatserve: `serve run` of tools.bench.compare's config for the default model, started as
`make serve` starts it; ngram adds `speculative: {method: ngram, num_speculative_tokens: 4,
prompt_lookup_min: 2, prompt_lookup_max: 4}` (what `make bench-spec` measures), suffix the
same lookup with earlier answers (`method: suffix`, up to 16 proposals). llama.cpp:
tools.bench.compare's command with one slot, then once for each `--llamacpp-spec` entry,
a `--spec-type` with its own defaults, or TYPE:FLAG=VALUE,... for other settings (llama.cpp
has no draft model here either: no smaller model with this tokenizer is at hand offline).
Both servers get the same requests (tools.bench.load: the edit load greedy, the chat load at
temperature 0.8, ignore_eos), one server at a time, loopback only: first one request, then
`--num-requests` more of the same. Prints each variant's output tok/s for the first request
and for the rest, with "on / off" against the same server without speculation. The first
request is the fair figure for proposers that keep earlier answers (chatserve's suffix,
llama.cpp's ngram-mod and ngram-cache): on the later, identical requests they replay the
answer they have seen.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from tools.bench.compare import (
    DEFAULT_EDGE,
    LLAMACPP_PORT,
    REPO,
    levels,
    llamacpp_command,
    resolve_model,
    serve_config,
    serve_running,
    server_running,
    setup_script,
)
from tools.bench.load import DEFAULT_PROMPT
from tools.bench.spec import EDIT_PROMPT
from workers.model.loader import resolve_gguf

CHATSERVE_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# suffix: the same lookup plus earlier answers; a replayed answer is taken whole, so longer proposals pay.
CHATSERVE_SUFFIX = {**CHATSERVE_NGRAM, "method": "suffix", "num_speculative_tokens": 16}
# llama.cpp's n-gram types with their defaults, and ngram-simple sized as chatserve's lookup.
LLAMACPP_SPEC = ["ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache",
                 "ngram-simple:spec-ngram-simple-size-n=3,spec-ngram-simple-size-m=4"]


@dataclass(frozen=True)
class Load:
    name: str
    prompt: str
    temperature: float


LOADS = (Load("edit", EDIT_PROMPT, 0.0), Load("chat", DEFAULT_PROMPT, 0.8))


def llamacpp_spec_flags(entry: str) -> list[str]:
    """`--spec-type TYPE` and its settings from a TYPE[:FLAG=VALUE,...] entry."""
    spec_type, _, settings = entry.partition(":")
    flags = ["--spec-type", spec_type]
    for setting in filter(None, settings.split(",")):
        flag, _, value = setting.partition("=")
        flags += [f"--{flag}", value]
    return flags


def with_speculation(config: Path, out: Path, speculative: dict = CHATSERVE_NGRAM) -> Path:
    """The Serve config with the default model's `speculative` block added."""
    data = yaml.safe_load(config.read_text())
    data["applications"][0]["args"]["models"][0]["speculative"] = dict(speculative)
    path = out / f"{config.stem}-{speculative['method']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_loads(args, url: str, model_name: str, variant: str) -> dict[str, dict[str, dict]]:
    """Each load at c=1 against `url`, first one request (the server has seen no answer like it),
    then `--num-requests` of the same request: load name -> {"first": ..., "all": ...}, each
    tools.bench.load's level report."""
    results = {}
    for load in LOADS:
        if load.name not in args.loads:
            continue
        results[load.name] = {}
        for part, count in (("first", 1), ("all", args.num_requests)):
            report = args.out / f"spec-peers-{variant}-{load.name}-{part}.json"
            cmd = [sys.executable, "-m", "tools.bench.load", "--url", url, "--model", model_name, "--concurrency",
                   "1", "--num-requests", str(count), "--max-tokens", str(args.max_tokens), "--prompt", load.prompt,
                   "--temperature", str(load.temperature), "--json", str(report)]
            subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
            results[load.name][part] = levels(report)[1]
        print(f"{variant:<45} {load.name:<5} first {results[load.name]['first']['output_tok_s']:6.1f}, "
              f"all {results[load.name]['all']['output_tok_s']:6.1f} tok/s", flush=True)
    return results


def table(results: dict[str, dict[str, dict[str, dict]]], baselines: dict[str, str]) -> str:
    """A row per variant and load: the first request's tok/s and the run's, each with its
    ratio to the same server without speculation."""
    lines = ["| server, speculation | load | first request, tok/s | on / off | all requests, tok/s | on / off "
             "| TPOT med / p99 ms |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for variant, by_load in results.items():
        base = results.get(baselines[variant], {})
        for load, parts in by_load.items():
            cells = []
            for part in ("first", "all"):
                tok_s = parts[part]["output_tok_s"]
                ratio = f"{tok_s / base[load][part]['output_tok_s']:.2f}x" if load in base else "-"
                cells += [f"{tok_s:.1f}", ratio]
            every = parts["all"]
            lines.append(f"| {variant} | {load} | {' | '.join(cells)} | "
                         f"{every['tpot_median_ms']:.1f} / {every['tpot_p99_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--loads", nargs="+", default=[load.name for load in LOADS],
                        choices=[load.name for load in LOADS])
    parser.add_argument("--systems", nargs="+", default=["serve", "llamacpp"], choices=["serve", "llamacpp"])
    parser.add_argument("--llamacpp-spec", nargs="*", default=LLAMACPP_SPEC,
                        help="llama-server speculation variants: TYPE or TYPE:FLAG=VALUE,...")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model("default", args.out)
    results: dict[str, dict[str, dict]] = {}
    baselines: dict[str, str] = {}
    if "serve" in args.systems:
        config = serve_config(model, "float32", args.out)
        variants = (("chatserve, off", config), ("chatserve, ngram k=4", with_speculation(config, args.out)),
                    ("chatserve, suffix k=16", with_speculation(config, args.out, CHATSERVE_SUFFIX)))
        for variant, path in variants:
            with serve_running(path, DEFAULT_EDGE, {}, args.out / "serve.log") as url:
                results[variant] = run_loads(args, url, model.name, variant)
            baselines[variant] = "chatserve, off"
    if "llamacpp" in args.systems:
        binary, gguf = setup_script("llamacpp_server.sh"), resolve_gguf(model.source)
        base = llamacpp_command(binary, gguf, model.name, slots=1, context_per_slot=2048)
        for entry in ["none", *args.llamacpp_spec]:
            variant = f"llama.cpp, {entry}"
            flags = [] if entry == "none" else llamacpp_spec_flags(entry)
            with server_running(base + flags, LLAMACPP_PORT, args.out / "llamacpp.log", ready_timeout_s=300) as url:
                results[variant] = run_loads(args, url, model.name, variant)
            baselines[variant] = "llama.cpp, none"
    text = table(results, baselines)
    (args.out / "spec-peers-summary.md").write_text(text + "\n")
    print(f"\n{os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M')}, c=1, {args.num_requests} requests of "
          f"{args.max_tokens} tokens a load\n{text}")


if __name__ == "__main__":
    main()
