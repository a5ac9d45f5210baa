"""Token trees: what a proposer hands to the verifier.

Node 0 is the root: the last emitted token, which the target has not seen yet. Nodes 1..n are
draft tokens; ``parents[i - 1]`` is the parent of node i and is always < i (topological order),
so the target can verify the whole tree in one forward pass over [root, node 1, ..., node n].
Children are tried in the order they appear, so proposers list the likeliest child first.

How the children of a node were chosen decides the exact acceptance rule used there:
``draft_probs[node]`` present -> they were sampled i.i.d. from that draft distribution
(SpecInfer's rule, a chain is the one-child case); absent -> they were chosen deterministically
(top-k, n-gram lookup), so each child's draft distribution is a point mass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    # node index -> (vocab,) warped draft distribution the children of that node were drawn from
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    # proposer-specific data carried from propose() to observe() (e.g. EAGLE's draft features)
    extra: object = None

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents, start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        self._children: list[list[int]] | None = None
        self._depths: list[int] | None = None

    @classmethod
    def chain(cls, tokens: list[int], draft_probs: list[torch.Tensor] | None = None) -> DraftTree:
        """A chain root -> t1 -> t2 ...; draft_probs[k] is the distribution t(k+1) was sampled from."""
        probs = {} if draft_probs is None else dict(enumerate(draft_probs))
        return cls(list(tokens), list(range(len(tokens))), probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def children(self) -> list[list[int]]:
        """children[node] = child node indices in trial order, for node in 0..n."""
        if self._children is None:
            kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
            for i, p in enumerate(self.parents, start=1):
                kids[p].append(i)
            self._children = kids
        return self._children

    @property
    def depths(self) -> list[int]:
        """depths[node], root = 0."""
        if self._depths is None:
            d = [0]
            for p in self.parents:
                d.append(d[p] + 1)
            self._depths = d
        return self._depths

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        return all(p == i for i, p in enumerate(self.parents))

    def chain_draft_probs(self) -> torch.Tensor | None:
        """(K, vocab) stacked draft distributions of a sampled chain; None for a point-mass chain."""
        if not self.draft_probs:
            return None
        if len(self.draft_probs) != len(self.tokens):
            raise ValueError("a sampled chain needs a draft distribution at every node but the last")
        return torch.stack([self.draft_probs[k] for k in range(len(self.tokens))])

    def ancestor_mask(self) -> torch.Tensor:
        """(n+1, n+1) bool: [i, j] is True when node j is node i or one of its ancestors."""
        n = len(self.tokens) + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i, p in enumerate(self.parents, start=1):
            mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (excluding the root)."""
        path = []
        while node != 0:
            path.append(node)
            node = self.parents[node - 1]
        return path[::-1]


def build_trie(branches: list[list[int]], tree_nodes: int) -> DraftTree:
    """Merge token sequences (best first) into a deterministic-children tree of at most tree_nodes.

    Shared prefixes are stored once; a branch is added token by token until the budget runs out.
    """
    tokens: list[int] = []
    parents: list[int] = []
    child_of: dict[tuple[int, int], int] = {}
    for branch in branches:
        node = 0
        for tok in branch:
            key = (node, tok)
            if key in child_of:
                node = child_of[key]
                continue
            if len(tokens) >= tree_nodes:
                break
            tokens.append(tok)
            parents.append(node)
            node = len(tokens)
            child_of[key] = node
    return DraftTree(tokens, parents)
