"""Sampling parameters and the warp (temperature, top-k, top-p) applied to target and draft alike.

The exactness guarantee of every acceptance rule is with respect to the *warped* target
distribution, so target and draft go through this one function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits (..., vocab) -> probabilities (..., vocab) in float32, after temperature, top-k, top-p.

    Same order as transformers' warpers (temperature, then top-k, then top-p). Top-p keeps the
    smallest set of most probable tokens whose mass reaches top_p (at least one token).
    """
    if params.greedy:
        raise ValueError("warp() is for sampling; at temperature 0 the rules compare argmaxes")
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        # mass strictly before each token; a token is dropped once that mass already reaches top_p
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a (vocab,) probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator))
