"""EAGLE proposer: chain drafting and EAGLE-2 dynamic trees from an EAGLE-1/EAGLE-3 head.

The head keeps its own KV cache. Between rounds it holds exactly one entry per real position t
(the target's feature f_t with the embedding of x_{t+1}) for every token the target has seen, so
it equals a fresh recomputation over the accepted sequence; the entries the tree expansion
appends during ``propose`` carry the head's own features and are cropped before it returns, so
rejected (and accepted) draft branches leave no trace. After verification ``observe`` appends
the real entries of the old root and the accepted nodes, from the target's features and the
accepted tokens, both still on the device.

Tree (EAGLE-2): the root's top-k children form the first frontier; at each further depth the
frontier nodes are expanded in one batched head forward (4-D tree mask, per-node positions), each
gets its top-k children, and the k children with the highest cumulative draft log-probability
become the next frontier. Of every child scored on the way, the ``tree_nodes`` with the highest
cumulative log-probability form the tree (a parent never scores below its child, so the choice is
closed under ancestors). Children are chosen deterministically, so verification uses the
point-mass rule and stays exact at every temperature. ``topk=1`` gives a chain.

Static shapes. Every tensor a round makes has a shape fixed by (depth, topk, tree_nodes), so the
round runs on the device without reading it (the tree, its parents, depths and ancestors are
built there) and a compiled head sees a few shapes. Pruning is therefore a bound known before the
round rather than a test of the scores: at depth d only the best ``tree_nodes - d + 1`` frontier
nodes can place a child in the tree (that child needs its d - 1 ancestors and the better frontier
nodes, which score at least as high and come first, in the tree too), and no depth beyond
``tree_nodes`` can; frontier rows past the bound are not expanded (``prune=False`` expands every
one). The tree is the one the full expansion chooses; which rows a data-dependent test would
have skipped as well are still computed, the price of never waiting for the device.
"""

from __future__ import annotations

import os

import torch

from draftsmith.eval.attention import tree_attention_mask
from draftsmith.eval.forward import model_forward
from draftsmith.eval.host import to_host
from draftsmith.eval.kv import crop
from draftsmith.eval.proposers import Proposer
from draftsmith.eval.runners import (
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
from draftsmith.eval.tree import DraftTree, ancestor_table
from draftsmith.eval.tree_auto import auto_eagle_tree
from draftsmith.heads.eagle import EagleHead, causal_mask
from draftsmith.heads.medusa_tree import AUTO
from draftsmith.layouts.eagle import export_eagle_gguf, load_eagle_head
from draftsmith.targets.target import Target

DEFAULT_DEPTH = 5
DEFAULT_TOPK = 8
DEFAULT_TREE_NODES = 32


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax in at least float32 (bf16 logits would tie too often when ranking)."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))


def _head_call(head, *, cache, input_ids, hidden, position_ids, attention_mask,
               logits_to_keep: int = 0):
    return head(input_ids, hidden, position_ids, attention_mask, cache,
                logits_to_keep=logits_to_keep)


class HostScores(dict):
    """A tree's ``extra``: ``scores`` (each node's cumulative draft log-probability) read on the
    host only when asked for (inspection and tests; the engine never reads it)."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if isinstance(value, torch.Tensor):
            value = to_host(value)
            self[key] = value
        return value


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
        compile: bool | str = False,
    ):
        for key, value in (("depth", depth), ("topk", topk), ("tree_nodes", tree_nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EagleProposer {key} must be an integer >= 1, got {value!r}")
        self.head = head  # its train/eval mode is left alone (trainers measure acceptance mid-run)
        self.depth, self.topk, self.tree_nodes = depth, topk, tree_nodes
        self.name = name
        self.prune = prune  # see the module docstring; False expands every frontier node
        self.compile = compile
        self.expanded_rows = 0  # frontier rows the head has run, over the proposer's life
        self.hidden_layers = tuple(head.config.aux_layer_ids)
        self._static: dict[tuple[int, int, int], torch.Tensor] = {}

    @classmethod
    def from_artifact(cls, path: str | os.PathLike, target: Target, *,
                      depth: int = DEFAULT_DEPTH, topk: int = DEFAULT_TOPK,
                      tree_nodes: int = DEFAULT_TREE_NODES, dtype: torch.dtype | None = None,
                      name: str | None = None, allow_other_weights: bool = False,
                      compile: bool | str = False) -> EagleProposer:
        """Load an eagle1/eagle3 artifact for ``target`` and draft EAGLE-2 trees with it.

        ``dtype``: run the head in another precision than the target (e.g. bf16 beside an fp32
        target on a CPU); the head's numerics never touch exactness, which depends on the
        target alone. ``name`` defaults to ``eagle:<path>``. ``allow_other_weights``: accept a
        target of the recorded shapes whose weights differ from the ones the head was trained for.
        ``compile``: the head's forward is compiled (:mod:`draftsmith.eval.forward`).
        """
        head = load_eagle_head(path, target, dtype=dtype,
                               allow_other_weights=allow_other_weights).eval()
        return cls(head, depth=depth, topk=topk, tree_nodes=tree_nodes,
                   name=name or f"eagle:{path}", compile=compile)

    @property
    def chains(self) -> bool:
        return self.topk == 1

    # -- cache bookkeeping -----------------------------------------------------------------------

    def _head(self, ids, hidden, positions, mask, *, last: bool = False):
        """The head over ``ids`` (1, q) written after its cache's entries -> (features, logits);
        ``last``: keep the last logits only, eagerly (a prompt)."""
        past = self.cache.length
        q = ids.shape[1]
        out = self.forward(torch.arange(past, past + q, device=self.head.device), eager=last,
                           input_ids=ids, hidden=hidden, position_ids=positions,
                           attention_mask=mask, logits_to_keep=1 if last else 0)
        self.cache.set_length(past + q)
        return out

    def start(self, prompt_ids, hidden, params, generator) -> None:
        super().start(prompt_ids, hidden, params, generator)
        self.forward = model_forward(self.head, role="draft", compile=self.compile, call=_head_call,
                                     cache_config=self.head.layer_config)
        self.cache = self.forward.take_cache(self)
        self.cached = 0  # real entries in the head's cache (positions 0..cached-1)
        self.pending = self._fuse(hidden)  # (1, P, h): target features without an entry yet
        # (1, m) the tokens after the pending features' positions, where known (the prompt's
        # own: once per generation; later rounds' come from the device)
        self.pending_ids = torch.tensor([list(prompt_ids[1:])], dtype=torch.long,
                                        device=self.head.device)
        self.root_hidden = None  # (1, 1, h): the head's output at the last real entry
        self.root_logits = None  # (draft_vocab,)
        self._catch_up(last=True)

    @torch.no_grad()
    def _fuse(self, hidden) -> torch.Tensor:
        if not hidden:
            raise ValueError(
                "EagleProposer needs the target's hidden states; run it through "
                "SpeculativeEngine, which collects proposer.hidden_layers"
            )
        return self.head.fuse(torch.cat(list(hidden), dim=-1))

    @torch.no_grad()
    def _catch_up(self, last: bool = False) -> None:
        """Add the real entries whose feature and next token are both known."""
        n = min(self.pending.shape[1], self.pending_ids.shape[1])
        if n <= 0:
            return
        head = self.head
        positions = torch.arange(self.cached, self.cached + n, device=head.device)[None]
        mask = causal_mask(n, self.cached, head.dtype, head.device)
        out, logits = self._head(self.pending_ids[:, :n], self.pending[:, :n], positions, mask,
                                 last=last)
        self.root_hidden, self.root_logits = out[:, -1:], logits[0, -1]
        self.cached += n
        self.pending = self.pending[:, n:]
        self.pending_ids = self.pending_ids[:, n:]

    def observe(self, seq, tree, path, hidden) -> None:
        # the target's features at the old root and the accepted nodes become real entries; the
        # token after each is the next accepted one, then the round's next token
        self.pending = torch.cat([self.pending, self._fuse(hidden)], dim=1)
        keep, root = tree.verified
        tokens = tree.device(self.head.device).tokens[keep[1:] - 1]
        self.pending_ids = torch.cat([self.pending_ids, tokens[None], root[None]], dim=1)
        self._catch_up()

    # -- drafting --------------------------------------------------------------------------------

    def _shape(self, depth: int, k: int) -> list[int]:
        """Frontier rows expanded at depths 2..depth (the static pruning bound)."""
        rows = []
        for d in range(2, depth + 1):
            m = min(k, self.tree_nodes - d + 1) if self.prune else k
            if m < 1:
                break
            rows.append(m)
        return rows

    @torch.no_grad()
    def propose(self, seq: list[int], max_depth: int) -> DraftTree | None:
        depth = min(self.depth, max_depth)
        if depth < 1:
            return None
        self.forward.check_owner(self)
        if self.pending_ids.shape[1] < self.pending.shape[1]:  # the first token: once
            first = torch.tensor([seq[-1:]], dtype=torch.long, device=self.head.device)
            self.pending_ids = torch.cat([self.pending_ids, first], dim=1)
        self._catch_up()
        head, base = self.head, self.cached
        device = head.device

        logp = _log_probs(self.root_logits)  # (Vd,)
        k = min(self.topk, logp.numel())
        scores, draft_ids = logp.topk(k)  # (k,)
        tokens = head.draft_to_target(draft_ids)
        # every scored child: target token, parent candidate (-1 = root), cumulative log-prob
        all_tokens, all_parents, all_scores = [tokens], [torch.full_like(tokens, -1)], [scores]
        front = torch.arange(k, device=device)  # candidate ids of the frontier
        front_tokens, front_scores = tokens, scores
        front_hidden = self.root_hidden.expand(1, k, -1)  # (1, m, h)
        front_entry = torch.full((k,), -1, dtype=torch.long, device=device)  # parent entry
        ancestry = torch.zeros(0, 0, dtype=torch.bool, device=device)  # entry x entry
        count = k
        rows = self._shape(depth, k)
        for d, m in enumerate(rows, start=2):
            # the frontier is sorted best first: the bound keeps its first m rows
            front, front_tokens, front_scores = front[:m], front_tokens[:m], front_scores[:m]
            front_hidden, front_entry = front_hidden[:, :m], front_entry[:m]
            entries = ancestry.shape[0]
            self.expanded_rows += m
            # the new entries see the real prefix, their ancestors' entries and themselves
            seen = torch.zeros(m, entries + m, dtype=torch.bool, device=device)
            if entries:
                seen[:, :entries] = ancestry[front_entry.clamp_min(0)] & (front_entry >= 0)[:, None]
            seen[:, entries:] = torch.eye(m, dtype=torch.bool, device=device)
            ancestry = torch.cat([torch.nn.functional.pad(ancestry, (0, m)), seen], dim=0)
            mask = tree_attention_mask(seen, base, head.dtype, device)  # (1, 1, m, base + entries + m)
            positions = torch.full((1, m), base - 1 + d - 1, device=device)
            out, logits = self._head(front_tokens[None], front_hidden, positions, mask)
            step_logp = _log_probs(logits[0])  # (m, Vd)
            per = min(k, step_logp.shape[-1])
            child_scores, child_ids = step_logp.topk(per, dim=-1)  # (m, per)
            cumulative = (front_scores[:, None] + child_scores).reshape(-1)  # (m * per,)
            child_tokens = head.draft_to_target(child_ids).reshape(-1)
            all_tokens.append(child_tokens)
            all_parents.append(front.repeat_interleave(per))
            all_scores.append(cumulative)
            best = cumulative.topk(min(k, cumulative.numel())).indices
            front = count + best
            front_tokens, front_scores = child_tokens[best], cumulative[best]
            front_hidden = out[:, best // per]
            front_entry = entries + best // per
            count += cumulative.numel()
        crop(self.cache, base)  # draft-feature entries must not outlive this round

        scores = torch.cat(all_scores)
        n = min(self.tree_nodes, count)
        # stable sort: among equal scores the earlier (shallower) candidate, so parents come first
        order = torch.sort(scores, descending=True, stable=True).indices[:n]
        node_of = torch.zeros(count, dtype=torch.long, device=device).scatter(
            0, order, torch.arange(1, n + 1, device=device))
        parents = torch.cat(all_parents)[order]
        tree_parents = node_of[parents.clamp_min(0)] * (parents >= 0)
        ancestors, depths = ancestor_table(tree_parents, len(rows) + 1)
        return DraftTree.from_tensors(
            torch.cat(all_tokens)[order], tree_parents, depth_bound=len(rows) + 1,
            chain=k == 1, ancestors=ancestors, depths=depths,
            extra=HostScores(scores=scores[order]))


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


def chain_options(n: int) -> dict:
    """The head drafting a chain of ``n`` tokens (top-k 1): what llama.cpp's draft-eagle3 does."""
    return {"depth": n, "topk": 1, "tree_nodes": n}


def build_eagle(arg: str, name: str, ctx: BuildContext) -> EngineMethod:
    """``eagle:<artifact>``: EAGLE-2 trees, sized by --tree auto (the options cap the search)."""
    options = ctx.kind_options("eagle")
    if ctx.tree == TREE_FIXED and options.get("tree_nodes") == AUTO:
        raise ValueError("EAGLE trees take a node count; --tree auto (the command line's "
                         "default) chooses their depth, topk and nodes by measured cost")
    caps = tree_caps(options, "depth", "topk", "tree_nodes") if ctx.tree == TREE_AUTO else None
    proposer = EagleProposer.from_artifact(arg, ctx.target, dtype=ctx.draft_dtype, name=name,
                                           allow_other_weights=ctx.allow_other_weights,
                                           compile=ctx.compile, **options)
    chosen = None
    if caps is not None:
        chosen = auto_eagle_tree(proposer, arg, ctx.target, draft_dtype=ctx.draft_dtype,
                                 compile=ctx.compile, **caps,
                                 **ctx.tree_calibration)
    return EngineMethod(name, ctx.engine, proposer, chosen)


def serve_eagle(arg: str, name: str, ctx) -> list[str]:
    """``eagle:<artifact>`` in llama.cpp: the head exported to GGUF, ``--spec-type draft-eagle3``
    (``ctx``: draftsmith.eval.llama_bench.ServeContext)."""
    gguf = export_eagle_gguf(arg, ctx.work_dir / f"eagle-{len(list(ctx.work_dir.glob('*.gguf')))}.gguf",
                             target=ctx.target, gguf_type=ctx.gguf_type, overwrite=True)
    return ctx.draft_args(gguf, "draft-eagle3", 3)  # llama.cpp's own default
