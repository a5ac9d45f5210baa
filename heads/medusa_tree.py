"""The static Medusa token tree: its form and how it is built from measured accuracies.

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

Its size is ``tree_nodes``: a node count (:func:`choose_tree`, which the evaluator also uses to
rebuild a stored tree for another size), or ``"auto"``, the count that maximises expected tau per
cost measured on this machine, which is the tree sizing's job (:mod:`draftsmith.eval.tree_auto`, with its
timings in :mod:`draftsmith.eval.tree_cost`): the Medusa trainer and ``--tree auto`` both size trees there.
"""

from __future__ import annotations

import heapq
import numbers
from collections.abc import Sequence

import torch

RankPath = tuple[int, ...]
AUTO = "auto"  # the tree_nodes value that sizes the tree by measured cost


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
            "cumulative (top-k); pass per-rank ones, draftsmith.heads.medusa.rank_accuracy(hits, totals)"
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


def choose_tree(rank_accuracies, num_heads: int, tree_nodes: int, *,
                max_depth: int | None = None,
                max_topk: int | None = None) -> tuple[list[RankPath], dict]:
    """The static tree of ``tree_nodes`` nodes from held-out per-rank accuracies -> (tree, info).

    ``rank_accuracies`` (K, R), or None when nothing was measured: then each head's top-1 chain,
    with a note in tree_info. ``max_depth`` / ``max_topk`` cap the tree's depth and ranks.
    ``tree_info`` records how the tree was chosen (``rank_accuracies``, ``tree_nodes``,
    ``expected_tau``); saved with the artifact, it lets the evaluator rebuild the tree for
    another size. A size by measured cost ("auto") is :func:`draftsmith.eval.tree_choice.size_medusa_tree`.
    """
    if tree_nodes == AUTO:
        raise ValueError("tree_nodes 'auto' is sized by this machine's measured costs: "
                         "draftsmith.eval.tree_choice.size_medusa_tree, or give a node count")
    check_tree_nodes(tree_nodes, allow_auto=False)
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
