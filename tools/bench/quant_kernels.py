"""One pass over a GGUF file's matrices through each quantized product, against the float
model's oneDNN-packed product of the same weights: where workers/quant/quantized_layers.py's
figures come from. The `fp8` column: the same matrices rounded to e4m3 with a scale per
row (an FP8 checkpoint's per-channel layout, workers/quant/fp8_blocks.py). The
`torch_int4_bf16` column: torch's own CPU int4 kernel (`_weight_int4pack_mm_for_cpu`,
groups of 32, the matrices requantized to its layout) with bfloat16 inputs, the only ones
it is fast with (float32 inputs were 10-60x slower still on an AVX2 EPYC).

    python -m tools.bench.quant_kernels [--gguf FILE] [--rows 1 16 32 64 256]

The output head (token_embd / output) is left out: it stays on the exact path. Each figure
is the best of a few passes, in ms; the machine's noise is ±20 %, so compare within a run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from workers.contract.model_config import BUILTIN_DEFAULT_MODEL
from workers.model.loader import resolve_gguf
from workers.quant.fp8_blocks import fp8_blocks
from workers.quant.native_kernels import kernels
from workers.quant.packed_weights import read_gguf_weights
from workers.quant.quantized_layers import QuantizedLinear

ACTIVATIONS = ("int8", "int8x2", "float32")
COLUMNS = (*ACTIVATIONS, "fp8", "torch_int4_bf16", "onednn_float32")
INT4_GROUP = 32
HEADS = ("token_embd.weight", "output.weight")


def best_ms(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(gguf: Path, rows: list[int], repeats: int) -> list[dict]:
    quant = kernels()
    if quant is None:
        raise SystemExit("no C compiler: the quantized kernels cannot be built here")
    weights = [w for name, w in read_gguf_weights(gguf).items() if name not in HEADS]
    layers = {mode: [QuantizedLinear(w, quant, None, torch.float32, mode) for w in weights] for mode in ACTIVATIONS}
    onednn = [torch.ops.mkldnn._reorder_linear_weight(layer.dequantized(), None) for layer in layers["float32"]]
    layers["fp8"] = [QuantizedLinear(_fp8(layer.dequantized()), quant, None, torch.float32)
                     for layer in layers["float32"]]
    int4 = [_torch_int4(layer.dequantized()) for layer in layers["float32"]]
    results = []
    for count in rows:
        inputs = {cols: torch.randn(count, cols) for cols in {w.cols for w in weights}}
        row = {"rows": count, "matrices": len(weights)}
        for mode, group in layers.items():
            row[mode] = best_ms(lambda: [layer(inputs[layer.in_features]) for layer in group], repeats)
        bf16 = {cols: x.bfloat16() for cols, x in inputs.items()}
        row["torch_int4_bf16"] = best_ms(lambda: [
            torch.ops.aten._weight_int4pack_mm_for_cpu(bf16[w.cols], packed, INT4_GROUP, scales)
            for w, (packed, scales) in zip(weights, int4)], repeats)
        row["onednn_float32"] = best_ms(lambda: [
            torch.ops.mkldnn._linear_pointwise(inputs[w.cols], packed, None, "none", [], "")
            for w, packed in zip(weights, onednn)], repeats)
        results.append(row)
    return results


def _fp8(weight: torch.Tensor):
    scale = weight.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448  # e4m3's largest value
    return fp8_blocks((weight / scale).to(torch.float8_e4m3fn), scale)


def _torch_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, bfloat16 scales and zeros) in torch's int4 layout: w = (q - 8) s + z."""
    rows, cols = weight.shape
    groups = weight.view(rows, cols // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp_min(1e-8)
    q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).view(rows, cols)
    zero = low + 8 * scale
    scales = torch.stack([scale.view(rows, -1).t(), zero.view(rows, -1).t()], dim=-1).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales.bfloat16()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="default: the built-in model's file")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 256])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args(argv)
    gguf = args.gguf or resolve_gguf(BUILTIN_DEFAULT_MODEL)
    print(f"{gguf.name}, {torch.get_num_threads()} threads, ms for one pass (best of {args.repeats})")
    print("| rows | " + " | ".join(COLUMNS) + " |")
    print("| --- |" + " --- |" * len(COLUMNS))
    for row in measure(gguf, args.rows, args.repeats):
        cells = [f"{row[mode]:.1f}" for mode in COLUMNS]
        print(f"| {row['rows']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
