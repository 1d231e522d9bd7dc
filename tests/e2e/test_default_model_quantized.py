"""The default model from its Q4_1 GGUF with the blocks kept (quantization: auto): its
weights' memory, and its greedy text against the float copy's on the e2e tests' prompts
(exact float32 activations, and the default int8x2)."""

from __future__ import annotations

import pytest
import torch

from workers.contract.model_config import BUILTIN_DEFAULT_MODEL
from workers.model.loader import load_model, weight_bytes
from workers.quant.native_kernels import kernels
from workers.quant.quantized_layers import QuantizedEmbedding, QuantizedLinear

pytestmark = [pytest.mark.slow, pytest.mark.skipif(kernels() is None, reason="no C compiler for the kernels")]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful customer support assistant. Use the supplied tools to assist "
                                   "the user."},
     {"role": "user", "content": "Hi, can you tell me the delivery date for my order? my order id is 12345."}],
]


@pytest.fixture(scope="module")
def models():
    # The float copy unpacked: oneDNN's packed weights (chosen by a per-machine probe) are
    # not parameters, and its weights are what the memory test weighs.
    return {name: load_model(BUILTIN_DEFAULT_MODEL, dtype="float32", quantization=quantization,
                             quantized_activations=activations, pack_cpu_weights=quantization == "auto")
            for name, quantization, activations in (("float", "none", "int8x2"), ("exact", "auto", "float32"),
                                                    ("default", "auto", "int8x2"))}


def _greedy(loaded, chat, n: int) -> list[int]:
    ids = loaded.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, ids.shape[1]:].tolist()


def test_weights_stay_in_their_blocks_under_120_mb(models):
    model = models["exact"].model
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, QuantizedLinear)
    assert weight_bytes(model) <= 120 * 1024**2
    assert weight_bytes(models["float"].model) > 4 * weight_bytes(model)  # ~540 MB of float32 before


@pytest.mark.parametrize("chat", CHATS, ids=["capital", "support"])
def test_greedy_text_matches_the_float_copy(models, chat):
    want = _greedy(models["float"], chat, 24)
    assert _greedy(models["exact"], chat, 24) == want
    # the default, activations rounded to 8 bits twice (one rounding, llama.cpp's, turns
    # the capital question's first token from "The" to "L", as llama-server does)
    assert _greedy(models["default"], chat, 24) == want
    if chat is CHATS[0]:
        assert "Paris" in models["default"].tokenizer.decode(want)


def test_a_tensor_parallel_shard_keeps_its_part_of_the_blocks(tmp_path):
    """Shard 1 of 3 of the default model (9 heads: 192 q rows and o columns a shard): every
    linear and the embedding hold its part of the file's blocks (q/k rows reordered as
    transformers loads them, then cut), equal to the float shard's weights."""
    from workers.contract.model_config import ModelConfig
    from workers.serving.model_part import load_part

    shards = {quantization: load_part(ModelConfig(
        id="m", dtype="float32", pack_cpu_weights=False, quantization=quantization,
        quantized_activations="float32", parallel={"tensor_parallel_size": 3}), 1)[0].model
        for quantization in ("auto", "none")}
    floats = dict(shards["none"].named_modules())
    packed = {name: m for name, m in shards["auto"].named_modules()
              if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    assert len(packed) == 4 * 30 + 2  # q/k/v, o, gate/up, down a layer; the embedding and the (tied) head
    assert shards["auto"].model.embed_tokens.blocks is shards["auto"].lm_head.blocks  # the shard's one copy
    for name, layer in packed.items():
        if isinstance(layer, QuantizedLinear):
            assert torch.equal(layer.dequantized(), floats[name].weight), name
