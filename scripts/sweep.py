"""A recipe sweep at equal wall time: every point trains for the same minutes
(scripts/train_budget.py), then one ``draftsmith.eval.bench`` run measures every head on held-out prompts.

    python scripts/sweep.py eagle3 --minutes 20 [--points base,ttt3,...] [--data FILE]
        [--num-prompts 16] [--runs runs/sweep] [--name NAME]

A sweep is a base recipe (a config and the overrides the shipped draft was trained with) and
its points, each changing one axis (``SWEEPS`` below). Each point trains in
``<runs>/<name>/<point>/`` (a finished point, with its ``budget.json``, is kept and not trained
again: rerun the command to continue a sweep); then one benchmark run of ``hf`` and every
finished point's draft, all drafting alike (EAGLE-3: the base config's fixed tree; Medusa: a
fixed tree of its ``eval_tree_nodes``; a distilled draft: chains of ``draft_depth``), greedy, on
Vicuna-bench (held out; MT-bench stays the test set), writes ``reports/sweep_<name>.json``, and
``reports/sweep_<name>.meta.json`` holds each point's overrides and budget record (probe, plan,
training seconds, steps, tokens). The table printed at the end ranks the points by tau, with the
speedup over ``hf`` measured in the same run beside it.

A point ``rowsN`` (``eagle3-shipped``) trains on a seeded sample of N rows of the sweep's data,
written beside its run (``<runs>/<name>/rowsN.rows.jsonl``, the same rows on every rerun): the
same minutes over fewer distinct rows, so a small sample is seen for several epochs where the
whole file is seen once. Such a point may name more overrides (``{"rows": N, "args": [...]}``):
``rows230-offline`` caches the sample's features inside its budget and reads them for the rest.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from draftsmith.files.command_line import run_command
from draftsmith.files.output_dir import write_atomic

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = "data/eval/vicuna_bench_question.jsonl"
# the recipe of the EAGLE-3 head shipped before the sweeps (the config's values were then set to
# the sweeps' winner, so every one the points are measured against is pinned here)
EAGLE3_BASE = ["--max_length", "512", "--max_tokens_per_batch", "2048", "--ttt_steps", "4",
               "--learning_rate", "5e-4", "--warmup_steps", "20", "--mixed_precision", "auto",
               "--draft_vocab_size", "8192", "--init_layer", "none",
               "--data", "data/train/selfdistill_answers.jsonl.gz"]
# the recipe of the Medusa-1 heads shipped before the sweep (pinned: the config now holds the winner)
MEDUSA_BASE = ["--max_length", "512", "--max_tokens_per_batch", "2048", "--soft_labels", "false",
               "--learning_rate", "1e-3", "--warmup_steps", "20", "--heldout_every", "0",
               "--draft_vocab_size", "8192", "--data", "data/train/selfdistill_answers.jsonl.gz"]
# the distilled draft's recipe before the sweep (scripts/cpu_results.sh distill-fixed), on
# 2048-token batches (pinned: the config now holds the shipped draft's)
DISTILL_BASE = ["--draft", "truncate:6", "--draft_vocab_size", "none", "--freeze_embedding", "false",
                "--data", "data/train/selfdistill_answers.jsonl.gz",
                "--max_length", "512", "--max_tokens_per_batch", "2048", "--on_policy_ratio", "0",
                "--learning_rate", "3e-4", "--warmup_steps", "10", "--heldout_every", "0"]
# the shipped EAGLE-3 head's recipe (configs/eagle/smollm2-135m.yaml when it was trained), pinned
SHIPPED_EAGLE3 = ["--max_length", "512", "--max_tokens_per_batch", "2048", "--ttt_steps", "4",
                  "--learning_rate", "1e-3", "--warmup_steps", "20", "--mixed_precision", "auto",
                  "--draft_vocab_size", "4096", "--init_layer", "27",
                  "--data", "data/train/selfdistill9k_answers.jsonl.gz"]
SAMPLE_SEED = 0
SWEEPS = {
    "eagle3": {
        "trainer": "eagle", "config": "configs/eagle/smollm2-135m.yaml", "base": EAGLE3_BASE,
        "points": {
            "base": [],
            "ttt3": ["--ttt_steps", "3"], "ttt5": ["--ttt_steps", "5"],
            "ttt7": ["--ttt_steps", "7"],
            "lr2e-4": ["--learning_rate", "2e-4"], "lr1e-3": ["--learning_rate", "1e-3"],
            "constant-lr": ["--lr_schedule", "constant"],
            "vocab2048": ["--draft_vocab_size", "2048"],
            "vocab4096": ["--draft_vocab_size", "4096"],
            # the cache is written inside the run, in its budget, then read for several epochs
            "offline": ["--feature_mode", "offline"],
            "init-layer": ["--init_layer", "27"],
            "noise0.1": ["--feature_noise", "0.1"],
            "data9k": ["--data", "data/train/selfdistill9k_answers.jsonl.gz"],
            # the 7-minute sweep's leading axes together (reports/sweep_eagle3_7min.json)
            "combo": ["--learning_rate", "1e-3", "--draft_vocab_size", "4096",
                      "--init_layer", "27", "--data", "data/train/selfdistill9k_answers.jsonl.gz"],
            "combo-ttt3": ["--learning_rate", "1e-3", "--draft_vocab_size", "4096",
                           "--init_layer", "27", "--ttt_steps", "3",
                           "--data", "data/train/selfdistill9k_answers.jsonl.gz"],
        },
    },
    "medusa": {
        "trainer": "medusa", "config": "configs/medusa/smollm2-135m.yaml", "base": MEDUSA_BASE,
        "points": {
            "base": [],
            "lr5e-4": ["--learning_rate", "5e-4"], "lr2e-3": ["--learning_rate", "2e-3"],
            "soft-labels": ["--soft_labels", "true"],
            "heads3": ["--num_heads", "3"], "heads5": ["--num_heads", "5"],
            "vocab4096": ["--draft_vocab_size", "4096"],
            "data9k": ["--data", "data/train/selfdistill9k_answers.jsonl.gz"],
        },
    },
    "distill": {
        "trainer": "distill", "config": "configs/distill/smollm2-135m.yaml", "base": DISTILL_BASE,
        "points": {
            "truncate6": [],  # the target's full vocabulary, as the earlier draft
            "truncate6-vocab8192": ["--draft_vocab_size", "8192"],
            "truncate4-vocab8192": ["--draft", "truncate:4", "--draft_vocab_size", "8192"],
            "truncate2-vocab8192": ["--draft", "truncate:2", "--draft_vocab_size", "8192"],
            "truncate2-vocab4096": ["--draft", "truncate:2", "--draft_vocab_size", "4096"],
            "fresh2-narrow": ["--draft", "fresh:2", "--draft_hidden_size", "384",
                              "--draft_vocab_size", "8192"],
            "truncate2-on-policy": ["--draft", "truncate:2", "--draft_vocab_size", "8192",
                                    "--on_policy_ratio", "0.5"],
            "data9k": ["--draft", "truncate:2", "--draft_vocab_size", "8192",
                       "--data", "data/train/selfdistill9k_answers.jsonl.gz"],
        },
    },
}
# around the shipped recipe: data size (seeded samples of its 9191 answers) and the schedule
SWEEPS["eagle3-shipped"] = {"trainer": "eagle", "config": "configs/eagle/smollm2-135m.yaml",
                            "base": SHIPPED_EAGLE3,
                            "points": {"shipped": [], "rows230": {"rows": 230},
                                       "rows1150": {"rows": 1150},
                                       "constant-lr": ["--lr_schedule", "constant"],
                                       # the sample's features cached inside the budget, then
                                       # read for as many epochs as the rest of it allows
                                       "rows230-offline": {"rows": 230, "args": [
                                           "--feature_mode", "offline"]}}}
PREFIX = {"eagle": "eagle", "medusa": "medusa", "distill": "draft"}


def _drafting(trainer: str, config: str) -> list[str]:
    """The bench flags every point of a sweep drafts with, from its base config."""
    values = yaml.safe_load((REPO / config).read_text())
    if trainer == "eagle":
        return ["--tree", "fixed", "--tree-depth", str(values["tree_depth"]), "--tree-topk",
                str(values["tree_topk"]), "--tree-nodes", str(values["tree_nodes"])]
    if trainer == "medusa":
        return ["--tree", "fixed", "--tree-nodes", str(values["eval_tree_nodes"])]
    return ["--draft-depth", str(values["draft_depth"])]


def _data_of(base: list[str], config: str) -> str:
    """The training data a sweep's points share: the last --data of its base, else the config's."""
    given = [base[i + 1] for i, a in enumerate(base[:-1]) if a == "--data"]
    if given:
        return given[-1]
    files = yaml.safe_load((REPO / config).read_text()).get("data") or []
    if len(files) != 1:
        raise ValueError(f"a rows point samples one data file; {config} names {files}")
    return files[0]


def sample_rows(source: str | Path, rows: int, out: Path, seed: int = SAMPLE_SEED) -> dict:
    """Write a seeded sample of ``rows`` of the usable conversations of ``source`` (read by
    draftsmith.train.rows, as the trainers read it) to ``out`` as messages JSONL, in the file's order; the
    record says what was drawn from what."""
    from draftsmith.train.rows import read_conversations

    path = Path(source) if Path(source).is_absolute() else REPO / source
    conversations, _ = read_conversations(str(path))
    if not 0 < rows <= len(conversations):
        raise ValueError(f"cannot sample {rows} rows of {source}: it has {len(conversations)}")
    chosen = sorted(random.Random(seed).sample(range(len(conversations)), rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "".join(json.dumps({"messages": conversations[i]["messages"]},
                                         ensure_ascii=False) + "\n" for i in chosen).encode())
    return {"rows": rows, "of": len(conversations), "sampled_from": str(source), "seed": seed,
            "file": str(out)}


def _overrides(spec: dict, point: str, out: Path, data: str | None) -> tuple[list[str], dict]:
    """A point's trainer overrides, and the sample it trains on (a rows point) or {}."""
    value = spec["points"][point]
    if isinstance(value, dict):
        source = data if data is not None else _data_of(spec["base"], spec["config"])
        sample = sample_rows(source, value["rows"], out.parent / f"{point}.rows.jsonl")
        return ["--data", sample["file"], *value.get("args", [])], sample
    return list(value), {}


def sweep(name: str, minutes: float, points: list[str] | None, data: str | None, runs: str,
          report_name: str, prompts: str, num_prompts: int, max_new_tokens: int,
          threads: int) -> Path:
    if name not in SWEEPS:
        raise ValueError(f"unknown sweep {name!r}: choose one of {sorted(SWEEPS)}")
    spec = SWEEPS[name]
    chosen = points or list(spec["points"])
    unknown = [p for p in chosen if p not in spec["points"]]
    if unknown:
        raise ValueError(f"unknown points {unknown} of sweep {name!r}: choose from "
                         f"{list(spec['points'])}")
    if "mt_bench" in prompts:
        raise ValueError(f"--prompts {prompts}: MT-bench is the test set; sweep on held-out "
                         f"prompts ({DEFAULT_PROMPTS})")
    root = Path(runs) / report_name
    base = ["--config", spec["config"], *spec["base"], "--eval_every", "0"]
    if data is not None:
        base += ["--data", data]
    meta = {"sweep": name, "minutes": minutes, "config": spec["config"], "base": base,
            "points": {}}
    for point in chosen:
        out = root / point
        done = out / "budget.json"
        overrides, sample = _overrides(spec, point, out, data)
        if not done.is_file():
            if out.exists():  # an interrupted point of this sweep: trained again from nothing
                shutil.rmtree(out)
            print(f"[sweep] {name}/{point}: {minutes} min", flush=True)
            command = [sys.executable, str(REPO / "scripts" / "train_budget.py"), "--minutes",
                       str(minutes), "--out", str(out), "--trainer", spec["trainer"], "--",
                       *base, *overrides]
            status = subprocess.run(command, cwd=REPO).returncode
            if status != 0:
                raise ValueError(f"point {point!r} failed (exit {status}); its logs are in {out}")
        meta["points"][point] = {"overrides": overrides,
                                 "budget": json.loads(done.read_text())}
        if sample:
            meta["points"][point]["sample"] = sample
    report = REPO / "reports" / f"sweep_{report_name}.json"
    bench = [sys.executable, "-m", "draftsmith.eval.bench", "--target", "smollm2-135m", "--threads",
             str(threads), "--method", "hf", *_drafting(spec["trainer"], spec["config"]),
             "--draft-dtype", "bf16",
             "--prompts", prompts, "--num-prompts", str(num_prompts), "--max-new-tokens",
             str(max_new_tokens), "--temperature", "0", "--out", str(report)]
    prefix = PREFIX[spec["trainer"]]
    for point in chosen:
        bench += ["--method", f"{prefix}:{root / point / 'run' / 'artifact'}"]
    status = subprocess.run(bench, cwd=REPO).returncode
    if status != 0:
        raise ValueError(f"the benchmark of the sweep failed (exit {status})")
    write_atomic(report.with_suffix(".meta.json"), json.dumps(meta, indent=2).encode())
    records = {r["method"]: r for r in json.loads(report.read_text())["methods"]}
    rows = []
    for point in chosen:
        record = records[f"{prefix}:{root / point / 'run' / 'artifact'}"]
        budget = meta["points"][point]["budget"]
        rows.append((record["tau"], record["speedup"], point, budget["steps"], budget["tokens"],
                     budget["train_seconds"]))
    print(f"\n{'point':<22}{'tau':>8}{'speedup':>9}{'steps':>8}{'tokens':>10}{'seconds':>9}")
    for tau, speedup, point, steps, tokens, seconds in sorted(rows, reverse=True):
        print(f"{point:<22}{tau:>8.3f}{speedup:>9.3f}{steps:>8}{tokens:>10}{seconds:>9.0f}")
    return report


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="scripts/sweep.py", description=__doc__.split("\n")[0])
    parser.add_argument("sweep", help=f"one of {sorted(SWEEPS)}")
    parser.add_argument("--minutes", type=float, required=True, help="each point's wall time")
    parser.add_argument("--points", default=None, help="comma-separated points (default: all)")
    parser.add_argument("--data", default=None, help="the training data (default: the config's)")
    parser.add_argument("--runs", default="runs/sweep")
    parser.add_argument("--name", default=None, help="the report's name (default: the sweep's)")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    points = args.points.split(",") if args.points else None
    return sweep(args.sweep, args.minutes, points, args.data, args.runs, args.name or args.sweep,
                 args.prompts, args.num_prompts, args.max_new_tokens, args.threads)


if __name__ == "__main__":
    sys.exit(run_command(main, "scripts/sweep.py"))
