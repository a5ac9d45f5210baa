"""Proposers: where draft tokens come from. The engine verifies whatever tree they return.

The interface is small so Medusa and EAGLE heads plug in beside the draft LM and n-gram lookup:

* ``hidden_layers``: target hidden-state indices the proposer reads (transformers'
  ``output_hidden_states`` numbering; empty -> the engine does not collect them).
* ``start(prompt_ids, hidden, params, generator)``: once per generation, after the target's prefill;
  ``hidden`` holds the requested hidden states over the prompt, each (1, prompt_len, hidden).
* ``propose(seq, max_depth)``: a ``DraftTree`` rooted at ``seq[-1]`` no deeper than ``max_depth``, or
  None to let the target decode one token alone. ``seq`` is the whole sequence so far.
* ``observe(seq, tree, path, hidden)``: after verification. ``seq`` now ends with the new root,
  ``path`` lists the accepted tree nodes, ``hidden`` the requested hidden states at the old root
  and the accepted nodes, each (1, 1 + len(path), hidden). Caches must be brought in line here.
* ``exact`` (default True). A proposer that defines ``lossy_verify(tree, logits, params,
  generator) -> TreeOutcome`` replaces the exact rule with its own and must set ``exact = False``.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from eval.kv import keep_tree_path, new_cache
from eval.sampling import SamplingParams, warp
from eval.tree import DraftTree, build_trie
from heads.target import tree_attention_mask


class Proposer:
    name = "plain"
    hidden_layers: tuple[int, ...] = ()
    exact = True

    def start(self, prompt_ids: list[int], hidden, params: SamplingParams, generator) -> None:
        self.params = params
        self.generator = generator

    def propose(self, seq: list[int], max_depth: int) -> DraftTree | None:
        return None

    def observe(self, seq: list[int], tree: DraftTree, path: list[int], hidden) -> None:
        return None


class NgramProposer(Proposer):
    """Prompt lookup: continue the latest earlier occurrence of the sequence's last n-gram.

    Longest n-gram first (max_ngram down to min_ngram), continued for up to ``max_depth``
    tokens. With ``max_branches`` > 1 the continuations of several distinct earlier occurrences
    (most recent first) are merged into a trie of at most ``tree_nodes`` tokens and verified
    together. Proposals are deterministic, so verification uses the point-mass rule and stays
    exact at any temperature.
    """

    name = "pld"

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1, max_depth: int = 10,
                 max_branches: int = 1, tree_nodes: int = 10):
        for key, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram),
                           ("max_depth", max_depth), ("max_branches", max_branches),
                           ("tree_nodes", tree_nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NgramProposer {key} must be an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"need min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_depth, self.max_branches, self.tree_nodes = max_depth, max_branches, tree_nodes

    def propose(self, seq: list[int], max_depth: int) -> DraftTree | None:
        depth = min(self.max_depth, max_depth)
        if depth < 1:
            return None
        arr = np.asarray(seq, dtype=np.int64)
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(arr[:-1], n)  # (len - n, n): every earlier n-gram
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size == 0:
                continue
            branches: list[list[int]] = []
            seen: set[tuple[int, ...]] = set()
            for start in hits[::-1]:
                cont = tuple(arr[start + n : start + n + depth].tolist())
                if cont and cont not in seen:
                    seen.add(cont)
                    branches.append(list(cont))
                    if len(branches) == self.max_branches:
                        break
            if len(branches) == 1:
                return DraftTree.chain(branches[0][: self.tree_nodes])
            return build_trie(branches, self.tree_nodes)
        return None


class DraftModelProposer(Proposer):
    """A small causal LM sharing the target's vocabulary, drafting a chain or a static tree.

    Chain (``branching`` None): up to ``max_depth`` tokens, stopping early once the draft's
    probability of the token it just proposed falls below ``min_confidence`` (later tokens would
    rarely survive verification). Tree: ``branching[d]`` children under every node of depth d,
    either the draft's top-k (``children="topk"``, verified with the deterministic-children rule)
    or k i.i.d. samples from its warped distribution (``children="sample"``, SpecInfer's rule);
    the draft expands one whole depth per forward with a tree attention mask over its own cache.
    At temperature 0 tokens are the draft's argmax / top-k.
    """

    name = "draft"

    def __init__(self, model, *, max_depth: int = 6, min_confidence: float = 0.4,
                 branching: list[int] | None = None, children: str = "topk",
                 name: str = "draft"):
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an integer >= 1, got {max_depth!r}")
        if not 0.0 <= min_confidence <= 1.0:  # NaN fails too
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        if branching is not None and (not branching or min(branching) < 1):
            raise ValueError(f"branching needs one count >= 1 per depth, got {branching}")
        if children not in ("topk", "sample"):
            raise ValueError(f"children must be 'topk' or 'sample', got {children!r}")
        self.model = model
        self.max_depth = max_depth if branching is None else len(branching)
        self.min_confidence = min_confidence
        self.branching = list(branching) if branching is not None else None
        self.children = children
        self.name = name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def start(self, prompt_ids, hidden, params, generator) -> None:
        super().start(prompt_ids, hidden, params, generator)
        self.cache = new_cache(self.model)
        self.cached: list[int] = []  # tokens on the accepted sequence the draft cache holds
        self.base = 0
        self.fed: list[int] = []  # tree nodes whose entries follow the first ``base`` ones

    def _forward(self, tokens: list[int], **kwargs) -> torch.Tensor:
        return self.model(
            input_ids=torch.tensor([tokens], device=self.device), cache=self.cache,
            use_cache=True, **kwargs,
        ).logits[0]  # (len(tokens) or kept, vocab)

    @torch.no_grad()
    def propose(self, seq: list[int], max_depth: int) -> DraftTree | None:
        depth = min(self.max_depth, max_depth)
        if depth < 1:
            return None
        feed = seq[len(self.cached):]
        logits = self._forward(feed, logits_to_keep=1)[-1]  # (vocab,) at the root
        self.cached.extend(feed)
        self.base = len(seq)  # the draft cache now holds all of seq
        self.fed = []
        if self.branching is None:
            return self._chain(logits, depth)
        return self._tree(logits, depth)

    def _chain(self, logits: torch.Tensor, depth: int) -> DraftTree:
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for d in range(depth):
            if self.params.greedy:
                tok = int(logits.argmax())
                confidence = (
                    float(torch.softmax(logits.float(), -1)[tok]) if self.min_confidence > 0 else 1.0
                )
            else:
                q = warp(logits, self.params)
                tok = int(torch.multinomial(q, 1, generator=self.generator))
                probs.append(q)
                confidence = float(q[tok])
            tokens.append(tok)
            if d == depth - 1 or confidence < self.min_confidence:
                break
            logits = self._forward([tok], logits_to_keep=1)[-1]
            self.fed.append(len(tokens))
        return DraftTree.chain(tokens, probs or None)

    def _tree(self, root_logits: torch.Tensor, depth: int) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        draft_probs: dict[int, torch.Tensor] = {}
        ancestors: dict[int, list[int]] = {0: []}  # node -> its tree ancestors (root excluded)
        frontier = [(0, root_logits)]
        sample = self.children == "sample" and not self.params.greedy
        for d in range(depth):
            k = self.branching[d]
            grown: list[int] = []
            for node, logits in frontier:
                if sample:
                    q = warp(logits, self.params)
                    kids = torch.multinomial(q, k, replacement=True, generator=self.generator)
                    draft_probs[node] = q
                else:
                    kids = torch.topk(logits, min(k, logits.shape[-1])).indices
                for tok in kids.tolist():
                    tokens.append(tok)
                    parents.append(node)
                    grown.append(len(tokens))
                    ancestors[len(tokens)] = ancestors[node] + [len(tokens)]
            if d == depth - 1:
                break
            # one draft forward over the whole new depth: each node sees the accepted sequence
            # and its own tree ancestors (already in the draft cache) plus itself
            fed_at = {n: i for i, n in enumerate(self.fed + grown)}
            allowed = torch.zeros(len(grown), len(fed_at), dtype=torch.bool)
            for row, n in enumerate(grown):
                allowed[row, [fed_at[a] for a in ancestors[n]]] = True
            mask = tree_attention_mask(allowed, self.base, self.dtype, self.device)
            positions = torch.full((1, len(grown)), self.base + d, device=self.device)
            out = self._forward([tokens[n - 1] for n in grown], attention_mask=mask,
                                position_ids=positions)
            self.fed.extend(grown)
            frontier = list(zip(grown, out))
        return DraftTree(tokens, parents, draft_probs)

    def observe(self, seq, tree, path, hidden) -> None:
        # the cache holds seq[:base] then the fed tree nodes; keep the accepted ones, in order
        fed_at = {n: i for i, n in enumerate(self.fed)}
        keep = []
        for node in path:
            if node not in fed_at:
                break
            keep.append(fed_at[node])
        keep_tree_path(self.cache, self.base, keep)
        self.cached = self.cached[: self.base] + [tree.tokens[n - 1] for n in path[: len(keep)]]
        self.fed = []
