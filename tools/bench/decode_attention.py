"""Decode attention alone on a GPU: the Triton paged kernel (one range per sequence and
KV head, and split into context ranges) against the CPU path's gather + SDPA.

    python tools/bench/decode_attention.py            # on a CUDA machine

Each variant is captured in a CUDA graph and timed over its replays (median of 5 runs of
50 replays), on random bf16 data with shuffled block tables; Llama-3 8B's attention
shape (32 heads, 8 KV heads, head dim 128), block size 16. Prints µs per call and the
K/V read rate (context bytes once over the time).
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from workers.model.triton_attention import paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CASES = [(1, 1024), (1, 4096), (1, 16384), (8, 4096), (64, 1024), (256, 512)]


def make_case(batch: int, context: int, device: torch.device):
    width = context // BLOCK
    num_blocks = batch * width
    tables = torch.randperm(num_blocks, device=device).view(batch, width)
    k = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k, v, tables, lens


def gather_sdpa(q, k, v, tables, lens):
    batch, width = tables.shape
    kd = k.view(-1, BLOCK, KV_HEADS, HEAD_DIM).index_select(0, tables.reshape(-1))
    vd = v.view(-1, BLOCK, KV_HEADS, HEAD_DIM).index_select(0, tables.reshape(-1))
    kd = kd.view(batch, width * BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2)
    vd = vd.view(batch, width * BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2)
    mask = (torch.arange(width * BLOCK, device=q.device)[None, :] < lens[:, None]).view(batch, 1, 1, -1)
    return F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=True).squeeze(2)


def time_graph(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / 50 * 1000)
    return statistics.median(runs)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    print(f"{'batch':>5} {'context':>7} {'one range':>10} {'split':>10} {'gather+SDPA':>12}   split GB/s   max |split - one|")
    for batch, context in CASES:
        q, k, v, tables, lens = make_case(batch, context, device)
        one = time_graph(lambda: paged_decode_attention(q, k, v, tables, lens, BLOCK, scale, num_splits=1))
        split = time_graph(lambda: paged_decode_attention(q, k, v, tables, lens, BLOCK, scale))
        sdpa = time_graph(lambda: gather_sdpa(q, k, v, tables, lens)) if batch * context <= 64 * 4096 else float("nan")
        diff = (paged_decode_attention(q, k, v, tables, lens, BLOCK, scale, num_splits=1).float()
                - paged_decode_attention(q, k, v, tables, lens, BLOCK, scale).float()).abs().max().item()
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
        print(f"{batch:>5} {context:>7} {one:>8.1f}µs {split:>8.1f}µs {sdpa:>10.1f}µs   {kv_bytes / split / 1e3:9.0f}"
              f"   {diff:.2e}")


if __name__ == "__main__":
    main()
