"""Divergences between a draft's and the target's next-token distributions, for distillation.

Every loss is a pure function ``(draft_logits, target_logits, mask) -> scalar``:

    draft_logits   (..., vocab)  the draft's logits; gradients flow here
    target_logits  (..., vocab)  the frozen target's logits at the same positions; a constant
    mask           (...)         1 where the position counts (its next token is to be predicted)

averaged over the valid positions (``reduction="sum"`` gives the sum, for trainers that divide by a
token count gathered across processes). Both distributions are warped by the same temperature,
``softmax(logits / temperature)``, and the result is *not* rescaled by temperature**2: the value
stays a divergence between the two warped distributions, so ``1 - tvd`` at temperature T is the
expected acceptance rate of exact speculative sampling at temperature T.

Notation: ``target_probs`` is the target's distribution, ``draft_probs`` the draft's.

* ``forward_kl`` = KL(target_probs || draft_probs): mode covering, the classic KD loss.
* ``reverse_kl`` = KL(draft_probs || target_probs): mode seeking.
* ``jsd`` (generalised, as in GKD and DistillSpec) with mixture
  ``mix = beta * target_probs + (1 - beta) * draft_probs``:
  ``beta * KL(target_probs || mix) + (1 - beta) * KL(draft_probs || mix)``, bounded by the binary
  entropy H(beta) <= log 2. At the endpoints the formula itself is identically 0, so (as GKD and
  TRL do) ``beta = 0`` gives ``forward_kl`` and ``beta = 1`` gives ``reverse_kl``: the limits of
  JSD_beta / beta and JSD_beta / (1 - beta). beta = 0.5 is the symmetric Jensen-Shannon divergence.
* ``tvd`` = 0.5 * sum |target_probs - draft_probs| = 1 - sum min(target_probs, draft_probs); the
  probability that exact speculative sampling rejects the draft's token (DistillSpec).

Memory: the valid positions are gathered and processed ``chunk_size`` at a time, in float32 for
bf16/fp16/fp32 inputs (float64 stays float64, as does the result), so no full (..., vocab) float32
copy of the logits exists. When the draft logits need a gradient, it is computed in closed form,
chunk by chunk, during the forward pass and held in one buffer of the draft logits' shape and dtype
(what autograd has to hand back anyway), instead of autograd keeping half a dozen float32
(..., vocab) intermediates alive until backward.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from draftsmith.heads.chunked_loss import next_token_mask

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "tvd")
# 256 positions x 49152 tokens x 4 bytes = 50 MB per float32 temporary; a chunk makes about eight.
DEFAULT_CHUNK_SIZE = 256
REDUCTIONS = ("mean", "sum")


# ---------------------------------------------------------------------------------------------
# Per-position kernels. Each takes (draft_logprobs, target_logprobs), both (n, vocab) float32
# log-softmaxes, and returns (loss (n,), weighted) where weighted = draft_probs * dL/d draft_probs,
# up to a per-row multiple of draft_probs (which the softmax Jacobian cancels), or None when
# with_grad is False. The gradient with respect to the scaled logits is then
# weighted - draft_probs * weighted.sum(-1).
# ---------------------------------------------------------------------------------------------


def _kl_terms(probs: torch.Tensor, logprobs: torch.Tensor, other_logprobs: torch.Tensor):
    """probs * (logprobs - other_logprobs), 0 where probs == 0 (so 0 * log 0 never becomes nan)."""
    terms = (logprobs - other_logprobs).mul_(probs)
    return terms.masked_fill_(probs == 0, 0.0)


def _forward_kl_kernel(draft_logprobs, target_logprobs, with_grad):
    target_probs = target_logprobs.exp()
    loss = _kl_terms(target_probs, target_logprobs, draft_logprobs).sum(-1)
    return loss, (target_probs.neg_() if with_grad else None)


def _reverse_kl_kernel(draft_logprobs, target_logprobs, with_grad):
    # dL/d draft_probs = log draft - log target + 1; the "+ 1" is a multiple of draft_probs
    weighted = _kl_terms(draft_logprobs.exp(), draft_logprobs, target_logprobs)
    return weighted.sum(-1), (weighted if with_grad else None)


def _jsd_kernel(draft_logprobs, target_logprobs, with_grad, beta: float):
    # log of the mixture beta * target + (1 - beta) * draft, without leaving log space
    mix_logprobs = torch.logaddexp(target_logprobs + math.log(beta),
                                   draft_logprobs + math.log1p(-beta))
    target_part = _kl_terms(target_logprobs.exp(), target_logprobs, mix_logprobs)
    draft_part = _kl_terms(draft_logprobs.exp(), draft_logprobs, mix_logprobs)
    loss = beta * target_part.sum(-1) + (1.0 - beta) * draft_part.sum(-1)
    # dL/d draft_probs = (1 - beta) * (log draft - log mix): the target-side terms cancel
    return loss, (draft_part.mul_(1.0 - beta) if with_grad else None)


def _tvd_kernel(draft_logprobs, target_logprobs, with_grad):
    draft_probs = draft_logprobs.exp()
    diff = draft_probs - target_logprobs.exp()
    loss = 0.5 * diff.abs().sum(-1)
    return loss, (draft_probs.mul_(diff.sign_()).mul_(0.5) if with_grad else None)


def _kernel_for(name: str, beta: float):
    if name == "forward_kl" or (name == "jsd" and beta == 0.0):
        return _forward_kl_kernel
    if name == "reverse_kl" or (name == "jsd" and beta == 1.0):
        return _reverse_kl_kernel
    if name == "jsd":
        return lambda d, t, with_grad: _jsd_kernel(d, t, with_grad, beta)
    if name == "tvd":
        return _tvd_kernel
    raise ValueError(f"unknown divergence {name!r}; expected one of {DIVERGENCES}")


# ---------------------------------------------------------------------------------------------
# The chunked driver
# ---------------------------------------------------------------------------------------------


def _chunks(rows: tuple[torch.Tensor, ...], count: int, chunk_size: int | None):
    """Index tuples selecting ``chunk_size`` valid positions at a time (all at once for None)."""
    step = count if chunk_size is None else chunk_size
    for start in range(0, count, max(step, 1)):
        yield start, tuple(r[start:start + step] for r in rows)


def _compute_dtype(draft_logits, target_logits) -> torch.dtype:
    return torch.promote_types(torch.promote_types(draft_logits.dtype, target_logits.dtype),
                               torch.float32)


def _chunk_logprobs(draft_logits, target_logits, index, temperature):
    """Gather one chunk of positions and log-softmax both sides in float32 (float64 inputs stay
    float64): (n, vocab) each."""
    dtype = _compute_dtype(draft_logits, target_logits)
    # advanced indexing copies, so the chunks can be scaled in place
    draft = draft_logits[index].to(dtype)
    target = target_logits[index].to(dtype)
    if temperature != 1.0:
        draft.div_(temperature)
        target.div_(temperature)
    return torch.log_softmax(draft, dim=-1), torch.log_softmax(target, dim=-1)


def _divergence_sum(kernel, draft_logits, target_logits, rows, count, temperature, chunk_size,
                    grad_out: torch.Tensor | None, grad_scale: float) -> torch.Tensor:
    """Sum of per-position losses (float64 scalar); fills ``grad_out`` rows when it is given."""
    total = torch.zeros((), dtype=torch.float64, device=draft_logits.device)
    for _, index in _chunks(rows, count, chunk_size):
        draft_logprobs, target_logprobs = _chunk_logprobs(draft_logits, target_logits, index,
                                                          temperature)
        # (n,), (n, vocab) or None
        loss, weighted = kernel(draft_logprobs, target_logprobs, grad_out is not None)
        total += loss.sum(dtype=torch.float64)
        if grad_out is not None:
            draft_probs = draft_logprobs.exp_()  # the chunk's log-probs are not needed any more
            grad = weighted.sub_(draft_probs * weighted.sum(-1, keepdim=True))
            grad_out[index] = grad.mul_(grad_scale / temperature).to(grad_out.dtype)
    return total


class _ChunkedDivergence(torch.autograd.Function):
    """Loss forward, with d loss / d draft_logits computed chunk by chunk into one buffer."""

    @staticmethod
    def forward(ctx, draft_logits, target_logits, rows, count, kernel, temperature, chunk_size,
                denominator):
        # (..., vocab): zero at masked positions, which do not affect the loss
        grad = torch.zeros_like(draft_logits)
        total = _divergence_sum(kernel, draft_logits.detach(), target_logits.detach(), rows, count,
                                temperature, chunk_size, grad, 1.0 / denominator)
        ctx.grad = grad
        return (total / denominator).to(_compute_dtype(draft_logits, target_logits))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grad is None:
            raise RuntimeError("backward through a chunked divergence runs once; do not pass "
                               "retain_graph=True through it")
        # scaled in place: the buffer is the gradient handed back, no second (..., vocab) copy
        grad, ctx.grad = ctx.grad, None
        grad.mul_(grad_loss.to(grad.dtype))
        return grad, None, None, None, None, None, None, None


def _check_inputs(draft_logits, target_logits, mask, temperature, chunk_size, reduction):
    if draft_logits.dim() < 2:
        raise ValueError("logits need shape (..., positions, vocab), got "
                         f"{tuple(draft_logits.shape)}")
    if draft_logits.shape[-1] != target_logits.shape[-1]:
        raise ValueError(
            f"vocabulary mismatch: draft logits have {draft_logits.shape[-1]} entries per "
            f"position, target logits {target_logits.shape[-1]}; the draft must share the "
            "target's vocabulary"
        )
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft logits {tuple(draft_logits.shape)} and target logits "
                         f"{tuple(target_logits.shape)} must have the same shape")
    if tuple(mask.shape) != tuple(draft_logits.shape[:-1]):
        raise ValueError(f"mask {tuple(mask.shape)} must match the logits without their vocabulary "
                         f"dimension, {tuple(draft_logits.shape[:-1])}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature > 0):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}; for "
                         "greedy decoding compare argmaxes with argmax_agreement instead")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError("chunk_size must be a positive int or None (no chunking), got "
                         f"{chunk_size!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _divergence(name, draft_logits, target_logits, mask, *, temperature, chunk_size, beta,
                reduction) -> torch.Tensor:
    _check_inputs(draft_logits, target_logits, mask, temperature, chunk_size, reduction)
    kernel = _kernel_for(name, beta)
    rows = mask.bool().nonzero(as_tuple=True)  # one (n_valid,) index tensor per leading dim
    count = int(rows[0].numel())
    denominator = float(max(count, 1)) if reduction == "mean" else 1.0
    if torch.is_grad_enabled() and draft_logits.requires_grad:
        return _ChunkedDivergence.apply(draft_logits, target_logits, rows, count, kernel,
                                        float(temperature), chunk_size, denominator)
    with torch.no_grad():
        total = _divergence_sum(kernel, draft_logits, target_logits, rows, count,
                                float(temperature), chunk_size, None, 1.0)
    return (total / denominator).to(_compute_dtype(draft_logits, target_logits))


# ---------------------------------------------------------------------------------------------
# Public losses
# ---------------------------------------------------------------------------------------------


def forward_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, *,
               temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE,
               reduction: str = "mean") -> torch.Tensor:
    """KL(target_probs || draft_probs) per valid position, averaged: a scalar (float32 or 64)."""
    return _divergence("forward_kl", draft_logits, target_logits, mask, temperature=temperature,
                       chunk_size=chunk_size, beta=0.0, reduction=reduction)


def reverse_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, *,
               temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE,
               reduction: str = "mean") -> torch.Tensor:
    """KL(draft_probs || target_probs) per valid position, averaged: a scalar (float32 or 64)."""
    return _divergence("reverse_kl", draft_logits, target_logits, mask, temperature=temperature,
                       chunk_size=chunk_size, beta=0.0, reduction=reduction)


def jsd(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, *,
        beta: float = 0.5, temperature: float = 1.0,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE, reduction: str = "mean") -> torch.Tensor:
    """Generalised JSD with mix = beta * target_probs + (1 - beta) * draft_probs:
    beta * KL(target_probs || mix) + (1 - beta) * KL(draft_probs || mix), averaged.

    beta = 0 gives forward_kl and beta = 1 reverse_kl (the limits of JSD/beta and JSD/(1 - beta));
    in between the value lies in [0, H(beta)] with H the binary entropy, so at most log 2.
    """
    if not (isinstance(beta, (int, float)) and 0.0 <= beta <= 1.0):
        raise ValueError(f"jsd needs 0 <= beta <= 1, got {beta!r}")
    return _divergence("jsd", draft_logits, target_logits, mask, temperature=temperature,
                       chunk_size=chunk_size, beta=float(beta), reduction=reduction)


def tvd(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, *,
        temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        reduction: str = "mean") -> torch.Tensor:
    """Total variation 0.5 * sum |target_probs - draft_probs| = 1 - sum min(...), averaged.

    1 - tvd is the probability that exact speculative sampling accepts the draft's token.
    """
    return _divergence("tvd", draft_logits, target_logits, mask, temperature=temperature,
                       chunk_size=chunk_size, beta=0.0, reduction=reduction)


def divergence(name: str, draft_logits: torch.Tensor, target_logits: torch.Tensor,
               mask: torch.Tensor, *, temperature: float = 1.0, beta: float = 0.5,
               chunk_size: int | None = DEFAULT_CHUNK_SIZE,
               reduction: str = "mean") -> torch.Tensor:
    """The divergence called ``name`` (one of DIVERGENCES); ``beta`` is used by "jsd" only."""
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; expected one of {DIVERGENCES}")
    if name == "jsd":
        return jsd(draft_logits, target_logits, mask, beta=beta, temperature=temperature,
                   chunk_size=chunk_size, reduction=reduction)
    return _divergence(name, draft_logits, target_logits, mask, temperature=temperature,
                       chunk_size=chunk_size, beta=0.0, reduction=reduction)


# ---------------------------------------------------------------------------------------------
# Metrics for logging (no gradient)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def argmax_agreement(draft_logits: torch.Tensor, target_logits: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """Fraction of valid positions where the draft's argmax is the target's: greedy acceptance."""
    _check_inputs(draft_logits, target_logits, mask, 1.0, None, "mean")
    valid = mask.bool()
    same = (draft_logits.argmax(-1) == target_logits.argmax(-1)) & valid  # (...)
    return (same.sum().double() / valid.sum().clamp(min=1)).float()


@torch.no_grad()
def expected_acceptance(draft_logits: torch.Tensor, target_logits: torch.Tensor,
                        mask: torch.Tensor, *, temperature: float = 1.0,
                        chunk_size: int | None = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Mean over valid positions of 1 - TVD: the per-token acceptance rate of exact speculative
    sampling at ``temperature`` (without top-k / top-p)."""
    return 1.0 - tvd(draft_logits, target_logits, mask, temperature=temperature,
                     chunk_size=chunk_size)


def scored_inputs(batch: dict) -> dict:
    """The models' inputs, their LM heads computed only where a loss-mask token is predicted."""
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "logits_to_keep": next_token_mask(batch["loss_mask"]).bool(), "use_cache": False}


@torch.no_grad()
def teacher_logits(target, batch: dict) -> torch.Tensor:
    """(n, vocab) the frozen target's logits at the scored positions of ``batch``."""
    return target.model(**scored_inputs(batch)).logits
