"""The exact acceptance rules (docs/exactness.md), as functions of distributions; acceptance counts.

Notation: ``target_probs`` is the target's warped distribution, ``draft_probs`` the draft's.
Every rule returns which draft tokens were accepted and the one extra token sampled from the
target (the correction after a rejection, or the bonus token after a fully accepted path), so each
verification round emits accepted + 1 tokens whose joint law is exactly the warped target's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import zip_longest

import torch

from eval.sampling import SamplingParams, warp
from eval.tree import DraftTree


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)) along the last dim.

    The residual is all zero only when target <= draft everywhere, i.e. target == draft, where a
    rejection has probability zero; the target itself is returned then, guarding against rounding.
    """
    diff = (target_probs - draft_probs).clamp_min(0)
    total = diff.sum(-1, keepdim=True)
    return torch.where(total > 0, diff / total.clamp_min(1e-30), target_probs)


def verify_chain(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over a chain, batched over a leading dimension.

    draft_tokens (B, K); target_probs (B, K+1, V): the target's distribution at the root and after
    each draft token; draft_probs (B, K, V): the distribution draft token k was sampled from, or
    None when the draft tokens were chosen deterministically (a point mass, e.g. n-gram lookup).
    Returns accepted (B,) in 0..K and next_token (B,).

    Token k is accepted with probability min(1, target(x)/draft(x)); at the first rejection the
    next token comes from norm(max(0, target - draft)); if all K survive, from target at K.
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    target_x = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (B, K)
    if draft_probs is None:
        ratio = target_x
    else:
        draft_x = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (B, K)
        ratio = target_x / draft_x.clamp_min(1e-30)
    uniform = torch.rand(batch, k, generator=generator, device=draft_tokens.device)
    accepted = (uniform < ratio).int().cumprod(-1).sum(-1)  # (B,)
    final = target_probs[rows, accepted]  # (B, V)
    rejected = accepted < k
    if bool(rejected.any()):
        at = accepted.clamp(max=k - 1)
        if draft_probs is None:
            point = torch.zeros_like(final).scatter_(-1, draft_tokens[rows, at].unsqueeze(-1), 1.0)
        else:
            point = draft_probs[rows, at]
        final = torch.where(rejected.unsqueeze(-1), residual(final, point), final)
    next_token = torch.multinomial(final, 1, generator=generator).squeeze(-1)
    return accepted, next_token


def verify_chain_greedy(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept while the draft token equals the target's argmax.

    draft_tokens (B, K), target_logits (B, K+1, V) -> accepted (B,), next_token (B,).
    """
    best = target_logits.argmax(-1)  # (B, K+1)
    k = draft_tokens.shape[1]
    accepted = (best[:, :k] == draft_tokens).int().cumprod(-1).sum(-1)
    rows = torch.arange(best.shape[0], device=best.device)
    return accepted, best[rows, accepted]


@dataclass
class TreeOutcome:
    path: list[int]  # accepted node indices, root excluded, in depth order
    next_token: int  # correction or bonus token sampled from the target
    tried_depths: list[int]  # depths at which a child was tested (accepted or not)


def verify_tree(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> TreeOutcome:
    """Walk a token tree from the root, accepting at most one child per level.

    target_logits (n+1, V): the target's logits at the root and at every node. Rules per node:
    children with a recorded draft distribution were sampled i.i.d. from it (accept child c with
    min(1, target(c)/draft(c)); after a rejection target <- norm(max(0, target - draft)) and the
    next child is tried); children without one were chosen deterministically (accept c with
    target(c); after a rejection target(c) <- 0, renormalised). When no child is accepted, or the
    node is a leaf, the next token is sampled from what is left of the target. At temperature 0
    the child equal to the target's argmax is accepted.
    """
    children = tree.children
    depths = tree.depths
    path: list[int] = []
    tried: list[int] = []
    node = 0
    if params.greedy:
        best = target_logits.argmax(-1).tolist()
        while True:
            want = best[node]
            if children[node]:
                tried.append(depths[node] + 1)
            nxt = next((c for c in children[node] if tree.tokens[c - 1] == want), None)
            if nxt is None:
                return TreeOutcome(path, want, tried)
            path.append(nxt)
            node = nxt

    while True:
        target_probs = warp(target_logits[node], params)  # (V,)
        kids = children[node]
        if kids:
            tried.append(depths[node] + 1)
        draft = tree.draft_probs.get(node)
        accepted = None
        for c in kids:
            tok = tree.tokens[c - 1]
            if draft is None:
                chance = target_probs[tok]
            else:
                chance = (target_probs[tok] / draft[tok].clamp_min(1e-30)).clamp(max=1.0)
            if float(torch.rand((), generator=generator, device=chance.device)) < float(chance):
                accepted = c
                break
            if draft is None:
                target_probs = target_probs.clone()
                target_probs[tok] = 0.0
                total = target_probs.sum()
                # all mass was on rejected children: impossible in exact arithmetic
                if float(total) <= 0:
                    target_probs = warp(target_logits[node], params)
                else:
                    target_probs = target_probs / total
            else:
                target_probs = residual(target_probs, draft)
        if accepted is None:
            token = int(torch.multinomial(target_probs, 1, generator=generator))
            return TreeOutcome(path, token, tried)
        path.append(accepted)
        node = accepted


@dataclass
class DepthCounts:
    """Acceptance counted per tree depth (index 0 is depth 1), summed over rounds and prompts.

    ``accepted_per_depth[d-1]``: draft tokens accepted at depth d. ``tried_per_depth[d-1]``:
    rounds whose walk tested a child at depth d, i.e. everything up to and including the first
    rejection. alpha = accepted / tried, overall and per depth. Counts from several generations,
    or from several processes, add up with :meth:`add`.
    """

    accepted_per_depth: list[int] = field(default_factory=list)
    tried_per_depth: list[int] = field(default_factory=list)

    def add_round(self, accepted_depths: Iterable[int], tried_depths: Iterable[int]) -> None:
        """One verification round: the depths of its accepted nodes and of its tested children."""
        for counts, depths in ((self.accepted_per_depth, accepted_depths),
                               (self.tried_per_depth, tried_depths)):
            for d in depths:
                counts.extend([0] * (d - len(counts)))
                counts[d - 1] += 1

    def add(self, other: DepthCounts | None) -> None:
        if other is None:
            return
        for mine, theirs in ((self.accepted_per_depth, other.accepted_per_depth),
                             (self.tried_per_depth, other.tried_per_depth)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def alpha(self) -> float | None:
        tried = sum(self.tried_per_depth)
        return sum(self.accepted_per_depth) / tried if tried else None

    @property
    def alpha_per_depth(self) -> list[float | None]:
        return [a / t if t else None for a, t in
                zip_longest(self.accepted_per_depth, self.tried_per_depth, fillvalue=0)]
