"""Method suffix's earlier answers: the longest suffix's latest occurrence in a stored
answer, answers kept per adapter and leaving oldest first with their table entries, and
the proposer taking whichever source (own context or an earlier answer) matched more."""

from __future__ import annotations

from workers.contract.sampling_params import SamplingParams
from workers.core.limits import SpeculativeLimits
from workers.core.sequence import FinishReason, Sequence
from workers.speculative.ngram_proposer import NgramProposer
from workers.speculative.response_history import (
    MATCH_CAP,
    ResponseHistory,
    matched_length,
)

LIMITS = SpeculativeLimits(num_tokens=4, lookup_min=2, lookup_max=3, disable_by_batch_size=3, method="suffix",
                           history_requests=2)


def test_an_earlier_answer_continues_a_context_that_ends_as_it_did():
    history = ResponseHistory(2, max_requests=4)
    history.add(prompt=[90, 91, 92, 93], output=[10, 11, 12, 13, 14, 15])
    # Stored as the prompt's last 2 tokens, then the answer: the answer's start is found
    # from a new prompt ending the same way (and the match counted back over all of it).
    start = history.lookup([7, 91, 92, 93], 4)
    assert start.tokens == [10, 11, 12, 13] and start.length == 2
    later = history.lookup([5, 92, 93, 10, 11, 12], 3)
    assert later.tokens == [13, 14, 15] and later.length == 5
    assert history.lookup([5, 5, 11, 12], 9).tokens == [13, 14, 15]  # up to the answer's end
    assert history.lookup([1, 2, 3], 4) is None
    assert history.lookup([12], 4) is None  # shorter than the n-gram looked up


def test_the_latest_answer_wins_and_adapters_keep_their_own():
    history = ResponseHistory(2, max_requests=4)
    history.add([1, 2], [50, 51, 60])
    history.add([1, 2], [50, 51, 70])
    assert history.lookup([50, 51], 1).tokens == [70]
    history.add([1, 2], [50, 51, 80], adapter="sql")
    assert history.lookup([50, 51], 1).tokens == [70]
    assert history.lookup([50, 51], 1, adapter="sql").tokens == [80]
    assert history.lookup([9, 9], 1, adapter="other") is None


def test_answers_leave_oldest_first_and_take_their_entries_along():
    history = ResponseHistory(2, max_requests=2)
    history.add([1], [20, 21, 22, 23])
    entries_of_one = history.entries
    history.add([1], [30, 31, 32, 33])
    history.add([1], [40, 41, 42, 43])
    assert len(history) == 2
    assert history.lookup([20, 21], 2) is None  # the first answer left
    assert history.lookup([30, 31], 2).tokens == [32, 33]
    for _ in range(50):  # many more answers: the table holds the kept ones' entries only
        history.add([1], [40, 41, 42, 43])
        history.add([1], [30, 31, 32, 33])
    assert history.entries <= 2 * entries_of_one
    history.add([1], [])  # an empty answer adds nothing
    assert len(history) == 2


def test_matched_length_counts_back_from_the_end_up_to_the_cap():
    assert matched_length([1, 2, 3, 4], [9, 2, 3, 4, 5], after=4) == 3
    assert matched_length([7, 4], [9, 2, 3, 4, 5], after=4) == 1
    long = list(range(200))
    assert matched_length(long, long + long, after=400) == MATCH_CAP


def _seq(prompt: list[int], output: list[int], seq_id: int = 0) -> Sequence:
    seq = Sequence(seq_id=seq_id, token_ids=list(prompt), params=SamplingParams(max_tokens=64),
                   eos_token_ids=frozenset(), max_model_len=256)
    seq.token_ids += output
    return seq


def test_the_proposer_takes_the_source_that_matched_more():
    proposer = NgramProposer(LIMITS, ResponseHistory(3, 2))
    # An earlier request answered [5, 6, 7, 8, 9, 1, 2, 3] to this prompt.
    done = _seq([40, 41, 42], [5, 6, 7, 8, 9, 1, 2, 3])
    done.finish_reason = FinishReason.STOP
    proposer.finished(done)
    # The same prompt again, two tokens in: its own context has (1, 2) -> 3 once (match 2);
    # the earlier answer matches the whole way back (prompt tail and both tokens: 5).
    again = _seq([1, 2, 3, 40, 41, 42], [5, 6])
    assert proposer.propose(again, room=10) == (7, 8, 9, 1)
    # A context whose own text matched longer keeps its own proposal.
    own = _seq([77, 78, 5, 6, 11, 12, 13, 77, 78], [5, 6])
    assert proposer.propose(own, room=10) == (11, 12, 13, 77)


def test_only_whole_answers_join_and_plain_ngram_keeps_none():
    proposer = NgramProposer(LIMITS, ResponseHistory(3, 2))
    cancelled = _seq([40, 41, 42], [5, 6, 7])
    cancelled.finish_reason = FinishReason.ABORT
    proposer.finished(cancelled)
    assert len(proposer.history) == 0
    cut = _seq([40, 41, 42], [5, 6, 7])
    cut.finish_reason = FinishReason.LENGTH
    proposer.finished(cut)
    assert len(proposer.history) == 1
    plain = NgramProposer(SpeculativeLimits(4, 2, 3, 3))
    plain.finished(cut)  # no history: nothing kept, nothing raised
    assert plain.history is None
