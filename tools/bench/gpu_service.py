"""The whole service on a GPU (../shared/gpu/CHECKLIST.md, items 1 and 2): a random-weight
Llama-1B checkpoint with the default model's tokenizer, `serve run` of configs/gpu.yaml on
it, the openai client's checks, and the Serve path against the engine offline, same load.

    python -m tools.bench.gpu_service checkpoint --tokenizer DIR --out /tmp/llama-1b
    python -m tools.bench.gpu_service engine --model /tmp/llama-1b --json engine.json
    python -m tools.bench.gpu_service serve --model /tmp/llama-1b --json serve.json
    python -m tools.bench.gpu_service table engine.json serve.json

The load is tools.bench.load's (streaming, temperature 0.8, ignore_eos, a closed loop of
max(8, 2C) requests at concurrency C) with a prompt of --prompt-tokens after the chat
template; the engine phase runs it straight into the engine the worker builds from the
same config (workers/serving/engine_build.py). The Serve phase also reads, per level, the
CPU that every process but the model worker and the load generator used (Linux /proc):
the Serve path's CPU per streamed token. `--shape tiny --device cpu` is a CPU smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MODEL_ID = "llama-1b-random"
SHAPES = {  # Llama-3.2-1B's shape; the vocabulary is the tokenizer's (random logits pick any id)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}


def write_checkpoint(tokenizer_dir: Path, out: Path, shape: str, device: str) -> Path:
    """A random-weight Llama in bfloat16 (save_pretrained) beside `tokenizer_dir`'s files."""
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(**SHAPES[shape], vocab_size=len(tokenizer), max_position_embeddings=8192,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def serve_config(model_dir: Path, device: str | None, direct_forward: bool = True) -> dict:
    """configs/gpu.yaml with the checkpoint as its model, bound to loopback."""
    config = yaml.safe_load((REPO / "configs" / "gpu.yaml").read_text())
    config["http_options"]["host"] = "127.0.0.1"
    spec = config["applications"][0]["args"]["models"][0]
    spec.update(id=MODEL_ID, source=str(model_dir))
    spec["engine"]["direct_forward"] = direct_forward
    if device:
        spec["device"] = device
        if device == "cpu":  # the CPU smoke run: no GPU to ask Ray for, no CUDA graphs
            spec["deployment"]["ray_actor_options"]["num_gpus"] = 0
            spec["engine"].pop("cuda_graph_max_batch_size")
            spec["engine"].pop("gpu_memory_utilization")
    return config


def bench_prompt(tokenizer, tokens: int) -> str:
    """A user message whose chat-templated prompt is at least `tokens` tokens."""
    words = 8
    while True:
        text = " ".join(f"word{i % 97}" for i in range(words))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if len(ids) >= tokens:
            return text
        words += max(1, int((tokens - len(ids)) * words / len(ids)))  # tokens a word, over-counted: no overshoot


def requests(args, concurrency: int) -> int:
    return args.num_requests or max(8, 2 * concurrency)


def run_engine(args) -> None:
    """The load straight into the engine the worker builds from the same config."""
    from tools.bench.engine import offline_level, write_reports
    from workers.contract.model_config import ModelConfig
    from workers.serving.engine_build import build_engine

    spec = serve_config(args.model, args.device, not args.no_direct)["applications"][0]["args"]["models"][0]
    config = ModelConfig.model_validate(spec)
    started = time.perf_counter()
    built = build_engine(config)
    print(f"engine built in {time.perf_counter() - started:.1f} s", flush=True)
    tokenizer = built.loaded.tokenizer
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": bench_prompt(tokenizer, args.prompt_tokens)}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    offline_level(built.engine, prompt_ids, 1, 1, 4)  # warm-up
    reports = []
    for concurrency in args.levels:
        report = offline_level(built.engine, prompt_ids, concurrency, requests(args, concurrency), args.max_tokens,
                               staggered=args.staggered)
        print(report.line("engine staggered" if args.staggered else "engine"), flush=True)
        reports.append(report)
    write_reports(args.json, reports, max_tokens=args.max_tokens, prompt_tokens=len(prompt_ids))


# --- serve: serve run, the client's checks, the load ---------------------------------------


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def client_checks(base_url: str) -> list[Check]:
    """The openai client against the running service: plain, streamed, tools, response_format."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="none", timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    def plain() -> str:
        reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=16)
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0, reply
        return f"{reply.usage.completion_tokens} tokens, finish {reply.choices[0].finish_reason}"

    def streamed() -> str:
        stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=16, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage and chunks[-1].usage.completion_tokens > 0, chunks[-3:]
        return f"{len(chunks)} chunks, {chunks[-1].usage.completion_tokens} tokens"

    def tools() -> str:
        tool = {"type": "function", "function": {
            "name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                           "required": ["city"], "additionalProperties": False}}}
        reply = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=[tool],
                                               tool_choice="required", max_tokens=64)
        call = reply.choices[0].message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and isinstance(arguments["city"], str), reply
        return f"{call.function.name}({call.function.arguments}), finish {reply.choices[0].finish_reason}"

    def response_format() -> str:
        schema = {"type": "object", "properties": {"sunny": {"type": "boolean"},
                                                   "sky": {"enum": ["clear", "cloudy", "rain"]}},
                  "required": ["sunny", "sky"], "additionalProperties": False}
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=messages, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema,
                                                                    "strict": True}})
        value = json.loads(reply.choices[0].message.content)
        assert isinstance(value["sunny"], bool) and value["sky"] in ("clear", "cloudy", "rain"), value
        return reply.choices[0].message.content

    return [_check(name, fn) for name, fn in
            (("non-streaming", plain), ("streaming", streamed), ("tools", tools), ("response_format", response_format))]


def _check(name: str, fn: Callable[[], str]) -> Check:
    try:
        return Check(name, True, fn())
    except Exception as exc:  # a failed check is a finding, not the end of the run
        return Check(name, False, "".join(traceback.format_exception_only(exc)).strip()[:500])


def _cpu_ticks_by_process() -> dict[int, tuple[str, int]]:
    from tools.bench.cpu_share import process_snapshot

    return {pid: (usage.name, usage.ticks) for pid, usage in process_snapshot().items()}


def serve_cpu_s(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> tuple[float, float]:
    """CPU seconds of (the model worker, everything else but this process) between the two
    snapshots; a process alive at one end only counts from zero or not at all."""
    from tools.bench.cpu_share import TICKS_PER_S

    worker = other = 0
    for pid, (name, ticks) in after.items():
        used = ticks - before.get(pid, (name, 0))[1]
        if pid == os.getpid() or used <= 0:
            continue
        if "ModelWorker" in name:
            worker += used
        else:
            other += used
    return worker / TICKS_PER_S, other / TICKS_PER_S


def run_serve(args) -> None:
    from transformers import AutoTokenizer

    from tools.bench.compare import serve_running

    out = Path(args.json).parent if args.json else Path(".")
    config_path = out / "serve-gpu.yaml"
    config_path.write_text(yaml.safe_dump(serve_config(args.model, args.device, not args.no_direct), sort_keys=False))
    prompt = bench_prompt(AutoTokenizer.from_pretrained(args.model), args.prompt_tokens)
    result: dict = {"max_tokens": args.max_tokens, "levels": []}
    started = time.perf_counter()
    try:
        with serve_running(config_path, "haproxy", {}, out / "serve.log", ready_timeout_s=args.ready_timeout) as url:
            result.update(url=url, ready_s=time.perf_counter() - started)
            print(f"serve ready in {result['ready_s']:.1f} s", flush=True)
            checks = client_checks(url)
            result["checks"] = [asdict(c) for c in checks]
            for check in checks:
                print(f"check {check.name}: {'ok' if check.ok else 'FAILED'}: {check.detail}", flush=True)
            for concurrency in args.levels:
                result["levels"].append(_serve_level(url, prompt, concurrency, args))
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))


def _serve_level(url: str, prompt: str, concurrency: int, args) -> dict:
    """One level of the load, with the CPU the processes other than the worker used meanwhile."""
    from tools.bench.load import run_level

    before = _cpu_ticks_by_process()
    report = asyncio.run(run_level(url, MODEL_ID, concurrency, requests(args, concurrency), args.max_tokens,
                                   prompt, True, {}))
    worker_s, other_s = serve_cpu_s(before, _cpu_ticks_by_process())
    tokens = report.output_tok_s * report.wall_s
    level = {**asdict(report), "worker_cpu_s": worker_s, "outside_cpu_s": other_s,
             "outside_cpu_us_per_token": 1e6 * other_s / tokens if tokens else float("nan")}
    print(report.line(), f" CPU outside the worker {level['outside_cpu_us_per_token']:.0f} us/token", flush=True)
    return level


def table(engine_path: Path, serve_path: Path) -> str:
    """The Serve path as a share of the engine, level by level (markdown)."""
    engine = {lv["concurrency"]: lv for lv in json.loads(engine_path.read_text())["levels"]}
    serve = {lv["concurrency"]: lv for lv in json.loads(serve_path.read_text())["levels"]}
    lines = ["| c | engine tok/s | Serve tok/s | Serve / engine | TTFT engine / Serve ms (added) "
             "| TPOT engine / Serve ms | CPU outside the worker µs/token |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in sorted(set(engine) & set(serve)):
        e, s = engine[c], serve[c]
        lines.append(f"| {c} | {e['output_tok_s']:.0f} | {s['output_tok_s']:.0f} | "
                     f"{s['output_tok_s'] / e['output_tok_s']:.0%} | {e['ttft_median_ms']:.1f} / "
                     f"{s['ttft_median_ms']:.1f} ({s['ttft_median_ms'] - e['ttft_median_ms']:+.1f}) | "
                     f"{e['tpot_median_ms']:.2f} / {s['tpot_median_ms']:.2f} | {s['outside_cpu_us_per_token']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ckpt = sub.add_parser("checkpoint", help="write the random-weight checkpoint")
    ckpt.add_argument("--tokenizer", type=Path, required=True, help="a folder with the default model's tokenizer")
    ckpt.add_argument("--out", type=Path, required=True)
    ckpt.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ckpt.add_argument("--device", default="cuda", help="where the random weights are made")
    load = argparse.ArgumentParser(add_help=False)
    load.add_argument("--model", type=Path, required=True, help="the checkpoint folder")
    load.add_argument("--device", default=None, help="override configs/gpu.yaml's device (cpu: smoke run)")
    load.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64, 256])
    load.add_argument("--max-tokens", type=int, default=256)
    load.add_argument("--prompt-tokens", type=int, default=512)
    load.add_argument("--num-requests", type=int, default=None, help="per level; default 2 x concurrency, >= 8")
    load.add_argument("--no-direct", action="store_true", help="engine.direct_forward: false (transformers' forward "
                      "for the steps that replay no CUDA graph)")
    load.add_argument("--json", default=None)
    engine = sub.add_parser("engine", parents=[load], help="the load straight into the engine")
    engine.add_argument("--staggered", action="store_true", help="the first requests come in one a step (as over "
                        "HTTP) rather than all at once")
    serve = sub.add_parser("serve", parents=[load], help="serve run, the client's checks, the load")
    serve.add_argument("--ready-timeout", type=float, default=300)
    tab = sub.add_parser("table", help="the Serve path against the engine (markdown)")
    tab.add_argument("engine_json", type=Path)
    tab.add_argument("serve_json", type=Path)
    args = parser.parse_args(argv)
    if args.command == "checkpoint":
        print(write_checkpoint(args.tokenizer, args.out, args.shape, args.device))
    elif args.command == "engine":
        run_engine(args)
    elif args.command == "serve":
        run_serve(args)
    else:
        print(table(args.engine_json, args.serve_json))


if __name__ == "__main__":
    main()
