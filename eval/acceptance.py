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

from draftsmith.eval.host import to_host
from draftsmith.eval.sampling import SamplingParams, warp
from draftsmith.eval.tree import DraftTree


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
    Returns accepted (B,) in 0..K and next_token (B,), on the device: nothing is read on the host.

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
    if k:
        # the residual at the first rejection, computed for every row (a rejected row uses it)
        at = accepted.clamp(max=k - 1)
        if draft_probs is None:
            point = torch.zeros_like(final).scatter_(-1, draft_tokens[rows, at].unsqueeze(-1), 1.0)
        else:
            point = draft_probs[rows, at]
        final = torch.where((accepted < k).unsqueeze(-1), residual(final, point), final)
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


class TreeOutcome:
    """A verification round's result: ``path`` (accepted node indices, root excluded, in depth
    order), ``next_token`` (the correction or bonus token sampled from the target) and
    ``tried_depths`` (depths at which a child was tested, accepted or not).

    Built from host values (``TreeOutcome(path, next_token, tried_depths)``), or by the device
    rules from one packed tensor, ``[L, next, leaf_has_children, path nodes (bound), path tokens
    (bound)]``, read on the host once (:meth:`read`), on first use of any host field.
    """

    def __init__(self, path=None, next_token=None, tried_depths=None, *,
                 packed: torch.Tensor | None = None, bound: int = 0):
        self.packed, self.bound = packed, bound
        self.path_tokens: list[int] | None = None
        if packed is None:
            self._path, self._next, self._tried = list(path), int(next_token), list(tried_depths)
        else:
            self._path = None

    def read(self) -> None:
        """The one host read of a device outcome."""
        if self._path is None:
            values = to_host(self.packed)
            length, nxt, more = values[0], values[1], values[2]
            nodes = values[3: 3 + self.bound]
            self._path, self._next = nodes[:length], nxt
            self.path_tokens = values[3 + self.bound: 3 + self.bound + length]
            self._tried = list(range(1, length + 1)) + ([length + 1] if more else [])

    @property
    def path(self) -> list[int]:
        self.read()
        return self._path

    @property
    def next_token(self) -> int:
        self.read()
        return self._next

    @property
    def tried_depths(self) -> list[int]:
        self.read()
        return self._tried

    def keep_index(self, device) -> torch.Tensor:
        """(1 + len(path),) offsets of the root and the path in the verified block, on
        ``device`` (sliced from the packed tensor: no copy from the host)."""
        self.read()
        if self.packed is not None:
            zero = torch.zeros(1, dtype=torch.long, device=self.packed.device)
            return torch.cat([zero, self.packed[3: 3 + len(self._path)]])
        return torch.tensor([0, *self._path], dtype=torch.long, device=device)

    def next_token_tensor(self, device) -> torch.Tensor:
        """(1,) the next token on ``device``."""
        if self.packed is not None:
            return self.packed[1:2]
        return torch.tensor([self._next], dtype=torch.long, device=device)


def _pack(length, nxt, more, nodes, tokens) -> torch.Tensor:
    return torch.cat([length.view(1).long(), nxt.view(1).long(), more.view(1).long(),
                      nodes.long(), tokens.long()])


def chain_outcome(accepted: torch.Tensor, next_token: torch.Tensor,
                  tokens: torch.Tensor) -> TreeOutcome:
    """A chain's (accepted (), next token ()) on the device as a :class:`TreeOutcome`."""
    k = tokens.shape[0]
    nodes = torch.arange(1, k + 1, device=tokens.device)
    return TreeOutcome(packed=_pack(accepted, next_token, accepted < k, nodes, tokens), bound=k)


def _walk(dev, choice: torch.Tensor, bound: int) -> torch.Tensor:
    """The path a walk takes when at every node the child whose token is ``choice[node]`` (the
    first such child) is accepted -> packed outcome. choice (n + 1,): the target's argmax at
    every node (greedy), or one token sampled from it at every node (point-mass children)."""
    tokens, parents, ancestors = dev.tokens, dev.parents, dev.ancestors
    n = tokens.shape[0]
    index = torch.arange(n, device=tokens.device)
    match = tokens == choice[parents]  # (n,) the child a walk through its parent would take
    earlier = (parents[:, None] == parents[None, :]) & (index[None, :] < index[:, None])
    first = match & ~(earlier & match[None, :]).any(-1)  # no earlier sibling matched
    below = ancestors[1:, 1:]  # (n, n): node i (row) and its ancestors but the root (columns)
    on_path = ~(below & ~first[None, :]).any(-1)
    length = on_path.sum()
    slot = torch.where(on_path, dev.depths[1:] - 1, bound)  # non-path nodes to a spare slot
    nodes = torch.zeros(bound + 1, dtype=torch.long, device=tokens.device)
    nodes = nodes.scatter(0, slot, index + 1)[:bound]
    path_tokens = torch.zeros(bound + 1, dtype=torch.long, device=tokens.device)
    path_tokens = path_tokens.scatter(0, slot, tokens)[:bound]
    if bound:
        leaf = torch.where(length > 0, nodes[(length - 1).clamp_min(0)], 0)
    else:
        leaf = torch.zeros((), dtype=torch.long, device=tokens.device)
    more = (parents == leaf).any()
    return _pack(length, choice[leaf], more, nodes, path_tokens)


def _sampled_walk(tree, dev, target_logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None, bound: int) -> torch.Tensor:
    """The sampling rules, one tree level per step on the device (see :func:`verify_tree`)."""
    tokens, parents = dev.tokens, dev.parents
    n, device = tokens.shape[0], tokens.device
    if n == 0:  # nothing drafted: the target's own sample
        token = torch.multinomial(warp(target_logits[0], params), 1, generator=generator)[0]
        none = torch.zeros((), dtype=torch.long, device=device)
        return _pack(none, token, none, tokens[:0], tokens[:0])
    is_child = parents[None, :] == torch.arange(n + 1, device=device)[:, None]  # (n+1, n)
    iid = bool(tree.draft_probs)  # a host fact: which nodes carry a draft distribution
    if iid:
        vocab = target_logits.shape[-1]
        rows = torch.zeros(n + 1, vocab, dtype=torch.float32, device=device)
        has_draft = torch.zeros(n + 1, dtype=torch.bool, device=device)
        for node, probs in tree.draft_probs.items():
            rows[node] = probs.to(device=device, dtype=torch.float32)
            has_draft[node] = True
        # children of every node in trial order: (n + 1, widest) node numbers, -1 beyond
        width = max(len(k) for k in tree.children) if tree.form_on_host else n
        rank = torch.where(is_child, is_child.long().cumsum(-1) - 1, width).clamp_max(width)
        numbers = (torch.arange(n, device=device) + 1).expand(n + 1, n)
        table = torch.full((n + 1, width + 1), -1, dtype=torch.long, device=device)
        table = table.scatter(1, rank, numbers)[:, :width]
    node = torch.zeros((), dtype=torch.long, device=device)
    alive = torch.ones((), dtype=torch.bool, device=device)
    length = torch.zeros((), dtype=torch.long, device=device)
    nxt = torch.zeros((), dtype=torch.long, device=device)
    more = torch.zeros((), dtype=torch.bool, device=device)
    nodes = torch.zeros(bound, dtype=torch.long, device=device)
    path_tokens = torch.zeros(bound, dtype=torch.long, device=device)
    positions = torch.arange(bound, device=device)
    for _ in range(bound + 1):
        target_probs = warp(target_logits[node], params)  # (V,)
        kids = is_child[node]  # (n,)
        if iid:
            draft, sampled_here = rows[node], has_draft[node]
            chosen = torch.full((), -1, dtype=torch.long, device=device)
            for j in range(table.shape[1]):
                child = table[node, j]
                valid = (child > 0) & (chosen < 0)
                token = tokens[(child - 1).clamp_min(0)]
                here = target_probs[token]
                ratio = torch.where(sampled_here,
                                    (here / draft[token].clamp_min(1e-30)).clamp(max=1.0), here)
                take = valid & (torch.rand((), generator=generator, device=device) < ratio)
                chosen = torch.where(take, child, chosen)
                zeroed = target_probs.scatter(0, token.view(1), 0.0)
                total = zeroed.sum()
                # a point-mass child rejected: its token's mass goes (all mass rejected cannot
                # happen in exact arithmetic; the target is taken whole again then)
                dropped = torch.where(total > 0, zeroed / total.clamp_min(1e-30),
                                      warp(target_logits[node], params))
                after = torch.where(sampled_here, residual(target_probs, draft), dropped)
                target_probs = torch.where(valid & ~take, after, target_probs)
            found = chosen > 0
            child = chosen.clamp_min(1)
            final = torch.multinomial(target_probs, 1, generator=generator)[0]
        else:
            final = torch.multinomial(target_probs, 1, generator=generator)[0]
            hit = kids & (tokens == final)
            found = hit.any()
            child = hit.int().argmax() + 1
        step = alive & found
        ended = alive & ~found
        at = step & (positions == length)
        nodes = torch.where(at, child, nodes)
        path_tokens = torch.where(at, tokens[child - 1], path_tokens)
        length = length + step.long()
        nxt = torch.where(ended, final, nxt)
        more = torch.where(ended, kids.any(), more)
        alive = alive & found
        node = torch.where(step, child, node)
    return _pack(length, nxt, more, nodes, path_tokens)


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

    Computed on the target's device and read on the host once (:class:`TreeOutcome`). Greedy,
    and sampling where every child is deterministic, take one token per node (the argmax, or one
    sample of the target there: trying deterministic children one by one with the rule above
    accepts the first child whose token the target's sample is, and otherwise emits that
    sample, so the two are the same law) and follow the matching children from the root, all
    nodes at once. i.i.d. children are tried one by one, a tree level per step.
    """
    bound = tree.depth_bound if len(tree) else 0
    dev = tree.device(target_logits.device)
    if params.greedy:
        choice = target_logits.argmax(-1)
        return TreeOutcome(packed=_walk(dev, choice, bound), bound=bound)
    packed = _sampled_walk(tree, dev, target_logits, params, generator, bound)
    return TreeOutcome(packed=packed, bound=bound)


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
