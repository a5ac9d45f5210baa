"""Exactness at temperature > 0, proven statistically rather than assumed.

Each check compares an empirical distribution with the exact one (computed by enumeration) cell
by cell, with a tolerance derived from the sample count: |freq - p| <= Z * sqrt(p (1 - p) / n)
(+ 1/n for rare cells), Z chosen so that a correct rule fails with probability < 1e-3 over all
cells (Bonferroni). Each check is also run with a deliberately wrong rule, which must fail it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import noisy_copy, tiny_gemma3, tiny_llama

import draftsmith.eval.engine as engine_module
from draftsmith.eval.acceptance import TreeOutcome, verify_chain, verify_tree
from draftsmith.eval.draft import DraftModelProposer
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.sampling import SamplingParams, warp
from draftsmith.eval.tree import DraftTree
from draftsmith.targets.target import wrap_target


def z_for(cells: int, family_alpha: float = 1e-3) -> float:
    """Two-sided normal quantile giving family-wise error ``family_alpha`` over ``cells``."""
    per_cell = family_alpha / cells
    lo, hi = 0.0, 10.0
    for _ in range(60):  # bisection on the normal tail: erfc(z / sqrt 2) = per_cell
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erfc(mid / math.sqrt(2)) > per_cell else (lo, mid)
    return hi


def worst_deviation(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |freq - p| / tolerance over all cells; <= 1 means consistent with ``exact``."""
    n = float(counts.sum())
    freq = counts.double() / n
    exact = exact.double()
    z = z_for(exact.numel())
    tolerance = z * torch.sqrt(exact * (1 - exact) / n) + 1.0 / n
    return float(((freq - exact).abs() / tolerance).max())


# ---- pure rules ---------------------------------------------------------------------------------

SEED_TARGET = torch.tensor([0.30, 0.25, 0.18, 0.12, 0.10, 0.05])
SEED_DRAFT = torch.tensor([0.44, 0.15, 0.16, 0.05, 0.12, 0.08])


def test_seed_article_numbers():
    """Context-free target/draft of the seed article, K = 4, 200k rounds through verify_chain."""
    rounds, k = 200_000, 4
    gen = torch.Generator().manual_seed(0)
    draft_tokens = torch.multinomial(SEED_DRAFT, rounds * k, replacement=True, generator=gen)
    draft_tokens = draft_tokens.view(rounds, k)
    target_probs = SEED_TARGET.expand(rounds, k + 1, 6)
    draft_probs = SEED_DRAFT.expand(rounds, k, 6)
    accepted, nxt = verify_chain(draft_tokens, target_probs, draft_probs, gen)

    alpha = float(torch.minimum(SEED_TARGET, SEED_DRAFT).sum())
    assert alpha == pytest.approx(0.81)
    expected_tau = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert expected_tau == pytest.approx(3.428, abs=5e-4)
    per_round = (accepted + 1).double()
    sem = float(per_round.std()) / math.sqrt(rounds)
    assert abs(float(per_round.mean()) - expected_tau) < 4 * sem

    # every emitted token (accepted draft tokens, then the correction / bonus token)
    kept = torch.arange(k).expand(rounds, k) < accepted.unsqueeze(1)
    emitted = torch.cat([draft_tokens[kept], nxt])
    freq = torch.bincount(emitted, minlength=6).double() / emitted.numel()
    assert float((freq - SEED_TARGET.double()).abs().max()) < 0.002


def test_seed_article_always_accept_is_caught():
    """The check above rejects a rule that skips the rejection step."""
    rounds, k = 50_000, 4
    gen = torch.Generator().manual_seed(0)
    draft_tokens = torch.multinomial(SEED_DRAFT, rounds * k, replacement=True, generator=gen)
    emitted = draft_tokens  # "always accept": the draft's own tokens come out
    freq = torch.bincount(emitted, minlength=6).double() / emitted.numel()
    assert float((freq - SEED_TARGET.double()).abs().max()) > 0.002


def tree_first_token_counts(tree, target_logits, params, samples, seed, rule=verify_tree):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(target_logits.shape[-1], dtype=torch.long)
    for _ in range(samples):
        out = rule(tree, target_logits, params, gen)
        first = tree.tokens[out.path[0] - 1] if out.path else out.next_token
        counts[first] += 1
    return counts


def always_first_child(tree, target_logits, params, generator):
    """A wrong rule: take the first child without looking at the target."""
    kids = tree.children[0]
    if kids:
        return TreeOutcome([kids[0]], int(target_logits[kids[0]].argmax()), [1])
    return TreeOutcome([], int(target_logits[0].argmax()), [])


@pytest.mark.parametrize("mode", ["iid", "deterministic"])
def test_tree_rule_first_token_is_target_distributed(mode):
    """Root with 3 children: the first emitted token follows the warped target exactly."""
    vocab = 6
    gen = torch.Generator().manual_seed(1)
    target_logits = torch.randn(4, vocab, generator=gen, dtype=torch.float64) * 1.5
    params = SamplingParams(temperature=1.0)
    draft = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    exact = warp(target_logits[0], params).double()
    counts = torch.zeros(vocab, dtype=torch.long)
    samples = 20_000
    for _ in range(samples):
        if mode == "iid":
            kids = torch.multinomial(draft, 3, replacement=True, generator=gen).tolist()
            tree = DraftTree(kids, [0, 0, 0], {0: draft.float()})
        else:
            tree = DraftTree([3, 1, 5], [0, 0, 0])
        out = verify_tree(tree, target_logits.float(), params, gen)
        first = tree.tokens[out.path[0] - 1] if out.path else out.next_token
        counts[first] += 1
    assert worst_deviation(counts, exact) <= 1.0
    wrong = tree_first_token_counts(DraftTree([3, 1, 5], [0, 0, 0]), target_logits.float(),
                                    params, 2000, 0, rule=always_first_child)
    assert worst_deviation(wrong, exact) > 1.0


# ---- the whole engine on a tiny vocabulary -----------------------------------------------------

VOCAB, STEPS, PROMPT = 5, 3, [0, 3, 1]
SAMPLES = 2500


@pytest.fixture(scope="module")
def small():
    target = wrap_target(tiny_llama(vocab=VOCAB, hidden=32, seed=5, init=0.3), name="v5")
    draft = noisy_copy(target.model, 0.6, seed=9)
    return target, draft


_EXACT: dict = {}


def exact_joint(target, params: SamplingParams) -> torch.Tensor:
    """P(first STEPS tokens) under the warped target, by enumerating every prefix."""
    key = (id(target), params)
    if key not in _EXACT:
        _EXACT[key] = _enumerate_joint(target, params)
    return _EXACT[key]


def _enumerate_joint(target, params: SamplingParams) -> torch.Tensor:
    joint = torch.zeros((VOCAB,) * STEPS, dtype=torch.float64)
    model = target.model
    for seq in itertools.product(range(VOCAB), repeat=STEPS):
        p = 1.0
        for i in range(STEPS):
            logits = model(torch.tensor([PROMPT + list(seq[:i])])).logits[0, -1]
            p *= float(warp(logits, params)[seq[i]])
        joint[seq] = p
    return joint


def engine_joint(target, proposer, params, samples=SAMPLES) -> torch.Tensor:
    engine = SpeculativeEngine(target)
    counts = torch.zeros((VOCAB,) * STEPS, dtype=torch.long)
    for i in range(samples):
        out = engine.generate(PROMPT, STEPS, params, proposer, seed=i, stop_at_eos=False)
        counts[tuple(out.tokens)] += 1
    return counts


def make_proposer(kind, draft):
    if kind == "chain":
        return DraftModelProposer(draft, max_depth=2, min_confidence=0.0)
    if kind == "iid-tree":
        return DraftModelProposer(draft, branching=[3, 2], children="sample")
    return DraftModelProposer(draft, branching=[3, 2], children="topk")


PARAMS = {"t1": SamplingParams(temperature=1.0), "top-p": SamplingParams(temperature=1.0, top_p=0.9)}


@pytest.mark.parametrize("warp_name", list(PARAMS))
@pytest.mark.parametrize("kind", ["chain", "iid-tree", "topk-tree"])
def test_engine_samples_the_exact_target_distribution(small, kind, warp_name):
    target, draft = small
    params = PARAMS[warp_name]
    exact = exact_joint(target, params)
    proposer = make_proposer(kind, draft)
    counts = engine_joint(target, proposer, params)
    assert worst_deviation(counts.flatten(), exact.flatten()) <= 1.0
    # the draft was actually used: some of its tokens were accepted, some rejected
    g = SpeculativeEngine(target).generate(PROMPT, 40, params, make_proposer(kind, draft), seed=1,
                                           stop_at_eos=False)
    assert 0 < (g.alpha or 0) < 1


@pytest.fixture(scope="module")
def small_gemma():
    """A Gemma-3 whose sliding layers see 2 positions (the prompt is 3): the window shapes the
    joint distribution of the generated tokens."""
    target = wrap_target(tiny_gemma3(vocab=VOCAB, window=2, layers=3, seed=5, init=0.05),
                         name="g5")
    # an unrelated, more confident draft: its guesses are often rejected
    return target, tiny_gemma3(vocab=VOCAB, window=2, layers=3, seed=6, init=0.2)


@pytest.mark.parametrize("kind", ["chain", "iid-tree", "topk-tree"])
def test_engine_samples_exactly_on_a_sliding_window_target(small_gemma, kind):
    target, draft = small_gemma
    params = PARAMS["t1"]
    exact = exact_joint(target, params)
    unwindowed = tiny_gemma3(vocab=VOCAB, window=64, layers=3, seed=5, init=0.05)  # same weights
    full = _enumerate_joint(wrap_target(unwindowed, name="g5-full"), params)
    assert float((full - exact).abs().max()) > 0.01  # the window changes what is sampled
    counts = engine_joint(target, make_proposer(kind, draft), params)
    assert worst_deviation(counts.flatten(), exact.flatten()) <= 1.0
    g = SpeculativeEngine(target).generate(PROMPT, 40, params, make_proposer(kind, draft),
                                           seed=1, stop_at_eos=False)
    assert 0 < (g.alpha or 0) < 1


def _accept_everything_chain(draft_tokens, target_probs, draft_probs, generator=None):
    k = draft_tokens.shape[1]
    accepted = torch.full((draft_tokens.shape[0],), k, dtype=torch.long)
    nxt = torch.multinomial(target_probs[:, k], 1, generator=generator).squeeze(-1)
    return accepted, nxt


def _no_residual_tree(tree, target_logits, params, generator=None):
    """A wrong tree rule: after a rejection keep sampling from the unmodified target."""
    path, node = [], 0
    while True:
        probs = warp(target_logits[node], params)
        draft = tree.draft_probs.get(node)
        chosen = None
        for c in tree.children[node]:
            tok = tree.tokens[c - 1]
            chance = probs[tok] if draft is None else (probs[tok] / draft[tok]).clamp(max=1)
            if float(torch.rand((), generator=generator)) < float(chance):
                chosen = c
                break
        if chosen is None:
            return TreeOutcome(path, int(torch.multinomial(probs, 1, generator=generator)), [])
        path.append(chosen)
        node = chosen


def _first_child_tree(tree, target_logits, params, generator=None):
    """A wrong tree rule: follow the first child at every level, then sample the bonus token."""
    path, node = [], 0
    while tree.children[node]:
        node = tree.children[node][0]
        path.append(node)
    probs = warp(target_logits[node], params)
    return TreeOutcome(path, int(torch.multinomial(probs, 1, generator=generator)), [])


@pytest.mark.parametrize("kind,patch,wrong", [
    ("chain", "verify_chain", _accept_everything_chain),
    ("iid-tree", "verify_tree", _no_residual_tree),
    ("topk-tree", "verify_tree", _first_child_tree),
])
def test_the_check_catches_a_wrong_rule(small, monkeypatch, kind, patch, wrong):
    target, draft = small
    params = PARAMS["t1"]
    monkeypatch.setattr(engine_module, patch, wrong)
    counts = engine_joint(target, make_proposer(kind, draft), params, samples=800)
    assert worst_deviation(counts.flatten(), exact_joint(target, params).flatten()) > 1.0
