"""Beam search bookkeeping for one request: which beams continue, which are done.

Each step every live beam proposes its most likely next tokens; the `width` best
continuations by cumulative log-probability go on (a beam chosen twice is forked, a
beam not chosen is dropped), and a continuation that ends in EOS (or a stop token)
becomes a finished hypothesis scored by cumulative log-probability / length **
length_penalty. The request ends when `width` hypotheses are finished and no live
beam can still beat the worst of them, or when the live beams reach max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Hypothesis:
    token_ids: list[int]  # output tokens, without the ending EOS
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" or "length"


@dataclass(frozen=True)
class Continuation:
    beam: int  # index into the live beams given to `step`
    token_id: int
    cum_logprob: float


@dataclass
class BeamGroup:
    width: int
    num_returned: int
    length_penalty: float
    end_token_ids: frozenset[int]
    finished: list[Hypothesis] = field(default_factory=list)

    def score(self, cum_logprob: float, length: int) -> float:
        return cum_logprob / max(1, length) ** self.length_penalty

    def step(
        self, logprobs: torch.Tensor, cum_logprobs: list[float], outputs: list[list[int]]
    ) -> list[Continuation]:
        """logprobs [B, V] of the live beams -> the continuations to keep (at most width)."""
        k = min(2 * self.width, logprobs.shape[1])
        top_values, top_ids = logprobs.topk(k, dim=-1)
        totals = top_values + torch.tensor(cum_logprobs, dtype=top_values.dtype).unsqueeze(1)
        order = totals.flatten().argsort(descending=True).tolist()
        keep: list[Continuation] = []
        for flat in order:
            beam, rank = divmod(flat, k)
            token = int(top_ids[beam, rank])
            total = float(totals[beam, rank])
            if token in self.end_token_ids:
                length = len(outputs[beam]) + 1
                self.finished.append(Hypothesis(list(outputs[beam]), total, self.score(total, length), "stop"))
                continue
            keep.append(Continuation(beam, token, total))
            if len(keep) == self.width:
                break
        return keep

    def is_done(self, live: list[tuple[float, int]]) -> bool:
        """`live`: (cum_logprob, length) of each live beam after this step."""
        if not live:
            return True
        if len(self.finished) < self.width:
            return False
        worst_kept = sorted(h.score for h in self.finished)[-self.width]
        return max(self.score(c, n) for c, n in live) <= worst_kept

    def finish_live(self, live: list[tuple[list[int], float]], reason: str) -> None:
        for tokens, cum in live:
            self.finished.append(Hypothesis(list(tokens), cum, self.score(cum, len(tokens)), reason))

    def best(self) -> list[Hypothesis]:
        return sorted(self.finished, key=lambda h: h.score, reverse=True)[: self.num_returned]
