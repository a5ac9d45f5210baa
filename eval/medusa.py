"""Medusa in the evaluator: the proposers that turn the heads' guesses into a static token tree.

Each round the heads read ``h_t``, the target's final-normed last hidden state at the last
accepted position (the one whose LM-head output was the root token); head d's top-k guesses fill
depth d of a static tree of rank paths (the Medusa repo's ``medusa_choices``). Children are chosen
deterministically (top-k, likeliest first) and carry no draft distribution, so the engine verifies
them with the exact point-mass rule at any temperature, and greedily at temperature 0. Heads over a
draft vocabulary rank their draft ids and hand the target ids those map to (``d2t``); the target
verifies over its whole vocabulary, so exactness does not depend on the draft vocabulary.

The tree's form and its construction from held-out accuracies live in heads/medusa_tree.py, its
size by measured cost in eval/tree_auto.py; :meth:`MedusaProposer.from_artifact` rebuilds an
artifact's tree for another size.

``TypicalMedusaProposer`` swaps the exact rule for Medusa's typical acceptance (lossy, flagged
``exact = False``, named ``medusa-typical``). In the benchmark: ``--method medusa:<artifact>`` and
``--method medusa:typical:<artifact>``.
"""

from __future__ import annotations

import math
import os

import torch

from draftsmith.eval.acceptance import TreeOutcome, verify_tree
from draftsmith.eval.proposers import Proposer
from draftsmith.eval.runners import (
    ARTIFACT_FIXED_OPTIONS,
    TREE_AUTO,
    BuildContext,
    EngineMethod,
    OptionFlag,
    int_at_least,
    parse_probability,
    parse_tree_nodes,
    tree_caps,
)
from draftsmith.eval.sampling import SamplingParams, warp
from draftsmith.eval.tree import DraftTree
from draftsmith.eval.tree_auto import auto_medusa_tree
from draftsmith.eval.tree_choice import size_medusa_tree
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.heads.medusa_tree import check_tree, check_tree_nodes, prune_tree
from draftsmith.layouts.medusa import load_medusa_heads
from draftsmith.targets.target import Target

DEFAULT_POSTERIOR_THRESHOLD = 0.09
DEFAULT_POSTERIOR_ALPHA = 0.3


class MedusaTree:
    """A static tree's structure, turned into a ``DraftTree`` from the heads' top-k each round.

    The form (parents, ancestors, depths, which head and rank fill each node) is copied to a
    device once, so a round gathers its tokens there and reads nothing on the host."""

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
        self._forms: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def _form(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._forms:
            host = DraftTree([0] * len(self.paths), self.parents)
            self._forms[device] = tuple(t.to(device) for t in (
                self.head_of, self.rank_of, torch.tensor(self.parents, dtype=torch.long),
                host.ancestor_mask(), torch.tensor(host.depths, dtype=torch.long)))
        return self._forms[device]

    def draft_tree(self, top_tokens: torch.Tensor, max_depth: int) -> DraftTree:
        """top_tokens (depth, topk): head d's guesses by rank -> deterministic-children tree,
        on top_tokens' device."""
        depth = min(max_depth, self.max_depth, top_tokens.shape[0])
        n = self.within_depth[depth]
        head_of, rank_of, parents, ancestors, depths = self._form(top_tokens.device)
        tokens = top_tokens[head_of[:n], rank_of[:n]]
        return DraftTree.from_tensors(tokens, parents[:n], depth_bound=depth,
                                      chain=all(p == i for i, p in enumerate(self.parents[:n])),
                                      ancestors=ancestors[: n + 1, : n + 1],
                                      depths=depths[: n + 1], host_parents=self.parents[:n])


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
        self.set_tree(tree)
        # transformers' numbering: index L is the final-normed last layer, what the LM head reads
        self.hidden_layers = (target.num_layers,)
        if name is not None:
            self.name = name
        self.h: torch.Tensor | None = None
        self.tree_info: dict = {}

    def set_tree(self, tree) -> None:
        """Draft this static tree (rank paths) from now on."""
        checked = MedusaTree(tree, self.heads.num_heads)
        if checked.topk > self.heads.config.head_vocab_size:
            raise ValueError(f"the tree uses rank {checked.topk - 1} but the heads guess among "
                             f"{self.heads.config.head_vocab_size} tokens")
        self.tree = checked

    @classmethod
    def from_artifact(cls, path: str | os.PathLike, target: Target, *,
                      tree_nodes: int | str | None = None, max_depth: int | None = None,
                      max_topk: int | None = None, typical: bool = False,
                      posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD,
                      posterior_alpha: float = DEFAULT_POSTERIOR_ALPHA,
                      name: str | None = None,
                      allow_other_weights: bool = False) -> MedusaProposer:
        """Load the Medusa artifact at ``path`` for ``target``.

        The artifact's stored tree is used as it is unless ``tree_nodes`` (a node count, or
        "auto": the size that maximises expected tau per cost measured here), ``max_depth`` or
        ``max_topk`` ask for another one; it is then rebuilt from the artifact's stored held-out
        accuracies (a tree stored without them can only be cut to ``max_depth`` / ``max_topk``).
        ``typical``: Medusa's lossy typical acceptance (:class:`TypicalMedusaProposer`) with
        ``posterior_threshold`` and ``posterior_alpha``, which apply to it alone.
        """
        if not typical and (posterior_threshold != DEFAULT_POSTERIOR_THRESHOLD
                            or posterior_alpha != DEFAULT_POSTERIOR_ALPHA):
            raise ValueError("posterior_threshold and posterior_alpha tune Medusa's typical "
                             "acceptance: pass typical=True (medusa:typical:<artifact>) or drop them")
        if tree_nodes is not None:
            check_tree_nodes(tree_nodes)
        artifact = load_medusa_heads(path, target, allow_other_weights=allow_other_weights)
        heads = artifact.heads
        tree = artifact.tree
        if tree_nodes is not None or max_depth is not None or max_topk is not None:
            accuracies = artifact.tree_info.get("rank_accuracies")
            if accuracies is not None:
                tree, _ = size_medusa_tree(
                    accuracies, heads.num_heads,
                    len(artifact.tree) if tree_nodes is None else tree_nodes,
                    max_depth=max_depth, max_topk=max_topk, target=target, heads=heads)
            elif tree_nodes is not None:
                raise ValueError(
                    f"the Medusa artifact {path} stores no held-out rank accuracies, so its tree "
                    "cannot be rebuilt for another size: drop tree_nodes (--tree-nodes), or save "
                    "the artifact with tree_info={'rank_accuracies': ...} "
                    "(draftsmith.eval.tree_choice.size_medusa_tree gives both)")
            else:
                tree = prune_tree(tree, heads.num_heads, max_depth, max_topk)
        if typical:
            proposer = TypicalMedusaProposer(target, heads, tree, name=name,
                                             posterior_threshold=posterior_threshold,
                                             posterior_alpha=posterior_alpha)
        else:
            proposer = cls(target, heads, tree, name=name)
        proposer.tree_info = artifact.tree_info  # how the stored tree was chosen (--tree auto)
        return proposer

    def start(self, prompt_ids, hidden, params: SamplingParams, generator) -> None:
        super().start(prompt_ids, hidden, params, generator)
        self.h = hidden[0][0, -1]  # (hidden,) h_t of the last prompt token

    @torch.no_grad()
    def propose(self, seq: list[int], max_depth: int) -> DraftTree | None:
        depth = min(max_depth, self.tree.max_depth)
        if depth < 1 or self.h is None:
            return None
        top = self.heads.top_tokens(self.h, self.tree.topk, num=depth)  # (depth, topk)
        return self.tree.draft_tree(top, depth)

    def observe(self, seq, tree, path, hidden) -> None:
        self.h = hidden[0][0, -1]  # h_t at the last accepted node (the old root if none)


def typical_acceptance(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator | None = None,
                       posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD,
                       posterior_alpha: float = DEFAULT_POSTERIOR_ALPHA) -> TreeOutcome:
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
                 posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD,
                 posterior_alpha: float = DEFAULT_POSTERIOR_ALPHA):
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


# ---------------------------------------------------------------------------------------------
# the benchmark's method: medusa:<artifact>, medusa:typical:<artifact>

TYPICAL_PREFIX = "typical:"
MEDUSA_FLAGS = (
    OptionFlag("medusa", MedusaProposer.from_artifact, "tree_nodes", "--tree-nodes",
               parse_tree_nodes, ""),
    OptionFlag("medusa", MedusaProposer.from_artifact, "max_depth", "--tree-depth",
               int_at_least(1), ""),
    OptionFlag("medusa", MedusaProposer.from_artifact, "max_topk", "--tree-topk",
               int_at_least(1), ""),
    OptionFlag("medusa", TypicalMedusaProposer, "posterior_threshold",
               "--medusa-posterior-threshold", parse_probability,
               "medusa:typical: a node is plausible when the target gives it more than "
               "min(threshold, alpha * exp(-entropy))"),
    OptionFlag("medusa", TypicalMedusaProposer, "posterior_alpha", "--medusa-posterior-alpha",
               parse_probability, "medusa:typical: see --medusa-posterior-threshold"),
)
MEDUSA_FIXED_OPTIONS = {**ARTIFACT_FIXED_OPTIONS, "typical": "medusa:typical:<artifact>"}


def build_medusa(arg: str, name: str, ctx: BuildContext) -> EngineMethod:
    """``medusa:<artifact>`` (exact) or ``medusa:typical:<artifact>`` (Medusa's lossy rule)."""
    options = ctx.kind_options("medusa")
    caps = (tree_caps(options, "max_depth", "max_topk", "tree_nodes")
            if ctx.tree == TREE_AUTO else None)
    typical = arg.startswith(TYPICAL_PREFIX)
    path = arg[len(TYPICAL_PREFIX):] if typical else arg
    if not typical:
        for key in ("posterior_threshold", "posterior_alpha"):
            if key in options:
                raise ValueError(f"--medusa-{key.replace('_', '-')} tunes Medusa's "
                                 "typical acceptance: use medusa:typical:<artifact>")
    proposer = MedusaProposer.from_artifact(path, ctx.target, typical=typical, name=name,
                                            allow_other_weights=ctx.allow_other_weights,
                                            **options)
    chosen = None
    if caps is not None:
        paths, chosen = auto_medusa_tree(path, ctx.target, proposer.heads, proposer.tree_info,
                                         compile=ctx.compile, proposer=proposer,
                                         **caps, **ctx.tree_calibration)
        proposer.set_tree(paths)
    return EngineMethod(name, ctx.engine, proposer, chosen)
