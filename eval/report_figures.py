"""The benchmark report's figures: speedups and acceptance per method, tokens per prompt,
acceptance by depth and by category, and training curves from a run's metrics.jsonl
(:func:`read_metrics`), each a PNG (matplotlib, headless).

Each function takes the records of a report (``draftsmith.eval.report``) and returns PNG bytes,
or None when the records hold nothing to draw.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from draftsmith.eval.methods import BENCH_METHODS


class ReportError(ValueError):
    """A report file that cannot be used, with the reason in words."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def finite_number(value) -> float | None:
    """A report value as a finite float, or None (missing, a bool, NaN, infinite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def ci_interval(record: dict, key: str):
    """A record's [low, high] interval under ``key`` as two floats, or None."""
    value = record.get(key)
    if (isinstance(value, list) and len(value) == 2
            and all(finite_number(v) is not None for v in value)):
        return [float(v) for v in value]
    return None


def _bars_with_intervals(records: list[dict], key: str, ci_key: str, xlabel: str,
                         reference: float | None) -> bytes | None:
    rows = [(r["method"], finite_number(r.get(key)), ci_interval(r, ci_key)) for r in records]
    rows = [row for row in rows if row[1] is not None]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.2))
    names = [n for n, _, _ in rows]
    values = [v for _, v, _ in rows]
    lows = [v - ci[0] if ci else 0.0 for _, v, ci in rows]
    highs = [ci[1] - v if ci else 0.0 for _, v, ci in rows]
    ax.barh(range(len(rows)), values, xerr=[lows, highs], color="#4878a8", capsize=4)
    ax.set_yticks(range(len(rows)), names)
    ax.invert_yaxis()
    if reference is not None:
        ax.axvline(reference, color="#444", linewidth=1, linestyle="--")
    if not any(ci for _, _, ci in rows):
        xlabel = xlabel.split(" (bars")[0]  # nothing to draw the bars from
    ax.set_xlabel(xlabel)
    for i, (v, high) in enumerate(zip(values, highs)):
        ax.text(v + high, i, f"  {v:.3f}", va="center", ha="left", fontsize=8)
    ax.set_xlim(0, max(v + h for v, h in zip(values, highs)) * 1.15)
    return _png(fig)


def speedup_figure(records: list[dict], reference: str = "hf") -> bytes | None:
    return _bars_with_intervals(records, "speedup", "speedup_ci95",
                                f"tokens/s over {reference}'s (bars: 95% interval over prompts)",
                                1.0)


def tau_figure(records: list[dict]) -> bytes | None:
    return _bars_with_intervals(records, "tau", "tau_ci95",
                                "tau: tokens per target forward (bars: 95% interval)", 1.0)


def tokens_per_prompt_figure(records: list[dict]) -> bytes | None:
    series = []
    for r in records:
        per = r.get("per_prompt")
        if not isinstance(per, dict):
            continue
        try:
            tokens = [sum(col) for col in zip(*per["new_tokens"])]
            seconds = [sum(col) for col in zip(*per["seconds"])]
        except (KeyError, TypeError):
            continue
        rates = [t / s if s else None for t, s in zip(tokens, seconds)]
        if any(v is not None for v in rates):
            series.append((r["method"], rates))
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, rates in series:
        xs = [i for i, v in enumerate(rates) if v is not None]
        ax.plot(xs, [rates[i] for i in xs], marker="o", markersize=3, linewidth=1, label=name)
    return _finish(fig, ax, "prompt (in the order run)", "tokens/s")


def _finish(fig, ax, xlabel: str, ylabel: str) -> bytes:
    """Integer x ticks, labels, legend and grid, then the PNG."""
    ax.set_xlabel(xlabel)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def alpha_figure(records: list[dict]) -> bytes | None:
    series = []
    for r in records:
        values = r.get("alpha_per_depth")
        if isinstance(values, list) and any(finite_number(v) is not None for v in values):
            series.append((r["method"], [finite_number(v) for v in values]))
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, values in series:
        depths = [d for d, v in enumerate(values, start=1) if v is not None]
        ax.plot(depths, [values[d - 1] for d in depths], marker="o", label=name)
    ax.set_ylim(0, 1)
    return _finish(fig, ax, "tree depth", "alpha (accepted / tried)")


def accepted_lengths_figure(records: list[dict]) -> bytes | None:
    series = []
    for r in records:
        hist = r.get("accepted_length_histogram")
        if isinstance(hist, list) and hist and all(finite_number(v) is not None for v in hist) \
                and sum(hist) > 0:
            series.append((r["method"], [float(v) / sum(hist) for v in hist]))
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(series)
    for k, (name, fractions) in enumerate(series):
        ax.bar([i + k * width for i in range(len(fractions))], fractions, width=width, label=name)
    longest = max(len(f) for _, f in series)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(longest)], [str(i) for i in range(longest)])
    ax.set_xlabel("draft tokens accepted in a round")
    ax.set_ylabel("fraction of rounds")
    ax.legend(fontsize=8)
    return _png(fig)


def categories_figure(categories: list[dict], reference: str = "hf") -> bytes | None:
    names = [c.get("category") for c in categories]
    methods: dict[str, list[float | None]] = {}
    for i, c in enumerate(categories):
        for r in c.get("methods") or []:
            if isinstance(r, dict) and r.get("method") != reference:
                methods.setdefault(r.get("method"), [None] * len(categories))[i] = \
                    finite_number(r.get("speedup"))
    methods = {m: v for m, v in methods.items() if any(x is not None for x in v)}
    if not methods:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(names)), 4))
    width = 0.8 / len(methods)
    for k, (name, values) in enumerate(methods.items()):
        xs = [i + k * width for i, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width=width, label=name)
    ax.axhline(1.0, color="#444", linewidth=1, linestyle="--")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=30,
                  ha="right")
    ax.set_ylabel(f"speedup over {reference}")
    ax.legend(fontsize=8)
    return _png(fig)


def _top1_patterns() -> list[re.Pattern]:
    """The per-step / per-head top-1 metrics every trainer logs (draftsmith.eval.methods' rows say which)."""
    return [re.compile(row.top1_metric) for row in BENCH_METHODS.values() if row.top1_metric]


def training_figures(runs: list[Metrics]) -> list[tuple[str, bytes | None, str]]:
    """(title, png or None, what is missing) for loss, top-1 per step / head, and eval tau."""
    plt = _pyplot()
    top1 = _top1_patterns()

    def curves(select) -> list[tuple[str, list[int], list[float]]]:
        found = []
        for run in runs:
            keys = sorted({k for r in run.records for k in r if select(k)},
                          key=lambda k: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", k)])
            for key in keys:
                points = [(r["step"], finite_number(r.get(key))) for r in run.records]
                points = [(s, v) for s, v in points if v is not None]
                if points:
                    label = key if len(runs) == 1 else f"{run.name}: {key}"
                    found.append((label, [s for s, _ in points], [v for _, v in points]))
        return found

    out = []
    for title, select, ylabel in (
        ("Training loss", lambda k: k == "loss", "loss"),
        ("Top-1 accuracy per test-time step (EAGLE: acc_i) or per head (Medusa)",
         lambda k: any(p.match(k) for p in top1), "top-1 accuracy"),
        ("Acceptance measured while training", lambda k: k == "eval/tau", "tau"),
    ):
        found = curves(select)
        if not found:
            out.append((title, None, f"no {ylabel} in these metrics"))
            continue
        fig, ax = plt.subplots(figsize=(8, 3.6))
        for label, steps, values in found:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3,
                    linewidth=1, label=label)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(found) > 1:
            ax.legend(fontsize=7)
        out.append((title, _png(fig), ""))
    return out


@dataclass
class Metrics:
    name: str
    records: list[dict]
    skipped: int = 0  # lines that were not JSON objects with an integer step


def read_metrics(path: str | os.PathLike) -> Metrics:
    """A training run's metrics.jsonl; lines that are not records are counted and skipped."""
    path = Path(path)
    name = path.parent.name or path.name
    if not path.is_file():
        raise ReportError(f"{path}: no such file")
    records, skipped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int) \
                    or isinstance(record.get("step"), bool):
                skipped += 1
                continue
            records.append(record)
    return Metrics(name, records, skipped)
