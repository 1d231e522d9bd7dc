"""Decode step of a random ~1B Llama split over tensor-parallel shards on this CPU, against
the whole model on one process (workers/parallel/):

    python -m tools.bench.tensor_parallel --batch 1 16 --steps 8

The model is written once to --dir (about 4.4 GB of safetensors). Each setting runs in
fresh processes: TP=1 loads the model whole with --threads torch threads; TP=2 loads each
shard's slices (workers/parallel/sliced_load.py) with --threads / 2 each, gloo over
loopback. Prints the engine's decode step time, the time inside the group's collectives on
the driver (waits for the other shard included), and each process's peak RSS.
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


def _run(rank: int, world: int, threads: int, init_method: str, directory: Path, batches: list[int], steps: int,
         out) -> None:
    from workers.contract.sampling_params import SamplingParams
    from workers.core.limits import EngineLimits
    from workers.engine.llm_engine import LLMEngine
    from workers.model.attention import register_paged_attention
    from workers.model.fused_projections import fuse_sibling_projections
    from workers.parallel.shard_loop import ShardLoop
    from workers.parallel.sliced_load import load_split_model
    from workers.parallel.tensor_group import ShardLayout, TensorGroup, TensorRank

    torch.set_num_threads(threads)
    position = TensorRank(rank, world)
    model = load_split_model(directory, position, torch.float32, "cpu", register_paged_attention())
    fuse_sibling_projections(model)
    cpu = torch.device("cpu")
    group = TensorGroup(rank, ShardLayout(world), init_method, cpu) if world > 1 else None
    if group is not None and not group.is_driver:
        for _ in batches:
            ShardLoop(model, group, cpu).run()
        out.put((rank, None, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
        return
    waited = [0.0]
    if group is not None:  # time inside the collectives (the driver's side of each)
        import torch.distributed as dist
        for name in ("all_reduce", "gather", "broadcast_object_list"):
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
                                                             max_num_seqs=batch), cpu, tensor_group=group)
        for i in range(batch):
            engine.add_request([1 + i, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=steps + 4, ignore_eos=True))
        engine.step()
        engine.step()
        waited[0] = 0.0
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        results[batch] = ((time.perf_counter() - started) / steps * 1000, waited[0] / steps * 1000)
        engine.close()
    out.put((rank, results, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def run(world: int, threads: int, directory: Path, batches: list[int], steps: int) -> list:
    from workers.parallel.tensor_group import free_init_method

    context = mp.get_context("spawn")
    out = context.Queue()
    init_method = free_init_method()
    procs = [context.Process(target=_run, args=(r, world, threads, init_method, directory, batches, steps, out))
             for r in range(world)]
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
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (split over the shards)")
    parser.add_argument("--dir", type=Path, default=Path("bench-results/tinyllama-shape-random"))
    args = parser.parse_args()
    directory = write_model(args.dir)
    for world in (1, 2):
        reports = run(world, max(1, args.threads // world), directory, args.batch, args.steps)
        timings = reports[0][1]
        rss = ", ".join(f"{r[2]:.0f}" for r in reports)
        for batch, (step_ms, collective_ms) in timings.items():
            print(f"TP={world} batch={batch:<3} decode step {step_ms:7.1f} ms  in collectives {collective_ms:6.1f} ms"
                  f"  peak RSS per process {rss} MiB", flush=True)


if __name__ == "__main__":
    main()
