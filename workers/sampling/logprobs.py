"""Log-probabilities of chosen tokens and each row's top k, for a batch of logits rows."""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, top_k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-probabilities of `targets` under the raw model distribution, plus each row's top k."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if top_k <= 0:
        return chosen, [[] for _ in chosen]
    values, ids = logprobs.topk(min(top_k, logprobs.shape[1]), dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return chosen, tops

