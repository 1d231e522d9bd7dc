"""LoRA in the engine: one step mixes rows of several adapters and the base model, and each
request's greedy output equals peft's merged model's."""

from __future__ import annotations

import copy
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.support.engines import greedy, make_engine, prompt_ids, run_to_completion
from tests.support.lora_adapters import merged_greedy, merged_model
from workers.contract.lora import LoraAdapterError
from workers.core.limits import LoraLimits
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
    assert (engine.runner.direct is not None) == fuse  # fused siblings: chatserve's own forward runs
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


def test_packed_cpu_linears_take_lora_too(paged_model, tiny_model, tiny_tokenizer, adapter_dirs, adapter_requests):
    from workers.model.cpu_linear import PackedLinear, pack_linear_layers

    fuse_sibling_projections(paged_model)
    if not pack_linear_layers(paged_model, float32=True):
        pytest.skip("no oneDNN on this CPU")
    engine = _lora_engine(paged_model, adapter_requests)
    assert any(isinstance(t.layer.base, PackedLinear) for t in engine.lora.targets.values())
    prompt = prompt_ids(tiny_tokenizer)[1]
    ids = {name: engine.add_request(prompt, greedy(5), lora=adapter_requests[name].key) for name in adapter_dirs}
    events = run_to_completion(engine)
    for name, request_id in ids.items():
        # oneDNN's float32 sums differ from MKL's in the last bits: compare the tokens, which
        # the tiny model's widely spaced logits make stable.
        assert [e.token_id for e in events[request_id]] == _expected(tiny_model, adapter_dirs, name, prompt, 5)


def test_more_adapters_than_slots_wait_for_one_and_evict_the_least_recent(
        paged_model, tiny_model, tiny_tokenizer, adapter_dirs, adapter_requests):
    engine = _lora_engine(paged_model, adapter_requests, lora=LoraLimits(max_loras=2, max_rank=8))
    prompts = prompt_ids(tiny_tokenizer)
    jobs = [("all-r4", prompts[0], 8), ("attn-r8", prompts[1], 3), ("mlp-r2", prompts[2], 4), (None, prompts[3], 5)]
    ids = [engine.add_request(p, greedy(n), lora=adapter_requests[name].key if name else None)
           for name, p, n in jobs]
    first = engine.step()  # two adapters take both slots; the third waits, the base request does not
    running = {s.lora.name if s.lora else None for s in engine.scheduler.running}
    assert running == {"all-r4", "attn-r8", None}
    assert [s.lora.name for s in engine.scheduler.waiting] == ["mlp-r2"]
    events = run_to_completion(engine)
    for event in first:
        events[event.request_id].insert(0, event)
    for request_id, (name, prompt, n) in zip(ids, jobs):
        assert [e.token_id for e in events[request_id]] == _expected(tiny_model, adapter_dirs, name, prompt, n)
    # attn-r8 finished first, so mlp-r2 took its slot; all-r4 stayed.
    assert sorted(engine.lora.slots.resident) == sorted([adapter_requests["all-r4"].key, adapter_requests["mlp-r2"].key])


def test_an_evicted_adapter_is_reloaded_into_a_clean_slot(paged_model, tiny_model, tiny_tokenizer, adapter_dirs,
                                                          adapter_requests):
    # One slot, adapters in turn: each load overwrites the last one's weights (the smaller
    # adapter's unused rank and modules must read zero, not its predecessor's values).
    engine = _lora_engine(paged_model, adapter_requests, lora=LoraLimits(max_loras=1, max_rank=8))
    prompt = prompt_ids(tiny_tokenizer)[4]
    for name in ["attn-r8", "all-r4", "mlp-r2", "attn-r8"]:
        request_id = engine.add_request(prompt, greedy(4), lora=adapter_requests[name].key)
        got = [e.token_id for e in run_to_completion(engine)[request_id]]
        assert got == _expected(tiny_model, adapter_dirs, name, prompt, 4), name


def test_removed_adapter_finishes_its_requests_and_takes_no_new_ones(paged_model, tiny_model, tiny_tokenizer,
                                                                     adapter_dirs, adapter_requests):
    engine = _lora_engine(paged_model, adapter_requests)
    key = adapter_requests["all-r4"].key
    prompt = prompt_ids(tiny_tokenizer)[0]
    running = engine.add_request(prompt, greedy(6), lora=key)
    queued = engine.add_request(prompt_ids(tiny_tokenizer)[1], greedy(3), lora=key)
    first = engine.step()
    assert engine.remove_lora(key) and not engine.remove_lora(key)
    with pytest.raises(LoraAdapterError, match="not loaded"):
        engine.add_request(prompt, greedy(2), lora=key)
    events = run_to_completion(engine)
    for event in first:
        events[event.request_id].insert(0, event)
    assert [e.token_id for e in events[running]] == _expected(tiny_model, adapter_dirs, "all-r4", prompt, 6)
    assert len(events[queued]) == 3


def test_adapters_the_model_cannot_serve_are_refused(paged_model, tiny_model, adapter_dirs, tmp_path):
    from tests.support.lora_adapters import write_peft_adapter
    from tests.support.tiny_models import build_tiny_llama
    from workers.contract.lora import LoraRequest

    engine = make_engine(paged_model, lora=LoraLimits(max_loras=2, max_rank=4))
    too_wide = read_peft_adapter(LoraRequest.of("wide", str(adapter_dirs["attn-r8"])))
    with pytest.raises(LoraAdapterError, match="'wide': rank 8 is above this model's max_lora_rank 4"):
        engine.add_lora(too_wide)
    other = build_tiny_llama(400, hidden_size=32, intermediate_size=64)
    mismatched = read_peft_adapter(LoraRequest.of("other", str(write_peft_adapter(other, tmp_path / "o", seed=5))))
    with pytest.raises(LoraAdapterError, match="'other': 'model.layers.0.mlp.down_proj' maps 64 -> 32 features, the model's layer 128 -> 64"):
        engine.add_lora(mismatched)
    head = write_peft_adapter(tiny_model, tmp_path / "head", seed=6, targets=["q_proj", "lm_head"])
    with pytest.raises(LoraAdapterError, match="'head': tensor 'base_model.model.lm_head.base_layer.weight' is not"):
        engine.add_lora(read_peft_adapter(LoraRequest.of("head", str(head))))
    # A module path the model does not have (an adapter of a deeper model).
    deep = shutil.copytree(adapter_dirs["all-r4"], tmp_path / "deep")
    weights = {k.replace("layers.1.", "layers.7."): v for k, v in load_file(deep / "adapter_model.safetensors").items()}
    save_file(weights, deep / "adapter_model.safetensors")
    with pytest.raises(LoraAdapterError, match="'deep' adapts 'model.layers.7.mlp.down_proj', which is not a LoRA"):
        engine.add_lora(read_peft_adapter(LoraRequest.of("deep", str(deep))))


def test_prefix_cache_keeps_adapters_apart(paged_model, tiny_model, tiny_tokenizer, adapter_dirs, adapter_requests):
    engine = _lora_engine(paged_model, adapter_requests, block_size=4)
    prompt = prompt_ids(tiny_tokenizer)[4]  # several full blocks
    # (adapter, whether its prompt blocks are found in the cache): each adapter's K/V only
    # ever serve that adapter, and the base model's only the base model.
    runs = [("all-r4", False), ("all-r4", True), (None, False), ("mlp-r2", False), (None, True), ("mlp-r2", True)]
    for name, found in runs:
        before = engine.blocks.hit_tokens
        request_id = engine.add_request(prompt, greedy(3), lora=adapter_requests[name].key if name else None)
        events = run_to_completion(engine)[request_id]
        assert (engine.blocks.hit_tokens > before) == found, name
        assert [e.token_id for e in events] == _expected(tiny_model, adapter_dirs, name, prompt, 3), name


def test_a_later_engine_on_the_same_model_rewraps_it(paged_model, tiny_model, tiny_tokenizer, adapter_dirs,
                                                     adapter_requests):
    # As on a GPU: the memory-profiling engine wraps the model first, then the real engine.
    fuse_sibling_projections(paged_model)
    prompt = prompt_ids(tiny_tokenizer)[3]

    def check(engine) -> None:
        ids = {name: engine.add_request(prompt, greedy(4), lora=adapter_requests[name].key) for name in adapter_dirs}
        events = run_to_completion(engine)
        for name, request_id in ids.items():
            assert [e.token_id for e in events[request_id]] == _expected(tiny_model, adapter_dirs, name, prompt, 4)

    first = _lora_engine(paged_model, adapter_requests)
    check(first)
    same = _lora_engine(paged_model, adapter_requests)
    assert {id(t.layer) for t in same.lora.targets.values()} == {id(t.layer) for t in first.lora.targets.values()}
    check(same)  # the slots the first engine filled are written again before use
    wider = _lora_engine(paged_model, adapter_requests, lora=LoraLimits(max_loras=2, max_rank=16))
    assert all(t.layer.rank == 16 and t.layer.context is wider.lora.context for t in wider.lora.targets.values())
    assert not any(isinstance(t.layer.base, type(t.layer)) for t in wider.lora.targets.values())
    check(wider)


def test_a_step_computes_one_run_per_adapter(paged_model, tiny_tokenizer, adapter_requests):
    engine = _lora_engine(paged_model, adapter_requests)
    names = ["all-r4", "attn-r8", None, "mlp-r2", "all-r4", "attn-r8", "mlp-r2", None]
    prompts = prompt_ids(tiny_tokenizer)
    for i, name in enumerate(names):
        engine.add_request(prompts[i % len(prompts)], greedy(2), lora=adapter_requests[name].key if name else None)
    steps = []
    active = engine.lora.context.active

    def recording(step):
        steps.append(step)
        return active(step)

    engine.lora.context.active = recording
    run_to_completion(engine)
    prefill, decode = steps[0], steps[1]  # every prompt in the first step, then one token each
    # Interleaved requests, one run per adapter; the decode runs taken by batched products.
    assert len(prefill.runs) == 3 and prefill.grouped is None
    assert decode.runs == () and len(decode.grouped.slots) == 3 and decode.grouped.lengths == (2, 2, 2)
    assert [run[1] for run in prefill.runs] == sorted(run[1] for run in prefill.runs)
    # Layers an adapter leaves alone skip its run: mlp-r2 adapts gate_proj and down_proj only.
    slot = engine.lora.slots.slot_of(adapter_requests["mlp-r2"].key)
    q = engine.lora.targets["model.layers.0.self_attn.q_proj"].layer
    down = engine.lora.targets["model.layers.0.mlp.down_proj"].layer
    assert not q.adapted[slot] and down.adapted[slot]


def test_speculation_with_adapters_gives_the_same_tokens(paged_model, tiny_tokenizer, adapter_requests):
    """Verification chunks of sequences on different adapters (and the base) in one step:
    the same greedy tokens as without speculation, with proposals taken."""
    from workers.core.limits import SpeculativeLimits

    phrase = tiny_tokenizer.encode("the cat sat on the mat and then ")
    prompts = [(phrase * k + p)[:96] for k, p in enumerate(prompt_ids(tiny_tokenizer), start=1)]
    names = [None, "all-r4", "attn-r8", "mlp-r2", "all-r4"]
    outputs = {}
    for speculative in (None, SpeculativeLimits(4, 1, 3, None)):
        engine = _lora_engine(paged_model, adapter_requests, speculative=speculative)
        ids = [engine.add_request(p, greedy(20), lora=adapter_requests[n].key if n else None)
               for n, p in zip(names, prompts)]
        events = run_to_completion(engine)
        outputs[speculative is not None] = [[e.token_id for e in events[i]] for i in ids]
        if speculative is not None:
            assert engine.proposer.counts.accepted_tokens > 0
    assert outputs[True] == outputs[False]
