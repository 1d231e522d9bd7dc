"""Batched sampling: per-row temperature, top-k, top-p and seeds as tensor operations.

Sampling uses the exponential-race form of the Gumbel-max trick: argmax(p / q) with
q ~ Exp(1) draws from p. Unseeded rows draw q from the global generator in one call;
a seeded row draws its own q from its private generator, so its tokens do not depend
on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.sequence import Sequence


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [S], greedy rows hold 1.0 (ignored)
    top_ks: torch.Tensor  # [S] long, vocab size where off
    top_ps: torch.Tensor  # [S]
    greedy: torch.Tensor  # [S] bool
    generators: list[tuple[int, torch.Generator]]  # seeded rows only
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> "SamplingTensors":
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_ps = [p.top_p for p in params]
        generators = [(i, s.generator) for i, s in enumerate(seqs) if s.generator is not None and not greedy[i]]
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.long, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=generators,
            all_greedy=all(greedy),
            needs_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy) if not g),
            needs_top_p=any(p < 1.0 for p, g in zip(top_ps, greedy) if not g),
        )


class Sampler:
    def __call__(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """logits [S, V] float32 -> sampled token ids [S]."""
        greedy_tokens = logits.argmax(dim=-1)
        if st.all_greedy:
            return greedy_tokens
        logits = logits / st.temperatures.unsqueeze(1)
        if st.needs_top_k or st.needs_top_p:
            logits = self._apply_top_k_top_p(logits, st)
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs).exponential_()
        for row, generator in st.generators:
            q[row].exponential_(generator=generator)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(st.greedy, greedy_tokens, sampled)

    @staticmethod
    def _apply_top_k_top_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        cut = ranks >= st.top_ks.unsqueeze(1)
        if st.needs_top_p:
            probs = torch.softmax(sorted_logits.masked_fill(cut, float("-inf")), dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            cut |= mass_before >= st.top_ps.unsqueeze(1)
        cut[:, 0] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
