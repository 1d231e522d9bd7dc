"""workers.bench_engine's `worker` mode: the worker's request path in one process."""

from __future__ import annotations

import asyncio
import re

import pytest

from workers import bench_engine


def test_worker_mode_runs_the_load_through_the_request_path(tiny_model_dir, capsys):
    bench_engine.main(["--source", str(tiny_model_dir), "worker", "--concurrency", "1", "3",
                       "--num-requests", "5", "--max-tokens", "4", "--prompt", "Hello there"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("worker ")]
    assert [re.search(r"c=(\d+)\s+n=(\d+)", line).groups() for line in lines] == [("1", "5"), ("3", "5")]
    for line in lines:
        tok_s = float(re.search(r"tok/s=\s*([\d.]+)", line).group(1))
        tpot = float(re.search(r"TPOT med=\s*([\d.]+)", line).group(1))
        assert tok_s > 0 and tpot > 0


@pytest.mark.parametrize("concurrency", [1, 4])
def test_worker_level_counts_every_token(tiny_model_dir, concurrency):
    async def run():
        engine, processor = await bench_engine.start_worker(str(tiny_model_dir))
        try:
            return await bench_engine.worker_level(processor, "Hi", concurrency, 6, 5)
        finally:
            engine.stop()

    report = asyncio.run(run())
    assert report.requests == 6 and report.concurrency == concurrency
    assert report.output_tok_s * report.wall_s == pytest.approx(6 * 5)
