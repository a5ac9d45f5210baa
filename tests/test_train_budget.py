"""scripts/train_budget.py: a recipe trained for a wall-time budget (the recipe sweeps and the peer
comparison): probe, plan, and a run the deadline stops, whose artifact is still written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from test_train_eagle import arguments, files  # noqa: F401 (files: the module's fixture)

pytestmark = pytest.mark.usefixtures("trainer_env")

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "train_budget.py"
_SPEC = importlib.util.spec_from_file_location("train_budget", _PATH)
budget = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(budget)


def test_a_run_past_its_deadline_is_stopped_saved_and_its_artifact_written(
        files, tmp_path, monkeypatch):  # noqa: F811 (the fixture)
    trainer_args = [a for a in arguments(files, tmp_path / "unused", eval_every=0)]
    for key in ("--output_dir", "--max_steps", "--save_every", "--log_every"):
        at = trainer_args.index(key)
        del trainer_args[at:at + 2]
    planned = {}
    plan = budget.steps_for_budget

    def too_many(step_seconds, probe_seconds, seconds, **kwargs):  # more than the budget holds
        planned.update(plan(step_seconds, probe_seconds, seconds, **kwargs))
        return {**planned, "steps": 100_000}

    monkeypatch.setattr(budget, "steps_for_budget", too_many)
    record = budget.train_for(0.3, tmp_path / "run", "eagle", trainer_args, probe_steps=3)
    saved = json.loads((tmp_path / "run" / "budget.json").read_text())
    assert saved == record and record["stopped_at_deadline"] is True
    assert planned["steps"] >= 1 and planned["step_seconds"] > 0
    assert 0 < record["steps"] < 100_000 and record["tokens"] > 0
    assert record["train_seconds"] < 18 + budget.GRACE  # stopped at 18 s, not at 100k steps
    assert (Path(record["artifact"]) / "config.json").is_file()
    last = [json.loads(line) for line in
            (tmp_path / "run" / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == record["steps"]

    with pytest.raises(ValueError, match="exists: train_budget starts a run from nothing"):
        budget.train_for(0.3, tmp_path / "run", "eagle", trainer_args)
    with pytest.raises(ValueError, match="--trainer 'eagles'"):
        budget.train_for(0.3, tmp_path / "other", "eagles", trainer_args)
