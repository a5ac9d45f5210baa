"""The static Medusa token tree: its form, how it is built from measured accuracies, its size.

A tree is a list of paths, each a tuple of top-k ranks per depth (the Medusa repo's
``medusa_choices``): ``(0, 2)`` is "head 1's best token, then head 2's third best". Depth d is
guessed by head d, so a path is at most as deep as there are heads, and every proper prefix of a
path is in the tree too (a node is verified together with its parent).

The tree is built from the heads' per-rank accuracies on held-out data (``rank_accuracies[d][r]``:
the chance that head d+1's rank-r guess is the right token) with the Medusa paper's greedy
construction (:func:`build_medusa_tree`): a node's value is the product of the accuracies of its
ranks along its path (the chance that the whole path is right, heads taken as independent), and
nodes are added best first, a node only after its parent and its next-likelier sibling.
``1 + sum(values)`` is the expected tau (:func:`expected_tau`).

Its size is ``tree_nodes``: a node count, or ``"auto"``, the count that maximises expected tau per
measured cost on this machine (:func:`plan_medusa_tree`: the cost of verifying 1 + n tokens in
one target forward, :func:`measure_verify_cost`, plus the heads' own cost,
:func:`measure_head_cost`). :func:`choose_tree` is the one entry point for all of these: the
trainer calls it for the artifact's tree and for its training-time evaluation, and the evaluator
calls it to rebuild a stored tree for another size.
"""

from __future__ import annotations

import heapq
import numbers
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from heads.target import Target, dtype_name, tree_attention_mask

if TYPE_CHECKING:
    from heads.medusa import MedusaHeads

RankPath = tuple[int, ...]
AUTO = "auto"  # the tree_nodes value that sizes the tree by measured cost
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)  # tokens per verification forward timed by "auto"


def check_tree(paths, num_heads: int) -> list[RankPath]:
    """Validate a Medusa tree (list of rank paths) -> sorted by (depth, ranks), duplicates removed.

    Every path is non-empty, no deeper than the number of heads, made of ranks >= 0, and every
    proper prefix of a path is itself in the tree (a node's parent must be verified with it).
    Sorted, parents precede children and siblings come likeliest (lowest rank) first.
    """
    if num_heads < 1:
        raise ValueError(f"a Medusa tree needs at least one head, got num_heads={num_heads}")
    if paths is None or isinstance(paths, (str, bytes)) or len(paths) == 0:
        raise ValueError(f"a Medusa tree is a non-empty list of rank paths, got {paths!r}")
    clean: set[RankPath] = set()
    for raw in paths:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or len(raw) == 0:
            raise ValueError(f"tree path {raw!r} is not a non-empty sequence of top-k ranks")
        if any(not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 0 for r in raw):
            raise ValueError(f"tree path {list(raw)} must hold integer ranks >= 0")
        if len(raw) > num_heads:
            raise ValueError(
                f"tree path {list(raw)} is {len(raw)} deep but there are only {num_heads} Medusa "
                f"heads (depth d is guessed by head d): drop the deeper paths or train more heads"
            )
        clean.add(tuple(int(r) for r in raw))
    for path in clean:
        if len(path) > 1 and path[:-1] not in clean:
            raise ValueError(
                f"tree path {list(path)} needs its parent {list(path[:-1])} in the tree too"
            )
    return sorted(clean, key=lambda p: (len(p), p))


def default_chain(num_heads: int) -> list[RankPath]:
    """Each head's top-1 guess, one after another: the tree when nothing was measured."""
    return [(0,) * d for d in range(1, num_heads + 1)]


def check_tree_nodes(tree_nodes, allow_auto: bool = True) -> int | str:
    """Validate a ``tree_nodes`` value: an integer >= 1, or "auto" where that is allowed."""
    if allow_auto and tree_nodes == AUTO:
        return AUTO
    if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or tree_nodes < 1:
        allowed = "an integer >= 1 or 'auto'" if allow_auto else "an integer >= 1"
        raise ValueError(f"tree_nodes must be {allowed}, got {tree_nodes!r}")
    return tree_nodes


def rank_table(rank_accuracies) -> list[list[float]]:
    """Validate per-rank accuracies (K, R) -> nested lists of floats."""
    try:
        table = torch.as_tensor(rank_accuracies, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as err:
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


def _path_value(path: RankPath, acc: list[list[float]]) -> float:
    value = 1.0
    for d, r in enumerate(path):
        value *= acc[d][r]
    return value


def grow_medusa_tree(rank_accuracies, tree_nodes: int,
                     max_depth: int | None = None) -> list[tuple[RankPath, float]]:
    """The greedy construction, in the order nodes are added: [(path, value)].

    The candidates are the first child (rank 0) of every node in the tree and the next sibling of
    every node; each step adds the candidate with the highest value (ties: smaller path first).
    Every prefix of the returned list is the greedy tree of that size.
    """
    acc = rank_table(rank_accuracies)
    check_tree_nodes(tree_nodes, allow_auto=False)
    depth_limit = len(acc) if max_depth is None else min(max_depth, len(acc))
    if depth_limit < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    ranks = len(acc[0])
    heap = [(-_path_value((0,), acc), (0,))]
    grown: list[tuple[RankPath, float]] = []
    while heap and len(grown) < tree_nodes:
        neg, path = heapq.heappop(heap)
        grown.append((path, -neg))
        if path[-1] + 1 < ranks:
            sibling = path[:-1] + (path[-1] + 1,)
            heapq.heappush(heap, (-_path_value(sibling, acc), sibling))
        if len(path) < depth_limit:
            child = path + (0,)
            heapq.heappush(heap, (-_path_value(child, acc), child))
    return grown


def build_medusa_tree(rank_accuracies, tree_nodes: int,
                      max_depth: int | None = None) -> list[RankPath]:
    """The static Medusa tree of at most ``tree_nodes`` nodes, sorted (depth, ranks)."""
    grown = grow_medusa_tree(rank_accuracies, tree_nodes, max_depth)
    return check_tree([p for p, _ in grown], len(rank_table(rank_accuracies)))


def expected_tau(tree, rank_accuracies) -> float:
    """1 + the expected accepted nodes per round: what tau should be if heads were independent."""
    acc = rank_table(rank_accuracies)
    total = 1.0
    for path in check_tree(tree, len(acc)):
        if max(path) >= len(acc[0]):
            raise ValueError(f"tree path {list(path)} uses a rank beyond the measured top-"
                             f"{len(acc[0])}")
        total += _path_value(path, acc)
    return total


# ---------------------------------------------------------------------------------------------
# the size from the measured cost of verification


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_verify_cost(target: Target, sizes=VERIFY_SIZES, context: int = 128,
                        repeats: int = 5, seed: int = 0) -> dict[int, float]:
    """Median seconds of one verification forward over n tokens (root + n-1 tree nodes).

    The forward is the engine's: ``context`` tokens already cached, a 4-D tree mask and per-node
    positions for n > 1, the final hidden state collected, the cache cropped back afterwards.
    """
    from transformers import DynamicCache

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
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :context].to(device), cache=cache, use_cache=True, logits_to_keep=1)
    calls = {}
    for n in sizes:
        kwargs = {}
        if n > 1:
            # the mask's shape sets the cost of the forward, not its pattern: a chain will do
            allowed = torch.ones(n, n, dtype=torch.bool).tril()
            kwargs["attention_mask"] = tree_attention_mask(allowed, context, dtype, device)
            kwargs["position_ids"] = torch.arange(context, context + n, device=device)[None]
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
            cache.crop(-n)  # drop the n verified tokens (transformers 5: a negative count)
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
        heads.top_tokens(h, min(topk, heads.config.head_vocab_size), num=depth).cpu()
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
class TreeChoice:
    tree_nodes: int
    tree: list[RankPath]
    expected_tau: float
    predicted_speedup: float  # expected tokens/s over plain decoding under the cost model
    table: list[dict] = field(default_factory=list)  # per size: nodes, expected_tau, cost, speedup


def choose_tree_nodes(rank_accuracies, verify_seconds: dict[int, float],
                      head_seconds: float = 0.0, max_tree_nodes: int | None = None) -> TreeChoice:
    """The size n maximising expected_tau(n) / (cost(1 + n) + head cost), relative to plain.

    ``verify_seconds[m]`` is the cost of verifying m tokens (:func:`measure_verify_cost`; needs
    m = 1, the plain decoding step); costs between measured sizes are interpolated, so n stops at
    the largest measured size minus one (or ``max_tree_nodes``). A ``predicted_speedup`` below 1
    says that on this machine Medusa with these heads is not expected to beat plain decoding.
    """
    if 1 not in verify_seconds:
        raise ValueError("verify_seconds needs the cost of 1 token (plain decoding) as a baseline")
    limit = max(verify_seconds) - 1
    if max_tree_nodes is not None:
        limit = min(limit, max_tree_nodes)
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
    tree = check_tree([p for p, _ in grown[:n]], len(rank_table(rank_accuracies)))
    return TreeChoice(n, tree, best["expected_tau"], best["predicted_speedup"], table)


def plan_medusa_tree(target: Target, heads: MedusaHeads, rank_accuracies,
                     sizes=VERIFY_SIZES, context: int = 128,
                     repeats: int = 5) -> tuple[list[RankPath], dict]:
    """Measure costs here, choose the size, build the tree -> (tree, tree_info for save_medusa)."""
    acc = rank_table(rank_accuracies)
    if len(acc) > heads.num_heads:
        raise ValueError(f"accuracies for {len(acc)} heads but the heads have {heads.num_heads}")
    verify = measure_verify_cost(target, sizes, context=context, repeats=repeats)
    head_cost = measure_head_cost(heads, depth=len(acc), topk=len(acc[0]))
    choice = choose_tree_nodes(acc, verify, head_cost)
    info = {
        "rank_accuracies": acc,
        "tree_nodes": choice.tree_nodes,
        "expected_tau": choice.expected_tau,
        "predicted_speedup": choice.predicted_speedup,
        "verify_seconds": {str(k): v for k, v in verify.items()},
        "head_seconds": head_cost,
        "measured_on": f"{target.device.type} {dtype_name(target.dtype)}",
    }
    return choice.tree, info


def choose_tree(rank_accuracies, num_heads: int, tree_nodes: int | str = AUTO, *,
                max_depth: int | None = None, max_topk: int | None = None,
                target: Target | None = None,
                heads: MedusaHeads | None = None) -> tuple[list[RankPath], dict]:
    """The static tree from held-out per-rank accuracies -> (tree, tree_info).

    ``rank_accuracies`` (K, R), or None when nothing was measured: then each head's top-1 chain,
    with a note in tree_info. ``tree_nodes``: a node count, or "auto" (the count that maximises
    expected tau per cost measured on this machine; needs ``target`` and ``heads``).
    ``max_depth`` / ``max_topk`` cap the tree's depth and ranks. ``tree_info`` records how the
    tree was chosen (``rank_accuracies``, ``tree_nodes``, ``expected_tau`` and, for "auto", the
    measured costs and ``predicted_speedup``); saved with the artifact, it lets the evaluator
    rebuild the tree for another size.
    """
    check_tree_nodes(tree_nodes)
    for name, value in (("max_depth", max_depth), ("max_topk", max_topk)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if rank_accuracies is None:
        chain = default_chain(num_heads if max_depth is None else min(max_depth, num_heads))
        return chain, {"note": "no held-out accuracies were measured: each head's top-1 chain"}
    acc = rank_table(rank_accuracies)[:num_heads]
    if max_depth is not None:
        acc = acc[:max_depth]
    if max_topk is not None:
        acc = [row[:max_topk] for row in acc]
    if tree_nodes == AUTO:
        if target is None or heads is None:
            raise ValueError("tree_nodes 'auto' measures this machine's cost of verification: "
                             "pass target= and heads=, or give a node count")
        return plan_medusa_tree(target, heads, acc)
    tree = build_medusa_tree(acc, tree_nodes)
    return tree, {"rank_accuracies": acc, "tree_nodes": tree_nodes,
                  "expected_tau": expected_tau(tree, acc)}


def prune_tree(tree, num_heads: int, max_depth: int | None = None,
               max_topk: int | None = None) -> list[RankPath]:
    """A stored tree cut to ``max_depth`` and to ranks below ``max_topk`` (for trees stored
    without accuracies, which cannot be rebuilt)."""
    kept = [p for p in check_tree(tree, num_heads)
            if (max_depth is None or len(p) <= max_depth) and (max_topk is None or max(p) < max_topk)]
    if not kept:
        raise ValueError(f"no path of the stored tree fits depth {max_depth} / topk {max_topk}")
    return check_tree(kept, num_heads)
