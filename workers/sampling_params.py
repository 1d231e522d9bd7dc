"""What one request asks of the sampler and of the stopping rules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Validated per-request generation settings (validation happens at the API edge).

    temperature == 0 means greedy; top_k <= 0 means no top-k cut; top_p == 1 means no
    nucleus cut. `stop` strings are matched on text by the request processor; token-level
    rules (EOS, stop_token_ids, max_tokens) are applied by the engine.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
