"""A worker's LoRA adapters outside Serve: loading on a request's first use, the paths it
may read, the load route's check, and a chat request through an adapter end to end."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil

import pytest

from tests.support.engines import (
    chat_request,
    generate,
    make_engine,
    template_ids,
    wait_idle,
    with_async_engine,
)
from tests.support.lora_adapters import merged_greedy, merged_model, write_peft_adapter
from workers.contract.lora import LoraRequest
from workers.contract.model_config import LoraConfig
from workers.core.limits import LoraLimits
from workers.lora.replica_adapters import WorkerAdapters, _Held
from workers.serving.request_processor import RequestProcessor

TEXT = "Hi there, what is the capital of France?"


@pytest.fixture(scope="module")
def adapter_root(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_root")
    write_peft_adapter(tiny_model, root / "a", seed=11)
    write_peft_adapter(tiny_model, root / "wide", seed=12, rank=16, alpha=16)
    return root


def _run(paged_model, config: LoraConfig, body):
    engine = make_engine(paged_model, max_model_len=256, lora=LoraLimits(max_loras=2, max_rank=8))

    async def with_adapters(aengine):
        return await body(aengine, WorkerAdapters(aengine, config, multiplexed=False))

    return asyncio.run(with_async_engine(engine, with_adapters)), engine


def test_chat_request_through_an_adapter_equals_peft_merged(paged_model, tiny_model, tiny_tokenizer, adapter_root):
    config = LoraConfig(adapters={"mine": str(adapter_root / "a")})
    request = dataclasses.replace(chat_request(TEXT, 7, ignore_eos=True),
                                  lora=LoraRequest.of("mine", str(adapter_root / "a")))

    async def body(aengine, adapters):
        assert await adapters.ensure(request.lora) is None
        processor = RequestProcessor(aengine, tiny_tokenizer)
        chunks = [c async for c in generate(processor, request)]
        plain = [c async for c in generate(processor, chat_request(TEXT, 7, ignore_eos=True))]
        await wait_idle(aengine)
        return chunks, plain

    (chunks, plain), engine = _run(paged_model, config, body)
    prompt = template_ids(tiny_tokenizer, TEXT)
    got = [t for c in chunks for t in c.token_ids]
    assert got == merged_greedy(merged_model(tiny_model, adapter_root / "a"), prompt, 7)
    assert [t for c in plain for t in c.token_ids] == merged_greedy(tiny_model, prompt, 7) != got
    assert engine.lora.slots.users(request.lora.key) == 0


def test_a_request_for_an_adapter_not_loaded_is_a_400(paged_model, tiny_tokenizer, adapter_root):
    request = dataclasses.replace(chat_request(TEXT, 3), lora=LoraRequest.of("ghost", str(adapter_root / "a")))

    async def body(aengine, adapters):
        return [c async for c in generate(RequestProcessor(aengine, tiny_tokenizer), request)]

    chunks, _ = _run(paged_model, LoraConfig(), body)
    assert chunks[0].error.status == 400 and chunks[0].error.code == "invalid_lora_adapter"
    assert chunks[0].error.param == "model" and "not loaded" in chunks[0].error.message


def test_only_configured_adapters_and_paths_inside_adapter_dir_are_read(paged_model, adapter_root, tmp_path):
    outside = shutil.copytree(adapter_root / "a", tmp_path / "outside")  # an adapter outside adapter_dir
    escape = adapter_root / "escape"
    os.symlink(tmp_path, escape)  # inside by name, outside once resolved
    config = LoraConfig(adapters={"conf": str(outside)}, adapter_dir=str(adapter_root))

    async def body(aengine, adapters):
        return {
            "configured": await adapters.ensure(LoraRequest.of("conf", str(outside))),
            "inside": await adapters.ensure(LoraRequest.of("rt", str(adapter_root / "a"))),
            "outside": await adapters.ensure(LoraRequest.of("rt2", str(outside))),
            "escape": await adapters.ensure(LoraRequest.of("rt3", str(escape / "outside"))),
        }

    errors, _ = _run(paged_model, config, body)
    assert errors["configured"] is None and errors["inside"] is None
    assert "outside the adapter directory" in errors["outside"].message
    assert "outside the adapter directory" in errors["escape"].message


def test_the_load_routes_check(paged_model, adapter_root):
    config = LoraConfig(adapter_dir=str(adapter_root), max_lora_rank=8)

    async def body(aengine, adapters):
        return [await adapters.check("n", "a"), await adapters.check("n", str(adapter_root / "wide")),
                await adapters.check("n", "/etc"), await adapters.check("n", "missing")]

    (good, wide, outside, missing), _ = _run(paged_model, config, body)
    assert good is None
    assert wide.status == 400 and wide.param == "lora_path" and "rank 16 is above" in wide.message
    assert "outside the adapter directory" in outside.message
    assert "is not a directory" in missing.message


def test_without_adapter_dir_nothing_loads_at_run_time(paged_model, adapter_root):
    async def body(aengine, adapters):
        return await adapters.check("n", str(adapter_root / "a"))

    error, _ = _run(paged_model, LoraConfig(), body)
    assert "loads no adapters at run time" in error.message


def test_a_bad_configured_adapter_fails_the_start(paged_model, adapter_root):
    async def body(aengine, adapters):
        with pytest.raises(ValueError, match="'big': rank 16 is above"):
            adapters.check_configured()
        return True

    assert _run(paged_model, LoraConfig(adapters={"big": str(adapter_root / "wide")}), body)[0]


def test_an_evicted_adapter_is_unregistered_once():
    removed = []

    class Engine:
        def remove_lora(self, key):
            removed.append(key)

    held = _Held(Engine(), "k")
    held.__del__()  # Serve's eviction
    held.__del__()  # the garbage collector's
    assert removed == ["k"]
