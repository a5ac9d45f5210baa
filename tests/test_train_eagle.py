"""train/eagle.py end to end: what moves, what stays frozen, exact resume, online = offline,
DDP = one process, the exported layouts, and the refusals.

The target is a random 4-layer Llama (hidden 32) saved as a Hugging Face directory with the real
SmolLM2 tokenizer and chat template, so data, templates, checkpoints, evaluation and export run as
on the real target, in seconds. Four layers because EAGLE-3 fuses three distinct hidden states
below the last layer (``aux_layer_ids`` 1, 2, 3).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import test_sharding as sharding
import torch
from conftest import StopAfter, write_jsonl
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

import draftsmith.train.loop as loop_module
from draftsmith.heads.eagle import EagleHead, load_eagle
from draftsmith.layouts.eagle import load_eagle_head
from draftsmith.layouts.export import main as export_main
from draftsmith.targets.target import load_target
from draftsmith.train.config import parse_config
from draftsmith.train.eagle import EagleTrainConfig, draft_vocabulary, head_config, main
from draftsmith.train.rows import load_sft_dataset
from draftsmith.train.signals import GracefulStop

pytestmark = pytest.mark.usefixtures("trainer_env")

REPO = Path(__file__).resolve().parents[1]
# single-token words of the SmolLM2 tokenizer (with a leading space)
WORDS = ("the cat dog sat on mat a big red blue green house tree river sun moon star bird fish "
         "car").split()


def save_tiny_target(path: Path, tokenizer, used_ids: set[int], hidden: int = 32,
                     seed: int = 0) -> Path:
    """A random 4-layer Llama over the SmolLM2 vocabulary (49152), saved with its tokenizer.

    Like a trained model, it predicts tokens the text uses, with confidence: the embedding and
    LM-head rows of every token outside ``used_ids`` (the test data and its chat template) are
    zero, and the LM head is scaled up (next-token entropy about 0.5 nats). A plain random
    target spreads its distribution over all 49152 tokens, which leaves a draft nothing to learn.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    unused = torch.ones(len(tokenizer), dtype=torch.bool)
    unused[sorted(used_ids)] = False
    with torch.no_grad():
        model.get_input_embeddings().weight[unused] = 0
        model.get_output_embeddings().weight[unused] = 0
        model.get_output_embeddings().weight.mul_(5)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def conversation(rng: random.Random, user_words: int, answer_words: int) -> dict:
    def text(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))
    return {"messages": [{"role": "user", "content": text(user_words)},
                         {"role": "assistant", "content": text(answer_words)}]}


def chat_token_ids(tokenizer, rows: list[dict], prompts: list[str]) -> set[int]:
    """Every token id of the rows and of the prompts, as the chat template writes them."""
    used = set()
    for row in rows:
        used.update(tokenizer.apply_chat_template(row["messages"], tokenize=True,
                                                  return_dict=False))
    for prompt in prompts:
        used.update(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  tokenize=True, return_dict=False,
                                                  add_generation_prompt=True))
    return used


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny targets (the run's, and another with a different width), data and eval prompts."""
    root = tmp_path_factory.mktemp("eagle")
    tokenizer = load_target("smollm2-135m").tokenizer
    rng = random.Random(0)
    varied = [conversation(rng, rng.randint(3, 8), rng.randint(6, 14)) for _ in range(16)]
    # every row the same number of tokens: DDP's mean of per-process means is the global mean
    even = [conversation(rng, 5, 10) for _ in range(16)]
    repeated = [conversation(random.Random(1), 6, 16)] * 8
    bad = varied[:6] + [
        {"messages": [{"role": "user", "content": "the cat sat"}]},  # no assistant turn
        {"messages": [{"role": "robot", "content": "beep"},
                      {"role": "assistant", "content": "the dog"}]},  # unknown role
    ]
    prompts = [" ".join(WORDS[i:i + 5]) for i in (0, 7)]
    eval_prompts = root / "eval.jsonl"
    eval_prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    used = chat_token_ids(tokenizer, varied + even + repeated
                          + [conversation(rng, 1, 1) for _ in range(40)], prompts)
    target = save_tiny_target(root / "target", tokenizer, used)
    other = save_tiny_target(root / "other-target", tokenizer, used, hidden=48, seed=1)
    return {"root": root, "target": str(target), "other": str(other),
            "varied": write_jsonl(root / "varied.jsonl", varied),
            "even": write_jsonl(root / "even.jsonl", even),
            "repeated": write_jsonl(root / "repeated.jsonl", repeated),
            "bad": write_jsonl(root / "bad.jsonl", bad), "eval": str(eval_prompts)}


def arguments(files, out: Path, **overrides) -> list[str]:
    """The command line of a test run: configs/eagle/tiny.yaml pointed at the tiny target."""
    values = dict(target=files["target"], data=files["varied"], output_dir=str(out),
                  aux_layer_ids="1,2,3", draft_vocab_size=512, max_length=64,
                  per_device_batch_size=4, max_steps=4, warmup_steps=1, learning_rate=3e-3,
                  save_every=2, keep_checkpoints="none", log_every=1, eval_every=2,
                  eval_prompts=files["eval"], eval_num_prompts=2, eval_max_new_tokens=6, seed=3)
    values.update(overrides)
    if values.get("version") == 1:  # tiny.yaml is an EAGLE-3 config: unset its EAGLE-3 keys
        values.update(aux_layer_ids="none", draft_vocab_size="none", ttt_steps=7)
    argv = ["--config", str(REPO / "configs/eagle/tiny.yaml")]
    for key, value in values.items():
        argv += [f"--{key}", str(value)]
    return argv


def config(files, out: Path, **overrides) -> EagleTrainConfig:
    return parse_config(EagleTrainConfig, arguments(files, out, **overrides))


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[dict]:
    return [r for r in records(out) if "loss" in r]


def initial_head(cfg: EagleTrainConfig, target) -> EagleHead:
    """The head main() starts from: built right after the seed, as the trainer does."""
    dataset, _ = load_sft_dataset(cfg.data, target.tokenizer, cfg.max_length)
    config_ = head_config(cfg, target)
    d2t, t2d, _ = draft_vocabulary(dataset, config_)
    torch.manual_seed(cfg.seed)
    return EagleHead(config_, target, d2t=d2t, t2d=t2d, dtype=torch.float32)


@pytest.fixture(scope="module", params=[1, 3], ids=["eagle1", "eagle3"])
def whole_run(request, files, tmp_path_factory):
    """4 uninterrupted steps, checkpoints at 2 and 4, acceptance at 0, 2 and 4."""
    version = request.param
    out = tmp_path_factory.mktemp(f"whole{version}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        patch.setenv("WANDB_MODE", "disabled")
        cfg = config(files, out, version=version, lr_schedule="constant")
        result = main(cfg)
    return version, cfg, out, result


# ------------------------------------------------------------------------------------------------
# Config


def test_shipped_configs_parse_and_mistakes_are_named(tmp_path):
    shipped = {name: parse_config(EagleTrainConfig, ["--config", str(REPO / "configs/eagle" /
                                                                     f"{name}.yaml")])
               for name in ("smollm2-135m", "smollm2-135m-eagle1", "tiny")}
    assert shipped["smollm2-135m"].version == 3 and shipped["smollm2-135m"].draft_vocab_size
    assert shipped["smollm2-135m-eagle1"].version == 1
    for cfg in shipped.values():
        for source in cfg.data:
            assert (REPO / source).is_file(), f"{source} is not vendored"
    with pytest.raises(ValueError, match="did you mean 'ttt_steps'"):
        parse_config(EagleTrainConfig, ["--ttt_step", "3"])
    typo = tmp_path / "typo.yaml"
    typo.write_text("version: 3\ndraft_vocab_sise: 1024\n")
    with pytest.raises(ValueError, match=r"'draft_vocab_sise' in .*typo\.yaml.*did you mean "
                                         r"'draft_vocab_size'"):
        parse_config(EagleTrainConfig, ["--config", str(typo)])
    with pytest.raises(ValueError, match="choose one of"):
        parse_config(EagleTrainConfig, ["--version", "2"])
    with pytest.raises(ValueError, match="'draft_vocab_size' applies to EAGLE-3 only"):
        parse_config(EagleTrainConfig, ["--version", "1", "--draft_vocab_size", "1024"])
    with pytest.raises(ValueError, match="'ce_weight' applies to EAGLE-1 only"):
        parse_config(EagleTrainConfig, ["--ce_weight", "0.5"])
    with pytest.raises(ValueError, match="three hidden-state indices"):
        parse_config(EagleTrainConfig, ["--aux_layer_ids", "2,5"])
    with pytest.raises(ValueError, match="set feature_mode: offline"):
        parse_config(EagleTrainConfig, ["--feature_cache_dir", "features"])
    with pytest.raises(ValueError, match="'ttt_decay' must be in"):
        parse_config(EagleTrainConfig, ["--ttt_decay", "0"])


# ------------------------------------------------------------------------------------------------
# A whole run


def test_training_moves_the_head_only_and_logs_what_it_measures(files, whole_run):
    version, cfg, out, result = whole_run
    target = result["target"]
    on_disk = load_file(str(Path(files["target"]) / "model.safetensors"))
    for name, tensor in target.model.state_dict().items():
        if name in on_disk:
            assert torch.equal(tensor, on_disk[name]), f"training changed the target's {name}"
    assert not any(p.requires_grad for p in target.model.parameters())
    assert not target.model.training

    start = initial_head(cfg, target).state_dict()
    trained = load_file(str(Path(result["artifact"]) / "model.safetensors"))
    assert set(trained) == set(start)
    assert not any(name.startswith(("embed", "model.")) for name in trained)  # nothing of the target
    moved = [name for name in trained if not torch.equal(trained[name], start[name])]
    fixed = {"d2t", "t2d"}
    assert set(moved) == set(trained) - fixed, "every trainable weight moves, the maps do not"
    if version == 3:
        dataset, _ = load_sft_dataset(cfg.data, target.tokenizer, cfg.max_length)
        d2t, t2d, coverage = draft_vocabulary(dataset, head_config(cfg, target))
        assert torch.equal(trained["d2t"], d2t) and torch.equal(trained["t2d"], t2d)
        assert coverage == 1.0  # 512 draft tokens hold every assistant token of these rows

    logged = records(out)
    start_record = logged[0]
    assert start_record["step"] == 0 and start_record["data/used"] == 16
    assert start_record["data/skipped"] == 0
    if version == 3:
        assert start_record["draft_vocab/size"] == 512
        assert start_record["draft_vocab/coverage"] == 1.0
    else:
        assert not any(key.startswith("draft_vocab/") for key in start_record)
    train = losses(out)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    accuracies = ["acc_0"] if version == 1 else ["acc_0", "acc_1", "acc_2"]  # tiny.yaml: 3 steps
    parts = ["feature_loss", "ce_loss"] if version == 1 else ["ce_loss_0", "ce_loss_1", "ce_loss_2"]
    for r in train:
        assert r["loss"] > 0 and r["tokens_per_s"] > 0 and r["lr"] == cfg.learning_rate
        assert r["peak_memory_gb"] > 0
        assert all(0 <= r[a] <= 1 for a in accuracies) and all(r[p] > 0 for p in parts)
        assert "acc_3" not in r
    evals = [r for r in logged if "eval/tau" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(r["eval/tau"] >= 1 for r in evals)
    assert result["step"] == 4 and result["stopped"] is None
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step_2", "step_4"]


def test_exported_layouts_load_back_and_draft_the_same(files, whole_run, tmp_path):
    version, cfg, out, result = whole_run
    target = load_target(files["target"])
    head = load_eagle(result["artifact"], target).eval()
    n = 12
    ids = torch.randint(0, 400, (1, n), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, n, len(head.config.aux_layer_ids) * 32, dtype=head.dtype)
    positions = torch.arange(n)[None]
    with torch.no_grad():
        _, expected = head(ids, head.fuse(features), positions)
    # speculators takes EAGLE-3 only, and names the verifier by hub id (the tiny target has none)
    formats = ("vllm", "sglang", "speculators") if version == 3 else ("vllm", "sglang")
    for fmt in formats:
        exported = tmp_path / fmt
        if fmt == "vllm":  # the command line users run, once
            done = subprocess.run(
                [sys.executable, "-m", "draftsmith", "export", str(result["artifact"]), "--format", fmt,
                 "--out", str(exported)], cwd=REPO, capture_output=True, text=True, timeout=300,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            assert done.returncode == 0, done.stderr
        else:
            extra = ["--verifier", "org/tiny", "--target", files["target"]] * (fmt == "speculators")
            assert export_main([str(result["artifact"]), "--format", fmt,
                                "--out", str(exported), *extra]) == 0
        back = load_eagle_head(exported, target).eval()
        with torch.no_grad():
            _, logits = back(ids, back.fuse(features), positions)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=fmt)
        if version == 3:
            assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)


# ------------------------------------------------------------------------------------------------
# Resume, online = offline, a repeated batch


def test_resume_after_a_stop_continues_exactly(files, whole_run, tmp_path, monkeypatch):
    """Stopped after step 2 (as by SIGTERM), resumed with another eval tree: the same run."""
    version, _, whole, result = whole_run
    monkeypatch.setattr(loop_module, "GracefulStop", StopAfter)
    first = main(config(files, tmp_path, version=version, lr_schedule="constant"))
    assert first["step"] == 2 and first["stopped"] and first["artifact"] is None
    monkeypatch.setattr(loop_module, "GracefulStop", GracefulStop)
    rest = main(config(files, tmp_path, version=version, lr_schedule="constant",
                       resume="latest", tree_nodes=5, tree_topk=2))
    assert rest["step"] == 4
    expected, got = losses(whole), losses(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(expected, got, strict=True):
        for key in a:
            if key.startswith(("loss", "acc_", "ce_loss", "feature_loss", "lr", "samples")):
                assert a[key] == b[key], (a["step"], key)
    assert len({r["loss"] for r in expected}) == 4
    a = load_file(str(Path(result["artifact"]) / "model.safetensors"))
    b = load_file(str(Path(rest["artifact"]) / "model.safetensors"))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resume_after_max_steps_continues_exactly(files, whole_run, tmp_path):
    """A run of max_steps 2, continued to 4 (a constant learning rate spans both the same)."""
    version, _, whole, _ = whole_run
    main(config(files, tmp_path, version=version, lr_schedule="constant", max_steps=2))
    main(config(files, tmp_path, version=version, lr_schedule="constant", resume="latest"))
    assert [r["loss"] for r in losses(tmp_path)] == [r["loss"] for r in losses(whole)]


def test_online_and_offline_features_give_the_same_first_step(files, whole_run, tmp_path):
    version, _, whole, _ = whole_run
    cache = tmp_path / "cache"
    offline = main(config(files, tmp_path / "run", version=version, lr_schedule="constant",
                          feature_mode="offline", feature_cache_dir=str(cache), max_steps=1,
                          eval_every=0, feature_dtype="fp32"))
    assert offline["step"] == 1 and (cache / "index.json").is_file()
    assert not offline["target"].layers[0].self_attn.q_proj.weight.is_meta  # it wrote the cache
    # a second run from the finished cache loads only what the loss reads from the target
    again = main(config(files, tmp_path / "again", version=version, lr_schedule="constant",
                        feature_mode="offline", feature_cache_dir=str(cache), max_steps=1,
                        eval_every=0, feature_dtype="fp32"))
    assert again["target"].layers[0].self_attn.q_proj.weight.is_meta
    online_first = losses(whole)[0]
    for run in ("run", "again"):
        offline_first = losses(tmp_path / run)[0]
        for key, value in online_first.items():
            if key.startswith(("loss", "acc_", "ce_loss", "feature_loss")):
                assert offline_first[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_packing_trains_the_unpacked_steps(files, tmp_path):
    """packing: true lays each micro-batch's rows end to end (no padding): the same losses,
    accuracies and weights as padded batches, online and from the offline cache."""
    common = dict(max_steps=2, eval_every=0, save_every=0, lr_schedule="constant")
    main(config(files, tmp_path / "padded", **common))
    main(config(files, tmp_path / "packed", packing="true", **common))
    main(config(files, tmp_path / "cached", packing="true", feature_mode="offline",
                feature_dtype="fp32", feature_cache_dir=str(tmp_path / "cache"), **common))
    padded = losses(tmp_path / "padded")
    assert all(r["padding"] > 0 for r in padded)
    weights = load_file(str(tmp_path / "padded/artifact/model.safetensors"))
    for run in ("packed", "cached"):
        got = losses(tmp_path / run)
        assert [r["padding"] for r in got] == [0, 0]
        for a, b in zip(padded, got, strict=True):
            for key in ("loss", "ce_loss_0", "acc_0", "acc_2", "tokens"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (run, key)
        packed = load_file(str(tmp_path / run / "artifact/model.safetensors"))
        for name, tensor in weights.items():
            torch.testing.assert_close(packed[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_loss_falls_on_a_repeated_batch(files, tmp_path):
    main(config(files, tmp_path, data=files["repeated"], max_steps=20, per_device_batch_size=2,
                eval_every=0, save_every=0, lr_schedule="constant", learning_rate=1e-2))
    train = [r["loss"] for r in losses(tmp_path)]
    assert len(train) == 20
    assert sum(train[-3:]) / 3 < 0.5 * train[0], train


# ------------------------------------------------------------------------------------------------
# Several processes


def test_two_processes_match_one_with_the_same_global_batch(files, tmp_path):
    # equal rows and the whole vocabulary (no position skipped for a target argmax outside the
    # draft vocabulary): every process's mean loss weighs as many tokens, so DDP's mean of the
    # per-process means is the one-process mean
    common = dict(data=files["even"], max_steps=3, eval_every=0, save_every=0,
                  lr_schedule="constant", draft_vocab_size="none")
    main(config(files, tmp_path / "one", per_device_batch_size=4, **common))
    argv = arguments(files, tmp_path / "two", per_device_batch_size=2, **common)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "train/eagle.py"), *argv], cwd=REPO, capture_output=True, text=True,
        timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [r["samples"] for r in two] == [r["samples"] for r in one] == [4, 8, 12]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "ce_loss_0", "acc_0"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["step"], key)
    a = load_file(str(tmp_path / "one/artifact/model.safetensors"))
    b = load_file(str(tmp_path / "two/artifact/model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def test_sharded_target_and_fsdp2_head_train_the_one_process_steps_and_resume_anywhere(
        files, tmp_path, monkeypatch):
    """torchrun, 2 CPU processes (gloo), launched as with configs/accelerate/fsdp2.yaml: the
    target's layers sharded over both (target_parallel 2) write the offline feature cache, byte
    for byte the one 1 process writes with a whole target (fp32: the same features exactly);
    the head under FSDP2 trains the 1-process steps (losses to 1e-5, weights gathered for the
    artifact); its checkpoint (torch.distributed.checkpoint) resumes on 1 process exactly, and a
    1-process checkpoint resumes on 2 with the target sharded and the features online. (Token
    accuracies are compared; ce_loss_<i> is a mean per micro-batch, which the split changes.)"""
    common = dict(max_steps=4, eval_every=0, save_every=2, lr_schedule="constant")
    one = tmp_path / "one"
    main(config(files, one, feature_mode="offline", feature_dtype="fp32",
                feature_cache_dir=str(tmp_path / "cache1"), **common))
    expected = sharding.losses(one, "acc_0", "acc_2", "tokens")
    two = tmp_path / "two"
    sharding.torchrun("train/eagle.py", config(
        files, two, per_device_batch_size=2, target_parallel=2, feature_mode="offline",
        feature_dtype="fp32", feature_cache_dir=str(tmp_path / "cache2"), **common), fsdp2=True)
    cached = sorted(p.name for p in (tmp_path / "cache1").iterdir())
    assert cached == sorted(p.name for p in (tmp_path / "cache2").iterdir())
    for name in cached:
        assert (tmp_path / "cache1" / name).read_bytes() == \
            (tmp_path / "cache2" / name).read_bytes(), name
    sharding.assert_same_steps(expected, sharding.losses(two, "acc_0", "acc_2", "tokens"))
    assert sorted(p.name for p in (two / "checkpoints/step_2").iterdir()) == [
        ".draftsmith", "dcp", "random_states_0.pkl", "random_states_1.pkl", "trainer_state.json"]
    whole = load_file(str(one / "artifact/model.safetensors"))
    gathered = load_file(str(two / "artifact/model.safetensors"))
    assert gathered.keys() == whole.keys()
    for name, tensor in whole.items():
        torch.testing.assert_close(gathered[name], tensor, rtol=1e-4, atol=1e-5, msg=name)

    for key, value in sharding.fsdp2_env().items():  # 1 process, launched with fsdp2.yaml
        monkeypatch.setenv(key, value)
    main(config(files, tmp_path / "back", resume=str(two / "checkpoints/step_2"), **common))
    sharding.assert_same_steps(expected[2:], sharding.losses(tmp_path / "back", "acc_0",
                                                             "acc_2", "tokens"))
    main(config(files, tmp_path / "alone", **{**common, "max_steps": 2}))
    sharding.torchrun("train/eagle.py", config(
        files, tmp_path / "forth", per_device_batch_size=2, target_parallel=2,
        resume=str(tmp_path / "alone/checkpoints/step_2"), **common), fsdp2=True)
    sharding.assert_same_steps(expected[2:], sharding.losses(tmp_path / "forth", "acc_0",
                                                             "acc_2", "tokens"))


def test_mixing_fsdp2_with_a_ddp_checkpoint_is_refused_before_the_target_loads(
        files, tmp_path, monkeypatch):
    """A checkpoint that holds the head whole (DDP, one process) resumed by an FSDP2 launch, and
    an FSDP2 checkpoint by a DDP launch: one line each naming the config to launch with, before
    the target loads; nothing in the run directory changes."""
    import draftsmith.train.sharding as sharding_module

    common = dict(max_steps=2, eval_every=0, save_every=2)
    main(config(files, tmp_path / "ddp", **common))
    for key, value in sharding.fsdp2_env().items():
        monkeypatch.setenv(key, value)
    main(config(files, tmp_path / "fsdp2", **common))
    saved = json.loads((tmp_path / "fsdp2/checkpoints/step_2/trainer_state.json").read_text())
    assert ".metadata" in saved["dcp"]  # verified before torch unpickles it on a resume

    def never(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(sharding_module, "load_run_target", never)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(ValueError, match=r"holds the trained module whole, as DDP trains it "
                       r".*resume with configs/accelerate/multi_gpu.yaml") as refused:
        main(config(files, tmp_path / "ddp", resume="latest", **{**common, "max_steps": 3}))
    assert "\n" not in str(refused.value)
    for key in sharding.fsdp2_env():
        monkeypatch.delenv(key)
    with pytest.raises(ValueError, match=r"holds the trained module as FSDP2 shards \(dcp/\) "
                       r".*configs/accelerate/fsdp2.yaml"):
        main(config(files, tmp_path / "fsdp2", resume="latest", **{**common, "max_steps": 3}))
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


# ------------------------------------------------------------------------------------------------
# Bad input


def test_a_missing_data_file_is_named(files, tmp_path):
    missing = str(tmp_path / "nowhere.jsonl")
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        main(config(files, tmp_path / "run", data=missing))


def test_unusable_rows_are_counted_and_reported(files, tmp_path, capsys):
    result = main(config(files, tmp_path, data=files["bad"], max_steps=1, eval_every=0,
                         per_device_batch_size=2))
    skipped = result["report"].sources[files["bad"]].skipped
    assert skipped == {"no assistant turn": [6], "unknown role 'robot'": [7]}
    shown = capsys.readouterr().out
    assert "skipped 2 rows" in shown and "no assistant turn" in shown and "'robot'" in shown
    start = records(tmp_path)[0]
    assert start["data/rows"] == 8 and start["data/used"] == 6 and start["data/skipped"] == 2


def test_resume_refuses_another_config_target_or_data(files, tmp_path):
    current = tmp_path / "target"  # the path the run names; what it points to changes below
    current.symlink_to(files["target"])
    data = tmp_path / "data.jsonl"
    shutil.copy(files["varied"], data)
    out = tmp_path / "run"
    common = dict(target=str(current), data=str(data), max_steps=2, eval_every=0)
    main(config(files, out, **common))

    with pytest.raises(ValueError, match=r"'ttt_steps' changed \(ttt_steps: 3 in the checkpoint, "
                                         r"2 now\)"):
        main(config(files, out, resume="latest", ttt_steps=2, **common))
    with pytest.raises(ValueError, match="'draft_vocab_size' changed"):
        main(config(files, out, resume="latest", **{**common, "draft_vocab_size": 256}))

    current.unlink()
    current.symlink_to(files["other"])
    with pytest.raises(ValueError, match="trained for another target.*hidden_size: 32 there, "
                                         "48 here"):
        main(config(files, out, resume="latest", **common))
    current.unlink()
    current.symlink_to(files["target"])

    # the same number of rows with other words: other lengths, and another draft vocabulary
    rng = random.Random(5)
    rows = [conversation(rng, 4, 8) for _ in range(16)]
    for row in rows:
        row["messages"][1]["content"] += " ocean mountain"
    write_jsonl(data, rows)
    with pytest.raises(ValueError, match="training data changed .*rows of other lengths"):
        main(config(files, out, resume="latest", **common))


def test_init_layer_reads_the_same_layer_from_a_target_loaded_in_parts(files, tmp_path):
    """A run from a finished feature cache loads the target's embedding, norm and LM head only;
    init_layer then reads its layer from the checkpoint, and the head starts the same."""
    from draftsmith.targets.target import load_target_parts
    from draftsmith.train.features import target_layer_weights

    whole = load_target(files["target"], dtype=torch.float32)
    parts = load_target_parts(files["target"], dtype=torch.float32)
    assert all(p.is_meta for p in parts.layers[2].parameters())
    from_parts = target_layer_weights(parts, 2, EagleHead.LAYER_WEIGHTS)
    loaded = target_layer_weights(whole, 2, EagleHead.LAYER_WEIGHTS)
    assert sorted(from_parts) == sorted(loaded) == sorted(EagleHead.LAYER_WEIGHTS)
    for name, tensor in loaded.items():
        assert torch.equal(from_parts[name].to(tensor.dtype), tensor), name

    cfg = config(files, tmp_path / "run", init_layer=3)
    head = initial_head(cfg, whole)
    head.start_as_target_layer(target_layer_weights(parts, 3, EagleHead.LAYER_WEIGHTS), 3)
    assert torch.equal(head.midlayer.mlp.down_proj.weight,
                       whole.layers[3].mlp.down_proj.weight.float())
    with pytest.raises(ValueError, match="'init_layer' applies to EAGLE-3 only"):
        config(files, tmp_path / "run", version=1, init_layer=3)
