"""Benchmark: every method on the same target and prompts, in one process, interleaved.

    python -m draftsmith.eval.bench --target smollm2-135m --method hf --method plain --method pld \\
        --method hf-pld --method draft:truncate:8 --method hf-assisted:truncate:8 \\
        --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 \\
        --max-new-tokens 128 --temperature 0 --out report.json --html report.html

Methods: ``plain`` (our engine, no draft), ``hf`` (transformers ``generate``), ``pld`` (our n-gram
lookup), ``hf-pld`` (``prompt_lookup_num_tokens``), ``draft:<dir|truncate:N>`` (our engine with a
draft LM), ``hf-assisted:<dir|truncate:N>`` (``assistant_model``), ``eagle:<artifact>`` and
``medusa:<artifact>`` (``medusa:typical:<artifact>``: Medusa's lossy typical acceptance, reported
``exact: false``). Prompts run one after another with every method, in an order rotated per
prompt, so machine drift hits all methods alike; a warm-up pass comes first; ``--repeats N`` runs
the whole interleaved set N times. ``speedup`` is tokens/s over ``hf`` measured in the same run
(``hf`` is added when not asked for), with a 95% bootstrap interval over prompts; prompts with a
``category`` (MT-bench, Spec-Bench) also get the table per category.
"""

from __future__ import annotations

import os

# MKL's default code path on AMD CPUs runs small fp32 GEMMs (2-32 rows: exactly what verifying a
# draft costs) 2-3x slower than its AUTO path; MKL reads this at its first GEMM, so it is set
# before any model runs. It applies to every method in the process alike; a user's own setting wins.
os.environ.setdefault("MKL_CBWR", "AUTO")

import argparse  # noqa: E402
import contextlib
import json
import platform
import sys
from pathlib import Path

import torch

from draftsmith.eval.engine import check_prompt
from draftsmith.eval.forward import COMPILE_MODES
from draftsmith.eval.llama_bench import ENGINE as LLAMA_ENGINE
from draftsmith.eval.llama_bench import EngineRun, check_work_dir, cross_check, llama_engine
from draftsmith.eval.methods import (
    build_methods,
    dest,
    method_for,
    option_flags,
    options_from_args,
    owners,
    resolve,
)
from draftsmith.eval.prompts import load_prompts
from draftsmith.eval.report import build_report, check_report_out, log_to_wandb, render_html
from draftsmith.eval.round_cost import cost_model_records
from draftsmith.eval.runners import (
    TREE_AUTO,
    TREE_MODES,
    Method,
    int_at_least,
    parse_finite,
    run_benchmark,
)
from draftsmith.eval.sampling import SamplingParams
from draftsmith.eval.summary import (
    REPORT_FORMAT,
    REPORT_VERSION,
    classify_divergence,
    first_difference,
    greedy_summary,
    greedy_verdict,
    summarise,
)
from draftsmith.eval.tree_auto import (
    CALIBRATION_NEW_TOKENS,
    CALIBRATION_NUM_PROMPTS,
    DEFAULT_CALIBRATION_PROMPTS,
)
from draftsmith.eval.tree_cost import CALIBRATION_BUDGET_S
from draftsmith.files.command_line import program, run_command
from draftsmith.files.output_dir import named_paths, write_atomic
from draftsmith.layouts.gguf import DEFAULT_GGUF_TYPE
from draftsmith.layouts.llama_cpp import GGUF_TYPES
from draftsmith.layouts.processes import stop_on_signals
from draftsmith.targets.target import dtype_name, load_target, parse_dtype

# ---------------------------------------------------------------------------------------------
# running


def explain_differences(methods: list[Method], records: list[dict], prompts: list[list[int]],
                        max_new_tokens: int, params: SamplingParams, dtype: torch.dtype,
                        reference: str = "hf") -> None:
    """For every greedy output that differs from the reference: where, and why (in place).

    Each differing prompt is replayed (untimed) by the method and by the reference with the
    target's logits recorded; at the first differing position the two tokens are classified as
    a numerical tie or a real divergence (draftsmith.eval.summary.classify_divergence). Sets each record's
    ``divergences`` and ``greedy_verdict``.
    """
    by_name = {m.name: m for m in methods}
    ref = by_name.get(reference)
    traces: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
    for record in records:
        differ = record.get("differing_prompts")
        if not differ or ref is None or record["method"] == reference:
            continue
        found = []
        for i in differ:
            if i not in traces:
                traces[i] = ref.trace(prompts[i], max_new_tokens, params)
            ref_tokens, ref_logits = traces[i]
            tokens, logits = by_name[record["method"]].trace(prompts[i], max_new_tokens, params)
            at = first_difference(ref_tokens, tokens)
            entry = {"prompt": i, "position": at}
            if at is None:
                entry.update({"classification": "numerical tie",
                              "note": "the outputs agreed when replayed: the difference did not "
                                      "recur, so it came from run-to-run rounding"})
            elif at >= min(len(ref_tokens), len(tokens)):
                entry.update({"classification": "real divergence",
                              "note": "one output stopped early (EOS) where the other went on"})
            else:
                entry.update(classify_divergence(ref_logits[at], logits[at], ref_tokens[at],
                                                 tokens[at], dtype))
            found.append(entry)
        record["divergences"] = found
        record["greedy_verdict"] = greedy_verdict(found)


def compile_seconds(methods: list[Method]) -> dict[str, float]:
    """Seconds spent compiling, per compiled module (the target, each draft), apart from every
    method's timed seconds."""
    from draftsmith.eval.forward import compiled_forwards

    return {name: round(seconds, 1) for name, seconds in compiled_forwards().items()}


# ---------------------------------------------------------------------------------------------
# the command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=program("python -m draftsmith.eval.bench"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m",
                   help="HF model directory, .gguf file, or embedded name (default smollm2-135m)")
    p.add_argument("--method", action="append", required=True, dest="methods",
                   help="repeat for several methods (see above)")
    p.add_argument("--prompts", required=True,
                   help="JSONL with 'turns' (MT-bench, Spec-Bench's question.jsonl) or plain text")
    p.add_argument("--prompt-format", choices=("chat", "text"), default="chat",
                   help="chat: each prompt is a user turn under the target's chat template "
                        "(default); text: the prompt as it is, continued (a base model such as "
                        "gemma3-270m, HumanEval's code prompts)")
    p.add_argument("--num-prompts", type=int_at_least(1), default=None,
                   help="use the first N prompts (default: all)")
    p.add_argument("--prompts-per-category", type=int_at_least(1), default=None,
                   help="use the first N prompts of each category (then --num-prompts)")
    p.add_argument("--category", action="append", dest="categories", default=None,
                   help="only prompts of this category (repeat for several)")
    p.add_argument("--turn", type=int_at_least(0), default=0,
                   help="which turn of multi-turn prompts (0-based); rows without it are skipped")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    p.add_argument("--temperature", type=parse_finite, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int_at_least(0), default=0, help="0 = off")
    p.add_argument("--top-p", type=parse_finite, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int_at_least(0), default=1,
                   help="prompts run (16 tokens) before timing")
    p.add_argument("--repeats", type=int_at_least(1), default=1,
                   help="run the whole interleaved set N times; each run's speedup is reported")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--html", default=None,
                   help="also write the HTML report here (python -m draftsmith.eval.report makes it later)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", type=parse_dtype, default=None,
                   help="the target's precision (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--draft-dtype", type=parse_dtype, default=None,
                   help="precision of draft LMs and EAGLE heads (e.g. bf16 beside an fp32 target "
                        "on a CPU); exactness depends on the target only (default: the target's)")
    p.add_argument("--attn-implementation", default=None,
                   help="the target's attention kernel: sdpa, eager, ... (default: transformers')")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--compile", choices=("auto", *COMPILE_MODES), default="auto",
                   help="compile the engine's and the drafts' forwards (draftsmith.eval.forward): on "
                        "(inductor's default), max (inductor's freezing pass, GEMMs "
                        "autotuned, kernels called from C++: the fastest rounds, 5-8 minutes "
                        "of compiling for a 135M target on 2 cores), off; auto: max for a "
                        "target of 50M parameters or more in a run decoding 10,000 tokens or "
                        "more in our engine (prompts x new tokens x repeats x methods), off "
                        "otherwise. Compile time is reported apart, never in a method's seconds "
                        "(default auto)")
    seen = {}
    for f in option_flags():
        seen.setdefault(f.flag, []).append(f)
    for flag, group in seen.items():
        defaults = (group[0].describe_default() if len(group) == 1 else
                    "; ".join(f"{f.kind} {f.describe_default()}" for f in group))
        text = " ".join(f.help for f in group if f.help)
        p.add_argument(flag, type=group[0].parse, default=None, dest=dest(flag),
                       help=f"{text} (default: {defaults})")
    p.add_argument("--tree", choices=TREE_MODES, default=TREE_AUTO,
                   help="auto: EAGLE and Medusa trees (depth, topk, nodes) chosen for the most "
                        "expected tokens/s from this machine's measured costs and the head's "
                        "measured acceptance, kept in <artifact>/tree_calibration.json; "
                        "--tree-depth/--tree-topk/--tree-nodes then cap the search. fixed: those "
                        "flags (or their defaults) as given (default: auto)")
    p.add_argument("--tree-calibration-prompts", default=str(DEFAULT_CALIBRATION_PROMPTS),
                   help="held-out questions on which --tree auto measures a head's acceptance "
                        "when its artifact has none (default: the Vicuna-bench questions)")
    p.add_argument("--tree-calibration-num-prompts", type=int_at_least(1),
                   default=CALIBRATION_NUM_PROMPTS,
                   help=f"how many of them (default {CALIBRATION_NUM_PROMPTS}, "
                        f"{CALIBRATION_NEW_TOKENS} tokens each)")
    p.add_argument("--tree-calibration-seconds", type=int_at_least(0),
                   default=int(CALIBRATION_BUDGET_S),
                   help="--tree auto: the most seconds a calibration may take before the run "
                        "(it is shrunk to fit, and its length said before it starts); 0 skips "
                        "it: a stored calibration is still used, else the fixed tree (default "
                        f"{CALIBRATION_BUDGET_S:g})")
    p.add_argument("--allow-other-weights", action="store_true",
                   help="accept heads trained for a target of the same shapes but other weights "
                        "(refused by default: both weight fingerprints are named)")
    p.add_argument("--engine", choices=("draftsmith", LLAMA_ENGINE), default="draftsmith",
                   help="draftsmith: our engine beside transformers (speedup over hf); llama.cpp: "
                        "one llama-server per method (speedup over llama.cpp's plain)")
    p.add_argument("--llama-draft-max", type=int_at_least(1), default=None,
                   help="llama.cpp: --spec-draft-n-max, draft tokens per round (default: "
                        "llama.cpp's 3 for EAGLE-3 heads and draft models, a block draft's block)")
    p.add_argument("--llama-draft-p-min", type=parse_finite, default=0.0,
                   help="llama.cpp: --spec-draft-p-min, stop drafting below this probability")
    p.add_argument("--gguf-type", choices=GGUF_TYPES, default=DEFAULT_GGUF_TYPE,
                   help=f"llama.cpp: the heads' and drafts' GGUF precision (default "
                        f"{DEFAULT_GGUF_TYPE})")
    p.add_argument("--gguf-target-type", choices=GGUF_TYPES, default=None,
                   help="llama.cpp: convert the target to a GGUF of this type (default: an "
                        "embedded name's or a .gguf's own file, f32 for a Hugging Face directory)")
    p.add_argument("--llama-ctx", type=int_at_least(256), default=2048,
                   help="llama.cpp: the servers' context size (at least the longest prompt plus "
                        "--max-new-tokens)")
    p.add_argument("--llama-work-dir", default=None,
                   help="llama.cpp: keep the run's GGUF exports and server logs here (default: a "
                        "temporary directory, removed at the end)")
    p.add_argument("--cross-check", action="store_true",
                   help="llama.cpp: also measure each head's acceptance per depth in draftsmith's "
                        "engine, on the same prompts and chain length, beside llama.cpp's")
    p.add_argument("--wandb", action="store_true",
                   help="log the tables and plots to Weights & Biases (online when logged in)")
    p.add_argument("--wandb-project", default="draftsmith")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for spec in args.methods:
        try:
            resolve(spec, args.engine)
        except ValueError as err:
            p.error(str(err))
    try:
        args.params = SamplingParams(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        p.error(str(err))
    if args.cross_check and (args.engine != LLAMA_ENGINE or args.llama_draft_p_min
                             or not args.params.greedy):
        # our engine drafts whole chains greedily: beside a p-min stop or sampled tokens the
        # per-depth counts would differ by rule, not by fault
        p.error("--cross-check compares llama.cpp's greedy full chains with ours: it needs "
                "--engine llama.cpp, --temperature 0 and no --llama-draft-p-min")
    # never onto an input (the prompts, the target, an artifact or a file in it), checked now
    inputs = named_paths(args.prompts, args.target, args.tree_calibration_prompts, *args.methods)
    check_distinct_outputs(p, args)
    if args.llama_work_dir:
        try:
            check_work_dir(args.llama_work_dir, inputs)
        except ValueError as err:
            p.error(f"--llama-work-dir: {err}")
    for name in ("out", "html"):
        if getattr(args, name):
            try:
                check_report_out(getattr(args, name), inputs=inputs, html=name == "html")
            except ValueError as err:
                p.error(f"--{name}: {err}")
    return args


OUTPUTS = ("out", "html", "llama_work_dir")  # what the command writes, each its own path


def check_distinct_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """No two outputs on one path (``--out r --html r`` would leave the page where the JSON was):
    refused before any work."""
    seen: dict[Path, str] = {}
    for name in OUTPUTS:
        value = getattr(args, name, None)
        if not value:
            continue
        path, flag = Path(value).expanduser().resolve(), "--" + name.replace("_", "-")
        for other, other_flag in seen.items():
            if other == path or (path.exists() and other.exists() and os.path.samefile(path,
                                                                                       other)):
                parser.error(f"{other_flag} and {flag} name the same path ({value}): one would "
                             "overwrite the other; give each its own path")
        seen[path] = flag


# --compile auto compiles (max) a target this large or larger for a run that decodes this many
# tokens in our engine or more: below either, compiling (minutes) outlasts what it would measure
COMPILE_FROM_PARAMETERS = 50_000_000
COMPILE_FROM_TOKENS = 10_000


def compile_choice(choice: str, target, engine_tokens: int) -> str:
    """``--compile``'s mode for ``target`` and a run decoding ``engine_tokens`` tokens in our
    engine ("auto": see the flag's help)."""
    if choice != "auto":
        return choice
    size = sum(p.numel() for p in target.model.parameters())
    return ("max" if size >= COMPILE_FROM_PARAMETERS and engine_tokens >= COMPILE_FROM_TOKENS
            else "off")


def draftsmith_engine(args, prompt_set, specs: list[str]) -> EngineRun:
    """Our engine (and transformers' generate for hf*): the methods of ``specs``, plain (the
    baseline of speedup) and hf (the greedy reference) added."""
    target = load_target(args.target, device=args.device, dtype=args.dtype,
                         attn_implementation=args.attn_implementation)
    prompts = [target.prompt_ids(p.text, args.prompt_format) for p in prompt_set.prompts]
    for ids in prompts:
        check_prompt(ids, args.max_new_tokens, target.vocab_size, target.max_context)
    for needed, why in (("hf", "greedy outputs are checked against it"),
                        ("plain", "speedup is measured against it in the same run")):
        if needed not in specs:
            print(f"[bench] adding `{needed}`: {why}", file=sys.stderr)
            specs = [needed, *specs]
    engine_specs = [spec for spec in specs if not spec.startswith("hf")]
    compile = compile_choice(args.compile, target, len(prompts) * args.max_new_tokens
                             * args.repeats * len(engine_specs))
    if compile != "off":
        print(f"[bench] --compile {compile}: the engine's forwards are compiled at their first "
              "use (minutes on a CPU, reported apart)", file=sys.stderr)
    uses_trees = any(method_for(s).trees for s in specs)
    if args.tree == TREE_AUTO and uses_trees and (
            Path(args.tree_calibration_prompts).resolve() == Path(args.prompts).resolve()):
        print("[bench] warning: --tree auto measures acceptance on the prompts being "
              "benchmarked (--tree-calibration-prompts is --prompts): the tree is tuned on the "
              "test set", file=sys.stderr)
    methods = build_methods(specs, target, draft_dtype=args.draft_dtype,
                            allow_other_weights=args.allow_other_weights, tree=args.tree,
                            tree_calibration={
                                "calibration_prompts": args.tree_calibration_prompts,
                                "num_prompts": args.tree_calibration_num_prompts,
                                "budget_seconds": args.tree_calibration_seconds},
                            options={kind: options_from_args(args, kind) for kind in owners()},
                            compile=compile,
                            max_cache_len=max(map(len, prompts)) + args.max_new_tokens)
    config = {"engine": "draftsmith", "device": str(target.device), "compile": compile,
              "attn_implementation": getattr(target.config, "_attn_implementation", None),
              "draft_dtype": None if args.draft_dtype is None else dtype_name(args.draft_dtype),
              "method_options": {kind: options_from_args(args, kind) for kind in owners()},
              "tree": args.tree}
    return EngineRun(methods, prompts, target, "hf", target.dtype, config,
                     speed_reference="plain")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt_set = load_prompts(args.prompts, turn=args.turn, limit=args.num_prompts,
                              per_category=args.prompts_per_category, categories=args.categories)
    for reason, count in prompt_set.skipped.items():
        print(f"[bench] skipped {count} rows of {args.prompts}: {reason}", file=sys.stderr)
    specs = list(dict.fromkeys(args.methods))
    with contextlib.ExitStack() as servers:  # --engine llama.cpp: stopped however the run ends
        if args.engine == LLAMA_ENGINE:
            run = llama_engine(args, prompt_set, specs, servers)
        else:
            run = draftsmith_engine(args, prompt_set, specs)
        methods, prompts = run.methods, run.prompts
        runs = run_benchmark(methods, prompts, max_new_tokens=args.max_new_tokens,
                             params=args.params, seed=args.seed, warmup=args.warmup,
                             repeats=args.repeats, progress=not args.no_progress)
        summary = summarise(runs, prompt_set.prompts, args.params.greedy,
                            reference=run.reference, speed_reference=run.speed_reference)
        for method, record in zip(methods, summary["methods"]):
            if getattr(method, "tree", None):
                record["tree"] = method.tree
            if getattr(method, "drafting", None):  # a draft LM's chain or static tree
                record["drafting"] = method.drafting
        report = build_bench_report(args, prompt_set, run, summary)
        # what was measured is on disk before anything interprets it (a failure below keeps it)
        save_report(args.out, report, None)
        steps = []
        if args.engine != LLAMA_ENGINE:
            steps.append(("cost model", lambda: cost_model_step(run, methods, summary, runs,
                                                                prompts, args.params)))
        if args.params.greedy:
            steps.append(("greedy differences explained", lambda: explain_step(
                args, run, methods, summary, prompts)))
        failed = interpret(report, steps)  # these replay prompts: llama-servers still running
    if args.engine == LLAMA_ENGINE and args.cross_check:
        failed += interpret(report, [("llama.cpp cross-check", lambda: cross_check(
            summary["methods"], run.target, prompts, max_new_tokens=args.max_new_tokens,
            chains={m.name: m.draft_max for m in methods if m.draft_max}))])
    report["greedy_summary"] = greedy_summary(summary["methods"], reference=run.reference)
    failed += interpret(report, [("printed table", lambda: print(format_report(report)))])
    save_report(args.out, report, failed)
    late = []  # outputs drawn from the saved report
    if args.html:
        late += interpret(report, [("HTML report", lambda: write_html(args, report))])
    if args.wandb:
        late += interpret(report, [("W&B", lambda: log_to_wandb(report, report["config"],
                                                                args.wandb_project))])
    if late:  # the report names them too
        failed += late
        save_report(args.out, report, failed)
    if failed:
        print(f"[bench] {', '.join(failed)} failed after the measurements: every measurement is "
              f"in {args.out or 'the table above'}; the failures are named in its 'failures'",
              file=sys.stderr)
        return 1
    return summary["methods"]


def build_bench_report(args, prompt_set, run, summary) -> dict:
    """The report as measured: config, prompts, every method's record (interpretation adds to
    the same dicts, so a rewrite after it carries both)."""
    import transformers

    config = {
        "target": args.target, "prompts": str(args.prompts),
        "prompt_format": args.prompt_format, "num_prompts": len(run.prompts),
        "skipped_prompts": dict(prompt_set.skipped),
        "turn": args.turn, "categories": prompt_set.categories,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed, "warmup": args.warmup,
        "repeats": args.repeats,
        "dtype": dtype_name(run.tie_dtype) if args.engine == LLAMA_ENGINE
        else dtype_name(run.target.dtype), "reference": run.reference,
        "speed_reference": run.speed_reference or run.reference,
        "threads": args.threads if args.engine == LLAMA_ENGINE else torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "machine": platform.machine(), "python": platform.python_version(),
    }
    config.update(run.config)  # the same dict the cost model and compile seconds land in
    run.config = config
    return {
        "format": REPORT_FORMAT, "version": REPORT_VERSION, "config": config,
        "prompts": [{"id": p.id, "category": p.category} for p in prompt_set.prompts],
        "methods": summary["methods"], "categories": summary["categories"],
        "greedy_summary": greedy_summary(summary["methods"], reference=run.reference),
    }


def save_report(out, report: dict, failed: list[str] | None) -> None:
    """Write the report (when --out was given), saying how far it got: ``failed`` None,
    "measured" (the runs' figures only); else "complete", or which interpreting steps failed."""
    stage = ("measured" if failed is None else "complete" if not failed
             else f"measured; {', '.join(failed)} failed")
    report["stage"] = stage
    if out:
        write_atomic(out, json.dumps(report, indent=2))
        print(f"[bench] report ({stage}) written to {out}", file=sys.stderr)


def interpret(report: dict, steps) -> list[str]:
    """Run each (name, step) after the measurements; a step that raises is named in the
    report's ``failures`` (with its error) and on stderr, and the others still run."""
    failed = []
    for name, step in steps:
        try:
            step()
        except Exception as err:  # noqa: BLE001 - whatever it was, the measurements stay
            failed.append(name)
            report.setdefault("failures", []).append(
                {"step": name, "error": f"{type(err).__name__}: {err}"})
            print(f"[bench] {name} failed: {type(err).__name__}: {err}", file=sys.stderr)
    return failed


def cost_model_step(run, methods, summary, runs, prompts, params) -> None:
    print("[bench] timing rounds for the cost model (predicted beside measured)",
          file=sys.stderr)
    run.config["cost_model"] = cost_model_records(methods, summary["methods"], runs, prompts,
                                                  params)
    run.config["compile_seconds"] = compile_seconds(methods)


def explain_step(args, run, methods, summary, prompts) -> None:
    explain_differences(methods, summary["methods"], prompts, args.max_new_tokens,
                        args.params, run.tie_dtype, reference=run.reference)
    found = {r["method"]: r.get("divergences") or [] for r in summary["methods"]}
    for group in summary["categories"]:  # each category's verdict from its own prompts
        for r in group["methods"]:
            if r.get("differing_prompts"):
                mine = [d for d in found.get(r["method"], [])
                        if d.get("prompt") in r["differing_prompts"]]
                r["greedy_verdict"] = greedy_verdict(mine) if mine else None


def write_html(args, report: dict) -> None:
    built = build_report([(str(args.out or "this run"), report)], [])
    write_atomic(args.html, render_html(built))
    print(f"[bench] HTML report written to {args.html}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# the printed table


def _cell(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _with_interval(value, interval) -> str:
    if value is None:
        return "-"
    if not interval:
        return f"{value:.3f}"
    return f"{value:.3f} [{interval[0]:.2f}, {interval[1]:.2f}]"


def _greedy_cell(record: dict) -> str:
    if record.get("greedy_identical") is None:
        return "-"
    verdict = record.get("greedy_verdict")
    if record["greedy_identical"]:
        return "yes"
    return {"identical up to numerics": "up to numerics", "diverged": "DIVERGED",
            "differs, unexplained": "unexplained"}.get(verdict, "NO")


def format_table(records: list[dict]) -> str:
    """The per-method table: tau and speedup with their 95% intervals."""
    repeats = any(r.get("speedup_per_repeat") for r in records)
    vs_hf = any(r.get("speedup_vs_hf") is not None for r in records)
    reads = any(r.get("host_reads_per_round") is not None for r in records)
    cols = ["method", "tau [95% CI]", "alpha", "tokens/s", "speedup [95% CI]"]
    if repeats:
        cols.append("speedup per repeat")
    if vs_hf:
        cols.append("vs hf")
    if reads:
        cols.append("reads/round")
    cols += ["target passes", "new tokens", "greedy identical"]
    rows = [cols]
    for r in records:
        row = [r["method"], _with_interval(r.get("tau"), r.get("tau_ci95")), _cell(r.get("alpha")),
               _cell(r.get("tokens_per_s"), 2), _with_interval(r.get("speedup"),
                                                                r.get("speedup_ci95"))]
        if repeats:
            spread = r.get("speedup_per_repeat")
            row.append("-" if not spread else
                       " ".join(_cell(v) for v in spread))
        if vs_hf:
            row.append(_cell(r.get("speedup_vs_hf")))
        if reads:
            row.append(_cell(r.get("host_reads_per_round"), 2))
        row += [_cell(r.get("target_passes")), _cell(r.get("new_tokens")), _greedy_cell(r)]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_categories(categories: list[dict], reference: str = "hf") -> str:
    """Speedup (tau) per method and category, as Spec-Bench reports it."""
    if not categories:
        return ""
    names = [c["category"] for c in categories]
    methods = [r["method"] for r in categories[0]["methods"]]
    rows = [["method"] + [f"{n} ({c['num_prompts']})" for n, c in zip(names, categories)]]
    for i, method in enumerate(methods):
        row = [method]
        for c in categories:
            r = c["methods"][i]
            speed = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
            tau = "-" if r.get("tau") is None else f"{r['tau']:.2f}"
            row.append(f"{speed} ({tau})")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return (f"per category: speedup over {reference} (tau); prompts per category in brackets\n"
            + "\n".join(lines))


def format_trees(records: list[dict]) -> str:
    """The trees --tree auto chose, expected beside measured."""
    lines = []
    for r in records:
        t = r.get("tree")
        if not t:
            continue
        lines.append(
            f"  {r['method']}: depth {t['depth']}, topk {t['topk']}, {t['tree_nodes']} nodes; "
            f"tau expected {t['expected_tau']:.2f} / measured {_cell(r.get('tau'), 2)}; "
            f"tokens/s expected {t['expected_tokens_per_s']:.2f} (whole rounds at 128 cached tokens) / "
            f"measured {_cell(r.get('tokens_per_s'), 2)}")
    return "trees chosen by --tree auto:\n" + "\n".join(lines) if lines else ""


def format_costs(report: dict) -> str:
    """The cost model's prediction beside the measured decoding, and the compile time."""
    lines = []
    for r in report["methods"]:
        c = r.get("cost_model")
        if not c or c.get("predicted_decode_tokens_per_s") is None:
            continue
        flag = "  <-- OFF BY MORE THAN 15%" if c.get("flagged") else ""
        lines.append(f"  {r['method']}: decoding tokens/s predicted "
                     f"{c['predicted_decode_tokens_per_s']:.2f} / measured "
                     f"{c['measured_decode_tokens_per_s']:.2f} "
                     f"({100 * c['prediction_error']:+.1f}%){flag}")
    config = report.get("config", {})
    compiled = config.get("compile_seconds") or {}
    tail = ""
    if config.get("compile") not in (None, "off"):
        tail = (f"\ncompiled ({config['compile']}): " + ", ".join(
            f"{k} {v:.0f} s" for k, v in compiled.items()) + " (not in any method's seconds)")
    if not lines:
        return tail.strip()
    return ("cost model (rounds timed after the run, applied to the rounds that ran):\n"
            + "\n".join(lines) + tail)


def _number(value, spec: str = ".4g") -> str:
    return "unknown" if value is None else format(value, spec)


def config_reference(report: dict) -> str:
    return report.get("config", {}).get("reference", "hf")


def format_report(report: dict) -> str:
    parts = [format_table(report["methods"]), format_trees(report["methods"]),
             format_costs(report)]
    if report.get("categories"):
        config = report.get("config", {})
        parts.append(format_categories(report["categories"],
                                       config.get("speed_reference") or config.get("reference",
                                                                                   "hf")))
    parts.append(report.get("greedy_summary", ""))
    for r in report["methods"]:
        for d in r.get("divergences") or []:
            if "reference_gap" in d:
                reference = config_reference(report)
                parts.append(
                    f"  {r['method']}: prompt {d['prompt']}, token {d['position']}: {reference} "
                    f"{d['reference_token']} / this {d['method_token']}, gap "
                    f"{_number(d['reference_gap'])} in {reference}'s run and "
                    f"{_number(d['method_gap'])} in this one (top-1/top-2 margins "
                    f"{_number(d['reference_top2']['margin'])} / "
                    f"{_number(d['method_top2']['margin'])}, tolerance "
                    f"{_number(d['tolerance'], '.3g')} in {d['dtype']}): {d['classification']}"
                    + (f" ({d['note']})" if d.get("note") else ""))
            else:
                parts.append(f"  {r['method']}: prompt {d['prompt']}: {d['classification']} "
                             f"({d.get('note', '')})")
    return "\n\n".join(p for p in parts if p)


def run_cli(argv=None) -> int:
    """``python -m draftsmith.eval.bench``: errors in the user's input end in one line, not a traceback; a
    signal (SIGTERM, Ctrl-C, SIGHUP) stops every llama-server and removes the temporary work
    directory before the exit (status 128 + the signal's number)."""
    prog = "python -m draftsmith.eval.bench"
    with stop_on_signals(prog):
        return run_command(lambda: main(argv), prog)


if __name__ == "__main__":
    sys.exit(run_cli())
