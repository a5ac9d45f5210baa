"""The draft LM in the evaluator: a small causal LM drafting chains or static trees.

``--method draft:<dir|truncate:N>`` (a distilled draft's directory, or the target's first N
layers): :class:`DraftModelProposer`, with the options ``--draft-depth``,
``--draft-min-confidence``, ``--draft-branching`` and ``--draft-children``
(:data:`DRAFT_FLAGS`). The draft keeps its own KV cache over the accepted sequence.

A draft directory may record how it drafts best (``"proposal"`` in its ``"draftsmith"`` block:
the trainer writes its evaluation options there, ``python -m draftsmith.eval.draft propose`` a tuned
setting): those options apply where the command line sets none (:func:`draft_options`).

    python -m draftsmith.eval.draft propose artifacts/smollm2-135m/draft --draft-branching 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftsmith.eval.forward import model_forward
from draftsmith.eval.host import to_host
from draftsmith.eval.kv import compact
from draftsmith.eval.proposers import Proposer
from draftsmith.eval.runners import (
    BuildContext,
    EngineMethod,
    OptionFlag,
    int_at_least,
    parse_probability,
)
from draftsmith.eval.sampling import warp
from draftsmith.eval.tree import DraftTree
from draftsmith.files.command_line import program, run_command
from draftsmith.files.output_dir import write_atomic
from draftsmith.heads.artifact import DRAFT_INFO_KEY
from draftsmith.heads.distill import read_draft_info
from draftsmith.layouts.draft import export_layout
from draftsmith.layouts.files import ExportOptions
from draftsmith.targets.target import attention_bias


class DraftModelProposer(Proposer):
    """A small causal LM sharing the target's vocabulary, drafting a chain or a static tree.

    Chain (``branching`` None): up to ``max_depth`` tokens, cut after the first token the draft
    gives less than ``min_confidence`` (later tokens would rarely survive verification). Tree:
    ``branching[d]`` children under every node of depth d, either the draft's top-k
    (``children="topk"``, verified with the deterministic-children rule) or k i.i.d. samples from
    its warped distribution (``children="sample"``, SpecInfer's rule); the draft expands one whole
    depth per forward with a tree attention mask over its own cache. At temperature 0 tokens are
    the draft's argmax / top-k.

    Everything stays on the device: the tokens a step drafts feed the next step as tensors, a
    static tree's form (parents, mask) is built once, and the accepted entries of the draft's
    cache are kept by a device index. A chain is drafted to its full depth and cut afterwards,
    with one read of its confidences (only when ``min_confidence`` > 0): a serving engine drafts
    a fixed number of tokens too, and stopping at each token would read the device every step.
    ``compile``: the draft's forward is compiled (:mod:`draftsmith.eval.forward`).
    """

    name = "draft"

    def __init__(self, model, *, max_depth: int = 6, min_confidence: float = 0.4,
                 branching: list[int] | None = None, children: str = "topk",
                 name: str = "draft", compile: bool | str = False):
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an integer >= 1, got {max_depth!r}")
        if not 0.0 <= min_confidence <= 1.0:  # NaN fails too
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        if branching is not None and (not branching or min(branching) < 1):
            raise ValueError(f"branching needs one count >= 1 per depth, got {branching}")
        if children not in ("topk", "sample"):
            raise ValueError(f"children must be 'topk' or 'sample', got {children!r}")
        self.model = model
        self.max_depth = max_depth if branching is None else len(branching)
        self.min_confidence = min_confidence
        self.branching = list(branching) if branching is not None else None
        self.children = children
        self.name = name
        self.compile = compile
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._forms: dict[tuple[int, ...], StaticForm] = {}

    @property
    def chains(self) -> bool:
        return self.branching is None

    def start(self, prompt_ids, hidden, params, generator) -> None:
        super().start(prompt_ids, hidden, params, generator)
        self.forward = model_forward(self.model, role="draft", compile=self.compile)
        self.cache = self.forward.take_cache(self)
        self.cached: list[int] = []  # tokens on the accepted sequence the draft cache holds
        self.base = 0
        self.fed_depths = 0  # tree depths whose nodes have entries after the first ``base``
        self.pending: torch.Tensor | None = None  # (m,) accepted tokens without an entry yet

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *,
                 last: bool = False) -> torch.Tensor:
        """The draft over ``ids`` (q,) at ``positions`` (q,) -> logits (q, vocab) (the last row
        alone, eagerly, with ``last``: a prompt). ``mask`` (q, k) bool: what the new entries see
        of the last k entries (the new ones last); every earlier entry is seen."""
        past = self.cache.length
        q, k = mask.shape
        full = torch.ones(q, past + q, dtype=torch.bool, device=self.device)
        full[:, past + q - k:] = mask
        out = self.forward(
            torch.arange(past, past + q, device=self.device), eager=last,
            input_ids=ids[None], position_ids=positions[None],
            attention_mask=attention_bias(full, self.dtype)[None, None],
            logits_to_keep=1 if last else 0)
        self.cache.set_length(past + q)
        return out.logits[0]

    @torch.no_grad()
    def propose(self, seq: list[int], max_depth: int) -> DraftTree | None:
        self.forward.check_owner(self)
        depth = min(self.max_depth, max_depth)
        if depth < 1:
            return None
        held = len(self.cached)
        if self.pending is None:  # the prompt and the first token: once per generation
            feed = torch.tensor(seq[held:], dtype=torch.long, device=self.device)
        else:
            feed = self.pending
        q = feed.shape[0]
        causal = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
        positions = torch.arange(held, held + q, device=self.device)
        # (vocab,) at the root; the prompt (the first feed) eagerly, keeping its last row only
        logits = self._forward(feed, causal, positions, last=self.pending is None)[-1]
        self.cached = list(seq)
        self.base = len(seq)  # the draft cache now holds all of seq
        self.pending = None
        if self.branching is None:
            return self._chain(logits, depth)
        return self._tree(logits, depth)

    def _chain(self, logits: torch.Tensor, depth: int) -> DraftTree:
        tokens, probs, confidence = [], [], []
        one = torch.ones(1, 1, dtype=torch.bool, device=self.device)
        for d in range(depth):
            if self.params.greedy:
                token = logits.argmax()
                confidence.append(torch.softmax(logits.float(), -1)[token])
            else:
                q = warp(logits, self.params)
                token = torch.multinomial(q, 1, generator=self.generator)[0]
                probs.append(q)
                confidence.append(q[token])
            tokens.append(token)
            if d == depth - 1:
                break
            logits = self._forward(token.view(1), one, torch.full(
                (1,), self.base + d, dtype=torch.long, device=self.device))[-1]
        self.fed_depths = len(tokens) - 1
        keep = len(tokens)
        if self.min_confidence > 0 and len(tokens) > 1:
            low = to_host(torch.stack(confidence[:-1]) < self.min_confidence)
            keep = next((i + 1 for i, below in enumerate(low) if below), keep)
        return DraftTree.chain(torch.stack(tokens[:keep]), probs[:keep] or None)

    def _tree(self, root_logits: torch.Tensor, depth: int) -> DraftTree:
        sample = self.children == "sample" and not self.params.greedy
        vocab = root_logits.shape[-1]
        branching = tuple(k if sample else min(k, vocab) for k in self.branching[:depth])
        if branching not in self._forms:
            self._forms[branching] = StaticForm(list(branching), self.device)
        form = self._forms[branching]
        draft_probs: dict[int, torch.Tensor] = {}
        level_tokens = []
        logits = root_logits[None]  # (frontier, vocab) in node order
        for d, k in enumerate(branching):
            if sample:
                q = warp(logits, self.params)  # (frontier, V)
                kids = torch.multinomial(q, k, replacement=True, generator=self.generator)
                for row, node in enumerate(form.levels[d]):
                    draft_probs[node] = q[row]
            else:
                kids = torch.topk(logits, k, dim=-1).indices
            grown = kids.reshape(-1)  # (frontier * k,) the next depth's tokens, in node order
            level_tokens.append(grown)
            if d == depth - 1:
                break
            # one draft forward over the whole new depth: each node sees the accepted sequence
            # and its own tree ancestors (already in the draft cache) plus itself
            logits = self._forward(grown, form.fed_masks[d], form.positions[d] + self.base)
        self.fed_depths = depth - 1
        tokens = torch.cat(level_tokens)
        return DraftTree.from_tensors(tokens, form.parents, depth_bound=depth,
                                      ancestors=form.ancestors, depths=form.depths,
                                      draft_probs=draft_probs, host_parents=form.host_parents)

    def observe(self, seq, tree, path, hidden) -> None:
        # the cache holds seq[:base], then the nodes of the first fed_depths depths in node order
        # (node i at offset i - 1): keep the accepted ones, in order
        keep, root = tree.verified
        fed = min(len(path), self.fed_depths)
        compact(self.cache, self.base, keep[1: 1 + fed] - 1, fed)
        self.cached = self.cached[: self.base] + seq[self.base: self.base + fed]
        tokens = tree.device(self.device).tokens
        self.pending = torch.cat([tokens[keep[1 + fed:] - 1], root.to(self.device)])


class StaticForm:
    """A static tree's form on the device, made once per branching: node numbers level by level,
    the parents, ancestors and depths of the whole tree, and for every level but the last the
    mask of its draft forward (its nodes against the nodes fed before them and themselves) and
    its positions (depth - 1 after the accepted sequence)."""

    def __init__(self, branching: list[int], device):
        parents: list[int] = []
        levels: list[list[int]] = []
        frontier = [0]
        for k in branching:
            grown = []
            for node in frontier:
                for _ in range(k):
                    parents.append(node)
                    grown.append(len(parents))
            levels.append(frontier)
            frontier = grown
        self.levels = levels  # the nodes whose children each depth holds
        self.host_parents = parents
        host = DraftTree([0] * len(parents), parents)
        ancestors = host.ancestor_mask()
        self.parents = torch.tensor(parents, dtype=torch.long, device=device)
        self.ancestors = ancestors.to(device)
        self.depths = torch.tensor(host.depths, dtype=torch.long, device=device)
        self.fed_masks, self.positions = [], []
        first = 1
        for d in range(len(branching) - 1):
            count = len(levels[d]) * branching[d]
            nodes = list(range(first, first + count))
            # fed so far: nodes 1 .. first + count - 1, in order
            self.fed_masks.append(ancestors[nodes][:, 1: first + count].to(device))
            self.positions.append(torch.full((count,), d, dtype=torch.long, device=device))
            first += count


def parse_branching(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be counts per depth like 4,2,1, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"must be counts >= 1 per depth like 4,2,1, got {text!r}")
    return counts


def parse_children(text: str) -> str:
    if text not in ("topk", "sample"):
        raise argparse.ArgumentTypeError(f"must be topk or sample, got {text!r}")
    return text


DRAFT_FLAGS = (
    OptionFlag("draft", DraftModelProposer, "max_depth", "--draft-depth", int_at_least(1),
               "draft: most draft tokens per round (a chain)"),
    OptionFlag("draft", DraftModelProposer, "min_confidence", "--draft-min-confidence",
               parse_probability,
               "draft: stop drafting after a token the draft gives less than this"),
    OptionFlag("draft", DraftModelProposer, "branching", "--draft-branching", parse_branching,
               "draft: a static tree instead of a chain, children per node at each depth "
               "(e.g. 4,2,1)", unset="a chain"),
    OptionFlag("draft", DraftModelProposer, "children", "--draft-children", parse_children,
               "draft trees: topk (the draft's best, point-mass rule) or sample (i.i.d. "
               "samples, SpecInfer's rule; greedy at temperature 0)"),
)
DRAFT_FIXED_OPTIONS = {"name": "the method's name on the command line", "compile": "--compile"}


def chain_options(n: int) -> dict:
    """The draft LM proposing ``n`` tokens with no confidence stop: llama.cpp's draft-simple."""
    return {"max_depth": n, "min_confidence": 0.0}


PROPOSAL_KEY = "proposal"
CHAIN_OPTIONS = ("max_depth", "min_confidence")  # set alone on the command line: a chain


def recorded_proposal(spec: str) -> dict:
    """The options a draft directory records as its own drafting (``"proposal"``), {} for
    truncate:N, a hub id or a model directory that records none."""
    if spec.startswith("truncate:") or not Path(spec).expanduser().is_dir():
        return {}
    proposal = (read_draft_info(Path(spec).expanduser()) or {}).get(PROPOSAL_KEY) or {}
    known = {f.keyword for f in DRAFT_FLAGS}
    if not isinstance(proposal, dict) or set(proposal) - known:
        raise ValueError(f"{spec}/config.json: its {PROPOSAL_KEY!r} must map options among "
                         f"{sorted(known)} to values, got {proposal!r}; record it again with "
                         f"`python -m draftsmith.eval.draft propose {spec} ...`")
    return {k: v for k, v in proposal.items() if v is not None}


def draft_options(spec: str, given: dict) -> dict:
    """The drafting of ``draft:<spec>``: the options set on the command line (``given``), then
    the directory's recorded ones, then the proposer's defaults. A depth or confidence set on the
    command line without ``--draft-branching`` asks for a chain: a recorded tree is dropped."""
    recorded = recorded_proposal(spec)
    if any(k in given for k in CHAIN_OPTIONS) and "branching" not in given:
        recorded.pop("branching", None)
    return {**recorded, **given}


def build_draft(arg: str, name: str, ctx: BuildContext) -> EngineMethod:
    """``draft:<dir|truncate:N>``, drafting as :func:`draft_options` says."""
    options = draft_options(arg, ctx.kind_options("draft"))
    try:
        proposer = DraftModelProposer(ctx.draft(arg), name=name, compile=ctx.compile, **options)
    except ValueError as err:
        raise ValueError(f"{name!r} drafting with {options}: {err}") from err
    used = {k: v for k, v in options.items() if k not in ctx.kind_options("draft")}
    if used:
        print(f"[bench] {name}: drafting as {arg} records: {used}", file=sys.stderr)
    method = EngineMethod(name, ctx.engine, proposer)
    method.drafting = {"max_depth": proposer.max_depth, "min_confidence": proposer.min_confidence,
                       "branching": proposer.branching, "children": proposer.children}
    return method


def serve_draft(arg: str, name: str, ctx) -> list[str]:
    """``draft:<dir>`` in llama.cpp: the distilled draft exported to GGUF, ``--spec-type
    draft-simple`` (``ctx``: draftsmith.eval.llama_bench.ServeContext)."""
    if arg.startswith("truncate:"):
        raise ValueError(f"{name!r}: llama.cpp serves a draft from its own GGUF; give a draft "
                         "model directory (a distilled draft), not the target's first layers")
    path = ctx.work_dir / f"draft-{len(list(ctx.work_dir.glob('*.gguf')))}.gguf"
    gguf = export_layout(arg, "gguf", path, ExportOptions(gguf_type=ctx.gguf_type, overwrite=True))
    return ctx.draft_args(gguf, "draft-simple", 3)  # llama.cpp's own default


def propose(directory: str, options: dict) -> dict:
    """Record ``options`` (DraftModelProposer keywords) as the drafting of a distilled draft's
    directory, in its config.json, after checking the proposer accepts them; returns what is
    recorded. Options left out are the proposer's defaults (nothing of an earlier record kept)."""
    path = Path(directory).expanduser()
    info = read_draft_info(path)
    if info is None:
        raise ValueError(f"{directory} is not a draftsmith draft (its config.json has no "
                         f"{DRAFT_INFO_KEY!r} block); train one with train/distill.py")
    if not options:
        raise ValueError("give at least one option to record (--draft-depth, "
                         "--draft-min-confidence, --draft-branching, --draft-children)")
    DraftModelProposer(torch.nn.Linear(1, 1), **options)  # refuses what the engine would
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config[DRAFT_INFO_KEY][PROPOSAL_KEY] = dict(options)
    write_atomic(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dict(options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program("python -m draftsmith.eval.draft"), description=(
        "Record how a distilled draft drafts by default (the options draftsmith.eval.bench applies to "
        "draft:<dir> where its command line sets none)."))
    sub = parser.add_subparsers(dest="command", required=True)
    record = sub.add_parser("propose", help="record the draft's default drafting in its "
                                            "config.json (replacing an earlier record)")
    record.add_argument("directory", help="a distilled draft's directory (train/distill.py)")
    for f in DRAFT_FLAGS:
        record.add_argument(f.flag, dest=f.keyword, type=f.parse, default=None, help=f.help)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = {f.keyword: getattr(args, f.keyword) for f in DRAFT_FLAGS
               if getattr(args, f.keyword) is not None}

    def run() -> None:
        recorded = propose(args.directory, options)
        print(f"[draft] {args.directory} drafts with {recorded} unless the command line says "
              f"otherwise")

    return run_command(run, "python -m draftsmith.eval.draft")


if __name__ == "__main__":
    sys.exit(main())
