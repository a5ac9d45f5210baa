"""train/dflash.py on a tiny random target: the draft learns, the target stays, a resumed run
continues exactly, and every serving layout of the artifact loads back to the same draft."""

from __future__ import annotations

import json
import random

import pytest
import test_sharding as sharding
import torch
from safetensors.torch import load_file
from test_train_eagle import conversation, save_tiny_target, write_jsonl

from draftsmith.heads.dflash import load_dflash
from draftsmith.layouts.dflash import load_block_draft
from draftsmith.layouts.export import export
from draftsmith.layouts.export import main as export_main
from draftsmith.targets.target import load_target
from draftsmith.train.config import parse_config
from draftsmith.train.dflash import DFlashTrainConfig, main

pytestmark = pytest.mark.usefixtures("trainer_env")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    tokenizer = load_target("smollm2-135m").tokenizer
    rng = random.Random(0)
    rows = [conversation(rng, rng.randint(3, 8), rng.randint(10, 18)) for _ in range(16)]
    used = set()
    for row in rows:
        used.update(tokenizer.apply_chat_template(row["messages"], tokenize=True,
                                                  return_dict=False))
    prompts = root / "eval.jsonl"
    prompts.write_text('{"turns": ["the cat sat on the mat"]}\n')
    used.update(tokenizer.apply_chat_template([{"role": "user", "content": "the cat sat on the "
                                                "mat"}], tokenize=True, return_dict=False,
                                              add_generation_prompt=True))
    target = save_tiny_target(root / "target", tokenizer, used)
    return {"root": root, "target": str(target), "data": write_jsonl(root / "d.jsonl", rows),
            "eval": str(prompts)}


def config(files, out, **overrides) -> DFlashTrainConfig:
    values = dict(config="configs/dflash/tiny.yaml", target=files["target"], data=files["data"],
                  output_dir=str(out), draft_vocab_size=256, target_layer_ids="0,2",
                  max_length=64, per_device_batch_size=4, max_steps=4, warmup_steps=1,
                  learning_rate=5e-3, save_every=2, keep_checkpoints="none", eval_every=2,
                  eval_prompts=files["eval"], eval_num_prompts=1, eval_max_new_tokens=8,
                  lr_schedule="constant", seed=3)
    values.update(overrides)
    argv = []
    for key, value in values.items():
        argv += [f"--{key}", str(value)]
    return parse_config(DFlashTrainConfig, argv)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_run_trains_resumes_exactly_and_exports(files, tmp_path, method):
    whole = main(config(files, tmp_path / "whole", method=method))
    assert whole["step"] == 4 and whole["artifact"] is not None
    target = whole["target"]
    draft = load_dflash(whole["artifact"], target)
    assert draft.method == method
    # stopped at step 2, resumed: the same weights at the end
    main(config(files, tmp_path / "part", method=method, max_steps=2))
    main(config(files, tmp_path / "part", method=method, resume="latest"))
    a = load_file(str(tmp_path / "whole/artifact/model.safetensors"))
    b = load_file(str(tmp_path / "part/artifact/model.safetensors"))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # every layout but gguf (served in tests/test_llama_cpp.py) reads back to the same draft
    for fmt in ("vllm", "sglang", "speculators"):
        extra = {"verifier": "org/tiny", "target": target} if fmt == "speculators" else {}
        out = export(whole["artifact"], fmt, tmp_path / fmt, **extra)
        back = load_block_draft(out, target)
        for (name, x), y in zip(draft.state_dict().items(), back.state_dict().values(),
                                strict=True):
            assert torch.equal(x, y), (fmt, name)
    assert export_main([str(whole["artifact"]), "--format", "vllm", "--out",
                        str(tmp_path / "checked"), "--check"]) == 0


def test_the_draft_learns_and_the_target_stays(files, tmp_path):
    first = main(config(files, tmp_path / "a", max_steps=1, eval_every=0))
    later = main(config(files, tmp_path / "b", max_steps=30, eval_every=0, save_every=0))
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "b/metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses[-1] < 0.7 * losses[0], losses
    target = later["target"]
    reference = load_target(files["target"])
    for (name, p), q in zip(target.model.named_parameters(), reference.model.parameters(),
                            strict=True):
        assert torch.equal(p, q), name
    assert first["artifact"] is not None


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_online_and_offline_features_give_the_same_first_step(files, tmp_path, method):
    common = dict(method=method, max_steps=1, eval_every=0, save_every=0, soft_weight=0.5)
    main(config(files, tmp_path / "online", **common))
    main(config(files, tmp_path / "offline", feature_mode="offline", feature_dtype="fp32",
                feature_cache_dir=str(tmp_path / "cache"), **common))
    again = main(config(files, tmp_path / "again", feature_mode="offline", feature_dtype="fp32",
                        feature_cache_dir=str(tmp_path / "cache"), **common))
    assert again["target"].layers[0].self_attn.q_proj.weight.is_meta  # the cache alone
    first = [json.loads(line) for line in (tmp_path / "online/metrics.jsonl").read_text()
             .splitlines() if '"loss"' in line][0]
    for run in ("offline", "again"):
        other = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text()
                 .splitlines() if '"loss"' in line][0]
        assert other["loss"] == pytest.approx(first["loss"], rel=1e-5), run


def test_sharded_target_and_fsdp2_draft_train_the_one_process_steps(files, tmp_path):
    """torchrun, 2 CPU processes: the block draft under FSDP2 (launched as with
    configs/accelerate/fsdp2.yaml) with the target's layers sharded over both trains the steps
    one process trains, and the artifact holds the same gathered weights. Every scored position
    is an anchor (anchors >= the rows' length), so no block depends on how rows are split."""
    common = dict(max_steps=2, eval_every=0, save_every=0, anchors=64)
    main(config(files, tmp_path / "one", per_device_batch_size=4, **common))
    sharding.torchrun("train/dflash.py", config(files, tmp_path / "fsdp2", target_parallel=2,
                                                per_device_batch_size=2, **common), fsdp2=True)
    sharding.assert_same_steps(sharding.losses(tmp_path / "one"),
                               sharding.losses(tmp_path / "fsdp2"))
    a = load_file(str(tmp_path / "one/artifact/model.safetensors"))
    b = load_file(str(tmp_path / "fsdp2/artifact/model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_benchmark_sizes_blocks_and_decodes_exactly(files, tmp_path):
    from draftsmith.eval import bench

    run = main(config(files, tmp_path / "run", max_steps=6, eval_every=0, save_every=0))
    records = bench.main(["--target", files["target"], "--method", "plain", "--method",
                          f"dflash:{run['artifact']}", "--prompts", files["eval"],
                          "--tree-calibration-prompts", files["eval"], "--max-new-tokens", "12",
                          "--warmup", "0", "--no-progress"])
    record = records[-1]
    assert record["greedy_identical"] is True
    assert 1 <= record["tree"]["tokens_per_round"] <= 3  # a block of 4: at most 3 drafts
    again = bench.main(["--target", files["target"], "--method", f"dflash:{run['artifact']}",
                        "--prompts", files["eval"], "--tree-calibration-prompts", files["eval"],
                        "--max-new-tokens", "12", "--warmup", "0", "--no-progress"])
    assert again[-1]["tree"]["measured_now"] is False  # kept in the artifact's calibration
