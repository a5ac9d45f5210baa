"""The eval floor's table: every method the benchmark runs, its builder and its options.

One row per method name on the command line: the baselines (``plain``, ``hf``, ``pld``,
``hf-pld``, ``hf-assisted:``) and one row per draft method, the column ``draftsmith.heads.methods`` names
(``draft:``, ``eagle:``, ``medusa:``). A row gives

* ``spec``: how it is written (``plain``, or a prefix and its argument: ``eagle:<artifact>``);
* ``build(arg, name, ctx) -> Method``: ``arg`` is what follows the prefix, ``ctx`` the
  :class:`draftsmith.eval.runners.BuildContext` (target, engine, options, benchmark-wide settings); None
  where the method exists in llama.cpp only;
* ``serve(arg, name, ctx) -> list[str]``: the method in llama.cpp (``--engine llama.cpp``), as
  the llama-server arguments beyond the target (``ctx``: :class:`draftsmith.eval.llama_bench.ServeContext`);
  None where llama.cpp has no counterpart;
* ``kind`` and ``flags``: the option group it reads and the flags that set it
  (:class:`draftsmith.eval.runners.OptionFlag`, defaults read from the proposer's signature), ``owner``
  the callable whose signature holds them, ``fixed_options`` its options no flag sets and why;
* ``column``: the draft method it measures (None for a baseline), ``trees``: whether
  ``--tree auto`` sizes it, ``top1_metric``: the regular expression of the per-step (or
  per-head) top-1 its trainer logs, which the report plots.

``draftsmith.eval.bench`` builds its flags and its methods from this table alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from draftsmith.eval import baselines, dflash, draft, eagle, medusa
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.runners import TREE_FIXED, TREE_MODES, BuildContext, Method, OptionFlag
from draftsmith.targets.target import Target


@dataclass(frozen=True)
class BenchMethod:
    """One method on the eval floor."""

    spec: str  # "plain", or "<prefix>:<argument>"
    build: Callable[[str, str, BuildContext], Method] | None
    kind: str | None = None  # the option group it reads
    flags: tuple[OptionFlag, ...] = ()  # the flags of that group (one row per group owns them)
    owner: Callable | None = None  # whose signature holds the group's options
    fixed_options: dict[str, str] = field(default_factory=dict)
    column: str | None = None  # the draft method it measures (draftsmith.heads.methods); None: a baseline
    trees: bool = False  # --tree auto sizes its trees
    top1_metric: str | None = None  # regex of the top-1 its trainer logs (group 1: step/head)
    serve: Callable[[str, str, object], list[str]] | None = None  # its llama-server arguments
    # its options drafting a chain of n tokens, as llama.cpp drafts (the cross-check's settings)
    chain: Callable[[int], dict] | None = None

    @property
    def prefix(self) -> str | None:
        return self.spec.split(":")[0] + ":" if ":" in self.spec else None

    def matches(self, spec: str) -> bool:
        return spec.startswith(self.prefix) if self.prefix else spec == self.spec


BENCH_METHODS: dict[str, BenchMethod] = {
    "plain": BenchMethod("plain", baselines.build_plain, serve=baselines.serve_plain),
    "hf": BenchMethod("hf", baselines.build_hf),
    "hf-static": BenchMethod("hf-static", baselines.build_hf_static),
    "pld": BenchMethod("pld", baselines.build_pld, kind="pld", flags=baselines.PLD_FLAGS,
                       owner=baselines.NgramProposer),
    "hf-pld": BenchMethod("hf-pld", baselines.build_hf_pld, kind="pld"),
    "hf-assisted": BenchMethod("hf-assisted:<dir|truncate:N>", baselines.build_hf_assisted),
    "ngram": BenchMethod("ngram:<llama.cpp n-gram type>", None, serve=baselines.serve_ngram),
    "draft": BenchMethod("draft:<dir|truncate:N>", draft.build_draft, kind="draft",
                         flags=draft.DRAFT_FLAGS, owner=draft.DraftModelProposer,
                         fixed_options=draft.DRAFT_FIXED_OPTIONS, column="draft",
                         serve=draft.serve_draft, chain=draft.chain_options),
    "eagle": BenchMethod("eagle:<artifact>", eagle.build_eagle, kind="eagle",
                         flags=eagle.EAGLE_FLAGS, owner=eagle.EagleProposer.from_artifact,
                         fixed_options=eagle.EAGLE_FIXED_OPTIONS, column="eagle", trees=True,
                         top1_metric=r"^acc_(\d+)$", serve=eagle.serve_eagle,
                         chain=eagle.chain_options),
    "medusa": BenchMethod("medusa:<artifact>", medusa.build_medusa, kind="medusa",
                          flags=medusa.MEDUSA_FLAGS, owner=medusa.MedusaProposer.from_artifact,
                          fixed_options=medusa.MEDUSA_FIXED_OPTIONS, column="medusa",
                          trees=True, top1_metric=r"^medusa/head(\d+)_top1$"),
    "dflash": BenchMethod("dflash:<artifact>", dflash.build_block("dflash"), kind="dflash",
                          flags=dflash.BLOCK_FLAGS, owner=dflash.BlockProposer.from_artifact,
                          fixed_options=dflash.BLOCK_FIXED_OPTIONS, column="dflash", trees=True,
                          top1_metric=r"^acc_(\d+)$", serve=dflash.serve_block("dflash"),
                          chain=dflash.chain_options),
    "dspark": BenchMethod("dspark:<artifact>", dflash.build_block("dspark"), kind="dflash",
                          column="dflash", trees=True, serve=dflash.serve_block("dspark"),
                          chain=dflash.chain_options),
}


def option_flags() -> tuple[OptionFlag, ...]:
    """Every option of every proposer, with its flag."""
    return tuple(f for row in BENCH_METHODS.values() for f in row.flags)


def owners() -> dict[str, Callable]:
    """Option kind -> the callable whose signature holds its options."""
    return {row.kind: row.owner for row in BENCH_METHODS.values() if row.owner is not None}


def fixed_options() -> dict[tuple[str, str], str]:
    """(kind, option) -> why no flag sets it."""
    return {(row.kind, name): why for row in BENCH_METHODS.values()
            for name, why in row.fixed_options.items()}


def method_for(spec: str) -> BenchMethod:
    """The row that runs ``spec``; an unknown one is named with every known form."""
    for row in BENCH_METHODS.values():
        if row.matches(spec):
            return row
    known = ", ".join(row.spec for row in BENCH_METHODS.values())
    raise ValueError(f"unknown method {spec!r}; use one of {known}, "
                     "medusa:typical:<artifact>")


def resolve(spec: str, engine: str = "draftsmith") -> tuple[BenchMethod, str]:
    """(row, argument) of ``spec`` for ``engine`` ("draftsmith" or "llama.cpp"), or a ValueError
    naming what to use where the row has no such counterpart."""
    row = method_for(spec)
    if engine == "draftsmith" and row.build is None:
        raise ValueError(f"{spec!r} runs in llama.cpp only: add --engine llama.cpp (our "
                         "engine's n-gram lookup is pld)")
    if engine != "draftsmith" and row.serve is None:
        raise ValueError(f"{spec!r} has no llama.cpp counterpart; with --engine llama.cpp use "
                         "plain, ngram:<type>, eagle:<artifact> or draft:<dir>")
    return row, spec[len(row.prefix):] if row.prefix else ""


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def options_from_args(args: argparse.Namespace, kind: str) -> dict:
    """The options of one method kind the user set on the command line (None: not set)."""
    options = {}
    for f in option_flags():
        value = getattr(args, dest(f.flag))
        if f.kind == kind and value is not None:
            options[f.keyword] = value
    return options


def build_methods(specs: list[str], target: Target, *, options: dict[str, dict] | None = None,
                  draft_dtype=None, allow_other_weights: bool = False, tree: str = TREE_FIXED,
                  tree_calibration: dict | None = None, compile: bool | str = False,
                  max_cache_len: int | None = None) -> list[Method]:
    """Method names -> runnable methods (drafts loaded once and shared).

    ``options``: option kind -> keyword options of that kind's proposer; ``draft_dtype``: the
    precision of draft LMs and heads (None: the target's); ``allow_other_weights``: heads trained
    for a target of the same shapes but other weights are accepted (otherwise refused).
    ``tree="auto"``: trees are chosen by expected tokens/s on this machine (draftsmith.eval.tree_auto); the
    depth / topk / tree_nodes options then cap the search. ``tree_calibration``: keyword options
    of the acceptance measurement (calibration_prompts, num_prompts, max_new_tokens) for
    artifacts that have none. ``compile``: the engine's and the drafts' forwards compiled
    (draftsmith.eval.forward.COMPILE_MODES); ``max_cache_len``: the longest prompt plus the new tokens
    (transformers' static cache is sized with it).
    """
    if tree not in TREE_MODES:
        raise ValueError(f"tree must be one of {', '.join(TREE_MODES)}, got {tree!r}")
    ctx = BuildContext(target, SpeculativeEngine(target, compile=compile), dict(options or {}),
                       draft_dtype=draft_dtype, allow_other_weights=allow_other_weights,
                       tree=tree, tree_calibration=dict(tree_calibration or {}),
                       compile=compile, max_cache_len=max_cache_len)
    methods = []
    for spec in specs:
        row, arg = resolve(spec)
        methods.append(row.build(arg, spec, ctx))
    return methods
