"""EAGLE training against straightforward references: the test-time attention without a dense
mask, the chunked losses, the sum reduction, gradient checkpointing and CPU bf16 autocast.

The references are the previous implementation, kept here: every training-time-test step runs
the head's inference forward over the KV cache of all earlier steps with a dense additive
(B, 1, S, (i + 1) S) mask, and the losses form the full (B, S, vocab) logits and distributions.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.heads.eagle import EagleHead, attention_bias, build_draft_vocab
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.eagle_loss import EagleLoss, eagle_loss
from draftsmith.targets.features import target_features
from draftsmith.targets.target import wrap_target

VOCAB, DRAFT_VOCAB, AUX = 96, 40, (1, 2, 3)


def make_target(dtype=torch.float64, kv_heads=2, seed=0):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=kv_heads,
                         max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # peaked distributions, as a trained LM's
        model.lm_head.weight.mul_(20)
    return wrap_target(model, name="tiny-training")


@pytest.fixture(scope="module")
def target():
    return make_target()


def make_batch(target, lengths=(23, 17, 9), seed=0, left=False):
    """Random rows (right-padded, or left-padded with ``left``), answers scored after a prompt."""
    gen = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    attention = torch.zeros(len(lengths), S, dtype=torch.long)
    loss_mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for r, n in enumerate(lengths):
        where = slice(S - n, S) if left else slice(0, n)
        ids[r, where] = torch.randint(1, VOCAB, (n,), generator=gen)
        attention[r, where] = 1
        scored = torch.zeros(n, dtype=torch.long)
        scored[3:] = 1
        loss_mask[r, where] = scored
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    return batch


def with_features(target, head, batch):
    out = dict(batch)
    out.update(target_features(target, batch["input_ids"], batch["attention_mask"], head.config))
    return out


def maps_for(target):
    counts = torch.arange(VOCAB).flip(0) % 9  # uneven: many target argmaxes fall outside
    return build_draft_vocab(counts, DRAFT_VOCAB)


def make_head(target, version, seed=1, **config):
    torch.manual_seed(seed)
    if version == 1:
        return EagleHead(EagleConfig.from_target(target, 1, **config), target)
    cfg = EagleConfig.from_target(target, 3, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB,
                                  **config)
    d2t, t2d = maps_for(target)
    head = EagleHead(cfg, target, d2t=d2t, t2d=t2d)
    with torch.no_grad():  # norms away from 1, so a swapped or skipped norm shows
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return head


# ------------------------------------------------------------------------------------------------
# The references


def shift_left(x, by, fill=0):
    if by == 0:
        return x
    return torch.cat([x[:, by:], x.new_full((x.shape[0], by, *x.shape[2:]), fill)], dim=1)


def dense_ttt_mask(S, step, dtype, key_valid):
    """(B, 1, S, (step + 1) S): step-0 entries causally (valid keys), then one diagonal per step."""
    k = torch.arange(S)
    first = (k[None, :] <= k[:, None])[None, None] & key_valid.bool()[:, None, None, :]
    diag = torch.eye(S, dtype=torch.bool)[None, None].expand(first.shape[0], 1, S, S)
    return attention_bias(torch.cat([first, *([diag] * step)], dim=-1), dtype)


def reference_steps(head, batch, steps):
    """The head's outputs and logits of each step, through its inference forward and a cache."""
    ids, features = batch["input_ids"], batch["features"]
    n = ids.shape[1] - 1
    valid = batch["attention_mask"][:, 1:]
    cache = head.new_cache()
    hidden = head.fuse(features[:, :-1])
    anchors = torch.arange(n)[None]
    outs = []
    for i in range(steps):
        mask = dense_ttt_mask(n, i, head.dtype, valid)
        hidden, logits = head(shift_left(ids[:, 1:], i), hidden, anchors + i, mask, cache)
        outs.append((hidden, logits))
    return outs


def reference_eagle3(head, batch, steps, decay, reduction):
    with torch.no_grad():
        full = head.frozen.lm_head(batch["last_hidden"][:, 1:])  # (B, n, V)
        in_vocab = head.t2d[full.argmax(-1)]
        kept = torch.arange(head.config.draft_vocab_size) + head.d2t
        target_logp = F.log_softmax(full[..., kept], dim=-1)
    loss, metrics = 0.0, {}
    for i, (_, logits) in enumerate(reference_steps(head, batch, steps)):
        weight = shift_left(batch["loss_mask"][:, 1:], 1 + i).bool() & shift_left(in_vocab, i, False)
        want = shift_left(target_logp, i)
        ce = -(want.exp() * F.log_softmax(logits, dim=-1)).sum(-1)
        count = weight.sum()
        total = (ce * weight).sum()
        loss = loss + decay**i * (total / count.clamp_min(1) if reduction == "mean" else total)
        metrics[f"ce_loss_{i}"] = total / count.clamp_min(1)
        metrics[f"acc_{i}"] = ((logits.argmax(-1) == want.argmax(-1)) & weight).sum() / count
        if i == 0:
            metrics["tokens"] = count
    return loss, metrics


def reference_eagle1(head, batch, ce_weight, reduction):
    (predicted, logits), = reference_steps(head, batch, 1)
    features = batch["features"]
    weight = shift_left(batch["loss_mask"][:, 1:], 1).bool()
    target_logp = F.log_softmax(head.frozen.lm_head(features[:, 1:]), dim=-1).detach()
    feature = F.smooth_l1_loss(predicted, features[:, 1:], reduction="none").mean(-1)
    ce = -(target_logp.exp() * F.log_softmax(logits, dim=-1)).sum(-1)
    count = weight.sum()
    total = ((feature + ce_weight * ce) * weight).sum()
    metrics = {"feature_loss": (feature * weight).sum() / count,
               "ce_loss": (ce * weight).sum() / count,
               "acc_0": ((logits.argmax(-1) == target_logp.argmax(-1)) & weight).sum() / count,
               "tokens": count}
    return (total / count if reduction == "mean" else total), metrics


def grads_of(head, loss):
    head.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------------------------
# test-time attention


@pytest.mark.parametrize("padded", [True, False])  # a bool mask, or the fused causal path
@pytest.mark.parametrize("kv_heads", [2, 4])  # grouped-query attention, and plain
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("version", [1, 3])
def test_ttt_steps_equal_the_dense_mask_implementation(version, dtype, kv_heads, padded):
    """Outputs of every step and the gradients through all of them, right-padded rows."""
    target = make_target(dtype=dtype, kv_heads=kv_heads)
    head = make_head(target, version)
    batch = with_features(target, head, make_batch(target, (23, 17, 9) if padded else (19, 19)))
    steps = 4
    ids = batch["input_ids"]
    n = ids.shape[1] - 1
    valid = batch["attention_mask"][:, 1:].bool()
    hidden = head.fuse(batch["features"][:, :-1])
    past, ours = [], []
    for i in range(steps):
        hidden, kv = head.ttt_step(shift_left(ids[:, 1:], i), hidden, torch.arange(n)[None] + i,
                                   past, valid if padded else None)
        past.append(kv)
        ours.append(hidden)
    theirs = [out for out, _ in reference_steps(head, batch, steps)]
    tol = dict(rtol=1e-10, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    rows = valid[..., None]  # padded anchors' outputs are unused (and differ: no keys at all)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a * rows, b * rows, msg=f"step {i}", **tol)
    probe = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i), dtype=dtype) * rows
             for i, o in enumerate(ours)]
    mine = grads_of(head, sum((o * p).sum() for o, p in zip(ours, probe)))
    ref = grads_of(head, sum((o * p).sum() for o, p in zip(theirs, probe)))
    for name in mine:
        torch.testing.assert_close(mine[name], ref[name], msg=name, **tol)


def test_left_padding_is_excluded_and_stays_finite(target):
    """Holes at the start of rows: padded keys never attended, padded queries stay finite."""
    head = make_head(target, 3)
    batch = with_features(target, head, make_batch(target, left=True))
    loss, metrics = eagle_loss(head, batch, steps=3, chunk_size=5, padding="any")
    expected, _ = reference_eagle3(head, batch, 3, 0.8, "mean")
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    grads = grads_of(head, loss)
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())


# ------------------------------------------------------------------------------------------------
# losses


@pytest.mark.parametrize("chunk", [1, 7, 4096])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_eagle3_loss_metrics_and_gradients_equal_the_reference(target, reduction, chunk):
    head = make_head(target, 3)
    batch = with_features(target, head, make_batch(target))
    loss, metrics = eagle_loss(head, batch, steps=4, decay=0.7, chunk_size=chunk,
                               reduction=reduction)
    expected, expected_metrics = reference_eagle3(head, batch, 4, 0.7, reduction)
    close = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss, expected, **close)
    for name, value in expected_metrics.items():
        torch.testing.assert_close(metrics[name].double(), value.double(), msg=name, **close)
    assert 0 < int(metrics["tokens"]) < int(batch["loss_mask"].sum())  # some rows skipped
    assert metrics["tokens"].dtype == torch.int64
    assert all(m.dim() == 0 and not m.requires_grad for m in metrics.values())
    mine, ref = grads_of(head, loss), grads_of(head, expected)
    for name in mine:
        torch.testing.assert_close(mine[name], ref[name], msg=name, **close)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_eagle1_loss_metrics_and_gradients_equal_the_reference(target, reduction):
    head = make_head(target, 1)
    batch = with_features(target, head, make_batch(target))
    loss, metrics = eagle_loss(head, batch, feature_noise=0.0, ce_weight=0.3, chunk_size=6,
                               reduction=reduction)
    expected, expected_metrics = reference_eagle1(head, batch, 0.3, reduction)
    close = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss, expected, **close)
    for name, value in expected_metrics.items():
        torch.testing.assert_close(metrics[name].double(), value.double(), msg=name, **close)
    mine, ref = grads_of(head, loss), grads_of(head, expected)
    for name in mine:
        torch.testing.assert_close(mine[name], ref[name], msg=name, **close)


def test_sum_is_mean_times_tokens_for_one_step(target):
    """What a trainer that divides by the tokens of the optimizer step relies on."""
    head = make_head(target, 3)
    batch = with_features(target, head, make_batch(target))
    mean, metrics = eagle_loss(head, batch, steps=1)
    total, sum_metrics = eagle_loss(head, batch, steps=1, reduction="sum")
    torch.testing.assert_close(total, mean * metrics["tokens"], rtol=1e-12, atol=0)
    assert torch.equal(metrics["tokens"], sum_metrics["tokens"])
    with pytest.raises(ValueError, match="reduction"):
        eagle_loss(head, batch, reduction="none")


@pytest.mark.parametrize("version", [1, 3])
def test_gradient_checkpointing_gives_the_same_gradients(target, version):
    head = make_head(target, version)
    batch = with_features(target, head, make_batch(target))
    calls = []
    head.decoder_layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    plain, plain_metrics = EagleLoss(head, steps=3, feature_noise=0.0)(batch, reduction="sum")
    ref = grads_of(head, plain)
    runs = len(calls)
    checked, metrics = EagleLoss(head, steps=3, feature_noise=0.0, gradient_checkpointing=True)(
        batch, reduction="sum")
    torch.testing.assert_close(checked, plain, rtol=0, atol=0)
    mine = grads_of(head, checked)
    assert len(calls) == 3 * runs  # the layer ran again in backward, once per step
    for name in mine:
        torch.testing.assert_close(mine[name], ref[name], rtol=1e-12, atol=1e-14, msg=name)
    assert metrics.keys() == plain_metrics.keys()


@pytest.mark.parametrize("version", [1, 3])
def test_bf16_autocast_on_cpu_is_close_to_float32(version):
    """The losses under CPU bf16 autocast: float32 results, finite, near the float32 ones."""
    target = make_target(dtype=torch.float32)
    head = make_head(target, version)
    batch = with_features(target, head, make_batch(target, lengths=(40, 33, 25)))
    loss32, metrics32 = eagle_loss(head, batch, steps=3, feature_noise=0.0)
    grads32 = grads_of(head, loss32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16, metrics16 = eagle_loss(head, batch, steps=3, feature_noise=0.0)
    assert loss16.dtype == torch.float32
    grads16 = grads_of(head, loss16)
    torch.testing.assert_close(loss16, loss32, rtol=3e-2, atol=0)
    assert torch.equal(metrics16["tokens"], metrics32["tokens"])  # the teacher is not autocast
    for name, g in grads16.items():
        assert g.dtype == torch.float32 and bool(torch.isfinite(g).all()), name
        assert (g - grads32[name]).norm() <= 0.1 * grads32[name].norm() + 1e-6, name
