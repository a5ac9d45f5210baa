"""The HTML report and W&B: every section, every image real, bad input told not thrown."""

from __future__ import annotations

import base64
import html
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from draftsmith.eval.acceptance import DepthCounts
from draftsmith.eval.prompts import Prompt
from draftsmith.eval.report import SECTIONS, announce_wandb_run, log_to_wandb, main, wandb_mode
from draftsmith.eval.summary import REPORT_FORMAT, REPORT_VERSION, MethodRuns, PromptRun, summarise

REPO = Path(__file__).resolve().parents[1]


def synthetic_report() -> dict:
    """A report as draftsmith.eval.bench writes it, from made-up runs: 6 prompts in 2 categories, 2 repeats."""
    rng = np.random.default_rng(0)
    prompts = [Prompt(f"p{i}", "writing" if i < 3 else "coding", i) for i in range(6)]

    def runs(speed: float, accepts: bool) -> list[list[PromptRun]]:
        out = []
        for _ in range(2):
            rep = []
            for _ in prompts:
                if accepts:
                    counts = DepthCounts()
                    lengths = [int(x) for x in rng.integers(0, 3, 10)]
                    for n in lengths:
                        counts.add_round(range(1, n + 1), range(1, min(n + 1, 2) + 1))
                    rep.append(PromptRun([1] * (11 + sum(lengths)), 1.0 / speed, 10, counts,
                                         lengths))
                else:
                    rep.append(PromptRun([1] * 21, float(rng.uniform(0.9, 1.1)), 20))
            out.append(rep)
        return out

    methods = [MethodRuns("hf", True, runs(1.0, False)), MethodRuns("pld", True, runs(1.4, True))]
    summary = summarise(methods, prompts, greedy=True)
    return {"format": REPORT_FORMAT, "version": REPORT_VERSION,
            "config": {"target": "tiny", "num_prompts": 6, "repeats": 2},
            "prompts": [{"id": p.id, "category": p.category} for p in prompts],
            "methods": summary["methods"], "categories": summary["categories"],
            "greedy_summary": "greedy equality: every method's output equals hf's token for token"}


def images(page: str) -> list[Image.Image]:
    found = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    return [Image.open(io.BytesIO(base64.b64decode(data))) for data in found]


def assert_real_image(image: Image.Image) -> None:
    image.load()
    assert image.width > 100 and image.height > 100
    pixels = np.asarray(image.convert("L"), dtype=np.float64)
    assert pixels.std() > 5, "a blank image"


@pytest.fixture
def metrics_file(tmp_path) -> Path:
    path = tmp_path / "eagle-run" / "metrics.jsonl"
    path.parent.mkdir()
    lines = []
    for step in range(0, 50, 10):
        lines.append(json.dumps({"step": step, "loss": 3 - step / 30, "acc_0": 0.2 + step / 200,
                                 "acc_1": 0.1 + step / 300}))
        if step % 20 == 0:
            lines.append(json.dumps({"step": step, "eval/tau": 1.1 + step / 100}))
    lines[3:3] = ["not json at all", '{"step": "seven"}', '{"loss": 1.0', "[1, 2]"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_page_has_every_section_and_every_image_decodes(tmp_path, metrics_file):
    report = tmp_path / "r.json"
    report.write_text(json.dumps(synthetic_report()))
    out = tmp_path / "page" / "report.html"
    assert main([str(report), "--metrics", str(metrics_file), "--out", str(out)]) == 0
    page = out.read_text()
    for key, title in SECTIONS:
        assert f"<section id='{key}'>" in page and title in page
    pictures = images(page)
    # speedup, tokens/s per prompt, tau, alpha per depth, accepted lengths, categories, and the
    # three training curves
    assert len(pictures) == 9
    for picture in pictures:
        assert_real_image(picture)
    assert "4 lines skipped" in page  # the metrics file's garbage lines, counted
    assert "writing (3 prompts)" in page and "coding (3 prompts)" in page
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched: self-contained
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_bad_reports_are_skipped_with_the_reason(tmp_path, capsys):
    good = synthetic_report()
    text = json.dumps(good, indent=1)
    files = {
        "truncated.json": text[: len(text) // 2],
        "newer.json": json.dumps({**good, "version": REPORT_VERSION + 1}),
        "other.json": json.dumps({"format": "lm-eval", "methods": [{"method": "x"}]}),
        "list.json": "[1, 2, 3]",
        "nameless.json": json.dumps({"methods": [{"tau": 1.0}]}),
    }
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    (tmp_path / "good.json").write_text(text)
    paths = [str(tmp_path / n) for n in files] + [str(tmp_path / "missing.json"),
                                                  str(tmp_path / "good.json")]
    out = tmp_path / "r.html"
    assert main([*paths, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    page = out.read_text()
    for reason in ("truncated?", "newer draftsmith", "not a draftsmith.eval.bench report",
                   "'lm-eval' file", "without a method name", "no such file"):
        assert html.escape(reason) in page and reason in err
    assert "6 files skipped" in err


def test_nothing_usable_writes_nothing_and_says_so(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{")
    out = tmp_path / "r.html"
    assert main([str(tmp_path / "bad.json"), "--out", str(out)]) == 2
    assert not out.exists() and "nothing written" in capsys.readouterr().err


def test_an_older_report_renders_with_what_it_has(tmp_path):
    out = tmp_path / "old.html"
    assert main([str(REPO / "reports" / "heads_t0.json"), "--out", str(out)]) == 0
    page = out.read_text()
    assert "older draftsmith.eval.bench" in page and "no per-prompt figures" in page
    assert "carry no category" in page
    pictures = images(page)
    assert len(pictures) == 3  # speedup, tau, alpha per depth: what a version-1 report holds
    for picture in pictures:
        assert_real_image(picture)


def test_empty_categories_and_missing_curves_are_said_not_drawn(tmp_path):
    report = synthetic_report()
    report["categories"].append({"category": "math", "num_prompts": 0, "methods": []})
    (tmp_path / "r.json").write_text(json.dumps(report))
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    out = tmp_path / "r.html"
    assert main([str(tmp_path / "r.json"), "--metrics", str(metrics), "--out", str(out)]) == 0
    page = out.read_text()
    assert html.escape("categories without prompts skipped: ['math']") in page
    assert "no top-1 accuracy in these metrics" in page and "no tau in these metrics" in page
    assert len(images(page)) == 7  # 6 of the benchmark, 1 training curve (the loss)


def test_out_is_checked_first(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(synthetic_report()))
    with pytest.raises(SystemExit):
        main([str(tmp_path / "r.json"), "--out", str(tmp_path)])


# ---------------------------------------------------------------------------------------------
# W&B: online when logged in, offline otherwise, and the run says which


@pytest.fixture
def no_wandb_login(monkeypatch, tmp_path):
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL",
                "NETRC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def test_wandb_mode_follows_wandbs_own_convention(no_wandb_login, monkeypatch, tmp_path):
    assert wandb_mode() == "offline"
    (no_wandb_login / ".netrc").write_text("machine example.org login u password p\n")
    assert wandb_mode() == "offline"
    (no_wandb_login / ".netrc").write_text("machine api.wandb.ai login user password " + "k" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_mode() == "offline"  # a key for another host
    monkeypatch.delenv("WANDB_BASE_URL")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"  # the user's own setting wins
    monkeypatch.delenv("WANDB_MODE")
    (no_wandb_login / ".netrc").write_text("garbage without structure\nmachine")
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"


def test_bench_logs_offline_and_says_how_to_sync(no_wandb_login, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    report = synthetic_report()
    log_to_wandb(report, report["config"], "draftsmith-test")
    err = capsys.readouterr().err
    match = re.search(r"W&B: offline \(not logged in to W&B\).*wandb sync (\S+)", err)
    assert match, err
    run_dir = Path(match.group(1))
    assert run_dir.is_dir() and run_dir.name.startswith("offline-run-")
    assert any(run_dir.glob("*.wandb"))  # the run's data, ready to sync
    media = list((run_dir / "files" / "media" / "images").rglob("*.png"))
    assert len(media) == 6  # the page's six benchmark figures
    tables = list((run_dir / "files" / "media" / "table").rglob("*.json"))
    assert len(tables) == 2  # the methods and the per-category table


def test_announce_names_the_mode():
    class Run:
        url = "https://wandb.ai/u/p/runs/x"
        dir = "/tmp/wandb/offline-run-1/files"

    assert "online, run at https://wandb.ai/u/p/runs/x" in announce_wandb_run(Run(), "online")
    line = announce_wandb_run(Run(), "offline")
    assert "wandb sync /tmp/wandb/offline-run-1" in line
    assert "disabled" in announce_wandb_run(None, "disabled")
