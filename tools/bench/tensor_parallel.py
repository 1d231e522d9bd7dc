"""Decode step of a random ~1B Llama split over shards on this CPU, by tensors (TP=2) or
in two pipeline stages (PP=2, with and without micro-batches), against the whole model on
one process (workers/parallel/):

    python -m tools.bench.tensor_parallel --batch 1 16 --steps 8

The model is written once to --dir (about 4.4 GB of safetensors). Each layout runs in
fresh processes, each loading its slices (workers/parallel/sliced_load.py) with --threads
/ shards torch threads, gloo over loopback. Prints the engine's decode step time, the time
the driver spends inside the group's collectives and receives (waits for the other shards
included), and each process's peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

# TinyLlama-1.1B's shape.
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)


def write_model(directory: Path) -> Path:
    """The random model as safetensors in `directory` (kept: later runs reuse it)."""
    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"]))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(directory)
    return directory


# name: (tensor shards, pipeline stages, micro-batches cut); "pp2-whole" runs each step
# through the stages uncut, the figure micro-batches are measured against.
LAYOUTS = {"tp1": (1, 1, True), "tp2": (2, 1, True), "pp2": (1, 2, True), "pp2-whole": (1, 2, False)}


def _run(rank: int, layout_name: str, threads: int, init_method: str, directory: Path, batches: list[int],
         steps: int, prompt: int, out) -> None:
    from workers.contract.sampling_params import SamplingParams
    from workers.core.limits import EngineLimits
    from workers.engine.llm_engine import LLMEngine
    from workers.model.attention import register_paged_attention
    from workers.model.fused_projections import fuse_sibling_projections
    from workers.parallel import pipeline
    from workers.parallel.shard_group import ShardGroup, ShardLayout
    from workers.parallel.shard_loop import ShardLoop
    from workers.parallel.sliced_load import load_split_model

    tensor, stages, cut = LAYOUTS[layout_name]
    layout = ShardLayout(tensor, stages)
    if not cut:
        whole = pipeline.micro_batches
        pipeline.micro_batches = lambda meta, tokens, keep, parts: whole(meta, tokens, keep, 1)
    torch.set_num_threads(threads)
    stage = None
    if stages > 1:
        stage = pipeline.StageLayers.of(layout.stage_of(rank), stages, SHAPE["num_hidden_layers"])
    model = load_split_model(directory, layout.position(rank), torch.float32, "cpu", register_paged_attention(),
                             stage)
    fuse_sibling_projections(model)
    cpu = torch.device("cpu")
    group = ShardGroup(rank, layout, init_method, cpu) if layout.world > 1 else None
    if group is not None and not group.is_driver:
        for _ in batches:
            ShardLoop(model, group, cpu, stage).run()
        out.put((rank, None, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
        return
    waited = [0.0]
    if group is not None:  # time inside the collectives and receives (the driver's side of each)
        import torch.distributed as dist
        for name in ("all_reduce", "gather", "broadcast_object_list", "recv"):
            original = getattr(dist, name)

            def timed(*args, _original=original, **kwargs):
                started = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    waited[0] += time.perf_counter() - started
            setattr(dist, name, timed)
    results = {}
    for batch in batches:
        engine = LLMEngine(model, frozenset(), EngineLimits(block_size=16, kv_cache_bytes=256 * 1024**2,
                                                             max_num_seqs=batch), cpu, shard_group=group,
                           stage=stage)
        for i in range(batch):
            engine.add_request([1 + i] + [2 + (i + j) % 1000 for j in range(prompt - 1)],
                               SamplingParams(max_tokens=steps + 4, ignore_eos=True))
        started = time.perf_counter()
        prefills = 0
        while any(not r.num_output_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
            prefills += 1
        prefill_ms = (time.perf_counter() - started) * 1000
        engine.step()
        waited[0] = 0.0
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        results[batch] = ((time.perf_counter() - started) / steps * 1000, waited[0] / steps * 1000,
                          prefill_ms, prefills)
        engine.close()
    out.put((rank, results, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def run(layout_name: str, threads: int, directory: Path, batches: list[int], steps: int, prompt: int) -> list:
    from workers.parallel.shard_group import free_init_method

    tensor, stages, _ = LAYOUTS[layout_name]
    context = mp.get_context("spawn")
    out = context.Queue()
    init_method = free_init_method()
    procs = [context.Process(target=_run, args=(r, layout_name, threads, init_method, directory, batches, steps, prompt,
                                                          out))
             for r in range(tensor * stages)]
    for p in procs:
        p.start()
    reports = sorted(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens a request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (split over the shards)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--dir", type=Path, default=Path("bench-results/tinyllama-shape-random"))
    args = parser.parse_args()
    directory = write_model(args.dir)
    for name in args.layouts:
        tensor, stages, _ = LAYOUTS[name]
        reports = run(name, max(1, args.threads // (tensor * stages)), directory, args.batch, args.steps, args.prompt)
        timings = reports[0][1]
        rss = ", ".join(f"{r[2]:.0f}" for r in reports)
        for batch, (step_ms, collective_ms, prefill_ms, prefills) in timings.items():
            print(f"{name:<9} batch={batch:<3} prefill {prefill_ms:8.1f} ms in {prefills} steps  decode step "
                  f"{step_ms:7.1f} ms  in collectives {collective_ms:6.1f} ms  peak RSS per process {rss} MiB",
                  flush=True)


if __name__ == "__main__":
    main()
