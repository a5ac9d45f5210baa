"""draftsmith.heads.distill_loss: every divergence against a plain float64 reference, identities, chunking,
gradients (draft only), temperature, masks, dtypes and errors."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.heads import distill_loss as losses
from draftsmith.heads.chunked_loss import next_token_mask
from draftsmith.heads.distill_loss import (
    DIVERGENCES,
    argmax_agreement,
    divergence,
    expected_acceptance,
    forward_kl,
    jsd,
    reverse_kl,
    tvd,
)

VOCAB = 11


def reference(name: str, draft_logits, target_logits, mask, temperature=1.0, beta=0.5):
    """Plain float64 definition, one position at a time (differentiable in draft_logits)."""
    values = []
    batch, seq = mask.shape
    for b in range(batch):
        for t in range(seq):
            if not mask[b, t]:
                continue
            d = draft_logits[b, t].double() / temperature
            g = target_logits[b, t].double() / temperature
            draft_probs = torch.exp(d - d.max()) / torch.exp(d - d.max()).sum()
            target_probs = torch.exp(g - g.max()) / torch.exp(g - g.max()).sum()
            if name == "forward_kl":
                v = (target_probs * (target_probs.log() - draft_probs.log())).sum()
            elif name == "reverse_kl":
                v = (draft_probs * (draft_probs.log() - target_probs.log())).sum()
            elif name == "jsd":
                mix = beta * target_probs + (1 - beta) * draft_probs
                v = (beta * (target_probs * (target_probs / mix).log()).sum()
                     + (1 - beta) * (draft_probs * (draft_probs / mix).log()).sum())
            elif name == "tvd":
                v = 0.5 * (target_probs - draft_probs).abs().sum()
            values.append(v)
    if not values:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(values).mean()


def random_case(seed: int, batch=3, seq=7, vocab=VOCAB, scale=3.0, dtype=torch.float32,
                keep=0.6):
    gen = torch.Generator().manual_seed(seed)
    draft = (torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    target = (torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    mask = (torch.rand(batch, seq, generator=gen) < keep).long()
    mask[0, 0] = 1  # at least one valid position
    return draft, target, mask


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_value_matches_float64_reference(name, temperature, seed):
    draft, target, mask = random_case(seed)
    beta = 0.3
    ours = divergence(name, draft, target, mask, temperature=temperature, beta=beta, chunk_size=4)
    ref = reference(name, draft, target, mask, temperature, beta)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    torch.testing.assert_close(ours.double(), ref, rtol=2e-5, atol=2e-6)
    # float64 inputs are computed in float64: agreement to rounding
    ours64 = divergence(name, draft.double(), target.double(), mask, temperature=temperature,
                        beta=beta, chunk_size=4)
    assert ours64.dtype == torch.float64
    torch.testing.assert_close(ours64, ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradient_matches_reference_and_reaches_the_draft_only(name, temperature):
    draft, target, mask = random_case(3, dtype=torch.float64)
    draft_ours = draft.clone().requires_grad_(True)
    target_ours = target.clone().requires_grad_(True)
    loss = divergence(name, draft_ours, target_ours, mask, temperature=temperature, beta=0.4,
                      chunk_size=5)
    loss.backward()
    assert target_ours.grad is None  # the target's logits are constants

    draft_ref = draft.clone().requires_grad_(True)
    reference(name, draft_ref, target, mask, temperature, beta=0.4).backward()
    torch.testing.assert_close(draft_ours.grad, draft_ref.grad, rtol=1e-9, atol=1e-12)
    # masked positions get exactly zero gradient
    assert torch.all(draft_ours.grad[mask == 0] == 0)

    # float32 inputs: the same gradient to float32 accuracy
    draft32 = draft.float().requires_grad_(True)
    divergence(name, draft32, target.float(), mask, temperature=temperature, beta=0.4).backward()
    assert draft32.grad.dtype == torch.float32
    torch.testing.assert_close(draft32.grad.double(), draft_ref.grad, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_chunked_equals_unchunked(name):
    draft, target, mask = random_case(5, batch=2, seq=13)
    results = []
    for chunk in (None, 1, 2, 3, 7, 64):
        d = draft.clone().requires_grad_(True)
        loss = divergence(name, d, target, mask, chunk_size=chunk, beta=0.7)
        loss.backward()
        results.append((chunk, loss.detach(), d.grad))
    _, loss0, grad0 = results[0]
    for chunk, loss, grad in results[1:]:
        torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-7, msg=f"chunk {chunk}")
        torch.testing.assert_close(grad, grad0, rtol=1e-5, atol=1e-8, msg=f"chunk {chunk}")
    # and without autograd (the logging path) the same value
    with torch.no_grad():
        for chunk in (None, 3):
            torch.testing.assert_close(divergence(name, draft, target, mask, chunk_size=chunk,
                                                  beta=0.7), loss0, rtol=1e-6, atol=1e-7)


def test_identities():
    draft, target, mask = random_case(7, scale=4.0)
    # a distribution against itself
    for name in DIVERGENCES:
        for beta in (0.0, 0.5, 1.0):
            value = divergence(name, target.clone(), target, mask, beta=beta)
            assert abs(float(value)) < 1e-6, (name, beta, float(value))
    # KL is non-negative
    assert float(forward_kl(draft, target, mask)) > 0
    assert float(reverse_kl(draft, target, mask)) > 0
    # 0 <= JSD_beta <= H(beta) <= log 2, at every position (mask of one position at a time)
    for beta in (0.1, 0.5, 0.9):
        entropy = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
        for b in range(mask.shape[0]):
            for t in range(mask.shape[1]):
                one = torch.zeros_like(mask)
                one[b, t] = 1
                value = float(jsd(draft, target, one, beta=beta))
                assert 0.0 <= value <= entropy + 1e-6 <= math.log(2) + 1e-6
    # nearly disjoint distributions come close to the bound
    peaked_draft = torch.full((1, 1, VOCAB), -30.0)
    peaked_draft[..., 0] = 30.0
    peaked_target = torch.full((1, 1, VOCAB), -30.0)
    peaked_target[..., 1] = 30.0
    one = torch.ones(1, 1)
    assert float(jsd(peaked_draft, peaked_target, one)) == pytest.approx(math.log(2), abs=1e-5)
    assert float(tvd(peaked_draft, peaked_target, one)) == pytest.approx(1.0, abs=1e-6)
    # TVD = 1 - sum(min(target_probs, draft_probs)), position by position
    draft_probs = torch.softmax(draft.double(), -1)
    target_probs = torch.softmax(target.double(), -1)
    overlap = torch.minimum(draft_probs, target_probs).sum(-1)  # (batch, seq)
    expected = (1 - overlap)[mask.bool()].mean()
    torch.testing.assert_close(tvd(draft, target, mask).double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(expected_acceptance(draft, target, mask).double(),
                               overlap[mask.bool()].mean(), rtol=1e-5, atol=1e-6)


def test_jsd_endpoints_are_the_kl_limits():
    draft, target, mask = random_case(11)
    torch.testing.assert_close(jsd(draft, target, mask, beta=0.0), forward_kl(draft, target, mask))
    torch.testing.assert_close(jsd(draft, target, mask, beta=1.0), reverse_kl(draft, target, mask))
    eps = 1e-7
    d64, t64 = draft.double(), target.double()
    torch.testing.assert_close(jsd(d64, t64, mask, beta=eps) / eps, forward_kl(d64, t64, mask),
                               rtol=2e-3, atol=0)
    torch.testing.assert_close(jsd(d64, t64, mask, beta=1 - eps) / eps,
                               reverse_kl(d64, t64, mask), rtol=2e-3, atol=0)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_temperature_is_a_rescaling_of_the_logits(name):
    draft, target, mask = random_case(13, dtype=torch.float64)
    temperature = 1.7
    d = draft.clone().requires_grad_(True)
    loss = divergence(name, d, target, mask, temperature=temperature)
    loss.backward()
    scaled = (draft / temperature).requires_grad_(True)
    loss_scaled = divergence(name, scaled, target / temperature, mask)
    loss_scaled.backward()
    torch.testing.assert_close(loss, loss_scaled)
    torch.testing.assert_close(d.grad, scaled.grad / temperature)
    # and it matters: a different temperature gives a different value
    other = divergence(name, draft, target, mask, temperature=0.5)
    assert abs(float(other) - float(loss.detach())) > 1e-4


def test_mask_reduction_and_empty_mask():
    draft, target, mask = random_case(17)
    base = tvd(draft, target, mask)
    # what sits at masked positions does not matter
    noisy = draft.clone()
    noisy[mask == 0] = torch.randn_like(noisy[mask == 0]) * 50
    torch.testing.assert_close(tvd(noisy, target, mask), base)
    # boolean and float masks are the same mask
    torch.testing.assert_close(tvd(draft, target, mask.bool()), base)
    torch.testing.assert_close(tvd(draft, target, mask.float()), base)
    total = tvd(draft, target, mask, reduction="sum")
    torch.testing.assert_close(total, base * mask.sum(), rtol=1e-6, atol=1e-6)
    # no valid position: zero, with a zero gradient, not nan
    d = draft.clone().requires_grad_(True)
    empty = forward_kl(d, target, torch.zeros_like(mask))
    empty.backward()
    assert float(empty.detach()) == 0.0 and torch.all(d.grad == 0)


def test_gradient_scales_with_the_upstream_gradient():
    draft, target, mask = random_case(19)
    d1 = draft.clone().requires_grad_(True)
    forward_kl(d1, target, mask).backward()
    d2 = draft.clone().requires_grad_(True)
    (3.0 * forward_kl(d2, target, mask) + (d2 ** 2).sum() * 0).backward()
    torch.testing.assert_close(d2.grad, 3.0 * d1.grad)
    # a second backward through the same graph is refused, not silently wrong
    d3 = draft.clone().requires_grad_(True)
    loss = forward_kl(d3, target, mask)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()


def test_bfloat16_inputs_are_computed_in_float32():
    draft, target, mask = random_case(23)
    draft16, target16 = draft.bfloat16(), target.bfloat16()
    d = draft16.clone().requires_grad_(True)
    loss = jsd(d, target16, mask, beta=0.5)
    loss.backward()
    assert loss.dtype == torch.float32 and d.grad.dtype == torch.bfloat16
    ref_draft = draft16.double().requires_grad_(True)
    ref = reference("jsd", ref_draft, target16.double(), mask, beta=0.5)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d.grad.double(), ref_draft.grad, rtol=2e-2, atol=1e-4)


def test_target_with_impossible_tokens_stays_finite():
    # a target warped by top-k gives -inf logits; 0 * log 0 must count as 0, not nan
    draft, target, mask = random_case(29)
    target = target.clone()
    target[..., :4] = float("-inf")
    d = draft.clone().requires_grad_(True)
    loss = forward_kl(d, target, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(d.grad).all()
    probs = torch.softmax(target.double(), -1)
    logq = torch.log_softmax(draft.double(), -1)
    keep = probs > 0
    per_position = torch.where(keep, probs * (probs.log() - logq), torch.zeros_like(probs)).sum(-1)
    torch.testing.assert_close(loss.double(), per_position[mask.bool()].mean(), rtol=1e-5,
                               atol=1e-6)
    for name in ("jsd", "tvd"):
        assert torch.isfinite(divergence(name, draft, target, mask))


def test_argmax_agreement_counts_valid_positions():
    draft, target, mask = random_case(31, batch=4, seq=9, keep=0.7)
    draft = draft.clone()
    draft[1, :4] = target[1, :4]  # some positions agree for sure
    same = valid = 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                valid += 1
                same += int(int(draft[b, t].argmax()) == int(target[b, t].argmax()))
    assert float(argmax_agreement(draft, target, mask)) == pytest.approx(same / valid)
    assert float(argmax_agreement(target, target, mask)) == 1.0


def test_next_token_mask_aligns_full_logits_with_shifted_ones():
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1]])
    shifted = next_token_mask(loss_mask)
    assert shifted.tolist() == [[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0]]
    draft, target, _ = random_case(37, batch=2, seq=6)
    full = reverse_kl(draft, target, shifted)
    sliced = reverse_kl(draft[:, :-1], target[:, :-1], loss_mask[:, 1:])
    torch.testing.assert_close(full, sliced)


def test_errors_name_what_was_received():
    draft, target, mask = random_case(41)
    with pytest.raises(ValueError, match=r"draft logits have 11 .* target logits 12"):
        forward_kl(draft, torch.zeros(3, 7, 12), mask)
    with pytest.raises(ValueError, match="mask"):
        tvd(draft, target, mask[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        tvd(draft, target, mask, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        tvd(draft, target, mask, chunk_size=0)
    with pytest.raises(ValueError, match="beta"):
        jsd(draft, target, mask, beta=1.5)
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        divergence("kl", draft, target, mask)
    with pytest.raises(ValueError, match="reduction"):
        tvd(draft, target, mask, reduction="none")
    assert losses.DEFAULT_CHUNK_SIZE > 0
