"""The ngram proposer: the longest suffix seen before, its latest occurrence, the count
and room caps, a list cut back; each sequence's pace (halve, grow, pause); and the
requests it leaves alone."""

from __future__ import annotations

from workers.contract.sampling_params import SamplingParams
from workers.core.limits import SpeculativeLimits
from workers.core.sequence import Sequence
from workers.speculative.ngram_proposer import NgramIndex, NgramProposer
from workers.speculative.proposals import batch_allows

LIMITS = SpeculativeLimits(num_tokens=4, lookup_min=1, lookup_max=3, disable_by_batch_size=3)


def test_longest_suffix_then_its_latest_occurrence():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3]
    # suffix (1, 2, 3) occurs at 0..2, followed by 9; (2, 3) later at 4..5 is shorter
    assert index.lookup(tokens, 3) == [9, 2, 3]
    tokens += [7, 2, 3]
    # (7, 2, 3) unseen; (2, 3): latest earlier occurrence at 9..10 is followed by 7
    assert index.lookup(tokens, 2) == [7, 2]
    assert index.lookup([5, 6, 7], 4) == []  # cut back: the table is rebuilt, nothing seen
    assert NgramIndex(2, 3).lookup([4, 8, 4], 2) == []  # one token alone is below lookup_min


def test_a_short_period_repeats_on_into_the_proposal():
    index = NgramIndex(1, 2)
    assert index.lookup([1, 2, 3, 1], 5) == [2, 3, 1, 2, 3]
    assert index.lookup([1, 2, 3, 1, 7, 7], 3) == [7, 7, 7]


def _seq(output: list[int], **params) -> Sequence:
    seq = Sequence(seq_id=0, token_ids=[1, 2, 3, 1, 2, 3, 1, 2], params=SamplingParams(max_tokens=64, **params),
                   eos_token_ids=frozenset(), max_model_len=256)
    seq.token_ids += output
    return seq


def test_pace_follows_the_rate_of_taken_proposals():
    proposer = NgramProposer(LIMITS)
    seq = _seq([3, 1, 2])
    assert proposer.propose(seq, room=10) == (3, 1, 2, 3)  # a fresh sequence: num_tokens caps it
    assert proposer.propose(seq, room=2) == (3, 1)  # so does the room
    proposer.record(seq, proposed=4, accepted=0)  # rate (0.7 * 2) / (0.7 * 2.5 + 1) = 0.51
    assert len(proposer.propose(seq, 10)) == 2  # 0.51 ** 2 > ROW_COST > 0.51 ** 3
    proposer.record(seq, proposed=2, accepted=0)  # 0.34
    assert len(proposer.propose(seq, 10)) == 1
    proposer.record(seq, proposed=1, accepted=0)  # 0.22
    assert len(proposer.propose(seq, 10)) == 1
    proposer.record(seq, proposed=1, accepted=0)  # 0.15: one would not pay; pause 1 step
    assert proposer.propose(seq, 10) == ()
    assert len(proposer.propose(seq, 10)) == 1  # then one, to see whether the rate came back
    proposer.record(seq, proposed=1, accepted=0)  # still not: pause 2 steps
    assert proposer.propose(seq, 10) == () and proposer.propose(seq, 10) == ()
    assert len(proposer.propose(seq, 10)) == 1
    for _ in range(3):
        proposer.record(seq, proposed=4, accepted=4)  # taken in full: long proposals again
    assert len(proposer.propose(seq, 10)) == 4
    assert (proposer.counts.drafts, proposer.counts.draft_tokens, proposer.counts.accepted_tokens) == (8, 21, 12)


def test_requests_it_leaves_alone():
    proposer = NgramProposer(LIMITS)
    assert proposer.propose(_seq([3, 1, 2]), 0) == ()
    assert proposer.propose(_seq([]), 4) == ()  # before the first token (n > 1 forks then)
    assert proposer.propose(_seq([3, 1, 2], presence_penalty=0.5), 4) == (3, 1, 2, 3)  # penalties follow the rows
    assert proposer.propose(_seq([3, 1, 2], min_tokens=8), 4) == (3, 1, 2, 3)  # each row bans by its position
    assert proposer.propose(_seq([3, 1, 2], n=2, use_beam_search=True, temperature=0.0), 4) == ()
    guided = _seq([3, 1, 2])
    guided.guide = object()  # a grammar no longer stops proposals (the scheduler cuts them to it)
    assert proposer.propose(guided, 4) == (3, 1, 2, 3)
    guided_early = _seq([3, 1, 2], min_tokens=8)
    guided_early.guide = object()  # its grammar may complete inside the proposals, where a plain step lifts the ban
    assert proposer.propose(guided_early, 4) == ()
    assert batch_allows(LIMITS, 2) and not batch_allows(LIMITS, 3)
    assert batch_allows(SpeculativeLimits(4, 1, 3, None), 1000)
