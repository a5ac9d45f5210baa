"""Block drafts in the evaluator: one draft forward per round proposes a whole chain.

``--method dflash:<artifact>`` / ``--method dspark:<artifact>``: :class:`BlockProposer`. The
draft keeps each layer's keys and values of every committed position (the target's hidden
states there, fused: :meth:`draftsmith.heads.dflash.DFlashDraft.context`), one entry per position the target
has processed, so between rounds it equals a fresh computation over the accepted sequence. A
round runs the block ``[anchor, MASK, ...]`` (the anchor is the sequence's last token, which the
target has not processed) once and reads its predictions:

* DFlash: slots 1..n, each position's own distribution (they do not depend on one another);
* DSpark: slots 0..n-1 left to right, each slot's logits plus the Markov term of the token drawn
  at the slot before (the anchor for the first), stopping at the first slot whose confidence is
  below ``min_confidence`` (a function of the draft alone, so exactness is untouched).

At temperature 0 the chain is the argmax tokens (verified greedily); above it, each token is
sampled from exactly the (warped) distribution its position gives, which the chain carries, so
the engine tests it with min(1, target / draft) against that distribution and samples the
residual on a rejection. ``block_size`` caps the tokens per round (the block the draft runs is
always the one it was trained with), ``--tree auto`` picks that count by expected tokens per
second on this machine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.eval.block_auto import auto_block_length
from draftsmith.eval.host import to_host
from draftsmith.eval.kv import grown
from draftsmith.eval.proposers import Proposer
from draftsmith.eval.runners import (
    ARTIFACT_FIXED_OPTIONS,
    TREE_AUTO,
    BuildContext,
    EngineMethod,
    OptionFlag,
    int_at_least,
    parse_probability,
)
from draftsmith.eval.sampling import warp
from draftsmith.eval.tree import DraftTree
from draftsmith.heads.artifact import read_artifact_config
from draftsmith.heads.dflash import ConfigValueError, DFlashConfig, DFlashDraft
from draftsmith.layouts.dflash import SPEC_TYPES, export_block, load_block_draft


class BlockProposer(Proposer):
    """Chains from a DFlash or DSpark draft; see the module docstring."""

    chains = True

    def __init__(self, draft: DFlashDraft, *, block_size: int | None = None,
                 min_confidence: float = 0.0, name: str = "dflash"):
        cfg = draft.config
        most = cfg.drafts_per_block
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(
                block_size, int) or block_size < 1):
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if block_size is not None and block_size > most:
            print(f"[dflash] {name}: block_size {block_size} is more than the {most} tokens a "
                  f"block of this draft predicts (it was trained with blocks of "
                  f"{cfg.block_size}); using {most}", flush=True)
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        if min_confidence and not cfg.confidence_head:
            raise ValueError(f"min_confidence needs a confidence head, and this {cfg.method} "
                             "draft has none")
        self.draft, self.name = draft, name
        self.tokens_per_round = most if block_size is None else min(block_size, most)
        self.min_confidence = min_confidence
        self.hidden_layers = cfg.hidden_states_read

    @classmethod
    def from_artifact(cls, path, target, *, dtype: torch.dtype | None = None,
                      method: str | None = None, block_size: int | None = None,
                      min_confidence: float = 0.0, name: str = "dflash",
                      allow_other_weights: bool = False) -> BlockProposer:
        try:
            draft = load_block_draft(path, target, dtype=dtype, method=method,
                                     allow_other_weights=allow_other_weights)
        except ConfigValueError as err:  # read from a published layout: which file said it
            raise ValueError(f"{Path(path) / 'config.json'}: {err} (the file is damaged or "
                             "hand-edited)") from err
        return cls(draft, block_size=block_size, min_confidence=min_confidence, name=name)

    def _features(self, hidden) -> torch.Tensor:
        return torch.cat(list(hidden), dim=-1)  # (1, n, L * H)

    def _commit(self, hidden) -> None:
        """The draft's keys and values of the target's states ``hidden``, written after the
        committed ones into buffers that grow by doubling (nothing is copied per round)."""
        features = self._features(hidden)  # (1, count, L * H)
        count = features.shape[1]
        positions = torch.arange(self.committed, self.committed + count,
                                 device=self.draft.device)[None]
        new = self.draft.context(features, positions)
        end = self.committed + count
        if end > self.capacity:
            self.capacity = grown(end)
            self.buffers = [tuple(torch.cat([old[:, :, : self.committed],
                                             old.new_zeros(*old.shape[:2],
                                                           self.capacity - self.committed,
                                                           old.shape[3])], dim=2)
                                  for old in pair) for pair in self.buffers]
        for (keys, values), (k, v) in zip(self.buffers, new, strict=True):
            keys[:, :, self.committed: end] = k
            values[:, :, self.committed: end] = v
        self.committed = end

    @torch.no_grad()
    def start(self, prompt_ids, hidden, params, generator) -> None:
        super().start(prompt_ids, hidden, params, generator)
        n = len(prompt_ids)
        self.capacity = grown(n)
        shapes = self.draft.context(self._features(hidden)[:, :1],
                                    torch.zeros(1, 1, dtype=torch.long, device=self.draft.device))
        self.buffers = [tuple(t.new_zeros(*t.shape[:2], self.capacity, t.shape[3]) for t in pair)
                        for pair in shapes]
        self.committed = 0
        self._commit(hidden)
        self.anchor = None  # (1,) the last emitted token on the device, from the last round

    @torch.no_grad()
    def propose(self, seq: list[int], max_depth: int) -> DraftTree | None:
        n = min(self.tokens_per_round, max_depth)
        if n < 1:
            return None
        draft, cfg = self.draft, self.draft.config
        p = len(seq) - 1  # the anchor's position; the context holds positions 0..p-1
        assert self.committed == p, "block draft context out of step"
        device = draft.device
        anchor = self.anchor
        if anchor is None:  # the first round's: the prefill's token, once per generation
            anchor = torch.tensor(seq[-1:], dtype=torch.long, device=device)
        block = torch.cat([anchor.to(device), torch.full((cfg.block_size - 1,), cfg.mask_token_id,
                                                         dtype=torch.long, device=device)])[None]
        positions = torch.arange(p, p + cfg.block_size, device=device)[None]
        allowed = torch.ones(1, cfg.block_size, p + cfg.block_size, dtype=torch.bool,
                             device=device)
        context = [(k[:, :, :p], v[:, :, :p]) for k, v in self.buffers]
        hidden = draft.block(block, positions, context, allowed)[0]  # (B, H)
        first = 0 if cfg.sample_from_anchor else 1
        gate = bool(cfg.confidence_head and self.min_confidence)
        tokens, probs, confident = [], [], []
        previous = anchor[0]
        for k in range(n):
            slot = hidden[first + k]
            if gate:
                confident.append(draft.confidence(slot, previous) >= self.min_confidence)
            logits = draft.logits(slot, previous if cfg.markov_rank else None)
            if self.params.greedy:
                choice = logits.argmax()
            else:
                q = warp(logits, self.params)
                choice = torch.multinomial(q, 1, generator=self.generator)[0]
                probs.append(self._on_target_vocab(q))
            token = draft.draft_to_target(choice)
            tokens.append(token)
            previous = token
        keep = n
        if gate:  # a block stops at its first unconfident slot: one read of the block's gates
            keep = next((i for i, ok in enumerate(to_host(torch.stack(confident))) if not ok),
                        n)
        if keep == 0:
            return None
        return DraftTree.chain(torch.stack(tokens[:keep]).reshape(keep), probs[:keep] or None)

    def _on_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft rows as one over the target's vocabulary."""
        columns = self.draft.draft_columns()
        if columns is None:
            return q
        full = q.new_zeros(self.draft.config.vocab_size)
        full[columns] = q
        return full

    @torch.no_grad()
    def observe(self, seq, tree, path, hidden) -> None:
        # hidden: the target's states at the old root and the accepted nodes, now committed
        self._commit(hidden)
        self.anchor = tree.verified[1]


# ---------------------------------------------------------------------------------------------
# the benchmark's methods: dflash:<artifact>, dspark:<artifact>

BLOCK_FLAGS = (
    OptionFlag("dflash", BlockProposer.from_artifact, "block_size", "--block-size",
               int_at_least(1), "dflash/dspark: most draft tokens per round (capped at what the "
               "draft's block predicts)", unset="the draft's block"),
    OptionFlag("dflash", BlockProposer.from_artifact, "min_confidence", "--block-min-confidence",
               parse_probability, "dspark: stop a block at the first token whose confidence "
               "is below this"),
)
BLOCK_FIXED_OPTIONS = {**ARTIFACT_FIXED_OPTIONS, "dtype": "--draft-dtype",
                       "method": "dflash:<artifact> or dspark:<artifact>"}


def chain_options(n: int) -> dict:
    """A block draft proposing ``n`` tokens a round: llama.cpp's block draft with that n_max."""
    return {"block_size": n}


def build_block(method: str):
    def build(arg: str, name: str, ctx: BuildContext) -> EngineMethod:
        options = ctx.kind_options("dflash")
        proposer = BlockProposer.from_artifact(
            arg, ctx.target, dtype=ctx.draft_dtype, method=method, name=name,
            allow_other_weights=ctx.allow_other_weights, **options)
        chosen = None
        if ctx.tree == TREE_AUTO and "block_size" not in options:  # a given size is kept
            chosen = auto_block_length(proposer, arg, ctx.target, draft_dtype=ctx.draft_dtype,
                                       compile=ctx.compile,
                                       **ctx.tree_calibration)
        return EngineMethod(name, ctx.engine, proposer, chosen)

    build.__name__ = f"build_{method}"
    return build


def serve_block(method: str):
    def serve(arg: str, name: str, ctx) -> list[str]:
        """``dflash:<artifact>`` in llama.cpp: exported to GGUF, ``--spec-type draft-dflash``
        (``draft-dspark``); ``ctx``: draftsmith.eval.llama_bench.ServeContext."""
        path = ctx.work_dir / f"{method}-{len(list(ctx.work_dir.glob('*.gguf')))}.gguf"
        gguf = export_block(arg, "gguf", path, target=ctx.target, gguf_type=ctx.gguf_type,
                            overwrite=True)
        most = DFlashConfig.from_dict(read_artifact_config(arg),
                                      Path(arg) / "config.json").drafts_per_block
        return ctx.draft_args(gguf, SPEC_TYPES[method], most)

    serve.__name__ = f"serve_{method}"
    return serve
