"""train/distill.py: on-policy batches, training that moves the draft only, exact resume, LoRA,
export (draftsmith.eval.bench and transformers' assisted generation), vocabulary and config refusals.

The target is a tiny random Llama saved as a Hugging Face directory with a 48-token word-level
tokenizer and a ChatML-like chat template, so the whole pipeline (data, chat template, sampling,
checkpoints, evaluation, export) runs as it does on a real target, in seconds.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import test_sharding as sharding
import torch
from conftest import StopAfter, records
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

import draftsmith.train.loop as loop_module
from draftsmith.eval.bench import build_methods
from draftsmith.eval.sampling import SamplingParams
from draftsmith.heads.chunked_loss import next_token_mask
from draftsmith.heads.distill import load_draft, read_draft_info
from draftsmith.heads.distill_loss import divergence
from draftsmith.targets.target import load_target
from draftsmith.train.config import config_from_dict, parse_config
from draftsmith.train.distill import (
    DistillConfig,
    build_draft,
    distill_loss,
    draft_sampled_batch,
    is_on_policy,
    main,
)
from draftsmith.train.distill_rows import collate_distill, load_distill_rows
from draftsmith.train.signals import GracefulStop

pytestmark = pytest.mark.usefixtures("trainer_env")


REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant"] + [f"w{i}" for i in range(41)]  # 48 tokens in all
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
PEFT_WARNING = "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        pad_token="<pad>", bos_token="<|im_start|>",
                                        eos_token="<|im_end|>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def save_tiny_llama(path: Path, vocab: int, tokenizer, seed: int) -> Path:
    """A 2-layer random Llama (std 0.1: peaked, varied outputs) saved with its tokenizer."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.1,
                         tie_word_embeddings=True, bos_token_id=2, eos_token_id=3, pad_token_id=1)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = 3
    model.generation_config.pad_token_id = 1
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(41)}" for _ in range(n))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny target directory, training data (answered and prompt-only), eval prompts."""
    root = tmp_path_factory.mktemp("distill")
    tokenizer = word_tokenizer()
    target = save_tiny_llama(root / "target", len(tokenizer), tokenizer, seed=0)
    rng = random.Random(0)
    answered = root / "answered.jsonl"
    answered.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": words(rng, rng.randint(3, 8))},
        {"role": "assistant", "content": words(rng, rng.randint(4, 12))}]}) + "\n"
        for _ in range(16)))
    prompts = root / "prompts.json"  # ShareGPT first turns: no responses
    prompts.write_text(json.dumps([{"conversations": [
        {"from": "human", "value": words(rng, rng.randint(3, 8))}]} for _ in range(8)]))
    eval_prompts = root / "eval.jsonl"
    eval_prompts.write_text("".join(json.dumps({"turns": [words(rng, 5)]}) + "\n"
                                    for _ in range(2)))
    return {"root": root, "target": str(target), "data": [str(answered), str(prompts)],
            "eval": str(eval_prompts)}


def base_config(files, out: Path, **overrides) -> DistillConfig:
    values = dict(
        target=files["target"], data=files["data"], output_dir=str(out), draft="truncate:1",
        mixed_precision="no",
        divergence="jsd", max_length=48, per_device_batch_size=4, max_steps=4, warmup_steps=1,
        learning_rate=1e-2, lr_schedule="cosine", save_every=2, keep_checkpoints=None,
        log_every=1, eval_every=2, eval_prompts=files["eval"], eval_num_prompts=2,
        eval_max_new_tokens=6, heldout_fraction=0.1, heldout_max_rows=3, heldout_every=2,
        on_policy_ratio=0.5, on_policy_max_new_tokens=10, on_policy_temperature=1.0, seed=3)
    values.update(overrides)
    return config_from_dict(DistillConfig, values)


def decodes_like_the_target(target, draft_dir) -> bool:
    """Greedy decoding with the draft directory's chains equals the target's own, token for token."""
    prompt = target.chat_ids("w1 w2 w3")
    plain, speculative = build_methods(["plain", f"draft:{draft_dir}"], target,
                                       options={"draft": {"max_depth": 4, "min_confidence": 0.0}})
    greedy = SamplingParams(temperature=0.0)
    return speculative.run(prompt, 12, greedy, seed=0).tokens == \
        plain.run(prompt, 12, greedy, seed=0).tokens


def weights_on_disk(directory: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / "model.safetensors"))


# ------------------------------------------------------------------------------------------------
# Config


def test_config_keys_are_checked_and_the_shipped_configs_parse():
    for name in ("smollm2-135m", "tiny"):
        cfg = parse_config(DistillConfig, ["--config", str(REPO / "configs/distill" /
                                                           f"{name}.yaml")])
        assert cfg.draft.startswith("truncate:") and 0 <= cfg.on_policy_ratio < 1
    with pytest.raises(ValueError, match="did you mean 'divergence'"):
        parse_config(DistillConfig, ["--divergance", "tvd"])
    with pytest.raises(ValueError, match="choose one of"):
        parse_config(DistillConfig, ["--divergence", "kl"])
    with pytest.raises(ValueError, match="'on_policy_ratio' must be in"):
        parse_config(DistillConfig, ["--on_policy_ratio", "1.5"])
    with pytest.raises(ValueError, match="expected truncate:N"):
        parse_config(DistillConfig, ["--draft", "trunc:6"])
    with pytest.raises(ValueError, match="truncate:N needs a layer count"):
        parse_config(DistillConfig, ["--draft", "truncate:x"])
    with pytest.raises(ValueError, match="fresh:L drafts only"):
        parse_config(DistillConfig, ["--draft_hidden_size", "64"])
    with pytest.raises(ValueError, match="random weights"):
        parse_config(DistillConfig, ["--draft", "fresh:2", "--lora"])
    with pytest.raises(ValueError, match="both set"):
        parse_config(DistillConfig, ["--heldout_data", "a.jsonl"])


def test_on_policy_schedule_is_seeded_and_follows_the_ratio():
    draws = [is_on_policy(7, i, 0.3) for i in range(4000)]
    assert draws == [is_on_policy(7, i, 0.3) for i in range(4000)]  # a pure function
    assert draws != [is_on_policy(8, i, 0.3) for i in range(4000)]
    assert abs(sum(draws) / len(draws) - 0.3) < 0.03  # 4 sigma of a Bernoulli(0.3) mean
    assert not any(is_on_policy(7, i, 0.0) for i in range(100))
    assert all(is_on_policy(7, i, 1.0) for i in range(100))


# ------------------------------------------------------------------------------------------------
# The on-policy step


def test_on_policy_batch_trains_on_exactly_the_tokens_the_draft_sampled(files, tmp_path):
    cfg = base_config(files, tmp_path)
    target = load_target(cfg.target)
    rows, summary = load_distill_rows(cfg.data, target, cfg.max_length)
    assert "16 with a response" in summary and "8 prompt-only" in summary
    batch_rows = [r for r in rows if r["answered"]][:3] + [r for r in rows if not r["answered"]][:3]
    batch = collate_distill(batch_rows, target.tokenizer.pad_token_id)
    draft = build_draft(cfg, target)

    recorded = []
    original = draft.generate

    def recording_generate(*args, **kwargs):
        out = original(*args, **kwargs)
        recorded.append((kwargs["input_ids"].shape[1], out))
        return out

    draft.generate = recording_generate
    # more stop tokens than the target's one: some rows stop early, others run to the limit
    eos = (*target.eos_token_ids, 10, 11, 12, 13)
    for on_policy, expected_rows in ((True, [0, 1, 2, 3, 4, 5]), (False, [3, 4, 5])):
        recorded.clear()
        out, sampled_rows, sampled_tokens = draft_sampled_batch(
            batch, draft, on_policy, max_new_tokens=cfg.on_policy_max_new_tokens,
            temperature=1.0, eos_token_ids=eos, pad_token_id=1, max_length=cfg.max_length,
            seed=11)
        (width, generated), = recorded  # one batched generate call
        assert sampled_rows == len(expected_rows)
        total, lengths = 0, []
        for i, b in enumerate(expected_rows):
            new = generated[i, width:].tolist()
            end = next((k for k, t in enumerate(new) if t in eos), None)
            new = new if end is None else new[: end + 1]
            lengths.append(len(new))
            prompt = batch_rows[b]["prompt_ids"].tolist()
            n = len(prompt) + len(new)
            assert out["input_ids"][b, :n].tolist() == prompt + new
            assert out["loss_mask"][b].tolist() == [0] * len(prompt) + [1] * len(new) + \
                [0] * (out["loss_mask"].shape[1] - n)
            assert out["attention_mask"][b].sum() == n
            total += len(new)
        assert sampled_tokens == total
        assert min(lengths) < cfg.on_policy_max_new_tokens == max(lengths), lengths
        for b in set(range(6)) - set(expected_rows):  # answered rows keep their data
            n = len(batch_rows[b]["input_ids"])
            assert out["input_ids"][b, :n].tolist() == batch_rows[b]["input_ids"].tolist()
            assert out["loss_mask"][b, :n].tolist() == batch_rows[b]["loss_mask"].tolist()
        # the same seed gives the same samples; the global random state is untouched
        state = torch.get_rng_state()
        again, _, _ = draft_sampled_batch(
            batch, draft, on_policy, max_new_tokens=cfg.on_policy_max_new_tokens,
            temperature=1.0, eos_token_ids=eos, pad_token_id=1, max_length=cfg.max_length,
            seed=11)
        assert torch.equal(again["input_ids"], out["input_ids"])
        assert torch.equal(torch.get_rng_state(), state)

    # the divergence is taken at the positions predicting the sampled tokens, and only there
    out, _, _ = draft_sampled_batch(batch, draft, True, max_new_tokens=10, temperature=1.0,
                                    eos_token_ids=eos, pad_token_id=1, max_length=48, seed=11)
    # scored from the final hidden states a chunk at a time, it equals the divergence of the
    # whole logits, value and gradients
    scores = distill_loss(draft, target, out, cfg)
    keep = next_token_mask(out["loss_mask"]).bool()
    assert scores.count == int(out["loss_mask"].sum())
    full_draft = draft(input_ids=out["input_ids"], attention_mask=out["attention_mask"]).logits
    with torch.no_grad():
        full_target = target.model(input_ids=out["input_ids"],
                                   attention_mask=out["attention_mask"]).logits
    reference = divergence("jsd", full_draft, full_target, keep.float(), beta=cfg.beta)
    torch.testing.assert_close(scores.loss, reference, rtol=1e-5, atol=1e-6)
    reference.backward()
    expected = [p.grad.clone() for p in draft.parameters()]
    draft.zero_grad(set_to_none=True)
    scores.loss.backward()
    for p, grad in zip(draft.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, grad, rtol=1e-4, atol=1e-7)
    agree = (full_draft[keep].argmax(-1) == full_target[keep].argmax(-1)).sum()
    assert int(scores.agree) == int(agree)
    assert not any(p.requires_grad or p.grad is not None for p in target.model.parameters())


def test_a_fresh_draft_has_the_target_vocabulary_and_its_own_size(files, tmp_path):
    cfg = base_config(files, tmp_path, draft="fresh:1", draft_hidden_size=32)
    target = load_target(cfg.target)
    draft = build_draft(cfg, target)
    assert draft.config.num_hidden_layers == 1 and draft.config.hidden_size == 32
    assert draft.get_output_embeddings().weight.shape == (target.vocab_size, 32)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in draft.parameters())


# ------------------------------------------------------------------------------------------------
# Training runs


def test_gradient_checkpointing_gives_the_same_gradients(files, tmp_path):
    target = load_target(files["target"])
    rows, _ = load_distill_rows(files["data"][:1], target, 48)
    batch = collate_distill(rows[:4], target.tokenizer.pad_token_id)
    grads = []
    for checkpointing in (False, True):
        cfg = base_config(files, tmp_path, draft="truncate:2", gradient_checkpointing=checkpointing)
        draft = build_draft(cfg, target).train()
        assert draft.is_activation_checkpointing == checkpointing
        loss = distill_loss(draft, target, batch, cfg, reduction="sum").loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 4
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


@pytest.fixture(scope="module")
def whole_run(files, tmp_path_factory):
    """4 steps, on- and off-policy micro-batches mixed, uninterrupted."""
    out = tmp_path_factory.mktemp("whole")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        patch.setenv("WANDB_MODE", "disabled")
        result = main(base_config(files, out))
    return out, result


def test_training_moves_the_draft_only_and_logs_what_it_measures(files, whole_run):
    out, result = whole_run
    schedule = [is_on_policy(3, i, 0.5) for i in range(4)]
    assert any(schedule) and not all(schedule), "seed 3 should mix on- and off-policy steps"
    logged = records(out)
    train = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["on_policy"] for r in train] == [float(s) for s in schedule]
    for r in train:
        assert r["loss"] > 0 and 0 <= r["agreement"] <= 1 and r["tokens_per_s"] > 0
        assert r["peak_memory_gb"] > 0
        assert (r["sampled_tokens"] is not None) or not r["on_policy"]
    heldout = [r for r in logged if "heldout/acceptance" in r]
    assert [r["step"] for r in heldout] == [0, 2, 4]
    assert all(0 < r["heldout/acceptance"] <= 1 and r["heldout/positions"] > 0 for r in heldout)
    assert [r["step"] for r in logged if "eval/tau" in r] == [0, 2, 4]

    target = result["target"]
    on_disk = weights_on_disk(files["target"])
    for name, tensor in target.model.state_dict().items():
        if name in on_disk:
            assert torch.equal(tensor, on_disk[name]), f"training changed the target's {name}"
    assert not any(p.requires_grad for p in target.model.parameters())
    assert not target.model.training

    artifact = weights_on_disk(result["artifact"])
    assert set(artifact) == {k for k in on_disk if not k.startswith("model.layers.1.")}
    moved = [k for k in artifact if not torch.equal(artifact[k], on_disk[k])]
    assert any("layers.0." in k for k in moved) and "model.embed_tokens.weight" in moved


def test_the_exported_draft_works_in_eval_bench_and_transformers(files, whole_run):
    out, result = whole_run
    artifact = Path(result["artifact"])
    info = read_draft_info(artifact)
    assert info["method"] == "draft" and info["steps"] == 4 and info["divergence"] == "jsd"
    assert (artifact / "tokenizer.json").is_file()
    target = load_target(files["target"])
    prompt = target.chat_ids("w1 w2 w3")

    plain, speculative = build_methods(["plain", f"draft:{artifact}"], target,
                                       options={"draft": {"max_depth": 4, "min_confidence": 0.0}})
    greedy = SamplingParams(temperature=0.0)
    expected = plain.run(prompt, 12, greedy, seed=0).tokens
    assert speculative.run(prompt, 12, greedy, seed=0).tokens == expected

    assistant = AutoModelForCausalLM.from_pretrained(str(artifact))
    ids = torch.tensor([prompt])
    kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 1}
    reference = target.model.generate(ids, **kwargs)
    assisted = target.model.generate(ids, assistant_model=assistant, **kwargs)
    assert torch.equal(assisted, reference)


def test_the_artifact_records_its_drafting_and_the_bench_drafts_with_it(files, whole_run,
                                                                        tmp_path):
    """The trainer records its evaluation's drafting in the directory; `python -m draftsmith.eval.draft
    propose` replaces it after checking it; draft:<dir> drafts with the record where the command
    line sets nothing (a depth alone asks for a chain), stays exact, and the report says how it
    drafted. A damaged record and bad options are refused by name."""
    import shutil

    from draftsmith.eval import bench
    from draftsmith.eval.draft import main as draft_main

    out, result = whole_run
    artifact = tmp_path / "draft"
    shutil.copytree(result["artifact"], artifact)
    assert read_draft_info(artifact)["proposal"] == {
        "max_depth": 6, "min_confidence": 0.0, "branching": None, "children": "topk"}
    target = load_target(files["target"])

    def drafting(options=None) -> dict:
        method = build_methods([f"draft:{artifact}"], target, options={"draft": options or {}})[0]
        return method.drafting

    assert drafting() == {"max_depth": 6, "min_confidence": 0.0, "branching": None,
                          "children": "topk"}
    assert draft_main(["propose", str(artifact), "--draft-branching", "3,2"]) == 0
    assert read_draft_info(artifact)["proposal"] == {"branching": [3, 2]}
    assert drafting() == {"max_depth": 2, "min_confidence": 0.4, "branching": [3, 2],
                          "children": "topk"}
    assert drafting({"max_depth": 3})["branching"] is None  # a chain asked for
    assert drafting({"branching": [2]})["branching"] == [2]
    assert drafting({"children": "sample"})["branching"] == [3, 2]
    prompt = target.chat_ids("w1 w2 w3")
    plain, tree = build_methods(["plain", f"draft:{artifact}"], target)
    greedy = SamplingParams(temperature=0.0)
    assert tree.run(prompt, 12, greedy, seed=0).tokens == plain.run(prompt, 12, greedy, seed=0).tokens

    records = bench.main(["--target", files["target"], "--method", f"draft:{artifact}",
                          "--prompts", files["eval"], "--num-prompts", "1", "--max-new-tokens",
                          "6", "--warmup", "0", "--no-progress", "--out",
                          str(tmp_path / "r.json")])
    name = f"draft:{artifact}"
    assert next(r for r in records if r["method"] == name)["drafting"]["branching"] == [3, 2]
    saved = json.loads((tmp_path / "r.json").read_text())
    assert next(r for r in saved["methods"] if r["method"] == name)["drafting"] == {
        "max_depth": 2, "min_confidence": 0.4, "branching": [3, 2], "children": "topk"}

    before = (artifact / "config.json").read_text()
    for bad in (["--draft-branching", "0"], ["--draft-min-confidence", "2"]):
        with pytest.raises(SystemExit):  # argparse: exit status 2, the flag named
            draft_main(["propose", str(artifact), *bad])
    assert draft_main(["propose", str(artifact)]) == 2  # nothing to record
    assert (artifact / "config.json").read_text() == before
    assert draft_main(["propose", str(tmp_path), "--draft-depth", "2"]) == 2  # not a draft
    config = json.loads(before)
    config["draftsmith"]["proposal"] = {"depth": 3}
    (artifact / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: its 'proposal'"):
        drafting()


def test_resume_continues_exactly_through_on_policy_batches(files, whole_run, tmp_path,
                                                            monkeypatch):
    whole, result = whole_run
    assert any(is_on_policy(3, i, 0.5) for i in (2, 3)), "steps 3-4 should hold on-policy ones"
    monkeypatch.setattr(loop_module, "GracefulStop", StopAfter)
    first = main(base_config(files, tmp_path))
    assert first["step"] == 2 and first["stopped"] and first["artifact"] is None
    monkeypatch.setattr(loop_module, "GracefulStop", GracefulStop)
    rest = main(base_config(files, tmp_path, resume="latest"))
    assert rest["step"] == 4

    expected = [r for r in records(whole) if "loss" in r]
    got = [r for r in records(tmp_path) if "loss" in r]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(expected, got, strict=True):
        for key in ("loss", "agreement", "on_policy", "sampled_tokens", "lr"):
            assert a[key] == b[key], (a["step"], key)
    assert len({r["loss"] for r in expected}) == 4
    a, b = weights_on_disk(result["artifact"]), weights_on_disk(rest["artifact"])
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.filterwarnings(PEFT_WARNING)
def test_lora_trains_adapters_only_and_exports_merged_weights(files, tmp_path):
    cfg = base_config(files, tmp_path, lora=True, lora_r=4, lora_alpha=8.0,
                      lora_target_modules=["q_proj", "v_proj", "down_proj"], max_steps=2,
                      eval_every=0, heldout_every=0, on_policy_ratio=1.0, learning_rate=5e-2)
    target = load_target(cfg.target)
    draft = build_draft(cfg, target)
    trainable = [n for n, p in draft.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    result = main(cfg)
    artifact = weights_on_disk(result["artifact"])
    on_disk = weights_on_disk(files["target"])
    assert not any("lora" in k for k in artifact)
    moved = {k for k in artifact if not torch.equal(artifact[k], on_disk[k])}
    # adapters merged into the adapted matrices; every other weight is the frozen base
    assert moved == {f"model.layers.0.{m}.weight"
                     for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}


def test_the_target_as_its_own_draft_is_accepted_everywhere(files, tmp_path):
    """A model directory as the draft, here the target itself: the held-out 1 - TVD estimate
    and argmax agreement are 1 and the engine accepts every greedy draft token, before training
    moves it (on-policy only, off-policy rows held out)."""
    out = tmp_path / "self"
    main(base_config(files, out, draft=files["target"], max_steps=1, learning_rate=1e-6,
                     heldout_every=1, eval_every=1, on_policy_ratio=1.0))
    start = {k: v for r in records(out) if r["step"] == 0 for k, v in r.items()}
    assert start["heldout/acceptance"] == pytest.approx(1.0, abs=1e-6)
    assert start["heldout/agreement"] == 1.0
    assert start["eval/alpha"] == 1.0 and start["eval/tau"] > 1.5


def test_a_draft_with_another_vocabulary_is_refused(files, tmp_path):
    other = word_tokenizer()
    other.add_tokens([f"x{i}" for i in range(12)])
    draft_dir = save_tiny_llama(tmp_path / "other", len(other), other, seed=1)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        main(base_config(files, tmp_path / "run", draft=str(draft_dir)))


def test_data_without_a_usable_row_is_refused_row_by_row(files, tmp_path):
    target = load_target(files["target"], device="cpu")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(row) + "\n" for row in [
        {"messages": [{"role": "assistant", "content": "w1"}]}, {"text": "w2"},
        {"messages": []}]))
    with pytest.raises(ValueError, match=r"(?s)no usable conversations in .*bad.jsonl.*3 rows, 0 "
                                         r"used.*an assistant turn before any user turn \(rows 0\)"
                                         r".*missing key 'messages' \(rows 1\).*empty "
                                         r"conversation \(rows 2\)"):
        load_distill_rows([str(bad)], target, 48)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "w1"}]}) + "\n")
    with pytest.raises(ValueError, match=r"(?s)no assistant turn \(rows 0\).*regenerate.*"
                                         r"on_policy_ratio is above 0"):
        load_distill_rows([str(prompts)], target, 48, keep_prompt_only=False)
    with pytest.raises(ValueError, match="no usable conversations"):
        main(base_config(files, tmp_path / "run", data=[str(bad)]))
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------
# Slow: two processes, and the real embedded target


@pytest.mark.slow
def test_two_cpu_processes_sample_reduce_and_export(files, tmp_path):
    """torchrun with 2 processes: each samples its own rows, the held-out sums are reduced, the
    main process exports a draft that loads (about 15 s)."""
    out = tmp_path / "two"
    args = [f"--target={files['target']}", f"--data={','.join(files['data'])}",
            "--draft=truncate:1", "--max_length=48", "--max_steps=3", "--warmup_steps=1",
            "--per_device_batch_size=2", "--log_every=1", "--eval_every=0",
            "--heldout_fraction=0.1", "--heldout_max_rows=4", "--heldout_every=3",
            "--on_policy_max_new_tokens=8", "--seed=3", f"--output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2", str(REPO / "train" / "distill.py"), *args],
                   check=True, env=env, cwd=REPO, timeout=300)
    logged = records(out)
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3]
    assert [r["samples"] for r in logged if "loss" in r] == [4, 8, 12]  # 2 rows x 2 processes
    assert [r["step"] for r in logged if "heldout/acceptance" in r] == [0, 3]
    target = load_target(files["target"])
    info = read_draft_info(out / "artifact")
    assert info["steps"] == 3
    load_draft(str(out / "artifact"), target)


@pytest.mark.parametrize("frozen", [False, True], ids=["whole", "frozen-embedding"])
def test_sharded_target_and_fsdp2_draft_train_the_one_process_steps(files, tmp_path, frozen):
    """torchrun, 2 CPU processes launched as with configs/accelerate/fsdp2.yaml, the target's
    layers sharded over both (target_parallel 2) and a fresh one-layer draft under FSDP2
    (off-policy: a sharded draft cannot sample per process): the 1-process losses, argmax
    agreement and held-out 1 - TVD (scored in lockstep), and the same draft gathered for the
    artifact. With freeze_embedding the draft takes the whole embedding every process keeps
    (only the layers are sharded), trains around it and leaves it out of the directory."""
    common = dict(draft="fresh:1", on_policy_ratio=0.0, max_steps=4, eval_every=0,
                  heldout_every=2, save_every=0, lr_schedule="constant")
    if frozen:
        common.update(freeze_embedding=True, draft_vocab_size=12)
    main(base_config(files, tmp_path / "one", **common))
    sharding.torchrun("train/distill.py", base_config(files, tmp_path / "two", target_parallel=2,
                                                      per_device_batch_size=2, **common),
                      fsdp2=True)
    for key in ("loss", "agreement", "heldout/acceptance", "heldout/positions"):
        expected = [(r["step"], r[key]) for r in records(tmp_path / "one") if key in r]
        got = [(r["step"], r[key]) for r in records(tmp_path / "two") if key in r]
        assert len(expected) >= 2
        sharding.assert_same_steps(expected, got)
    whole = weights_on_disk(str(tmp_path / "one" / "artifact"))
    gathered = weights_on_disk(str(tmp_path / "two" / "artifact"))
    assert gathered.keys() == whole.keys()
    assert frozen == (not any("embed_tokens" in k for k in whole))
    # the one-process run scores from hidden states a chunk at a time, the sharded one from
    # whole logits (its target is split): the same divergence, rounded differently, which
    # AdamW's normalised steps carry into the weights at the 1e-5 level
    for name, tensor in whole.items():
        torch.testing.assert_close(gathered[name], tensor, rtol=1e-4, atol=5e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_a_few_steps_on_the_embedded_smollm2_target(tmp_path):
    """truncate:2 of SmolLM2-135M-Instruct, on- and off-policy, exported and loaded back."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in [
        ("What is 2 + 3?", "2 + 3 = 5.\n#### 5"),
        ("Name a primary colour.", "Red is a primary colour."),
        ("What is the capital of France?", "The capital of France is Paris."),
        ("How many legs does a spider have?", "A spider has 8 legs.\n#### 8"),
        ("Say hello in French.", "Bonjour!"),
    ]))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"conversations": [{"from": "human", "value": v}]} for v in (
        "Write a haiku about the sea.", "Explain what a list is in Python.",
        "Give me three tips for sleeping well.")]))
    cfg = config_from_dict(DistillConfig, dict(
        target="smollm2-135m", draft="truncate:2", data=[str(data), str(prompts)],
        output_dir=str(tmp_path / "run"), max_length=128, per_device_batch_size=2, max_steps=3,
        warmup_steps=1, learning_rate=1e-4, log_every=1, eval_every=0, heldout_fraction=0.2,
        heldout_max_rows=2, heldout_every=3, on_policy_ratio=0.5, on_policy_max_new_tokens=16,
        divergence="tvd", seed=1, report_to="none"))
    result = main(cfg)
    logged = records(tmp_path / "run")
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3]
    assert all(0 <= r["loss"] <= 1 for r in logged if "loss" in r)  # TVD is in [0, 1]
    heldout = [r["heldout/acceptance"] for r in logged if "heldout/acceptance" in r]
    assert len(heldout) == 2 and all(0 < a < 1 for a in heldout)
    draft = load_draft(str(result["artifact"]), result["target"])
    assert draft.config.num_hidden_layers == 2


def test_a_reduced_draft_vocabulary_trains_resumes_and_decodes_exactly(files, tmp_path):
    """draft_vocab_size: the most frequent answer tokens only, on- and off-policy; a resume with
    other data (another vocabulary) is refused; forward KL (infinite there) is refused at parse."""
    from draftsmith.heads.distill import DraftVocabHead, load_draft

    out = tmp_path / "run"
    result = main(base_config(files, out, draft_vocab_size=12, eval_every=0, heldout_every=4))
    artifact = Path(result["artifact"])
    assert read_draft_info(artifact)["draft_vocab_size"] == 12
    first = records(out)[0]
    assert first["draft_vocab/size"] == 12 and 0 < first["draft_vocab/coverage"] <= 1
    assert all(r["loss"] > 0 for r in records(out) if "loss" in r)
    target = load_target(files["target"])
    draft = load_draft(str(artifact), target)
    head = draft.get_output_embeddings()
    assert isinstance(head, DraftVocabHead) and head.weight.shape[0] == 12
    assert decodes_like_the_target(target, artifact)
    with pytest.raises(ValueError, match="reduced vocabulary.*--method draft:"):
        build_methods([f"hf-assisted:{artifact}"], target)

    # a resumed run whose data would give another vocabulary (the data check passes here: the
    # vocabulary rule itself is what changed) is refused, not silently continued
    import draftsmith.train.distill as distill_module
    from draftsmith.heads.draft_vocab import maps_from_token_ids

    def other_vocabulary(token_ids, masks, vocab_size, size):
        return (*maps_from_token_ids(torch.arange(size), vocab_size), 1.0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distill_module, "draft_vocabulary", other_vocabulary)
        with pytest.raises(ValueError, match="cannot resume .* draft vocabulary"):
            main(base_config(files, out, draft_vocab_size=12, eval_every=0, heldout_every=4,
                             max_steps=6, resume="latest"))
    with pytest.raises(ValueError, match="infinite where the target gives probability"):
        base_config(files, tmp_path / "kl", draft_vocab_size=12, divergence="forward_kl")


def test_a_frozen_embedding_is_the_targets_left_out_of_the_directory_and_taken_back(
        files, tmp_path):
    """freeze_embedding: the draft trains its layers and reduced LM head only; the directory holds
    no embedding and the loader takes the target's (refusing a target with other weights); the
    draft decodes exactly. Settings it cannot apply to are refused when the config is read."""
    out = tmp_path / "run"
    result = main(base_config(files, out, draft="truncate:2", draft_vocab_size=12,
                              freeze_embedding=True, eval_every=0, heldout_every=0))
    artifact = Path(result["artifact"])
    assert read_draft_info(artifact)["embedding"] == "target"
    on_disk = weights_on_disk(str(artifact))
    assert not any("embed_tokens" in k for k in on_disk)
    target = load_target(files["target"])
    embedding = target.model.get_input_embeddings().weight
    start = LlamaForCausalLM.from_pretrained(files["target"])
    trained = [k for k, v in on_disk.items() if k.startswith("model.layers.0.")
               and not torch.equal(v, start.state_dict()[k])]
    assert trained  # the layers moved; the embedding could not
    draft = load_draft(str(artifact), target)
    assert torch.equal(draft.get_input_embeddings().weight, embedding)
    assert decodes_like_the_target(target, artifact)

    # shipped in bf16 through `python -m draftsmith.heads.artifact cast`: half the bytes, the ids kept, the
    # same refusals as any cast (never over its source), and it still decodes exactly
    from draftsmith.heads.artifact import main as artifact_main

    shipped = tmp_path / "shipped"
    assert artifact_main(["cast", str(artifact), str(shipped), "--dtype", "bf16"]) == 0
    cast = weights_on_disk(str(shipped))
    assert cast.keys() == on_disk.keys() and cast["lm_head.kept"].dtype == torch.int64
    assert all(v.dtype == torch.bfloat16 for k, v in cast.items() if k != "lm_head.kept")
    assert read_draft_info(shipped) == read_draft_info(artifact)
    assert artifact_main(["cast", str(shipped), str(artifact), "--dtype", "fp32"]) == 2
    assert artifact_main(["cast", str(artifact), str(shipped), "--dtype", "bf16"]) == 0  # again
    assert decodes_like_the_target(target, shipped)

    other = tmp_path / "other-target"  # the same shapes, another embedding: not the draft's
    start.model.embed_tokens.weight.data.add_(0.5)
    start.save_pretrained(str(other))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(files["target"]) / name).is_file():
            (other / name).write_bytes((Path(files["target"]) / name).read_bytes())
    with pytest.raises(ValueError, match="other weights"):
        load_draft(str(artifact), load_target(str(other)))

    for bad in ({"freeze_embedding": True},  # the LM head would be the tied embedding
                {"freeze_embedding": True, "draft_vocab_size": 12, "draft": "fresh:1",
                 "draft_hidden_size": 8},
                {"freeze_embedding": True, "draft_vocab_size": 12, "lora": True}):
        with pytest.raises(ValueError, match="freeze_embedding"):
            base_config(files, tmp_path / "bad", **bad)
