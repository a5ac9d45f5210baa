"""The Medusa heads' loss: every head's vocabulary projection chunk by chunk, beside its module.

    objective = MedusaObjective(heads, target, loss_decay=0.8, soft_labels=False)
    loss, stats = objective(input_ids, attention_mask, loss_mask, target_hidden(target, ...))

Head k (1-based) at position t guesses token t+1+k and is scored where that token is in the loss
mask (:func:`head_rows`). With hard labels the heads' cross-entropy is against the token itself;
with ``soft_labels`` against the frozen target's own distribution there (its LM head on its
hidden state t+k). Over a draft vocabulary a token without a draft id is not scored (hard) and
the teacher is renormalised over the draft tokens (soft). Each head's loss is weighted
``loss_decay`` ** k. Medusa-2 (``adapted``: a LoRA-adapted copy of the target, trained with the
heads) adds ``kl_weight`` x KL(original || adapted) and ``lm_loss_weight`` x the adapted model's
own next-token cross-entropy. The projections run through
:func:`draftsmith.heads.chunked_loss.projected_cross_entropy`, so no (tokens, vocabulary) logits are held
for the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from draftsmith.heads.chunked_loss import (
    DEFAULT_CHUNK_SIZE,
    next_token_mask,
    projected_cross_entropy,
)
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.targets.target import Target

DEFAULT_LOSS_DECAY = 0.8  # head k's loss is weighted decay**k (the Medusa paper's lambda_k)
TRAIN_TOPK = 5  # ranks counted on training batches: enough for the logged top-1 and top-5


def head_rows(loss_mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch index, position) of the positions t where head k (1-based) is scored.

    Head k at t guesses token t+1+k, scored where ``loss_mask[:, t+1+k]`` is 1.
    """
    scored = torch.zeros_like(loss_mask, dtype=torch.bool)  # (B, T)
    seq = loss_mask.shape[1]
    if seq > 1 + k:
        scored[:, : seq - 1 - k] = loss_mask[:, 1 + k:].bool()
    return scored.nonzero(as_tuple=True)


@torch.no_grad()
def target_hidden(target: Target, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, H) the frozen target's final-normed last hidden state, its LM head skipped.

    The same as ``target.features(ids, [target.num_layers])[1][0]`` without the (B, T, V)
    logits nobody here needs.
    """
    return target.decoder(input_ids=input_ids, attention_mask=attention_mask,
                          use_cache=False).last_hidden_state


@dataclass
class StepStats:
    """Detached per-micro-batch quantities for logging (tensors stay on the device)."""

    head_loss: torch.Tensor  # (K,) mean loss of each head over its scored rows
    hits: torch.Tensor  # (K, topk) int64
    counts: torch.Tensor  # (K,) positions per head (the accuracies' denominators)
    # (K,) positions whose loss was scored: all of counts without a draft vocabulary; with one,
    # those whose token (hard labels) or target argmax (soft labels) has a draft id
    scored: torch.Tensor
    lm: dict[str, torch.Tensor] = field(default_factory=dict)  # Medusa-2: sums and the count


class MedusaObjective(nn.Module):
    """What is prepared, optimised and checkpointed: the heads and, in Medusa-2, a LoRA-adapted
    copy of the target (``adapted``, a peft model). The frozen original target is held by
    reference (teacher for soft labels and the KL), outside the module's parameters.

    In Medusa-2 the copy's frozen base weights are left out of ``state_dict`` (and may be absent
    when loading one): checkpoints hold the adapters and heads alone.
    """

    def __init__(self, heads: MedusaHeads, target: Target, adapted: nn.Module | None = None, *,
                 loss_decay: float = DEFAULT_LOSS_DECAY, soft_labels: bool = False,
                 heads_loss_weight: float = 1.0, kl_weight: float = 0.0,
                 lm_loss_weight: float = 0.0, loss_chunk_size: int = DEFAULT_CHUNK_SIZE):
        super().__init__()
        self.heads = heads
        self.adapted = adapted
        self._target = (target,)  # a tuple: not a submodule, never saved or wrapped
        self.decay = loss_decay
        self.soft_labels = soft_labels
        self.heads_loss_weight = heads_loss_weight
        self.kl_weight = kl_weight
        self.lm_loss_weight = lm_loss_weight
        self.chunk_size = loss_chunk_size
        self._frozen_keys: frozenset[str] = frozenset()
        if adapted is not None:
            state = self.state_dict(keep_vars=True)
            self._frozen_keys = frozenset(  # the adapted copy's base weights (not the heads')
                k for k, v in state.items() if k.startswith("adapted.")
                and not (isinstance(v, nn.Parameter) and v.requires_grad))
            self.register_state_dict_post_hook(_drop_frozen_keys)
            self.register_load_state_dict_post_hook(_allow_missing_frozen_keys)

    @property
    def target(self) -> Target:
        return self._target[0]

    def adapted_model(self) -> nn.Module:
        """The Hugging Face model inside the peft wrapper (adapters active)."""
        return self.adapted.get_base_model()

    def verifier(self) -> Target:
        """The model the heads are verified against: the target, or its adapted copy."""
        if self.adapted is None:
            return self.target
        target = self.target
        return Target(model=self.adapted_model(), tokenizer=target.tokenizer,
                      name=f"{target.name}+medusa2", eos_token_ids=target.eos_token_ids)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor, teacher_hidden: torch.Tensor,
                topk: int = TRAIN_TOPK, reduction: str = "mean") -> tuple[torch.Tensor, StepStats]:
        """-> (loss, stats) for one micro-batch; teacher_hidden (B, T, H) from the frozen target.

        loss = heads_loss_weight * sum_k decay**k * mean loss of head k
               [+ kl_weight * KL(original || adapted) + lm_loss_weight * CE(adapted), Medusa-2]
        ``reduction="sum"``: the same with every mean replaced by the sum over its positions
        (for a loop that normalises by the tokens of the whole optimizer step).
        """
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        target = self.target
        if self.adapted is None:
            hidden = teacher_hidden  # (B, T, H), no gradient: the target is frozen
        else:
            hidden = self.adapted_model().get_decoder()(
                input_ids=input_ids, attention_mask=attention_mask,
                use_cache=False).last_hidden_state  # (B, T, H), through the adapters
        heads_loss = None
        losses, hits, counts, scored = [], [], [], []
        # a draft vocabulary: the teacher restricted to its tokens (None: the whole vocabulary)
        columns = self.heads.draft_columns() if self.soft_labels else None
        for k, state in enumerate(self.heads.head_states(hidden), start=1):
            b, t = head_rows(loss_mask, k)
            out = projected_cross_entropy(
                state[b, t], self.heads.lm_head_weight(k - 1),
                self.heads.target_to_draft(input_ids[b, t + 1 + k]),  # -1: no draft id
                teacher_states=teacher_hidden[b, t + k] if self.soft_labels else None,
                teacher_head=target.lm_head if self.soft_labels else None,
                teacher_columns=columns,
                hard_weight=0.0 if self.soft_labels else 1.0,
                soft_weight=1.0 if self.soft_labels else 0.0,
                chunk_size=self.chunk_size, topk=topk)
            mean = out.loss / out.scored.clamp_min(1)
            weighted = self.decay ** k * (out.loss if reduction == "sum" else mean)
            heads_loss = weighted if heads_loss is None else heads_loss + weighted
            losses.append(mean.detach())
            hits.append(out.hits)
            counts.append(out.count)
            scored.append(out.scored)
        loss = self.heads_loss_weight * heads_loss
        stats = StepStats(torch.stack(losses), torch.stack(hits),
                          torch.tensor(counts, device=hidden.device),
                          torch.stack(scored).to(hidden.device))
        if self.adapted is not None:
            loss, stats.lm = self._adapted_lm_loss(loss, hidden, input_ids, loss_mask,
                                                   teacher_hidden, reduction)
        return loss, stats

    def _adapted_lm_loss(self, loss, hidden, input_ids, loss_mask, teacher_hidden, reduction):
        """Medusa-2: add kl_weight * KL(original || adapted) + lm_loss_weight * CE(adapted)."""
        b, t = next_token_mask(loss_mask).bool().nonzero(as_tuple=True)  # positions t -> t+1
        out = projected_cross_entropy(
            hidden[b, t], self.adapted_model().get_output_embeddings().weight,
            input_ids[b, t + 1], teacher_states=teacher_hidden[b, t],
            teacher_head=self.target.lm_head, hard_weight=self.lm_loss_weight,
            soft_weight=self.kl_weight, chunk_size=self.chunk_size, topk=1)
        n = 1 if reduction == "sum" else max(out.count, 1)
        # the teacher's entropy is a constant: subtracting it turns the soft cross-entropy into
        # the KL without changing the gradient
        lm_loss = (out.loss - self.kl_weight * out.teacher_entropy) / n
        stats = {"kl": out.soft_ce - out.teacher_entropy, "ce": out.hard_ce,
                 "agree": out.agree, "count": torch.tensor(float(out.count))}
        return loss + lm_loss, stats


def _drop_frozen_keys(module: MedusaObjective, state_dict: dict, prefix: str,
                      local_metadata) -> None:
    for key in module._frozen_keys:
        state_dict.pop(prefix + key, None)


def _allow_missing_frozen_keys(module: MedusaObjective, incompatible) -> None:
    frozen = module._frozen_keys
    # keys arrive with the prefix of any wrapper (DDP's "module."), so match their tails
    kept = [k for k in incompatible.missing_keys
            if not any(k == f or k.endswith("." + f) for f in frozen)]
    incompatible.missing_keys[:] = kept
