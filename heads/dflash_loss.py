"""The block drafts' loss, beside their module (heads/dflash.py).

Training runs many blocks of one sequence in one forward: ``anchors`` positions p are drawn per
row (:func:`sample_anchors`: positions whose next token the loss scores, without replacement,
from a seeded generator, so a resumed run draws the same), each starting a block ``[x_p, MASK,
..., MASK]`` at positions p .. p + B - 1 that sees the fused context of positions < p and its
own block (:func:`draftsmith.heads.dflash.block_mask`), all blocks in parallel.

Slot j's label is the token at p + j (DFlash, slots 1..B-1) or p + j + 1 (DSpark, slots 0..B-1),
scored while it is inside the sequence and scored by ``loss_mask``, and only as long as every
earlier slot of its block is (a block's predictions are a chain). Each slot's loss is

    hard_weight * CE(true token) + soft_weight * CE(the target's distribution there)

through :func:`draftsmith.heads.chunked_loss.projected_cross_entropy` (the target's distribution predicting
position q is its LM head on its last hidden state at q - 1; over a draft vocabulary it is
restricted to the draft rows), weighted by the DFlash paper's position decay
``exp(-(k - 1) / gamma)`` (k = 1 for the first predicted slot), summed. DSpark's Markov term
enters the same projection (its states carry ``markov_w1[previous]`` beside the hidden state, its
weight ``markov_w2`` beside the LM head's: the logits are exactly U + W2 W1[prev]), teacher-forced
with the true previous token; its confidence head is trained with a binary cross-entropy against
the acceptance the draft's own distribution would get, 1 - TV(draft, target) (no gradient through
the target), at ``conf_weight``.

The sum is normalised by the trainer: a row's weight is its number of blocks times the sum of the
position weights (:func:`row_block_weight`), known before the anchors are drawn.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from draftsmith.heads.chunked_loss import DEFAULT_CHUNK_SIZE, DraftLoss, projected_cross_entropy
from draftsmith.heads.dflash import DFlashDraft, block_mask
from draftsmith.heads.draft_vocab import target_to_draft

DEFAULT_GAMMA = 4.0  # the position decay's gamma (speculators' and DeepSpec's; SpecForge: 7)
DEFAULT_ANCHORS = 16  # blocks per row and step
DEFAULT_CONF_WEIGHT = 1.0


def position_weights(draft: DFlashDraft, gamma: float = DEFAULT_GAMMA) -> list[float]:
    """The weight of each predicted slot, the first predicted one 1."""
    return [math.exp(-k / gamma) for k in range(draft.config.drafts_per_block)]


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """(S,) bool: the positions p >= 1 whose next token the loss scores."""
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    if loss_mask.shape[-1] > 2:
        out[..., 1:-1] = loss_mask[..., 2:].bool()
    return out


def row_block_weight(loss_mask, anchors: int, weights: list[float]) -> float:
    """A row's weight in the step's normalisation: its blocks times the position weights' sum."""
    mask = torch.as_tensor(loss_mask)
    return min(anchors, int(anchor_candidates(mask).sum())) * sum(weights)


def sample_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """(B, S) -> (B, A) anchors per row, ascending, -1 where a row has fewer candidates."""
    rows = []
    for row in anchor_candidates(loss_mask):
        where = row.nonzero().flatten()
        order = torch.randperm(where.numel(), generator=generator)[:count]
        rows.append(where[order.to(where.device)].sort().values)
    width = max(1, max(r.numel() for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.long, device=loss_mask.device)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r
    return out


def dflash_loss(draft: DFlashDraft, batch: dict, anchors: torch.Tensor, *,
                gamma: float = DEFAULT_GAMMA, hard_weight: float = 1.0, soft_weight: float = 0.0,
                conf_weight: float = DEFAULT_CONF_WEIGHT, chunk_size: int = DEFAULT_CHUNK_SIZE,
                gradient_checkpointing: bool = False) -> tuple[torch.Tensor, dict]:
    """The weighted loss summed over every scored slot, and its metrics.

    batch: input_ids, attention_mask, loss_mask (B, S), features (B, S, L * H) (the target's
    hidden states at ``target_layer_ids``), last_hidden (B, S, H) (its final-normed state, for
    the soft term and DSpark's confidence target); anchors (B, A) from :func:`sample_anchors`.
    metrics: ``acc_<k>`` (correct, scored) per predicted slot k, ``conf_loss`` (DSpark).
    ``gradient_checkpointing``: the draft's layers are recomputed in backward (the same loss).
    """
    cfg = draft.config
    ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
    valid_tokens = batch["attention_mask"].bool()
    B, S = ids.shape
    A, size = anchors.shape[1], cfg.block_size
    positions = torch.arange(S, device=ids.device).expand(B, S)
    context = draft.context(batch["features"], positions)
    slot = torch.arange(size, device=ids.device)
    block_pos = anchors.clamp_min(0)[:, :, None] + slot  # (B, A, size)
    block_ids = torch.full((B, A, size), cfg.mask_token_id, dtype=torch.long, device=ids.device)
    block_ids[:, :, 0] = ids.gather(1, anchors.clamp_min(0))
    hidden = draft.block(block_ids.view(B, A * size), block_pos.view(B, A * size), context,
                         block_mask(valid_tokens, anchors, size),
                         gradient_checkpointing=gradient_checkpointing).view(B, A, size, -1)
    weights = position_weights(draft, gamma)
    columns = draft.draft_columns() if soft_weight else None
    weight = draft.logit_weight
    if cfg.markov_rank:
        weight = torch.cat([weight, draft.markov_head.markov_w2.weight], dim=1)
    total = hidden.new_zeros(())
    metrics: dict[str, tuple] = {}
    alive = anchors >= 0  # (B, A): the block's earlier slots were all scored
    conf_total = hidden.new_zeros(())
    offset = 1 if cfg.sample_from_anchor else 0
    for k, w in enumerate(weights):
        j = k + 1 - offset  # the block slot
        label_pos = anchors + k + 1  # the position whose token slot j predicts
        inside = label_pos < S
        safe = label_pos.clamp(max=S - 1).clamp_min(0)
        alive = alive & inside & loss_mask.gather(1, safe) & valid_tokens.gather(1, safe)
        if not bool(alive.any()):
            break
        b, a = alive.nonzero(as_tuple=True)
        q = label_pos[b, a]
        states = hidden[b, a, j]  # (n, H)
        previous = ids[b, q - 1]  # the true token before the label (the anchor for the first)
        code = None
        if cfg.markov_rank:
            code = draft.markov_head.markov_w1(previous)
            states = torch.cat([states, code.to(states.dtype)], dim=-1)
        labels = ids[b, q]
        if cfg.draft_vocab_size is not None:
            labels = target_to_draft(draft.t2d, labels, draft.d2t)
        teacher = {}
        if soft_weight or cfg.confidence_head:
            teacher = {"teacher_states": batch["last_hidden"][b, q - 1],
                       "teacher_head": draft.frozen.lm_head}
        out = projected_cross_entropy(
            states, weight, labels, **(teacher if soft_weight else {}),
            teacher_columns=columns, hard_weight=hard_weight, soft_weight=soft_weight,
            chunk_size=chunk_size)
        total = total + w * out.loss
        metrics[f"acc_{k}"] = (out.hits[0], torch.tensor(labels.numel(), device=ids.device))
        if cfg.confidence_head and conf_weight:
            with torch.no_grad():
                accept = _acceptance(draft, states, weight, teacher["teacher_states"],
                                     draft.draft_columns(), chunk_size)
            logit = draft.confidence_head(hidden[b, a, j], code)
            conf = F.binary_cross_entropy_with_logits(logit.float(), accept, reduction="sum")
            conf_total = conf_total + w * conf.detach()
            total = total + conf_weight * w * conf
    if cfg.confidence_head:
        metrics["conf_loss"] = (conf_total, hidden.new_tensor(float(max(1, int(alive.sum())))))
    return total, metrics


@torch.no_grad()
def _acceptance(draft: DFlashDraft, states, weight, teacher_states, columns,
                chunk_size: int) -> torch.Tensor:
    """1 - TV(draft, target) per row: the chance a token sampled from the draft is accepted."""
    out = []
    for start in range(0, states.shape[0], chunk_size):
        s = states[start:start + chunk_size]
        mine = torch.softmax((s @ weight.T.to(s.dtype)).float(), dim=-1)
        theirs = torch.softmax(draft.frozen.lm_head(teacher_states[start:start + chunk_size])
                               .float(), dim=-1)
        if columns is not None:
            restricted = theirs[:, columns]
            theirs = restricted  # mass outside the draft rows can never be drafted
        out.append(1.0 - 0.5 * (mine - theirs).abs().sum(-1) - 0.5 * (
            1.0 - theirs.sum(-1)))
    return torch.cat(out).clamp(0.0, 1.0)


class DFlashLoss(DraftLoss):
    """The draft plus its loss as one module, what a trainer hands to ``accelerator.prepare``
    (one DDP forward per micro-batch; the draft stays ``.draft``). The keywords are
    :func:`dflash_loss`'s; ``forward(batch, anchors) -> (loss, metrics)``."""

    OPTIONS = ("gamma", "hard_weight", "soft_weight", "conf_weight", "chunk_size",
               "gradient_checkpointing")

    def __init__(self, draft: DFlashDraft, **options):
        super().__init__(**options)
        self.draft = draft

    def forward(self, batch: dict, anchors: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return dflash_loss(self.draft, batch, anchors, **self.loss_kwargs)
