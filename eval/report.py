"""The benchmark's report: one self-contained HTML page, the same tables and plots in W&B.

    python -m draftsmith.eval.report REPORT.json [REPORT.json ...] [--metrics runs/*/metrics.jsonl] \\
        --out report.html

The page (images embedded, nothing fetched) has, for every report: the run's set-up and the
greedy-equality verdict; speedup over ``hf`` per method with its 95% interval; tokens/s per
prompt; tau with its interval and alpha per tree depth; the histogram of accepted lengths; the
table per category; the greedy differences, classified. With ``--metrics``, the training curves
of each run: loss, top-1 accuracy per test-time step (EAGLE) or per head (Medusa), and the
acceptance ``eval/tau`` measured while training.

Bad input never ends in a traceback: a report that is not valid JSON, truncated, from another
version or another tool is skipped with the reason on the page and on stderr; garbage lines in a
metrics file are counted and skipped; a figure with nothing to show is replaced by a sentence
saying what is missing, never drawn empty.

W&B (``draftsmith.eval.bench --wandb``, and training's ``report_to: wandb`` through :func:`wandb_mode` and
:func:`announce_wandb_run`) follows W&B's own convention: online when the user is logged in,
offline otherwise, and the run says which at its start.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import netrc
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from draftsmith.eval.report_figures import (
    Metrics,
    ReportError,
    accepted_lengths_figure,
    alpha_figure,
    categories_figure,
    ci_interval,
    finite_number,
    read_metrics,
    speedup_figure,
    tau_figure,
    tokens_per_prompt_figure,
    training_figures,
)
from draftsmith.eval.summary import (
    BOOTSTRAP_RESAMPLES,
    CONFIDENCE,
    REPORT_FORMAT,
    REPORT_VERSION,
    greedy_summary,
)
from draftsmith.files.command_line import program
from draftsmith.files.output_dir import check_file_destination, named_paths, write_atomic

SECTIONS = (
    ("summary", "Set-up and verdict"),
    ("speedup", "Speedup over the reference (hf, or plain decoding in llama.cpp), with 95% intervals"),
    ("tokens-per-prompt", "Tokens per second, prompt by prompt"),
    ("acceptance", "Tau and alpha per depth"),
    ("accepted-lengths", "Accepted lengths"),
    ("categories", "Per category"),
    ("greedy", "Greedy equality"),
    ("training", "Training curves"),
)


# ---------------------------------------------------------------------------------------------
# files


def read_report(path: str | os.PathLike) -> dict:
    """A benchmark report JSON, checked; raises ReportError saying what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ReportError(f"{path}: cannot be read ({err})") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        hint = " (the file ends early: truncated?)" if err.pos >= len(text.rstrip()) else ""
        raise ReportError(f"{path}: not valid JSON at line {err.lineno}, column {err.colno}"
                          f"{hint}") from err
    if not isinstance(data, dict) or not isinstance(data.get("methods"), list):
        raise ReportError(f"{path}: not a draftsmith.eval.bench report (no 'methods' list)")
    fmt = data.get("format")
    if fmt is not None and fmt != REPORT_FORMAT:
        raise ReportError(f"{path}: a {fmt!r} file, not a draftsmith.eval.bench report")
    version = data.get("version", 1)
    if not isinstance(version, int) or version > REPORT_VERSION:
        raise ReportError(f"{path}: written by a newer draftsmith (report version {version!r}; "
                          f"this one reads up to {REPORT_VERSION}): upgrade draftsmith")
    bad = [i for i, r in enumerate(data["methods"])
           if not isinstance(r, dict) or not isinstance(r.get("method"), str)]
    if bad or not data["methods"]:
        raise ReportError(f"{path}: its 'methods' list is empty or holds entries without a "
                          f"method name (entries {bad[:5]})")
    data.setdefault("config", {})
    if not isinstance(data["config"], dict):
        data["config"] = {}
    data["version"] = version
    return data


# ---------------------------------------------------------------------------------------------
# figures: each returns PNG bytes, or None when there is nothing to draw (the caller says why)


# ---------------------------------------------------------------------------------------------
# the page


@dataclass
class Section:
    key: str
    title: str
    blocks: list[str] = field(default_factory=list)  # HTML fragments
    images: list[tuple[str, bytes]] = field(default_factory=list)  # (caption, png)


@dataclass
class Report:
    sections: list[Section]
    notes: list[str]  # files skipped, with the reason


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def _fmt(value, digits: int = 3) -> str:
    number = finite_number(value)
    if number is None:
        return "-" if value is None else _e(value)
    if isinstance(value, int):
        return str(value)
    return f"{number:.{digits}f}"


def _with_ci(record: dict, key: str, ci_key: str) -> str:
    value = finite_number(record.get(key))
    if value is None:
        return "-"
    ci = ci_interval(record, ci_key)
    return f"{value:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def _greedy_text(record: dict) -> str:
    identical = record.get("greedy_identical")
    if identical is None:
        return "-"
    if identical:
        return "yes"
    return _e(record.get("greedy_verdict") or "no")


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def methods_table(records: list[dict]) -> str:
    header = ["method", "tau [95% CI]", "alpha", "alpha per depth", "tokens/s",
              "speedup [95% CI]", "speedup per repeat", "target passes", "new tokens", "exact",
              "greedy identical"]
    rows = []
    for r in records:
        per_depth = r.get("alpha_per_depth")
        per_depth = ", ".join(_fmt(v) for v in per_depth) if isinstance(per_depth, list) else "-"
        repeats = r.get("speedup_per_repeat")
        repeats = ", ".join(_fmt(v) for v in repeats) if isinstance(repeats, list) else "-"
        rows.append([_e(r["method"]), _with_ci(r, "tau", "tau_ci95"), _fmt(r.get("alpha")),
                     per_depth, _fmt(r.get("tokens_per_s"), 2),
                     _with_ci(r, "speedup", "speedup_ci95"), repeats,
                     _fmt(r.get("target_passes")), _fmt(r.get("new_tokens")),
                     "yes" if r.get("exact", True) else "<b>no (lossy)</b>", _greedy_text(r)])
    return _table(header, rows)


def trees_table(records: list[dict]) -> str:
    """The trees ``--tree auto`` chose: expected (cost model) beside measured."""
    rows = []
    for r in records:
        t = r.get("tree")
        if not isinstance(t, dict):
            continue
        rows.append([_e(r["method"]), _fmt(t.get("depth")), _fmt(t.get("topk")),
                     _fmt(t.get("tree_nodes")),
                     f"{_fmt(t.get('expected_tau'))} / {_fmt(r.get('tau'))}",
                     f"{_fmt(t.get('expected_tokens_per_s'), 2)} / "
                     f"{_fmt(r.get('tokens_per_s'), 2)}",
                     _fmt(t.get("predicted_speedup"))])
    if not rows:
        return ""
    return ("<p>Trees chosen by <code>--tree auto</code> from this machine's measured costs "
            "and each head's measured acceptance. Expected tokens/s counts forward passes "
            "only (no prefill, sampling or bookkeeping).</p>"
            + _table(["method", "depth", "topk", "nodes", "tau expected / measured",
                      "tokens/s expected / measured", "predicted speedup over plain decoding"],
                     rows))


def categories_table(categories: list[dict]) -> str:
    names = [c.get("category") for c in categories]
    methods = list(dict.fromkeys(r.get("method") for c in categories
                                 for r in c.get("methods") or [] if isinstance(r, dict)))
    header = ["method"] + [f"{n} ({c.get('num_prompts', '?')} "
                           f"prompt{'' if c.get('num_prompts') == 1 else 's'})"
                           for n, c in zip(names, categories)]
    rows = []
    for m in methods:
        row = [_e(m)]
        for c in categories:
            r = next((x for x in c.get("methods") or [] if isinstance(x, dict)
                      and x.get("method") == m), {})
            speed = _with_ci(r, "speedup", "speedup_ci95")
            row.append(f"{speed}x, tau {_fmt(r.get('tau'))}" if speed != "-" else
                       f"tau {_fmt(r.get('tau'))}")
        rows.append(row)
    return _table(header, rows)


def divergences_table(records: list[dict]) -> str:
    rows = []
    for r in records:
        for d in r.get("divergences") or []:
            if not isinstance(d, dict):
                continue
            ref2, m2 = d.get("reference_top2") or {}, d.get("method_top2") or {}
            rows.append([_e(r["method"]), _fmt(d.get("prompt")), _fmt(d.get("position")),
                         f"{_fmt(d.get('reference_token'))} / {_fmt(d.get('method_token'))}",
                         f"{_fmt(ref2.get('margin'), 4)} / {_fmt(m2.get('margin'), 4)}",
                         f"{_fmt(d.get('reference_gap'), 4)} / {_fmt(d.get('method_gap'), 4)}",
                         f"{_fmt(d.get('tolerance'), 4)} ({_e(d.get('dtype', ''))})",
                         f"<b>{_e(d.get('classification'))}</b> {_e(d.get('note', ''))}"])
    if not rows:
        return ""
    return _table(["method", "prompt", "first differing token", "tokens hf / this",
                   "top-1 - top-2 logit: hf run / this run",
                   "gap between the two tokens: hf run / this run", "tolerance",
                   "classification"], rows)


def _config_table(config: dict) -> str:
    keys = ["target", "prompts", "num_prompts", "skipped_prompts", "categories", "turn",
            "max_new_tokens", "temperature", "top_k", "top_p", "seed", "repeats", "device",
            "dtype", "attn_implementation", "draft_dtype", "method_options", "tree", "threads", "torch",
            "transformers", "machine", "engine", "reference", "llama_server", "llama_cpp_commit",
            "target_gguf", "target_gguf_type", "head_gguf_type", "spec_draft_n_max",
            "spec_draft_p_min"]
    rows = [[_e(k), _e(json.dumps(config[k]) if isinstance(config[k], (dict, list))
                       else config[k])] for k in keys if k in config]
    return _table(["setting", "value"], rows)


def build_report(reports: list[tuple[str, dict]], metrics: list[Metrics],
                 notes: list[str] | None = None) -> Report:
    """The page's sections for the given reports and training metrics (already read)."""
    notes = list(notes or [])
    sections = {key: Section(key, title) for key, title in SECTIONS}
    many = len(reports) > 1

    def add(key: str, name: str | None, fragment: str = "",
            image: tuple[str, bytes | None] | None = None, missing: str = "") -> None:
        section = sections[key]
        if many and name:
            section.blocks.append(f"<h3>{_e(name)}</h3>")
        if fragment:
            section.blocks.append(fragment)
        if image is not None:
            caption, png = image
            if png is None:
                section.blocks.append(f"<p class='missing'>{_e(missing)}</p>")
            else:
                section.images.append((caption, png))
                section.blocks.append(_img(caption, png))

    for name, data in reports:
        records = [r for r in data["methods"] if isinstance(r, dict)]
        config = data.get("config", {})
        ref = config.get("reference", "hf")  # --engine llama.cpp: its plain decoding
        verdict = data.get("greedy_summary") or greedy_summary(records, reference=ref)
        old = data.get("version", 1) < REPORT_VERSION
        intro = (f"<p><b>{_e(verdict)}</b></p>"
                 + (f"<p class='missing'>{_e(name)} was written by an older draftsmith.eval.bench (report "
                    "version 1): it holds no per-prompt figures, intervals, categories or "
                    "accepted lengths; run draftsmith.eval.bench again for them.</p>" if old else "")
                 + methods_table(records) + trees_table(records) + _config_table(config)
                 + ("" if old else
                    f"<p class='note'>Intervals: {int(CONFIDENCE * 100)}% percentile bootstrap "
                    f"over prompts ({BOOTSTRAP_RESAMPLES} resamples, the method and {ref} "
                    "resampled together), both fixed.</p>"))
        add("summary", name, intro)
        add("speedup", name, image=(f"{name}: speedup over {ref}",
                                    speedup_figure(records, ref)),
            missing=f"no method in this report has a speedup ({ref} was not run?)")
        add("tokens-per-prompt", name,
            image=(f"{name}: tokens/s per prompt", tokens_per_prompt_figure(records)),
            missing="this report holds no per-prompt figures (an older draftsmith.eval.bench wrote it)")
        add("acceptance", name, image=(f"{name}: tau", tau_figure(records)),
            missing="no method in this report has a tau")
        add("acceptance", None, image=(f"{name}: alpha per depth", alpha_figure(records)),
            missing="no method in this report drafts tokens (alpha per depth needs one)")
        add("accepted-lengths", name,
            image=(f"{name}: accepted draft tokens per round", accepted_lengths_figure(records)),
            missing="no accepted-length counts in this report (methods of ours that draft "
                    "record them; transformers' do not)")
        categories = [c for c in data.get("categories") or [] if isinstance(c, dict)]
        empty = [c.get("category") for c in categories if not c.get("num_prompts")]
        categories = [c for c in categories if c.get("num_prompts")]
        if empty:
            notes.append(f"{name}: categories without prompts skipped: {empty}")
        if categories:
            add("categories", name, categories_table(categories),
                image=(f"{name}: speedup per category", categories_figure(categories, ref)),
                missing=f"no speedup per category ({ref} was not run?)")
        else:
            add("categories", name, "<p class='missing'>the prompts of this report carry no "
                "category (MT-bench and Spec-Bench files do)</p>")
        table = divergences_table(records)
        add("greedy", name, f"<p>{_e(verdict)}</p>" + (table or (
            "<p>no differing outputs</p>" if any(r.get("greedy_identical") is not None
                                                 for r in records)
            else "<p>not checked: sampling (temperature > 0)</p>")))
    if metrics:
        skipped = [f"{m.name}: {m.skipped} lines skipped (not a JSON record with an integer "
                   "step)" for m in metrics if m.skipped]
        fragment = "".join(f"<p class='missing'>{_e(s)}</p>" for s in skipped)
        listed = ", ".join(f"{m.name} ({len(m.records)} records)" for m in metrics)
        sections["training"].blocks.append(f"<p>runs: {_e(listed)}</p>{fragment}")
        for title, png, missing in training_figures(metrics):
            sections["training"].blocks.append(f"<h3>{_e(title)}</h3>")
            if png is None:
                sections["training"].blocks.append(f"<p class='missing'>{_e(missing)}</p>")
            else:
                sections["training"].images.append((title, png))
                sections["training"].blocks.append(_img(title, png))
    else:
        sections["training"].blocks.append(
            "<p class='missing'>no training metrics given (--metrics runs/NAME/metrics.jsonl)</p>")
    return Report(list(sections.values()), notes)


def _img(caption: str, png: bytes) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (f"<figure><img alt='{_e(caption)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{_e(caption)}</figcaption></figure>")


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; } figure { margin: 1em 0; } img { max-width: 100%; }
figcaption { font-size: 0.85em; color: #555; } .missing { color: #8a5a00; }
.note { font-size: 0.85em; color: #555; } nav a { margin-right: 1em; }
"""


def render_html(report: Report, title: str = "draftsmith benchmark report") -> str:
    nav = "".join(f"<a href='#{s.key}'>{_e(s.title)}</a>" for s in report.sections)
    notes = "".join(f"<p class='missing'>{_e(n)}</p>" for n in report.notes)
    body = "".join(f"<section id='{s.key}'><h2>{_e(s.title)}</h2>{''.join(s.blocks)}</section>"
                   for s in report.sections)
    return (f"{_HTML_START}{_e(title)}"
            f"</title><style>{_STYLE}</style></head><body><h1>{_e(title)}</h1><nav>{nav}</nav>"
            f"{notes}{body}</body></html>")


# how every page render_html writes begins: what marks an earlier report that --out may replace
_HTML_START = "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>"


def is_html_report(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a page :func:`render_html` wrote (an earlier report)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(_HTML_START)) == _HTML_START.encode()
    except OSError:
        return False


def is_bench_report(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a benchmark report draftsmith.eval.bench wrote (an earlier one)."""
    try:
        read_report(path)
    except ReportError:
        return False
    return True


def check_report_out(path: str | os.PathLike, *, inputs=(), overwrite: bool = False,
                     html: bool | None = None) -> Path:
    """Refuse a report path before any work: never one of the command's ``inputs`` (a prompts
    file, a metrics.jsonl, an artifact directory and the files in it; see
    :func:`draftsmith.files.output_dir.named_paths`), not even with ``overwrite``; an existing file only
    when it is an earlier report of its kind (a page when ``html``, by default for a ``.html`` or
    ``.htm`` name; else a benchmark JSON) or with ``overwrite``."""
    html_out = Path(path).suffix.lower() in (".html", ".htm") if html is None else html
    return check_file_destination(
        path, kind="HTML report" if html_out else "draftsmith.eval.bench report",
        replaceable=is_html_report if html_out else is_bench_report, overwrite=overwrite,
        protect=inputs)


# ---------------------------------------------------------------------------------------------
# Weights & Biases


def wandb_mode() -> str:
    """W&B's own convention: ``$WANDB_MODE`` when set; else "online" when the user is logged in,
    "offline" otherwise.

    Logged in: ``$WANDB_API_KEY`` or ``$WANDB_IDENTITY_TOKEN_FILE`` is set, or the netrc file
    (``$NETRC``, else ``~/.netrc``, where ``wandb login`` writes the key) has an entry for the W&B
    host (``$WANDB_BASE_URL``, default api.wandb.ai). Nothing is sent to check the key.
    """
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online"
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    candidates = [Path(os.environ["NETRC"]).expanduser()] if os.environ.get("NETRC") else [
        Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    for path in candidates:
        if not path.is_file():
            continue
        try:
            if host and netrc.netrc(str(path)).authenticators(host):
                return "online"
        except (netrc.NetrcParseError, OSError):
            continue
    return "offline"


def announce_wandb_run(run, mode: str, stream=None) -> str:
    """Say at a run's start where its W&B data goes; returns the line printed.

    Online: the run's URL. Offline: that nothing leaves the machine and the ``wandb sync``
    command that uploads the run later (``wandb login`` first).
    """
    if mode == "disabled" or run is None:
        line = "[draftsmith] W&B: disabled (WANDB_MODE=disabled)"
    elif mode == "offline":
        run_dir = Path(run.dir).parent if getattr(run, "dir", None) else Path("wandb")
        reason = ("WANDB_MODE=offline" if os.environ.get("WANDB_MODE") == "offline"
                  else "not logged in to W&B")
        line = (f"[draftsmith] W&B: offline ({reason}); nothing leaves this machine. To upload "
                f"this run later: wandb login, then wandb sync {run_dir}")
    else:
        line = f"[draftsmith] W&B: online, run at {getattr(run, 'url', None) or '(no URL)'}"
    print(line, file=stream or sys.stderr, flush=True)
    return line


def log_to_wandb(report: dict, config: dict, project: str) -> None:
    """The benchmark's tables and the page's figures, as a W&B run (job type "bench")."""
    import wandb
    from PIL import Image

    mode = wandb_mode()
    run = wandb.init(project=project, job_type="bench", config=config, mode=mode)
    announce_wandb_run(run, mode)
    records = report["methods"]

    def table(rows: list[dict]):
        cols = sorted({k for r in rows for k in r if k != "per_prompt"})
        return wandb.Table(columns=cols, data=[[json.dumps(r.get(c)) if isinstance(
            r.get(c), (list, dict)) else r.get(c) for c in cols] for r in rows])

    logged = {"bench": table(records)}
    per_category = [{"category": c["category"], **r} for c in report.get("categories") or []
                    for r in c["methods"]]
    if per_category:
        logged["bench_per_category"] = table(per_category)
    divergences = [{"method": r["method"], **d} for r in records for d in r.get("divergences") or []]
    if divergences:
        logged["greedy_divergences"] = table(divergences)
    built = build_report([("bench", report)], [])
    for section in built.sections:
        for caption, png in section.images:
            logged[f"{section.key}/{caption.split(': ', 1)[-1]}"] = wandb.Image(
                Image.open(io.BytesIO(png)), caption=caption)
    run.log(logged)
    for r in records:
        for key in ("tau", "alpha", "tokens_per_s", "speedup"):
            if r.get(key) is not None:
                run.summary[f"{r['method']}/{key}"] = r[key]
    run.summary["greedy_summary"] = report.get("greedy_summary")
    run.finish()


# ---------------------------------------------------------------------------------------------
# the command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=program("python -m draftsmith.eval.report"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", help="report JSON files written by draftsmith.eval.bench --out")
    p.add_argument("--metrics", nargs="*", default=[],
                   help="training runs' metrics.jsonl files, for the training curves")
    p.add_argument("--out", required=True, help="the HTML file to write (new, or an earlier "
                   "report; never one of the inputs)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if it is not an earlier report (never an input)")
    p.add_argument("--title", default="draftsmith benchmark report")
    args = p.parse_args(argv)
    try:
        check_report_out(args.out, inputs=named_paths(*args.reports, *args.metrics),
                         overwrite=args.overwrite, html=True)
    except ValueError as err:
        p.error(f"--out: {err}")
    notes, reports, metrics = [], [], []
    for path in args.reports:
        try:
            reports.append((path, read_report(path)))
        except ReportError as err:
            notes.append(f"skipped {err}")
    for path in args.metrics:
        try:
            metrics.append(read_metrics(path))
        except ReportError as err:
            notes.append(f"skipped {err}")
    skipped = len(notes)
    if not reports:
        for note in notes:
            print(f"[report] {note}", file=sys.stderr)
        print(f"[report] error: none of the {len(args.reports)} report files can be used; "
              "nothing written", file=sys.stderr)
        return 2
    built = build_report(reports, metrics, notes)
    for note in built.notes:
        print(f"[report] {note}", file=sys.stderr)
    write_atomic(args.out, render_html(built, args.title))
    print(f"[report] written to {args.out} ({len(reports)} reports, {len(metrics)} training "
          f"runs, {skipped} files skipped)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
