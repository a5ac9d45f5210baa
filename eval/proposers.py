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
from numpy.lib.stride_tricks import sliding_window_view

from draftsmith.eval.sampling import SamplingParams
from draftsmith.eval.tree import DraftTree, build_trie


class Proposer:
    name = "plain"
    hidden_layers: tuple[int, ...] = ()
    exact = True
    chains = False  # it drafts chains only (the cost model times chain rounds for it)

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

    @property
    def chains(self) -> bool:
        return self.max_branches == 1

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
