"""Reference Medusa loss and rank counts, the plain unchunked computation.

Tests check the trainer's chunked loss and its held-out rank counts against these: a pure
function of whole (batch, seq, vocab) logits, written to be read rather than to be fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def _head_slices(head_logits, input_ids: torch.Tensor, loss_mask: torch.Tensor):
    """Yield (k, logits (B, T-1-k, V), labels (B, T-1-k), mask (B, T-1-k)) for k = 1..K.

    Head k at position t predicts token t+1+k, which is scored when loss_mask[t+1+k] is 1.
    """
    if input_ids.shape != loss_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and loss_mask "
                         f"{tuple(loss_mask.shape)} must both be (batch, seq)")
    seq = input_ids.shape[1]
    for k, logits in enumerate(head_logits, start=1):
        if logits.shape[:2] != input_ids.shape:
            raise ValueError(f"head {k} logits have shape {tuple(logits.shape)}, expected "
                             f"(batch, seq, vocab) matching input_ids {tuple(input_ids.shape)}")
        span = max(0, seq - 1 - k)
        yield (k, logits[:, :span], input_ids[:, 1 + k:1 + k + span],
               loss_mask[:, 1 + k:1 + k + span].to(torch.float32))


@dataclass
class MedusaLoss:
    total: torch.Tensor  # () weighted sum over heads, what to backpropagate
    per_head: torch.Tensor  # (K,) detached mean loss of each head, for logging
    weights: list[float] = field(default_factory=list)  # the per-head weights used
    tokens: torch.Tensor | None = None  # (K,) scored positions per head


def medusa_loss(head_logits: torch.Tensor | Sequence[torch.Tensor], input_ids: torch.Tensor,
                loss_mask: torch.Tensor, target_logits: torch.Tensor | None = None,
                decay: float = 0.8) -> MedusaLoss:
    """The Medusa training loss: sum_k decay**k * mean cross-entropy of head k (k = 1..K).

    head_logits: (K, B, T, V) or K tensors (B, T, V), head k's logits at every position;
    input_ids, loss_mask: (B, T), the collated batch (loss_mask[t] = 1: token t is to be
    predicted). Hard labels are the data's tokens t+1+k. With ``target_logits`` (B, T, V), the
    frozen target's own logits on the same batch, the labels are soft instead: head k at position
    t matches softmax(target_logits[t+k]), the target's distribution of token t+1+k given the true
    prefix (Medusa-2 self-distillation). Each head's loss is averaged over its scored positions.
    """
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    if target_logits is not None and target_logits.shape[:2] != input_ids.shape:
        raise ValueError(f"target_logits {tuple(target_logits.shape)} must be (batch, seq, vocab) "
                         f"matching input_ids {tuple(input_ids.shape)}")
    seq = input_ids.shape[1]
    total = None
    per_head, weights, counts = [], [], []
    for k, logits, labels, mask in _head_slices(head_logits, input_ids, loss_mask):
        log_probs = logits.float().log_softmax(-1)  # (B, T-1-k, V)
        if target_logits is None:
            ce = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        else:
            soft = target_logits[:, k:seq - 1].detach().float().softmax(-1)
            ce = -(soft * log_probs).sum(-1)
        n = mask.sum()
        loss_k = (ce * mask).sum() / n.clamp_min(1.0)
        weight = decay ** k
        total = weight * loss_k if total is None else total + weight * loss_k
        per_head.append(loss_k.detach())
        weights.append(weight)
        counts.append(n.detach())
    if total is None:
        raise ValueError("head_logits is empty: pass the logits of at least one head")
    return MedusaLoss(total, torch.stack(per_head), weights, torch.stack(counts))


@torch.no_grad()
def rank_hits(head_logits: torch.Tensor | Sequence[torch.Tensor], input_ids: torch.Tensor,
              loss_mask: torch.Tensor, topk: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """How often the true token t+1+k is head k's r-th guess, on scored positions.

    -> hits (K, topk) int64: hits[k-1, r] counts positions where the label is head k's rank-r
    token; totals (K,) int64: scored positions per head. Sum these over a held-out set (and over
    processes), then turn them into draftsmith.heads.medusa.rank_accuracy (what the tree is built from) and
    draftsmith.heads.medusa.topk_accuracy (what to log).
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    hits, totals = [], []
    for _, logits, labels, mask in _head_slices(head_logits, input_ids, loss_mask):
        k = min(topk, logits.shape[-1])
        guesses = logits.topk(k, dim=-1).indices  # (B, T', k)
        found = (guesses == labels.unsqueeze(-1)) & (mask.unsqueeze(-1) > 0)
        row = found.reshape(-1, k).sum(0)
        if k < topk:
            row = torch.cat([row, row.new_zeros(topk - k)])
        hits.append(row)
        totals.append(mask.sum().long())
    return torch.stack(hits).long(), torch.stack(totals).long()

