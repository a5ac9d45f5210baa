"""How a benchmark method runs, and what every method's builder is handed.

* :class:`Method`: a named way to generate (``run(prompt_ids, ...) -> PromptRun``, ``trace`` for
  the greedy report); :class:`EngineMethod` is our engine with a proposer (or none: ``plain``),
  :class:`HFMethod` transformers' ``generate`` (``hf``, ``hf-pld``, ``hf-assisted``).
* :class:`OptionFlag`: one keyword option of a proposer and the command-line flag that sets it;
  its default is read from the proposer's own signature (one default per option).
* :class:`BuildContext`: the target, the one engine, the options set on the command line and the
  benchmark-wide settings, handed to every row's builder in ``draftsmith.eval.methods.BENCH_METHODS``.

The parsers below turn a flag's text into a typed option with a one-line error.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.proposers import Proposer
from draftsmith.eval.sampling import SamplingParams
from draftsmith.eval.summary import MethodRuns, PromptRun
from draftsmith.heads.distill import load_draft
from draftsmith.heads.medusa_tree import AUTO
from draftsmith.targets.target import Target

TREE_AUTO, TREE_FIXED = "auto", "fixed"
TREE_MODES = (TREE_AUTO, TREE_FIXED)


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
        return PromptRun(g.tokens, g.seconds, g.target_passes, g.acceptance, g.accepted_lengths,
                         g.rounds, g.host_reads)

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


@dataclass
class BuildContext:
    """What every builder of ``draftsmith.eval.methods.BENCH_METHODS`` is handed.

    ``options``: option kind -> the keyword options set on the command line (the flags of
    :class:`OptionFlag` with that kind); ``draft_dtype``: the precision of draft models and heads
    (None: the target's); ``allow_other_weights``: heads trained for a target of the same shapes
    but other weights are accepted; ``tree``: "auto" (trees sized by measured cost,
    draftsmith.eval.tree_auto) or "fixed"; ``tree_calibration``: keyword options of the acceptance
    measurement for artifacts that have none; ``compile``: drafts' forwards are compiled as the
    engine's is (--compile).
    """

    target: Target
    engine: SpeculativeEngine
    options: dict[str, dict] = field(default_factory=dict)
    draft_dtype: torch.dtype | None = None
    allow_other_weights: bool = False
    tree: str = TREE_FIXED
    tree_calibration: dict = field(default_factory=dict)
    compile: bool | str = False
    max_cache_len: int | None = None
    _drafts: dict[str, torch.nn.Module] = field(default_factory=dict)

    def kind_options(self, kind: str) -> dict:
        """A copy of the options set for ``kind`` (a builder may pop from it)."""
        return dict(self.options.get(kind) or {})

    def draft(self, spec: str) -> torch.nn.Module:
        """A draft LM (a directory or truncate:N), loaded once and shared by every method."""
        if spec not in self._drafts:
            self._drafts[spec] = load_draft(spec, self.target, dtype=self.draft_dtype)
        return self._drafts[spec]


# options of every artifact-loading builder that no flag of its own sets, and why
ARTIFACT_FIXED_OPTIONS = {
    "name": "the method's name on the command line",
    "allow_other_weights": "--allow-other-weights",
    "compile": "--compile",
}


def tree_caps(options: dict, depth: str, topk: str, nodes: str) -> dict:
    """--tree auto: the depth / topk / node options (popped from ``options``) cap the search."""
    tree_nodes = options.pop(nodes, None)
    return {"max_depth": options.pop(depth, None), "max_topk": options.pop(topk, None),
            "max_nodes": None if tree_nodes in (None, AUTO) else tree_nodes}


def signature_default(owner, keyword: str):
    """The one default of an option: the one in its owner's signature."""
    return inspect.signature(owner).parameters[keyword].default


def parse_finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_at_least(low: int):
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


def parse_probability(text: str) -> float:
    value = parse_finite(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def parse_tree_nodes(text: str) -> int | str:
    return AUTO if text == AUTO else int_at_least(1)(text)


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
