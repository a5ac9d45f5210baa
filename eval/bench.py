"""Benchmark: every method on the same target and prompts, in one process, interleaved.

    python -m eval.bench --target smollm2-135m --method hf --method plain --method pld \\
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
import inspect
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from distill.draft import load_draft
from eval.eagle import EagleProposer
from eval.engine import SpeculativeEngine, check_prompt
from eval.medusa import MedusaProposer, TypicalMedusaProposer
from eval.prompts import load_prompts
from eval.proposers import DraftModelProposer, NgramProposer, Proposer
from eval.report import (
    build_report,
    check_writable,
    log_to_wandb,
    render_html,
    write_atomic,
)
from eval.sampling import SamplingParams
from eval.summary import (
    REPORT_FORMAT,
    REPORT_VERSION,
    MethodRuns,
    PromptRun,
    classify_divergence,
    first_difference,
    greedy_summary,
    greedy_verdict,
    summarise,
)
from eval.tree_auto import (
    CALIBRATION_NEW_TOKENS,
    CALIBRATION_NUM_PROMPTS,
    DEFAULT_CALIBRATION_PROMPTS,
    auto_eagle_tree,
    auto_medusa_tree,
)
from heads.medusa_tree import AUTO
from heads.target import Target, dtype_name, load_target, parse_dtype

FIXED_METHODS = ("plain", "hf", "pld", "hf-pld")
TREE_AUTO, TREE_FIXED = "auto", "fixed"
TREE_MODES = (TREE_AUTO, TREE_FIXED)
PREFIX_METHODS = ("draft:", "hf-assisted:", "eagle:", "medusa:")
TYPICAL_PREFIX = "typical:"


class Method:
    """A named way to generate: run(prompt_ids) -> PromptRun; trace() also returns the logits."""

    name: str
    exact = True

    def run(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
            seed: int) -> PromptRun:
        raise NotImplementedError

    def trace(self, prompt_ids: list[int], max_new_tokens: int,
              params: SamplingParams) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy tokens and the target's logits (vocab,) behind each (untimed; for reports)."""
        raise NotImplementedError


class EngineMethod(Method):
    def __init__(self, name: str, engine: SpeculativeEngine, proposer: Proposer | None,
                 tree: dict | None = None):
        self.name, self.engine, self.proposer = name, engine, proposer
        self.exact = getattr(proposer, "exact", True)
        self.tree = tree  # how --tree auto chose the proposer's tree, for the report

    def run(self, prompt_ids, max_new_tokens, params, seed):
        g = self.engine.generate(prompt_ids, max_new_tokens, params, self.proposer, seed=seed)
        return PromptRun(g.tokens, g.seconds, g.target_passes, g.acceptance, g.accepted_lengths)

    def trace(self, prompt_ids, max_new_tokens, params):
        g = self.engine.generate(prompt_ids, max_new_tokens, params, self.proposer, seed=0,
                                 record_logits=True)
        return g.tokens, g.logits


class HFMethod(Method):
    """transformers ``generate``; target forwards are counted with a hook on the target."""

    def __init__(self, name: str, target: Target, **generate_kwargs):
        self.name, self.target, self.kwargs = name, target, generate_kwargs
        self.calls = 0
        target.model.register_forward_hook(self._count)
        self.counting = False

    def _count(self, module, args, output):
        if self.counting:
            self.calls += 1

    def _generate(self, prompt_ids, max_new_tokens, params, seed, **extra):
        ids = torch.tensor([prompt_ids], device=self.target.device)
        sampling = (
            {"do_sample": False} if params.greedy else
            {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k,
             "top_p": params.top_p}
        )
        if not params.greedy:
            torch.manual_seed(seed)
        eos = list(self.target.eos_token_ids)  # the engine's stopping tokens, for both
        return self.target.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            eos_token_id=eos or None, pad_token_id=eos[0] if eos else None,
            **sampling, **self.kwargs, **extra,
        )

    @torch.no_grad()
    def run(self, prompt_ids, max_new_tokens, params, seed):
        self.calls, self.counting = 0, True
        start = time.perf_counter()
        out = self._generate(prompt_ids, max_new_tokens, params, seed)
        seconds = time.perf_counter() - start
        self.counting = False
        tokens = out[0, len(prompt_ids):].tolist()
        return PromptRun(tokens, seconds, max(0, self.calls - 1))

    @torch.no_grad()
    def trace(self, prompt_ids, max_new_tokens, params):
        out = self._generate(prompt_ids, max_new_tokens, params, 0, output_logits=True,
                             return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        return tokens, [row[0].float().cpu() for row in out.logits]


# ---------------------------------------------------------------------------------------------
# methods and their options


@dataclass(frozen=True)
class OptionFlag:
    """One library option of a method kind, and the command-line flag that sets it."""

    kind: str  # "pld", "draft", "eagle", "medusa"
    owner: object  # the callable whose signature holds the option and its one default
    keyword: str
    flag: str
    parse: object  # str -> value
    help: str
    unset: str = "the artifact's"  # what a default of None means

    def describe_default(self) -> str:
        return self.unset if self.default is None else repr(self.default)

    @property
    def default(self):
        return inspect.signature(self.owner).parameters[self.keyword].default


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def _probability(text: str) -> float:
    value = _finite(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _tree_nodes(text: str) -> int | str:
    return AUTO if text == AUTO else _int_at_least(1)(text)


def _branching(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be counts per depth like 4,2,1, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"must be counts >= 1 per depth like 4,2,1, got {text!r}")
    return counts


def _children(text: str) -> str:
    if text not in ("topk", "sample"):
        raise argparse.ArgumentTypeError(f"must be topk or sample, got {text!r}")
    return text


# Every option of every proposer, with its flag; defaults are read from the library's signatures.
OPTION_FLAGS = (
    OptionFlag("pld", NgramProposer, "max_ngram", "--pld-max-ngram", _int_at_least(1),
               "pld: longest n-gram matched"),
    OptionFlag("pld", NgramProposer, "min_ngram", "--pld-min-ngram", _int_at_least(1),
               "pld: shortest n-gram matched"),
    OptionFlag("pld", NgramProposer, "max_depth", "--pld-depth", _int_at_least(1),
               "pld: tokens continued after a match; also hf-pld's prompt_lookup_num_tokens"),
    OptionFlag("pld", NgramProposer, "max_branches", "--pld-branches", _int_at_least(1),
               "pld: continuations of distinct earlier matches merged into a tree"),
    OptionFlag("pld", NgramProposer, "tree_nodes", "--pld-tree-nodes", _int_at_least(1),
               "pld: nodes of the n-gram tree"),
    OptionFlag("draft", DraftModelProposer, "max_depth", "--draft-depth", _int_at_least(1),
               "draft: most draft tokens per round (a chain)"),
    OptionFlag("draft", DraftModelProposer, "min_confidence", "--draft-min-confidence",
               _probability, "draft: stop drafting after a token the draft gives less than this"),
    OptionFlag("draft", DraftModelProposer, "branching", "--draft-branching", _branching,
               "draft: a static tree instead of a chain, children per node at each depth "
               "(e.g. 4,2,1)", unset="a chain"),
    OptionFlag("draft", DraftModelProposer, "children", "--draft-children", _children,
               "draft trees: topk (the draft's best, point-mass rule) or sample (i.i.d. "
               "samples, SpecInfer's rule; greedy at temperature 0)"),
    OptionFlag("eagle", EagleProposer.from_artifact, "depth", "--tree-depth", _int_at_least(1),
               "eagle: EAGLE-2 tree depth; medusa: cap on the tree's depth"),
    OptionFlag("eagle", EagleProposer.from_artifact, "topk", "--tree-topk", _int_at_least(1),
               "eagle: children per expanded node; medusa: cap on the tree's ranks"),
    OptionFlag("eagle", EagleProposer.from_artifact, "tree_nodes", "--tree-nodes", _tree_nodes,
               "eagle: draft tokens per tree; medusa: rebuild the artifact's tree with this many "
               "nodes from its stored accuracies, or 'auto': the size that maximises expected "
               "tau per verification cost measured on this machine"),
    OptionFlag("medusa", MedusaProposer.from_artifact, "tree_nodes", "--tree-nodes", _tree_nodes,
               ""),
    OptionFlag("medusa", MedusaProposer.from_artifact, "max_depth", "--tree-depth",
               _int_at_least(1), ""),
    OptionFlag("medusa", MedusaProposer.from_artifact, "max_topk", "--tree-topk",
               _int_at_least(1), ""),
    OptionFlag("medusa", TypicalMedusaProposer, "posterior_threshold",
               "--medusa-posterior-threshold", _probability,
               "medusa:typical: a node is plausible when the target gives it more than "
               "min(threshold, alpha * exp(-entropy))"),
    OptionFlag("medusa", TypicalMedusaProposer, "posterior_alpha", "--medusa-posterior-alpha",
               _probability, "medusa:typical: see --medusa-posterior-threshold"),
)
# Options of the library entry points that no flag sets, and why.
FIXED_OPTIONS = {
    ("draft", "name"): "the method's name on the command line",
    ("eagle", "name"): "the method's name on the command line",
    ("eagle", "dtype"): "--draft-dtype",
    ("medusa", "name"): "the method's name on the command line",
    ("medusa", "typical"): "medusa:typical:<artifact>",
    ("eagle", "allow_other_weights"): "--allow-other-weights",
    ("medusa", "allow_other_weights"): "--allow-other-weights",
}
OWNERS = {"pld": NgramProposer, "draft": DraftModelProposer,
          "eagle": EagleProposer.from_artifact, "medusa": MedusaProposer.from_artifact}


def options_from_args(args: argparse.Namespace, kind: str) -> dict:
    """The options of one method kind the user set on the command line (None: not set)."""
    options = {}
    for f in OPTION_FLAGS:
        value = getattr(args, _dest(f.flag))
        if f.kind == kind and value is not None:
            options[f.keyword] = value
    return options


def _cap(tree_nodes):
    return None if tree_nodes in (None, AUTO) else tree_nodes


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def build_methods(specs: list[str], target: Target, *, pld_options: dict | None = None,
                  draft_options: dict | None = None, eagle_options: dict | None = None,
                  medusa_options: dict | None = None,
                  draft_dtype: torch.dtype | None = None,
                  allow_other_weights: bool = False, tree: str = TREE_FIXED,
                  tree_calibration: dict | None = None) -> list[Method]:
    """Method names -> runnable methods (drafts loaded once and shared).

    ``*_options``: keyword options of that kind's proposer (NgramProposer, DraftModelProposer,
    EagleProposer.from_artifact, MedusaProposer.from_artifact); ``draft_dtype``: the precision
    of draft LMs and EAGLE heads (None: the target's); ``allow_other_weights``: heads trained
    for a target of the same shapes but other weights are accepted (otherwise refused).
    ``tree="auto"``: EAGLE and Medusa trees are chosen by expected tokens/s on this machine
    (eval.tree_auto); their depth / topk / tree_nodes options then cap the search.
    ``tree_calibration``: keyword options of the acceptance measurement (calibration_prompts,
    num_prompts, max_new_tokens) for artifacts that have none.
    """
    if tree not in TREE_MODES:
        raise ValueError(f"tree must be one of {', '.join(TREE_MODES)}, got {tree!r}")
    pld_options, draft_options = dict(pld_options or {}), dict(draft_options or {})
    eagle_options, medusa_options = dict(eagle_options or {}), dict(medusa_options or {})
    calibration = dict(tree_calibration or {})
    if tree == TREE_FIXED and eagle_options.get("tree_nodes") == AUTO:
        raise ValueError("EAGLE trees take a node count; --tree auto (the command line's "
                         "default) chooses their depth, topk and nodes by measured cost")
    if tree == TREE_AUTO:  # the options cap the search
        eagle_caps = {"max_depth": eagle_options.pop("depth", None),
                      "max_topk": eagle_options.pop("topk", None),
                      "max_nodes": _cap(eagle_options.pop("tree_nodes", None))}
        medusa_caps = {"max_depth": medusa_options.pop("max_depth", None),
                       "max_topk": medusa_options.pop("max_topk", None),
                       "max_nodes": _cap(medusa_options.pop("tree_nodes", None))}
    engine = SpeculativeEngine(target)
    drafts: dict[str, torch.nn.Module] = {}

    def draft(spec: str):
        if spec not in drafts:
            drafts[spec] = load_draft(spec, target, dtype=draft_dtype)
        return drafts[spec]

    methods: list[Method] = []
    for spec in specs:
        if spec == "plain":
            methods.append(EngineMethod(spec, engine, None))
        elif spec == "hf":
            methods.append(HFMethod(spec, target))
        elif spec == "pld":
            methods.append(EngineMethod(spec, engine, NgramProposer(**pld_options)))
        elif spec == "hf-pld":
            depth = pld_options.get(
                "max_depth", inspect.signature(NgramProposer).parameters["max_depth"].default)
            methods.append(HFMethod(spec, target, prompt_lookup_num_tokens=depth))
        elif spec.startswith("draft:"):
            methods.append(EngineMethod(spec, engine, DraftModelProposer(
                draft(spec[len("draft:"):]), name=spec, **draft_options)))
        elif spec.startswith("hf-assisted:"):
            methods.append(HFMethod(spec, target, assistant_model=draft(spec[len("hf-assisted:"):])))
        elif spec.startswith("eagle:"):
            path = spec[len("eagle:"):]
            proposer = EagleProposer.from_artifact(path, target, dtype=draft_dtype,
                                                   name=spec, allow_other_weights=allow_other_weights,
                                                   **eagle_options)
            chosen = None
            if tree == TREE_AUTO:
                chosen = auto_eagle_tree(proposer, path, target, draft_dtype=draft_dtype,
                                         **eagle_caps, **calibration)
            methods.append(EngineMethod(spec, engine, proposer, chosen))
        elif spec.startswith("medusa:"):
            path = spec[len("medusa:"):]
            typical = path.startswith(TYPICAL_PREFIX)
            if not typical:
                for key in ("posterior_threshold", "posterior_alpha"):
                    if key in medusa_options:
                        raise ValueError(f"--medusa-{key.replace('_', '-')} tunes Medusa's "
                                         "typical acceptance: use medusa:typical:<artifact>")
            proposer = MedusaProposer.from_artifact(
                path[len(TYPICAL_PREFIX):] if typical else path, target, typical=typical,
                name=spec, allow_other_weights=allow_other_weights, **medusa_options)
            chosen = None
            if tree == TREE_AUTO:
                paths, chosen = auto_medusa_tree(
                    path[len(TYPICAL_PREFIX):] if typical else path, target, proposer.heads,
                    proposer.tree_info, **medusa_caps, **calibration)
                proposer.set_tree(paths)
            methods.append(EngineMethod(spec, engine, proposer, chosen))
        else:
            raise ValueError(
                f"unknown method {spec!r}; use one of plain, hf, pld, hf-pld, "
                "draft:<dir|truncate:N>, hf-assisted:<dir|truncate:N>, eagle:<artifact>, "
                "medusa:<artifact>, medusa:typical:<artifact>"
            )
    return methods


# ---------------------------------------------------------------------------------------------
# running


def run_benchmark(methods: list[Method], prompts: list[list[int]], *, max_new_tokens: int,
                  params: SamplingParams, seed: int = 0, warmup: int = 1, repeats: int = 1,
                  progress: bool = True) -> list[MethodRuns]:
    """Every method on every prompt (interleaved, rotated per prompt), ``repeats`` times over."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for ids in prompts[:warmup]:
        for m in methods:
            m.run(ids, min(max_new_tokens, 16), params, seed)
    runs = {m.name: MethodRuns(m.name, m.exact, []) for m in methods}
    bar = tqdm(total=repeats * len(prompts) * len(methods), desc="bench", disable=not progress,
               file=sys.stderr)
    for _ in range(repeats):
        for m in methods:
            runs[m.name].runs.append([])
        for i, ids in enumerate(prompts):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            for m in order:
                bar.set_postfix_str(m.name)
                runs[m.name].runs[-1].append(m.run(ids, max_new_tokens, params, seed + i))
                bar.update()
    bar.close()
    return [runs[m.name] for m in methods]


def explain_differences(methods: list[Method], records: list[dict], prompts: list[list[int]],
                        max_new_tokens: int, params: SamplingParams, dtype: torch.dtype,
                        reference: str = "hf") -> None:
    """For every greedy output that differs from the reference: where, and why (in place).

    Each differing prompt is replayed (untimed) by the method and by the reference with the
    target's logits recorded; at the first differing position the two tokens are classified as
    a numerical tie or a real divergence (eval.summary.classify_divergence). Sets each record's
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


# ---------------------------------------------------------------------------------------------
# the command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m",
                   help="HF model directory, .gguf file, or embedded name (default smollm2-135m)")
    p.add_argument("--method", action="append", required=True, dest="methods",
                   help="repeat for several methods (see above)")
    p.add_argument("--prompts", required=True,
                   help="JSONL with 'turns' (MT-bench, Spec-Bench's question.jsonl) or plain text")
    p.add_argument("--num-prompts", type=_int_at_least(1), default=None,
                   help="use the first N prompts (default: all)")
    p.add_argument("--prompts-per-category", type=_int_at_least(1), default=None,
                   help="use the first N prompts of each category (then --num-prompts)")
    p.add_argument("--category", action="append", dest="categories", default=None,
                   help="only prompts of this category (repeat for several)")
    p.add_argument("--turn", type=_int_at_least(0), default=0,
                   help="which turn of multi-turn prompts (0-based); rows without it are skipped")
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=128)
    p.add_argument("--temperature", type=_finite, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=_int_at_least(0), default=0, help="0 = off")
    p.add_argument("--top-p", type=_finite, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=_int_at_least(0), default=1,
                   help="prompts run (16 tokens) before timing")
    p.add_argument("--repeats", type=_int_at_least(1), default=1,
                   help="run the whole interleaved set N times; each run's speedup is reported")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--html", default=None,
                   help="also write the HTML report here (python -m eval.report makes it later)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", type=parse_dtype, default=None,
                   help="the target's precision (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--draft-dtype", type=parse_dtype, default=None,
                   help="precision of draft LMs and EAGLE heads (e.g. bf16 beside an fp32 target "
                        "on a CPU); exactness depends on the target only (default: the target's)")
    p.add_argument("--attn-implementation", default=None,
                   help="the target's attention kernel: sdpa, eager, ... (default: transformers')")
    p.add_argument("--threads", type=_int_at_least(1), default=None, help="torch CPU threads")
    seen = {}
    for f in OPTION_FLAGS:
        seen.setdefault(f.flag, []).append(f)
    for flag, group in seen.items():
        defaults = (group[0].describe_default() if len(group) == 1 else
                    "; ".join(f"{f.kind} {f.describe_default()}" for f in group))
        text = " ".join(f.help for f in group if f.help)
        p.add_argument(flag, type=group[0].parse, default=None, dest=_dest(flag),
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
    p.add_argument("--tree-calibration-num-prompts", type=_int_at_least(1),
                   default=CALIBRATION_NUM_PROMPTS,
                   help=f"how many of them (default {CALIBRATION_NUM_PROMPTS}, "
                        f"{CALIBRATION_NEW_TOKENS} tokens each)")
    p.add_argument("--allow-other-weights", action="store_true",
                   help="accept heads trained for a target of the same shapes but other weights "
                        "(refused by default: both weight fingerprints are named)")
    p.add_argument("--wandb", action="store_true",
                   help="log the tables and plots to Weights & Biases (online when logged in)")
    p.add_argument("--wandb-project", default="draftsmith")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for spec in args.methods:
        if spec not in FIXED_METHODS and not spec.startswith(PREFIX_METHODS):
            p.error(f"unknown method {spec!r}; known: {', '.join(FIXED_METHODS + PREFIX_METHODS)}")
    try:
        args.params = SamplingParams(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        p.error(str(err))
    for name in ("out", "html"):
        if getattr(args, name):
            try:
                check_writable(getattr(args, name))
            except ValueError as err:
                p.error(f"--{name}: {err}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt_set = load_prompts(args.prompts, turn=args.turn, limit=args.num_prompts,
                              per_category=args.prompts_per_category, categories=args.categories)
    for reason, count in prompt_set.skipped.items():
        print(f"[bench] skipped {count} rows of {args.prompts}: {reason}", file=sys.stderr)
    target = load_target(args.target, device=args.device, dtype=args.dtype,
                         attn_implementation=args.attn_implementation)
    prompts = [target.chat_ids(p.text) for p in prompt_set.prompts]
    for ids in prompts:
        check_prompt(ids, args.max_new_tokens, target.vocab_size, target.max_context)
    specs = list(dict.fromkeys(args.methods))
    if "hf" not in specs:
        print("[bench] adding `hf`: speedup is measured against it in the same run", file=sys.stderr)
        specs.insert(0, "hf")
    uses_trees = any(s.startswith(("eagle:", "medusa:")) for s in specs)
    if args.tree == TREE_AUTO and uses_trees and (
            Path(args.tree_calibration_prompts).resolve() == Path(args.prompts).resolve()):
        print("[bench] warning: --tree auto measures acceptance on the prompts being "
              "benchmarked (--tree-calibration-prompts is --prompts): the tree is tuned on the "
              "test set", file=sys.stderr)
    methods = build_methods(specs, target, draft_dtype=args.draft_dtype,
                            allow_other_weights=args.allow_other_weights, tree=args.tree,
                            tree_calibration={
                                "calibration_prompts": args.tree_calibration_prompts,
                                "num_prompts": args.tree_calibration_num_prompts},
                            **{f"{kind}_options": options_from_args(args, kind) for kind in OWNERS})
    runs = run_benchmark(methods, prompts, max_new_tokens=args.max_new_tokens, params=args.params,
                         seed=args.seed, warmup=args.warmup, repeats=args.repeats,
                         progress=not args.no_progress)
    summary = summarise(runs, prompt_set.prompts, args.params.greedy)
    for method, record in zip(methods, summary["methods"]):
        if getattr(method, "tree", None):
            record["tree"] = method.tree
    if args.params.greedy:
        explain_differences(methods, summary["methods"], prompts, args.max_new_tokens,
                            args.params, target.dtype)
        found = {r["method"]: r.get("divergences") or [] for r in summary["methods"]}
        for group in summary["categories"]:  # each category's verdict from its own prompts
            for r in group["methods"]:
                if r.get("differing_prompts"):
                    mine = [d for d in found.get(r["method"], [])
                            if d.get("prompt") in r["differing_prompts"]]
                    r["greedy_verdict"] = greedy_verdict(mine) if mine else None
    import transformers

    config = {
        "target": args.target, "prompts": str(args.prompts), "num_prompts": len(prompts),
        "skipped_prompts": dict(prompt_set.skipped), "turn": args.turn,
        "categories": prompt_set.categories, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "seed": args.seed, "warmup": args.warmup, "repeats": args.repeats,
        "device": str(target.device), "dtype": dtype_name(target.dtype),
        "attn_implementation": getattr(target.config, "_attn_implementation", None),
        "draft_dtype": None if args.draft_dtype is None else dtype_name(args.draft_dtype),
        "method_options": {kind: options_from_args(args, kind) for kind in OWNERS},
        "tree": args.tree,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(), "python": platform.python_version(),
    }
    report = {
        "format": REPORT_FORMAT, "version": REPORT_VERSION, "config": config,
        "prompts": [{"id": p.id, "category": p.category} for p in prompt_set.prompts],
        "methods": summary["methods"], "categories": summary["categories"],
        "greedy_summary": greedy_summary(summary["methods"]),
    }
    print(format_report(report))
    if args.out:
        write_atomic(args.out, json.dumps(report, indent=2))
        print(f"[bench] report written to {args.out}", file=sys.stderr)
    if args.html:
        built = build_report([(str(args.out or "this run"), report)], [])
        write_atomic(args.html, render_html(built))
        print(f"[bench] HTML report written to {args.html}", file=sys.stderr)
    if args.wandb:
        log_to_wandb(report, config, args.wandb_project)
    return summary["methods"]


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
    return {"identical up to numerics": "up to numerics", "diverged": "DIVERGED"}.get(
        verdict, "NO")


def format_table(records: list[dict]) -> str:
    """The per-method table: tau and speedup with their 95% intervals."""
    repeats = any(r.get("speedup_per_repeat") for r in records)
    cols = ["method", "tau [95% CI]", "alpha", "tokens/s", "speedup [95% CI]"]
    if repeats:
        cols.append("speedup per repeat")
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
        row += [_cell(r.get("target_passes")), _cell(r.get("new_tokens")), _greedy_cell(r)]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_categories(categories: list[dict]) -> str:
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
    return "per category: speedup over hf (tau); prompts per category in brackets\n" + "\n".join(lines)


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
            f"tokens/s expected {t['expected_tokens_per_s']:.2f} (forward passes only) / "
            f"measured {_cell(r.get('tokens_per_s'), 2)}")
    return "trees chosen by --tree auto:\n" + "\n".join(lines) if lines else ""


def format_report(report: dict) -> str:
    parts = [format_table(report["methods"]), format_trees(report["methods"])]
    if report.get("categories"):
        parts.append(format_categories(report["categories"]))
    parts.append(report.get("greedy_summary", ""))
    for r in report["methods"]:
        for d in r.get("divergences") or []:
            if "reference_gap" in d:
                parts.append(
                    f"  {r['method']}: prompt {d['prompt']}, token {d['position']}: hf "
                    f"{d['reference_token']} / this {d['method_token']}, gap {d['reference_gap']:.4g}"
                    f" in hf's run and {d['method_gap']:.4g} in this one (top-1/top-2 margins "
                    f"{d['reference_top2']['margin']:.4g} / {d['method_top2']['margin']:.4g}, "
                    f"tolerance {d['tolerance']:.3g} in {d['dtype']}): {d['classification']}")
            else:
                parts.append(f"  {r['method']}: prompt {d['prompt']}: {d['classification']} "
                             f"({d.get('note', '')})")
    return "\n\n".join(p for p in parts if p)


def run_cli(argv=None) -> int:
    """``python -m eval.bench``: errors in the user's input end in one line, not a traceback."""
    try:
        main(argv)
    except (ValueError, FileNotFoundError) as err:
        print(f"python -m eval.bench: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_cli())
