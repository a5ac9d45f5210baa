"""Held-out acceptance against CPU-minutes of training, from a run that measured it as it trained
(``eval_every`` > 0): each ``eval/tau`` record of ``<run>/metrics.jsonl`` beside the steps, real
tokens and epochs trained by then and the minutes spent training (each logging window's new tokens
over its tokens per second; evaluation excluded) and evaluating.

    python scripts/acceptance_curve.py runs/ship/eagle3 --out reports/eagle3_curve.json

The report holds the run's evaluation settings (prompts, how many, new tokens, temperature, the
tree) from ``<run>/config.yaml`` and one row per evaluation; the table is printed too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from draftsmith.files.command_line import run_command
from draftsmith.files.output_dir import write_atomic

SETTINGS = ("data", "eval_prompts", "eval_num_prompts", "eval_max_new_tokens", "eval_temperature",
            "tree_depth", "tree_topk", "tree_nodes", "learning_rate", "ttt_steps",
            "draft_vocab_size", "init_layer", "max_steps", "eval_tree_nodes", "num_heads",
            "soft_labels", "draft", "freeze_embedding", "draft_depth", "draft_min_confidence")


def curve(run: Path) -> dict:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist: give a training run's output_dir")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    config = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() \
        else {}
    rows, train_seconds, eval_seconds, tokens, last = [], 0.0, 0.0, 0, {}
    for record in records:
        if record.get("tokens_per_s"):
            train_seconds += (record["tokens"] - tokens) / record["tokens_per_s"]
            tokens, last = record["tokens"], record
        if "eval/tau" in record:
            eval_seconds += record.get("eval/seconds", 0.0)
            rows.append({
                "step": record["step"], "tokens": tokens, "epoch": last.get("epoch", 0.0),
                "train_minutes": round(train_seconds / 60, 2),
                "eval_minutes": round(eval_seconds / 60, 2),
                "tau": round(record["eval/tau"], 4), "alpha": round(record["eval/alpha"], 4),
                "alpha_depth_1": round(record.get("eval/alpha_depth_1", 0.0), 4),
            })
    if not rows:
        raise ValueError(f"{metrics} has no eval/tau record: the run measured no acceptance "
                         f"(eval_every 0)")
    return {"run": str(run), "settings": {k: config.get(k) for k in SETTINGS}, "points": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="scripts/acceptance_curve.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a training run's output_dir")
    parser.add_argument("--out", default=None, help="write the report here (JSON)")
    args = parser.parse_args(argv)
    report = curve(Path(args.run))
    print(f"{'step':>6}{'tokens':>11}{'epoch':>7}{'train min':>11}{'tau':>8}{'alpha':>8}"
          f"{'depth 1':>9}")
    for row in report["points"]:
        print(f"{row['step']:>6}{row['tokens']:>11,}{row['epoch']:>7.2f}"
              f"{row['train_minutes']:>11.1f}{row['tau']:>8.3f}{row['alpha']:>8.3f}"
              f"{row['alpha_depth_1']:>9.3f}")
    if args.out:
        write_atomic(Path(args.out), (json.dumps(report, indent=2) + "\n").encode())
    return report


if __name__ == "__main__":
    sys.exit(run_command(main, "scripts/acceptance_curve.py"))
