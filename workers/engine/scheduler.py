"""Decides which sequences run in the next model step, and how many tokens each feeds.

Policy (one step):
1. Running sequences, oldest first: a decoding sequence feeds 1 token, a sequence
   mid-prefill feeds its next chunk. If the KV pool has no block for it, the newest
   running sequence is preempted (its blocks freed; it is recomputed later, so its
   output does not change). With speculative decoding, a decoding sequence may feed the
   proposer's tokens after its last one (while fewer than `disable_by_batch_size`
   sequences run, and only into free blocks).
2. Waiting sequences, in arrival order, while the step's token budget, the batch-size
   cap and the free blocks allow. A sequence first takes the longest prefix of full
   blocks found in the prefix cache (no budget spent on them); a prompt longer than
   the remaining budget is prefilled in chunks over several steps, so decodes keep
   flowing meanwhile. A sequence whose LoRA adapter finds no slot (every slot held by
   running sequences of other adapters) stays waiting; those behind it may go.

Under the `priority` policy (vLLM's meaning) "arrival order" becomes (priority, arrival)
order, lower first, in both queues: the waiting queue admits the most urgent first, and
since running sequences are visited in that order too, the sequence a preemption takes
(the last) is the one with the largest (priority, arrival). Arrival is the engine's
request id, which it hands out in arrival order.
"""

from __future__ import annotations

import time
from bisect import insort
from collections import deque
from dataclasses import dataclass

from workers.core.adapter_slots import AdapterSlots, NoAdapters
from workers.core.batch import ScheduledBatch, ScheduledChunk
from workers.core.sequence import FinishReason, Sequence, SequenceStatus
from workers.engine.block_manager import BlockManager
from workers.speculative.proposals import Proposer, batch_allows, output_room


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens fed to the model in one step
    # Prompt tokens one step may take while other sequences decode (None: the whole budget).
    # On a CPU a prompt token costs several times a decode row, so a big chunk beside the
    # decodes stretches their inter-token gap; alone, a prompt still gets the whole budget.
    max_prefill_tokens_while_decoding: int | None = None
    priority: bool = False  # order both queues by (params.priority, arrival) instead of arrival alone


def priority_key(seq: Sequence) -> tuple[int, int]:
    """A sequence's place under the priority policy: its request's priority, then arrival
    (the n choices of a request share both, and keep their order among themselves)."""
    return seq.params.priority, seq.request_id


def _adapter_slot(chunk: ScheduledChunk) -> int:
    return -1 if chunk.seq.lora_slot is None else chunk.seq.lora_slot


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 lora: AdapterSlots = NoAdapters(), proposer: Proposer | None = None) -> None:
        """`proposer`: speculative decoding's; a decoding sequence it proposes tokens for
        feeds them after its last one (a verification chunk, checked by the engine)."""
        self.config = config
        self.blocks = block_manager
        self.lora = lora
        self.proposer = proposer
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # While the engine isolates a failing step: schedule this request alone.
        self.only_request: int | None = None
        self._prefill_left = config.max_num_batched_tokens  # prompt tokens the step being built may still take

    def add(self, seq: Sequence) -> None:
        if self.config.priority:
            insort(self.waiting, seq, key=priority_key)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """Drop `seq` wherever it is and free its cache."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, FinishReason.ABORT)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq)
        self.lora.release(seq)
        if self.proposer is not None:
            self.proposer.finished(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._prefill_left = self._prefill_cap()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        if self.lora.num_slots:
            # Prompt chunks of one adapter side by side: the LoRA layers then take one run of
            # rows per adapter, not one per chunk (workers/lora/layers.py). The order of a
            # step's chunks means nothing else.
            batch.prefills.sort(key=_adapter_slot)
        return batch

    def continue_decodes(self, seqs: list[Sequence]) -> ScheduledBatch | None:
        """Async scheduling: the step after one whose tokens are still on the device. `seqs`
        (that step's sequences, in its order) each feed one more token, except those that
        ended meanwhile (a stop, an abort) or that the pending token ends by length. None
        when the step should be scheduled normally instead: others are running or waiting
        to be admitted, blocks would run out (preemption), or a failing request is being
        isolated."""
        live = [s for s in seqs if not s.is_finished]
        if self.only_request is not None or self.running != live:  # identity: Sequence has eq=False
            return None
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return None  # admit them now rather than after the pipeline drains
        next_seqs = [s for s in live if not s.reaches_length_limit(pending=1)]
        if not next_seqs or len(next_seqs) > self.config.max_num_batched_tokens:
            return None
        needed = [self.blocks.blocks_needed(s, 1) for s in next_seqs]
        if sum(needed) > self.blocks.num_free_blocks:
            return None
        batch = ScheduledBatch()
        for seq, n in zip(next_seqs, needed):
            if n:  # most steps need no new block
                batch.block_copies.extend(self.blocks.allocate(seq, 1))
            batch.decodes.append(ScheduledChunk(seq, 1, True))
        return batch

    def _prefill_cap(self) -> int:
        """Prompt tokens this step may take: the budget, or the cap while anyone decodes."""
        cap = self.config.max_prefill_tokens_while_decoding
        if cap is None or not any(s.num_uncomputed_tokens == 1 for s in self.running):
            return self.config.max_num_batched_tokens
        return cap

    def _chunk_size(self, uncomputed: int, budget: int) -> int:
        """Tokens to feed a sequence this step: a prompt chunk (more than one) also fits the prefill cap."""
        n = min(uncomputed, budget)
        return min(n, self._prefill_left) if n > 1 else n

    def _take(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.add(ScheduledChunk.of(seq, n))
        if n > 1:
            self._prefill_left -= n

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        queue = list(self.running)
        proposing = self.proposer is not None and batch_allows(self.proposer.limits, len(queue))
        if proposing:
            self.proposer.prepare(queue)
        while queue and budget > 0:
            seq = queue.pop(0)
            if self.only_request is not None and seq.request_id != self.only_request:
                continue
            n = self._chunk_size(seq.num_uncomputed_tokens, budget)
            if n == 0:
                continue  # a beam waiting for its siblings' logits, or no prefill room left this step
            # Computed once per sequence (most decodes need no block); again only after a
            # preemption, which may un-share one of its blocks.
            needed = self.blocks.blocks_needed(seq, n)
            while needed > self.blocks.num_free_blocks and queue:
                self._preempt(queue.pop(), batch)
                needed = self.blocks.blocks_needed(seq, n)
            if needed > self.blocks.num_free_blocks:
                self._preempt(seq, batch)
                continue
            fed = self._take_draft(batch, seq, budget) if proposing and n == 1 else 0
            if fed:
                budget -= fed
                continue
            if needed:
                batch.block_copies.extend(self.blocks.allocate(seq, n))
            self._take(batch, seq, n)
            budget -= n
        # Unscheduled sequences (budget ran out) keep their place; running stays oldest-first.
        preempted = {id(s) for s in batch.preempted}
        self.running = [s for s in self.running if id(s) not in preempted]
        return budget

    def _take_draft(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """Schedule decoding `seq` with proposed tokens after its last one, if the proposer
        has some that fit the step's budget, the sequence's limits and the free blocks
        (a proposal never preempts anyone); the tokens it feeds (0: none scheduled)."""
        if seq.num_uncomputed_tokens != 1:
            return 0
        draft = self.proposer.propose(seq, min(budget - 1, output_room(seq)))
        if draft and seq.guide is not None:
            draft = seq.guide.allowed_prefix(draft)
        if draft:
            draft = seq.unforced_prefix(draft)
        if not draft or self.blocks.blocks_needed(seq, 1 + len(draft)) > self.blocks.num_free_blocks:
            return 0
        batch.block_copies.extend(self.blocks.allocate(seq, 1 + len(draft)))
        batch.add(ScheduledChunk.verifying(seq, draft))
        return 1 + len(draft)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        candidates = [s for s in self.waiting if self.only_request in (None, s.request_id)]
        for seq in candidates:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            prefix = self.blocks.cached_prefix(seq)
            n = self._chunk_size(seq.num_uncomputed_tokens - prefix.num_tokens, budget)
            if n == 0 or not self.blocks.can_allocate(seq, n, prefix):
                break
            if seq.lora is not None and not self.lora.admit(seq):
                continue  # its adapter waits for a slot; another adapter's (or none) may still go
            self.waiting.remove(seq)
            if seq.queue_time is None:
                seq.queue_time = time.perf_counter() - seq.arrival_time
            self.blocks.use_prefix(seq, prefix)
            batch.block_copies.extend(self.blocks.allocate(seq, n))
            seq.status = SequenceStatus.RUNNING
            if self.config.priority:
                insort(self.running, seq, key=priority_key)  # so a preemption finds the least urgent last
            else:
                self.running.append(seq)
            self._take(batch, seq, n)
            budget -= n

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.blocks.free(seq)
        self.lora.release(seq)
        seq.status = SequenceStatus.WAITING
        if self.config.priority:
            insort(self.waiting, seq, key=priority_key)
        else:
            self.waiting.appendleft(seq)  # it arrived before anyone still waiting
        batch.preempted.append(seq)

    def advance(self, batch: ScheduledBatch) -> None:
        """The step's tokens are now in the KV cache; blocks they filled become cacheable."""
        for chunk in batch.decodes + batch.prefills:
            # A verification chunk's proposals count once checked (verified()).
            chunk.seq.num_computed_tokens += chunk.num_tokens - len(chunk.draft)
            self.blocks.cache_computed_blocks(chunk.seq)

    def verified(self, seq: Sequence, accepted: int) -> None:
        """`accepted` proposals of a verification chunk were taken (and appended): their
        K/V, written by the step, are now the sequence's. The rejected ones' slots are
        written over when the sequence reaches those positions again."""
        seq.num_computed_tokens += accepted
        self.blocks.cache_computed_blocks(seq)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Start sibling choices right after `parent`, sharing its blocks."""
        position = self.running.index(parent) + 1
        for child in children:
            self.blocks.fork(parent, child)
            self.lora.share(parent, child)
        self.running[position:position] = children

    def run_alone(self, request_id: int | None) -> None:
        """Schedule only `request_id`'s sequences (None: everyone again): step recovery
        isolates a failing step's requests this way."""
        self.only_request = request_id

    def end_running(self, seq: Sequence, reason: FinishReason) -> None:
        """A running sequence ended outside a step's sampling (a beam at its length limit)."""
        self.running.remove(seq)
        self.finish(seq, reason)

    def drop(self, seq: Sequence) -> None:
        """Remove a running sequence that is no longer needed (a beam not continued)."""
        self.running.remove(seq)
        self.finish(seq, FinishReason.ABORT)

    def append_tokens(self, seqs: list[Sequence], sampled: list[int]) -> list[tuple[Sequence, int, FinishReason | None]]:
        return [(seq, token, self.append_token(seq, token)) for seq, token in zip(seqs, sampled)]

    def append_token(self, seq: Sequence, token: int) -> FinishReason | None:
        """Append a sampled token; a sequence it ends leaves the running batch."""
        reason = seq.append_token(token)
        if reason is not None:
            self.running.remove(seq)
            self.finish(seq, reason)
        return reason
