"""A prompt's attention on the CPU, one layer: its queries as decode rows of the C kernel
(workers/model/cpu_attention.c, what `engine.deterministic` runs) against SDPA's causal
product (what the engine runs otherwise), and whether the kernel's tiled rows equal each
row run alone, bit for bit.

    python -m tools.bench.prompt_attention --tokens 1000 2000 [--dtype bfloat16]

Random data in `--dtype` (float32 by default; bfloat16 is what a float checkpoint's cache
holds where `dtype: auto` picks it) in the default model's attention shape (9 heads, 3 KV heads, head dim
64), block size 16, `--threads` threads; the median of `--repeat` calls in ms."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from workers.model.cpu_attention import cpu_decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def median_ms(call, repeat: int) -> float:
    call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(tokens: int, repeat: int, checked_rows: int, dtype: torch.dtype = torch.float32) -> None:
    kernel = cpu_decode_attention()
    if kernel is None:
        raise SystemExit("no C compiler to build cpu_attention.c")
    generator = torch.Generator().manual_seed(0)
    slots = -(-tokens // BLOCK) * BLOCK
    k, v = (torch.randn(slots, KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(dtype)
    tables = torch.arange(slots // BLOCK, dtype=torch.int64).expand(tokens, -1).contiguous()
    lens = torch.arange(1, tokens + 1, dtype=torch.int32)
    out, scale = torch.empty_like(q), HEAD_DIM**-0.5

    def by_kernel() -> None:
        assert kernel(q, k, v, tables, lens, BLOCK, scale, None, None, out)

    def by_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[:tokens].transpose(0, 1)[None],
                                              v[:tokens].transpose(0, 1)[None], is_causal=True, enable_gqa=True)

    kernel_ms, sdpa_ms = median_ms(by_kernel, repeat), median_ms(by_sdpa, repeat)
    alone = torch.empty(checked_rows, HEADS, HEAD_DIM, dtype=dtype)
    for row in range(checked_rows):
        assert kernel(q[row:row + 1], k, v, tables[row:row + 1], lens[row:row + 1], BLOCK, scale, None, None,
                      alone[row:row + 1])
    equal = torch.equal(alone, out[:checked_rows])
    error = (by_sdpa()[0].transpose(0, 1) - out).float().abs().max().item()
    print(f"{tokens} queries, {str(dtype).removeprefix('torch.')}: kernel {kernel_ms:.1f} ms, SDPA {sdpa_ms:.1f} ms ({kernel_ms / sdpa_ms:.2f}x); "
          f"first {checked_rows} rows alone == tiled: {equal}; max |kernel - SDPA| {error:.1e}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 2000])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--checked-rows", type=int, default=300)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for tokens in args.tokens:
        measure(tokens, args.repeat, min(args.checked_rows, tokens), getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
