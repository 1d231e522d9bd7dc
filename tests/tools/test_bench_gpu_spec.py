"""The GPU speculation benchmark's CPU smoke run (tools/bench/gpu_spec.py --tiny): the row
prices at every row count, and off / ngram / draft each generating at concurrency 1."""

from __future__ import annotations

import json

from tools.bench.gpu_spec import ROWS, main


def test_bench_gpu_spec_tiny_prices_rows_and_runs_each_method(tmp_path, capsys):
    out = tmp_path / "spec.json"
    (report,) = main(["--tiny", "--requests", "2", "--json", str(out)])
    assert [p.rows for p in report.prices] == list(ROWS)
    assert all(p.eager_ms > 0 and p.graph_ms is None for p in report.prices)  # no CUDA graphs on the CPU
    runs = {r.method: r for r in report.runs}
    assert set(runs) == {"off", "ngram", "draft"} and all(r.tok_s > 0 for r in runs.values())
    # The draft proposes at every step after the first token; a random draft is rarely right.
    assert runs["draft"].tokens_per_verification >= 1.0
    assert runs["off"].accepted_per_proposed == runs["off"].tokens_per_verification == 0.0
    printed = capsys.readouterr().out
    assert "row share" in printed and "c=1 draft" in printed
    saved = json.loads(out.read_text())
    assert saved["reports"][0]["shape"] == "tiny" and len(saved["reports"][0]["runs"]) == 3
