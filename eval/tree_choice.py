"""Choosing a tree from measurements: the EAGLE tree (depth, top-k, nodes) and the Medusa tree's
size that give the most expected tokens per second, from acceptance by rank and the timed cost
of verifying n tokens. Pure functions of numbers: ``draftsmith.eval.tree_auto`` measures them and
calls these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.eval.tree_cost import (
    COST_CONTEXT,
    COST_REPEATS,
    TIMED_SIZES,
    interpolate,
    machine_description,
    machine_key,
    measure_head_cost,
    measure_verify_cost,
)
from draftsmith.heads.medusa_tree import (
    AUTO,
    RankPath,
    check_tree,
    choose_tree,
    grow_medusa_tree,
    rank_table,
)
from draftsmith.targets.target import Target, dtype_name

MAX_DEPTH, MAX_TOPK, MAX_NODES = 6, 8, 63  # the search's bounds unless the user caps them



@dataclass
class EagleTreeChoice:
    depth: int
    topk: int
    tree_nodes: int
    expected_tau: float
    predicted_speedup: float  # over plain decoding, under the cost model
    round_seconds: float  # draft + verification, per round
    plain_seconds: float  # one plain decoding step
    table: list[dict]  # the best size of every (depth, topk)

    @property
    def expected_tokens_per_s(self) -> float:
        return self.expected_tau / self.round_seconds

    def as_dict(self) -> dict:
        return {"depth": self.depth, "topk": self.topk, "tree_nodes": self.tree_nodes,
                "expected_tau": self.expected_tau, "predicted_speedup": self.predicted_speedup,
                "expected_tokens_per_s": self.expected_tokens_per_s,
                "plain_tokens_per_s_model": 1.0 / self.plain_seconds,
                "round_seconds": self.round_seconds}


def choose_eagle_tree(rank_accuracies, verify_seconds: dict[int, float],
                      draft_seconds: dict[tuple[int, int], float], *, max_depth: int = MAX_DEPTH,
                      max_topk: int = MAX_TOPK, max_nodes: int = MAX_NODES) -> EagleTreeChoice:
    """The (depth, topk, nodes) maximising expected_tau(tree) / (verify(1 + n) + draft(d, k)).

    ``draft_seconds[(d, k)]``: one draft round; pairs beyond ``max_depth`` / ``max_topk`` or the
    accuracies' depth and ranks are skipped. Nodes stop at the largest verified size minus one.
    """
    acc = rank_table(rank_accuracies)
    if 1 not in verify_seconds:
        raise ValueError("verify_seconds needs the cost of 1 token (plain decoding)")
    plain = verify_seconds[1]
    limit = min(max_nodes, max(verify_seconds) - 1)
    if limit < 1:
        raise ValueError(f"measure verification of at least 2 tokens (got {sorted(verify_seconds)})")
    best, table = None, []
    for (d, k), draft in sorted(draft_seconds.items()):
        if d > min(max_depth, len(acc)) or k > min(max_topk, len(acc[0])):
            continue
        sub = [row[:k] for row in acc[:d]]
        reachable = sum(k ** j for j in range(1, d + 1))  # ranks < k, depth <= d
        grown = grow_medusa_tree(sub, min(limit, reachable))
        tau, top = 1.0, None
        for n, (_, value) in enumerate(grown, start=1):
            tau += value
            cost = interpolate(verify_seconds, n + 1) + draft
            row = {"depth": d, "topk": k, "tree_nodes": n, "expected_tau": tau,
                   "round_seconds": cost, "predicted_speedup": tau * plain / cost}
            if top is None or row["predicted_speedup"] > top["predicted_speedup"]:
                top = row
        if top is None:
            continue
        table.append(top)
        # ties go to the smaller tree, then the shallower and narrower
        rank = (top["predicted_speedup"], -top["tree_nodes"], -d, -k)
        if best is None or rank > best[0]:
            best = (rank, top)
    if best is None:
        raise ValueError(f"no (depth, topk) within depth <= {max_depth} and topk <= {max_topk} "
                         f"was measured (measured {sorted(draft_seconds)})")
    top = best[1]
    return EagleTreeChoice(top["depth"], top["topk"], top["tree_nodes"], top["expected_tau"],
                           top["predicted_speedup"], top["round_seconds"], plain, table)


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
        cost = interpolate(verify_seconds, n + 1) + head_seconds
        table.append({"nodes": n, "expected_tau": tau, "cost_ratio": cost / plain,
                      "predicted_speedup": tau * plain / cost})
    best = max(table, key=lambda row: (row["predicted_speedup"], -row["nodes"]))
    n = best["nodes"]
    tree = check_tree([p for p, _ in grown[:n]], len(rank_table(rank_accuracies)))
    return TreeChoice(n, tree, best["expected_tau"], best["predicted_speedup"], table)


def plan_medusa_tree(target: Target, heads, rank_accuracies, sizes=TIMED_SIZES,
                     context: int = COST_CONTEXT,
                     repeats: int = COST_REPEATS) -> tuple[list[RankPath], dict]:
    """Measure costs here, choose the size, build the tree -> (tree, tree_info for save_medusa).

    tree_info carries the costs as a calibration's machine entry does (``verify_seconds``,
    ``head_seconds``, ``head_shape``, ``machine_key``), so ``--tree auto`` on the same machine
    uses them instead of measuring again."""
    acc = rank_table(rank_accuracies)
    if len(acc) > heads.num_heads:
        raise ValueError(f"accuracies for {len(acc)} heads but the heads have {heads.num_heads}")
    verify = measure_verify_cost(target, sizes, context=context, repeats=repeats)
    head_cost = measure_head_cost(heads, depth=len(acc), topk=len(acc[0]))
    choice = choose_tree_nodes(acc, verify, head_cost)
    description = machine_description(target, None)
    info = {
        "rank_accuracies": acc,
        "tree_nodes": choice.tree_nodes,
        "expected_tau": choice.expected_tau,
        "predicted_speedup": choice.predicted_speedup,
        "verify_seconds": {str(k): v for k, v in verify.items()},
        "head_seconds": head_cost,
        "measured_on": f"{target.device.type} {dtype_name(target.dtype)}",
        "head_shape": [len(acc), len(acc[0])],
        "context": context,
        "machine": description,
        "machine_key": machine_key(description),
    }
    return choice.tree, info


def size_medusa_tree(rank_accuracies, num_heads: int, tree_nodes: int | str = AUTO, *,
                     max_depth: int | None = None, max_topk: int | None = None,
                     target: Target | None = None, heads=None) -> tuple[list[RankPath], dict]:
    """The Medusa trainer's tree: :func:`draftsmith.heads.medusa_tree.choose_tree` for a node count, or for
    "auto" the count that maximises expected tau per cost measured here (needs ``target`` and
    ``heads``) -> (tree, tree_info)."""
    if tree_nodes != AUTO or rank_accuracies is None:
        return choose_tree(rank_accuracies, num_heads, 1 if tree_nodes == AUTO else tree_nodes,
                           max_depth=max_depth, max_topk=max_topk)
    if target is None or heads is None:
        raise ValueError("tree_nodes 'auto' measures this machine's cost of verification: "
                         "pass target= and heads=, or give a node count")
    acc = rank_table(rank_accuracies)[:num_heads]
    if max_depth is not None:
        acc = acc[:max_depth]
    if max_topk is not None:
        acc = [row[:max_topk] for row in acc]
    return plan_medusa_tree(target, heads, acc)
