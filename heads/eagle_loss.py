"""The EAGLE heads' losses, beside their module (heads/eagle.py).

The features they read come from the target: :func:`draftsmith.targets.features.target_features`.

Losses: the vocabulary projections (the head's logits and the target's distribution, from
``last_hidden`` through the frozen LM head) run ``chunk_size`` positions at a time in
:func:`draftsmith.heads.chunked_loss.projected_cross_entropy`, all training-time-test steps in one call, so
the extra memory is a few (chunk, vocab) float32 buffers plus one (vocab, hidden) weight gradient,
whatever T and the number of steps.

Training API (what a trainer calls)::

    cfg = EagleConfig.from_target(target, version=3, draft_vocab_size=8192)
    d2t, t2d = build_draft_vocab(count_tokens(ds["input_ids"], target.vocab_size,
                                              ds["loss_mask"]), cfg.draft_vocab_size)
    head = EagleHead(cfg, target, d2t=d2t, t2d=t2d, dtype=torch.float32)
    step = accelerator.prepare(EagleLoss(head, steps=7, chunk_size=256,
                                         gradient_checkpointing=False))
    batch = collate_causal_lm(rows, pad_id)                               # right-padded
    batch.update(target_features(target, batch["input_ids"], batch["attention_mask"], cfg))
    loss, metrics = step(batch, reduction="sum")  # sum over scored positions; metrics["tokens"]
    save_eagle(accelerator.unwrap_model(step).head, out / "artifact", target)
    head = load_eagle(out / "artifact", target)

Offline mode replaces ``target_features`` by the cache in ``train/features.py``, whose
batches carry the same keys and tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.chunked_loss import (
    DEFAULT_CHUNK_SIZE,
    DraftLoss,
    projected_argmax,
    projected_cross_entropy,
)
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle_config import (
    DEFAULT_CE_WEIGHT,
    DEFAULT_NOISE,
    DEFAULT_STEP_DECAY,
    DEFAULT_TTT_STEPS,
    REDUCTIONS,
)
from draftsmith.heads.ttt_attention import documents_of, resolve_backend

PADDINGS = ("right", "any")


def _with_noise(features: torch.Tensor, amount: float, generator) -> torch.Tensor:
    """Uniform noise in [-amount/2, amount/2) on the input features (EAGLE's robustness trick)."""
    if not amount:
        return features
    noise = torch.rand(
        features.shape, generator=generator, device=features.device, dtype=torch.float32
    )
    return features + ((noise - 0.5) * amount).to(features.dtype)


def _shift_left(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, by:] padded at the end to x's length along dim 1."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], by, *x.shape[2:]), fill)
    return torch.cat([x[:, by:], pad], dim=1)


def _anchor_mask(loss_mask: torch.Tensor, step: int) -> torch.Tensor:
    """(B, S-1): anchor t at step ``step`` predicts token t + 2 + step; weight loss_mask there."""
    return _shift_left(loss_mask[:, 1:], 1 + step).bool()


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _key_valid(attention_mask: torch.Tensor | None, padding: str) -> torch.Tensor | None:
    """(B, S) attention mask -> (B, S-1) bool over the anchors (entry t reads position t + 1),
    or None for right-padded rows: causal attention never lets a real anchor see the padding
    after it, so no mask is built (the fused kernels run without one)."""
    if padding not in PADDINGS:
        raise ValueError(f"padding must be one of {PADDINGS}, got {padding!r}")
    if attention_mask is None or padding == "right":
        return None
    return attention_mask[:, 1:].bool()


def _packing(position_ids: torch.Tensor | None, n: int, device
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(anchor positions (1 or B, n), anchor documents (B, n) or None, reach (1 or B, n)) of a
    batch of n + 1 tokens per row. Packed rows (``position_ids`` restarting at 0 per document)
    give each anchor its position and document; ``reach[j]`` is the position of token j + 2
    within its document: the anchor j - i of test-time step i that predicts it is in the same
    document exactly when reach >= i + 2 (for unpacked rows reach is j + 2)."""
    if position_ids is None:
        anchors = torch.arange(n, device=device)[None]
        return anchors, None, anchors + 2
    documents = documents_of(position_ids)[:, :-1]
    return position_ids[:, :-1], documents, _shift_left(position_ids[:, 1:], 1)


def _plain_lm_head(head: EagleHead) -> nn.Module:
    lm_head = head.frozen.lm_head
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError(
            "the target's LM head has a bias; the chunked EAGLE losses project with its weight "
            "alone and would drop it"
        )
    return lm_head


def eagle1_loss(
    head: EagleHead,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    feature_noise: float = DEFAULT_NOISE[1],
    ce_weight: float = DEFAULT_CE_WEIGHT,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    gradient_checkpointing: bool = False,
    reduction: str = "mean",
    generator: torch.Generator | None = None,
    position_ids: torch.Tensor | None = None,
    padding: str = "right",
    attention: str = "auto",
) -> tuple[torch.Tensor, dict]:
    """EAGLE-1: SmoothL1(next feature) + ce_weight x soft CE against the target's distribution.

    input_ids, loss_mask, attention_mask (B, S), right-padded; features (B, S, h) = the target's
    final-normed hidden states. The loss is per scored position (anchors t with loss_mask[t + 2])
    feature_loss + ce_weight * ce: averaged (``reduction="mean"``) or summed (``"sum"``). Returns
    (loss, metrics) with metrics 0-dim detached tensors: loss (the returned value), feature_loss,
    ce_loss, acc_0 (draft argmax == target argmax) as means per scored position, and tokens (the
    number of scored positions). ``position_ids``, ``padding`` and ``attention``: as
    :func:`eagle3_loss`.
    """
    if head.version != 1:
        raise ValueError("eagle1_loss needs an EAGLE-1 head; use eagle3_loss")
    _check_reduction(reduction)
    S = input_ids.shape[1]
    if S < 3:
        raise ValueError(f"sequences need at least 3 tokens to train EAGLE, got {S}")
    lm_head = _plain_lm_head(head)
    inputs = _with_noise(features[:, :-1], feature_noise, generator)
    positions, documents, reach = _packing(position_ids, S - 1, input_ids.device)
    predicted, _ = head.ttt_step(
        input_ids[:, 1:],
        head.fuse(inputs),
        positions,
        key_valid=_key_valid(attention_mask, padding),
        documents=documents,
        attention=resolve_backend(attention, input_ids.device),
        gradient_checkpointing=gradient_checkpointing,
    )  # (B, S-1, h)
    scored = _anchor_mask(loss_mask, 0) & (reach >= 2)  # anchor and token in one document
    b, t = scored.nonzero(as_tuple=True)  # the scored anchors, (N,) each
    rows = predicted[b, t]  # (N, h)
    wanted = features[:, 1:][b, t]  # (N, h) = f_{t+1}, also the target's distribution's state
    feature_sum = F.smooth_l1_loss(rows, wanted.to(rows.dtype), reduction="none").mean(-1).sum()
    count = max(int(b.numel()), 1)
    scale = 1.0 / count if reduction == "mean" else 1.0
    ce = projected_cross_entropy(
        head.logit_states(rows),
        head.logit_weight,
        teacher_states=wanted,
        teacher_head=lm_head,
        hard_weight=0.0,
        soft_weight=ce_weight,
        group_weights=[scale],
        chunk_size=chunk_size,
    )
    loss = scale * feature_sum + ce.loss
    metrics = {
        "loss": loss.detach(),
        "feature_loss": feature_sum.detach() / count,
        "ce_loss": (ce.soft_ce / count).to(loss.dtype),
        "acc_0": (ce.agree / count).to(loss.dtype),
        "tokens": ce.scored.to(torch.int64),
    }
    return loss, metrics


def eagle3_loss(
    head: EagleHead,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    last_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    steps: int = DEFAULT_TTT_STEPS,
    decay: float = DEFAULT_STEP_DECAY,
    feature_noise: float = DEFAULT_NOISE[3],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    gradient_checkpointing: bool = False,
    reduction: str = "mean",
    generator: torch.Generator | None = None,
    position_ids: torch.Tensor | None = None,
    padding: str = "right",
    attention: str = "auto",
) -> tuple[torch.Tensor, dict]:
    """EAGLE-3 training-time test: ``steps`` unrolled steps, soft CE weighted decay^i.

    input_ids, loss_mask, attention_mask (B, S), right-padded; features (B, S, 3h) the aux hidden
    states; last_hidden (B, S, h) index L. Step i feeds the head its own step i-1 features (step
    0: the fused target features) with the data's tokens, at positions t + i. The target's
    distribution is restricted to the draft vocabulary and renormalised; positions whose target
    argmax has no draft id are skipped (as in the reference code).

    ``reduction="mean"``: sum_i decay^i x (mean soft CE of step i over its scored positions);
    ``"sum"``: sum_i decay^i x (sum of step i's soft CE over its scored positions), for trainers
    that divide by a token count of their own (``tokens``). Returns (loss, metrics), metrics 0-dim
    detached tensors: loss (the returned value), ce_loss_i and acc_i per step (means; acc: draft
    argmax == target argmax), tokens (the positions step 0 scores).

    ``position_ids`` (B, S): packed rows, several documents end to end, positions restarting at
    0 for each (and no attention mask): the target's features were computed per document, every
    anchor attends within its document and no prediction crosses into the next one, so the
    loss equals the rows' loss unpacked. ``padding``: ``right`` (padding only after each row's
    tokens, what every collate here produces: no mask needed) or ``any`` (holes anywhere, excluded
    by a mask). ``attention``: the test-time attention kernel, ``sdpa``, ``flex`` or ``auto``
    (flex on a GPU; :mod:`draftsmith.heads.ttt_attention`).
    """
    if head.version != 3:
        raise ValueError("eagle3_loss needs an EAGLE-3 head; use eagle1_loss")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    _check_reduction(reduction)
    B, S = input_ids.shape
    if S < 3:
        raise ValueError(f"sequences need at least 3 tokens to train EAGLE, got {S}")
    lm_head = _plain_lm_head(head)
    n = S - 1  # anchors t = 0..S-2
    key_valid = _key_valid(attention_mask, padding)
    attention = resolve_backend(attention, input_ids.device)
    hidden = head.fuse(_with_noise(features[:, :-1], feature_noise, generator))  # (B, n, h)
    anchors, documents, reach = _packing(position_ids, n, input_ids.device)
    tokens = input_ids[:, 1:]
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    outputs = []
    for i in range(steps):
        hidden, kv = head.ttt_step(
            _shift_left(tokens, i),
            hidden,
            anchors + i,
            past,
            key_valid,
            documents=documents,
            attention=attention,
            gradient_checkpointing=gradient_checkpointing,
        )
        past.append(kv)
        outputs.append(hidden)
    # Step i's entry at anchor t predicts the token the target predicts at position t + 1 + i,
    # so every step is scored against the same rows j = t + i of the target's distribution
    # (j <-> position j + 1, weighted by loss_mask[j + 2]); step i lacks the rows whose anchor
    # j - i lies before the document of token j + 2 (j < i in an unpacked row).
    scored = _anchor_mask(loss_mask, 0) & (reach >= 2)
    b, j = scored.nonzero(as_tuple=True)  # (N,) each
    student = torch.stack(
        [head.logit_states(out[b, (j - i).clamp_min(0)]) for i, out in enumerate(outputs)]
    )  # (steps, N, h)
    depth = reach.expand(B, -1)[b, j]  # (N,) position of token j + 2 in its document
    row_mask = torch.stack([depth >= i + 2 for i in range(steps)])  # (steps, N)
    teacher_states = last_hidden[:, 1:][b, j]  # (N, h)
    columns = None
    if head.config.draft_vocab_size < head.config.vocab_size:
        columns = torch.arange(head.config.draft_vocab_size, device=head.device) + head.d2t
    weights = torch.tensor([decay**i for i in range(steps)], dtype=torch.float64)
    if reduction == "mean":
        scored = row_mask
        if columns is not None:  # which rows survive the skip: the target's argmax, once more
            scored = scored & head.t2d[projected_argmax(teacher_states, lm_head, chunk_size)]
        weights = weights.to(head.device) / scored.sum(-1).clamp_min(1)
    out = projected_cross_entropy(
        student,
        head.logit_weight,
        teacher_states=teacher_states,
        teacher_head=lm_head,
        teacher_columns=columns,
        row_mask=row_mask,
        group_weights=weights,
        hard_weight=0.0,
        soft_weight=1.0,
        chunk_size=chunk_size,
    )
    loss = out.loss
    count = out.scored.clamp_min(1)
    ce, acc = (out.soft_ce / count).to(loss.dtype), (out.agree / count).to(loss.dtype)
    metrics: dict[str, torch.Tensor] = {}
    for i in range(steps):
        metrics[f"ce_loss_{i}"] = ce[i]
        metrics[f"acc_{i}"] = acc[i]
    metrics["loss"] = loss.detach()
    metrics["tokens"] = out.scored[0].to(torch.int64)
    return loss, metrics


def eagle_loss(
    head: EagleHead,
    batch: dict,
    *,
    steps: int = DEFAULT_TTT_STEPS,
    decay: float = DEFAULT_STEP_DECAY,
    feature_noise: float | None = None,
    ce_weight: float = DEFAULT_CE_WEIGHT,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    gradient_checkpointing: bool = False,
    reduction: str = "mean",
    generator: torch.Generator | None = None,
    padding: str = "right",
    attention: str = "auto",
) -> tuple[torch.Tensor, dict]:
    """The head's loss on a batch with input_ids, attention_mask, loss_mask, features, last_hidden
    (and position_ids for packed rows: :func:`eagle3_loss`).

    ``feature_noise`` None -> the version's default (0.2 for EAGLE-1, 0 for EAGLE-3); ``steps``
    and ``decay`` are EAGLE-3's, ``ce_weight`` EAGLE-1's. ``reduction``: "mean" (per scored
    position) or "sum" (over scored positions; ``metrics["tokens"]`` counts step 0's).
    ``padding`` and ``attention``: :func:`eagle3_loss`'s.
    """
    missing = [k for k in ("input_ids", "loss_mask", "features", "last_hidden") if k not in batch]
    if missing:
        raise ValueError(
            f"batch lacks {missing}: add target_features(...) (online) or use the "
            "feature cache's collate (offline)"
        )
    noise = DEFAULT_NOISE[head.version] if feature_noise is None else feature_noise
    common = dict(
        feature_noise=noise,
        chunk_size=chunk_size,
        gradient_checkpointing=gradient_checkpointing,
        reduction=reduction,
        generator=generator,
        position_ids=batch.get("position_ids"),
        padding=padding,
        attention=attention,
    )
    if head.version == 1:
        return eagle1_loss(
            head,
            batch["input_ids"],
            batch["features"],
            batch["loss_mask"],
            batch.get("attention_mask"),
            ce_weight=ce_weight,
            **common,
        )
    return eagle3_loss(
        head,
        batch["input_ids"],
        batch["features"],
        batch["last_hidden"],
        batch["loss_mask"],
        batch.get("attention_mask"),
        steps=steps,
        decay=decay,
        **common,
    )


class EagleLoss(DraftLoss):
    """The head plus its loss as one module: what a trainer hands to ``accelerator.prepare``.

    DDP synchronises gradients through the wrapped module's ``forward``, and the loss runs the head
    several times (training-time test) and uses ``fc`` outside the head's own forward; wrapping
    the whole loss makes that one forward per step. The head stays ``.head`` (unwrap to save).
    The keywords are :func:`eagle_loss`'s; ``forward(batch, generator=None, reduction="mean")``.
    """

    # eagle_loss's options that a trainer sets once (reduction and generator come per call)
    OPTIONS = ("steps", "decay", "feature_noise", "ce_weight", "chunk_size",
               "gradient_checkpointing", "attention")

    def __init__(self, head: EagleHead, **options):
        super().__init__(**options)
        self.head = head

    def forward(
        self, batch: dict, generator: torch.Generator | None = None, reduction: str = "mean"
    ) -> tuple[torch.Tensor, dict]:
        return eagle_loss(
            self.head, batch, generator=generator, reduction=reduction, **self.loss_kwargs
        )
