"""Side-by-side serving benchmark, one command: the same model and load through chatserve's
engine offline, its worker path without Ray, the Serve path, vLLM's CPU server and
llama.cpp's server.

    python -m tools.bench.compare --model default --levels 1 16 32 64 --max-tokens 64
    python -m tools.bench.compare --model near-free --levels 1 16 64 128 --max-tokens 256 \
        --systems engine worker serve vllm

Every system gets the load of `tools.bench.load` (one templated prompt, temperature 0.8,
ignore_eos, a closed loop of max(8, 2C) requests at concurrency C), run one after another
on this machine, loopback only, chatserve in --dtype (float32 by default). vLLM cannot
serve the blocks of a GGUF on CPU and serves the float copy, in the dtype chatserve's `auto`
picks for float weights on this CPU (bfloat16 where AMX multiplies it, else float32;
--vllm-dtype sets another), or in --dtype with --quantization none (the same weights).
The Serve path is `serve run` of a config written from configs/default.yaml for the model,
started the way `make serve` starts it (serve_app.launch, SERVE_ENV); vLLM is `vllm serve` from its own venv
(tools/bench/vllm_cpu_env.sh) on the same model directory. llama.cpp's `llama-server`
(built once by tools/bench/llamacpp_server.sh) serves the model's own GGUF
file (the default model only: a Q4_1 GGUF), one slot per concurrent stream, a thread per
core. Prints a table with each system's throughput as a share of the engine offline and of
vLLM, and writes every report to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from tools.bench.near_free_model import write_near_free_model
from tools.servers import stop_session, wait_ready
from workers.contract.model_config import BUILTIN_DEFAULT_MODEL
from workers.model.loader import prepare_model_dir, resolve_dtype, resolve_gguf

REPO = Path(__file__).resolve().parents[2]
SERVE_PORT = 8000
VLLM_PORT = 8011
LLAMACPP_PORT = 8012
PEER_TITLES = {"vllm": "vLLM", "llamacpp": "llama.cpp"}
# Idle seconds between two systems: the machine's state after one run is the next one's
# start. On the project's VMs the Serve path started right after the engine's run made
# 103-109 tok/s at c=1, against 144-147 alone or after a minute's pause (default model, AMX
# Xeon, 2026-11-29; not heat: after 40 s of both cores spinning it made 144); llama.cpp's
# server 81-85 either way. Most likely the VM's free page reporting (virtio-balloon), which
# hands the memory a run freed back to the host, to be faulted in again by the next one.
SETTLE_S = 60.0

# How `make serve` starts Ray and Serve, less the HTTP edge (the Makefile's SERVE_ENV is
# this plus EDGES[DEFAULT_EDGE]: a test keeps them equal; the Makefile says why each).
SERVE_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_worker_niceness": "0",
    "RAY_task_events_report_interval_ms": "0",
    "RAY_event_stats": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}

# The HTTP edges Ray Serve offers: its proxy (port 8000), the ingress replica's own port
# (direct ingress), or HAProxy in front of the replicas' ports (port 8000): (env, port).
_REPLICA_PORTS = {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "8001", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "8100"}
EDGES = {
    "proxy": ({}, SERVE_PORT),
    "direct": ({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", **_REPLICA_PORTS}, 8001),
    "haproxy": ({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_NBTHREAD": "1", **_REPLICA_PORTS}, SERVE_PORT),
}
DEFAULT_EDGE = "haproxy"


@dataclass(frozen=True)
class Model:
    """A model as the systems take it: chatserve's `source`, vLLM's directory, the window."""

    name: str
    source: str
    directory: Path
    max_num_seqs: int


def resolve_model(name: str, out: Path) -> Model:
    if name == "default":
        return Model("SmolLM2-135M-Instruct", BUILTIN_DEFAULT_MODEL, prepare_model_dir(BUILTIN_DEFAULT_MODEL), 64)
    if name == "near-free":
        directory = write_near_free_model(out / "near-free-model")
        return Model("near-free", str(directory), directory, 128)
    raise SystemExit(f"unknown model {name!r} (default, near-free)")


def serve_config(model: Model, dtype: str, out: Path, quantization: str = "auto",
                 quantized_activations: str = "int8x2") -> Path:
    """configs/default.yaml with the model, dtype and quantization swapped in, bound to loopback."""
    config = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    config["http_options"]["host"] = "127.0.0.1"
    spec = config["applications"][0]["args"]["models"][0]
    spec.update(id=model.name, source=model.source, dtype=dtype, quantization=quantization,
                quantized_activations=quantized_activations)
    spec["engine"]["max_num_seqs"] = model.max_num_seqs
    path = out / f"serve-{model.name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run(cmd: list[str], **kwargs) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, **kwargs)


def load(args, url: str, model_name: str, report: Path) -> None:
    run([sys.executable, "-m", "tools.bench.load", "--url", url, "--model", model_name, "--concurrency",
         *map(str, args.levels), "--max-tokens", str(args.max_tokens), "--json", str(report)])


def bench_engine(args, model: Model, mode: str, config: Path, report: Path) -> None:
    run([sys.executable, "-m", "tools.bench.engine", "--source", model.source, "--dtype", args.dtype,
         "--quantization", args.quantization, "--quantized-activations", args.quantized_activations, mode,
         "--config", str(config), "--concurrency", *map(str, args.levels), "--max-tokens", str(args.max_tokens),
         "--json", str(report)])


def serve_environment(edge: str, plain: bool = False) -> tuple[dict[str, str], int]:
    """What `serve run` is started with, and the port it serves on: make serve's (SERVE_ENV
    and the edge's), or, `plain`, nothing of chatserve's (Serve's proxy on port 8000)."""
    if plain:
        return {}, EDGES["proxy"][1]
    edge_env, port = EDGES[edge]
    return {**SERVE_ENV, **edge_env}, port


def serve_command(config: Path, plain: bool = False) -> list[str]:
    """How the Serve path is started: as `make serve` starts it (serve_app.launch: `serve run`
    in a Ray without the dashboard's modules), or, `plain`, `serve run` as typed by hand."""
    if plain:
        return [console_script("serve"), "run", str(config)]
    return [sys.executable, "-m", "serve_app.launch", str(config)]


def console_script(name: str) -> str:
    """A console script beside this interpreter, else on PATH (on a lent GPU machine the
    carried wheels install Ray's under a folder of their own: tools/gpu_session/)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


@contextmanager
def server_running(cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None,
                   ready_timeout_s: float = 600) -> Iterator[str]:
    """A server started with `cmd` (loopback, its output in `log_path`); yields its URL once
    it serves, and stops it with everything it started."""
    print("$", " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, ready_timeout_s, process)
        yield url
    finally:
        stop_session(process)


@contextmanager
def serve_running(config: Path, edge: str, extra_env: dict[str, str], log_path: Path,
                  plain: bool = False, ready_timeout_s: float = 600) -> Iterator[str]:
    """`config` served as `make serve` serves it (serve_command, SERVE_ENV, the edge's environment)
    plus `extra_env`, or `plain`: as a user types it, with no environment of chatserve's
    (Serve's proxy is the edge); yields its URL once it serves, and stops everything it started."""
    chosen, port = serve_environment(edge, plain)
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **chosen, **extra_env, "PYTHONPATH": python_path}
    # Ray's daemons, workers and HAProxy stay in the command's session, which server_running
    # stops whole: by process ids, never another Ray on the machine.
    with server_running(serve_command(config, plain), port, log_path, env, ready_timeout_s) as url:
        yield url


def bench_serve(args, model: Model, config: Path, report: Path, plain: bool = False) -> None:
    extra = dict(item.split("=", 1) for item in args.serve_env)
    with serve_running(config, args.edge, extra, args.out / "serve.log", plain) as url:
        load(args, url, model.name, report)


def setup_script(name: str) -> str:
    """Run a peer's idempotent install script (tools/bench/) and return the path it prints last."""
    out = subprocess.run([str(REPO / "tools" / "bench" / name)], check=True, capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


def vllm_dtype(args) -> str:
    """vLLM's dtype: --vllm-dtype; else chatserve's --dtype where both serve the float copy;
    else (chatserve on the blocks) what chatserve's `auto` gives float weights on this CPU:
    the peer in its best dtype here, as a user with the float checkpoint would run it."""
    if args.vllm_dtype:
        return args.vllm_dtype
    if args.quantization == "none":
        return args.dtype
    return str(resolve_dtype("auto", "cpu", quantized=False)).removeprefix("torch.")


def bench_vllm(args, model: Model, report: Path) -> None:
    venv = setup_script("vllm_cpu_env.sh")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    cmd = [str(REPO / venv / "bin" / "vllm"), "serve", str(model.directory), "--served-model-name", model.name,
           "--dtype", vllm_dtype(args), "--host", "127.0.0.1", "--port", str(VLLM_PORT)]
    with server_running(cmd, VLLM_PORT, args.out / "vllm.log", env) as url:
        load(args, url, model.name, report)


def llamacpp_command(binary: str, gguf: Path, model_name: str, slots: int, context_per_slot: int) -> list[str]:
    """llama-server on `gguf`: one slot per concurrent stream (its continuous batching runs
    them together), a thread per core, the GGUF's own chat template. --no-repack: a Q4_1
    file crashed at load with its weights repacked (2026-11-25, Xeon)."""
    return [binary, "-m", str(gguf), "--alias", model_name, "--host", "127.0.0.1", "--port", str(LLAMACPP_PORT),
            "-t", str(os.cpu_count() or 1), "-np", str(slots), "-c", str(slots * context_per_slot), "--jinja",
            "--no-repack"]


def bench_llamacpp(args, model: Model, report: Path) -> None:
    gguf = resolve_gguf(model.source)
    if gguf is None:
        raise SystemExit(f"llama.cpp serves GGUF files: {model.name} has none (use --model default)")
    binary = setup_script("llamacpp_server.sh")
    cmd = llamacpp_command(binary, gguf, model.name, max(args.levels), context_per_slot=512)
    with server_running(cmd, LLAMACPP_PORT, args.out / "llamacpp.log", ready_timeout_s=300) as url:
        load(args, url, model.name, report)


def levels(path: Path) -> dict[int, dict]:
    return {level["concurrency"]: level for level in json.loads(path.read_text())["levels"]} if path.exists() else {}


def summary(results: dict[str, dict[int, dict]]) -> str:
    """One row per system and level; the peer column is vLLM's, else llama.cpp's."""
    peer_name = "vllm" if "vllm" in results else "llamacpp"
    engine, peer = results.get("engine", {}), results.get(peer_name, {})
    lines = [f"| system | c | output tok/s | vs engine offline | vs {PEER_TITLES[peer_name]} | TTFT med / p99 ms "
             "| TTFT over engine ms | TPOT med / p99 ms |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for system, by_level in results.items():
        for c, level in sorted(by_level.items()):
            tok_s = level["output_tok_s"]
            vs_engine = f"{tok_s / engine[c]['output_tok_s']:.0%}" if c in engine else "-"
            vs_peer = f"{tok_s / peer[c]['output_tok_s']:.2f}x" if c in peer else "-"
            ttft_over = f"{level['ttft_median_ms'] - engine[c]['ttft_median_ms']:+.1f}" if c in engine else "-"
            lines.append(f"| {system} | {c} | {tok_s:.1f} | {vs_engine} | {vs_peer} | "
                         f"{level['ttft_median_ms']:.1f} / {level['ttft_p99_ms']:.1f} | {ttft_over} | "
                         f"{level['tpot_median_ms']:.1f} / {level['tpot_p99_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default (SmolLM2-135M-Instruct) or near-free")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--systems", nargs="+", default=["engine", "serve", "vllm"],
                        choices=["engine", "worker", "serve", "plain", "vllm", "llamacpp"],
                        help="plain: `serve run` of the config as typed by hand, without make serve's environment")
    parser.add_argument("--dtype", default="float32", help="chatserve's (engine, worker and Serve)")
    parser.add_argument("--vllm-dtype", choices=("float32", "bfloat16"), default=None,
                        help="vLLM's; default: --dtype with --quantization none, else what chatserve's auto picks "
                        "for float weights on this CPU")
    parser.add_argument("--quantization", choices=("auto", "none"), default="auto",
                        help="chatserve's (engine and Serve): auto keeps a GGUF file's blocks, none its float copy")
    parser.add_argument("--quantized-activations", choices=("int8x2", "int8", "float32"), default="int8x2",
                        help="chatserve's quantized_activations (engine and Serve)")
    parser.add_argument("--edge", choices=sorted(EDGES), default=DEFAULT_EDGE, help="the Serve path's HTTP edge")
    parser.add_argument("--serve-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more environment for `serve run` (and so for Ray and the replicas)")
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help="idle seconds before each system after the first (SETTLE_S says why)")
    parser.add_argument("--label", default="", help="added to the report files' names (A/B runs)")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model, args.out)
    config = serve_config(model, args.dtype, args.out, args.quantization, args.quantized_activations)
    reports = {system: args.out / f"{args.model}-{system}{args.label}.json" for system in args.systems}
    for index, system in enumerate(args.systems):
        if index:
            time.sleep(args.settle_s)
        print(f"== {system}: {model.name}, c={args.levels}, {args.max_tokens} tokens", flush=True)
        if system in ("engine", "worker"):
            bench_engine(args, model, "offline" if system == "engine" else "worker", config, reports[system])
        elif system in ("serve", "plain"):
            bench_serve(args, model, config, reports[system], plain=system == "plain")
        elif system == "llamacpp":
            bench_llamacpp(args, model, reports[system])
        else:
            bench_vllm(args, model, reports[system])
    table = summary({system: levels(path) for system, path in reports.items()})
    (args.out / f"{args.model}-summary.md").write_text(table + "\n")
    print(f"\n{os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M')}\n{table}")


if __name__ == "__main__":
    main()
