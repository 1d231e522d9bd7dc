"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) rewritten, exactly, as blocks the kernels take.

A K-quant super-block holds 256 weights with per-sub-block integer scales (and minimums)
times an fp16 super-scale; the kernels work on blocks of 32 with one scale. Each
sub-block's scale is the product of the two, exact in float32 (an 11-bit mantissa times a
6- or 8-bit integer), so the weights become blocks of 32 with float32 fields
(cpu_kernels.c's Q4_F32 and Q8_F32) that dequantize to the very floats gguf's own
dequantization gives. The cost is memory: Q4_K 4.5 -> 6 bits a weight, Q5_K 5.5 -> 11,
Q6_K 6.6 -> 11 (still a third of float32).
"""

from __future__ import annotations

import numpy as np

Q4_K, Q5_K, Q6_K = 12, 13, 14  # ggml's type ids
Q4_F32, Q8_F32 = 103, 108  # cpu_kernels.c's float-field blocks
SUPER_BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}
CONVERTED_FORMAT = {Q4_K: Q4_F32, Q5_K: Q8_F32, Q6_K: Q8_F32}


def convert_k_quant(fmt: int, rows: np.ndarray) -> tuple[int, np.ndarray]:
    """(format, blocks) for `rows` (uint8, rows x super-blocks' bytes) of a K-quant tensor:
    Q4_F32 blocks of 24 bytes for Q4_K, Q8_F32 blocks of 44 for Q5_K and Q6_K."""
    count = rows.shape[0]
    supers = rows.reshape(-1, SUPER_BLOCK_BYTES[fmt])
    if fmt == Q6_K:
        d_lo, d_hi, minimum, q = _q6_k(supers)
    else:
        d_lo, minimum, q = _q4_k_or_q5_k(supers, five_bits=fmt == Q5_K)
        d_hi = d_lo
    fields = [d_lo, minimum] if fmt == Q4_K else [d_lo, d_hi, minimum]
    head = np.stack(fields, axis=-1).astype("<f4").view(np.uint8)  # (supers, 8, fields x 4 bytes)
    if fmt == Q4_K:
        q = q.astype(np.uint8)
        quants = q[..., :16] | (q[..., 16:] << 4)  # Q4_1's order: byte j holds q[j] and q[j + 16]
    else:
        quants = q.astype(np.int8).view(np.uint8)
    blocks = np.concatenate([head, quants], axis=-1)  # (supers, 8 blocks of 32, block bytes)
    return CONVERTED_FORMAT[fmt], np.ascontiguousarray(blocks.reshape(count, -1))


def _scales_and_minimums(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and minimums of Q4_K/Q5_K's 12 scale bytes (ggml's
    get_scale_min_k4)."""
    parts = packed.reshape(-1, 3, 4)
    d, m, high = parts[:, 0], parts[:, 1], parts[:, 2]
    scales = np.concatenate([d & 0x3F, (high & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    minimums = np.concatenate([m & 0x3F, (high >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), minimums.astype(np.float32)


def _half(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)  # (supers, 1)


def _q4_k_or_q5_k(supers: np.ndarray, five_bits: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _half(supers[:, 0:2]), _half(supers[:, 2:4])
    scales, minimums = _scales_and_minimums(supers[:, 4:16])
    if five_bits:
        high, packed = supers[:, 16:48], supers[:, 48:176]
    else:
        high, packed = None, supers[:, 16:144]
    # 4 runs of 32 bytes: the low nibbles are sub-block 2c, the high ones sub-block 2c + 1
    chunks = packed.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (chunks & 0x0F).reshape(-1, 8, 32)
    if high is not None:  # bit s of byte j: the fifth bit of sub-block s's weight j
        bits = high.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q | ((bits & 1) << 4)
    return d * scales, -(dmin * minimums), q


def _q6_k(supers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    low, high, scales = supers[:, :128], supers[:, 128:192], supers[:, 192:208]
    d = _half(supers[:, 208:210])
    low4 = (low.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high2 = (high.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (low4.reshape(-1, 8, 32) | (high2.reshape(-1, 8, 32) << 4)).astype(np.int16) - 32
    sixteen = d * scales.view(np.int8).astype(np.float32)  # (supers, 16): a scale per 16 weights
    return sixteen[:, 0::2], sixteen[:, 1::2], np.zeros_like(sixteen[:, 0::2]), q
