"""The memory planner against the allocator on every trainer's tiny config (the embedded target).

    python scripts/memory_probe_tiny.py [--out reports/memory_probe_tiny.json] [--steps 2]

For each of configs/{eagle,medusa,dflash,distill}/tiny.yaml, ``python -m draftsmith.train.memory_probe`` in
a fresh process (so no memory freed by an earlier run is reused unseen), twice:

* ``full``: on rows that fill every micro-batch the config plans (answers longer than
  ``max_length``, so every position after a short prompt is scored) and, for distillation,
  off-policy (an on-policy batch is a prompt and 32 sampled tokens): the case the planner plans
  for, where its estimate should be within 10% of the allocator's peak;
* ``own``: on the config's own data, where the planner must be an upper bound.

Writes one JSON report with every probe's measurements and planned parts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINERS = ("eagle", "medusa", "dflash", "distill")
WORDS = ("the of and to in is was for on that with as by at from it an be this are or which "
         "river mountain city bridge garden window number answer people water light music").split()


def write_full_rows(path: Path, rows: int = 64, answer_words: int = 600) -> Path:
    """Conversations whose answers are longer than any tiny config's ``max_length``."""
    rng = random.Random(0)
    lines = []
    for _ in range(rows):
        question = " ".join(rng.choice(WORDS) for _ in range(8))
        answer = " ".join(rng.choice(WORDS) for _ in range(answer_words))
        lines.append(json.dumps({"messages": [{"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def probe_argv(trainer: str, full_rows: Path | None) -> list[str]:
    argv = ["--config", str(REPO / "configs" / trainer / "tiny.yaml")]
    if full_rows is not None:
        argv += ["--data", str(full_rows)]
        if trainer == "distill":
            argv += ["--on_policy_ratio", "0"]
    return argv


def run_probe(trainer: str, full_rows: Path | None, steps: int, scratch: Path) -> dict:
    """One probe in a fresh process; its JSON."""
    out = scratch / f"{trainer}-{'full' if full_rows else 'own'}.json"
    command = [sys.executable, "-m", "draftsmith.train.memory_probe", *probe_argv(trainer, full_rows),
               "--steps", str(steps), "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "reports" / "memory_probe_tiny.json"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--trainer", action="append", choices=TRAINERS, default=None)
    args = parser.parse_args(argv)
    report = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or
              platform.machine(), "python": platform.python_version(), "runs": []}
    import torch
    import transformers

    report["torch"], report["transformers"] = torch.__version__, transformers.__version__
    with tempfile.TemporaryDirectory(prefix="draftsmith-probe-") as scratch:
        scratch = Path(scratch)
        full = write_full_rows(scratch / "full_rows.jsonl")
        for trainer in args.trainer or TRAINERS:
            for rows in (full, None):
                result = run_probe(trainer, rows, args.steps, scratch)
                result["rows"] = "full" if rows else "own"
                result["argv"] = [a if a != str(full) else "<full rows>" for a in result["argv"]]
                report["runs"].append(result)
                print(f"{trainer:8} {result['rows']:4} planned {result['planned_tensors_gib']:.3f}"
                      f" GiB, measured {result['measured_tensors_gib']:.3f} GiB: "
                      f"{result['planned_over_measured']:.3f}", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
