"""The `priority` scheduling policy: admission by (priority, arrival) with the batch full,
preemption of the largest (priority, arrival), and `fcfs` unchanged (it refuses priorities)."""

from __future__ import annotations

import pytest

from serve_app.config.app_config import ConfigError, parse_app_config
from tests.support.engines import complete_step, greedy, make_engine
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import PriorityError, engine_limits
from workers.core.sequence import Sequence
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler, SchedulerConfig

NEXT_TOKEN = 7


def make_seq(seq_id: int, priority: int, prompt_len: int = 4, max_tokens: int = 3) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)
    return Sequence(seq_id, [100 + seq_id] * prompt_len, params, frozenset(), 10_000)


def make_scheduler(priority: bool, num_blocks: int = 64, max_num_seqs: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, 2048, priority=priority), BlockManager(num_blocks, 4))


def admission_order(sched: Scheduler, max_steps: int = 200) -> list[int]:
    """Run everything to the end; the seq ids in the order they first got a model step."""
    order: list[int] = []
    for _ in range(max_steps):
        if not sched.has_work():
            return order
        batch = sched.schedule()
        order += [c.seq.seq_id for c in batch.prefills if c.seq.seq_id not in order]
        complete_step(sched, batch, [NEXT_TOKEN] * len(batch.sampling_chunks))
    raise AssertionError("scheduler did not finish")


def fill_then_queue(priority_policy: bool, priorities: list[int]) -> list[int]:
    """Seq 0 fills a one-sequence batch; then seqs 1.. arrive with `priorities`."""
    sched = make_scheduler(priority_policy, max_num_seqs=1)
    sched.add(make_seq(0, 0))
    first = sched.schedule()
    complete_step(sched, first, [NEXT_TOKEN])
    for seq_id, priority in enumerate(priorities, start=1):
        sched.add(make_seq(seq_id, priority))
    return [0] + admission_order(sched)


def test_full_batch_admits_lower_priority_value_first_ties_by_arrival():
    assert fill_then_queue(True, [5, 5, 1, -2]) == [0, 4, 3, 1, 2]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    assert fill_then_queue(False, [5, 5, 1, -2]) == [0, 1, 2, 3, 4]


def preempt_one(priority_policy: bool) -> Scheduler:
    """Three prefilled 4-token prompts (one block each) with two blocks free: the next
    decode step needs a block each, so one of them is preempted."""
    sched = make_scheduler(priority_policy, num_blocks=5)
    for seq_id, priority in enumerate([2, 0, 1]):  # the oldest is the least urgent
        sched.add(make_seq(seq_id, priority, max_tokens=8))
    complete_step(sched, sched.schedule(), [NEXT_TOKEN] * 3)
    assert len(sched.running) == 3 and sched.blocks.num_free_blocks == 2
    batch = sched.schedule()
    assert len(batch.preempted) == 1 and list(sched.waiting) == batch.preempted
    return sched


def test_priority_preempts_the_largest_priority_arrival():
    sched = preempt_one(True)
    assert [s.seq_id for s in sched.waiting] == [0]
    assert [s.seq_id for s in sched.running] == [1, 2]


def test_fcfs_preempts_the_newest():
    sched = preempt_one(False)
    assert [s.seq_id for s in sched.waiting] == [2]


def test_preempted_sequence_waits_by_its_priority_and_arrival():
    sched = preempt_one(True)  # seq 0 (priority 2) waits
    sched.add(make_seq(3, 2))  # same priority, later: behind it
    sched.add(make_seq(4, 1))  # more urgent: ahead of it
    assert [s.seq_id for s in sched.waiting] == [4, 0, 3]


# ------------------------------------------------------------------ the engine, with a model


def test_engine_admits_a_later_urgent_request_before_earlier_ones(paged_model, tiny_tokenizer):
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ("Hello", "one two", "three four", "five six")]
    engine = make_engine(paged_model, max_num_seqs=1, priority_scheduling=True)
    order = []
    first = engine.add_request(prompts[0], greedy(3))
    order += [ev.request_id for ev in engine.step()]
    later = [engine.add_request(p, greedy(3, priority=q)) for p, q in zip(prompts[1:], [4, 4, -1])]
    for _ in range(100):
        if not engine.has_work():
            break
        order += [ev.request_id for ev in engine.step() if ev.request_id not in order]
    assert order == [first, later[2], later[0], later[1]]


def test_fcfs_engine_refuses_a_priority(paged_model):
    engine = make_engine(paged_model)
    with pytest.raises(PriorityError, match="scheduling_policy"):
        engine.add_request([1, 2, 3], greedy(2, priority=1))
    engine.add_request([1, 2, 3], greedy(2, priority=0))  # the default is fine
    assert engine.num_active == 1


# ------------------------------------------------------------------------------- config


def test_scheduling_policy_config_reaches_the_limits():
    args = {"models": [{"id": "a"}, {"id": "b", "engine": {"scheduling_policy": "priority"}}]}
    config = parse_app_config(args)
    assert [engine_limits(m, 2048).priority_scheduling for m in config.models] == [False, True]


def test_unknown_scheduling_policy_is_named_by_its_dotted_path():
    with pytest.raises(ConfigError, match=r"models\.0\.engine\.scheduling_policy: Input should be 'fcfs' or "
                       r"'priority'"):
        parse_app_config({"models": [{"id": "a", "engine": {"scheduling_policy": "lifo"}}]})
