"""Token trees: what a proposer hands to the verifier.

Node 0 is the root: the last emitted token, which the target has not seen yet. Nodes 1..n are
draft tokens; ``parents[i - 1]`` is the parent of node i and is always < i (topological order),
so the target can verify the whole tree in one forward pass over [root, node 1, ..., node n].
Children are tried in the order they appear, so proposers list the likeliest child first.

How the children of a node were chosen decides the exact acceptance rule used there:
``draft_probs[node]`` present -> they were sampled i.i.d. from that draft distribution
(SpecInfer's rule, a chain is the one-child case); absent -> they were chosen deterministically
(top-k, n-gram lookup), so each child's draft distribution is a point mass.

A tree lives where its proposer made it. Host proposers (n-gram lookup, a static tree filled
from a host list) give lists; device proposers (EAGLE, Medusa, a draft LM) give tensors
(:meth:`DraftTree.from_tensors`) that never come to the host during a round: the engine builds
the verification's positions and mask and runs the acceptance from :meth:`DraftTree.device`,
and only the accepted path crosses to the host. The list views (``tokens``, ``parents``,
``children``...) of a device tree are read once, on first use (tests, reports), through
:func:`draftsmith.eval.host.to_host`. Sizes (``len``, ``depth_bound``, ``is_chain``) are always known on the
host: the shapes of a round never depend on values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.eval.host import to_host


@dataclass
class DeviceTree:
    """A tree's tensors on one device (n nodes after the root)."""

    tokens: torch.Tensor  # (n,) int64
    parents: torch.Tensor  # (n,) int64, in 0..n-1 (0 = the root)
    depths: torch.Tensor  # (n + 1,) int64, the root's 0
    ancestors: torch.Tensor  # (n + 1, n + 1) bool: [i, j] when j is i or one of its ancestors


def ancestor_table(parents: torch.Tensor, depth_bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) parents (node i + 1's parent, in 0..i) -> ancestors (n + 1, n + 1) bool and depths
    (n + 1,), on the parents' device, by pointer jumping: ceil(log2(depth_bound)) + 1 gathers,
    no value read on the host."""
    n = parents.shape[0]
    device = parents.device
    up = torch.cat([torch.zeros(1, dtype=torch.long, device=device), parents.long()])  # (n+1,)
    eye = torch.eye(n + 1, dtype=torch.bool, device=device)
    ancestors = eye | torch.nn.functional.one_hot(up, n + 1).bool()
    ancestors[0] = eye[0]
    reach = 1
    while reach < depth_bound:  # after each jump every node knows twice as many generations
        ancestors = ancestors | (ancestors.float() @ ancestors.float() > 0)
        reach *= 2
    depths = ancestors.sum(-1) - 1
    return ancestors, depths


class DraftTree:
    """A draft tree (see the module docstring): ``DraftTree(tokens, parents, draft_probs,
    extra)`` from host lists, or :meth:`from_tensors`."""

    def __init__(self, tokens, parents, draft_probs: dict[int, torch.Tensor] | None = None,
                 extra: object = None):
        tokens, parents = list(tokens), list(parents)
        if len(tokens) != len(parents):
            raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
        for i, p in enumerate(parents, start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        self._tokens, self._parents = tokens, parents
        self.draft_probs = dict(draft_probs or {})
        # proposer-specific data carried from propose() to observe() (e.g. EAGLE's draft features)
        self.extra = extra
        self._size = len(tokens)
        self._children: list[list[int]] | None = None
        self._depths: list[int] | None = None
        self._device: dict[torch.device, DeviceTree] = {}
        self._chain: bool | None = None
        self._bound: int | None = None
        self.verified = None  # set by the engine before observe(): the round's accepted path

    @classmethod
    def from_tensors(cls, tokens: torch.Tensor, parents: torch.Tensor, *, depth_bound: int,
                     chain: bool = False, ancestors: torch.Tensor | None = None,
                     depths: torch.Tensor | None = None,
                     draft_probs: dict[int, torch.Tensor] | None = None,
                     host_parents: list[int] | None = None, extra: object = None) -> DraftTree:
        """A tree made on the device: ``tokens`` and ``parents`` (n,), no node deeper than
        ``depth_bound`` (known on the host, e.g. the proposer's depth), ``chain`` when every node
        is its predecessor's child. ``ancestors`` / ``depths`` when the proposer has them (else
        computed on the device); ``host_parents`` when the tree's form is known on the host (a
        static tree), so that its host views need no read. Parents must precede their children
        (not checked: that would read them)."""
        tree = cls.__new__(cls)
        tree._tokens = None
        tree._parents = None if host_parents is None else list(host_parents)
        tree.draft_probs = dict(draft_probs or {})
        tree.extra = extra
        tree._size = int(tokens.shape[0])
        tree._children = tree._depths = None
        tree._chain, tree._bound = chain, max(0, depth_bound)
        if ancestors is None or depths is None:
            ancestors, depths = ancestor_table(parents, tree._bound)
        tree._device = {tokens.device: DeviceTree(tokens.long(), parents.long(), depths.long(),
                                                   ancestors.bool())}
        tree.verified = None
        return tree

    @classmethod
    def chain(cls, tokens, draft_probs: list[torch.Tensor] | None = None) -> DraftTree:
        """A chain root -> t1 -> t2 ...; draft_probs[k] is the distribution t(k+1) was sampled
        from. ``tokens`` a host list, or a device tensor (the chain then stays there)."""
        probs = {} if draft_probs is None else dict(enumerate(draft_probs))
        if isinstance(tokens, torch.Tensor):
            n = int(tokens.shape[0])
            parents = torch.arange(n, device=tokens.device)
            ancestors = torch.ones(n + 1, n + 1, dtype=torch.bool, device=tokens.device).tril()
            depths = torch.arange(n + 1, device=tokens.device)
            return cls.from_tensors(tokens, parents, depth_bound=n, chain=True,
                                    ancestors=ancestors, depths=depths, draft_probs=probs)
        return cls(list(tokens), list(range(len(tokens))), probs)

    # -- host views ------------------------------------------------------------------------------

    def _read(self) -> None:
        device = next(iter(self._device.values()))
        if self._parents is None:
            both = to_host(torch.stack([device.tokens, device.parents]))
            self._tokens, self._parents = both[0], both[1]
        elif self._tokens is None:
            self._tokens = to_host(device.tokens)

    @property
    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._read()
        return self._tokens

    @property
    def parents(self) -> list[int]:
        if self._parents is None:
            self._read()
        return self._parents

    @property
    def form_on_host(self) -> bool:
        """Whether the parents are known on the host without a read."""
        return self._parents is not None

    def __len__(self) -> int:
        return self._size

    @property
    def children(self) -> list[list[int]]:
        """children[node] = child node indices in trial order, for node in 0..n."""
        if self._children is None:
            kids: list[list[int]] = [[] for _ in range(self._size + 1)]
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
    def depth_bound(self) -> int:
        """No node is deeper than this (the exact depth for a host tree)."""
        if self._bound is None:
            self._bound = self.max_depth
        return self._bound

    @property
    def is_chain(self) -> bool:
        if self._chain is None:
            self._chain = all(p == i for i, p in enumerate(self.parents))
        return self._chain

    def chain_draft_probs(self) -> torch.Tensor | None:
        """(K, vocab) stacked draft distributions of a sampled chain; None for a point-mass chain."""
        if not self.draft_probs:
            return None
        if len(self.draft_probs) != self._size:
            raise ValueError("a sampled chain needs a draft distribution at every node but the last")
        return torch.stack([self.draft_probs[k] for k in range(self._size)])

    def ancestor_mask(self) -> torch.Tensor:
        """(n+1, n+1) bool: [i, j] is True when node j is node i or one of its ancestors."""
        n = self._size + 1
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

    # -- device views ----------------------------------------------------------------------------

    def device(self, device: torch.device | str) -> DeviceTree:
        """The tree's tensors on ``device`` (a host tree is copied there once)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        found = self._device.get(device)
        if found is None:
            if self._device:  # made on another device
                other = next(iter(self._device.values()))
                found = DeviceTree(*(t.to(device) for t in (other.tokens, other.parents,
                                                            other.depths, other.ancestors)))
            else:  # host lists: built here, copied in one transfer
                n = self._size
                packed = torch.cat([torch.tensor(self._tokens + self._parents + self.depths,
                                                 dtype=torch.long),
                                    self.ancestor_mask().long().flatten()]).to(device)
                found = DeviceTree(packed[:n], packed[n:2 * n], packed[2 * n:3 * n + 1],
                                   packed[3 * n + 1:].view(n + 1, n + 1).bool())
            self._device[device] = found
        return found


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
