"""Block drafts (DFlash, DSpark): the module, its loss, its artifact and its exactness in the
engine, on tiny random models."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from test_exactness import PROMPT, STEPS, VOCAB, exact_joint, worst_deviation

from draftsmith.eval.dflash import BlockProposer
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.sampling import SamplingParams
from draftsmith.heads.dflash import DFlashConfig, DFlashDraft, block_mask, load_dflash, save_dflash
from draftsmith.heads.dflash_loss import dflash_loss, row_block_weight, sample_anchors
from draftsmith.heads.draft_vocab import build_draft_vocab
from draftsmith.targets.target import wrap_target

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def target():
    return wrap_target(tiny_llama(layers=4, seed=2), name="tiny4")


def make_draft(target, method="dflash", draft_vocab=None, seed=0, **kw) -> DFlashDraft:
    cfg = DFlashConfig.from_target(target, method, num_layers=2, block_size=4,
                                   target_layer_ids=(0, 2), draft_vocab_size=draft_vocab,
                                   markov_rank=8 if method == "dspark" else None, **kw)
    maps = {}
    if draft_vocab:
        counts = torch.arange(target.vocab_size, 0, -1).double()
        maps = dict(zip(("d2t", "t2d"), build_draft_vocab(counts, draft_vocab), strict=True))
    torch.manual_seed(seed)
    draft = DFlashDraft(cfg, target, dtype=torch.float64, **maps)
    with torch.no_grad():  # a random draft that guesses something: larger weights than init
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return draft.eval()


def features(target, draft, ids):
    _, states = target.features(ids, list(draft.config.hidden_states_read))
    return torch.cat(states, dim=-1)


def test_block_mask_sees_earlier_context_and_its_own_block():
    valid = torch.tensor([[True, True, True, True, False]])
    allowed = block_mask(valid, torch.tensor([[2, -1]]), 2)  # (1, 4, 5 + 4)
    assert allowed[0, 0, :5].tolist() == [True, True, False, False, False]  # context < 2
    assert allowed[0, 0, 5:].tolist() == [True, True, False, False]  # its own block, both ways
    assert allowed[0, 1, 5:].tolist() == [True, True, False, False]
    assert allowed[0, 2, :5].tolist() == [False] * 5  # no anchor: sees itself only
    assert allowed[0, 2, 5:].tolist() == [False, False, True, True]


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_parallel_training_blocks_equal_one_block_at_inference(target, method):
    draft = make_draft(target, method)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, 14), generator=gen)
    feats = features(target, draft, ids)
    positions = torch.arange(14)[None]
    anchors = torch.tensor([[3, 8, 11]])
    size = draft.config.block_size
    block = torch.full((1, 3, size), draft.config.mask_token_id)
    block[:, :, 0] = ids[0, anchors[0]]
    pos = anchors[:, :, None] + torch.arange(size)
    together = draft.block(block.view(1, -1), pos.view(1, -1), draft.context(feats, positions),
                           block_mask(torch.ones(1, 14, dtype=torch.bool), anchors, size))
    for a, p in enumerate(anchors[0].tolist()):
        alone = draft.block(block[:, a], pos[:, a], draft.context(feats[:, :p], positions[:, :p]),
                            torch.ones(1, size, p + size, dtype=torch.bool))
        torch.testing.assert_close(together[0, a * size:(a + 1) * size], alone[0], rtol=1e-10,
                                   atol=1e-10)


@pytest.mark.parametrize("method,vocab", [("dflash", None), ("dflash", 40), ("dspark", 40)])
def test_the_loss_trains_the_draft_and_leaves_the_target(target, method, vocab):
    draft = make_draft(target, method, vocab).train()
    before = {n: p.clone() for n, p in target.model.named_parameters()}
    assert not any(p is target.embed.weight for p in draft.parameters())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (2, 16), generator=gen)
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    _, states = target.features(ids, [*draft.config.hidden_states_read, target.num_layers])
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask,
             "features": torch.cat(states[:-1], -1), "last_hidden": states[-1]}
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        anchors = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(step))
        loss, metrics = dflash_loss(draft, batch, anchors, soft_weight=0.5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
    assert "acc_0" in metrics and ("conf_loss" in metrics) == (method == "dspark")
    for n, p in target.model.named_parameters():
        assert torch.equal(p, before[n]), n
    # anchors: positions whose next token is scored, from p = 3 on (the row's weight counts them)
    anchors = sample_anchors(loss_mask, 100, torch.Generator().manual_seed(0))
    assert anchors[0].tolist() == list(range(3, 15))
    assert row_block_weight(loss_mask[0], 4, [1.0, 0.5]) == 4 * 1.5


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(target, method):
    draft = make_draft(target, method, 40).train()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, target.vocab_size, (2, 16), generator=gen)
    mask = torch.ones_like(ids)
    _, states = target.features(ids, [*draft.config.hidden_states_read, target.num_layers])
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask,
             "features": torch.cat(states[:-1], -1), "last_hidden": states[-1]}
    anchors = sample_anchors(mask, 5, torch.Generator().manual_seed(0))
    results = []
    for recompute in (False, True):
        draft.zero_grad()
        loss, _ = dflash_loss(draft, batch, anchors, soft_weight=0.5,
                              gradient_checkpointing=recompute)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters()
                                        if p.grad is not None}))
    (plain, plain_grads), (kept, kept_grads) = results
    torch.testing.assert_close(kept, plain, rtol=1e-12, atol=1e-12)
    assert plain_grads.keys() == kept_grads.keys() and len(plain_grads) > 4
    for name, grad in plain_grads.items():
        torch.testing.assert_close(kept_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_artifact_round_trip_and_refusals(target, tmp_path):
    draft = make_draft(target, "dspark", 40)
    save_dflash(draft, tmp_path / "a", target)
    back = load_dflash(tmp_path / "a", target, dtype=torch.float64)
    for (n, a), b in zip(draft.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="holds a dspark draft, not dflash"):
        load_dflash(tmp_path / "a", target, method="dflash")
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_target(target, target_layer_ids=(0, 3))  # the last layer
    with pytest.raises(ValueError, match="no Markov"):
        DFlashConfig(**{**draft.config.to_dict(), "method": "dflash"})


@pytest.mark.parametrize("key,value,said", [
    ("block_size", 10**9, "block_size must be an integer in 2..64, got 1000000000"),
    ("block_size", 1e9, "block_size must be an integer in 2..64, got 1000000000.0"),
    ("block_size", 4.0, "block_size must be an integer in 2..64, got 4.0"),
    ("block_size", 65, "block_size must be an integer in 2..64, got 65"),
    ("max_position_embeddings", 3, "block_size must be an integer in 2..3, got 4"),
    ("mask_token_id", 3.5, "mask_token_id must be an integer >= 0, got 3.5"),
    ("markov_rank", "8", "markov_rank must be an integer >= 0, got '8'"),
    ("target_layer_ids", [0.0, 2.0], "target_layer_ids must be a list of integer layer ids"),
    ("rope_theta", "big", "rope_theta must be a finite number > 0, got 'big'"),
    ("confidence_head", "yes", "confidence_head must be true or false"),
])
def test_a_hand_edited_config_is_refused_naming_the_file_and_key(target, tmp_path, key, value,
                                                                 said):
    """A config.json value that would allocate gigabytes (a block of 10**9 tokens) or is of the
    wrong type is refused when the draft is read, before anything is built from it."""
    import json

    path = save_dflash(make_draft(target), tmp_path / "a", target)
    config = json.loads((path / "config.json").read_text())
    config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    for load in (lambda: load_dflash(path, target),
                 lambda: BlockProposer.from_artifact(str(path), target)):
        with pytest.raises(ValueError) as info:
            load()
        assert str(info.value).startswith(f"{path / 'config.json'}: {said}"), str(info.value)


def test_a_published_layout_with_a_huge_block_is_refused_naming_its_file(target, tmp_path):
    """z-lab's layout (what vLLM reads) keeps block_size in dflash_config: read back, a block of
    1e9 tokens is refused naming the file, before a block is allocated."""
    import json

    from draftsmith.layouts.dflash import export_block

    artifact = save_dflash(make_draft(target), tmp_path / "a", target)
    out = export_block(artifact, "vllm", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["block_size"] = 1e9
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        BlockProposer.from_artifact(str(out), target)
    assert str(info.value).startswith(f"{out / 'config.json'}: block_size must be an integer in "
                                      "2..64, got 1000000000"), str(info.value)


@pytest.mark.parametrize("method,vocab", [("dflash", None), ("dspark", 40)])
def test_greedy_output_equals_plain_greedy(target, method, vocab):
    draft = make_draft(target, method, vocab)
    engine = SpeculativeEngine(target)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        prompt = torch.randint(0, target.vocab_size, (7,), generator=gen).tolist()
        plain = engine.generate(prompt, 20, GREEDY, stop_at_eos=False)
        blocks = engine.generate(prompt, 20, GREEDY, BlockProposer(draft), stop_at_eos=False)
        assert blocks.tokens == plain.tokens
        assert blocks.target_passes <= plain.target_passes


# ---- exactness at temperature > 0, against enumeration ----------------------------------------


@pytest.fixture(scope="module")
def small():
    target = wrap_target(tiny_llama(vocab=VOCAB, hidden=32, layers=4, seed=5, init=0.3),
                         name="v5x4")
    return target


WARPS = {"t1": SamplingParams(temperature=1.0),
         "t0.7-top-p": SamplingParams(temperature=0.7, top_p=0.9),
         "top-k": SamplingParams(temperature=1.0, top_k=3)}


def joint(target, proposer, params, samples):
    engine = SpeculativeEngine(target)
    counts = torch.zeros((VOCAB,) * STEPS, dtype=torch.long)
    for i in range(samples):
        out = engine.generate(PROMPT, STEPS, params, proposer, seed=i, stop_at_eos=False)
        counts[tuple(out.tokens)] += 1
    return counts


@pytest.mark.parametrize("warp_name", list(WARPS))
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_blocks_sample_the_exact_target_distribution(small, method, warp_name):
    params = WARPS[warp_name]
    draft = make_draft(small, method, seed=4, mask_token_id=0)
    counts = joint(small, BlockProposer(draft), params, 2500)
    assert worst_deviation(counts.flatten(), exact_joint(small, params).flatten()) <= 1.0
    g = SpeculativeEngine(small).generate(PROMPT, 40, params, BlockProposer(draft), seed=1,
                                          stop_at_eos=False)
    assert 0 < (g.alpha or 0) < 1  # the draft was used: some tokens accepted, some not


class _WrongDistribution(BlockProposer):
    """A broken rule: the chain says its tokens came from the uniform distribution."""

    def propose(self, seq, max_depth):
        tree = super().propose(seq, max_depth)
        if tree is not None:
            for node, q in tree.draft_probs.items():
                tree.draft_probs[node] = torch.full_like(q, 1.0 / q.numel())
        return tree


def test_the_check_catches_blocks_tested_against_the_wrong_distribution(small):
    params = WARPS["t1"]
    draft = make_draft(small, "dflash", seed=4, mask_token_id=0)
    counts = joint(small, _WrongDistribution(draft), params, 1500)
    assert worst_deviation(counts.flatten(), exact_joint(small, params).flatten()) > 1.0


def test_block_acceptance_equals_drafting_one_anchor_at_a_time(target):
    from draftsmith.eval.block_auto import block_acceptance, choose_block_length

    draft = make_draft(target, "dspark", 40, seed=7).train()
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, target.vocab_size, (6,), generator=gen).tolist()
    seq = prompt + SpeculativeEngine(target).generate(prompt, 16).tokens
    # fitted to this continuation, so that some depths are accepted and some not
    ids = torch.tensor([seq])
    _, states = target.features(ids, [*draft.config.hidden_states_read, target.num_layers])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "loss_mask": torch.ones_like(ids), "features": torch.cat(states[:-1], -1),
             "last_hidden": states[-1]}
    optimizer = torch.optim.Adam(draft.parameters(), lr=1e-2)
    for step in range(12):
        loss, _ = dflash_loss(draft, batch, sample_anchors(
            batch["loss_mask"], 8, torch.Generator().manual_seed(step)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    draft.eval()
    measured = block_acceptance(draft, target, [prompt], max_new_tokens=16)
    depth = draft.config.drafts_per_block
    hits, tried = [0] * depth, [0] * depth
    layers = list(draft.config.hidden_states_read)
    for p in range(len(prompt), len(seq) - 1):
        proposer = BlockProposer(draft)
        states, _ = target.hidden_states(torch.tensor([seq[:p]]), layers)
        proposer.start(seq[:p], [states[i] for i in layers], GREEDY, None)
        tree = proposer.propose(seq[:p + 1], len(seq) - 1 - p)
        for k, token in enumerate(tree.tokens):
            tried[k] += 1
            if token != seq[p + 1 + k]:
                break
            hits[k] += 1
    kept = sum(t > 0 for t in tried)
    assert measured["positions"] == tried[:kept]
    rates = [r[0] for r in measured["rank_accuracies"]]
    assert rates == pytest.approx([h / t for h, t in zip(hits[:kept], tried[:kept])])
    assert 0 < rates[0] < 1, rates
    # the length: more tokens pay only while their acceptance beats their verification cost
    costs = {1: 1.0, 2: 1.1, 3: 1.2, 4: 2.5, 5: 2.6}
    choice = choose_block_length([[0.9], [0.8], [0.7], [0.6]], costs, 0.1, 4)
    assert choice["tokens_per_round"] == 2
    assert choose_block_length([[0.9], [0.8]], costs, 0.1, 1)["tokens_per_round"] == 1
