"""A tiny random vision-language model (LLaVA: CLIP vision tower + Llama), built offline
in about a second and saved as a directory the worker's loader opens like any model."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import torch
from PIL import Image
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

from tests.support.tiny_models import build_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56
PATCH_SIZE = 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # CLS dropped ("default" feature strategy)

# Content is a string or a list of parts; an image part becomes the placeholder the
# processor expands to TOKENS_PER_IMAGE tokens.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_vlm_processor() -> LlavaProcessor:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    # The PIL/numpy image processor: no torchvision needed.
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, chat_template=VLM_CHAT_TEMPLATE,
    )


def build_tiny_vlm(processor: LlavaProcessor, seed: int = 0) -> LlavaForConditionalGeneration:
    tokenizer = processor.tokenizer
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                       pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=-1, vision_feature_select_strategy="default")
    model = LlavaForConditionalGeneration(config)
    # Larger weights than the default init: logits far from ties, and images that matter.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def write_tiny_vlm_dir(path: Path, seed: int = 0) -> Path:
    processor = build_vlm_processor()
    build_tiny_vlm(processor, seed).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def png_bytes(color: tuple[int, int, int], size: tuple[int, int] = (40, 30), pattern: bool = True) -> bytes:
    """A small RGB PNG; `pattern` adds a gradient so different colors differ in structure too."""
    image = Image.new("RGB", size, color)
    if pattern:
        pixels = image.load()
        for x in range(size[0]):
            for y in range(0, size[1], 3):
                pixels[x, y] = ((color[0] + 7 * x) % 256, (color[1] + 5 * y) % 256, color[2])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A valid PNG header that declares a huge image over a few bytes of data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")
