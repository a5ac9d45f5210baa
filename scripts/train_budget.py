"""Train a draftsmith recipe for a wall-time budget: what "at equal wall time" means in the
recipe sweeps (scripts/sweep.py) and against the peer trainer (scripts/peer_speculators.sh).

    python scripts/train_budget.py --minutes 20 --out runs/sweep/eagle3/base \\
        [--trainer eagle] [--probe-steps 8] -- --config configs/eagle/smollm2-135m.yaml ...

1. A probe: the trainer with the given arguments for ``--probe-steps`` steps; its wall time and
   the steps it logged give the start-up and the time of a step (draftsmith.train.speed.steps_for_budget).
2. The run: ``max_steps`` = the steps that fit the budget, so that its learning-rate schedule
   spans them (``num_epochs`` lifted: only time binds); stopped by SIGTERM at the deadline if it
   runs over (the trainer finishes its step and saves), and then resumed with ``max_steps`` at the
   step reached, which writes its artifact.
3. ``<out>/budget.json``: the budget, the probe and the plan (start-up, seconds per step, steps),
   the training seconds, whether the deadline stopped it, the steps and tokens trained, the
   trainer's arguments.

The probe is not counted in the budget (every side of a comparison probes alike); what a recipe
does before its first step inside the run (loading, tokenising, writing a feature cache) is.
Every argument after ``--`` goes to the trainer (``train/<trainer>.py``); these are set here:
``--output_dir``, ``--max_steps``, ``--num_epochs none``, ``--log_every 1``, ``--save_every``
(only the stop saves), ``--report_to none``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.files.command_line import run_command
from draftsmith.files.output_dir import write_atomic
from draftsmith.train.recipes import TRAINERS
from draftsmith.train.speed import logged_step_seconds, steps_for_budget

REPO = Path(__file__).resolve().parents[1]
FIXED = ("--num_epochs", "none", "--log_every", "1", "--save_every", "1000000", "--report_to",
         "none")
GRACE = 120  # seconds a stopped trainer has to finish its step and save before it is killed


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _trainer(name: str, args: list[str], out: Path, steps: int, log: Path,
             deadline: float | None = None, resume: bool = False) -> tuple[int, float, bool]:
    """Run train/<name>.py to ``steps``; -> (exit status, seconds, stopped at the deadline)."""
    command = [sys.executable, str(REPO / "train" / f"{name}.py"), *args, *FIXED,
               "--output_dir", str(out), "--max_steps", str(steps),
               "--resume", "latest" if resume else "none"]
    started = time.monotonic()
    with open(log, "ab") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            process.wait(timeout=None if deadline is None else max(1.0, deadline - started))
            return process.returncode, time.monotonic() - started, False
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)  # the trainer saves the step it is in, then stops
            try:
                process.wait(timeout=GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            return process.returncode, time.monotonic() - started, True
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def _fail(what: str, log: Path) -> ValueError:
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.is_file() else ""
    return ValueError(f"{what} failed (log: {log}):\n{tail}")


def train_for(minutes: float, out: str | Path, trainer: str, trainer_args: list[str],
              probe_steps: int = 8) -> dict:
    """Probe, plan and run (module docstring); -> what ``<out>/budget.json`` holds."""
    if trainer not in TRAINERS:
        raise ValueError(f"--trainer {trainer!r}: choose one of {sorted(TRAINERS)}")
    if not minutes > 0 or probe_steps < 3:
        raise ValueError(f"need --minutes > 0 and --probe-steps >= 3, got {minutes} and "
                         f"{probe_steps}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    budget = minutes * 60
    probe_dir, run_dir, log = out / "probe", out / "run", out / "train.log"
    for leftover in (probe_dir, run_dir):
        if leftover.exists():
            raise ValueError(f"{leftover} exists: train_budget starts a run from nothing; give "
                             f"another --out or remove it")
    status, probe_seconds, _ = _trainer(trainer, trainer_args, probe_dir, probe_steps,
                                        out / "probe.log")
    if status != 0:
        raise _fail("the probe", out / "probe.log")
    plan = steps_for_budget(logged_step_seconds(_records(probe_dir)), probe_seconds, budget,
                            what=f"{trainer} training")
    print(f"[train_budget] {trainer}: {plan['steps']} steps of {plan['step_seconds']} s fit "
          f"{budget:.0f} s (start-up {plan['startup_seconds']} s)", flush=True)
    deadline = time.monotonic() + budget
    status, seconds, stopped = _trainer(trainer, trainer_args, run_dir, plan["steps"], log,
                                        deadline=deadline)
    records = [r for r in _records(run_dir) if "tokens" in r]
    if stopped:  # the artifact of the step the deadline stopped it at
        if not records:
            raise _fail("the run (stopped at its deadline before its first step)", log)
        reached = records[-1]["step"]
        status, _, _ = _trainer(trainer, trainer_args, run_dir, reached, log, resume=True)
    if status != 0 or not (run_dir / "artifact" / "config.json").is_file():
        raise _fail("the run", log)
    record = {
        "trainer": trainer, "trainer_args": trainer_args, "budget_seconds": round(budget, 1),
        "probe": {"steps": probe_steps, "seconds": round(probe_seconds, 1)}, "plan": plan,
        "train_seconds": round(seconds, 1), "stopped_at_deadline": stopped,
        "steps": records[-1]["step"] if records else 0,
        "tokens": records[-1]["tokens"] if records else 0,
        "artifact": str(run_dir / "artifact"),
    }
    write_atomic(out / "budget.json", json.dumps(record, indent=2).encode())
    return record


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    parser = argparse.ArgumentParser(prog="scripts/train_budget.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, required=True, help="the wall-time budget")
    parser.add_argument("--out", required=True, help="the directory of the probe, run and plan")
    parser.add_argument("--trainer", default="eagle", help="train/<trainer>.py (default eagle)")
    parser.add_argument("--probe-steps", type=int, default=8)
    args = parser.parse_args(ours)
    if not rest:
        parser.error("give the trainer's arguments after --, e.g. -- --config CONFIG")
    record = train_for(args.minutes, args.out, args.trainer, rest, args.probe_steps)
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    sys.exit(run_command(main, "scripts/train_budget.py"))
