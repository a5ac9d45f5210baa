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

from eval.kv import crop, new_cache
from eval.sampling import SamplingParams, warp
from eval.tree import DraftTree, build_trie


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

    Longest n-gram first (max_ngram down to min_ngram). With ``max_branches`` > 1 the
    continuations of several distinct earlier occurrences (most recent first) are merged into a
    trie of at most ``max_nodes`` tokens and verified together. Proposals are deterministic, so
    verification uses the point-mass rule and stays exact at any temperature.
    """

    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_depth: int = 10,
                 max_branches: int = 1, max_nodes: int = 10):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_depth < 1 or max_branches < 1 or max_nodes < 1:
            raise ValueError("max_depth, max_branches and max_nodes must be >= 1")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_depth, self.max_branches, self.max_nodes = max_depth, max_branches, max_nodes

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
                return DraftTree.chain(branches[0][: self.max_nodes])
            return build_trie(branches, self.max_nodes)
        return None


class DraftModelProposer(Proposer):
    """A chain from a small causal LM sharing the target's vocabulary, with its own KV cache.

    Drafts up to ``max_depth`` tokens, stopping early once the draft's probability of the token it
    just proposed falls below ``min_confidence`` (later tokens would rarely survive verification).
    At temperature > 0 tokens are sampled from the warped draft distribution, recorded for the
    exact chain rule; at temperature 0 they are the draft's argmax.
    """

    name = "draft"

    def __init__(self, model, max_depth: int = 6, min_confidence: float = 0.0, name: str = "draft"):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.model = model
        self.max_depth = max_depth
        self.min_confidence = min_confidence
        self.name = name
        self.device = next(model.parameters()).device

    def start(self, prompt_ids, hidden, params, generator) -> None:
        super().start(prompt_ids, hidden, params, generator)
        self.cache = new_cache(self.model)
        self.cached: list[int] = []  # tokens whose keys/values the draft cache holds

    @torch.no_grad()
    def propose(self, seq: list[int], max_depth: int) -> DraftTree | None:
        depth = min(self.max_depth, max_depth)
        if depth < 1:
            return None
        feed = seq[len(self.cached):]
        self.base = len(seq)  # after this call the cache holds all of seq
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(depth):
            logits = self.model(
                input_ids=torch.tensor([feed], device=self.device), cache=self.cache,
                use_cache=True, logits_to_keep=1,
            ).logits[0, -1]  # (vocab,)
            self.cached.extend(feed)
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
            feed = [tok]
            if confidence < self.min_confidence:
                break
        return DraftTree.chain(tokens, probs or None)

    def observe(self, seq, tree, path, hidden) -> None:
        # keep only the cached tokens that are still part of the sequence
        keep = min(getattr(self, "base", 0), len(self.cached))
        limit = min(len(self.cached), len(seq))
        while keep < limit and self.cached[keep] == seq[keep]:
            keep += 1
        if keep < len(self.cached):
            crop(self.cache, keep)
            del self.cached[keep:]
