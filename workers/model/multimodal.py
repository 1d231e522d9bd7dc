"""Encoding a request's images, once: the vision tower turns the processor's pixel inputs into
one feature row per placeholder position of the prompt (workers/core/images.py holds both).

The features are computed once, when the engine takes the request (vision tower and
projector, through the model's own `get_image_features`), and kept on the sequence.
A step that feeds any placeholder position overwrites that position's text embedding
with its feature row (workers/model/runner.py), so chunked prefill, preemption-by-recompute
and batching with text requests need nothing else.
"""

from __future__ import annotations

import torch

from workers.contract.errors import WorkerError
from workers.core.images import ImageFeatures, ImageInputs


class ImageEncodeError(WorkerError, RuntimeError):
    """The vision tower failed, or its output does not fit the prompt's placeholders
    (a model/processor mismatch): the request fails with a 500, the engine goes on."""

    status = 500
    type = "internal_error"
    code = "engine_error"


def encode_images(model: torch.nn.Module, inputs: ImageInputs, device: torch.device) -> ImageFeatures:
    """Run the vision tower and projector once for all the request's images."""
    dtype = model.dtype
    pixel_inputs = {
        name: value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        for name, value in inputs.pixel_inputs.items()
    }
    try:
        with torch.inference_mode():
            out = model.get_image_features(**pixel_inputs, return_dict=True)
    except Exception as exc:  # noqa: BLE001 - fails this request only, not the engine thread
        raise ImageEncodeError(f"the vision tower failed: {type(exc).__name__}: {exc}") from exc
    features = getattr(out, "pooler_output", out)  # per-image tensors, or one batched tensor
    if isinstance(features, (list, tuple)):
        rows = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    else:
        rows = features.reshape(-1, features.shape[-1])
    if rows.shape[0] != inputs.positions.numel():
        raise ImageEncodeError(
            f"the vision tower gave {rows.shape[0]} feature rows for {inputs.positions.numel()} image placeholder tokens"
        )
    return ImageFeatures(inputs.positions.to("cpu", torch.long), rows.to(dtype))
