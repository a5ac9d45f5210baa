"""EAGLE heads, their losses and the EAGLE proposer (the offline feature cache: test_eagle_features.py).

A tiny random float64 Llama target (4 layers) stands in for the real one. "Trained" heads are
fitted for a few dozen steps on the target's own greedy continuations of the test prompts: they
then draft those continuations, so high acceptance shows that training and inference agree on
alignment, positions and the index convention (a random head would be accepted by luck only).
"""

from __future__ import annotations

import copy
import gc
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.eval.eagle import EagleProposer
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.kv import crop
from draftsmith.eval.sampling import SamplingParams
from draftsmith.heads.eagle import (
    EagleHead,
    build_draft_vocab,
    check_vocab_maps,
    count_tokens,
    load_eagle,
    save_eagle,
)
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.eagle_loss import EagleLoss, eagle_loss
from draftsmith.targets.features import target_features
from draftsmith.targets.target import wrap_target
from draftsmith.train.accelerator import close_process_group
from draftsmith.train.rows import collate_causal_lm

VOCAB, DRAFT_VOCAB = 96, 48
AUX = (1, 2, 3)
PROMPTS = [[5, 17, 33, 2, 9], [60, 61, 62], [11, 12, 40, 41, 42, 43, 80]]
NEW_TOKENS = 40


def make_target(seed: int = 0, vocab: int = VOCAB, hidden: int = 64):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64)
    with torch.no_grad():  # a peaked next-token distribution, like a trained LM's (entropy ~1.4)
        model.lm_head.weight.mul_(30)
    return wrap_target(model, name=f"tiny-{vocab}-{hidden}")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny models run fastest on one thread, and the CPU is shared with other test runs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def engine(target):
    return SpeculativeEngine(target)


@pytest.fixture(scope="module")
def greedy(engine):
    """Plain greedy continuations of the test prompts (the reference every method must match)."""
    return [engine.generate(p, NEW_TOKENS, SamplingParams()).tokens for p in PROMPTS]


@pytest.fixture(scope="module")
def batch(greedy):
    """The prompts with their greedy continuations as a training batch (answers are assistant)."""
    rows = [
        {"input_ids": p + g, "loss_mask": [0] * len(p) + [1] * len(g)}
        for p, g in zip(PROMPTS, greedy)
    ]
    return rows, collate_causal_lm(rows, pad_token_id=0)


@pytest.fixture(scope="module")
def maps(batch):
    _, b = batch
    counts = count_tokens(b["input_ids"].tolist(), VOCAB, b["loss_mask"].tolist())
    return build_draft_vocab(counts, DRAFT_VOCAB)


def make_head(target, version, maps, seed=1):
    torch.manual_seed(seed)
    if version == 1:
        return EagleHead(EagleConfig.from_target(target, 1), target)
    cfg = EagleConfig.from_target(target, 3, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB)
    return EagleHead(cfg, target, d2t=maps[0], t2d=maps[1])


def online_batch(target, head, collated):
    b = dict(collated)
    b.update(target_features(target, b["input_ids"], b["attention_mask"], head.config))
    return b


def fit(head, batch_, steps):
    """Adam on one repeated batch; returns the losses."""
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss, _ = eagle_loss(head, batch_, feature_noise=0.0, steps=3, ce_weight=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(scope="module")
def heads(target, batch, maps):
    """version -> {"random": head, "trained": head}."""
    out = {}
    for version in (1, 3):
        trained = make_head(target, version, maps)
        fit(trained, online_batch(target, trained, batch[1]), 60)
        out[version] = {"random": make_head(target, version, maps, seed=7), "trained": trained}
    return out


# ------------------------------------------------------------------------------------------------
# draft vocabulary


def test_build_draft_vocab_keeps_most_frequent_and_maps_exactly():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_draft_vocab(counts, 4)
    kept = [2, 3, 5, 0]  # most frequent first; 2 and 3 tie and both fit
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (torch.arange(4) + d2t).tolist() == sorted(kept)  # draft ids follow ascending target ids
    assert t2d.nonzero().flatten().tolist() == sorted(kept)
    # a tie at the cut goes to the lower id; unseen tokens fill up by id
    assert (torch.arange(3) + build_draft_vocab(torch.tensor([1, 2, 2, 2]), 3)[0]).tolist() == [
        1,
        2,
        3,
    ]
    assert (torch.arange(3) + build_draft_vocab(torch.tensor([0, 4, 0, 0]), 3)[0]).tolist() == [
        0,
        1,
        2,
    ]
    check_vocab_maps(d2t, t2d, 8)
    with pytest.raises(ValueError, match="1..8"):
        build_draft_vocab(counts, 9)


def test_check_vocab_maps_refuses_inconsistent_maps():
    d2t, t2d = build_draft_vocab(torch.tensor([3, 1, 4, 1, 5, 9]), 3)
    bad_t2d = t2d.clone()
    bad_t2d[0] = ~bad_t2d[0]
    with pytest.raises(ValueError, match="t2d does not mark"):
        check_vocab_maps(d2t, bad_t2d, 6)
    with pytest.raises(ValueError, match="outside"):
        check_vocab_maps(d2t + 10, t2d, 6)
    with pytest.raises(ValueError, match="ascending"):
        check_vocab_maps(torch.tensor([2, 0, -2]), t2d, 6)


def test_count_tokens_counts_only_masked_tokens():
    counts = count_tokens([[1, 2, 2], [3, 2]], 5, [[0, 1, 1], [1, 0]])
    assert counts.tolist() == [0, 0, 2, 1, 0]
    with pytest.raises(ValueError, match="outside"):
        count_tokens([[7]], 5)


# ------------------------------------------------------------------------------------------------
# the head


def test_config_validation(target, maps):
    with pytest.raises(ValueError, match="three distinct ascending"):
        EagleConfig.from_target(target, 3)  # (2, 2, 1) for a 4-layer target
    with pytest.raises(ValueError, match="three distinct ascending"):
        EagleConfig.from_target(target, 3, aux_layer_ids=(1, 2, 4))  # 4 = L is not a layer input
    with pytest.raises(ValueError, match="no reduced draft vocabulary"):
        EagleConfig.from_target(target, 1, draft_vocab_size=10)
    with pytest.raises(ValueError, match="version"):
        EagleConfig.from_target(target, 2)
    cfg = EagleConfig.from_target(target, 3, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB)
    with pytest.raises(ValueError, match="build_draft_vocab"):
        EagleHead(cfg, target)
    assert cfg.feature_layers == (1, 2, 3, 4)
    assert EagleConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="vocab"):
        EagleHead(cfg, make_target(vocab=64), d2t=maps[0], t2d=maps[1])


def test_head_weights_use_serving_names_and_leave_target_out(target, maps):
    h1, h3 = make_head(target, 1, maps), make_head(target, 3, maps)
    names1 = set(h1.state_dict())
    assert "fc.weight" in names1 and "layers.0.self_attn.q_proj.weight" in names1
    assert not any("input_layernorm" in n or "embed" in n or "lm_head" in n for n in names1)
    names3 = set(h3.state_dict())
    assert {
        "fc.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    } <= names3
    assert not any("embed" in n for n in names3)
    assert h3.fc.weight.shape == (64, 3 * 64)
    assert h3.midlayer.self_attn.q_proj.weight.shape[1] == 2 * 64
    kept = torch.arange(DRAFT_VOCAB) + maps[0]
    assert torch.equal(
        h3.lm_head.weight, target.lm_head.weight[kept]
    )  # initialised from the target
    assert torch.equal(h3.draft_to_target(torch.arange(DRAFT_VOCAB)), kept)
    target_params = {id(p) for p in target.model.parameters()}
    assert not any(id(p) in target_params for p in h3.parameters())
    assert all(p.requires_grad for p in h3.parameters())
    twin = copy.deepcopy(h3)  # e.g. an EMA copy: its own weights, the same frozen target parts
    assert twin.frozen.embed is target.embed and twin.fc.weight is not h3.fc.weight


@pytest.mark.parametrize("version", [1, 3])
def test_losses_decrease_and_target_stays_frozen(target, batch, maps, version):
    head = make_head(target, version, maps, seed=3)
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    start = {k: v.clone() for k, v in head.state_dict().items()}
    b = online_batch(target, head, batch[1])
    losses = fit(head, b, 30)
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(torch.equal(v, target.model.state_dict()[k]) for k, v in before.items())
    assert not torch.equal(start["fc.weight"], head.state_dict()["fc.weight"])
    _, metrics = eagle_loss(head, b)
    expected = {"loss", "tokens", "acc_0"} | (
        {"feature_loss", "ce_loss"} if version == 1 else {f"acc_{i}" for i in range(7)}
    )
    assert expected <= set(metrics)
    assert all(m.dim() == 0 and not m.requires_grad for m in metrics.values())


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_loss_module_trains_under_ddp(tmp_path, target, batch, maps, version):
    """EagleLoss is one DDP forward per step; gradients equal the plain loss's."""
    import torch.distributed as dist

    head = make_head(target, version, maps)
    b = online_batch(target, head, batch[1])
    loss, _ = eagle_loss(head, b, steps=2, feature_noise=0.0)
    loss.backward()
    plain = {n: p.grad.clone() for n, p in head.named_parameters()}
    head.zero_grad()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(EagleLoss(head, steps=2, feature_noise=0.0))
        ddp_loss, metrics = ddp(b)
        ddp_loss.backward()
        del ddp
        gc.collect()
    finally:
        close_process_group()  # gloo's destructor can hang: see draftsmith.train.accelerator
    torch.testing.assert_close(ddp_loss, loss)
    for name, p in head.named_parameters():
        torch.testing.assert_close(p.grad, plain[name], rtol=1e-12, atol=1e-14)
    assert "acc_1" in metrics or version == 1


# ------------------------------------------------------------------------------------------------
# the proposer


MODES = {
    "chain": dict(depth=4, topk=1, tree_nodes=4),
    "tree": dict(depth=4, topk=3, tree_nodes=12),
}


@pytest.mark.parametrize("kind", ["random", "trained"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("version", [1, 3])
def test_greedy_output_equals_plain_greedy(engine, heads, greedy, version, mode, kind):
    proposer = EagleProposer(heads[version][kind], **MODES[mode])
    taus = []
    for prompt, reference in zip(PROMPTS, greedy):
        g = engine.generate(prompt, NEW_TOKENS, SamplingParams(), proposer)
        assert g.tokens == reference
        taus.append(g.tau)
    if kind == "trained":  # the head drafts what it was trained on: most drafts are accepted
        assert min(taus) > 1.5, taus


class Recording(EagleProposer):
    """Keeps every proposal and the head's cache after every observe."""

    def start(self, prompt_ids, hidden, params, generator):
        self.proposals, self.snapshots = [], []
        super().start(prompt_ids, hidden, params, generator)

    def propose(self, seq, max_depth):
        tree = super().propose(seq, max_depth)
        self.proposals.append((list(seq), tree))
        return tree

    def observe(self, seq, tree, path, hidden):
        super().observe(seq, tree, path, hidden)
        layer = self.cache.layers[0]
        self.snapshots.append((list(seq), len(path), layer.keys.clone(), layer.values.clone()))


def fresh(target, head, seq):
    """The head's cache recomputed from scratch over the real entries of ``seq`` (not the root)."""
    feats = target_features(target, torch.tensor([seq[:-1]]), None, head.config)["features"]
    cache = head.new_cache()
    out, logits = head(
        torch.tensor([seq[1:]]), head.fuse(feats), torch.arange(len(seq) - 1)[None], None, cache
    )
    return cache, out[:, -1:], logits[0, -1]


@pytest.mark.parametrize("version", [1, 3])
@torch.no_grad()
def test_head_cache_after_each_round_equals_fresh_recomputation(engine, target, heads, version):
    head = heads[version]["trained"]
    proposer = Recording(head, **MODES["tree"])
    engine.generate(PROMPTS[0], NEW_TOKENS, SamplingParams(), proposer)
    assert max(n for _, n, _, _ in proposer.snapshots) >= 2  # multi-token accepted paths happened
    for seq, _, keys, values in proposer.snapshots:
        assert keys.shape[2] == len(seq) - 1  # one entry per token the target has seen, no more
        cache, _, _ = fresh(target, head, seq)
        torch.testing.assert_close(keys, cache.layers[0].keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(values, cache.layers[0].values, rtol=0, atol=1e-10)


@pytest.mark.parametrize("version", [1, 3])
@torch.no_grad()
def test_tree_scores_match_sequential_recomputation(engine, target, heads, version):
    """Every node's cumulative log-prob equals decoding its branch one entry at a time."""
    head = heads[version]["trained"]
    proposer = Recording(head, depth=4, topk=3, tree_nodes=16)
    engine.generate(PROMPTS[2], 16, SamplingParams(), proposer)
    draft_id = torch.cumsum(head.t2d.long(), 0) - 1 if version == 3 else torch.arange(VOCAB)
    checked = 0
    for seq, tree in proposer.proposals[:5]:
        scores = tree.extra["scores"]
        assert all(scores[i] >= scores[i + 1] for i in range(len(scores) - 1))  # best first
        cache, root_hidden, root_logits = fresh(target, head, seq)
        base = len(seq) - 1
        for node in range(1, len(tree) + 1):
            hidden, logits, total = root_hidden, root_logits, 0.0
            for depth, step in enumerate(tree.path_to(node), start=1):
                tok = tree.tokens[step - 1]
                total += float(torch.log_softmax(logits.double(), -1)[draft_id[tok]])
                if step != node:
                    hidden, out = head(
                        torch.tensor([[tok]]),
                        hidden,
                        torch.tensor([[base - 1 + depth]]),
                        None,
                        cache,
                    )
                    logits = out[0, -1]
            crop(cache, base)
            assert total == pytest.approx(scores[node - 1], abs=1e-9)
            checked += 1
    assert checked > 20
    assert any(not tree.is_chain for _, tree in proposer.proposals)


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("shape", [dict(depth=5, topk=3, tree_nodes=6),
                                   dict(depth=4, topk=4, tree_nodes=10)])
@torch.no_grad()
def test_pruned_expansion_chooses_the_same_trees_from_fewer_rows(engine, heads, greedy, version,
                                                                 shape):
    """Frontier nodes that cannot place a child in the tree are not expanded: every round's tree
    (tokens, parents, scores) is the one the full expansion builds, from fewer head rows."""
    head = heads[version]["trained"]
    pruned, full = (Recording(head, **shape, prune=prune) for prune in (True, False))
    rounds = 0
    for prompt, reference in zip(PROMPTS, greedy):
        for proposer in (pruned, full):
            assert engine.generate(prompt, NEW_TOKENS, SamplingParams(), proposer).tokens == reference
        assert len(pruned.proposals) == len(full.proposals)
        for (seq_a, a), (seq_b, b) in zip(pruned.proposals, full.proposals):
            assert seq_a == seq_b and a.tokens == b.tokens and a.parents == b.parents
            assert a.extra["scores"] == pytest.approx(b.extra["scores"], abs=1e-12)
        rounds += len(full.proposals)
    assert rounds > 20
    # the pruning is a bound known before the round (static shapes, no read of the scores): it
    # saves rows where the node budget is tighter than the frontier at the deepest depths
    if shape["tree_nodes"] - shape["depth"] + 1 < shape["topk"]:
        assert pruned.expanded_rows < full.expanded_rows
    else:
        assert pruned.expanded_rows == full.expanded_rows


def test_sampling_uses_the_point_mass_rule(engine, heads):
    proposer = Recording(heads[3]["trained"], **MODES["tree"])
    params = SamplingParams(temperature=0.8, top_p=0.9)
    a = engine.generate(PROMPTS[1], 24, params, proposer, seed=3)
    trees = [tree for _, tree in proposer.proposals]
    b = engine.generate(PROMPTS[1], 24, params, proposer, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) == 24
    assert all(0 <= t < VOCAB for t in a.tokens)
    # children are chosen deterministically (top-k), so no draft distribution is recorded
    assert trees and all(not tree.draft_probs for tree in trees)


def test_proposer_limits_and_depth_budget(engine, heads):
    with pytest.raises(ValueError, match=">= 1"):
        EagleProposer(heads[1]["random"], depth=0)
    proposer = Recording(heads[1]["random"], depth=6, topk=4, tree_nodes=10)
    engine.generate(PROMPTS[0], 5, SamplingParams(), proposer)
    for seq, tree in proposer.proposals:
        assert len(tree) <= 10
        assert tree.max_depth <= min(6, 5 - (len(seq) - len(PROMPTS[0])))


# ------------------------------------------------------------------------------------------------
# artifact


def test_save_load_round_trip_and_refuse_other_target(tmp_path, target, heads):
    ids = torch.tensor([PROMPTS[2]])
    for version in (1, 3):
        head = heads[version]["trained"]
        path = save_eagle(head, tmp_path / f"eagle{version}", target)
        meta = json.loads((path / "config.json").read_text())
        assert meta["method"] == f"eagle{version}" and meta["target"] == target.identity()
        loaded = load_eagle(path, target)
        feats = head.fuse(target_features(target, ids, None, head.config)["features"])
        positions = torch.arange(ids.shape[1])[None]
        assert torch.equal(loaded(ids, feats, positions)[1], head(ids, feats, positions)[1])
        with pytest.raises(ValueError, match="trained for target"):
            load_eagle(path, make_target(hidden=32))
    with pytest.raises(FileNotFoundError):
        load_eagle(tmp_path / "missing", target)


def test_from_artifact_takes_typed_options(tmp_path, target, heads):
    path = save_eagle(heads[3]["trained"], tmp_path / "a", target)
    proposer = EagleProposer.from_artifact(path, target, tree_nodes=9, topk=2)
    assert (proposer.tree_nodes, proposer.depth, proposer.topk) == (9, 5, 2)
    assert proposer.hidden_layers == AUX and proposer.name == f"eagle:{path}"
    with pytest.raises(FileNotFoundError):
        EagleProposer.from_artifact(tmp_path / "nope", target)
    with pytest.raises(ValueError, match="tree_nodes must be an integer"):
        EagleProposer.from_artifact(path, target, tree_nodes=0)


# ------------------------------------------------------------------------------------------------
# the real target


@pytest.mark.slow
def test_smollm2_random_eagle3_greedy_equality():
    from draftsmith.targets.target import load_target

    target = load_target("smollm2-135m", device="cpu", dtype="float32")
    question = Path(__file__).resolve().parents[1] / "data" / "eval" / "mt_bench_question.jsonl"
    prompt = json.loads(question.read_text().splitlines()[0])["turns"][0]
    ids = target.chat_ids(prompt)
    counts = count_tokens([ids], target.vocab_size)
    counts[:4096] += 1  # a 4096-token draft vocabulary around the prompt's tokens
    d2t, t2d = build_draft_vocab(counts, 4096)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target, 3, draft_vocab_size=4096), target, d2t, t2d)
    assert head.config.aux_layer_ids == (2, 15, 27)
    engine = SpeculativeEngine(target)
    reference = engine.generate(ids, 32, SamplingParams()).tokens
    for mode in MODES.values():
        assert (
            engine.generate(ids, 32, SamplingParams(), EagleProposer(head, **mode)).tokens
            == reference
        )


@pytest.mark.parametrize("version", [1, 3])
def test_head_in_bf16_keeps_greedy_exact(tmp_path, engine, target, heads, greedy, version):
    """--draft-dtype bf16: the head drafts in bf16 beside the float target; output is unchanged."""
    path = save_eagle(heads[version]["trained"], tmp_path / f"eagle{version}", target)

    proposer = EagleProposer.from_artifact(path, target, tree_nodes=12, depth=4, topk=3,
                                           dtype=torch.bfloat16)
    assert proposer.head.dtype == torch.bfloat16
    for prompt, reference in zip(PROMPTS, greedy):
        assert engine.generate(prompt, NEW_TOKENS, SamplingParams(), proposer).tokens == reference


def test_target_features_keep_only_the_layers_the_head_reads():
    """The hooks capture exactly transformers' output_hidden_states at the aux indices and L."""
    target = wrap_target(tiny_llama(layers=5, seed=1), name="five")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    states = target.decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                            use_cache=False).hidden_states
    for version, aux in ((3, [1, 2, 4]), (3, [2, 3, 4]), (1, None)):
        config = EagleConfig.from_target(target, version, aux_layer_ids=aux)
        got = target_features(target, ids, mask, config)
        want = states[5] if version == 1 else torch.cat([states[i] for i in aux], dim=-1)
        assert torch.equal(got["features"], want) and torch.equal(got["last_hidden"], states[5])
    assert not any(layer._forward_pre_hooks for layer in target.layers)  # hooks removed


def test_a_head_is_refused_on_a_same_shape_target_with_other_weights(tmp_path):
    """Issue: only shapes were compared, so a head was accepted (alpha 0) on another target."""
    from draftsmith.eval.bench import build_methods

    trained_for = wrap_target(tiny_llama(layers=5, seed=1), name="a")
    other = wrap_target(tiny_llama(layers=5, seed=2), name="a")  # same name, same shapes
    config = EagleConfig.from_target(trained_for, 3, aux_layer_ids=[1, 2, 3])
    path = save_eagle(EagleHead(config, trained_for), tmp_path / "head", trained_for)
    with pytest.raises(ValueError, match=r"same shapes and other weights.*--allow-other-weights"):
        EagleProposer.from_artifact(path, other)
    with pytest.raises(ValueError, match="same shapes and other weights"):
        build_methods([f"eagle:{path}"], other)
    assert EagleProposer.from_artifact(path, other, allow_other_weights=True)
    assert build_methods([f"eagle:{path}"], other, allow_other_weights=True)
    assert EagleProposer.from_artifact(path, trained_for)  # its own target, of course


def test_eagle_loss_module_takes_exactly_the_losss_options():
    import inspect

    keywords = {n for n, p in inspect.signature(eagle_loss).parameters.items()
                if p.kind is p.KEYWORD_ONLY}
    # reduction and generator come per call; padding is the batch's (every collate right-pads)
    assert set(EagleLoss.OPTIONS) == keywords - {"reduction", "generator", "padding"}
    with pytest.raises(TypeError, match="got stepz"):
        EagleLoss(None, stepz=3)


def test_a_head_started_as_a_target_layer_computes_that_layer_exactly(target, maps):
    """init_layer: before training, the EAGLE-3 head at step 0 is the target's layer applied to
    the fused feature it starts from, so its output is the next layer's input, to rounding."""
    from draftsmith.train.features import target_layer_weights

    head = make_head(target, 3, maps).to(torch.float64)
    layer = AUX[1]
    head.start_as_target_layer(target_layer_weights(target, layer, EagleHead.LAYER_WEIGHTS), layer)
    ids = torch.tensor([PROMPTS[2]])
    captured, _ = target.hidden_states(ids, [*AUX, layer + 1])
    fused = head.fuse(torch.cat([captured[i] for i in AUX], dim=-1))
    assert torch.equal(fused, captured[layer].to(fused.dtype))  # fc passes that feature through
    positions = torch.arange(ids.shape[1])[None]
    out, _ = head(ids, fused, positions)
    torch.testing.assert_close(out, captured[layer + 1], rtol=0, atol=1e-10)
    # a random start computes something else
    fresh = make_head(target, 3, maps).to(torch.float64)
    assert (fresh(ids, fused, positions)[0] - captured[layer + 1]).abs().max() > 1e-2

    with pytest.raises(ValueError, match="not one of the fused features"):
        head.start_as_target_layer(target_layer_weights(target, 0, EagleHead.LAYER_WEIGHTS), 0)
    qwen_like = {**target_layer_weights(target, layer, EagleHead.LAYER_WEIGHTS),
                 "self_attn.q_norm.weight": torch.ones(16)}
    with pytest.raises(ValueError, match=r"beyond one: \['self_attn.q_norm.weight'\]"):
        head.start_as_target_layer(qwen_like, layer)
    with pytest.raises(ValueError, match="for EAGLE-3 heads"):
        make_head(target, 1, maps).start_as_target_layer({}, layer)
