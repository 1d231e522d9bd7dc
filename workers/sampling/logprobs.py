"""Log-probabilities: of the sampled tokens (with each row's top k), and of prompt tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.core.batch import PromptLogitRows
    from workers.core.sequence import Sequence

TopList = list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> tuple[list[float], list[TopList]]:
    """Log-probabilities of `targets` under the raw model distribution, plus each row's top k."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if top_k <= 0:
        return chosen, [[] for _ in chosen]
    values, ids = logprobs.topk(min(top_k, logprobs.shape[1]), dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return chosen, tops


def sampled_logprobs(seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor) -> dict[int, tuple[float, TopList]]:
    """By row: the sampled token's log-probability and the top ones, for the sequences that ask."""
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not wanted:
        return {}
    top_k = max(seqs[i].params.logprobs for i in wanted)
    index = torch.tensor(wanted, device=logits.device)
    chosen, tops = token_logprobs(logits[index], tokens[index], top_k)
    return {
        row: (lp, top[: seqs[row].params.logprobs]) for row, lp, top in zip(wanted, chosen, tops)
    }


def score_prompts(logits: torch.Tensor, prompt_rows: list[PromptLogitRows]) -> None:
    """Append to each chunk's sequence the log-probabilities of the prompt tokens its rows predict."""
    offset = 0
    for rows in prompt_rows:
        seq = rows.seq
        part = logits[offset : offset + rows.count]
        offset += rows.count
        first = rows.first_position
        targets = torch.tensor(seq.token_ids[first + 1 : first + 1 + rows.count], device=part.device)
        chosen, tops = token_logprobs(part, targets, seq.params.prompt_logprobs)
        seq.prompt_logprobs.extend(zip(targets.tolist(), chosen, tops))
