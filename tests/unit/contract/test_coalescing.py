"""The coalescing queue both ends of the transport use: a backlog is one chunk per choice,
errors and finished choices never merge, order is arrival order."""

from __future__ import annotations

from workers.contract.chunks import ErrorInfo, GenerationChunk, TokenLogprob
from workers.contract.coalescing import CoalescingQueue, merge_chunk


def chunk(text: str, ids: list[int], index: int = 0, finish: str | None = None, **fields) -> GenerationChunk:
    return GenerationChunk(index=index, text=text, token_ids=list(ids), finish_reason=finish,
                           completion_tokens=fields.pop("completion_tokens", len(ids)), **fields)


def test_a_choices_backlog_merges_into_one_chunk_with_everything_in_order():
    queue = CoalescingQueue()
    queue.put("r", chunk("Hel", [1], prefill_time_ms=5.0, queue_time_ms=1.0, cached_tokens=0))
    queue.put("r", chunk("lo", [2], decode_times_ms=[3.0], completion_tokens=2, cached_tokens=4))
    queue.put("r", chunk("!", [3], finish="stop", decode_times_ms=[4.0], completion_tokens=3, stop_reason="!"))
    ((request_id, merged),) = queue.take_all()
    assert request_id == "r"
    assert (merged.text, merged.token_ids, merged.finish_reason, merged.stop_reason) == ("Hello!", [1, 2, 3], "stop", "!")
    assert (merged.completion_tokens, merged.cached_tokens) == (3, 4)
    assert (merged.prefill_time_ms, merged.queue_time_ms, merged.decode_times_ms) == (5.0, 1.0, [3.0, 4.0])
    assert len(queue) == 0 and queue.take_all() == []


def test_logprobs_are_concatenated():
    first = chunk("a", [1], logprobs=[TokenLogprob("a", 1, -0.5, [])])
    assert merge_chunk(first, chunk("b", [2], logprobs=[TokenLogprob("b", 2, -1.5, [])]))
    assert [lp.token for lp in first.logprobs] == ["a", "b"]


def test_errors_and_finished_choices_never_merge_and_keep_their_place():
    queue = CoalescingQueue()
    queue.put("r", chunk("a", [1]))
    queue.put("r", GenerationChunk(error=ErrorInfo(500, "boom")))
    queue.put("s", chunk("x", [7], finish="length"))
    queue.put("s", chunk("late", [8]))  # after its finish: a separate entry, never folded in
    taken = queue.take_all()
    assert [(rid, c.text, c.error is not None) for rid, c in taken] == [
        ("r", "a", False), ("r", "", True), ("s", "x", False), ("s", "late", False)]


def test_choices_of_one_request_stay_apart_and_requests_interleave_in_arrival_order():
    queue = CoalescingQueue()
    queue.put("r", chunk("a", [1], index=0))
    queue.put("s", chunk("x", [9]))
    queue.put("r", chunk("b", [2], index=1))
    queue.put("r", chunk("c", [3], index=0))
    assert [(rid, c.index, c.text) for rid, c in queue.take_all()] == [("r", 0, "ac"), ("s", 0, "x"), ("r", 1, "b")]


def test_after_a_take_new_chunks_start_a_fresh_entry():
    queue = CoalescingQueue()
    queue.put("r", chunk("a", [1]))
    assert [c.text for _, c in queue.take_all()] == ["a"]
    queue.put("r", chunk("b", [2]))
    queue.put("r", chunk("c", [3]))
    assert [c.text for _, c in queue.take_all()] == ["bc"]


def test_drop_forgets_a_cancelled_requests_chunks_and_holds_tells_what_is_pending():
    queue = CoalescingQueue()
    queue.put("r", chunk("a", [1]))
    queue.put("s", chunk("x", [9]))
    assert queue.holds("r") and queue.holds("s") and not queue.holds("t")
    queue.drop("r")
    assert not queue.holds("r")
    assert [rid for rid, _ in queue.take_all()] == ["s"]
