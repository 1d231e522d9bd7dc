"""workers.bench_engine's `worker` mode: the worker's request path in one process."""

from __future__ import annotations

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
    import asyncio

    from workers.async_engine import AsyncEngine
    from workers.model_loader import load_model
    from workers.attention import register_paged_attention
    from workers.request_processor import RequestProcessor

    async def run():
        tokenizers = []

        def build():
            loaded = load_model(str(tiny_model_dir), attn_implementation=register_paged_attention())
            tokenizers.append(loaded.tokenizer)
            return bench_engine.new_engine(loaded.model, loaded.tokenizer)

        engine = AsyncEngine.start_on_own_thread(build, asyncio.get_running_loop())
        try:
            return await bench_engine.worker_level(RequestProcessor(engine, tokenizers[0]), "Hi", concurrency, 6, 5)
        finally:
            engine.stop()

    report = asyncio.run(run())
    assert report.requests == 6 and report.concurrency == concurrency
    assert report.output_tok_s * report.wall_s == pytest.approx(6 * 5)
