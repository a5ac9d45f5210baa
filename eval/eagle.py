"""EAGLE proposer: chain drafting and EAGLE-2 dynamic trees from an EAGLE-1/EAGLE-3 head.

The head keeps its own KV cache. Between rounds it holds exactly one entry per real position t
(the target's feature f_t with the embedding of x_{t+1}) for every token the target has seen, so
it equals a fresh recomputation over the accepted sequence; the entries the tree expansion
appends during ``propose`` carry the head's own features and are cropped before it returns, so
rejected (and accepted) draft branches leave no trace. After verification ``observe`` appends
the real entries of the old root and the accepted nodes, from the target's features.

Tree (EAGLE-2): the root's top-k children form the first frontier; at each further depth the
frontier nodes are expanded in one batched head forward (4-D tree mask, per-node positions), each
gets its top-k children, and the k children with the highest cumulative draft log-probability
become the next frontier. Of every child scored on the way, the ``tree_nodes`` with the highest
cumulative log-probability form the tree (a parent never scores below its child, so the choice is
closed under ancestors). Children are chosen deterministically, so verification uses the
point-mass rule and stays exact at every temperature. ``topk=1`` gives a chain.

Pruning: once ``tree_nodes`` children have been scored, a frontier node scoring no higher than the
``tree_nodes``-th best of them cannot place a descendant in the tree (a descendant scores no
higher than its ancestor and comes later, so it loses even a tie); such nodes are not expanded,
and the expansion stops when none is left. The tree is the one the full expansion chooses, at
fewer head rows and often fewer head forwards (a small tree rarely needs the last depths).
"""

from __future__ import annotations

import os

import torch

from eval.kv import crop
from eval.proposers import Proposer
from eval.runners import (
    ARTIFACT_FIXED_OPTIONS,
    TREE_AUTO,
    TREE_FIXED,
    BuildContext,
    EngineMethod,
    OptionFlag,
    int_at_least,
    parse_tree_nodes,
    tree_caps,
)
from eval.tree import DraftTree
from eval.tree_auto import auto_eagle_tree
from heads.eagle import EagleHead, causal_mask
from heads.medusa_tree import AUTO
from heads.target import Target, tree_attention_mask
from layouts.eagle import export_eagle_gguf, load_eagle_head

DEFAULT_DEPTH = 5
DEFAULT_TOPK = 8
DEFAULT_TREE_NODES = 32


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax in at least float32 (bf16 logits would tie too often when ranking)."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))


class EagleProposer(Proposer):
    """Draft trees (or chains) from an EAGLE head; see the module docstring."""

    name = "eagle"

    def __init__(
        self,
        head: EagleHead,
        depth: int = DEFAULT_DEPTH,
        topk: int = DEFAULT_TOPK,
        tree_nodes: int = DEFAULT_TREE_NODES,
        name: str = "eagle",
        prune: bool = True,
    ):
        for key, value in (("depth", depth), ("topk", topk), ("tree_nodes", tree_nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EagleProposer {key} must be an integer >= 1, got {value!r}")
        self.head = head  # its train/eval mode is left alone (trainers measure acceptance mid-run)
        self.depth, self.topk, self.tree_nodes = depth, topk, tree_nodes
        self.name = name
        self.prune = prune  # see the module docstring; False expands every frontier node
        self.expanded_rows = 0  # frontier rows the head has run, over the proposer's life
        self.hidden_layers = tuple(head.config.aux_layer_ids)

    @classmethod
    def from_artifact(cls, path: str | os.PathLike, target: Target, *,
                      depth: int = DEFAULT_DEPTH, topk: int = DEFAULT_TOPK,
                      tree_nodes: int = DEFAULT_TREE_NODES, dtype: torch.dtype | None = None,
                      name: str | None = None,
                      allow_other_weights: bool = False) -> EagleProposer:
        """Load an eagle1/eagle3 artifact for ``target`` and draft EAGLE-2 trees with it.

        ``dtype``: run the head in another precision than the target (e.g. bf16 beside an fp32
        target on a CPU); the head's numerics never touch exactness, which depends on the
        target alone. ``name`` defaults to ``eagle:<path>``. ``allow_other_weights``: accept a
        target of the recorded shapes whose weights differ from the ones the head was trained for.
        """
        head = load_eagle_head(path, target, dtype=dtype,
                               allow_other_weights=allow_other_weights).eval()
        return cls(head, depth=depth, topk=topk, tree_nodes=tree_nodes,
                   name=name or f"eagle:{path}")

    # -- cache bookkeeping -----------------------------------------------------------------------

    def start(self, prompt_ids, hidden, params, generator) -> None:
        super().start(prompt_ids, hidden, params, generator)
        self.cache = self.head.new_cache()
        self.cached = 0  # real entries in the head's cache (positions 0..cached-1)
        self.pending = self._fuse(hidden)  # (1, P, h): target features without an entry yet
        self.root_hidden = None  # (1, 1, h): the head's output at the last real entry
        self.root_logits = None  # (draft_vocab,)
        self._catch_up(prompt_ids)

    @torch.no_grad()
    def _fuse(self, hidden) -> torch.Tensor:
        if not hidden:
            raise ValueError(
                "EagleProposer needs the target's hidden states; run it through "
                "SpeculativeEngine, which collects proposer.hidden_layers"
            )
        return self.head.fuse(torch.cat(list(hidden), dim=-1))

    @torch.no_grad()
    def _catch_up(self, seq: list[int]) -> None:
        """Add the real entries whose feature and next token are both known."""
        n = min(self.pending.shape[1], len(seq) - 1 - self.cached)
        if n <= 0:
            return
        head = self.head
        ids = torch.tensor([seq[self.cached + 1 : self.cached + 1 + n]], device=head.device)
        positions = torch.arange(self.cached, self.cached + n, device=head.device)[None]
        mask = causal_mask(n, self.cached, head.dtype, head.device)
        out, logits = head(ids, self.pending[:, :n], positions, mask, self.cache, logits_to_keep=1)
        self.root_hidden, self.root_logits = out[:, -1:], logits[0, -1]
        self.cached += n
        self.pending = self.pending[:, n:]

    def observe(self, seq, tree, path, hidden) -> None:
        # the target's features at the old root and the accepted nodes become real entries
        self.pending = torch.cat([self.pending, self._fuse(hidden)], dim=1)
        self._catch_up(seq)

    # -- drafting --------------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, seq: list[int], max_depth: int) -> DraftTree | None:
        depth = min(self.depth, max_depth)
        if depth < 1:
            return None
        self._catch_up(seq)
        assert self.cached == len(seq) - 1 and self.pending.shape[1] == 0, "head cache out of step"
        head, k, base = self.head, self.topk, self.cached
        device = head.device

        logp = _log_probs(self.root_logits)  # (Vd,)
        scores, draft_ids = logp.topk(min(k, logp.numel()))  # (k,)
        tokens = head.draft_to_target(draft_ids)
        # every scored child: target token, parent candidate (-1 = root), cumulative log-prob
        all_tokens, all_parents, all_scores = [tokens], [torch.full_like(tokens, -1)], [scores]
        frontier = torch.arange(tokens.numel(), device=device)  # candidate ids to expand next
        front_tokens, front_scores = tokens, scores
        front_hidden = self.root_hidden.expand(1, tokens.numel(), -1)  # (1, m, h)
        front_entry_parent = torch.full_like(tokens, -1)  # tree entry of the parent, -1 = root
        ancestry = torch.zeros(0, 0, dtype=torch.bool, device=device)  # tree entry x tree entry
        n_candidates = tokens.numel()
        for d in range(2, depth + 1):
            if self.prune and n_candidates >= self.tree_nodes:
                # the tree_nodes-th best score so far: nodes at or below it cannot place a child
                floor = torch.cat(all_scores).topk(self.tree_nodes).values[-1]
                alive = front_scores > floor
                if not bool(alive.any()):
                    break
                if not bool(alive.all()):
                    frontier, front_tokens = frontier[alive], front_tokens[alive]
                    front_scores, front_hidden = front_scores[alive], front_hidden[:, alive]
                    front_entry_parent = front_entry_parent[alive]
            m, entries = front_tokens.numel(), ancestry.shape[0]
            self.expanded_rows += m
            # the new entries see the real prefix, their ancestors' entries and themselves
            rows = torch.zeros(m, entries + m, dtype=torch.bool, device=device)
            has_parent = front_entry_parent >= 0
            if entries and bool(has_parent.any()):
                rows[:, :entries] = ancestry[front_entry_parent.clamp_min(0)] & has_parent[:, None]
            rows[:, entries:] = torch.eye(m, dtype=torch.bool, device=device)
            ancestry = torch.cat([torch.nn.functional.pad(ancestry, (0, m)), rows], dim=0)
            mask = tree_attention_mask(rows, base, head.dtype, device)  # (1, 1, m, base + entries + m)
            positions = torch.full((1, m), base - 1 + d - 1, device=device)
            out, logits = head(front_tokens[None], front_hidden, positions, mask, self.cache)
            step_logp = _log_probs(logits[0])  # (m, Vd)
            child_scores, child_ids = step_logp.topk(min(k, step_logp.shape[-1]), dim=-1)  # (m, k)
            cumulative = (front_scores[:, None] + child_scores).reshape(-1)  # (m * k,)
            child_tokens = head.draft_to_target(child_ids).reshape(-1)
            per = child_ids.shape[1]
            parents = frontier.repeat_interleave(per)
            all_tokens.append(child_tokens)
            all_parents.append(parents)
            all_scores.append(cumulative)
            if d < depth:
                best = cumulative.topk(min(k, cumulative.numel())).indices
                frontier = n_candidates + best
                front_tokens, front_scores = child_tokens[best], cumulative[best]
                front_hidden = out[:, best // per]
                front_entry_parent = entries + best // per
            n_candidates += cumulative.numel()
        crop(self.cache, base)  # draft-feature entries must not outlive this round

        scores = torch.cat(all_scores)
        # stable sort: among equal scores the earlier (shallower) candidate, so parents come first
        order = torch.sort(scores, descending=True, stable=True).indices[: self.tree_nodes]
        chosen = order.tolist()
        cand_tokens = torch.cat(all_tokens)[order].tolist()
        cand_parents = torch.cat(all_parents)[order].tolist()
        cand_scores = scores[order].tolist()
        node_of = {}
        tree_tokens, tree_parents, tree_scores = [], [], []
        for cand, tok, parent, score in zip(chosen, cand_tokens, cand_parents, cand_scores):
            if parent != -1 and parent not in node_of:
                continue  # unreachable in exact arithmetic (ancestors score at least as high)
            tree_tokens.append(tok)
            tree_parents.append(0 if parent == -1 else node_of[parent])
            tree_scores.append(score)
            node_of[cand] = len(tree_tokens)
        # extra: each node's cumulative draft log-probability (for inspection and tests)
        return DraftTree(tree_tokens, tree_parents, extra={"scores": tree_scores})


# ---------------------------------------------------------------------------------------------
# the benchmark's method: eagle:<artifact>

EAGLE_FLAGS = (
    OptionFlag("eagle", EagleProposer.from_artifact, "depth", "--tree-depth", int_at_least(1),
               "eagle: EAGLE-2 tree depth; medusa: cap on the tree's depth"),
    OptionFlag("eagle", EagleProposer.from_artifact, "topk", "--tree-topk", int_at_least(1),
               "eagle: children per expanded node; medusa: cap on the tree's ranks"),
    OptionFlag("eagle", EagleProposer.from_artifact, "tree_nodes", "--tree-nodes",
               parse_tree_nodes,
               "eagle: draft tokens per tree; medusa: rebuild the artifact's tree with this many "
               "nodes from its stored accuracies, or 'auto': the size that maximises expected "
               "tau per verification cost measured on this machine"),
)
EAGLE_FIXED_OPTIONS = {**ARTIFACT_FIXED_OPTIONS, "dtype": "--draft-dtype"}


def build_eagle(arg: str, name: str, ctx: BuildContext) -> EngineMethod:
    """``eagle:<artifact>``: EAGLE-2 trees, sized by --tree auto (the options cap the search)."""
    options = ctx.kind_options("eagle")
    if ctx.tree == TREE_FIXED and options.get("tree_nodes") == AUTO:
        raise ValueError("EAGLE trees take a node count; --tree auto (the command line's "
                         "default) chooses their depth, topk and nodes by measured cost")
    caps = tree_caps(options, "depth", "topk", "tree_nodes") if ctx.tree == TREE_AUTO else None
    proposer = EagleProposer.from_artifact(arg, ctx.target, dtype=ctx.draft_dtype, name=name,
                                           allow_other_weights=ctx.allow_other_weights,
                                           **options)
    chosen = None
    if caps is not None:
        chosen = auto_eagle_tree(proposer, arg, ctx.target, draft_dtype=ctx.draft_dtype, **caps,
                                 **ctx.tree_calibration)
    return EngineMethod(name, ctx.engine, proposer, chosen)


def serve_eagle(arg: str, name: str, ctx) -> list[str]:
    """``eagle:<artifact>`` in llama.cpp: the head exported to GGUF, ``--spec-type draft-eagle3``
    (``ctx``: eval.llama_bench.ServeContext)."""
    gguf = export_eagle_gguf(arg, ctx.work_dir / f"eagle-{len(list(ctx.work_dir.glob('*.gguf')))}.gguf",
                             target=ctx.target, gguf_type=ctx.gguf_type, overwrite=True)
    return ctx.draft_args(gguf, "draft-eagle3", 3)  # llama.cpp's own default
