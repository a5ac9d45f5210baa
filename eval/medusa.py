"""Medusa in the evaluator: the static token tree, its node budget, and the proposers.

Each round the heads read ``h_t``, the target's final-normed last hidden state at the last
accepted position (the one whose LM-head output was the root token); head d's top-k guesses fill
depth d of a static tree of rank paths (the Medusa repo's ``medusa_choices``). Children are chosen
deterministically (top-k, likeliest first) and carry no draft distribution, so the engine verifies
them with the exact point-mass rule at any temperature, and greedily at temperature 0.

The tree is built from the heads' per-rank accuracies on held-out data with the Medusa paper's
greedy construction (:func:`build_medusa_tree`): a node's value is the product of the accuracies
of its ranks along its path (the chance that the whole path is right, heads taken independently),
and nodes are added best first, a node only after its parent and its next-likelier sibling.
``1 + sum(values)`` is the expected tau. The node budget comes from what verification costs on
this machine (:func:`measure_verify_cost`, :func:`choose_node_budget`): the budget that maximises
expected tau / (cost of verifying 1 + n tokens + cost of the heads).

``TypicalMedusaProposer`` swaps the exact rule for Medusa's typical acceptance (lossy, flagged
``exact = False``, named ``medusa-typical``). In the benchmark: ``--method medusa:<artifact>`` and
``--method medusa:typical:<artifact>``.
"""

from __future__ import annotations

import heapq
import math
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from eval.acceptance import TreeOutcome, verify_tree
from eval.kv import crop, new_cache
from eval.proposers import Proposer
from eval.sampling import SamplingParams, warp
from eval.tree import DraftTree
from heads.medusa import MedusaArtifact, MedusaHeads, RankPath, check_tree
from heads.public_heads import load_medusa_heads
from heads.target import Target

TYPICAL_PREFIX = "typical:"


# ---------------------------------------------------------------------------------------------
# tree construction


def _accuracy_table(rank_accuracies) -> list[list[float]]:
    """Validate per-rank accuracies (K, R) -> nested lists of floats."""
    try:
        table = torch.as_tensor(rank_accuracies, dtype=torch.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"rank accuracies must be a rectangular (num_heads, topk) table of "
                         f"numbers: {err}") from err
    if table.dim() != 2 or table.shape[0] < 1 or table.shape[1] < 1:
        raise ValueError(f"rank accuracies must be a (num_heads, topk) table with num_heads >= 1, "
                         f"got shape {tuple(table.shape)}")
    if not bool(torch.isfinite(table).all()) or bool((table < 0).any()) or bool((table > 1).any()):
        raise ValueError("rank accuracies must be probabilities in [0, 1]")
    sums = table.sum(-1)
    if bool((sums > 1 + 1e-6).any()):
        raise ValueError(
            f"each head's rank accuracies must sum to at most 1 (got {sums.tolist()}): these look "
            "cumulative (top-k); pass per-rank ones, heads.medusa.rank_accuracy(hits, totals)"
        )
    return table.tolist()


def grow_medusa_tree(rank_accuracies, node_budget: int,
                     max_depth: int | None = None) -> list[tuple[RankPath, float]]:
    """The greedy construction, in the order nodes are added: [(path, value)].

    rank_accuracies[d][r] is the chance that head d+1's rank-r guess is the right token. The
    candidates are the first child (rank 0) of every node in the tree and the next sibling of
    every node; each step adds the candidate with the highest value (ties: smaller path first).
    Every prefix of the returned list is the greedy tree of that size.
    """
    acc = _accuracy_table(rank_accuracies)
    if not isinstance(node_budget, int) or node_budget < 1:
        raise ValueError(f"the node budget must be an integer >= 1, got {node_budget!r}")
    depth_limit = len(acc) if max_depth is None else min(max_depth, len(acc))
    if depth_limit < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    ranks = len(acc[0])

    def value(path: RankPath) -> float:
        v = 1.0
        for d, r in enumerate(path):
            v *= acc[d][r]
        return v

    heap = [(-value((0,)), (0,))]
    grown: list[tuple[RankPath, float]] = []
    while heap and len(grown) < node_budget:
        neg, path = heapq.heappop(heap)
        grown.append((path, -neg))
        if path[-1] + 1 < ranks:
            sibling = path[:-1] + (path[-1] + 1,)
            heapq.heappush(heap, (-value(sibling), sibling))
        if len(path) < depth_limit:
            child = path + (0,)
            heapq.heappush(heap, (-value(child), child))
    return grown


def build_medusa_tree(rank_accuracies, node_budget: int,
                      max_depth: int | None = None) -> list[RankPath]:
    """The static Medusa tree of at most ``node_budget`` nodes, sorted (depth, ranks)."""
    grown = grow_medusa_tree(rank_accuracies, node_budget, max_depth)
    return check_tree([p for p, _ in grown], len(_accuracy_table(rank_accuracies)))


def expected_tau(tree, rank_accuracies) -> float:
    """1 + the expected accepted nodes per round: what tau should be if heads were independent."""
    acc = _accuracy_table(rank_accuracies)
    total = 1.0
    for path in check_tree(tree, len(acc)):
        if max(path) >= len(acc[0]):
            raise ValueError(f"tree path {list(path)} uses a rank beyond the measured top-"
                             f"{len(acc[0])}")
        v = 1.0
        for d, r in enumerate(path):
            v *= acc[d][r]
        total += v
    return total


# ---------------------------------------------------------------------------------------------
# node budget from the measured cost of verification


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_verify_cost(target: Target, sizes=(1, 2, 4, 8, 16, 32, 64), context: int = 128,
                        repeats: int = 5, seed: int = 0) -> dict[int, float]:
    """Median seconds of one verification forward over n tokens (root + n-1 tree nodes).

    The forward is the engine's: ``context`` tokens already cached, a 4-D tree mask and per-node
    positions for n > 1, the final hidden state collected, the cache cropped back afterwards.
    """
    sizes = sorted({int(n) for n in sizes})
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes must be token counts >= 1, got {sizes}")
    if context < 1 or context + sizes[-1] > target.max_context:
        raise ValueError(f"context {context} + {sizes[-1]} tokens must fit the target's context "
                         f"of {target.max_context}")
    model, device, dtype = target.model, target.device, target.dtype
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, context + sizes[-1]), generator=gen)
    cache = new_cache(model)
    model(input_ids=ids[:, :context].to(device), cache=cache, use_cache=True, logits_to_keep=1)
    calls = {}
    for n in sizes:
        kwargs = {}
        if n > 1:
            # a binary tree under the root: the mask's shape sets the cost, not its pattern
            tree = DraftTree([0] * (n - 1), [0] + [1 + i // 2 for i in range(n - 2)])
            mask = torch.full((1, 1, n, context + n), torch.finfo(dtype).min, dtype=dtype)
            mask[..., :context] = 0
            mask[0, 0, :, context:].masked_fill_(tree.ancestor_mask(), 0)
            kwargs["attention_mask"] = mask.to(device)
            kwargs["position_ids"] = torch.tensor([[context + d for d in tree.depths]],
                                                  device=device)
        calls[n] = (ids[:, context:context + n].to(device), kwargs)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    # sizes interleaved within each repeat, so drifting machine load hits them alike; the first
    # repeat pays for warm-up and is dropped
    for _ in range(repeats + 1):
        for n in sizes:
            block, kwargs = calls[n]
            _sync(device)
            start = time.perf_counter()
            out = model(input_ids=block, cache=cache, use_cache=True, output_hidden_states=True,
                        **kwargs)
            out.hidden_states[target.num_layers].sum().item()
            _sync(device)
            times[n].append(time.perf_counter() - start)
            crop(cache, context)
    return {n: statistics.median(t[1:]) for n, t in times.items()}


@torch.no_grad()
def measure_head_cost(heads: MedusaHeads, depth: int | None = None, topk: int = 10,
                      repeats: int = 20) -> float:
    """Median seconds for the heads' proposal of one round: ``depth`` heads on h_t, then top-k."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    depth = heads.num_heads if depth is None else min(depth, heads.num_heads)
    param = next(heads.parameters(), None)
    weight = heads.lm_head_weight(0)
    device = param.device if param is not None else weight.device
    h = torch.randn(heads.config.hidden_size, device=device,
                    dtype=param.dtype if param is not None else weight.dtype)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        heads(h, num=depth).topk(min(topk, heads.config.vocab_size), dim=-1).indices.cpu()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _interpolate(costs: dict[int, float], n: int) -> float:
    """Cost of n tokens, linear between the measured sizes."""
    sizes = sorted(costs)
    if n in costs:
        return costs[n]
    if not sizes[0] <= n <= sizes[-1]:
        raise ValueError(f"no cost measured around {n} tokens (measured {sizes})")
    hi = next(s for s in sizes if s > n)
    lo = max(s for s in sizes if s < n)
    w = (n - lo) / (hi - lo)
    return costs[lo] * (1 - w) + costs[hi] * w


@dataclass
class BudgetChoice:
    node_budget: int
    tree: list[RankPath]
    expected_tau: float
    predicted_speedup: float  # expected tokens/s over plain decoding under the cost model
    table: list[dict] = field(default_factory=list)  # per budget: nodes, expected_tau, cost, speedup


def choose_node_budget(rank_accuracies, verify_seconds: dict[int, float],
                       head_seconds: float = 0.0, max_nodes: int | None = None) -> BudgetChoice:
    """The node budget n maximising expected_tau(n) / (cost(1 + n) + head cost), relative to plain.

    ``verify_seconds[m]`` is the cost of verifying m tokens (:func:`measure_verify_cost`; needs
    m = 1, the plain decoding step); costs between measured sizes are interpolated, so n stops at
    the largest measured size minus one (or ``max_nodes``). A ``predicted_speedup`` below 1 says
    that on this machine Medusa with these heads is not expected to beat plain decoding at all.
    """
    if 1 not in verify_seconds:
        raise ValueError("verify_seconds needs the cost of 1 token (plain decoding) as a baseline")
    limit = max(verify_seconds) - 1
    if max_nodes is not None:
        limit = min(limit, max_nodes)
    if limit < 1:
        raise ValueError(f"measure verification of at least 2 tokens (got {sorted(verify_seconds)})")
    grown = grow_medusa_tree(rank_accuracies, limit)
    plain = verify_seconds[1]
    table, tau = [], 1.0
    for n, (_, value) in enumerate(grown, start=1):
        tau += value
        cost = _interpolate(verify_seconds, n + 1) + head_seconds
        table.append({"nodes": n, "expected_tau": tau, "cost_ratio": cost / plain,
                      "predicted_speedup": tau * plain / cost})
    best = max(table, key=lambda row: (row["predicted_speedup"], -row["nodes"]))
    n = best["nodes"]
    tree = check_tree([p for p, _ in grown[:n]], len(_accuracy_table(rank_accuracies)))
    return BudgetChoice(n, tree, best["expected_tau"], best["predicted_speedup"], table)


def plan_medusa_tree(target: Target, heads: MedusaHeads, rank_accuracies,
                     sizes=(1, 2, 4, 8, 16, 32, 64), context: int = 128,
                     repeats: int = 5) -> tuple[list[RankPath], dict]:
    """Measure costs here, choose the budget, build the tree -> (tree, tree_info for save_medusa)."""
    acc = _accuracy_table(rank_accuracies)
    if len(acc) > heads.num_heads:
        raise ValueError(f"accuracies for {len(acc)} heads but the heads have {heads.num_heads}")
    verify = measure_verify_cost(target, sizes, context=context, repeats=repeats)
    head_cost = measure_head_cost(heads, depth=len(acc), topk=len(acc[0]))
    choice = choose_node_budget(acc, verify, head_cost)
    info = {
        "rank_accuracies": acc,
        "node_budget": choice.node_budget,
        "expected_tau": choice.expected_tau,
        "predicted_speedup": choice.predicted_speedup,
        "verify_seconds": {str(k): v for k, v in verify.items()},
        "head_seconds": head_cost,
        "measured_on": f"{target.device.type} {str(target.dtype).replace('torch.', '')}",
    }
    return choice.tree, info


# ---------------------------------------------------------------------------------------------
# proposers


class MedusaTree:
    """A static tree's structure, turned into a ``DraftTree`` from the heads' top-k each round."""

    def __init__(self, paths, num_heads: int):
        self.paths = check_tree(paths, num_heads)
        index = {p: i for i, p in enumerate(self.paths, start=1)}
        self.parents = [index[p[:-1]] if len(p) > 1 else 0 for p in self.paths]
        self.head_of = torch.tensor([len(p) - 1 for p in self.paths])  # (n,) 0-based head
        self.rank_of = torch.tensor([p[-1] for p in self.paths])  # (n,)
        self.topk = max(max(p) for p in self.paths) + 1
        self.max_depth = max(len(p) for p in self.paths)
        # nodes sorted by depth: the nodes no deeper than d are the first within_depth[d]
        self.within_depth = [sum(len(p) <= d for p in self.paths) for d in range(self.max_depth + 1)]

    def __len__(self) -> int:
        return len(self.paths)

    def draft_tree(self, top_tokens: torch.Tensor, max_depth: int) -> DraftTree:
        """top_tokens (depth, topk): head d's guesses by rank -> deterministic-children tree."""
        depth = min(max_depth, self.max_depth, top_tokens.shape[0])
        n = self.within_depth[depth]
        tokens = top_tokens[self.head_of[:n], self.rank_of[:n]].tolist()
        return DraftTree(tokens, self.parents[:n])


def _arg(args, name: str):
    return None if args is None else getattr(args, name, None)


def tree_for(artifact: MedusaArtifact, node_budget: int | None = None,
             max_depth: int | None = None, max_topk: int | None = None) -> list[RankPath]:
    """The artifact's tree, or one rebuilt from its stored accuracies for another budget / shape."""
    for name, v in (("node budget", node_budget), ("tree depth", max_depth), ("tree topk", max_topk)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"the Medusa {name} must be an integer >= 1, got {v!r}")
    if node_budget is None and max_depth is None and max_topk is None:
        return artifact.tree
    acc = artifact.tree_info.get("rank_accuracies")
    if acc is None:
        if node_budget is not None:
            raise ValueError(
                "this Medusa artifact stores no held-out rank accuracies, so its tree cannot be "
                "rebuilt for another node budget: drop --tree-nodes, or save the artifact with "
                "tree_info={'rank_accuracies': ...} (see eval.medusa.plan_medusa_tree)"
            )
        kept = [p for p in artifact.tree
                if (max_depth is None or len(p) <= max_depth)
                and (max_topk is None or max(p) < max_topk)]
        if not kept:
            raise ValueError(f"no path of the stored tree fits depth {max_depth} / topk {max_topk}")
        return check_tree(kept, artifact.heads.num_heads)
    acc = _accuracy_table(acc)[: artifact.heads.num_heads]
    if max_topk is not None:
        acc = [row[:max_topk] for row in acc]
    budget = node_budget if node_budget is not None else len(artifact.tree)
    return build_medusa_tree(acc, budget, max_depth)


class MedusaProposer(Proposer):
    """Medusa heads -> static tree -> exact verification (deterministic-children rule)."""

    name = "medusa"

    def __init__(self, target: Target, heads: MedusaHeads, tree, name: str | None = None):
        cfg = heads.config
        if (cfg.hidden_size, cfg.vocab_size) != (target.hidden_size, target.vocab_size):
            raise ValueError(
                f"Medusa heads of hidden {cfg.hidden_size} / vocab {cfg.vocab_size} do not fit "
                f"target {target.name!r} (hidden {target.hidden_size}, vocab {target.vocab_size})"
            )
        self.heads = heads.eval()
        self.tree = MedusaTree(tree, heads.num_heads)
        if self.tree.topk > cfg.vocab_size:
            raise ValueError(f"the tree uses rank {self.tree.topk - 1} but the vocabulary has "
                             f"{cfg.vocab_size} tokens")
        # transformers' numbering: index L is the final-normed last layer, what the LM head reads
        self.hidden_layers = (target.num_layers,)
        if name is not None:
            self.name = name
        self.h: torch.Tensor | None = None

    @classmethod
    def from_artifact(cls, path: str | os.PathLike, target: Target, args=None) -> MedusaProposer:
        """Load ``path`` for ``target``; ``typical:<path>`` gives the lossy typical-acceptance variant.

        ``args`` (the benchmark's namespace, may be None): ``tree_nodes`` rebuilds the tree for
        that node budget from the artifact's stored accuracies, ``tree_depth`` / ``tree_topk`` cap
        its depth and ranks; ``posterior_threshold`` / ``posterior_alpha`` tune typical acceptance.
        """
        spec = str(path)
        if spec.startswith(TYPICAL_PREFIX):
            spec, cls = spec[len(TYPICAL_PREFIX):], TypicalMedusaProposer
        artifact = load_medusa_heads(spec, target)
        tree = tree_for(artifact, _arg(args, "tree_nodes"), _arg(args, "tree_depth"),
                        _arg(args, "tree_topk"))
        if cls is TypicalMedusaProposer:
            kwargs = {k: _arg(args, k) for k in ("posterior_threshold", "posterior_alpha")
                      if _arg(args, k) is not None}
            return cls(target, artifact.heads, tree, **kwargs)
        return cls(target, artifact.heads, tree)

    def start(self, prompt_ids, hidden, params: SamplingParams, generator) -> None:
        super().start(prompt_ids, hidden, params, generator)
        self.h = hidden[0][0, -1]  # (hidden,) h_t of the last prompt token

    @torch.no_grad()
    def propose(self, seq: list[int], max_depth: int) -> DraftTree | None:
        depth = min(max_depth, self.tree.max_depth)
        if depth < 1 or self.h is None:
            return None
        logits = self.heads(self.h, num=depth)  # (depth, vocab)
        top = logits.topk(self.tree.topk, dim=-1).indices.cpu()  # (depth, topk)
        return self.tree.draft_tree(top, depth)

    def observe(self, seq, tree, path, hidden) -> None:
        self.h = hidden[0][0, -1]  # h_t at the last accepted node (the old root if none)


def typical_acceptance(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator | None = None,
                       posterior_threshold: float = 0.09,
                       posterior_alpha: float = 0.3) -> TreeOutcome:
    """Medusa's typical acceptance over a tree (lossy: the output is NOT the target's distribution).

    target_logits (n+1, V). A node is plausible when the target gives its token more than
    min(posterior_threshold, posterior_alpha * exp(-entropy)) at its parent; the deepest node
    whose whole path is plausible is accepted (ties: the highest path likelihood), and the next
    token is sampled from the target at that node after dropping tokens under the same threshold.
    At temperature 0 this is greedy verification, as in the Medusa repo.
    """
    if params.greedy:
        return verify_tree(tree, target_logits, params, generator)
    probs = warp(target_logits, params)  # (n+1, V)
    entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)  # (n+1,)
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold),
                              posterior_alpha * torch.exp(-entropy))  # (n+1,)
    parents = torch.tensor(tree.parents, dtype=torch.long, device=probs.device)
    tokens = torch.tensor(tree.tokens, dtype=torch.long, device=probs.device)
    p_node = probs[parents, tokens].tolist() if len(tree) else []
    ok = (probs[parents, tokens] > threshold[parents]).tolist() if len(tree) else []
    depths = tree.depths
    alive = [True] + [False] * len(tree)
    loglik = [0.0] * (len(tree) + 1)
    best, best_key = 0, (0, 0.0)
    for i, parent in enumerate(tree.parents, start=1):
        alive[i] = alive[parent] and ok[i - 1]
        if not alive[i]:
            continue
        loglik[i] = loglik[parent] + math.log(p_node[i - 1])
        key = (depths[i], loglik[i])
        if key > best_key:
            best, best_key = i, key
    path = tree.path_to(best)
    children = tree.children
    tried = [depths[node] + 1 for node in [0, *path] if children[node]]
    final = probs[best]
    keep = final >= threshold[best]
    keep[final.argmax()] = True
    final = torch.where(keep, final, torch.zeros_like(final))
    token = int(torch.multinomial(final / final.sum(), 1, generator=generator))
    return TreeOutcome(path, token, tried)


class TypicalMedusaProposer(MedusaProposer):
    """Medusa with typical acceptance: faster acceptance, but lossy (``exact = False``)."""

    name = "medusa-typical"
    exact = False

    def __init__(self, target: Target, heads: MedusaHeads, tree, name: str | None = None,
                 posterior_threshold: float = 0.09, posterior_alpha: float = 0.3):
        if not 0.0 <= posterior_threshold <= 1.0 or not 0.0 <= posterior_alpha <= 1.0:
            raise ValueError(f"posterior_threshold and posterior_alpha must lie in [0, 1], got "
                             f"{posterior_threshold}, {posterior_alpha}")
        super().__init__(target, heads, tree, name)
        self.posterior_threshold = posterior_threshold
        self.posterior_alpha = posterior_alpha

    def lossy_verify(self, tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                     generator) -> TreeOutcome:
        return typical_acceptance(tree, target_logits, params, generator,
                                  self.posterior_threshold, self.posterior_alpha)
