"""Images through the engine on the tiny random LLaVA: greedy output equals transformers'
own `generate` on the same inputs, also with the image split across prefill chunks, after
preemption, and batched with a text request; the worker's image checks."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch
from transformers import AutoModelForImageTextToText

from tests.support.engines import generate
from tests.support.tiny_vlm import (
    TOKENS_PER_IMAGE,
    png_bytes,
    png_declaring,
    write_tiny_vlm_dir,
)
from tests.unit.model.test_cpu_linear import needs_onednn_bf16
from workers.contract.requests import GenerateRequest, ImageData
from workers.contract.sampling_params import SamplingParams
from workers.core.images import ImageInputs
from workers.core.limits import EngineLimits
from workers.engine.llm_engine import LLMEngine
from workers.model.cpu_linear import PackedLinear
from workers.model.kv_cache import KVCacheShape
from workers.model.loader import load_model
from workers.model.multimodal import ImageEncodeError
from workers.serving.async_engine import AsyncEngine
from workers.serving.request_processor import RequestProcessor
from workers.text.prompts import PromptBuilder, PromptError
from workers.text.vision_prompts import VisionPromptBuilder, decode_image

CPU = torch.device("cpu")
RED, BLUE = png_bytes((220, 30, 30)), png_bytes((20, 40, 230))
PARAM = "messages.0.content.1.image_url"


def built(prompts, request):
    """(prompt ids, image inputs) of a request, as the worker builds them."""
    prompt = prompts.build(request)
    return prompt.token_ids, prompt.images


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_vlm_dir(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="module")
def paged_vlm(vlm_dir, paged_attn_name):
    """The worker's loader: paged attention on the language model, SDPA on the vision tower."""
    loaded = load_model(str(vlm_dir), dtype="float32", attn_implementation=paged_attn_name)  # as the references
    assert loaded.model.config.text_config._attn_implementation == paged_attn_name
    assert loaded.model.config.vision_config._attn_implementation == "sdpa"
    return loaded


@pytest.fixture(scope="module")
def reference_vlm(vlm_dir):
    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(paged_vlm) -> VisionPromptBuilder:
    return VisionPromptBuilder(paged_vlm.processor, paged_vlm.image_token_id, max_image_pixels=10_000)


def image_request(*images: bytes, text: str = "What is this?") -> GenerateRequest:
    parts = [{"type": "text", "text": text}] + [{"type": "image", "image_index": k} for k in range(len(images))]
    return GenerateRequest("r", SamplingParams(), messages=[{"role": "user", "content": parts}],
                           images=tuple(ImageData(data, f"messages.0.content.{k + 1}.image_url")
                                        for k, data in enumerate(images)))


def text_request(text: str) -> GenerateRequest:
    return GenerateRequest("t", SamplingParams(), messages=[{"role": "user", "content": text}])


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def make_engine(model, num_blocks=128, block_size=4, **limits) -> LLMEngine:
    per_token = KVCacheShape.from_model_config(model.config, model.dtype).bytes_per_token
    limits = EngineLimits(block_size=block_size, kv_cache_bytes=num_blocks * block_size * per_token, **limits)
    return LLMEngine(model, frozenset(), limits, CPU)


def run(engine: LLMEngine, batches: list | None = None) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for _ in range(500):
        if not engine.has_work():
            return out
        if batches is not None:
            schedule = engine.scheduler.schedule
            engine.scheduler.schedule = lambda: _record(schedule, batches)
        for event in engine.step():
            out.setdefault(event.request_id, []).append(event.token_id)
        if batches is not None:
            engine.scheduler.schedule = schedule
    raise AssertionError("engine did not finish")


def _record(schedule, batches):
    batch = schedule()
    batches.append({c.seq.request_id for c in batch.decodes + batch.prefills})
    return batch


def reference(model, prompts: VisionPromptBuilder, request: GenerateRequest, n: int) -> list[int]:
    ids, images = built(prompts, request)
    x = torch.tensor([ids])
    kwargs = dict(images.pixel_inputs) if images is not None else {}
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def test_prompt_expands_one_placeholder_per_feature(prompts, paged_vlm):
    ids, images = built(prompts, image_request(RED))
    assert images is not None
    assert images.positions.numel() == TOKENS_PER_IMAGE
    assert all(ids[p] == paged_vlm.image_token_id for p in images.positions.tolist())
    assert images.salt == hashlib.sha256(len(RED).to_bytes(8, "little") + RED).digest()


def test_image_request_matches_transformers_generate(paged_vlm, reference_vlm, prompts):
    expected = {color: reference(reference_vlm, prompts, image_request(color), 8) for color in (RED, BLUE)}
    assert expected[RED] != expected[BLUE]  # the image changes the answer: features are not ignored
    assert answers_in_one_batch(paged_vlm.model, prompts, 8) == expected


def answers_in_one_batch(model, prompts: VisionPromptBuilder, n: int) -> dict[bytes, list[int]]:
    """Greedy answers to the red and the blue image request, run side by side in one engine."""
    engine = make_engine(model)
    ids = {}
    for color in (RED, BLUE):
        prompt, images = built(prompts, image_request(color))
        ids[color] = engine.add_request(prompt, greedy(n), images=images)
    out = run(engine)
    assert engine.blocks.num_used_blocks == 0
    return {color: out[i] for color, i in ids.items()}


@needs_onednn_bf16
def test_bfloat16_vision_model_with_packed_weights(vlm_dir, paged_attn_name, prompts):
    """The loader packs a bfloat16 vision-language model's linear layers (vision tower and
    projector included): image requests run and answer as the plain bfloat16 model does."""
    answers = []
    for pack in (False, True):
        loaded = load_model(str(vlm_dir), dtype="bfloat16", attn_implementation=paged_attn_name,
                            pack_cpu_weights=pack)
        packed = [name for name, m in loaded.model.named_modules() if isinstance(m, PackedLinear)]
        assert bool(packed) == pack and (not pack or any("vision" in name for name in packed))
        answers.append(answers_in_one_batch(loaded.model, prompts, 8))
    assert answers[0] == answers[1]
    assert all(len(tokens) == 8 for tokens in answers[1].values())


def test_image_split_across_prefill_chunks(paged_vlm, reference_vlm, prompts):
    """A 5-token budget cuts the 16 placeholders over several steps."""
    request = image_request(RED, BLUE)
    expected = reference(reference_vlm, prompts, request, 6)
    engine = make_engine(paged_vlm.model, max_num_batched_tokens=5)
    prompt, images = built(prompts, request)
    request_id = engine.add_request(prompt, greedy(6), images=images)
    batches: list = []
    assert run(engine, batches)[request_id] == expected
    assert len(batches) >= len(prompt) // 5  # really chunked


def test_image_and_text_requests_in_one_batch(paged_vlm, reference_vlm, prompts):
    text = text_request("Paris is the capital of")
    text_ids, _ = built(prompts, text)
    alone_engine = make_engine(paged_vlm.model)
    alone_id = alone_engine.add_request(text_ids, greedy(10))
    alone = run(alone_engine)[alone_id]
    assert alone == reference(reference_vlm, prompts, text, 10)

    engine = make_engine(paged_vlm.model)
    prompt, images = built(prompts, image_request(BLUE))
    image_id = engine.add_request(prompt, greedy(10), images=images)
    text_id = engine.add_request(text_ids, greedy(10))
    batches: list = []
    out = run(engine, batches)
    assert any({image_id, text_id} <= ids for ids in batches)  # they did share steps
    assert out[text_id] == alone
    assert out[image_id] == reference(reference_vlm, prompts, image_request(BLUE), 10)


def test_preempted_image_request_recomputes_the_same_output(paged_vlm, reference_vlm, prompts):
    engine = make_engine(paged_vlm.model, num_blocks=22, block_size=4)  # 88 slots: two ~45-token sequences do not fit
    requests = [image_request(RED), image_request(BLUE)]
    preempted: list = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        preempted.extend(batch.preempted)
        return batch

    engine.scheduler.schedule = recording
    ids = []
    for request in requests:
        prompt, images = built(prompts, request)
        ids.append(engine.add_request(prompt, greedy(14), images=images))
    out = run(engine)
    assert preempted, "the pool was meant to force a preemption"
    for request_id, request in zip(ids, requests):
        assert out[request_id] == reference(reference_vlm, prompts, request, 14)


def test_sequences_carry_a_cache_salt_of_their_images(paged_vlm, prompts):
    engine = make_engine(paged_vlm.model)
    salts = []
    for request in (image_request(RED), image_request(BLUE), text_request("hi")):
        prompt, images = built(prompts, request)
        engine.add_request(prompt, greedy(1), images=images)
        salts.append(engine.scheduler.waiting[-1].cache_salt)
    assert salts[0] and salts[1] and salts[0] != salts[1]
    assert salts[2] == b""


# --- the worker's checks of the bytes ------------------------------------------------


@pytest.mark.parametrize("data, message", [
    (png_declaring(100_000, 100_000), "pixels"),  # beyond PIL's own bomb limit
    (png_declaring(2_000, 2_000), "the limit is 10000"),  # beyond ours
    (b"this is not an image at all", "not a readable image"),
    (png_bytes((1, 2, 3))[:40], "not a readable image"),  # truncated
])
def test_bad_images_are_refused_naming_the_part(data, message):
    with pytest.raises(PromptError) as err:
        decode_image(ImageData(data, PARAM), max_pixels=10_000)
    assert err.value.param == PARAM
    assert message in str(err.value)


def test_an_image_within_the_cap_decodes():
    image = decode_image(ImageData(png_bytes((5, 6, 7), size=(100, 100)), PARAM), max_pixels=10_000)
    assert image.size == (100, 100) and image.mode == "RGB"


def test_text_only_model_refuses_images(tiny_tokenizer):
    request = image_request(RED)
    with pytest.raises(PromptError) as err:
        PromptBuilder(tiny_tokenizer).build(request)
    assert err.value.param == PARAM


def test_request_processor_answers_an_image_request(paged_vlm, reference_vlm, prompts):
    """The worker's whole path: images decoded off the event loop, features in the engine."""
    async def main():
        engine = AsyncEngine(make_engine(paged_vlm.model))
        engine.start(asyncio.get_running_loop())
        try:
            processor = RequestProcessor(engine, paged_vlm.tokenizer, vision=prompts)
            request = GenerateRequest("r", greedy(5), messages=image_request(RED).messages, images=image_request(RED).images,
                                      max_tokens=5)
            chunks = [c async for c in generate(processor, request)]
            bad = GenerateRequest("b", greedy(5), messages=image_request(RED).messages,
                                  images=(ImageData(b"junk", PARAM),), max_tokens=5)
            refused = [c async for c in generate(processor, bad)]
        finally:
            engine.stop()
        return chunks, refused

    chunks, refused = asyncio.run(main())
    assert all(c.error is None for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == reference(reference_vlm, prompts, image_request(RED), 5)
    assert chunks[-1].prompt_tokens == len(built(prompts, image_request(RED))[0])
    assert refused[0].error.status == 400 and refused[0].error.param == PARAM


def test_features_that_miss_placeholders_fail_the_request_only(paged_vlm, prompts):
    engine = make_engine(paged_vlm.model)
    prompt, images = built(prompts, image_request(RED))
    short = ImageInputs(images.pixel_inputs, images.positions[:-1], images.salt)
    with pytest.raises(ImageEncodeError, match="feature rows"):
        engine.add_request(prompt, greedy(2), images=short)
    broken = ImageInputs({"pixel_values": torch.zeros(1, 3, 7, 7)}, images.positions, images.salt)
    with pytest.raises(ImageEncodeError, match="vision tower failed"):
        engine.add_request(prompt, greedy(2), images=broken)
    assert not engine.has_work()
    request_id = engine.add_request(prompt, greedy(2), images=images)
    assert len(run(engine)[request_id]) == 2


def test_forked_choices_keep_the_images(paged_vlm, prompts):
    """n > 1 and beam siblings fork from the prompt; a preempted sibling recomputes it."""
    engine = make_engine(paged_vlm.model)
    prompt, images = built(prompts, image_request(RED))
    engine.add_request(prompt, greedy(1), images=images)
    parent = engine.scheduler.waiting[-1]
    child = parent.fork(99, 1)
    assert child.image_features is parent.image_features is not None
    assert child.cache_salt == parent.cache_salt == images.salt
