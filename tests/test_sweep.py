"""scripts/sweep.py: a data-size point trains on a seeded sample of the sweep's rows."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "sweep.py"
_SPEC = importlib.util.spec_from_file_location("sweep", _PATH)
sweep = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sweep)


def _rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"a{i}"}]} for i in range(n)]


def test_a_rows_point_samples_the_sweeps_data_the_same_way_each_time(tmp_path):
    source = tmp_path / "answers.jsonl.gz"
    with gzip.open(source, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in _rows(50)) + "\n")  # a blank last line
    spec = {"config": "configs/eagle/smollm2-135m.yaml", "base": ["--data", str(source)],
            "points": {"rows7": {"rows": 7}, "all": []}}
    overrides, sample = sweep._overrides(spec, "rows7", tmp_path / "sweep" / "rows7", None)
    written = Path(sample["file"])
    assert overrides == ["--data", str(written)] and written.parent == tmp_path / "sweep"
    assert sample == {"rows": 7, "of": 50, "sampled_from": str(source), "seed": 0,
                      "file": str(written)}
    drawn = [json.loads(line) for line in written.read_text().splitlines()]
    assert len(drawn) == 7 and len({r["messages"][0]["content"] for r in drawn}) == 7
    order = [int(r["messages"][0]["content"][1:]) for r in drawn]
    assert order == sorted(order) and all(r in _rows(50) for r in drawn)
    first = written.read_bytes()
    sweep._overrides(spec, "rows7", tmp_path / "sweep" / "rows7", None)
    assert written.read_bytes() == first  # a rerun of the sweep trains on the same rows
    assert sweep._overrides(spec, "all", tmp_path / "sweep" / "all", None) == ([], {})
    # a rows point may carry more overrides: the same rows, the overrides after the data
    spec["points"]["rows7-offline"] = {"rows": 7, "args": ["--feature_mode", "offline"]}
    overrides, other = sweep._overrides(spec, "rows7-offline", tmp_path / "sweep" / "x", None)
    assert overrides == ["--data", other["file"], "--feature_mode", "offline"]
    assert Path(other["file"]).read_bytes() == first

    with pytest.raises(ValueError, match="cannot sample 51 rows of .* it has 50"):
        sweep.sample_rows(source, 51, tmp_path / "too_many.jsonl")


def test_the_data_size_sweep_samples_the_shipped_recipes_data():
    spec = sweep.SWEEPS["eagle3-shipped"]
    assert sweep._data_of(spec["base"], spec["config"]) == \
        "data/train/selfdistill9k_answers.jsonl.gz"
    assert sweep._data_of([], spec["config"]) == "data/train/selfdistill9k_answers.jsonl.gz"
