"""tools.bench.quant_kernels times every quantized product on a GGUF's matrices, the head
left out."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tools.bench.quant_kernels import COLUMNS, measure
from workers.quant.native_kernels import kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C compiler for the kernels")


def test_each_product_is_timed_on_every_matrix_but_the_head(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for name, shape in (("token_embd.weight", (96, 64)), ("blk.0.ffn_up.weight", (128, 64)),
                        ("blk.0.ffn_down.weight", (64, 128))):
        fmt = gguf.GGMLQuantizationType.Q4_1
        writer.add_tensor(name, gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), fmt), raw_dtype=fmt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    results = measure(path, [1, 20], repeats=1)
    assert [row["rows"] for row in results] == [1, 20]
    for row in results:
        assert row["matrices"] == 2
        assert all(row[column] > 0 for column in COLUMNS)
