"""The GPU benchmark script's CPU smoke run (`--tiny`), so the script cannot rot between GPU sessions."""

from __future__ import annotations

import math

from tools.bench.gpu import main


def test_bench_gpu_tiny_runs_engine_and_generate_batch(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    (report,) = main(["--tiny", "--json", str(out)])
    assert report.shape == "tiny" and report.device == "cpu"
    for value in (report.engine_tok_s, report.hf_tok_s, report.decode_ms, report.floor_ms, report.copy_gb_s):
        assert value is not None and math.isfinite(value) and value > 0
    assert report.floor_ms < report.decode_ms  # a step cannot beat reading its bytes once
    assert "generate_batch" in capsys.readouterr().out
    assert out.read_text().startswith("{")
