"""LoRA in the engine: one step mixes rows of several adapters and the base model, and each
request's greedy output equals peft's merged model's."""

from __future__ import annotations

import copy

import pytest

from tests.support.engines import greedy, make_engine, prompt_ids, run_to_completion
from tests.support.lora_adapters import merged_greedy, merged_model
from workers.contract.lora import LoraAdapterError
from workers.engine.limits import LoraLimits
from workers.lora.peft_files import read_peft_adapter
from workers.model.fused_projections import fuse_sibling_projections

LIMITS = LoraLimits(max_loras=4, max_rank=8)


def _lora_engine(model, adapter_requests, **limits):
    engine = make_engine(model, lora=limits.pop("lora", LIMITS), **limits)
    for request in adapter_requests.values():
        engine.add_lora(read_peft_adapter(request))
    return engine


def _expected(tiny_model, adapter_dirs, name, prompt, n):
    model = tiny_model if name is None else merged_model(tiny_model, adapter_dirs[name])
    return merged_greedy(model, prompt, n)


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused-projections"])
def test_one_batch_mixing_three_adapters_and_the_base_equals_peft_merged(
        fuse, paged_model, tiny_model, tiny_tokenizer, adapter_dirs, adapter_requests):
    if fuse:
        fuse_sibling_projections(paged_model)
    engine = _lora_engine(paged_model, adapter_requests)
    prompts = prompt_ids(tiny_tokenizer)
    names = [None, "all-r4", "attn-r8", "mlp-r2", "all-r4", None, "attn-r8", "mlp-r2"]
    jobs = [(names[i], prompts[i % len(prompts)], 6 + i) for i in range(len(names))]
    ids = [engine.add_request(p, greedy(n), lora=adapter_requests[name].key if name else None)
           for name, p, n in jobs]
    seen_mixed = []
    step = engine.runner.forward

    def recording_forward(decodes, prefills, *args, **kw):
        slots = {c.seq.lora_slot for c in decodes + prefills}
        seen_mixed.append(len(slots))
        return step(decodes, prefills, *args, **kw)

    engine.runner.forward = recording_forward
    events = run_to_completion(engine)
    assert max(seen_mixed) == 4, "some step ran rows of all three adapters and the base together"
    for request_id, (name, prompt, n) in zip(ids, jobs):
        got = [e.token_id for e in events[request_id]]
        assert got == _expected(tiny_model, adapter_dirs, name, prompt, n), name


def test_an_adapter_changes_the_output(tiny_model, tiny_tokenizer, adapter_dirs):
    prompt = prompt_ids(tiny_tokenizer)[2]
    outputs = {name: tuple(_expected(tiny_model, adapter_dirs, name, prompt, 8)) for name in [None, *adapter_dirs]}
    assert len(set(outputs.values())) == len(outputs)


def test_unknown_adapter_key_is_refused(paged_model, adapter_requests):
    engine = _lora_engine(paged_model, adapter_requests)
    with pytest.raises(LoraAdapterError, match="not loaded"):
        engine.add_request([1, 2, 3], greedy(2), lora="nope@0")
    plain = make_engine(copy.deepcopy(paged_model))
    with pytest.raises(LoraAdapterError, match="serves no LoRA"):
        plain.add_request([1, 2, 3], greedy(2), lora=adapter_requests["all-r4"].key)
