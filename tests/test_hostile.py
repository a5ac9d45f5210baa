"""What a careful or hostile user found (issue 23): each fault is a test that failed before its
fix. No command overwrites what it read or a directory it did not write; no training goes silently
wrong; every user error is one line naming the file or key and the fix, exit status 2.

The tree calibration's faults (a damaged tree_calibration.json, the calibration's budget) are in
tests/test_tree_auto.py, beside its fixtures.
"""

from __future__ import annotations

import copy
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_checkpoints
import torch
from safetensors.torch import load_file, save_file
from test_checkpoints import run, steps_of
from test_target import llama, save_model_dir

from draftsmith.heads.artifact import load_artifact, save_artifact
from draftsmith.heads.artifact import main as artifact_main
from draftsmith.targets.target import load_target, wrap_target

REPO = Path(__file__).resolve().parents[1]
one_thread = test_checkpoints.one_thread  # the toy trainer fixture is conftest's


def artifact(path: Path, value: float = 1.0, **config) -> Path:
    weights = {"fc.weight": torch.full((4, 4), value), "d2t": torch.arange(3)}
    return save_artifact(path, "eagle3", {"hidden_size": 4, **config}, weights, {"name": "tiny"})


def snapshot(directory: Path) -> dict:
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


# ------------------------------------------------------------------------------------------------
# Data lost


def test_1_regenerate_refuses_a_foreign_out_file_before_touching_it(tmp_path):
    from draftsmith.train.regenerate import regenerate

    prompts = [[{"role": "user", "content": "hi"}]]
    mine = tmp_path / "mine.json"
    mine.write_text('{\n  "a": 1,\n  "b": [1, 2]\n}')  # a user's JSON, no final newline
    binary = tmp_path / "blob.jsonl"
    binary.write_bytes(b'{"messages": []}\n\xff\xfe\x00binary')
    for path in (mine, binary):
        before = path.read_bytes()
        with pytest.raises(ValueError, match=rf"{path.name}.* not .*regenerate wrote.*--out"):
            regenerate(object(), prompts, path, progress=False)
        assert path.read_bytes() == before
    data = tmp_path / "data.jsonl"  # nor into the file its prompts come from
    data.write_text(json.dumps({"messages": prompts[0]}) + "\n")
    with pytest.raises(ValueError, match="an input of this operation"):
        regenerate(object(), [str(data)], data, progress=False)
    assert data.read_text() == json.dumps({"messages": prompts[0]}) + "\n"


def test_2_cast_never_replaces_another_runs_artifact(tmp_path):
    from draftsmith.heads.artifact import cast_artifact

    source = artifact(tmp_path / "runA" / "artifact", 1.0)
    other = artifact(tmp_path / "runB" / "artifact", 2.0)
    before = snapshot(other)
    with pytest.raises(ValueError, match="another draftsmith artifact.*--overwrite"):
        cast_artifact(source, other, torch.bfloat16)
    assert snapshot(other) == before
    copy_dir = cast_artifact(source, tmp_path / "bf16", torch.bfloat16)
    assert cast_artifact(source, copy_dir, torch.float16) == copy_dir  # an earlier cast of it
    assert load_artifact(copy_dir)[1]["fc.weight"].dtype == torch.float16


def test_3_cast_never_deletes_its_source_or_a_directory_holding_it(tmp_path, capsys):
    source = artifact(tmp_path / "runA" / "artifact")
    (tmp_path / "runA" / "metrics.jsonl").write_text("{}\n")
    before = snapshot(tmp_path / "runA")
    for out in (tmp_path / "runA", source / "inner"):
        assert artifact_main(["cast", str(source), str(out), "--dtype", "bf16",
                              "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "an input of this operation" in err, err
    assert snapshot(tmp_path / "runA") == before


def test_4_cast_of_a_medusa2_artifact_copies_its_adapted_target(tmp_path):
    from draftsmith.heads.artifact import cast_artifact

    source = tmp_path / "run" / "artifact"
    save_artifact(source, "medusa", {"base_model": str((source / "target").resolve()),
                                     "adapted_target": {"path": "target", "digest": "d"}},
                  {"w": torch.ones(2, 2)}, {"name": "tiny"})
    (source / "target").mkdir()
    (source / "target" / "config.json").write_text('{"model_type": "llama"}')
    out = cast_artifact(source, tmp_path / "copy", torch.bfloat16)
    assert (out / "target" / "config.json").read_text() == '{"model_type": "llama"}'
    config, _ = load_artifact(out)
    assert config["base_model"] == str((out / "target").resolve())


def test_5_a_report_path_onto_an_input_is_refused_before_the_run(tmp_path):
    from draftsmith.eval.report import check_report_out
    from draftsmith.files.output_dir import named_paths

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    head = artifact(tmp_path / "head")
    inputs = named_paths(str(prompts), f"eagle:{head}", f"medusa:typical:{head}", "plain")
    assert inputs == [prompts.resolve(), head.resolve()]
    for out in (prompts, head / "config.json", head):
        with pytest.raises(ValueError, match="an input of this operation"):
            check_report_out(out, inputs=inputs)
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    with pytest.raises(ValueError, match="not an earlier draftsmith.eval.bench report.*--overwrite"):
        check_report_out(mine, inputs=inputs)
    assert check_report_out(tmp_path / "new.json", inputs=inputs) == (tmp_path / "new.json")


def test_5_bench_out_onto_its_prompts_file_is_refused(tmp_path):
    from draftsmith.eval.bench import parse_args

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    with pytest.raises(SystemExit) as stop:
        parse_args(["--target", "smollm2-135m", "--method", "plain", "--prompts", str(prompts),
                    "--out", str(prompts)])
    assert stop.value.code == 2


def test_6_report_never_replaces_its_metrics_input(tmp_path, capsys):
    from draftsmith.eval.report import main as report_main

    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1, "loss": 2.0}\n')
    bench = REPO / "reports" / "demo_bench.json"
    with pytest.raises(SystemExit) as stop:
        report_main([str(bench), "--metrics", str(metrics), "--out", str(metrics)])
    assert stop.value.code == 2 and "an input of this operation" in capsys.readouterr().err
    assert metrics.read_text() == '{"step": 1, "loss": 2.0}\n'


def test_7_a_users_config_yaml_in_output_dir_is_never_replaced(toy, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("# my notes\nlearning_rate: 0.01\n")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="config.yaml that draftsmith did not write"):
            run(toy, out, overwrite=overwrite)
    assert (out / "config.yaml").read_text() == "# my notes\nlearning_rate: 0.01\n"
    # inputs inside what the run writes are refused too (a data file named metrics.jsonl)
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="an input of this operation"):
        run(toy, other, data=[str(other / "metrics.jsonl")], overwrite=True)


# ------------------------------------------------------------------------------------------------
# Silently wrong


def test_8_distillation_weights_count_long_int8_masks_exactly():
    from draftsmith.train.distill import planned_sizes

    mask = torch.ones(200, dtype=torch.int8)  # an int8 sum of 200 ones is -56
    rows = [{"prompt_ids": torch.zeros(5, dtype=torch.int32),
             "input_ids": torch.zeros(205, dtype=torch.int32),
             "loss_mask": torch.cat([torch.zeros(5, dtype=torch.int8), mask]), "answered": True}]
    cfg = SimpleNamespace(max_length=512, on_policy_max_new_tokens=16, on_policy_ratio=0.0)
    assert planned_sizes(rows, cfg) == ([205], [200])

    from draftsmith.train.batches import scored_tokens

    assert scored_tokens(mask) == scored_tokens(mask.tolist()) == 200


def test_9_a_change_to_any_single_layer_is_caught(tmp_path):
    from draftsmith.heads.medusa import MedusaHeads, load_medusa, save_medusa

    base = llama(layers=4)
    target = wrap_target(base, name="t")
    recorded = target.identity()
    heads = MedusaHeads.from_target(target, num_heads=1)
    save_medusa(tmp_path / "medusa", heads, target)
    for name, _ in base.named_parameters():
        changed = copy.deepcopy(base)
        with torch.no_grad():  # one value, anywhere: every layer, the embedding, the final norm
            dict(changed.named_parameters())[name].view(-1)[0] *= 0.5
        other = wrap_target(changed, name="t")
        with pytest.raises(ValueError, match="other weights"):
            other.check_identity(recorded)
    layer0 = copy.deepcopy(base)
    with torch.no_grad():
        layer0.model.layers[0].self_attn.q_proj.weight.mul_(0.5)  # not the sampled middle layer
    with pytest.raises(ValueError, match="other weights"):
        load_medusa(tmp_path / "medusa", wrap_target(layer0, name="t"))
    load_medusa(tmp_path / "medusa", wrap_target(copy.deepcopy(base).to(torch.bfloat16)))


def test_9_the_full_digest_is_computed_once_per_target_directory(tmp_path, monkeypatch):
    from draftsmith.targets import target as target_module

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    directory = save_model_dir(tmp_path / "model", llama())
    first = load_target(str(directory), device="cpu").identity()
    assert len(first["weights_digest"]) == 64  # every weight, beside the sampled fingerprint
    assert list((tmp_path / "cache" / "weights-digests").iterdir())  # kept for the next load
    calls = []
    monkeypatch.setattr(target_module, "weights_digest", lambda *a: calls.append(a) or "x")
    assert load_target(str(directory), device="cpu").identity() == first and not calls
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 0.5
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert load_target(str(directory), device="cpu").identity()["weights_digest"] == "x"


@pytest.mark.slow
def test_9_artifacts_with_only_the_old_fingerprint_still_load(tmp_path):
    from draftsmith.heads.eagle import load_eagle
    from draftsmith.heads.medusa import load_medusa

    target = load_target("smollm2-135m", device="cpu")
    for name, load in (("eagle3", load_eagle), ("medusa", load_medusa)):
        # an artifact written before weights_digest existed records only the sampled fingerprint:
        # the shipped heads, with the digest taken out of those trained since
        directory = tmp_path / name
        shutil.copytree(REPO / "artifacts" / "smollm2-135m" / name, directory)
        config = json.loads((directory / "config.json").read_text())
        config["target"].pop("weights_digest", None)
        assert "weights_fingerprint" in config["target"]
        (directory / "config.json").write_text(json.dumps(config))
        load(directory, target)


def test_10_no_artifact_or_checkpoint_from_diverged_weights(toy, tmp_path, monkeypatch):
    from draftsmith.train import loop

    with pytest.raises(ValueError, match=r"'learning_rate' must be in \(0, 1\], got 1e\+30 "
                                         r"\(AdamW moves every weight"):
        test_checkpoints.parse_config(toy.ToyConfig, ["--learning_rate", "1e30"])
    with pytest.raises(ValueError, match=r"NaN or infinite values \(fc.weight\)"):
        artifact(tmp_path / "nan", float("nan"))
    assert not (tmp_path / "nan").exists()

    from draftsmith.heads.artifact import NonFiniteWeights

    # the loss guard off: the weights themselves are checked before a checkpoint is written
    monkeypatch.setattr(loop, "_check_finite", lambda *a: None)
    with pytest.raises(NonFiniteWeights, match="checkpoint step_2 was not saved"):
        run(toy, tmp_path / "run", nan_from_step=1)
    assert steps_of(tmp_path / "run") == []


def test_11_an_artifact_config_of_the_wrong_type_exports_nothing(tmp_path, capsys):
    from draftsmith.heads.eagle import EagleHead, save_eagle
    from draftsmith.heads.eagle_config import EagleConfig
    from draftsmith.layouts.export import main as export_main

    target = wrap_target(llama(), name="t")
    torch.manual_seed(0)
    path = save_eagle(EagleHead(EagleConfig.from_target(target, 1), target), tmp_path / "e", target)
    config = json.loads((path / "config.json").read_text())
    config["num_attention_heads"] = "nine"
    (path / "config.json").write_text(json.dumps(config))
    for extra in ([], ["--check"]):
        out = tmp_path / f"vllm{len(extra)}"
        assert export_main([str(path), "--format", "vllm", "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert "num_attention_heads must be an integer >= 1, got 'nine'" in err
        assert not out.exists()


# ------------------------------------------------------------------------------------------------
# Unclear errors and crashes


def test_12_resume_latest_after_a_kill_before_the_first_checkpoint_starts_fresh(toy, tmp_path):
    out = tmp_path / "run"
    settings = dict(max_steps=2, eval_every=2, eval_num_prompts=1, eval_max_new_tokens=2)
    run(toy, out, **settings)
    for leftover in ("checkpoints", "artifact"):  # what a kill before step 2 leaves: no results
        test_checkpoints.shutil.rmtree(out / leftover)
    assert run(toy, out, resume="latest", **settings)["step"] == 2
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(0) == 1  # restarting does not double the step-0 record
    for leftover in ("checkpoints", "artifact"):
        test_checkpoints.shutil.rmtree(out / leftover)
    with pytest.raises(ValueError, match="holds the results of an earlier run"):
        run(toy, out, resume="latest", **{**settings, "learning_rate": 0.05})  # another run's


def test_13_a_checkpoint_with_nan_weights_is_damaged_and_the_previous_one_offered(toy, tmp_path):
    out = tmp_path / "run"
    run(toy, out, max_steps=4)
    weights = out / "checkpoints" / "step_4" / "model.safetensors"
    tensors = {k: torch.full_like(v, float("nan")) for k, v in load_file(weights).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"step_4 is damaged: .*NaN or infinite.*--resume "
                                         r"previous .*step_2"):
        run(toy, out, max_steps=6, resume="latest")


def test_15_a_damaged_tokenisation_cache_is_named_and_rebuilt(toy, tmp_path, capsys, monkeypatch):
    import datasets

    from draftsmith.train.rows import load_sft_dataset

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}) + "\n"
        for i in range(3)))
    tokenizer = toy.byte_tokenizer()
    cache = tmp_path / "cache"
    expected = load_sft_dataset(str(rows), tokenizer, cache_dir=cache)[0]["input_ids"]
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    arrow = next(entry.rglob("*.arrow"))
    for damage in (lambda: (entry / "report.json").write_text("{not json"),
                   lambda: arrow.write_bytes(b"garbage")):
        damage()
        dataset, _ = load_sft_dataset(str(rows), tokenizer, cache_dir=cache)
        assert dataset["input_ids"] == expected
        assert f"the tokenisation cache {entry} is damaged" in capsys.readouterr().err
    # a tokenisation interrupted while writing leaves nothing beside the cache
    test_checkpoints.shutil.rmtree(entry)

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_sft_dataset(str(rows), tokenizer, cache_dir=cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_16_a_data_file_whose_name_holds_a_comma_is_one_file(toy, tmp_path):
    path = tmp_path / "x,y.jsonl"
    path.write_text("{}\n")
    cfg = test_checkpoints.parse_config(toy.ToyConfig, ["--data", str(path)])
    assert cfg.data == [str(path)]
    assert test_checkpoints.parse_config(toy.ToyConfig, ["--data", "a.jsonl,b.jsonl"]).data == [
        "a.jsonl", "b.jsonl"]


@pytest.mark.parametrize("key", ["adam_beta1", "adam_beta2"])
def test_17_adam_betas_of_one_are_refused_at_parse(toy, key):
    with pytest.raises(ValueError, match=rf"'{key}' must be in \[0, 1\), got 1.0 \(a moving-"):
        test_checkpoints.parse_config(toy.ToyConfig, [f"--{key}", "1"])


def test_18_resume_with_the_same_data_spelled_otherwise(toy, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("rows.jsonl").write_text("{}\n")
    out = tmp_path / "run"
    run(toy, out, data=["rows.jsonl"], stop_after=2)
    for spelling in (str(tmp_path / "rows.jsonl"), "./rows.jsonl"):
        assert run(toy, out, data=[spelling], resume="latest", stop_after=1)["step"] >= 3
    with pytest.raises(ValueError, match="'data' changed"):
        Path("other.jsonl").write_text("{}\n")
        run(toy, out, data=["other.jsonl"], resume="latest")


# ------------------------------------------------------------------------------------------------
# Also


def test_an_export_killed_mid_write_leaves_nothing_after_the_next_write(tmp_path):
    from draftsmith.files.output_dir import write_dir

    out = tmp_path / "export"
    script = (f"import os, signal\nfrom draftsmith.files.output_dir import write_dir\n"
              f"def fill(tmp):\n    (tmp / 'a').write_text('x')\n"
              f"    os.kill(os.getpid(), signal.SIGKILL)\n"
              f"write_dir({str(out)!r}, fill, kind='export')\n")
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=False,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    assert [p.name for p in tmp_path.iterdir()][0].startswith(".export.tmp-")  # what it left
    write_dir(out, lambda tmp: (tmp / "b").write_text("y"), kind="export")
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_printed_commands_are_shell_quoted():
    from draftsmith.files.command_line import shell_command

    assert shell_command("python", "-m", "draftsmith.eval.bench", "--method", "eagle:/my runs/a'b") == \
        "python -m draftsmith.eval.bench --method 'eagle:/my runs/a'\"'\"'b'"
    for trainer in ("eagle", "medusa", "distill"):
        source = (REPO / "train" / f"{trainer}.py").read_text()
        assert "python -m draftsmith.eval.bench --target {" not in source, trainer  # an unquoted f-string


@pytest.mark.parametrize("script, argv", [
    ("train/eagle.py", ["--no_such_key", "1"]),
    ("train/medusa.py", ["--adam_beta1", "1"]),
    ("train/distill.py", ["--learning_rate", "1e30"]),
    ("train/data.py", ["merge", "--out", "/nonexistent/answers.jsonl"]),
])
def test_trainer_and_train_data_errors_are_one_line_and_exit_2(script, argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / script), run_name="__main__")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and ": error: " in err, err
    assert "Traceback" not in err
