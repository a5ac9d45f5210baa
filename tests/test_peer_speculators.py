"""scripts/peer_speculators.py's arithmetic: the step budget from a probe, the packing budget that
fits the memory, the run summaries (the pipeline itself is scripts/peer_speculators.sh, run end to
end by hand: it trains for minutes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "peer_speculators.py"
_SPEC = importlib.util.spec_from_file_location("peer_speculators", _PATH)
peer = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(peer)


def _jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_plan_from_our_metrics(tmp_path):
    # draftsmith's metrics.jsonl: cumulative real tokens and tokens/s of each logged step
    metrics = _jsonl(tmp_path / "m.jsonl", [
        {"step": 0, "data/rows": 64},
        {"step": 1, "tokens": 3000, "tokens_per_s": 100.0},  # 30 s, warm-up included
        {"step": 2, "tokens": 5000, "tokens_per_s": 200.0},  # 10 s
        {"step": 3, "tokens": 8000, "tokens_per_s": 100.0},  # 30 s
    ])
    assert peer.step_seconds("ours", metrics) == pytest.approx([30, 10, 30])
    # a step is the later half's mean, 20 s; the start-up 100 - 3 x 20 = 40 s: (600 - 40) / 20
    assert peer.plan("ours", metrics, seconds=100, budget=600,
                     record=str(tmp_path / "p.json")) == 28
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["startup_seconds"] == 40 and saved["step_seconds"] == 20 and saved["steps"] == 28


def test_plan_from_speculators_metrics(tmp_path):
    # speculators_cpu.py's lines: the time each step's record was logged (+ its hparams record)
    metrics = _jsonl(tmp_path / "m.jsonl", [
        {"time": 100.0, "train": {"loss": 1.0}, "global_step": 0},
        {"time": 150.0, "train": {"loss": 1.0}, "global_step": 1},
        {"time": 190.0, "train": {"loss": 1.0}, "global_step": 2},
        {"time": 200.0, "val": {"loss_epoch": 1.0}},
    ])
    assert peer.step_seconds("speculators", metrics) == [50, 40]
    # the first record came after start-up and one step: a step 40 s (the later half), start-up
    # 200 - 3 x 40 = 80 s
    assert peer.plan("speculators", metrics, seconds=200, budget=480) == 10
    assert peer.plan("speculators", metrics, seconds=200, budget=479) == 9


def test_plan_refuses_a_budget_that_fits_no_step(tmp_path):
    metrics = _jsonl(tmp_path / "m.jsonl", [
        {"step": k, "tokens": 1000 * k, "tokens_per_s": 10.0} for k in (1, 2, 3)])
    with pytest.raises(ValueError, match="fits no ours step.*give it more time"):
        peer.plan("ours", metrics, seconds=400, budget=150)  # start-up 100 s, a step 100 s
    with pytest.raises(ValueError, match="logged 1 steps.*give it more steps"):
        peer.plan("ours", _jsonl(tmp_path / "one.jsonl", [
            {"step": 1, "tokens": 10, "tokens_per_s": 1.0}]), seconds=20, budget=100)
    with pytest.raises(FileNotFoundError, match="wrote none"):
        peer.plan("ours", str(tmp_path / "missing.jsonl"), seconds=1, budget=1)


def test_packing_budget_halves_until_the_losses_fit():
    gib = 2**30
    assert peer.seq_len_that_fits(8192, 49152, 3, None) == 8192  # memory unknown: as asked
    assert peer.seq_len_that_fits(8192, 49152, 3, 64 * gib) == 8192
    assert peer.seq_len_that_fits(8192, 49152, 3, 22 * gib) == 4096  # a 24 GiB machine
    assert peer.seq_len_that_fits(8192, 49152, 3, 8 * gib) == 2048
    assert peer.seq_len_that_fits(8192, 49152, 3, 1 * gib) == 512  # never below


def test_summaries_of_finished_runs(tmp_path):
    ours = _jsonl(tmp_path / "ours.jsonl", [
        {"step": 0}, {"step": 5, "tokens": 9000, "tokens_per_s": 50.0, "acc_0": 0.25}])
    assert peer.summary("ours", ours) == {"steps": 5, "tokens": 9000,
                                          "last_step_top1": {"acc_0": 0.25}}
    theirs = _jsonl(tmp_path / "theirs.jsonl", [
        {"time": 1.0, "global_step": 0, "train": {"full_acc_0": 0.1, "loss": 2.0},
         "profile": {"tokens_per_s": 100.0, "step_ms": 2000.0}},
        {"time": 3.0, "global_step": 1, "train": {"full_acc_0": 0.2, "loss": 1.0},
         "profile": {"tokens_per_s": 50.0, "step_ms": 4000.0}}])
    assert peer.summary("speculators", theirs) == {"steps": 2, "tokens": 400,
                                                   "last_step_top1": {"full_acc_0": 0.2}}
