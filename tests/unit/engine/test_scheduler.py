"""Scheduler policy, driven with plain Sequence objects and a BlockManager (no model)."""

from __future__ import annotations

import random

from tests.support.engines import complete_step
from workers.contract.sampling_params import SamplingParams
from workers.core.batch import ScheduledBatch
from workers.core.sequence import FinishReason, Sequence, SequenceStatus
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler, SchedulerConfig

NEXT_TOKEN = 7


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Sequence(seq_id, [100 + seq_id] * prompt_len, params, frozenset(), 10_000)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=64, max_num_batched_tokens=2048) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens), BlockManager(num_blocks, block_size))


def step(sched: Scheduler) -> ScheduledBatch:
    batch = sched.schedule()
    complete_step(sched, batch, [NEXT_TOKEN] * len(batch.sampling_chunks))
    return batch


def check_blocks_cover_computed(sched: Scheduler) -> None:
    bs = sched.blocks.block_size
    owned = []
    for seq in sched.running:
        assert len(seq.block_table) * bs >= seq.num_computed_tokens
        owned.extend(seq.block_table)
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert len(owned) == sched.blocks.num_used_blocks


def test_token_budget_respected_and_everything_finishes():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=200, block_size=4, max_num_batched_tokens=16)
    seqs = [make_seq(i, rng.randint(1, 40), max_tokens=rng.randint(1, 6)) for i in range(12)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work():
        batch = step(sched)
        assert 0 < batch.num_tokens <= 16
        assert batch.num_tokens == sum(c.num_tokens for c in batch.decodes + batch.prefills)
        check_blocks_cover_computed(sched)
        steps += 1
        assert steps < 500
    total_prefill = sum(s.num_prompt_tokens for s in seqs)
    # At least enough steps to push every prompt through a 16-token budget.
    assert steps >= total_prefill / 16
    for s in seqs:
        assert s.finish_reason is FinishReason.LENGTH
        assert s.output_token_ids == [NEXT_TOKEN] * s.params.max_tokens
    assert sched.blocks.num_free_blocks == 200


def test_long_prompt_is_chunked_across_steps():
    sched = make_scheduler(max_num_batched_tokens=16)
    seq = make_seq(0, 40)
    sched.add(seq)
    sizes, samples = [], []
    for _ in range(3):
        batch = sched.schedule()
        assert batch.decodes == [] and len(batch.prefills) == 1
        chunk = batch.prefills[0]
        assert chunk.seq is seq
        sizes.append(chunk.num_tokens)
        samples.append(chunk.samples)
        complete_step(sched, batch, [NEXT_TOKEN] * len(batch.sampling_chunks))
        if not chunk.samples:
            assert seq.num_output_tokens == 0  # no token before the prompt is fully in
    assert sizes == [16, 16, 8]
    assert samples == [False, False, True]
    assert seq.num_computed_tokens == 40
    assert seq.output_token_ids == [NEXT_TOKEN]
    assert len(seq.block_table) == 10
    # Next step is a decode of the sampled token.
    batch = sched.schedule()
    assert [c.seq for c in batch.decodes] == [seq] and batch.prefills == []


def test_max_num_seqs_respected():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(i, 3, max_tokens=3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    finished_order = []
    while sched.has_work():
        batch = step(sched)
        scheduled = {id(c.seq) for c in batch.decodes + batch.prefills}
        assert len(scheduled) <= 2
        assert len(sched.running) <= 2
        for s in seqs:
            if s.is_finished and s not in finished_order:
                finished_order.append(s)
    # Admission is first come first served.
    assert [s.seq_id for s in finished_order] == [0, 1, 2, 3, 4]


def test_decodes_scheduled_before_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_seq(0, 3, max_tokens=10)
    sched.add(a)
    step(sched)  # prefill a, a now decodes
    b = make_seq(1, 10)
    sched.add(b)
    batch = sched.schedule()
    assert [c.seq for c in batch.decodes] == [a]
    assert [(c.seq, c.num_tokens, c.samples) for c in batch.prefills] == [(b, 3, False)]
    assert batch.sampling_chunks[0].seq is a
    complete_step(sched, batch, [NEXT_TOKEN])
    # A budget of one token goes to the running decode, not to the new prompt.
    c = make_seq(2, 5)
    sched.add(c)
    sched.config = SchedulerConfig(64, 1)
    batch = sched.schedule()
    assert [ch.seq for ch in batch.decodes] == [a]
    assert batch.prefills == []
    assert c.status is SequenceStatus.WAITING


def test_running_prefill_continues_before_waiting_prompts():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq(0, 20)
    b = make_seq(1, 4)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in batch.prefills] == [(a, 8)]
    complete_step(sched, batch, [])
    batch = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in batch.prefills] == [(a, 8)]


def test_preemption_frees_newest_running_and_requeues_it_first():
    # 4 blocks of 2 tokens: a (4 tokens) and b (3 tokens) fill the pool after one step.
    sched = make_scheduler(num_blocks=4, block_size=2)
    a, b, c = make_seq(0, 4, max_tokens=10), make_seq(1, 3, max_tokens=10), make_seq(2, 2)
    sched.add(a)
    sched.add(b)
    batch = step(sched)
    assert [ch.seq for ch in batch.prefills] == [a, b]
    assert sched.blocks.num_free_blocks == 0
    sched.add(c)
    # a now needs a 3rd block for position 4; none is free -> b (newest) is preempted.
    batch = sched.schedule()
    assert batch.preempted == [b]
    assert [ch.seq for ch in batch.decodes] == [a]
    assert batch.prefills == []  # nothing new admitted in a step that preempted
    assert sched.running == [a]
    assert list(sched.waiting) == [b, c]
    assert b.status is SequenceStatus.WAITING
    assert b.block_table == [] and b.num_computed_tokens == 0
    # b keeps its generated token: it is recomputed, not restarted.
    assert b.token_ids == [101] * 3 + [NEXT_TOKEN]
    assert len(a.block_table) == 3 and sched.blocks.num_free_blocks == 1
    complete_step(sched, batch, [NEXT_TOKEN])
    check_blocks_cover_computed(sched)


def test_preemption_picks_newest_not_second_newest():
    sched = make_scheduler(num_blocks=3, block_size=2)
    # seq 1 has a 1-token prompt: its first decode still fits in its block.
    seqs = [make_seq(0, 2, max_tokens=10), make_seq(1, 1, max_tokens=10), make_seq(2, 2, max_tokens=10)]
    for s in seqs:
        sched.add(s)
    step(sched)
    assert sched.blocks.num_free_blocks == 0
    batch = sched.schedule()
    # seq 0 needs a block -> seq 2 (newest) goes, seq 1 keeps running.
    assert batch.preempted == [seqs[2]]
    assert [c.seq for c in batch.decodes] == [seqs[0], seqs[1]]
    assert list(sched.waiting) == [seqs[2]]
    assert sched.running == [seqs[0], seqs[1]]


def test_several_preemptions_keep_arrival_order_in_waiting():
    sched = make_scheduler(num_blocks=3, block_size=2)
    seqs = [make_seq(i, 2, max_tokens=10) for i in range(3)]
    for s in seqs:
        sched.add(s)
    step(sched)  # each seq fills exactly one block
    batch = sched.schedule()
    # seq 0 takes seq 2's block; seq 1 then needs one too and has no victim left.
    assert batch.preempted == [seqs[2], seqs[1]]
    assert [c.seq for c in batch.decodes] == [seqs[0]]
    assert list(sched.waiting) == [seqs[1], seqs[2]]
    assert sched.running == [seqs[0]]


def test_preempted_sequences_run_to_completion_with_same_tokens():
    sched = make_scheduler(num_blocks=6, block_size=2)
    seqs = [make_seq(i, 3, max_tokens=6) for i in range(3)]
    for s in seqs:
        sched.add(s)
    preempted = 0
    for _ in range(200):
        if not sched.has_work():
            break
        batch = step(sched)
        preempted += len(batch.preempted)
        check_blocks_cover_computed(sched)
    assert not sched.has_work()
    assert preempted > 0
    for s in seqs:
        assert s.output_token_ids == [NEXT_TOKEN] * 6
    assert sched.blocks.num_free_blocks == 6


def test_lone_sequence_that_cannot_grow_preempts_itself():
    sched = make_scheduler(num_blocks=2, block_size=2)
    a = make_seq(0, 4, max_tokens=5)
    sched.add(a)
    step(sched)
    batch = sched.schedule()
    assert batch.preempted == [a] and batch.is_empty
    assert list(sched.waiting) == [a] and sched.running == []
    assert sched.blocks.num_free_blocks == 2


def test_abort_frees_blocks_running_and_waiting():
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=1)
    a, b = make_seq(0, 9, max_tokens=10), make_seq(1, 5)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.blocks.num_used_blocks == 3
    assert a in sched.running and b in sched.waiting
    sched.abort(a)
    assert sched.blocks.num_used_blocks == 0
    assert a.is_finished and a.finish_reason is FinishReason.ABORT
    assert a not in sched.running and a.block_table == []
    sched.abort(b)
    assert b.finish_reason is FinishReason.ABORT and not sched.waiting
    assert not sched.has_work()
    sched.abort(b)  # aborting twice is harmless
    assert sched.blocks.num_free_blocks == 10


def test_finished_sequence_releases_blocks():
    sched = make_scheduler(num_blocks=10, block_size=4)
    a = make_seq(0, 6, max_tokens=2)
    sched.add(a)
    step(sched)
    assert sched.blocks.num_used_blocks == 2
    step(sched)
    assert a.finish_reason is FinishReason.LENGTH
    assert sched.blocks.num_used_blocks == 0 and sched.running == []


# --- with the prefix cache ---------------------------------------------------------------


def distinct_seq(seq_id: int, tokens: list[int], max_tokens: int = 2) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Sequence(seq_id, list(tokens), params, frozenset(), 10_000)


def run_all(sched: Scheduler, limit: int = 500) -> list[ScheduledBatch]:
    batches = []
    while sched.has_work():
        batches.append(step(sched))
        assert len(batches) < limit
    return batches


def test_cached_prefix_is_skipped_and_costs_no_budget():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=4)
    shared = list(range(200, 216))  # 4 full blocks
    first = distinct_seq(0, shared + [1, 2, 3])
    sched.add(first)
    run_all(sched)
    second = distinct_seq(1, shared + [7, 8, 9, 10, 11, 12])
    sched.add(second)
    batch = sched.schedule()
    (chunk,) = batch.prefills
    assert chunk.seq is second and chunk.num_tokens == 4  # the budget, spent after the cached 16
    assert second.num_computed_tokens == 16 and second.num_cached_tokens == 16
    complete_step(sched, batch, [])
    batch = step(sched)
    assert [(c.seq, c.num_tokens, c.samples) for c in batch.prefills] == [(second, 2, True)]
    run_all(sched)
    assert second.output_token_ids == [NEXT_TOKEN] * 2
    assert sched.blocks.num_used_blocks == 0


def test_prefix_hit_admission_counts_cached_blocks_as_available():
    # 6 blocks: the first request's 5 blocks stay cached after it finishes; the second one
    # reuses 4 of them and needs only 1 more + 1 taken back from the free pool per hit.
    sched = make_scheduler(num_blocks=6, block_size=4)
    shared = list(range(300, 316))
    sched.add(distinct_seq(0, shared + [1, 2, 3], max_tokens=1))
    run_all(sched)
    assert sched.blocks.num_free_blocks == 6 and sched.blocks.num_cached_blocks == 4
    second = distinct_seq(1, shared + list(range(50, 58)), max_tokens=1)  # 24 tokens = 6 blocks
    sched.add(second)
    batch = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in batch.prefills] == [(second, 8)]
    assert sched.blocks.num_free_blocks == 0


def test_preempted_sequence_resumes_from_its_cached_blocks():
    sched = make_scheduler(num_blocks=6, block_size=2)
    seqs = [distinct_seq(i, [400 + 10 * i + j for j in range(3)], max_tokens=6) for i in range(3)]
    for s in seqs:
        sched.add(s)
    resumed_from = []
    while sched.has_work():
        batch = sched.schedule()
        resumed_from += [c.seq.num_computed_tokens for c in batch.prefills if c.seq.num_output_tokens > 0]
        complete_step(sched, batch, [NEXT_TOKEN] * len(batch.sampling_chunks))
    assert resumed_from and max(resumed_from) > 0, "a resumed sequence should reuse its cached blocks"
    for s in seqs:
        assert s.output_token_ids == [NEXT_TOKEN] * 6
    assert sched.blocks.num_free_blocks == 6


def test_prefill_cap_applies_only_while_others_decode():
    sched = Scheduler(SchedulerConfig(64, 64, max_prefill_tokens_while_decoding=5), BlockManager(64, 4))
    first = make_seq(0, 30, max_tokens=20)
    sched.add(first)
    alone = step(sched)
    assert [c.num_tokens for c in alone.prefills] == [30]  # nobody decodes: the whole budget
    second = make_seq(1, 30)
    sched.add(second)
    chunks = []
    while second.num_computed_tokens < 30:
        batch = step(sched)
        assert [c.seq for c in batch.decodes] == [first]  # the decode runs every step
        chunks.append(sum(c.num_tokens for c in batch.prefills))
    assert chunks == [5] * 6  # the prompt went in capped chunks beside it


def test_prefill_cap_is_shared_by_all_prompts_of_a_step():
    sched = Scheduler(SchedulerConfig(64, 64, max_prefill_tokens_while_decoding=6), BlockManager(64, 4))
    sched.add(make_seq(0, 3, max_tokens=20))
    step(sched)
    for i in (1, 2, 3):
        sched.add(make_seq(i, 10))
    batch = step(sched)
    assert len(batch.decodes) == 1
    assert sum(c.num_tokens for c in batch.prefills) == 6
    assert [c.num_tokens for c in batch.prefills] == [6]  # the oldest prompt first; the others wait
