"""train/medusa.py: the chunked loss against draftsmith.heads.medusa's reference, Medusa-1 and Medusa-2 runs,
exact resume, the artifact (tree, adapted target) in the evaluator, and refusals.

The target is a random 2-layer Llama of hidden size 32 with SmolLM2's real tokenizer (vocabulary
49152, chat template), saved as a Hugging Face directory, so the data pipeline, the 49k-token
projections, checkpoints, evaluation and export run as on the real target, in seconds.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import test_sharding as sharding
import torch
import torch.nn.functional as F
from conftest import StopAfter, records
from medusa_reference import medusa_loss, rank_hits
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import draftsmith.train.loop as loop_module
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.medusa import MedusaProposer
from draftsmith.eval.sampling import SamplingParams
from draftsmith.heads.chunked_loss import next_token_mask, projected_cross_entropy
from draftsmith.heads.distill import add_lora
from draftsmith.heads.distill_loss import forward_kl
from draftsmith.heads.draft_vocab import build_draft_vocab, check_same_vocabulary
from draftsmith.heads.medusa import MedusaHeads, load_medusa
from draftsmith.heads.medusa_loss import MedusaObjective, head_rows, target_hidden
from draftsmith.layouts.export import export
from draftsmith.layouts.medusa import export_medusa
from draftsmith.targets.resolve import resolve_target
from draftsmith.targets.target import load_target, wrap_target
from draftsmith.train.config import config_from_dict, config_to_dict, parse_config
from draftsmith.train.medusa import MedusaTrainConfig, build_objective, loss_options, main
from draftsmith.train.signals import GracefulStop

pytestmark = pytest.mark.usefixtures("trainer_env")


REPO = Path(__file__).resolve().parents[1]
PEFT_WARNING = "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"


def save_tiny_llama(path: Path, tokenizer, seed: int = 0) -> Path:
    """A 2-layer, hidden-32 random Llama over the tokenizer's 49152 tokens, saved with it."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.1,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny target directory, 24 counting conversations, two evaluation prompts."""
    root = tmp_path_factory.mktemp("medusa")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_target("smollm2-135m")))
    target = save_tiny_llama(root / "target", tokenizer)
    rng = random.Random(0)
    rows = []
    for _ in range(24):
        start = rng.randrange(50)
        stop = start + rng.randint(3, 8)
        rows.append({"messages": [
            {"role": "user", "content": f"Count from {start} to {stop}."},
            {"role": "assistant", "content": ", ".join(str(i) for i in range(start, stop + 1))}]})
    data = root / "count.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    eval_prompts = root / "eval.jsonl"
    eval_prompts.write_text("".join(json.dumps({"turns": [f"Count from {a} to {a + 4}."]}) + "\n"
                                    for a in (7, 30)))
    return {"root": root, "target": str(target), "data": [str(data)],
            "eval": str(eval_prompts)}


def base_config(files, out: Path, **overrides) -> MedusaTrainConfig:
    """configs/medusa/tiny.yaml, pointed at the tiny target and its data."""
    shipped = parse_config(MedusaTrainConfig, ["--config", str(REPO / "configs/medusa/tiny.yaml")])
    values = config_to_dict(shipped)
    values.update(
        target=files["target"], data=files["data"], output_dir=str(out),
        eval_prompts=files["eval"], max_length=64, per_device_batch_size=4, max_steps=4,
        warmup_steps=1, learning_rate=1e-2, save_every=2, keep_checkpoints=None, log_every=1,
        eval_every=2, eval_max_new_tokens=8, heldout_fraction=0.2, heldout_max_rows=4,
        heldout_every=2, share_lm_head=False, tree_nodes="auto", seed=3)
    values.update(overrides)
    return config_from_dict(MedusaTrainConfig, values)


def weights_on_disk(directory) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / "model.safetensors"))


def greedy(target, proposer, prompt: list[int], n: int = 24) -> list[int]:
    return SpeculativeEngine(target).generate(prompt, n, SamplingParams(temperature=0.0),
                                              proposer, seed=0).tokens


# ------------------------------------------------------------------------------------------------
# Config


def test_shipped_configs_parse_and_bad_keys_are_refused():
    for name in ("smollm2-135m", "tiny"):
        cfg = parse_config(MedusaTrainConfig, ["--config", str(REPO / "configs/medusa" /
                                                               f"{name}.yaml")])
        assert cfg.num_heads >= 1 and not cfg.medusa2
    with pytest.raises(ValueError, match="'num_heads' .* must be >= 1, got 0"):
        parse_config(MedusaTrainConfig, ["--num_heads", "0"])
    with pytest.raises(ValueError, match="did you mean 'num_heads'"):
        parse_config(MedusaTrainConfig, ["--num_head", "3"])
    with pytest.raises(ValueError, match="'loss_decay' must be in"):
        parse_config(MedusaTrainConfig, ["--loss_decay", "0"])
    with pytest.raises(ValueError, match="'kl_weight' applies to Medusa-2 only"):
        parse_config(MedusaTrainConfig, ["--kl_weight", "0.5"])
    with pytest.raises(ValueError, match="'tree_nodes' must be 'auto' or a node count"):
        parse_config(MedusaTrainConfig, ["--tree_nodes", "many"])
    with pytest.raises(ValueError, match="LM head and the embedding stay frozen"):
        parse_config(MedusaTrainConfig, ["--medusa2", "--lora_target_modules", "q_proj,lm_head"])
    with pytest.raises(ValueError, match="kl_weight 0 and lm_loss_weight 0"):
        parse_config(MedusaTrainConfig, ["--medusa2", "--kl_weight", "0"])
    assert parse_config(MedusaTrainConfig, []).draft_vocab_size is None
    assert parse_config(MedusaTrainConfig, ["--draft_vocab_size", "8192"]).draft_vocab_size == 8192
    with pytest.raises(ValueError, match="'draft_vocab_size' must be >= 1, got 0"):
        parse_config(MedusaTrainConfig, ["--draft_vocab_size", "0"])


# ------------------------------------------------------------------------------------------------
# The chunked loss against the reference


@pytest.fixture(scope="module")
def small():
    """A float64 2-layer Llama (vocab 40) and a batch with padding and a partial loss mask."""
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    target = wrap_target(LlamaForCausalLM(config).double(), name="small")
    ids = torch.randint(0, 40, (2, 11))
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0
    mask = torch.zeros_like(ids)
    mask[0, 3:] = 1
    mask[1, 5:9] = 1
    return target, ids, attention, mask


def perturbed_heads(target, num_heads: int, share: bool) -> MedusaHeads:
    heads = MedusaHeads.from_target(target, num_heads=num_heads, share_lm_head=share)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return heads


def loss_config(**values) -> MedusaTrainConfig:
    return config_from_dict(MedusaTrainConfig, {"num_heads": 3, "loss_chunk_size": 3, **values})


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("share", [False, True])
def test_chunked_loss_equals_medusa_loss_in_value_gradient_and_hits(small, soft, share):
    target, ids, attention, mask = small
    heads = perturbed_heads(target, 3, share)
    reference = copy.deepcopy(heads)
    if share:
        reference.bind_lm_head(target.lm_head)
    objective = MedusaObjective(heads, target,
                                **loss_options(loss_config(soft_labels=soft, share_lm_head=share)))
    logits, (hidden,) = target.features(ids, [target.num_layers], attention)
    assert torch.equal(target_hidden(target, ids, attention), hidden)

    loss, stats = objective(ids, attention, mask, hidden)
    loss.backward()
    head_logits = reference(hidden)  # (K, B, T, V)
    expected = medusa_loss(head_logits, ids, mask, target_logits=logits if soft else None)
    expected.total.backward()
    # medusa_loss works in float32 whatever the input; this loss keeps float64 in float64
    close = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(loss, expected.total.to(loss.dtype), **close)
    torch.testing.assert_close(stats.head_loss, expected.per_head.to(stats.head_loss.dtype),
                               **close)
    for (name, p), q in zip(heads.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name, **close)
    hits, totals = rank_hits(head_logits, ids, mask, topk=5)
    assert torch.equal(stats.hits, hits) and torch.equal(stats.counts, totals)
    assert not any(p.requires_grad for p in target.model.parameters())


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("share", [False, True])
def test_draft_vocab_loss_scores_the_draft_tokens_only(small, soft, share):
    """Hard labels outside the draft vocabulary are not scored (and never hits); soft labels are
    the target's distribution over the draft tokens, renormalised, skipping positions whose
    target argmax has no draft id. Checked against the whole-logits computation."""
    target, ids, attention, mask = small
    d2t, t2d = build_draft_vocab(torch.arange(40) % 7, 16)
    kept = torch.nonzero(t2d).flatten()
    heads = MedusaHeads.from_target(target, num_heads=3, share_lm_head=share, d2t=d2t, t2d=t2d)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    reference = copy.deepcopy(heads)
    objective = MedusaObjective(heads, target, **loss_options(
        loss_config(soft_labels=soft, share_lm_head=share, draft_vocab_size=16)))
    logits, (hidden,) = target.features(ids, [target.num_layers], attention)
    loss, stats = objective(ids, attention, mask, hidden, topk=3)
    loss.backward()

    head_logits = reference(hidden)  # (K, B, T, 16) over draft ids
    total, skipped = 0.0, 0
    for k in range(1, 4):
        b, t = head_rows(mask, k)
        logp = head_logits[k - 1, b, t].log_softmax(-1)  # (n, 16)
        labels = ids[b, t + 1 + k]
        if soft:
            teacher = logits[b, t + k]  # (n, 40): the target's distribution of token t+1+k
            scored = t2d[teacher.argmax(-1)]
            ce = -(teacher[:, kept].softmax(-1) * logp).sum(-1)
        else:
            scored = t2d[labels]
            ce = -logp.gather(-1, reference.target_to_draft(labels).clamp_min(0)[:, None])[:, 0]
        mean = ce[scored].sum() / scored.sum()
        total = total + 0.8 ** k * mean
        skipped += int((~scored).sum())
        torch.testing.assert_close(stats.head_loss[k - 1], mean.detach())
        assert int(stats.scored[k - 1]) == int(scored.sum()) and stats.counts[k - 1] == len(b)
        guesses = reference.draft_to_target(logp.topk(3, -1).indices)  # target ids
        hits = (guesses == labels[:, None]) & (scored[:, None] if soft else t2d[labels][:, None])
        assert torch.equal(stats.hits[k - 1], hits.sum(0))
    assert skipped > 0, "every position was in the draft vocabulary: a weak test"
    total.backward()
    torch.testing.assert_close(loss, total)
    for (name, p), q in zip(heads.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_head_rows_score_token_t_plus_1_plus_k():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    b, t = head_rows(mask, 2)  # head 2 at t guesses t + 3
    assert list(zip(b.tolist(), t.tolist())) == [(0, 0), (0, 1)]
    assert head_rows(mask, 6)[0].numel() == 0  # no position that far ahead


def test_projected_loss_mixes_hard_and_soft_targets_and_refuses_a_half_teacher():
    gen = torch.Generator().manual_seed(1)
    states = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher_states = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    head = torch.nn.Linear(5, 11, bias=True).double()
    labels = torch.randint(0, 11, (7,), generator=gen)
    out = projected_cross_entropy(states, weight, labels, teacher_states=teacher_states,
                                  teacher_head=head, hard_weight=0.3, soft_weight=0.7,
                                  chunk_size=2, topk=3)
    out.loss.backward()
    logp = (states @ weight.T).log_softmax(-1)
    with torch.no_grad():
        teacher_logits = head(teacher_states)
    teacher = teacher_logits.softmax(-1)
    reference = 0.3 * F.nll_loss(logp, labels, reduction="sum") - 0.7 * (teacher * logp).sum()
    got_states, got_weight = states.grad.clone(), weight.grad.clone()
    states.grad = weight.grad = None
    reference.backward()
    torch.testing.assert_close(out.loss, reference)
    torch.testing.assert_close(got_states, states.grad)
    torch.testing.assert_close(got_weight, weight.grad)
    kl = forward_kl(states @ weight.T, teacher_logits, torch.ones(7), reduction="sum")
    torch.testing.assert_close(out.soft_ce - out.teacher_entropy, kl.detach())
    with pytest.raises(ValueError, match="together"):
        projected_cross_entropy(states, weight, labels, teacher_states=teacher_states)


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_medusa2_loss_adds_the_kl_and_ce_of_the_adapted_model_with_exact_gradients(small):
    target, ids, attention, mask = small
    cfg = loss_config(medusa2=True, soft_labels=True, kl_weight=0.7, lm_loss_weight=0.4,
                      heads_loss_weight=0.5, lora_r=2, lora_target_modules=["q_proj", "down_proj"])
    heads = perturbed_heads(target, 3, share=False)
    adapted = add_lora(copy.deepcopy(target.model), r=2, alpha=4.0,
                       target_modules=["q_proj", "down_proj"])
    with torch.no_grad():  # non-zero B: the adapted model differs from the original
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    objective = MedusaObjective(heads, target, adapted, **loss_options(cfg))
    reference = copy.deepcopy(objective)
    teacher_logits, (teacher,) = target.features(ids, [target.num_layers], attention)
    loss, stats = objective(ids, attention, mask, teacher)
    loss.backward()

    out = reference.adapted_model()(input_ids=ids, attention_mask=attention,
                                    output_hidden_states=True)
    hidden, logits = out.hidden_states[-1], out.logits
    keep = next_token_mask(mask)
    kl = forward_kl(logits, teacher_logits, keep, chunk_size=None)
    ce = F.cross_entropy(logits[keep.bool()], ids.roll(-1, 1)[keep.bool()])
    heads_part = medusa_loss(reference.heads(hidden), ids, mask, target_logits=teacher_logits)
    expected = 0.5 * heads_part.total + 0.7 * kl + 0.4 * ce
    expected.backward()
    close = {"rtol": 1e-5, "atol": 1e-6}  # medusa_loss works in float32
    torch.testing.assert_close(loss, expected, **close)
    n = stats.lm["count"]
    torch.testing.assert_close(stats.lm["kl"] / n, kl.detach().double())
    torch.testing.assert_close(stats.lm["ce"] / n, ce.detach().double())
    trained = [(n, p) for n, p in objective.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n, _ in trained) and any("blocks" in n for n, _ in trained)
    others = dict(reference.named_parameters())
    for name, p in trained:
        torch.testing.assert_close(p.grad, others[name].grad, msg=name, **close)
    # checkpoints hold the adapters and heads, not the frozen copy of the target
    saved = objective.state_dict()
    assert saved and all("lora_" in k or k.startswith("heads.") for k in saved)
    fresh = MedusaObjective(perturbed_heads(target, 3, False), target,
                            add_lora(copy.deepcopy(target.model), r=2, alpha=4.0,
                                     target_modules=["q_proj", "down_proj"]),
                            **loss_options(cfg))
    fresh.load_state_dict(saved)  # strict: the frozen keys may be absent
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, saved[name])


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_medusa2_gradient_checkpointing_gives_the_same_gradients(small):
    target, ids, attention, mask = small
    grads = []
    for checkpointing in (False, True):
        cfg = loss_config(medusa2=True, lora_r=2, lora_target_modules=["q_proj", "down_proj"],
                          gradient_checkpointing=checkpointing)
        torch.manual_seed(3)
        objective = build_objective(cfg, target)
        with torch.no_grad():  # non-zero B: gradients reach the adapters' A matrices too
            for name, p in objective.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        assert objective.adapted_model().is_activation_checkpointing == checkpointing
        teacher = target_hidden(target, ids, attention)
        loss, _ = objective(ids, attention, mask, teacher, reduction="sum")
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in objective.named_parameters()
                      if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and any("lora_A" in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


# ------------------------------------------------------------------------------------------------
# Medusa-1


@pytest.fixture(scope="module")
def medusa1(files, tmp_path_factory):
    """4 steps of Medusa-1 with a trainable LM-head copy per head, uninterrupted."""
    out = tmp_path_factory.mktemp("m1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        patch.setenv("WANDB_MODE", "disabled")
        result = main(base_config(files, out))
    return out, result


def test_medusa1_trains_the_heads_only_and_logs_per_head_accuracies(files, medusa1):
    out, result = medusa1
    target = result["target"]
    on_disk = weights_on_disk(files["target"])
    for name, tensor in target.model.state_dict().items():
        if name in on_disk:
            assert torch.equal(tensor, on_disk[name]), f"training changed the target's {name}"
    assert not any(p.requires_grad for p in target.model.parameters())
    assert not target.model.training

    artifact = weights_on_disk(result["artifact"])
    fresh = MedusaHeads.from_target(target, num_heads=2).state_dict()
    assert set(artifact) == set(fresh)
    assert all(not torch.equal(artifact[k], fresh[k]) for k in artifact), "every head moved"
    for step in (2, 4):  # checkpoints hold the heads, nothing of the target
        assert set(weights_on_disk(out / "checkpoints" / f"step_{step}")) == \
            {f"heads.{k}" for k in fresh}

    logged = records(out)
    train = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        for k in (1, 2):
            assert 0 <= r[f"medusa/head{k}_top1"] <= r[f"medusa/head{k}_top5"] <= 1
            assert r[f"medusa/head{k}_loss"] > 0
        assert r["tokens_per_s"] > 0 and r["peak_memory_gb"] > 0
    assert train[-1]["loss"] < train[0]["loss"]
    heldout = [r for r in logged if "heldout/head1_top1" in r]
    assert [r["step"] for r in heldout] == [0, 2, 4]
    assert all(r["heldout/expected_tau"] >= 1 and r["heldout/positions"] > 0 for r in heldout)
    assert [r["step"] for r in logged if "eval/tau" in r] == [0, 2]
    (final,) = [r for r in logged if "final/tau" in r]
    assert final["step"] == 4 and final["final/tau"] >= 1
    assert final["final/expected_tau"] == pytest.approx(result["tree_info"]["expected_tau"])


def test_medusa1_artifact_loads_in_the_evaluator_and_decodes_greedily_exactly(files, medusa1):
    _, result = medusa1
    target = load_target(files["target"])
    info = result["tree_info"]
    assert info["tree_nodes"] == len(result["tree"]) and "verify_seconds" in info
    assert len(info["rank_accuracies"]) == 2 and len(info["rank_accuracies"][0]) == 10
    proposer = MedusaProposer.from_artifact(result["artifact"], target)
    assert proposer.tree.paths == result["tree"]
    # a wider tree rebuilt from the stored accuracies, as draftsmith.eval.bench --tree-nodes does
    wide = MedusaProposer.from_artifact(result["artifact"], target, tree_nodes=12)
    assert len(wide.tree) == 12 and wide.tree.max_depth == 2
    prompt = target.chat_ids("Count from 3 to 9.")
    plain = greedy(target, None, prompt)
    assert greedy(target, proposer, prompt) == plain
    assert greedy(target, wide, prompt) == plain
    config = json.loads((Path(result["artifact"]) / "config.json").read_text())
    assert config["medusa2"] is False and "adapted_target" not in config


def test_an_artifact_for_another_target_is_refused(medusa1):
    _, result = medusa1
    other = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    other_target = wrap_target(LlamaForCausalLM(other), name="other")
    with pytest.raises(ValueError, match="trained for target 'target', not for 'other'"):
        MedusaProposer.from_artifact(result["artifact"], other_target)


def test_resume_continues_exactly(files, medusa1, tmp_path, monkeypatch):
    whole, result = medusa1
    monkeypatch.setattr(loop_module, "GracefulStop", StopAfter)
    first = main(base_config(files, tmp_path))
    assert first["step"] == 2 and first["stopped"] and first["artifact"] is None
    monkeypatch.setattr(loop_module, "GracefulStop", GracefulStop)
    rest = main(base_config(files, tmp_path, resume="latest"))
    assert rest["step"] == 4

    keys = ("loss", "lr", "medusa/head1_loss", "medusa/head2_loss", "medusa/head1_top5")
    expected = [r for r in records(whole) if "loss" in r]
    got = [r for r in records(tmp_path) if "loss" in r]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(expected, got, strict=True):
        assert [a[k] for k in keys] == [b[k] for k in keys], a["step"]
    assert len({r["loss"] for r in expected}) == 4
    a, b = weights_on_disk(result["artifact"]), weights_on_disk(rest["artifact"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------
# Medusa-1 over a draft vocabulary

DRAFT_KWARGS = dict(draft_vocab_size=8, share_lm_head=True)


@pytest.fixture(scope="module")
def draft_run(files, tmp_path_factory):
    """4 steps of Medusa-1 over an 8-token draft vocabulary (hard labels), uninterrupted."""
    out = tmp_path_factory.mktemp("draft")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        patch.setenv("WANDB_MODE", "disabled")
        result = main(base_config(files, out, **DRAFT_KWARGS))
    return out, result


def test_draft_vocab_run_trains_its_projection_logs_coverage_and_decodes_exactly(
        files, draft_run, tmp_path):
    out, result = draft_run
    logged = records(out)
    (first,) = [r for r in logged if "draft_vocab/coverage" in r]
    assert first["step"] == 0 and first["draft_vocab/size"] == 8
    assert 0.5 < first["draft_vocab/coverage"] < 1  # some assistant tokens are not drafted
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]
    config = json.loads((Path(result["artifact"]) / "config.json").read_text())
    assert config["draft_vocab_size"] == 8 and config["share_lm_head"] is True
    artifact = weights_on_disk(result["artifact"])
    assert artifact["lm_head.weight"].shape == (8, 32) and int(artifact["t2d"].sum()) == 8
    target = result["target"]
    kept = torch.nonzero(artifact["t2d"]).flatten()
    start = target.model.get_output_embeddings().weight[kept]
    assert not torch.equal(artifact["lm_head.weight"], start.to(artifact["lm_head.weight"].dtype))
    checkpoint = weights_on_disk(out / "checkpoints" / "step_4")
    assert torch.equal(checkpoint["heads.d2t"], artifact["d2t"])  # the maps travel with it
    assert len(result["tree_info"]["rank_accuracies"][0]) == 8  # ranks among 8 draft tokens

    verifier = load_target(files["target"])
    proposer = MedusaProposer.from_artifact(result["artifact"], verifier)
    prompt = verifier.chat_ids("Count from 3 to 9.")
    assert greedy(verifier, proposer, prompt) == greedy(verifier, None, prompt)
    assert set(proposer.propose(prompt, 2).tokens) <= set(kept.tolist())

    served = export(result["artifact"], "vllm-0.32", tmp_path / "vllm")
    assert torch.equal(load_file(str(served / "model.safetensors"))["token_map"], kept)
    with pytest.raises(ValueError, match="draft_vocab_size 8 .*draft_vocab_size: null"):
        export(result["artifact"], "trtllm", tmp_path / "trtllm")


def test_draft_vocab_resume_continues_exactly(files, draft_run, tmp_path, monkeypatch):
    whole, result = draft_run
    monkeypatch.setattr(loop_module, "GracefulStop", StopAfter)
    first = main(base_config(files, tmp_path, **DRAFT_KWARGS))
    assert first["step"] == 2 and first["stopped"]
    monkeypatch.setattr(loop_module, "GracefulStop", GracefulStop)
    rest = main(base_config(files, tmp_path, resume="latest", **DRAFT_KWARGS))
    assert rest["step"] == 4
    keys = ("loss", "lr", "medusa/head1_loss", "medusa/head2_loss", "medusa/head1_top5")
    expected = [r for r in records(whole) if "loss" in r]
    got = [r for r in records(tmp_path) if "loss" in r]
    for a, b in zip(expected, got, strict=True):
        assert [a[k] for k in keys] == [b[k] for k in keys], a["step"]
    a, b = weights_on_disk(result["artifact"]), weights_on_disk(rest["artifact"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_with_another_draft_vocabulary_is_refused():
    maps = build_draft_vocab(torch.arange(20) % 5, 6)
    check_same_vocabulary(maps, tuple(m.clone() for m in maps), "ckpt")
    other = build_draft_vocab(torch.arange(20) % 7, 6)
    with pytest.raises(ValueError, match="cannot resume from ckpt: its draft vocabulary .*differs"):
        check_same_vocabulary(maps, other, "ckpt")


def test_regenerated_data_comes_from_the_target(files, tmp_path):
    cfg = base_config(files, tmp_path, regenerate=True, regenerate_max_new_tokens=6,
                      regenerate_temperature=0.0, max_steps=1, eval_every=0, heldout_every=0,
                      tree_nodes="3", num_heads=1)
    result = main(cfg)
    lines = [json.loads(line) for line in (tmp_path / "regenerated.jsonl").read_text().splitlines()]
    assert len(lines) == 24 and {m["role"] for m in lines[0]["messages"]} == {"user", "assistant"}
    target = result["target"]
    # greedy answers: the target's own continuation (the longest prompt: no padding in its batch)
    first = max(lines, key=lambda r: len(target.chat_ids(r["messages"][:-1])))
    prompt = target.chat_ids(first["messages"][:-1])
    with torch.no_grad():
        out = target.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    expected = target.tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
    assert first["messages"][-1]["content"] == expected
    assert len(result["tree"]) == 3 and result["step"] == 1


def test_two_processes_regenerate_their_shares_and_train_the_one_process_steps(files, tmp_path):
    """torchrun, 2 CPU processes: each answers half of the prompts (no process waits while
    another generates), the main process joins the shards in input order, and the run trains
    the steps one process trains on the same answers."""
    common = dict(regenerate=True, regenerate_max_new_tokens=6, regenerate_temperature=0.0,
                  max_steps=2, eval_every=2, eval_num_prompts=2, heldout_every=0,
                  tree_nodes="3", num_heads=2, save_every=0)
    cfg = base_config(files, tmp_path / "two", per_device_batch_size=2, **common)
    argv = [f"--{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in config_to_dict(cfg).items() if v is not None]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "train/medusa.py"), *argv], cwd=REPO, capture_output=True, text=True,
        timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-3000:]
    two = tmp_path / "two"
    shards = sorted(p.name for p in two.glob("regenerated.shard-*-of-2.jsonl"))
    assert shards == ["regenerated.shard-0-of-2.jsonl", "regenerated.shard-1-of-2.jsonl"]
    merged = [json.loads(line) for line in (two / "regenerated.jsonl").read_text().splitlines()]
    assert [r["prompt_index"] for r in merged] == list(range(24))  # input order, every prompt
    alone = main(base_config(files, tmp_path / "alone", **common))  # one process regenerating
    answers = [json.loads(line)
               for line in (tmp_path / "alone" / "regenerated.jsonl").read_text().splitlines()]
    assert sorted(answers, key=lambda r: r["prompt_index"]) == merged  # greedy: the same answers
    assert alone["step"] == 2
    # one process with the same global batch, on the merged file, trains the same steps
    trained = {**common, "regenerate": False, "data": [str(two / "regenerated.jsonl")]}
    main(base_config(files, tmp_path / "one", per_device_batch_size=4, **trained))
    for a, b in zip(records(tmp_path / "one"), records(two), strict=True):
        if "loss" in a:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        if "eval/tau" in a:  # the acceptance measured on each process's share, summed
            assert b["eval/tau"] == pytest.approx(a["eval/tau"])


def test_sharded_target_and_fsdp2_heads_train_the_one_process_steps(files, tmp_path):
    """torchrun, 2 CPU processes launched as with configs/accelerate/fsdp2.yaml, the target's
    layers sharded over both (target_parallel 2) and the heads under FSDP2: the 1-process
    losses, held-out accuracies (every process scores its share in lockstep) and tree, and the
    same heads gathered into the artifact."""
    common = dict(max_steps=4, eval_every=0, heldout_every=2, tree_nodes="4", num_heads=2,
                  save_every=0, lr_schedule="constant")
    one = main(base_config(files, tmp_path / "one", **common))
    sharding.torchrun("train/medusa.py", base_config(files, tmp_path / "two", target_parallel=2,
                                                     per_device_batch_size=2, **common),
                      fsdp2=True)
    heldout = ("heldout/head1_top1", "heldout/head2_top5", "heldout/positions")
    for key in ("loss", "medusa/head1_top1", "medusa/head2_top1", *heldout):  # token-weighted
        expected = [(r["step"], r[key]) for r in records(tmp_path / "one") if key in r]
        got = [(r["step"], r[key]) for r in records(tmp_path / "two") if key in r]
        assert len(expected) >= 2
        sharding.assert_same_steps(expected, got)
    whole = weights_on_disk(tmp_path / "one" / "artifact")
    gathered = weights_on_disk(tmp_path / "two" / "artifact")
    assert gathered.keys() == whole.keys()
    for name, tensor in whole.items():
        torch.testing.assert_close(gathered[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    info = json.loads((tmp_path / "two" / "artifact" / "config.json").read_text())
    assert info["tree"] == [list(c) for c in one["tree"]]
    assert info["tree_info"]["heldout_positions"] == one["tree_info"]["heldout_positions"]


# ------------------------------------------------------------------------------------------------
# Medusa-2


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_medusa2_trains_adapters_exports_the_merged_target_and_resumes(files, tmp_path):
    kwargs = dict(medusa2=True, share_lm_head=True, soft_labels=True, lora_r=4, lora_alpha=8.0,
                  lora_target_modules=["q_proj", "v_proj"], kl_weight=1.0, lm_loss_weight=0.5,
                  heads_loss_weight=0.5, max_steps=2, save_every=1, eval_every=2,
                  heldout_every=0, tree_nodes="4", learning_rate=5e-2)
    out = tmp_path / "run"
    result = main(base_config(files, out, **kwargs))
    base = weights_on_disk(files["target"])
    original = result["target"]
    for name, tensor in original.model.state_dict().items():
        if name in base:
            assert torch.equal(tensor, base[name]), f"Medusa-2 changed the frozen {name}"

    logged = [r for r in records(out) if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2]
    assert all(r["lm_kl"] >= 0 and 0 <= r["lm_agreement"] <= 1 and r["lm_ce"] > 0
               for r in logged)
    assert logged[0]["lm_kl"] < 1e-6 and logged[-1]["lm_kl"] > 0  # B starts at zero, then moves

    # the adapters moved; the merged target is base + B @ A * alpha / r, nothing else changed
    checkpoint = weights_on_disk(out / "checkpoints" / "step_2")
    assert checkpoint and all("lora_" in k or k.startswith("heads.blocks.") for k in checkpoint)
    merged_dir = Path(result["artifact"]) / "target"
    merged = weights_on_disk(merged_dir)
    expected = dict(base)
    adapted_names = set()
    for key, b_matrix in checkpoint.items():
        if "lora_B" not in key:
            continue
        assert b_matrix.abs().max() > 0, f"{key} did not train"
        module = key.split("base_model.model.", 1)[1].split(".lora_B")[0]
        a_matrix = checkpoint[key.replace("lora_B", "lora_A")]
        expected[f"{module}.weight"] = base[f"{module}.weight"] + (b_matrix @ a_matrix) * 2.0
        adapted_names.add(f"{module}.weight")
    assert len(adapted_names) == 4  # q_proj and v_proj of both layers
    assert set(merged) == set(base)
    for name in merged:
        torch.testing.assert_close(merged[name], expected[name], msg=name, rtol=0, atol=1e-6)
        assert torch.equal(merged[name], base[name]) == (name not in adapted_names), name
    reference = AutoModelForCausalLM.from_pretrained(files["target"])
    reference.load_state_dict(expected, strict=False)
    exported = AutoModelForCausalLM.from_pretrained(str(merged_dir))
    ids = torch.tensor([original.chat_ids("Count from 1 to 5.")])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
        assert not torch.allclose(exported(ids).logits, original.model(ids).logits)
    assert [r["step"] for r in records(out) if "final/tau" in r] == [2]

    # the artifact is verified against the adapted target only
    with pytest.raises(ValueError, match="Medusa-2 training.*--target .*target"):
        MedusaProposer.from_artifact(result["artifact"], load_target(files["target"]))
    adapted = load_target(str(merged_dir))
    proposer = MedusaProposer.from_artifact(result["artifact"], adapted)
    assert len(proposer.tree) == 4
    prompt = adapted.chat_ids("Count from 3 to 9.")
    assert greedy(adapted, proposer, prompt) == greedy(adapted, None, prompt)
    assert load_medusa(result["artifact"], adapted).config["base_model"] == str(merged_dir.resolve())
    # serving layouts name the adapted target as their base model
    exported_dir = export_medusa(result["artifact"], "vllm-0.32", tmp_path / "vllm")
    meta = json.loads((exported_dir / "config.json").read_text())
    # a local adapted target has no hub id: the export names none rather than a local path
    assert "base_model_name_or_path" not in meta and meta["original_lm_head"]

    # resumed from step 1 in another directory: the same step 2 and the same export
    again = tmp_path / "again"
    resumed = main(base_config(files, again, resume=str(out / "checkpoints" / "step_1"), **kwargs))
    assert resumed["step"] == 2
    (step2,) = [r for r in records(again) if "loss" in r]
    for key in ("loss", "lm_kl", "lm_ce", "medusa/head1_loss"):
        assert step2[key] == logged[-1][key], key
    again_merged = weights_on_disk(Path(resumed["artifact"]) / "target")
    assert all(torch.equal(again_merged[k], merged[k]) for k in merged)
