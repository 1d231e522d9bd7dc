"""A step of decode rows through every fused layer in one C call (cpu_decoder.c): the same
bits as the fused layers called one operation at a time, and nothing done where it does
not take the step."""

from __future__ import annotations

import pytest
import torch

from tests.support.engines import make_engine, run_to_completion
from tests.unit.model.test_quantized_weights import PROMPTS, Q, _twin_pair
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import SpeculativeLimits
from workers.model.gguf_packing import keep_gguf_weights_packed


@pytest.fixture(scope="module")
def packed_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("decoder") / "m.gguf"
    _, model = _twin_pair(path, Q.Q4_1)
    keep_gguf_weights_packed(model, path, activations="int8x2")
    return model


class _Counted:
    """Wraps a DecodeLayers: how many steps it took and how many it declined."""

    def __init__(self, inner):
        self.inner, self.taken, self.declined = inner, 0, 0

    def __call__(self, *args):
        done = self.inner(*args)
        self.taken += done
        self.declined += not done
        return done


def _run(model, one_call: bool, bias: bool = False, n: int = 1, **limits):
    engine = make_engine(model, **limits)
    direct = engine.runner.direct
    if bias:  # a Qwen2-like q/k/v bias, added after the product
        for i, layer in enumerate(direct.layers):
            generator = torch.Generator().manual_seed(i)
            layer.qkv.bias = 0.1 * torch.randn(layer.qkv.out_features, generator=generator)
        direct.decode_layers = direct._decode_layers()
    assert direct.decode_layers is not None
    counted = direct.decode_layers = _Counted(direct.decode_layers) if one_call else None
    params = SamplingParams(max_tokens=10, temperature=0.8 if n > 1 else 0.0, seed=7, n=n, ignore_eos=True,
                            logprobs=1)
    ids = [engine.add_request(prompt, params) for prompt in PROMPTS]
    events = run_to_completion(engine)
    out = [[(ev.index, ev.token_id, ev.logprob) for ev in events[i]] for i in ids]
    return out, counted


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "qkv-bias"])
def test_one_call_gives_the_per_layer_bits(packed_model, bias):
    """16 prompts (decode steps of 1 to 16 rows, beside prompt steps, which it declines):
    every token and logprob equal to the per-layer fused path's."""
    (got, counted), (want, _) = _run(packed_model, True, bias), _run(packed_model, False, bias)
    assert got == want
    assert counted.taken >= 9  # every decode-only step


def test_speculative_verifications_run_in_the_call_with_the_same_bits(packed_model):
    """ngram proposals: each verification is a short span with context, given to the C
    attention as decode rows (several rows of one sequence), beside plain decode rows."""
    speculative = SpeculativeLimits(num_tokens=3, lookup_min=1, lookup_max=3, disable_by_batch_size=None)
    (got, counted), (want, _) = (_run(packed_model, one_call, speculative=speculative) for one_call in (True, False))
    assert got == want
    assert counted.taken >= 9


def test_seeded_samples_with_n_are_the_same(packed_model):
    (got, counted), (want, _) = _run(packed_model, True, n=3), _run(packed_model, False, n=3)
    assert got == want and counted.taken > 0


@pytest.mark.parametrize("prompts", [1, 2, 3], ids=["one-row", "two-rows", "three-rows"])
def test_two_threads_give_the_one_thread_bits(packed_model, prompts):
    """Steps of one to three decode rows split over two threads (the rounding, the products'
    group pairs and the attention's heads shared by the team): the tokens and logprobs of
    one thread, every decode step taken in the one call. The suite's own runs use one
    thread (tests/conftest.py)."""
    def run(threads: int):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            engine = make_engine(packed_model)
            counted = engine.runner.direct.decode_layers = _Counted(engine.runner.direct.decode_layers)
            params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
            ids = [engine.add_request(prompt, params) for prompt in PROMPTS[:prompts]]
            events = run_to_completion(engine)
        finally:
            torch.set_num_threads(previous)
        return [[(ev.token_id, ev.logprob) for ev in events[i]] for i in ids], counted

    (got, counted), (want, _) = run(2), run(1)
    assert got == want
    assert counted.taken >= 10 and counted.declined == 0


def test_a_slot_outside_the_cache_declines_and_leaves_x(packed_model):
    """The call checks every slot before it writes: one past the caches and nothing is done
    (the per-layer path then raises, as torch's index_copy does)."""
    engine = make_engine(packed_model)
    direct = engine.runner.direct
    decoder, seen = direct.decode_layers, []

    def spy(x, cos, signed_sin, slots, tables, lens, cache):
        bad, before = slots.clone(), x.clone()
        bad[0] = cache.keys.shape[1]  # one past the last slot
        seen.append((decoder(x, cos, signed_sin, bad, tables, lens, cache), torch.equal(x, before)))
        return decoder(x, cos, signed_sin, slots, tables, lens, cache)

    direct.decode_layers = spy
    request = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))
    events = run_to_completion(engine)[request]
    assert seen and all(result == (False, True) for result in seen)
    assert len(events) == 4 and all(ev.error is None for ev in events)


def test_the_build_key_covers_the_included_sources():
    """A change to the product or attention code rebuilds the decoder too."""
    from workers.model import cpu_decoder
    from workers.native.build import local_sources

    names = {path.name for path in local_sources(cpu_decoder.SOURCE)}
    assert names == {"cpu_decoder.c", "cpu_kernels.c", "cpu_attention.c", "vector_math.h"}


def test_the_portable_build_compiles(tmp_path):
    """Without AVX2 (plain x86-64) the included sources' portable loops build here too."""
    import platform
    import subprocess

    from workers.model import cpu_decoder

    arch = ["-march=x86-64"] if platform.machine() == "x86_64" else []
    subprocess.run(["gcc", "-O2", "-fopenmp", "-shared", "-fPIC", "-Werror=implicit-function-declaration", *arch,
                    "-o", str(tmp_path / "portable.so"), str(cpu_decoder.SOURCE)], check=True, timeout=120)
