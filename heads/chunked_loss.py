"""Linear projection + cross-entropy over a large vocabulary, chunk by chunk.

One helper for every draft whose logits are ``states @ weight.T`` over the target's vocabulary
(Medusa's heads, EAGLE-1 through the target's LM head, EAGLE-3 through its own draft-vocabulary
head): :func:`projected_cross_entropy` scores the rows ``chunk_size`` at a time against hard
labels and/or a teacher distribution, and never forms the (rows, vocab) logits, their softmax or
their gradient at once.

The teacher is given as states plus a projection (``teacher_head``, the frozen target's LM head),
so its distribution is also formed a chunk at a time, never stored. ``teacher_columns`` restricts
it to the student's vocabulary (EAGLE-3's draft vocabulary: the teacher's logits at those target
ids, renormalised) and skips the rows whose teacher argmax has no student column.

Several *groups* of student rows may share one teacher row each (EAGLE-3's training-time-test
steps all predict the token the target predicts at the same position): ``states`` (G, n, H) is
scored against the n teacher rows, each teacher chunk computed once for all G groups, and the
loss is ``sum_g group_weights[g] * (hard_weight * hard_ce[g] + soft_weight * soft_ce[g])``.

Gradient: the gradient with respect to each chunk's logits is known in closed form
(``(hard_weight + soft_weight) * p - hard_weight * onehot - soft_weight * teacher``), so it is
formed in the forward pass, folded into the gradients of ``states`` and ``weight`` at once, and
freed. What waits for backward is an (G, n, H) and one (V, H) buffer -- the sizes autograd hands
back anyway; every group accumulates into the same (V, H) buffer (its weight in the loss is fixed
before the forward, which is why ``group_weights`` are arguments and not applied afterwards).

Precision: logits, softmaxes and sums in float32 (float64 when ``weight`` is float64), whatever
autocast runs the projections in; the teacher's projection runs outside autocast, in the teacher's
own dtype, so it gives exactly the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

# 256 rows x 128256 tokens x 4 bytes = 131 MB per float32 temporary; a chunk makes about six.
DEFAULT_CHUNK_SIZE = 256


@dataclass
class ProjectedLoss:
    """What :func:`projected_cross_entropy` returns: sums over the scored rows, not means.

    With 2-D ``states`` the per-row sums are 0-dim and ``hits`` is (topk,); with 3-D (G, n, H)
    states each has a leading group dimension (G,).
    """

    loss: torch.Tensor  # () sum_g group_weights[g] * (hard_weight * hard_ce + soft_weight * soft_ce)
    hard_ce: torch.Tensor  # sum of -log p(label) (0 without labels)
    soft_ce: torch.Tensor  # sum of -sum_v teacher(v) log p(v) (0 without a teacher)
    teacher_entropy: torch.Tensor  # sum of the teacher's entropies (soft_ce - this = KL)
    agree: torch.Tensor  # rows whose argmax equals the teacher's argmax (0 without a teacher)
    hits: torch.Tensor  # (topk,) int64: rows whose label is the rank-r guess (empty without labels)
    scored: torch.Tensor  # rows scored: in row_mask, and (with teacher_columns) not skipped
    count: int  # rows given (n)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(c, V), (c, V) -> (c,) row-wise dot products, without a (c, V) product in memory."""
    return torch.bmm(a[:, None, :], b[:, :, None]).reshape(-1)


class _Buffers:
    """(chunk, width) work buffers, allocated once per call and reused by every chunk.

    Reuse matters on CPU: a fresh (chunk, vocab) tensor is a fresh mmap whose first touch
    page-faults, which costs more than the arithmetic on it.
    """

    def __init__(self, rows: int, device: torch.device):
        self.rows, self.device = rows, device
        self._made: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        key = (name, width, dtype)
        if key not in self._made:
            self._made[key] = torch.empty(self.rows, width, dtype=dtype, device=self.device)
        return self._made[key][:rows]


def _project(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
             buffers: _Buffers) -> torch.Tensor:
    """out[:] = x @ weight.T (x (c, H), weight (V, H)), the product in weight's dtype."""
    if weight.dtype == out.dtype:
        return torch.mm(x.to(weight.dtype), weight.t(), out=out)
    product = buffers.get("product", out.shape[0], out.shape[1], weight.dtype)
    torch.mm(x.to(weight.dtype), weight.t(), out=product)
    return out.copy_(product)


def _plain_linear(module) -> bool:
    return isinstance(module, nn.Linear) and module.bias is None


def _teacher_logits(teacher_head: nn.Module, teacher_states: torch.Tensor,
                    out: torch.Tensor | None = None, buffers: _Buffers | None = None):
    """The teacher's logits (autocast off: exactly the frozen target's output, in its dtype).

    With ``out`` (a bias-free ``nn.Linear`` only) they are written there, in out's dtype.
    """
    weight = getattr(teacher_head, "weight", None)
    if weight is not None:
        teacher_states = teacher_states.to(weight.dtype)
    with torch.autocast(teacher_states.device.type, enabled=False):
        if out is not None:
            return _project(teacher_states, weight, out, buffers)
        return teacher_head(teacher_states)


def _chunk_loop(states, weight_mm, labels, teacher_states, teacher_head, teacher_columns,
                row_mask, group_weights, hard_weight, soft_weight, chunk_size, topk,
                grad_states, grad_weight, sums, hits, compute):
    """The forward pass proper (autocast off): fills sums, hits and the gradient buffers.

    weight_mm (V, H) is the projection in the dtype the matrix products run in (autocast's, when
    the caller had it on); logits, softmaxes and gradients are in ``compute``.
    """
    groups, n = states.shape[0], states.shape[1]
    device, mm = states.device, weight_mm.dtype
    vocab = weight_mm.shape[0]
    buffers = _Buffers(min(chunk_size, n), device)
    in_columns = None  # (V_teacher,) bool: the teacher ids that have a student column
    for start in range(0, n, chunk_size):
        end = min(n, start + chunk_size)
        c = end - start
        rows = torch.arange(c, device=device)
        keep = row_mask[:, start:end]  # (G, c)
        teacher = teacher_logp = None
        if teacher_states is not None:
            out = None
            if _plain_linear(teacher_head):
                out = buffers.get("teacher", c, teacher_head.weight.shape[0], compute)
            teacher_logits = _teacher_logits(
                teacher_head, teacher_states[start:end], out, buffers
            ).to(compute)  # (c, V_teacher)
            if teacher_columns is not None:
                if in_columns is None:
                    in_columns = torch.zeros(teacher_logits.shape[-1], dtype=torch.bool,
                                             device=device)
                    in_columns[teacher_columns] = True
                keep = keep & in_columns[teacher_logits.argmax(-1)]
                columns = buffers.get("columns", c, vocab, compute)
                teacher_logits = torch.index_select(
                    teacher_logits, -1, teacher_columns, out=columns
                )  # (c, V)
            teacher_guess = teacher_logits.argmax(-1)  # (c,)
            teacher_logp = torch.log_softmax(
                teacher_logits, -1, out=buffers.get("teacher_logp", c, vocab, compute)
            )  # (c, V)
            teacher = torch.exp(
                teacher_logp, out=buffers.get("teacher_p", c, vocab, compute)
            )  # (c, V)
            entropy = -_row_dot(teacher, teacher_logp)  # (c,); finite logits: no log 0
            del teacher_logits
        label = labels[start:end] if labels is not None else None
        has_label = None
        if label is not None:
            has_label = label >= 0  # (c,) -1: the token has no column (outside a draft vocabulary)
            if hard_weight:
                keep = keep & has_label
            label = label.clamp_min(0)  # a column to index with; rows without one never count
        for g in range(groups):
            kept = keep[g]  # (c,)
            sums[g, 4] += kept.sum()
            # each row's weight in the loss; it scales the (c, H) factors of the gradient
            # products below instead of the (c, V) gradient itself
            coef = torch.where(kept, group_weights[g], 0.0)[:, None]  # (c, 1)
            x = states[g, start:end].to(mm)  # (c, H)
            logits = buffers.get("logits", c, vocab, compute)
            logits = _project(x, weight_mm, logits, buffers)  # (c, V)
            guess = logits.argmax(-1)  # (c,)
            if label is not None and topk:
                top = logits.topk(topk, dim=-1).indices  # (c, topk)
                hits[g] += ((top == label[:, None]) & (kept & has_label)[:, None]).sum(0)
                del top
            logp = buffers.get("logp", c, vocab, compute)
            logp = torch.log_softmax(logits, -1, out=logp)  # (c, V)
            # d loss / d logits of a row, before coef, in the logits' buffer:
            # (hard + soft) * p - hard * onehot(label) - soft * teacher
            grad = torch.exp(logp, out=logits)  # (c, V)
            if hard_weight + soft_weight != 1.0:
                grad.mul_(hard_weight + soft_weight)
            if label is not None:
                hard = -logp[rows, label]  # (c,)
                sums[g, 0] += torch.where(kept & has_label, hard, 0.0).sum().double()
                grad[rows, label] -= hard_weight
            if teacher is not None:
                soft = -_row_dot(teacher, logp)  # (c,)
                sums[g, 1] += torch.where(kept, soft, 0.0).sum().double()
                sums[g, 2] += torch.where(kept, entropy, 0.0).sum().double()
                sums[g, 3] += (kept & (guess == teacher_guess)).sum()
                if soft_weight:
                    grad.sub_(teacher, alpha=soft_weight)
            if grad_states is not None:  # (c, H)
                grad_states[g, start:end] = (grad.to(mm) @ weight_mm).to(compute) * coef
            if grad_weight is not None:
                scaled = x.to(compute) * coef  # (c, H)
                if mm == compute:  # in place: no (V, H) temporary
                    grad_weight.addmm_(grad.t(), scaled)
                else:  # the product in the low precision, a (V, H) temporary of that dtype
                    grad_weight += grad.t().to(mm) @ scaled.to(mm)


class _ProjectedCrossEntropy(torch.autograd.Function):
    """Chunked linear + cross-entropy: only (chunk, vocab) temporaries, gradient in forward."""

    @staticmethod
    def forward(ctx, states, weight, labels, teacher_states, teacher_head, teacher_columns,
                row_mask, group_weights, hard_weight, soft_weight, chunk_size, topk, want_states,
                want_weight):
        compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
        groups, device = states.shape[0], states.device
        grad_states = torch.zeros(states.shape, dtype=compute, device=device) \
            if want_states else None  # (G, n, H)
        grad_weight = torch.zeros(weight.shape, dtype=compute, device=weight.device) \
            if want_weight else None  # (V, H)
        # per group: hard_ce, soft_ce, teacher_entropy, agree, scored
        sums = torch.zeros(groups, 5, dtype=torch.float64, device=device)
        hits = torch.zeros(groups, topk, dtype=torch.int64, device=device)
        group_weights = group_weights.to(device=device, dtype=compute)
        # the projections run in autocast's dtype when it is on (the weight cast once here, as
        # autocast's own cache would); everything else runs outside it, in ``compute``
        mm = weight.dtype
        if torch.is_autocast_enabled(device.type):
            mm = torch.get_autocast_dtype(device.type)
        with torch.autocast(device.type, enabled=False):
            _chunk_loop(states, weight.detach().to(mm), labels, teacher_states, teacher_head,
                        teacher_columns, row_mask, group_weights, hard_weight, soft_weight,
                        chunk_size, topk, grad_states, grad_weight, sums, hits, compute)
        per_group = hard_weight * sums[:, 0] + soft_weight * sums[:, 1]  # (G,)
        loss = (group_weights.double() * per_group).sum().to(compute)
        ctx.save_for_backward(grad_states, grad_weight)
        ctx.dtypes = (states.dtype, weight.dtype)
        ctx.mark_non_differentiable(sums, hits)
        return loss, sums, hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums, _grad_hits):
        grad_states, grad_weight = ctx.saved_tensors
        states_dtype, weight_dtype = ctx.dtypes
        out_states = None if grad_states is None else (grad_states * grad_loss).to(states_dtype)
        out_weight = None if grad_weight is None else (grad_weight * grad_loss).to(weight_dtype)
        return (out_states, out_weight) + (None,) * 12


def projected_cross_entropy(
    states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    teacher_states: torch.Tensor | None = None,
    teacher_head: nn.Module | None = None,
    teacher_columns: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    group_weights: Sequence[float] | torch.Tensor | None = None,
    hard_weight: float = 1.0,
    soft_weight: float = 0.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    topk: int = 1,
) -> ProjectedLoss:
    """Cross-entropy of ``states @ weight.T`` against labels and/or a teacher, chunk by chunk.

    states (n, H) or (G, n, H): the rows to score (gradients flow here), G groups sharing the n
    labels / teacher rows; weight (V, H): the projection (trained when it requires grad; no
    bias); labels (n,): the true tokens' rows of weight, for ``hard_ce`` and ``hits``, -1 for a
    token weight has no row of (a draft vocabulary's misses: never a hit, and with
    ``hard_weight`` > 0 the row is not scored); teacher_states (n, H_t)
    with ``teacher_head`` (a frozen LM head module): the teacher's distribution
    softmax(teacher_head(teacher_states)) for the soft term; teacher_columns (V,) int64: the
    teacher's ids of weight's rows -- the teacher is restricted to them and renormalised, and a
    row whose teacher argmax is not among them is skipped; row_mask (n,) or (G, n) bool: the rows
    to score (default all); group_weights (G,): each group's weight in the loss (default ones).

    Returns a :class:`ProjectedLoss` whose ``loss`` is
    ``sum_g group_weights[g] * (hard_weight * hard_ce[g] + soft_weight * soft_ce[g])``, sums over
    the scored rows (divide by ``scored`` for means).
    """
    if (teacher_states is None) != (teacher_head is None):
        raise ValueError("give teacher_states and teacher_head together (or neither)")
    if soft_weight and teacher_states is None:
        raise ValueError("soft_weight > 0 needs the teacher (teacher_states and teacher_head)")
    if hard_weight and labels is None:
        raise ValueError("hard_weight > 0 needs labels; pass hard_weight=0.0 to score against "
                         "the teacher only")
    if teacher_columns is not None and teacher_states is None:
        raise ValueError("teacher_columns restricts the teacher: give teacher_states too")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    grouped = states.dim() == 3
    if not grouped and states.dim() != 2:
        raise ValueError(f"states must be (n, hidden) or (groups, n, hidden), got "
                         f"{tuple(states.shape)}")
    states3 = states if grouped else states[None]
    groups, n = states3.shape[0], states3.shape[1]
    if states3.shape[2] != weight.shape[1]:
        raise ValueError(f"states have width {states3.shape[2]} but weight is "
                         f"{tuple(weight.shape)} (vocab, hidden)")
    if labels is not None and labels.shape != (n,):
        raise ValueError(f"labels must be ({n},) for states {tuple(states.shape)}, got "
                         f"{tuple(labels.shape)}")
    if teacher_states is not None and teacher_states.shape[0] != n:
        raise ValueError(f"teacher_states must have {n} rows, got {tuple(teacher_states.shape)}")
    if teacher_columns is not None and teacher_columns.shape != (weight.shape[0],):
        raise ValueError(f"teacher_columns must name one teacher id per row of weight "
                         f"({weight.shape[0]},), got {tuple(teacher_columns.shape)}")
    if row_mask is None:
        row_mask = torch.ones(groups, n, dtype=torch.bool, device=states.device)
    row_mask = row_mask.to(device=states.device, dtype=torch.bool).expand(groups, n)
    if group_weights is None:
        group_weights = torch.ones(groups, dtype=torch.float64)
    if not isinstance(group_weights, torch.Tensor):  # Python floats: keep their precision
        group_weights = torch.tensor(group_weights, dtype=torch.float64)
    group_weights = group_weights.reshape(-1)
    if group_weights.numel() != groups:
        raise ValueError(f"group_weights must have one weight per group ({groups}), got "
                         f"{group_weights.numel()}")
    topk = min(topk, weight.shape[0]) if labels is not None else 0
    grad = torch.is_grad_enabled()
    loss, sums, hits = _ProjectedCrossEntropy.apply(
        states3, weight, labels, teacher_states, teacher_head, teacher_columns, row_mask,
        group_weights, float(hard_weight), float(soft_weight), chunk_size, topk,
        grad and states.requires_grad, grad and weight.requires_grad)
    if not grouped:
        sums, hits = sums[0], hits[0]
    return ProjectedLoss(loss, sums[..., 0], sums[..., 1], sums[..., 2], sums[..., 3], hits,
                         sums[..., 4], n)


@torch.no_grad()
def projected_argmax(states: torch.Tensor, head: nn.Module,
                     chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """(n, H) -> (n,) int64 argmax of ``head(states)``, chunk by chunk (the frozen teacher's)."""
    out = torch.empty(states.shape[0], dtype=torch.int64, device=states.device)
    for start in range(0, states.shape[0], chunk_size):
        out[start:start + chunk_size] = _teacher_logits(head, states[start:start + chunk_size]) \
            .argmax(-1)
    return out


def next_token_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """(batch, seq) loss mask over tokens -> (batch, seq) mask over the logits predicting them.

    ``loss_mask[:, t] = 1`` means token t is to be predicted; the logits at position t - 1 predict
    it. Passing the full (batch, seq, vocab) logits with this mask avoids slicing ``[:, :-1]``.
    """
    if loss_mask.dim() < 1:
        raise ValueError("loss_mask needs a sequence dimension, got shape "
                         f"{tuple(loss_mask.shape)}")
    shifted = torch.zeros_like(loss_mask)
    shifted[..., :-1] = loss_mask[..., 1:]
    return shifted


class DraftLoss(nn.Module):
    """A draft plus its loss function as one module, what a trainer hands to
    ``accelerator.prepare``: DDP synchronises gradients through the wrapped module's forward,
    and a loss that runs the draft several times (training-time test, many blocks) is then one
    forward per micro-batch. Subclasses name the loss function's options a trainer sets once
    (``OPTIONS``); their one default is that function's signature's."""

    OPTIONS: tuple[str, ...] = ()

    def __init__(self, **options):
        super().__init__()
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise TypeError(f"{type(self).__name__} takes the loss's options "
                            f"{', '.join(self.OPTIONS)}; got {', '.join(unknown)}")
        self.loss_kwargs = options
