"""tools.reliability.seeded_batch_probe: the same batch gives a seeded request the same tokens."""

from __future__ import annotations

from tests.support.engines import prompt_ids
from tools.reliability.seeded_batch_probe import run_batch
from workers.contract.sampling_params import SamplingParams


def test_a_batch_run_twice_gives_each_seeded_choice_the_same_tokens(paged_model, tiny_tokenizer):
    prompts = prompt_ids(tiny_tokenizer)
    requests = [(p, SamplingParams(max_tokens=24, temperature=0.9, seed=i, n=2, ignore_eos=True))
                for i, p in enumerate(prompts)]
    first, again = run_batch(paged_model, requests), run_batch(paged_model, requests)
    assert first == again
    assert all(sorted(choices) == [0, 1] and all(len(ids) == 24 for ids in choices.values()) for choices in first)
    assert first[0][0] != first[0][1]  # the choices draw apart
