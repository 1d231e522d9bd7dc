"""The Serve worker deployment in-process (no Ray): its health check, its info and stats."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.support.engines import chat_request, wait_idle
from workers.contract.engine_load import KV_CACHE_USAGE, QUEUED_PROMPT_TOKENS, WAITING
from workers.serving.deployment import ModelWorker


def _with_worker(model_dir, engine: dict, body):
    """Build the worker as Serve does (on a running loop), run `body(worker)`, stop its engine."""
    config = {"id": "tiny", "source": str(model_dir),
              "engine": {"kv_cache_memory_gib": 0.001, "torch_threads": 1, **engine}}

    async def main():
        worker = ModelWorker.func_or_class(config)
        try:
            return await body(worker)
        finally:
            worker.engine.stop()

    return asyncio.run(main())


def test_worker_health_check_fails_on_a_hung_or_dead_engine(tiny_model_dir):
    async def body(worker):
        try:
            await worker.check_health()  # healthy
            worker.engine.stuck_for = lambda: 6.0
            with pytest.raises(RuntimeError, match="hung"):
                await worker.check_health()
            worker.engine.stuck_for = lambda: 0.0
            worker.engine.error = RuntimeError("boom")
            with pytest.raises(RuntimeError, match="not running"):
                await worker.check_health()
        finally:
            worker.engine.error = None

    _with_worker(tiny_model_dir, {"step_hang_timeout_s": 5}, body)


def test_worker_stats_and_info_report_its_engine(tiny_model_dir):
    async def body(worker):
        gen = worker.generate(chat_request("Hello there", 300, ignore_eos=True))  # still running when asked
        await gen.__anext__()  # the request runs
        busy = worker.stats()
        busy_load = await worker.record_autoscaling_stats()
        await gen.aclose()
        await wait_idle(worker.engine)
        return worker.info(), busy, worker.stats(), busy_load, await worker.record_autoscaling_stats()

    info, busy, idle, busy_load, idle_load = _with_worker(tiny_model_dir, {"max_model_len": 400}, body)
    # What Serve's autoscaler gets (custom metrics, for the engine-load policy).
    assert busy_load[WAITING] == 0 and busy_load[QUEUED_PROMPT_TOKENS] == 0  # it decodes
    assert 0 < busy_load[KV_CACHE_USAGE] <= 1
    assert idle_load == {WAITING: 0.0, KV_CACHE_USAGE: 0.0, QUEUED_PROMPT_TOKENS: 0.0}
    assert (info.id, info.max_model_len, info.block_size) == ("tiny", 400, 16)
    assert info.kv_cache_blocks == busy.kv_blocks_total == idle.kv_blocks_total > 0
    assert (busy.active_requests, busy.running, busy.waiting) == (1, 1, 0) and busy.kv_blocks_used > 0
    assert (idle.active_requests, idle.running, idle.waiting, idle.kv_blocks_used) == (0, 0, 0, 0)
    assert idle.engine_steps >= busy.engine_steps > 0
    assert idle.prefix_cache_query_tokens > 0 and idle.pid == os.getpid() and idle.rss_bytes > 0
