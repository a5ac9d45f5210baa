"""Medusa: heads, loss and accuracies, static tree, exact verification, artifact and export."""

from __future__ import annotations

import itertools
import json
import math
from contextlib import contextmanager

import pytest
import torch
from medusa_reference import medusa_loss, rank_hits
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.eval.acceptance import TreeOutcome
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.medusa import (
    MedusaProposer,
    MedusaTree,
    TypicalMedusaProposer,
    typical_acceptance,
)
from draftsmith.eval.sampling import SamplingParams, warp
from draftsmith.eval.tree import DraftTree
from draftsmith.eval.tree_choice import choose_tree_nodes, plan_medusa_tree, size_medusa_tree
from draftsmith.eval.tree_cost import measure_head_cost, measure_verify_cost
from draftsmith.heads.draft_vocab import build_draft_vocab, count_tokens
from draftsmith.heads.medusa import (
    MedusaConfig,
    MedusaHeads,
    accuracy_metrics,
    load_medusa,
    medusa_param_counts,
    rank_accuracy,
    save_medusa,
    topk_accuracy,
)
from draftsmith.heads.medusa_tree import (
    build_medusa_tree,
    check_tree,
    choose_tree,
    expected_tau,
    grow_medusa_tree,
)
from draftsmith.layouts.export import export as export_any
from draftsmith.layouts.medusa import export_medusa, load_medusa_export, load_medusa_heads
from draftsmith.targets.target import wrap_target


def small_target(vocab: int, seed: int = 0, std: float = 0.02, name: str = "tiny"):
    """A 2-layer, hidden-64 random Llama in float64, no EOS (generations run to their length)."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      initializer_range=std, eos_token_id=None, bos_token_id=None,
                      pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).double()
    model.generation_config.eos_token_id = None
    return wrap_target(model, name=name)


def random_heads(target, num_heads: int = 3, num_layers: int = 1, share: bool = False,
                 seed: int = 1, scale: float = 0.3, maps=None) -> MedusaHeads:
    """Heads from ``target`` with random blocks (and perturbed projections), so guesses differ;
    ``maps`` (d2t, t2d): heads over that draft vocabulary."""
    d2t, t2d = maps or (None, None)
    heads = MedusaHeads.from_target(target, num_heads=num_heads, num_layers=num_layers,
                                    share_lm_head=share, d2t=d2t, t2d=t2d)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return heads.eval()


@contextmanager
def one_thread():
    """Tiny models run fastest on one thread, and the CPU is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target32():
    return small_target(32, seed=0, std=0.02, name="tiny32")


@pytest.fixture(scope="module")
def target6():
    return small_target(6, seed=0, std=0.1, name="tiny6")


# ---------------------------------------------------------------------------------------------
# heads


@pytest.mark.parametrize("share", [False, True])
def test_fresh_heads_are_the_lm_head_on_the_final_normed_state(target32, share):
    # zero blocks + the LM head's projection: every head reproduces the target's own logits,
    # which also checks that hidden index L is the final-normed state the LM head reads
    heads = MedusaHeads.from_target(target32, num_heads=4, num_layers=2, share_lm_head=share)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    logits, (hidden,) = target32.features(ids, [target32.num_layers])
    out = heads(hidden)  # (4, 1, 8, 32)
    assert out.shape == (4, 1, 8, 32)
    for k in range(4):
        torch.testing.assert_close(out[k], logits, rtol=0, atol=1e-12)
    names = set(dict(heads.named_parameters()))
    assert ("lm_heads.0.weight" in names) is (not share)
    assert all(n.startswith(("blocks.", "lm_heads.")) for n in heads.state_dict())
    # every block has its own parameters
    w = [layer.weight for b in heads.blocks for layer in b.layers]
    assert len({t.data_ptr() for t in w}) == len(w) == 8


def test_param_counts_match_the_module_and_smollm2_sizes(target32):
    for share in (False, True):
        heads = MedusaHeads.from_target(target32, num_heads=3, num_layers=2, share_lm_head=share)
        counts = medusa_param_counts(heads.config)
        assert counts["trainable"] == sum(p.numel() for p in heads.parameters())
        assert counts["trainable"] == sum(t.numel() for t in heads.state_dict().values())
    big = medusa_param_counts(MedusaConfig(hidden_size=576, vocab_size=49152, num_heads=4))
    assert big["blocks"] == 4 * (576 * 576 + 576) == 1_329_408
    assert big["lm_head_copies"] == 4 * 49152 * 576 == 113_246_208
    assert big["trainable"] == big["blocks"] + big["lm_head_copies"]
    shared = medusa_param_counts(MedusaConfig(576, 49152, 4, share_lm_head=True))
    assert shared["trainable"] == shared["blocks"] and shared["shared_lm_head"] == 49152 * 576


def test_shared_heads_project_in_one_pass_like_head_by_head(target32):
    """forward() batches the heads through the shared LM head: same logits as one head at a time."""
    heads = random_heads(target32, num_heads=3, share=True)
    hidden = torch.randn(2, 5, target32.hidden_size, dtype=target32.dtype)
    states = heads.head_states(hidden)
    one_by_one = torch.stack([heads.project(s, k) for k, s in enumerate(states)])
    torch.testing.assert_close(heads(hidden), one_by_one)
    torch.testing.assert_close(heads(hidden, num=2), one_by_one[:2])


@pytest.mark.parametrize("bad", [dict(num_heads=0), dict(num_heads=-2), dict(num_layers=-1),
                                 dict(hidden_size=0)])
def test_bad_config_is_refused(bad):
    kwargs = dict(hidden_size=8, vocab_size=10, **bad) if "hidden_size" not in bad else \
        dict(vocab_size=10, **bad)
    with pytest.raises(ValueError, match="must be an integer"):
        MedusaConfig(**kwargs)


def test_shared_heads_need_an_lm_head(target32):
    cfg = MedusaConfig(64, 32, 2, share_lm_head=True)
    with pytest.raises(ValueError, match="share the target's LM head"):
        MedusaHeads(cfg)
    wrong = torch.nn.Linear(64, 31, bias=False)
    with pytest.raises(ValueError, match="shape"):
        MedusaHeads(cfg, lm_head=wrong)


# ---------------------------------------------------------------------------------------------
# heads over a draft vocabulary

# target32's draft vocabulary in the tests: 12 of its 32 tokens, not a prefix of the ids
DRAFT_COUNTS = (torch.arange(32) * 7) % 11


def draft_maps(n: int = 12, counts=DRAFT_COUNTS):
    return build_draft_vocab(counts, n)


def test_draft_vocab_config_round_trips_and_defaults_to_the_whole_vocabulary():
    cfg = MedusaConfig(64, 32, 3, draft_vocab_size=12, share_lm_head=True)
    assert MedusaConfig.from_dict(cfg.to_dict()) == cfg and cfg.head_vocab_size == 12
    assert not cfg.reads_target_lm_head  # its own projection over the draft vocabulary
    old = MedusaConfig(64, 32, 3).to_dict()
    del old["draft_vocab_size"]  # an artifact written before the key existed
    back = MedusaConfig.from_dict(old)
    assert back.draft_vocab_size is None and back.head_vocab_size == 32
    for bad in (0, 33, True, 2.5):
        with pytest.raises(ValueError, match="draft_vocab_size must be None .* 1..32"):
            MedusaConfig(64, 32, 3, draft_vocab_size=bad)


@pytest.mark.parametrize("share", [False, True])
def test_draft_heads_project_onto_the_targets_rows_and_map_through_d2t(target32, share):
    d2t, t2d = draft_maps()
    kept = torch.nonzero(t2d).flatten()  # (12,) ascending target ids
    assert kept.tolist() != list(range(12))  # the offsets matter
    heads = MedusaHeads.from_target(target32, num_heads=3, num_layers=2, share_lm_head=share,
                                    d2t=d2t, t2d=t2d)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    logits, (hidden,) = target32.features(ids, [target32.num_layers])
    out = heads(hidden)  # (3, 1, 8, 12): identity blocks + the target's rows of the kept tokens
    assert out.shape == (3, 1, 8, 12)
    for k in range(3):
        torch.testing.assert_close(out[k], logits[..., kept], rtol=0, atol=1e-12)
    # candidates are target ids: the kept tokens in the order of the target's own logits
    top = heads.top_tokens(hidden, 4)  # (3, 1, 8, 4)
    expected = kept[logits[..., kept].topk(4, dim=-1).indices]
    assert torch.equal(top, expected.expand(3, -1, -1, -1))
    assert torch.equal(heads.draft_to_target(torch.arange(12)), kept)
    assert torch.equal(heads.target_to_draft(kept), torch.arange(12))
    dropped = torch.nonzero(~t2d).flatten()
    assert (heads.target_to_draft(dropped) == -1).all()
    # the search over kept ids (no vocabulary-sized temporary) agrees with the running count
    from draftsmith.heads.draft_vocab import target_to_draft
    every = torch.arange(t2d.numel()).reshape(2, -1)
    assert torch.equal(target_to_draft(t2d, every, heads.d2t), target_to_draft(t2d, every))
    names = set(heads.state_dict())
    assert {"d2t", "t2d"} <= names
    assert ("lm_head.weight" in names) is share
    assert ("lm_heads.0.weight" in names) is (not share)
    assert heads.lm_head_weight(0).shape == (12, 64) and heads.lm_head_weight(0).requires_grad
    counts = medusa_param_counts(heads.config)
    assert counts["trainable"] == sum(p.numel() for p in heads.parameters())
    assert counts["shared_lm_head"] == 12 * 64 and counts["lm_head_copies"] == 3 * 12 * 64
    with pytest.raises(ValueError, match="top 13 guesses; the heads guess among 12"):
        heads.top_tokens(hidden, 13)
    smol = medusa_param_counts(MedusaConfig(576, 49152, 4, share_lm_head=True,
                                            draft_vocab_size=8192))
    assert smol["trainable"] == smol["blocks"] + 8192 * 576


def test_draft_heads_refuse_missing_or_wrong_maps(target32):
    d2t, t2d = draft_maps()
    cfg = MedusaConfig(64, 32, 2, draft_vocab_size=12)
    with pytest.raises(ValueError, match="need its maps: pass d2t and t2d"):
        MedusaHeads(cfg)
    with pytest.raises(ValueError, match="d2t has 12 entries, MedusaConfig.draft_vocab_size is 11"):
        MedusaHeads(MedusaConfig(64, 32, 2, draft_vocab_size=11), d2t=d2t, t2d=t2d)
    with pytest.raises(ValueError, match="t2d does not mark"):
        MedusaHeads(cfg, d2t=d2t, t2d=~t2d)
    with pytest.raises(ValueError, match="set MedusaConfig.draft_vocab_size"):
        MedusaHeads(MedusaConfig(64, 32, 2), d2t=d2t, t2d=t2d)


# ---------------------------------------------------------------------------------------------
# loss and accuracies


def _onehot_logits(input_ids, num_heads, vocab, shift=0, scale=30.0):
    """Logits whose head k at position t is sure of input_ids[t + 1 + k + shift]."""
    batch, seq = input_ids.shape
    out = torch.zeros(num_heads, batch, seq, vocab, dtype=torch.float64)
    for k in range(1, num_heads + 1):
        for t in range(seq):
            j = t + 1 + k + shift
            if 0 <= j < seq:
                out[k - 1, :, t].scatter_(-1, input_ids[:, j:j + 1], scale)
    return out


def test_medusa_loss_aligns_head_k_with_token_t_plus_1_plus_k():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[:, :6] = 0
    right = medusa_loss(_onehot_logits(ids, 3, 11), ids, mask)
    wrong = medusa_loss(_onehot_logits(ids, 3, 11, shift=-1), ids, mask)
    assert right.per_head.max() < 1e-9
    assert wrong.per_head.min() > 1.0
    assert right.weights == pytest.approx([0.8, 0.64, 0.512])
    assert wrong.total.item() == pytest.approx(sum(w * v for w, v in zip(
        wrong.weights, wrong.per_head.tolist())))
    # scored positions: t with t+1+k < 12 and mask[t+1+k] = 1, i.e. t+1+k >= 6
    assert right.tokens.tolist() == [2 * (12 - 1 - k - (6 - 1 - k)) for k in (1, 2, 3)]
    # unscored positions (t+1+k < 6 for every head when t < 2) do not count
    garbled = _onehot_logits(ids, 3, 11)
    garbled[:, :, :2] = torch.randn(3, 2, 2, 11, dtype=torch.float64, generator=gen)
    assert medusa_loss(garbled, ids, mask).per_head.max() < 1e-9


def test_medusa_loss_soft_labels_follow_the_targets_distribution():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 7, (1, 9), generator=gen)
    mask = torch.ones_like(ids)
    heads = torch.randn(2, 1, 9, 7, dtype=torch.float64, generator=gen)
    target = torch.randn(1, 9, 7, dtype=torch.float64, generator=gen)
    out = medusa_loss(heads, ids, mask, target_logits=target)
    # head k at position t matches the target's distribution at t + k
    for k in (1, 2):
        manual = torch.stack([
            -(target[0, t + k].softmax(-1) * heads[k - 1, 0, t].log_softmax(-1)).sum()
            for t in range(9 - 1 - k)
        ]).mean()
        assert out.per_head[k - 1].item() == pytest.approx(manual.item(), rel=1e-6)
    # a sure target reduces to the hard labels
    sure = torch.zeros(1, 9, 7, dtype=torch.float64)
    sure[0, :-1].scatter_(-1, ids[0, 1:].unsqueeze(-1), 50.0)
    hard = medusa_loss(heads, ids, mask)
    soft = medusa_loss(heads, ids, mask, target_logits=sure)
    torch.testing.assert_close(soft.per_head, hard.per_head, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="decay"):
        medusa_loss(heads, ids, mask, decay=0.0)


def test_loss_trains_the_blocks_through_a_frozen_shared_head(target32):
    heads = MedusaHeads.from_target(target32, num_heads=2, share_lm_head=True)
    lm_before = target32.lm_head.weight.clone()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 32, (4, 16), generator=gen)
    mask = torch.ones_like(ids)
    _, (hidden,) = target32.features(ids, [target32.num_layers])
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    first = None
    with one_thread():
        for _ in range(15):
            out = medusa_loss(heads(hidden), ids, mask)
            opt.zero_grad()
            out.total.backward()
            opt.step()
            first = out.total.item() if first is None else first
    assert out.total.item() < first
    assert torch.equal(target32.lm_head.weight, lm_before)
    assert heads.blocks[0].layers[0].weight.abs().sum() > 0


def test_rank_hits_and_accuracies():
    ids = torch.tensor([[0, 1, 2, 3, 4, 5]])
    mask = torch.ones_like(ids)
    logits = torch.zeros(2, 1, 6, 6)
    # head 1 at t predicts ids[t+2]: put it at rank 0 for t=0, rank 1 for t=1, absent for t=2,3
    logits[0, 0, 0] = torch.tensor([0, 0, 9, 1, 0, 0.0])
    logits[0, 0, 1] = torch.tensor([0, 0, 0, 5, 0, 9.0])
    logits[0, 0, 2] = torch.tensor([9, 8, 7, 0, -1, 0.0])
    logits[0, 0, 3] = torch.tensor([9, 8, 7, 0, 0, -1.0])
    logits[1, 0, 0] = torch.tensor([0, 0, 0, 9, 0, 0.0])  # head 2 at t=0 wants ids[3] = 3
    hits, totals = rank_hits(logits, ids, mask, topk=3)
    assert totals.tolist() == [4, 3]
    assert hits[0].tolist() == [1, 1, 0]
    assert hits[1, 0].item() == 1
    acc = rank_accuracy(hits, totals)
    assert acc[0].tolist() == pytest.approx([0.25, 0.25, 0.0])
    assert topk_accuracy(hits, totals, 2)[0].item() == pytest.approx(0.5)
    metrics = accuracy_metrics(hits, totals, ks=(1, 5))
    assert metrics["medusa/head1_top1"] == pytest.approx(0.25)
    assert "medusa/head1_top5" not in metrics  # only counted up to top-3
    with pytest.raises(ValueError, match="k must be"):
        topk_accuracy(hits, totals, 4)


# ---------------------------------------------------------------------------------------------
# tree construction and budget


def test_tree_from_known_accuracies():
    acc = [[0.7, 0.15, 0.05], [0.6, 0.2, 0.1], [0.5, 0.2, 0.1]]
    # values: (0)=.7 (0,0)=.42 (0,0,0)=.21 (1)=.15 (0,1)=.14 (1,0)=.09 (0,0,1)=.084, then .07s
    grown = grow_medusa_tree(acc, 7)
    assert [p for p, _ in grown] == [(0,), (0, 0), (0, 0, 0), (1,), (0, 1), (1, 0), (0, 0, 1)]
    tree = build_medusa_tree(acc, 7)
    assert tree == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]
    assert expected_tau(tree, acc) == pytest.approx(1 + .7 + .42 + .21 + .15 + .14 + .09 + .084)
    assert build_medusa_tree(acc, 3, max_depth=1) == [(0,), (1,), (2,)]
    # a budget beyond every possible node returns them all (3 + 9 + 27)
    assert len(build_medusa_tree(acc, 1000)) == 39


def test_greedy_tree_is_the_best_closed_tree_for_sorted_accuracies():
    # with accuracies falling along ranks, values fall along children and siblings, so the
    # greedy tree must be the top-n nodes by value among all paths
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        raw = torch.rand(3, 4, generator=gen, dtype=torch.float64)
        acc = (raw.sort(-1, descending=True).values / raw.sum(-1, keepdim=True) * 0.9).tolist()
        paths = [p for d in (1, 2, 3) for p in itertools.product(range(4), repeat=d)]
        values = sorted((math.prod(acc[d][r] for d, r in enumerate(p)) for p in paths),
                        reverse=True)
        for n in (1, 5, 12):
            got = sum(v for _, v in grow_medusa_tree(acc, n))
            assert got == pytest.approx(sum(values[:n]))


def test_siblings_come_in_rank_order_even_when_a_lower_rank_is_likelier():
    acc = [[0.1, 0.5, 0.2]]
    assert [p for p, _ in grow_medusa_tree(acc, 2)] == [(0,), (1,)]


def test_bad_trees_and_accuracies_are_refused():
    with pytest.raises(ValueError, match="only 2 Medusa heads"):
        check_tree([(0,), (0, 0), (0, 0, 0)], num_heads=2)
    with pytest.raises(ValueError, match="at least one head"):
        check_tree([(0,)], num_heads=0)
    with pytest.raises(ValueError, match="parent"):
        check_tree([(0,), (1, 0)], num_heads=2)
    with pytest.raises(ValueError, match="ranks >= 0"):
        check_tree([(-1,)], num_heads=2)
    with pytest.raises(ValueError, match="non-empty"):
        check_tree([], num_heads=2)
    with pytest.raises(ValueError, match="cumulative"):
        build_medusa_tree([[0.5, 0.8, 0.9]], 3)
    with pytest.raises(ValueError, match="rectangular"):
        build_medusa_tree([[0.5, 0.1], [0.4]], 3)
    with pytest.raises(ValueError, match="num_heads >= 1"):
        build_medusa_tree(torch.zeros(0, 3), 3)
    with pytest.raises(ValueError, match="tree_nodes must be an integer"):
        build_medusa_tree([[0.5]], 0)


def test_budget_maximises_expected_tau_per_cost():
    acc = [[0.9], [0.9], [0.9]]  # a chain: taus 1.9, 2.71, 3.439 for 1, 2, 3 nodes
    gentle = {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5}
    choice = choose_tree_nodes(acc, gentle)
    assert choice.tree_nodes == 3 and choice.tree == [(0,), (0, 0), (0, 0, 0)]
    assert choice.expected_tau == pytest.approx(3.439)
    assert choice.predicted_speedup == pytest.approx(3.439 / 2.5)
    steep = {1: 1.0, 2: 1.2, 3: 2.2, 4: 3.2}
    assert choose_tree_nodes(acc, steep).tree_nodes == 1
    # costs between measured sizes are interpolated linearly
    assert choose_tree_nodes(acc, {1: 1.0, 4: 2.5}).tree_nodes == 3
    # the heads' own cost counts too: 1.9/(1.2+h) vs 3.439/(3.2+h) flips for a large h
    assert choose_tree_nodes(acc, steep, head_seconds=10.0).tree_nodes == 3
    with pytest.raises(ValueError, match="1 token"):
        choose_tree_nodes(acc, {2: 1.0, 4: 2.0})


def test_cost_measurement_and_plan_on_a_tiny_target(target32):
    with one_thread():
        costs = measure_verify_cost(target32, sizes=(1, 3, 5), context=16, repeats=1)
        assert sorted(costs) == [1, 3, 5] and all(c > 0 for c in costs.values())
        heads = random_heads(target32, num_heads=2)
        assert measure_head_cost(heads, topk=3, repeats=2) > 0
        tree, info = plan_medusa_tree(target32, heads, [[0.5, 0.2], [0.4, 0.1]], sizes=(1, 2, 4),
                                      context=16, repeats=1)
    assert 1 <= len(tree) <= 3 and info["tree_nodes"] == len(tree)
    assert info["expected_tau"] == pytest.approx(expected_tau(tree, info["rank_accuracies"]))
    assert set(info["verify_seconds"]) == {"1", "2", "4"}


# ---------------------------------------------------------------------------------------------
# the proposer and exact verification


def test_static_tree_to_draft_tree():
    tree = MedusaTree([(0,), (1,), (0, 0), (0, 1), (1, 0)], num_heads=2)
    top = torch.tensor([[10, 11], [20, 21]])
    draft = tree.draft_tree(top, max_depth=5)
    assert draft.tokens == [10, 11, 20, 21, 20]
    assert draft.parents == [0, 0, 1, 1, 2]
    assert draft.draft_probs == {}  # deterministic children: the exact point-mass rule
    shallow = tree.draft_tree(top, max_depth=1)
    assert shallow.tokens == [10, 11] and shallow.parents == [0, 0]


@pytest.mark.parametrize("share", [False, True])
def test_greedy_with_a_medusa_tree_equals_target_greedy(target32, share):
    heads = random_heads(target32, num_heads=3, share=share)
    tree = build_medusa_tree([[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.2, 0.1]], 12)
    proposer = MedusaProposer(target32, heads, tree)
    engine = SpeculativeEngine(target32)
    gen = torch.Generator().manual_seed(4)
    accepted = 0
    with one_thread():
        for _ in range(3):
            prompt = torch.randint(0, 32, (1, 6), generator=gen)
            reference = target32.model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30,
                do_sample=False, pad_token_id=0)[0, 6:].tolist()
            out = engine.generate(prompt[0].tolist(), 30, SamplingParams(), proposer)
            assert out.tokens == reference
            assert out.target_passes < 30 or not any(out.acceptance.accepted_per_depth)
            accepted += sum(out.acceptance.accepted_per_depth)
    assert accepted > 0, "no draft token was ever accepted: the test would not exercise the tree"


@pytest.mark.parametrize("share", [False, True])
def test_greedy_with_a_draft_vocabulary_equals_target_greedy(target32, share):
    """Reduced-vocabulary heads propose target ids through d2t; the target verifies over its
    whole vocabulary, so the output is plain greedy decoding, token for token."""
    engine = SpeculativeEngine(target32)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 32, (1, 6), generator=gen) for _ in range(6)]
    with one_thread():
        references = [target32.model.generate(
            p, attention_mask=torch.ones_like(p), max_new_tokens=30, do_sample=False,
            pad_token_id=0)[0, 6:].tolist() for p in prompts]
    # the draft vocabulary from "training data": the target's answers to the first three
    maps = build_draft_vocab(count_tokens(references[:3], 32), 12)
    heads = random_heads(target32, num_heads=3, share=share, maps=maps, scale=0.1)
    tree = build_medusa_tree([[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.2, 0.1]], 12)
    proposer = MedusaProposer(target32, heads, tree)
    proposed, accepted, outside = set(), 0, 0
    with one_thread():
        for prompt, reference in zip(prompts[3:], references[3:], strict=True):
            out = engine.generate(prompt[0].tolist(), 30, SamplingParams(), proposer)
            assert out.tokens == reference
            accepted += sum(out.acceptance.accepted_per_depth)
            outside += sum(not maps[1][t] for t in reference)
            proposed |= set(proposer.propose(prompt[0].tolist(), 3).tokens)
    assert accepted > 0, "no draft token was ever accepted: the test would not exercise the tree"
    assert outside > 0, "every emitted token was in the draft vocabulary: a weak test"
    assert proposed <= set(torch.nonzero(maps[1]).flatten().tolist())  # target ids, drafted
    with pytest.raises(ValueError, match="rank 12 but the heads guess among 12 tokens"):
        MedusaProposer(target32, heads, [(r,) for r in range(13)])


def _exact_first_three(target, prompt: list[int]) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3) of the target at temperature 1, by enumeration over the tiny vocabulary."""
    v = target.vocab_size
    pairs = list(itertools.product(range(v), repeat=2))
    ids = torch.tensor([prompt + [a, b] for a, b in pairs])
    with torch.no_grad():
        probs = target.model(ids).logits.softmax(-1)  # (v*v, len+2, v)
    n = len(prompt)
    out = {}
    for i, (a, b) in enumerate(pairs):
        pab = probs[i, n - 1, a] * probs[i, n, b]
        for c in range(v):
            out[(a, b, c)] = float(pab * probs[i, n + 1, c])
    return out


_VIEWS = ((0, 1, 2), (0, 1), (1, 2), (0, 2), (1,), (2,))  # the joint and its marginals


def _marginal(dist: dict, view: tuple[int, ...]) -> dict:
    out: dict = {}
    for outcome, mass in dist.items():
        key = tuple(outcome[i] for i in view)
        out[key] = out.get(key, 0) + mass
    return out


def _outside_bound(counts: dict, exact: dict, samples: int, delta: float = 1e-3) -> list:
    """Frequencies (joint and marginals) outside Bernstein's bound, union-bounded to delta.

    For one outcome of probability p, P(|freq - p| > eps) <= 2 exp(-n eps^2 / (2p(1-p) + 2eps/3)),
    so eps = sqrt(2 p (1-p) L / n) + 2 L / (3 n) with L = log(2 m / delta) over all m outcomes
    checked fails with probability at most delta under the exact rule.
    """
    checked = [(view, _marginal(exact, view), _marginal(counts, view)) for view in _VIEWS]
    log_term = math.log(2 * sum(len(e) for _, e, _ in checked) / delta)
    bad = []
    for view, probs, seen in checked:
        for outcome, p in probs.items():
            freq = seen.get(outcome, 0) / samples
            bound = math.sqrt(2 * p * (1 - p) * log_term / samples) + 2 * log_term / (3 * samples)
            if abs(freq - p) > bound:
                bad.append((view, outcome, freq, p, bound))
    return bad


class _AlwaysAccept(MedusaProposer):
    """A deliberately wrong rule: accept every first child, then sample from the target."""

    exact = False

    def lossy_verify(self, tree, target_logits, params, generator):
        node, path = 0, []
        while tree.children[node]:
            node = tree.children[node][0]
            path.append(node)
        probs = warp(target_logits[node], params)
        tried = list(range(1, len(path) + 1))
        return TreeOutcome(path, int(torch.multinomial(probs, 1, generator=generator)), tried)


class _NoRenormalisation(MedusaProposer):
    """A subtly wrong rule: accept child c with target(c), but never remove rejected children's
    mass (neither from the next child's chance nor from the final sample)."""

    exact = False

    def lossy_verify(self, tree, target_logits, params, generator):
        node, path, tried = 0, [], []
        while True:
            probs = warp(target_logits[node], params)
            if tree.children[node]:
                tried.append(tree.depths[node] + 1)
            accepted = next((c for c in tree.children[node] if float(
                torch.rand((), generator=generator)) < float(probs[tree.tokens[c - 1]])), None)
            if accepted is None:
                token = int(torch.multinomial(probs, 1, generator=generator))
                return TreeOutcome(path, token, tried)
            path.append(accepted)
            node = accepted


@pytest.mark.parametrize("draft", [None, 4])
def test_temperature_one_distribution_matches_the_target(target6, draft):
    # four new tokens: the first comes from the prefill, the first round then verifies a tree of
    # depth 2 (several children at depth 1 and 2), so the first three tokens depend on the
    # deterministic-children rule at both depths; their law must be the target's. ``draft``: the
    # heads guess among 4 of the 6 tokens (ids 0, 2, 3, 5), mapped to target ids through d2t.
    prompt = [1, 2, 3]
    exact = _exact_first_three(target6, prompt)
    assert sum(exact.values()) == pytest.approx(1.0)
    maps = None if draft is None else build_draft_vocab(torch.tensor([5, 1, 4, 3, 0, 2]), draft)
    heads = random_heads(target6, num_heads=2, scale=0.2, maps=maps)
    tree = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]
    engine = SpeculativeEngine(target6)
    params = SamplingParams(temperature=1.0)

    def sample(proposer, n):
        counts: dict[tuple, int] = {}
        accepted = [0, 0]
        with one_thread():
            for seed in range(n):
                g = engine.generate(prompt, 4, params, proposer, seed=seed)
                key = tuple(g.tokens[:3])
                counts[key] = counts.get(key, 0) + 1
                for d, a in enumerate(g.acceptance.accepted_per_depth[:2]):
                    accepted[d] += a
        return counts, accepted

    samples = 1000
    counts, accepted = sample(MedusaProposer(target6, heads, tree), samples)
    assert _outside_bound(counts, exact, samples) == []
    # the tree was really used: tokens were accepted at depth 1 and at depth 2
    assert accepted[0] > samples // 10 and accepted[1] > samples // 50
    if draft is not None:  # the wrong rules are rejected once, below, with full-vocabulary heads
        return
    # the same check rejects wrong rules, a blatant and a subtle one
    wrong, _ = sample(_AlwaysAccept(target6, heads, tree), 100)
    assert _outside_bound(wrong, exact, 100) != []
    subtle, _ = sample(_NoRenormalisation(target6, heads, tree), samples)
    assert _outside_bound(subtle, exact, samples) != []


def test_typical_acceptance_is_lossy_and_picks_the_longest_plausible_path():
    # root -> a(1) -> c(3); root -> b(2). Target at root: a likely; at a: c likely.
    tree = DraftTree([1, 2, 3], [0, 0, 1])
    logits = torch.full((4, 5), -10.0)
    logits[0, 1], logits[0, 2] = 5.0, 4.0
    logits[1, 3] = 5.0
    logits[3, 4] = 5.0
    params = SamplingParams(temperature=1.0)
    out = typical_acceptance(tree, logits, params, torch.Generator().manual_seed(0))
    assert out.path == [1, 3] and out.next_token == 4 and out.tried_depths == [1, 2]
    # make c implausible: only a is accepted
    logits[1, 3], logits[1, 0] = -10.0, 5.0
    out = typical_acceptance(tree, logits, params, torch.Generator().manual_seed(0))
    assert out.path == [1] and out.next_token == 0
    # temperature 0 is greedy verification
    greedy = typical_acceptance(tree, logits, SamplingParams(), None)
    assert greedy.path == [1] and greedy.next_token == 0


def test_typical_proposer_is_flagged_inexact(target32):
    heads = random_heads(target32, num_heads=2)
    typical = TypicalMedusaProposer(target32, heads, [(0,), (1,), (0, 0)])
    assert typical.exact is False and typical.name == "medusa-typical"
    assert MedusaProposer(target32, heads, [(0,)]).exact is True
    with one_thread():
        out = SpeculativeEngine(target32).generate([1, 2, 3], 12, SamplingParams(0.7), typical)
    assert len(out.tokens) == 12
    with pytest.raises(ValueError, match="posterior"):
        TypicalMedusaProposer(target32, heads, [(0,)], posterior_threshold=2.0)


# ---------------------------------------------------------------------------------------------
# artifact and export


@pytest.mark.parametrize("share", [False, True])
def test_artifact_round_trip_and_tree_override(target32, tmp_path, share):
    heads = random_heads(target32, num_heads=3, share=share)
    acc = [[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.2, 0.1]]
    tree = build_medusa_tree(acc, 6)
    save_medusa(tmp_path / "a", heads, target32, tree=tree, tree_info={"rank_accuracies": acc})
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["method"] == "medusa" and config["share_lm_head"] is share
    assert config["tree"] == [list(p) for p in tree]
    stored = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert ("lm_heads.0.weight" in stored) is (not share)
    art = load_medusa(tmp_path / "a", target32)
    h = torch.randn(5, 64, dtype=torch.float64)
    assert torch.equal(art.heads(h), heads(h)) and art.tree == tree
    proposer = MedusaProposer.from_artifact(str(tmp_path / "a"), target32)
    assert proposer.tree.paths == tree
    bigger = MedusaProposer.from_artifact(str(tmp_path / "a"), target32, tree_nodes=10,
                                          max_depth=2)
    assert bigger.tree.paths == build_medusa_tree(acc, 10, max_depth=2)
    narrow = MedusaProposer.from_artifact(str(tmp_path / "a"), target32, max_topk=1)
    assert narrow.tree.paths == build_medusa_tree([row[:1] for row in acc], len(tree))
    typical = MedusaProposer.from_artifact(tmp_path / "a", target32, typical=True,
                                           posterior_threshold=0.2, posterior_alpha=0.5)
    assert isinstance(typical, TypicalMedusaProposer) and not typical.exact
    assert (typical.posterior_threshold, typical.posterior_alpha) == (0.2, 0.5)
    with pytest.raises(ValueError, match="typical"):
        MedusaProposer.from_artifact(tmp_path / "a", target32, posterior_threshold=0.2)
    if share:
        with pytest.raises(ValueError, match="pass target"):
            load_medusa(tmp_path / "a")


def test_artifact_errors(target32, tmp_path):
    heads = random_heads(target32, num_heads=2)
    with pytest.raises(ValueError, match="only 2 Medusa heads"):
        save_medusa(tmp_path / "deep", heads, target32, tree=[(0,), (0, 0), (0, 0, 0)])
    save_medusa(tmp_path / "a", heads, target32)  # no tree given: each head's top-1 chain
    assert load_medusa(tmp_path / "a", target32).tree == [(0,), (0, 0)]
    other = small_target(40, name="other")
    with pytest.raises(ValueError, match="trained for target 'tiny32'"):
        load_medusa(tmp_path / "a", other)
    with pytest.raises(ValueError, match="trained for target"):
        MedusaProposer.from_artifact(str(tmp_path / "a"), other)
    with pytest.raises(ValueError, match="no held-out rank accuracies"):
        MedusaProposer.from_artifact(str(tmp_path / "a"), target32, tree_nodes=4)
    # without accuracies a stored tree can still be cut to a depth
    assert MedusaProposer.from_artifact(tmp_path / "a", target32, max_depth=1).tree.paths == [(0,)]
    with pytest.raises(ValueError, match="tree_nodes"):
        MedusaProposer.from_artifact(tmp_path / "a", target32, tree_nodes=0)
    with pytest.raises(FileNotFoundError):
        load_medusa(tmp_path / "missing", target32)
    with pytest.raises(ValueError, match="do not fit"):
        MedusaProposer(other, heads, [(0,)])
    with pytest.raises(ValueError, match="only 2 Medusa heads"):
        MedusaProposer(target32, heads, [(0,), (0, 0), (0, 0, 0)])


@pytest.mark.parametrize("fmt", ["vllm-0.32", "trtllm"])
@pytest.mark.parametrize("share,bias", [(False, True), (True, True), (False, False)])
def test_export_round_trip(target32, tmp_path, fmt, share, bias):
    heads = MedusaHeads.from_target(target32, num_heads=3, num_layers=2, share_lm_head=share,
                                    bias=bias)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    save_medusa(tmp_path / "a", heads, target32, tree=[(0,), (1,), (0, 0)])
    out = export_medusa(tmp_path / "a", fmt, tmp_path / fmt, target=target32 if share else None)
    meta = json.loads((out / "config.json").read_text())
    if fmt == "vllm-0.32":
        state = load_file(str(out / "model.safetensors"))
        expected = {f"blocks.{h}.layers.{j}.weight" for h in range(3) for j in range(2)}
        # a shared projection is read from lm_heads.0 only (original_lm_head)
        expected |= {f"lm_heads.{h}.weight" for h in (range(1) if share else range(3))}
        if bias:
            expected |= {f"blocks.{h}.layers.{j}.bias" for h in range(3) for j in range(2)}
        assert set(state) == expected
        assert (meta["num_heads"], meta["num_hidden_layers"]) == (3, 2)
        assert (meta["hidden_size"], meta["vocab_size"]) == (64, 32)
        assert meta["medusa_fc_bias"] is bias and meta["architectures"] == ["MedusaModel"]
    else:
        state = load_file(str(out / "medusa_lm_head.safetensors"))
        assert (meta["medusa_num_heads"], meta["medusa_num_layers"]) == (3, 2)
        assert "base_model_name_or_path" not in meta  # tiny32 has no hub id: nothing to name
        # TensorRT-LLM's converter reads exactly these keys
        for h in range(3):
            for j in range(2):
                assert state[f"{h}.{j}.linear.weight"].shape == (64, 64)
                assert state[f"{h}.{j}.linear.bias"].shape == (64,)
            assert state[f"{h}.2.weight"].shape == (32, 64)
    if share:  # the target's LM head fills the slots
        key = "lm_heads.0.weight" if fmt == "vllm-0.32" else "1.2.weight"
        assert torch.equal(state[key], target32.lm_head.weight)
    back = load_medusa_export(out)
    h = torch.randn(4, 64, dtype=torch.float64)
    assert torch.equal(back(h), heads(h))


def test_export_errors(target32, tmp_path):
    heads = random_heads(target32, num_heads=2)
    save_medusa(tmp_path / "a", heads, target32)
    with pytest.raises(ValueError, match="exports to trtllm | fasterdecoding | vllm-0.32"):
        export_medusa(tmp_path / "a", "onnx", tmp_path / "x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="did not write .notes.txt.*--overwrite"):
        export_medusa(tmp_path / "a", "vllm-0.32", busy)
    assert (busy / "notes.txt").read_text() == "keep me"
    export_medusa(tmp_path / "a", "vllm-0.32", tmp_path / "v")
    # a previous export is replaced; weights can be written in another dtype
    export_medusa(tmp_path / "a", "vllm-0.32", tmp_path / "v", dtype=torch.float32)
    assert {t.dtype for t in load_file(str(tmp_path / "v" / "model.safetensors")).values()} == {
        torch.float32}
    with pytest.raises(FileNotFoundError):
        load_medusa_export(tmp_path / "a")  # an artifact is not a serving layout


@pytest.mark.parametrize("share", [False, True])
def test_draft_vocab_artifact_round_trip(target32, tmp_path, share):
    maps = draft_maps()
    heads = random_heads(target32, num_heads=3, share=share, maps=maps)
    acc = [[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.2, 0.1]]
    tree = build_medusa_tree(acc, 6)
    save_medusa(tmp_path / "a", heads, target32, tree=tree, tree_info={"rank_accuracies": acc})
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["draft_vocab_size"] == 12 and config["share_lm_head"] is share
    stored = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    assert torch.equal(stored["d2t"], maps[0]) and torch.equal(stored["t2d"], maps[1])
    assert stored["lm_head.weight" if share else "lm_heads.2.weight"].shape == (12, 64)
    h = torch.randn(5, 64, dtype=torch.float64)
    # its own projection is stored: no target needed to load it, even with share_lm_head
    for art in (load_medusa(tmp_path / "a"), load_medusa(tmp_path / "a", target32)):
        assert torch.equal(art.heads(h), heads(h)) and art.tree == tree
        assert torch.equal(art.heads.top_tokens(h, 3), heads.top_tokens(h, 3))
    proposer = MedusaProposer.from_artifact(tmp_path / "a", target32, tree_nodes=10)
    assert proposer.tree.paths == build_medusa_tree(acc, 10)
    with pytest.raises(ValueError, match="trained for target 'tiny32'"):
        load_medusa(tmp_path / "a", small_target(32, seed=5, name="other32"))
    damaged = {k: v for k, v in stored.items() if k != "t2d"}
    from safetensors.torch import save_file
    save_file(damaged, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ValueError, match="lack d2t/t2d"):
        load_medusa(tmp_path / "a")


def test_full_vocabulary_artifacts_without_the_key_load_unchanged(target32, tmp_path):
    heads = random_heads(target32, num_heads=2)
    save_medusa(tmp_path / "a", heads, target32)
    path = tmp_path / "a" / "config.json"
    config = json.loads(path.read_text())
    assert config["draft_vocab_size"] is None
    del config["draft_vocab_size"]  # as written before the key existed
    path.write_text(json.dumps(config))
    art = load_medusa(tmp_path / "a", target32)
    h = torch.randn(3, 64, dtype=torch.float64)
    assert art.heads.config.draft_vocab_size is None and torch.equal(art.heads(h), heads(h))


def _vllm_compute_logits(draft_logits: torch.Tensor, token_map: torch.Tensor,
                         vocab: int) -> torch.Tensor:
    """vLLM <= 0.32 Medusa.compute_logits with a token_map: the draft logits scattered into the
    full vocabulary, -inf everywhere else."""
    full = torch.full((*draft_logits.shape[:-1], vocab), -torch.inf, dtype=draft_logits.dtype)
    full[..., token_map] = draft_logits
    return full


@pytest.mark.parametrize("share", [False, True])
def test_draft_vocab_exports_exactly_to_vllm_and_is_refused_elsewhere(target32, tmp_path, share):
    maps = draft_maps()
    heads = random_heads(target32, num_heads=3, share=share, maps=maps)
    save_medusa(tmp_path / "a", heads, target32, tree=[(0,), (1,), (0, 0)])
    out = export_medusa(tmp_path / "a", "vllm-0.32", tmp_path / "v")
    meta = json.loads((out / "config.json").read_text())
    assert (meta["vocab_size"], meta["truncated_vocab_size"]) == (32, 12)
    assert meta["original_lm_head"] is share
    state = load_file(str(out / "model.safetensors"))
    kept = torch.nonzero(maps[1]).flatten()
    assert state["token_map"].dtype == torch.int64 and torch.equal(state["token_map"], kept)
    heads_written = [k for k in state if k.startswith("lm_heads.")]
    assert heads_written == (["lm_heads.0.weight"] if share else
                             [f"lm_heads.{h}.weight" for h in range(3)])
    assert all(state[k].shape == (12, 64) for k in heads_written)
    # what vLLM computes from these tensors: per head, the draft logits scattered by token_map
    h = torch.randn(7, 64, dtype=torch.float64)
    states = heads.head_states(h)
    for k, x in enumerate(states):
        weight = state["lm_heads.0.weight" if share else f"lm_heads.{k}.weight"]
        full = _vllm_compute_logits(x @ weight.T, state["token_map"], 32)
        assert torch.equal(full.argmax(-1), heads.top_tokens(h, 1)[k, :, 0])
        assert torch.equal(full.topk(3, dim=-1).indices, heads.top_tokens(h, 3)[k])
    back = load_medusa_export(out)  # read back: the same draft vocabulary and logits
    assert back.config.draft_vocab_size == 12 and back.config.share_lm_head is share
    assert torch.equal(back(h), heads(h)) and torch.equal(back.d2t, maps[0])
    found = load_medusa_heads(out, target32)
    assert torch.equal(found.heads.top_tokens(h, 3), heads.top_tokens(h, 3))
    for fmt in ("trtllm", "fasterdecoding"):
        with pytest.raises(ValueError, match="draft_vocab_size 12 of the target's 32 tokens.*"
                                             "--format vllm-0.32.*draft_vocab_size: null"):
            export_any(tmp_path / "a", fmt, tmp_path / fmt, base_model="org/tiny",
                       write_pt=True)
        assert not (tmp_path / fmt).exists()


def test_a_vllm_export_with_full_rows_and_an_unsorted_token_map_reads_back(target32, tmp_path):
    """vLLM cuts full-vocabulary projections to token_map's rows, in token_map's order; the
    reader keeps the same tokens and logits with draft ids in ascending target order."""
    heads = random_heads(target32, num_heads=2)
    save_medusa(tmp_path / "a", heads, target32)
    out = export_medusa(tmp_path / "a", "vllm-0.32", tmp_path / "v")
    token_map = torch.tensor([30, 2, 17, 5, 9, 0, 11, 25])
    state = load_file(str(out / "model.safetensors"))
    state["token_map"] = token_map
    from safetensors.torch import save_file
    save_file(state, str(out / "model.safetensors"))
    meta = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**meta, "truncated_vocab_size": 8}))
    back = load_medusa_export(out)
    h = torch.randn(5, 64, dtype=torch.float64)
    for k, x in enumerate(heads.head_states(h)):
        cut = state[f"lm_heads.{k}.weight"][token_map]  # (8, 64), vLLM's rows
        full = _vllm_compute_logits(x @ cut.T, token_map, 32)
        assert torch.equal(back.top_tokens(h, 4)[k], full.topk(4, dim=-1).indices)
    (out / "config.json").write_text(json.dumps({**meta, "truncated_vocab_size": 8}))
    del state["token_map"]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="no token_map"):
        load_medusa_export(out)


# ---------------------------------------------------------------------------------------------
# slow: the real target


@pytest.mark.slow
def test_smollm2_greedy_with_identity_started_heads(tmp_path):
    from draftsmith.targets.target import load_target

    target = load_target("smollm2-135m", device="cpu", dtype="float32")
    heads = MedusaHeads.from_target(target, num_heads=4, share_lm_head=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    tree = build_medusa_tree(
        [[0.4, 0.1, 0.05], [0.3, 0.1, 0.05], [0.2, 0.1, 0.05], [0.1, 0.1, 0.05]], 10)
    proposer = MedusaProposer(target, heads, tree)
    engine = SpeculativeEngine(target)
    prompt = target.chat_ids("List three colours of the rainbow.")
    plain = engine.generate(prompt, 32, SamplingParams(), None)
    medusa = engine.generate(prompt, 32, SamplingParams(), proposer)
    assert medusa.tokens == plain.tokens
    assert medusa.target_passes <= plain.target_passes

    save_medusa(tmp_path / "a", heads, target, tree=tree)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Name a primary colour."]}) + "\n")
    from draftsmith.eval.bench import main as bench

    records = bench(["--target", "smollm2-135m", "--method", "plain",
                     "--method", f"medusa:{tmp_path / 'a'}", "--prompts", str(prompts),
                     "--max-new-tokens", "16", "--warmup", "0", "--no-progress"])
    by_name = {r["method"]: r for r in records}
    assert by_name[f"medusa:{tmp_path / 'a'}"]["greedy_identical"] is True


def test_choose_tree_is_the_one_entry_for_trainer_and_evaluator(target32):
    acc = [[0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]
    tree, info = choose_tree(acc, num_heads=2, tree_nodes=4)
    assert tree == build_medusa_tree(acc, 4) and info["tree_nodes"] == 4
    assert info["expected_tau"] == pytest.approx(expected_tau(tree, acc))
    assert choose_tree(acc, 2, 4, max_depth=1)[0] == [(0,), (1,), (2,)]
    assert choose_tree(acc, 2, 5, max_topk=1)[0] == [(0,), (0, 0)]
    chain, info = choose_tree(None, num_heads=3, tree_nodes=8)
    assert chain == [(0,), (0, 0), (0, 0, 0)] and "no held-out" in info["note"]
    with pytest.raises(ValueError, match="sized by this machine's measured costs"):
        choose_tree(acc, 2, "auto")  # the size by cost is the tree sizing's (draftsmith.eval.tree_auto)
    with pytest.raises(ValueError, match="pass target= and heads="):
        size_medusa_tree(acc, 2, "auto")
    assert size_medusa_tree(acc, 2, 4) == choose_tree(acc, 2, 4)
    with one_thread():
        heads = random_heads(target32, num_heads=2)
        auto, info = size_medusa_tree(acc, 2, "auto", target=target32, heads=heads)
    assert len(auto) == info["tree_nodes"] and "verify_seconds" in info and info["machine_key"]
    with pytest.raises(ValueError, match="tree_nodes must be"):
        choose_tree(acc, 2, "many")
