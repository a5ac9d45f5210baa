"""What `pip install` puts in site-packages: one name, ``draftsmith``, holding every floor and the
data the commands read by default; the command works from the installed wheel alone."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("draftsmith-*.whl")
    return path


def test_the_wheel_installs_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"draftsmith", wheel.name.split("-py")[0]
                                                + ".dist-info"}
    for floor in ("files", "targets", "heads", "layouts", "eval", "train"):
        sources = {p.name for p in (REPO / floor).glob("*.py")}
        packed = {n.split("/")[-1] for n in names if n.startswith(f"draftsmith/{floor}/")}
        assert sources <= packed, (floor, sources - packed)
    # what the commands read by default: evaluation questions, shipped target shapes
    assert "draftsmith/data/eval/vicuna_bench_question.jsonl" in names
    assert "draftsmith/data/target_configs/meta-llama--Llama-3.1-8B-Instruct.json" in names
    assert not any(n.startswith("draftsmith/data/train/") for n in names)  # training data stays


def test_the_installed_command_runs_without_the_checkout(wheel, tmp_path):
    """In a fresh venv (the dependencies seen through the system site-packages), away from the
    checkout: `draftsmith --help`, a subcommand, the memory planner on a shipped shape, and a
    trainer's own --help by its module; no top-level `heads`, `eval` or `train` is importable."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*words: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(words[0]), *words[1:]], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)

    where = run(python, "-c", "import draftsmith, draftsmith.eval.bench as b; "
                              "print(draftsmith.__path__, b.__file__)")
    assert where.returncode == 0, where.stderr[-3000:]
    assert str(venv) in where.stdout and str(REPO) not in where.stdout
    for name in ("heads", "eval", "train", "layouts", "targets", "files", "distill"):
        gone = run(python, "-c", f"import {name}")
        assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stderr, name
    top = run(venv / "bin" / "draftsmith", "--help")
    assert top.returncode == 0 and "train" in top.stdout, top.stderr[-2000:]
    bench = run(venv / "bin" / "draftsmith", "bench", "--help")
    assert bench.returncode == 0 and "draftsmith bench" in bench.stdout, bench.stderr[-2000:]
    # an 8B recipe planned from the shape the wheel ships (no download, no checkout)
    config = work / "eagle-8b.yaml"
    config.write_text((REPO / "configs/eagle/llama-3.1-8b-instruct.yaml").read_text())
    memory = run(venv / "bin" / "draftsmith", "memory", "--config", str(config), "--trainer",
                 "eagle", "--device", "cuda", "--processes", "8")
    assert memory.returncode == 0, memory.stderr[-2000:]
    assert "total" in memory.stdout and "GiB" in memory.stdout, memory.stdout
    trainer = run(python, "-m", "draftsmith.train.eagle", "--help")
    assert trainer.returncode == 0 and "--config" in trainer.stdout, trainer.stderr[-2000:]
