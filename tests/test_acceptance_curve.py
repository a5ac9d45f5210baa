"""scripts/acceptance_curve.py: held-out acceptance against minutes of training, read from a run's
metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "acceptance_curve.py"
_SPEC = importlib.util.spec_from_file_location("acceptance_curve", _PATH)
acceptance_curve = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(acceptance_curve)


def _run(tmp_path: Path, records: list[dict]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.yaml").write_text("eval_num_prompts: 8\ntree_nodes: 32\nlearning_rate: 0.001\n")
    return run


def test_minutes_count_training_windows_and_evaluations_apart(tmp_path):
    run = _run(tmp_path, [
        {"step": 0, "data/rows": 10},
        {"step": 0, "eval/tau": 1.1, "eval/alpha": 0.1, "eval/alpha_depth_1": 0.1,
         "eval/seconds": 30.0},
        {"step": 10, "tokens": 6000, "tokens_per_s": 100.0, "epoch": 0.5},  # 60 s
        {"step": 20, "tokens": 9000, "tokens_per_s": 50.0, "epoch": 1.0},  # 60 s
        {"step": 20, "eval/tau": 1.8, "eval/alpha": 0.5, "eval/alpha_depth_1": 0.6,
         "eval/seconds": 90.0},
    ])
    report = acceptance_curve.main([str(run), "--out", str(tmp_path / "curve.json")])
    assert report["points"] == [
        {"step": 0, "tokens": 0, "epoch": 0.0, "train_minutes": 0.0, "eval_minutes": 0.5,
         "tau": 1.1, "alpha": 0.1, "alpha_depth_1": 0.1},
        {"step": 20, "tokens": 9000, "epoch": 1.0, "train_minutes": 2.0, "eval_minutes": 2.0,
         "tau": 1.8, "alpha": 0.5, "alpha_depth_1": 0.6},
    ]
    assert report["settings"]["eval_num_prompts"] == 8 and report["settings"]["tree_nodes"] == 32
    assert json.loads((tmp_path / "curve.json").read_text()) == report


def test_a_run_without_acceptance_or_metrics_is_named(tmp_path):
    run = _run(tmp_path, [{"step": 10, "tokens": 10, "tokens_per_s": 1.0}])
    with pytest.raises(ValueError, match="no eval/tau record.*eval_every 0"):
        acceptance_curve.curve(run)
    with pytest.raises(FileNotFoundError, match="training run's output_dir"):
        acceptance_curve.curve(tmp_path / "missing")
