"""draftsmith.heads.chunked_loss: the chunked projection + cross-entropy against a plain float64 reference.

The reference forms the full (groups, n, vocab) logits and lets autograd differentiate them; the
chunked helper must give the same loss, sums and gradients for any chunk size, with groups,
row masks, group weights and a teacher restricted to the student's columns (EAGLE-3's draft
vocabulary, rows whose teacher argmax has no column skipped).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.heads.chunked_loss import projected_argmax, projected_cross_entropy

G, N, H, V_TEACHER = 3, 11, 6, 17
COLUMNS = torch.tensor([0, 2, 3, 5, 8, 9, 12, 16])  # the student's 8 columns among 17 teacher ids


@pytest.fixture
def problem():
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(G, N, H, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(len(COLUMNS), H, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher_states = torch.randn(N, H, generator=gen, dtype=torch.float64) * 2
    teacher_head = torch.nn.Linear(H, V_TEACHER, bias=False).double().requires_grad_(False)
    with torch.no_grad():
        teacher_head.weight.copy_(torch.randn(V_TEACHER, H, generator=gen, dtype=torch.float64))
    row_mask = torch.rand(G, N, generator=gen) > 0.2
    labels = torch.randint(0, len(COLUMNS), (N,), generator=gen)
    return states, weight, teacher_states, teacher_head, row_mask, labels


def reference(states, weight, labels, teacher_states, teacher_head, columns, row_mask,
              group_weights, hard_weight, soft_weight):
    """Everything at once: (loss, hard (G,), soft (G,), entropy (G,), agree (G,), scored (G,))."""
    logp = (states @ weight.T).log_softmax(-1)  # (G, n, V)
    with torch.no_grad():
        teacher_logits = teacher_head(teacher_states)  # (n, V_teacher)
        keep = row_mask.clone()
        if columns is not None:
            in_columns = torch.zeros(teacher_logits.shape[-1], dtype=torch.bool)
            in_columns[columns] = True
            keep &= in_columns[teacher_logits.argmax(-1)]
            teacher_logits = teacher_logits[:, columns]
        teacher_logp = teacher_logits.log_softmax(-1)
        teacher = teacher_logp.exp()
    hard = -logp.gather(-1, labels.expand(G, -1)[..., None])[..., 0]  # (G, n)
    soft = -(teacher * logp).sum(-1)  # (G, n)
    entropy = -(teacher * teacher_logp).sum(-1).expand(G, -1)
    agree = (logp.argmax(-1) == teacher.argmax(-1)).double()
    k = keep.double()
    sums = [(x * k).sum(-1) for x in (hard, soft, entropy, agree)]
    loss = (torch.as_tensor(group_weights, dtype=torch.float64)
            * (hard_weight * sums[0] + soft_weight * sums[1])).sum()
    return loss, *sums, k.sum(-1)


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("restricted", [False, True])
def test_grouped_loss_and_gradients_equal_the_unchunked_reference(problem, chunk, restricted):
    states, weight, teacher_states, teacher_head, row_mask, labels = problem
    columns = COLUMNS if restricted else None
    if not restricted:  # the teacher over the student's own vocabulary
        teacher_head = torch.nn.Linear(H, len(COLUMNS), bias=False).double().requires_grad_(False)
        with torch.no_grad():
            teacher_head.weight.copy_(weight.detach() * 1.5)
    group_weights = [1.0, 0.8, 0.64]
    kwargs = dict(hard_weight=0.3, soft_weight=0.7)
    out = projected_cross_entropy(states, weight, labels, teacher_states=teacher_states,
                                  teacher_head=teacher_head, teacher_columns=columns,
                                  row_mask=row_mask, group_weights=group_weights,
                                  chunk_size=chunk, topk=2, **kwargs)
    (out.loss * 1.7).backward()  # a scale from outside (e.g. 1 / tokens) reaches the gradients
    got = states.grad.clone(), weight.grad.clone()
    states.grad = weight.grad = None
    loss, hard, soft, entropy, agree, scored = reference(
        states, weight, labels, teacher_states, teacher_head, columns, row_mask, group_weights,
        **kwargs)
    (loss * 1.7).backward()
    torch.testing.assert_close(out.loss, loss)
    for name, ours, theirs in (("hard", out.hard_ce, hard), ("soft", out.soft_ce, soft),
                               ("entropy", out.teacher_entropy, entropy),
                               ("agree", out.agree, agree), ("scored", out.scored, scored)):
        torch.testing.assert_close(ours, theirs.to(ours.dtype), msg=name)
    if restricted:  # some rows were skipped because the teacher's argmax has no column
        assert bool((out.scored < row_mask.sum(-1)).any())
    torch.testing.assert_close(got[0], states.grad)
    torch.testing.assert_close(got[1], weight.grad)
    assert out.hits.shape == (G, 2) and out.count == N


def test_plain_rows_keep_the_two_dimensional_api(problem):
    states, weight, teacher_states, teacher_head, _, labels = problem
    teacher_head = torch.nn.Linear(H, len(COLUMNS), bias=False).double().requires_grad_(False)
    rows = states[0].detach().requires_grad_(True)
    out = projected_cross_entropy(rows, weight, labels, chunk_size=3, topk=3)
    out.loss.backward()
    logp = (rows @ weight.T).log_softmax(-1)
    torch.testing.assert_close(out.loss, F.nll_loss(logp, labels, reduction="sum"))
    top = logp.topk(3, -1).indices
    assert torch.equal(out.hits, (top == labels[:, None]).sum(0))
    assert out.hard_ce.dim() == 0 and out.scored == N and out.hits.shape == (3,)
    with pytest.raises(ValueError, match="together"):
        projected_cross_entropy(rows, weight, labels, teacher_states=teacher_states)
    with pytest.raises(ValueError, match="needs labels"):
        projected_cross_entropy(rows, weight, teacher_states=teacher_states,
                                teacher_head=teacher_head)
    with pytest.raises(ValueError, match="one weight per group"):
        projected_cross_entropy(states, weight, labels, group_weights=[1.0])
    with pytest.raises(ValueError, match="chunk_size"):
        projected_cross_entropy(rows, weight, labels, chunk_size=0)


@pytest.mark.parametrize("soft", [False, True])
def test_labels_without_a_column_are_never_hits_and_unscored_by_the_hard_term(problem, soft):
    """Label -1: the token has no row in weight (a draft vocabulary's miss)."""
    states, weight, teacher_states, teacher_head, _, labels = problem
    rows = states[0].detach().requires_grad_(True)
    missing = torch.zeros(N, dtype=torch.bool)
    missing[[1, 4, 5, 9]] = True
    marked = torch.where(missing, -1, labels)
    teacher = dict(teacher_states=teacher_states, teacher_head=teacher_head,
                   teacher_columns=COLUMNS) if soft else {}
    weights = dict(hard_weight=0.0, soft_weight=1.0) if soft else {}
    out = projected_cross_entropy(rows, weight, marked, chunk_size=3, topk=3, **teacher,
                                  **weights)
    out.loss.backward()
    got = rows.grad.clone(), weight.grad.clone()
    rows.grad = weight.grad = None
    # the same rows scored with labels everywhere: soft unchanged; hard over the labelled rows
    row_mask = None if soft else ~missing
    full = projected_cross_entropy(rows, weight, labels, chunk_size=3, topk=3, row_mask=row_mask,
                                   **teacher, **weights)
    full.loss.backward()
    torch.testing.assert_close(out.loss, full.loss)
    torch.testing.assert_close(got[0], rows.grad)
    torch.testing.assert_close(got[1], weight.grad)
    assert out.scored == full.scored
    logp = (rows @ weight.T).log_softmax(-1)
    hits = (logp.topk(3, -1).indices == labels[:, None]) & ~missing[:, None]
    if soft:  # rows whose teacher argmax has no column are skipped
        in_columns = torch.zeros(V_TEACHER, dtype=torch.bool)
        in_columns[COLUMNS] = True
        hits &= in_columns[teacher_head(teacher_states).argmax(-1)][:, None]
    assert torch.equal(out.hits, hits.sum(0)) and int(hits.sum()) > 0
    scored = ~missing  # hard_ce sums -log p(label) over the labelled rows that were scored
    if soft:
        scored &= in_columns[teacher_head(teacher_states).argmax(-1)]
    hard = -logp.gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(out.hard_ce, hard.detach()[scored].sum())


def test_frozen_weight_and_no_grad_keep_no_buffers(problem):
    states, weight, teacher_states, teacher_head, row_mask, _ = problem
    frozen = weight.detach()
    out = projected_cross_entropy(states, frozen, teacher_states=teacher_states,
                                  teacher_head=teacher_head, teacher_columns=COLUMNS,
                                  hard_weight=0.0, soft_weight=1.0, chunk_size=5)
    out.loss.backward()
    assert states.grad is not None and frozen.grad is None
    with torch.no_grad():
        quiet = projected_cross_entropy(states, weight, teacher_states=teacher_states,
                                        teacher_head=teacher_head, teacher_columns=COLUMNS,
                                        hard_weight=0.0, soft_weight=1.0)
    assert not quiet.loss.requires_grad
    torch.testing.assert_close(quiet.loss, out.loss.detach())


def test_projected_argmax_is_the_teachers_argmax(problem):
    _, _, teacher_states, teacher_head, _, _ = problem
    assert torch.equal(projected_argmax(teacher_states, teacher_head, chunk_size=4),
                       teacher_head(teacher_states).argmax(-1))


def test_bf16_autocast_keeps_softmax_in_float32_and_the_teacher_exact():
    """Under CPU bf16 autocast the student's projection runs in bf16, the rest stays float32."""
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(2, 64, 32, generator=gen, requires_grad=True)
    weight = (torch.randn(512, 32, generator=gen) * 0.5).requires_grad_(True)
    teacher_head = torch.nn.Linear(32, 1024, bias=False).requires_grad_(False)
    teacher_states = torch.randn(64, 32, generator=gen)
    columns = torch.arange(0, 1024, 2)
    kwargs = dict(teacher_states=teacher_states, teacher_head=teacher_head,
                  teacher_columns=columns, hard_weight=0.0, soft_weight=1.0, chunk_size=16)
    exact = projected_cross_entropy(states, weight, **kwargs)
    exact.loss.backward()
    grads = states.grad.clone(), weight.grad.clone()
    states.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = projected_cross_entropy(states, weight, **kwargs)
    assert low.loss.dtype == torch.float32
    low.loss.backward()
    # the teacher ran outside autocast: the same rows are skipped, the same entropies
    assert torch.equal(low.scored, exact.scored)
    torch.testing.assert_close(low.teacher_entropy, exact.teacher_entropy)
    torch.testing.assert_close(low.loss, exact.loss, rtol=2e-2, atol=0)
    for ours, theirs in zip((states.grad, weight.grad), grads):
        assert ours.dtype == torch.float32 and bool(torch.isfinite(ours).all())
        assert (ours - theirs).norm() < 0.05 * theirs.norm()
