"""Distillation divergences from hidden states, chunk by chunk: no (positions, vocab) tensor whole.

:mod:`draftsmith.heads.distill_loss` scores two (n, vocab) logit tensors. Those exist only because the models'
LM heads made them: at a 128k vocabulary and 16k scored positions each is 8 GB in float32, and a
training step held three (the target's logits, the draft's, which mixed precision casts to
float32, and the gradient buffer). Here the two models give their final hidden states at the
scored positions, (n, h) each, and :func:`projected_divergence` forms both logits ``chunk_size``
rows at a time, scores them with the same kernels as :mod:`draftsmith.heads.distill_loss` (so the values are the
same divergences), folds the chunk's gradient into the gradients of the draft's states and LM
head weight at once and frees it. What waits for backward is an (n, h) and a (vocab, h) buffer,
the sizes autograd hands back anyway.

The draft's head may be a :class:`draftsmith.heads.distill.DraftVocabHead` (``kept`` target ids): its
logits are its rows placed among -inf, as that module's forward does. The target's projection runs
in the target's own dtype (its distribution exactly), the rest in float32 (float64 stays float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from draftsmith.heads.distill_loss import (
    DEFAULT_CHUNK_SIZE,
    DIVERGENCES,
    REDUCTIONS,
    _kernel_for,
    _tvd_kernel,
)


@dataclass
class ProjectedDivergence:
    """Sums over the n scored rows (``loss`` divided by n under ``reduction="mean"``)."""

    loss: torch.Tensor  # () the divergence, differentiable in the draft's states and head
    agree: torch.Tensor  # () rows whose draft argmax is the target's (float64)
    rejected: torch.Tensor | None  # () sum of TVD at the temperature, when asked (float64)
    count: int  # n


def _head_weight(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """(weight (K, h), kept target ids or None, vocabulary) of a bias-free linear LM head or a
    DraftVocabHead; None for any other head (LoRA on the head, a bias, a sharded weight)."""
    from draftsmith.heads.distill import DraftVocabHead

    if isinstance(head, DraftVocabHead):
        return head.weight, head.kept, head.vocab_size
    if type(head) is nn.Linear and head.bias is None:
        return head.weight, None, int(head.weight.shape[0])
    return None


def plain_weight(head: nn.Module) -> bool:
    """Whether ``head``'s weight is an ordinary tensor :func:`projected_divergence` can use (not
    a sharded DTensor, which only its module's forward gathers)."""
    found = _head_weight(head)
    return found is not None and type(found[0].data) is torch.Tensor


def _chunk(draft_states, draft_weight, kept, vocab, target_states, target_head_weight, start,
           stop, dtype, temperature):
    """Both (c, vocab) log-softmaxes of rows start:stop, and the draft's raw logits' argmax.
    ``draft_weight`` is already in the dtype the products run in; the logits go to ``dtype``."""
    rows = (draft_states[start:stop].to(draft_weight.dtype) @ draft_weight.T).to(dtype)  # (c, K)
    if kept is not None:
        draft = rows.new_full((rows.shape[0], vocab), float("-inf"))
        draft.index_copy_(1, kept, rows)
    else:
        draft = rows
    target = nn.functional.linear(target_states[start:stop].to(target_head_weight.dtype),
                                  target_head_weight).to(dtype)
    agree = (draft.argmax(-1) == target.argmax(-1)).sum(dtype=torch.float64)
    if temperature != 1.0:
        draft.div_(temperature)
        target.div_(temperature)
    return torch.log_softmax(draft, -1), torch.log_softmax(target, -1), agree


def _run(kernel, draft_states, draft_weight, kept, vocab, target_states, target_weight,
         temperature, chunk_size, with_tvd, grads, grad_scale):
    """Loss sum, agreement, TVD sum; fills ``grads`` = (states grad, weight grad) when given.

    Under autocast the matrix products run in autocast's dtype, as the draft's LM head would
    (the weight cast once); everything else (softmaxes, the loss, its gradient) runs outside
    autocast in float32 or wider."""
    device = draft_states.device
    with torch.autocast(device.type, enabled=False):
        mm = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
              else torch.promote_types(draft_weight.dtype, torch.float32))
        return _run_outside_autocast(kernel, draft_states, draft_weight, kept, vocab,
                                     target_states, target_weight, temperature, chunk_size,
                                     with_tvd, grads, grad_scale, mm)


def _run_outside_autocast(kernel, draft_states, draft_weight, kept, vocab, target_states,
                          target_weight, temperature, chunk_size, with_tvd, grads, grad_scale,
                          mm):
    dtype = torch.promote_types(draft_weight.dtype, torch.float32)
    n = draft_states.shape[0]
    device = draft_states.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    agree = torch.zeros((), dtype=torch.float64, device=device)
    rejected = torch.zeros((), dtype=torch.float64, device=device) if with_tvd else None
    weight = draft_weight.to(mm)
    step = max(chunk_size or n, 1)
    for start in range(0, n, step):
        stop = min(start + step, n)
        draft_lp, target_lp, same = _chunk(draft_states, weight, kept, vocab, target_states,
                                           target_weight, start, stop, dtype, temperature)
        agree += same
        if with_tvd:
            rejected += _tvd_kernel(draft_lp, target_lp, False)[0].sum(dtype=torch.float64)
        loss, weighted = kernel(draft_lp, target_lp, grads is not None)
        total += loss.sum(dtype=torch.float64)
        if grads is None:
            continue
        probs = draft_lp.exp_()
        grad = weighted.sub_(probs * weighted.sum(-1, keepdim=True))
        grad.mul_(grad_scale / temperature)  # d loss / d draft logits, (c, vocab)
        if kept is not None:
            grad = grad.index_select(1, kept)  # the other columns are constants (-inf)
        grad = grad.to(mm)
        grads[0][start:stop] = (grad @ weight).to(grads[0].dtype)
        if grads[1] is not None:
            grads[1].add_(grad.T @ draft_states[start:stop].to(mm))
    return total, agree, rejected


class _Projected(torch.autograd.Function):
    @staticmethod
    def forward(ctx, draft_states, draft_weight, kept, vocab, target_states, target_weight,
                kernel, temperature, chunk_size, with_tvd, denominator):
        # the weight's gradient only where it is trained (a frozen head under LoRA is not)
        grads = (torch.zeros_like(draft_states),
                 torch.zeros(draft_weight.shape, device=draft_weight.device,
                             dtype=torch.promote_types(draft_weight.dtype, torch.float32))
                 if ctx.needs_input_grad[1] else None)
        total, agree, rejected = _run(kernel, draft_states.detach(), draft_weight.detach(), kept,
                                      vocab, target_states, target_weight, temperature,
                                      chunk_size, with_tvd, grads, 1.0 / denominator)
        ctx.grads = grads
        ctx.weight_dtype = draft_weight.dtype
        ctx.mark_non_differentiable(agree, *(() if rejected is None else (rejected,)))
        loss = (total / denominator).to(torch.promote_types(draft_weight.dtype, torch.float32))
        return loss, agree, rejected

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _agree, _rejected):
        if ctx.grads is None:
            raise RuntimeError("backward through a projected divergence runs once")
        (states, weight), ctx.grads = ctx.grads, None
        states.mul_(grad_loss.to(states.dtype))
        if weight is not None:
            weight = weight.mul_(grad_loss.to(weight.dtype)).to(ctx.weight_dtype)
        return states, weight, None, None, None, None, None, None, None, None, None


def projected_divergence(name: str, draft_states: torch.Tensor, draft_head: nn.Module,
                         target_states: torch.Tensor, target_head: nn.Module, *,
                         temperature: float = 1.0, beta: float = 0.5,
                         chunk_size: int | None = DEFAULT_CHUNK_SIZE, reduction: str = "mean",
                         with_tvd: bool = False) -> ProjectedDivergence:
    """The divergence ``name`` (:data:`draftsmith.heads.distill_loss.DIVERGENCES`) between the draft's
    distribution ``softmax(draft_head(draft_states) / T)`` and the target's
    ``softmax(target_head(target_states) / T)`` at n rows, (n, h) and (n, h_target) states,
    without forming either (n, vocab) logits: chunk by chunk, gradients to the draft's states
    and head weight. ``with_tvd``: also the summed TVD (1 - acceptance), no gradient."""
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; expected one of {DIVERGENCES}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    found, target_found = _head_weight(draft_head), _head_weight(target_head)
    if found is None or target_found is None or target_found[1] is not None:
        raise ValueError("projected_divergence needs bias-free linear LM heads (the draft's may "
                         "be a DraftVocabHead); score logits with draftsmith.heads.distill_loss instead")
    weight, kept, vocab = found
    if vocab != target_found[2]:
        raise ValueError(f"vocabulary mismatch: the draft's head spans {vocab} tokens, the "
                         f"target's {target_found[2]}")
    if draft_states.dim() != 2 or draft_states.shape[0] != target_states.shape[0]:
        raise ValueError(f"states must be (n, h) with the same n, got {tuple(draft_states.shape)}"
                         f" and {tuple(target_states.shape)}")
    kernel = _kernel_for(name, float(beta))
    n = int(draft_states.shape[0])
    denominator = float(max(n, 1)) if reduction == "mean" else 1.0
    target_weight = target_found[0].detach()
    if torch.is_grad_enabled() and (draft_states.requires_grad or weight.requires_grad):
        loss, agree, rejected = _Projected.apply(
            draft_states, weight, kept, vocab, target_states.detach(), target_weight, kernel,
            float(temperature), chunk_size, with_tvd, denominator)
        return ProjectedDivergence(loss, agree, rejected, n)
    with torch.no_grad():
        total, agree, rejected = _run(kernel, draft_states, weight, kept, vocab, target_states,
                                      target_weight, float(temperature), chunk_size, with_tvd,
                                      None, 1.0)
    loss = (total / denominator).to(torch.promote_types(weight.dtype, torch.float32))
    return ProjectedDivergence(loss, agree, rejected, n)


# ---------------------------------------------------------------------------------------------
# A distillation step's scores: the two models' final states at the scored positions
# ---------------------------------------------------------------------------------------------


def hugging_face_model(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a DDP and/or peft wrapper (adapters active), else
    ``module``."""
    from peft import PeftModel

    module = getattr(module, "module", module)  # DistributedDataParallel
    return module.get_base_model() if isinstance(module, PeftModel) else module


def projects_from_states(model: nn.Module, target, sharded_target: bool) -> bool:
    """Whether the step can score from hidden states: both LM heads plain (a linear or
    DraftVocabHead weight that is an ordinary tensor, not an FSDP2 shard), both models with a
    decoder, the target whole on this process."""
    hf = hugging_face_model(model)
    return (not sharded_target and hasattr(hf, "get_decoder")
            and plain_weight(hf.get_output_embeddings())
            and plain_weight(target.model.get_output_embeddings()))


def _last_state(output) -> torch.Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


@torch.no_grad()
def teacher_states(target, batch: dict) -> torch.Tensor:
    """(n, h) the frozen target's final (normed) hidden states at the scored positions."""
    from draftsmith.heads.chunked_loss import next_token_mask

    mask = next_token_mask(batch["loss_mask"]).bool()
    out = target.decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         use_cache=False)
    return _last_state(out)[mask]


def draft_states(model: nn.Module, batch: dict) -> torch.Tensor:
    """(n, h) the draft's final hidden states at the scored positions, by calling ``model``
    itself (so DDP and gradient checkpointing see an ordinary forward) with no logits kept."""
    from draftsmith.heads.chunked_loss import next_token_mask

    mask = next_token_mask(batch["loss_mask"]).bool()
    captured = []
    decoder = hugging_face_model(model).get_decoder()
    handle = decoder.register_forward_hook(lambda _m, _a, out: captured.append(_last_state(out)))
    try:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              logits_to_keep=torch.zeros_like(mask), use_cache=False)
    finally:
        handle.remove()
    return captured[-1][mask]


def distill_scores(model: nn.Module, target, batch: dict, cfg, *, reduction: str = "mean",
                   with_tvd: bool = False, projected: bool = True) -> ProjectedDivergence:
    """The distillation loss ``cfg.divergence`` (``cfg.temperature``, ``cfg.beta``,
    ``cfg.loss_chunk_size``) of the draft ``model`` against ``target`` at the positions that
    predict loss-mask tokens, with the argmax agreement (and the TVD sum). ``projected``: from
    the final hidden states, chunk by chunk (:func:`projected_divergence`); else from the two
    models' (n, vocab) logits (a sharded target or draft, a LoRA-wrapped LM head)."""
    from draftsmith.heads.distill_loss import argmax_agreement, divergence, scored_inputs, tvd

    if projected:
        return projected_divergence(
            cfg.divergence, draft_states(model, batch),
            hugging_face_model(model).get_output_embeddings(), teacher_states(target, batch),
            target.model.get_output_embeddings(), temperature=cfg.temperature, beta=cfg.beta,
            chunk_size=cfg.loss_chunk_size, reduction=reduction, with_tvd=with_tvd)
    inputs = scored_inputs(batch)
    with torch.no_grad():
        target_logits = target.model(**inputs).logits  # (n, vocab)
    draft_logits = model(**inputs).logits  # (n, vocab)
    ones = torch.ones(draft_logits.shape[:-1], device=draft_logits.device)  # (n,)
    loss = divergence(cfg.divergence, draft_logits, target_logits, ones,
                      temperature=cfg.temperature, beta=cfg.beta, chunk_size=cfg.loss_chunk_size,
                      reduction=reduction)
    n = int(draft_logits.shape[0])
    agree = (argmax_agreement(draft_logits, target_logits, ones) * n).double()
    rejected = (tvd(draft_logits, target_logits, ones, temperature=cfg.temperature,
                    chunk_size=cfg.loss_chunk_size, reduction="sum").double()
                if with_tvd else None)
    return ProjectedDivergence(loss, agree, rejected, n)
