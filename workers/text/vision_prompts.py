"""Chat prompts of a vision-language model: images decoded, template rendered with image
placeholders, placeholders expanded and pixels prepared by the model's own processor.

Runs on the worker's side of the request (never the engine thread). Each image is
checked here, where it is decoded: its header must name an image format PIL reads and a
size within `max_image_pixels` *before* any pixel is decoded, so a decompression bomb
(a tiny file declaring a huge image) is a 400, never an out-of-memory.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

from PIL import Image, UnidentifiedImageError

from workers.contract.requests import GenerateRequest, ImageData
from workers.core.images import ImageInputs
from workers.text.prompts import Prompt, PromptBuilder, PromptError

# Processor outputs that describe the text, not the images.
_TEXT_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}


def decode_image(image: ImageData, max_pixels: int) -> Image.Image:
    try:
        with Image.open(io.BytesIO(image.data)) as opened:  # reads the header only
            width, height = opened.size
            if width * height > max_pixels:
                raise PromptError(
                    f"{image.param}: the image is {width}x{height} pixels; the limit is {max_pixels}", image.param,
                    "invalid_image")
            return opened.convert("RGB")  # decodes now, within the checked size
    except PromptError:
        raise
    except Image.DecompressionBombError:
        raise PromptError(f"{image.param}: the image declares too many pixels", image.param, "invalid_image") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as exc:
        raise PromptError(f"{image.param}: not a readable image ({type(exc).__name__})", image.param,
                          "invalid_image") from None


class VisionPromptBuilder:
    def __init__(self, processor, image_token_id: int, max_image_pixels: int) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token_id = image_token_id
        self.max_image_pixels = max_image_pixels
        self.template = getattr(processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)
        self.text = PromptBuilder(self.tokenizer)  # plain prompts (/v1/completions)

    def build(self, request: GenerateRequest) -> Prompt:
        if request.prompt is not None or request.prompt_token_ids is not None:
            return self.text.build(request)
        if not self.template:
            raise PromptError("this model has no chat template; use /v1/completions", "messages")
        messages = [_as_parts(m) for m in request.messages or []]
        ordered = _images_in_order(request)
        images = [decode_image(image, self.max_image_pixels) for image in ordered]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                **_ending_kwargs(request), **request.chat_template_kwargs,
            )
            out = self.processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
        except Exception as exc:  # jinja or the processor reject the conversation (e.g. placeholder count)
            raise PromptError(f"the model's processor rejected the messages: {exc}", "messages") from exc
        ids = out["input_ids"][0]
        if not images:
            return Prompt(ids.tolist(), text)
        positions = (ids == self.image_token_id).nonzero().flatten()
        pixel_inputs = {k: v for k, v in out.items() if k not in _TEXT_KEYS}
        return Prompt(ids.tolist(), text, ImageInputs(pixel_inputs, positions, _salt(ordered)))


def _images_in_order(request: GenerateRequest) -> list[ImageData]:
    """The request's images in the order their parts appear (the template's order)."""
    ordered = []
    for i, message in enumerate(request.messages or []):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") == "image":
                k = part.get("image_index")
                if not isinstance(k, int) or not 0 <= k < len(request.images):
                    raise PromptError(f"messages.{i}.content.{j}: image_index {k!r} names no image of the request",
                                      f"messages.{i}.content.{j}")
                ordered.append(request.images[k])
    return ordered


def _as_parts(message: dict[str, Any]) -> dict[str, Any]:
    """Content as a list of typed parts, the shape vision chat templates iterate over;
    an image part keeps its place as `{"type": "image"}`."""
    content = message.get("content")
    if isinstance(content, list):
        parts = [{"type": "image"} if p.get("type") == "image" else {"type": "text", "text": p.get("text", "")}
                 for p in content]
    else:
        parts = [{"type": "text", "text": content or ""}]
    return dict(message, content=parts)


def _salt(images: list[ImageData]) -> bytes:
    digest = hashlib.sha256()
    for image in images:
        digest.update(len(image.data).to_bytes(8, "little"))
        digest.update(image.data)
    return digest.digest()


def _ending_kwargs(request: GenerateRequest) -> dict[str, Any]:
    """`continue_final_message` only when asked (as workers/text/prompts.py passes it)."""
    return {"continue_final_message": True} if request.continue_final_message else {}
