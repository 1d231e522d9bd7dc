"""tools/bench/worker_ttft.py: a request's first token split into parts that add up."""

from __future__ import annotations

import asyncio

import pytest

from tools.bench import worker_ttft


def test_parts_add_up_and_the_prefill_step_is_timed(tiny_model_dir):
    splits = asyncio.run(worker_ttft.measure(str(tiny_model_dir), requests=3, max_tokens=3, prompt="Hello there",
                                             warmup=1))
    assert len(splits) == 3
    for split in splits:
        parts = [split.to_queue_ms, split.queued_ms, split.first_step_ms, split.delivery_ms]
        assert all(part >= 0 for part in parts)
        assert split.first_step_ms > 0
        assert split.total_ms == pytest.approx(sum(parts))
        assert split.total_ms < 30_000


def test_summary_has_each_part_and_the_total():
    splits = [worker_ttft.TtftSplit(1.0, 0.1, 50.0, 0.5), worker_ttft.TtftSplit(3.0, 0.3, 70.0, 1.5)]
    lines = worker_ttft.summary_lines(splits)
    assert [line.split()[0] for line in lines] == ["to_queue_ms", "queued_ms", "first_step_ms", "delivery_ms",
                                                   "ttft_ms"]
    assert "median    60.00 ms" in lines[2] and "max    70.00 ms" in lines[2]
    assert "median    63.20 ms" in lines[4]  # the medians of 51.6 and 74.8


def test_the_clock_marks_only_the_first_step_with_events_after_an_add():
    class FakeEngine:
        def __init__(self):
            self.outputs = [[], ["token"], ["token"]]

        def add_request(self, *args, **kwargs):
            return 7

        def step(self):
            return self.outputs.pop(0)

    engine = FakeEngine()
    clock = worker_ttft.EngineClock(engine)
    assert engine.add_request() == 7 and clock.added is not None
    assert engine.step() == [] and clock.step_ended is None  # no events yet: not the first token's step
    engine.step()
    first_end = clock.step_ended
    engine.step()
    assert clock.step_ended == first_end and clock.step_began <= first_end
