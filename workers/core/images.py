"""A request's images as the engine carries them: the processor's pixel inputs, then the
vision features they become, pinned to the prompt positions of their placeholders
(workers/model/multimodal.py computes the features)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageInputs:
    """Prepared on the worker's event loop (vision_prompts.py) for one request."""

    pixel_inputs: dict[str, torch.Tensor]  # the processor's image outputs: pixel_values, image_sizes, ...
    positions: torch.Tensor  # [K] prompt positions of the image placeholder tokens, ascending
    salt: bytes  # a hash of the images: Sequence.cache_salt


@dataclass(frozen=True)
class ImageFeatures:
    """One embedding row per placeholder position of a sequence's prompt."""

    positions: torch.Tensor  # [K] long, ascending, on the CPU
    embeds: torch.Tensor  # [K, hidden], on the model's device, in its dtype

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, embeddings) of the placeholders in positions [start, end)."""
        lo = int(torch.searchsorted(self.positions, start))
        hi = int(torch.searchsorted(self.positions, end))
        return self.positions[lo:hi], self.embeds[lo:hi]
