"""draftsmith.train.tracking: metrics.jsonl contents, aggregation, progress bar, W&B offline, acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.eval.draft import DraftModelProposer
from draftsmith.eval.engine import measure_acceptance
from draftsmith.eval.report import wandb_mode
from draftsmith.eval.sampling import SamplingParams
from draftsmith.train.accelerator import make_accelerator
from draftsmith.train.batches import BatchPlan
from draftsmith.train.checkpoints import TrainState, read_checkpoint_state
from draftsmith.train.config import config_from_dict
from draftsmith.train.optimizer import learning_rate
from draftsmith.train.tracking import (
    AcceptanceEval,
    MetricsLogger,
    resolve_prompts_file,
    rewind_jsonl,
)

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "tests" / "fixtures" / "toy_train.py"
BASE = dict(target="tiny-llama", mixed_precision="no", max_steps=6, per_device_batch_size=4,
            gradient_accumulation_steps=2, num_rows=20, warmup_steps=2, learning_rate=1e-2,
            save_every=0, log_every=1, eval_every=0)
PROMPTS = ["Write a haiku about checkpoints.", "What is 2 + 2?", "Name three colours."]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in PROMPTS))
    return path


def config(toy, out: Path, **overrides):
    return config_from_dict(toy.ToyConfig, {**BASE, "output_dir": str(out), **overrides})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def state(step: int, total: int = 10) -> TrainState:
    plan = BatchPlan([16] * 40, seed=0, per_device_batch_size=8)  # 5 steps of 8 rows an epoch
    return TrainState(step=step, total_steps=total, plan=plan, wandb_run_id="test",
                      rows_seen=8 * step, tokens_seen=8 * 16 * step)


def test_metrics_jsonl_holds_training_and_acceptance_records(toy, tmp_path, prompts_file, capsys):
    cfg = config(toy, tmp_path / "run", log_every=2, eval_every=3, eval_prompts=str(prompts_file),
                 eval_num_prompts=2, eval_max_new_tokens=6)
    result = toy.main(cfg)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/tau" in r]
    # where training starts (step 0), every eval_every steps and at the end
    assert [r["step"] for r in train] == [2, 4, 6] and [r["step"] for r in evals] == [0, 3, 6]
    for r in train:
        assert set(r) == {"step", "loss", "accuracy", "padding", "tokens_per_s", "lr",
                          "peak_memory_gb", "epoch", "samples", "tokens"}
        assert r["padding"] == 0.0 and r["tokens"] == 16 * r["samples"]  # rows of equal length
        assert r["loss"] > 0 and 0 <= r["accuracy"] <= 1 and r["tokens_per_s"] > 0
        assert r["lr"] == learning_rate(cfg, r["step"] - 1, 6)
        assert r["samples"] == 8 * r["step"] and r["epoch"] == r["step"] / 2
    for r in evals:
        assert r["eval/tau"] >= 1 and r["eval/seconds"] >= 0
        assert r["eval/alpha"] is None or 0 <= r["eval/alpha"] <= 1
        assert "eval/alpha_depth_1" in r

    # a logged value is the mean over the steps since the last log: compare with logging every step
    every = config(toy, tmp_path / "every", log_every=1)
    toy.main(every)
    per_step = {r["step"]: r for r in read_jsonl(tmp_path / "every" / "metrics.jsonl")}
    for r in train:
        losses = [per_step[r["step"] - 1]["loss"], per_step[r["step"]]["loss"]]
        assert r["loss"] == pytest.approx(sum(losses) / 2, rel=1e-12)

    # the final acceptance record is what the engine measures for the exported head
    weights = load_file(str(tmp_path / "run" / "artifact" / "model.safetensors"))
    head = toy.ToyHead(64, 259, 0.0, 0.0)
    head.load_state_dict(weights)
    target = toy.tiny_target(cfg.target)
    ids = [target.chat_ids(p) for p in PROMPTS[:2]]
    expected = measure_acceptance(target, toy.ToyProposer(head.eval(), target.num_layers), ids,
                                  max_new_tokens=6, params=SamplingParams(), seed=cfg.seed)
    assert evals[-1]["eval/tau"] == pytest.approx(expected["tau"])
    assert evals[-1]["eval/alpha"] == expected["alpha"]
    assert torch.equal(result["weights"]["proj.weight"], weights["proj.weight"])

    err = capsys.readouterr().err
    assert "loss=" in err and "accuracy=" in err and "tok/s=" in err  # the progress bar


def test_metrics_logger_aggregates_weighted_means_and_logs_on_schedule(toy, tmp_path):
    cfg = config(toy, tmp_path, log_every=2)
    accelerator = make_accelerator(cfg)
    metrics = MetricsLogger(accelerator, cfg, state(0))
    metrics.add("loss", torch.tensor(1.0))
    metrics.add("loss", torch.tensor(3.0))
    metrics.add("accuracy", torch.tensor(3), torch.tensor(4))
    metrics.count_tokens(torch.tensor(100))
    assert metrics.step(state(1), lr=0.5) is None  # not a logging step
    metrics.add("accuracy", 1, 6)
    metrics.count_tokens(50)
    record = metrics.step(state(2), lr=torch.tensor(0.25))
    assert record["loss"] == 2.0 and record["accuracy"] == pytest.approx(0.4)
    assert record["lr"] == 0.25 and record["tokens_per_s"] > 0
    assert record["epoch"] == 0.4 and record["samples"] == 16
    metrics.add("loss", 5.0)
    assert metrics.step(state(3), force=True)["loss"] == 5.0  # forced: a stop or the end
    metrics.log({"step": 3, "eval/tau": 2.5, "eval/alpha": None})
    metrics.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 3, 3]
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["eval/tau"] == 2.5


def test_a_resumed_logger_drops_records_past_its_step(toy, tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6))
                    + '{"step": 6, "lo')  # a line cut short by a crash
    cfg = config(toy, tmp_path)
    MetricsLogger(make_accelerator(cfg), cfg, state(3)).close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    rewind_jsonl(path, 0)
    assert path.read_text() == ""
    rewind_jsonl(tmp_path / "missing.jsonl", 3)  # nothing to do
    assert not (tmp_path / "missing.jsonl").exists()


def test_wandb_run_is_offline_in_the_output_dir_when_not_logged_in(toy, tmp_path, monkeypatch,
                                                                    capsys):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # not logged in
    assert wandb_mode() == "offline"
    out = tmp_path / "run"
    toy.main(config(toy, out, max_steps=2, report_to="wandb", run_name="toy-run"))
    run_id = read_checkpoint_state(out / "checkpoints" / "step_2")["wandb_run_id"]
    runs = list((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and any(runs[0].iterdir())
    said = capsys.readouterr().err
    assert "W&B: offline (not logged in to W&B)" in said and "wandb sync" in said
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai login user password " + "0" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_mode() == "online"  # logged in: W&B's own default
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode() == "online"  # a user's explicit choice wins


def test_acceptance_eval_leaves_the_training_random_state_alone(toy, tmp_path, prompts_file):
    cfg = config(toy, tmp_path, eval_every=5, eval_prompts=str(prompts_file), eval_num_prompts=1,
                 eval_max_new_tokens=4)
    accelerator = make_accelerator(cfg)
    target = toy.tiny_target(cfg.target)
    head = accelerator.prepare(toy.ToyHead(64, 259, 0.5, 0.1))
    metrics = MetricsLogger(accelerator, cfg, state(0))

    def noisy_proposer(module):
        torch.rand(5)  # a proposer that draws from the global RNG while being built
        assert not module.training
        # the target drafting for itself: greedy, so every draft token is accepted
        return DraftModelProposer(target.model, max_depth=2, min_confidence=0.0)

    evaluation = AcceptanceEval(accelerator, cfg, target, noisy_proposer)
    assert len(evaluation.prompts) == 1 and evaluation.prompts[0] == target.chat_ids(PROMPTS[0])
    assert evaluation.maybe_run(state(4), head, metrics) is None  # not due
    before = torch.get_rng_state()
    record = evaluation.maybe_run(state(5), head, metrics)
    # 4 new tokens: 1 from the prefill, then one round of 2 accepted drafts + 1 target token
    assert record["eval/tau"] == 3.0 and record["eval/alpha"] == 1.0
    assert record["eval/alpha_depth_1"] == record["eval/alpha_depth_2"] == 1.0
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1] == record
    assert torch.equal(torch.get_rng_state(), before)
    assert head.training  # back in training mode
    assert evaluation.maybe_run(state(10, total=10), head, metrics) is not None  # the end is due
    metrics.close()


def test_acceptance_eval_prompt_files(toy, tmp_path):
    assert resolve_prompts_file("data/eval/mt_bench_question.jsonl").is_file()  # from anywhere
    cfg = config(toy, tmp_path, eval_every=5, eval_prompts=str(tmp_path / "nope.jsonl"))
    accelerator = make_accelerator(cfg)
    target = toy.tiny_target(cfg.target)
    metrics = MetricsLogger(accelerator, cfg, state(0))
    with pytest.raises(FileNotFoundError, match="nope.jsonl.*eval_every 0"):
        AcceptanceEval(accelerator, cfg, target, lambda m: None)
    off = config(toy, tmp_path, eval_every=0, eval_prompts=str(tmp_path / "nope.jsonl"))
    assert AcceptanceEval(accelerator, off, target, lambda m: None).prompts == []
    metrics.close()
