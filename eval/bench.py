"""Benchmark: every method on the same target and prompts, in one process, interleaved.

    python -m eval.bench --target smollm2-135m --method hf --method plain --method pld \\
        --method hf-pld --method draft:truncate:24 --method hf-assisted:truncate:24 \\
        --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 \\
        --max-new-tokens 128 --temperature 0 --out report.json

Methods: ``plain`` (our engine, no draft), ``hf`` (transformers ``generate``), ``pld`` (our n-gram
lookup), ``hf-pld`` (``prompt_lookup_num_tokens``), ``draft:<dir|truncate:N>`` (our engine with a
draft LM), ``hf-assisted:<dir|truncate:N>`` (``assistant_model``), ``eagle:<artifact>`` and
``medusa:<artifact>`` (``medusa:typical:<artifact>``: Medusa's lossy typical acceptance, reported
``exact: false``). Prompts run one after another with every method, in an order rotated per
prompt, so machine drift hits all methods alike; a warm-up pass comes first. ``speedup`` is
tokens/s over ``hf`` measured in the same run (``hf`` is added when not asked for).
"""

from __future__ import annotations

import os

# MKL's default code path on AMD CPUs runs small fp32 GEMMs (2-32 rows: exactly what verifying a
# draft costs) 2-3x slower than its AUTO path; MKL reads this at its first GEMM, so it is set
# before any model runs. It applies to every method in the process alike; a user's own setting wins.
os.environ.setdefault("MKL_CBWR", "AUTO")

import argparse  # noqa: E402
import json  # noqa: E402
import platform
import sys
import time
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

import torch
from tqdm.auto import tqdm

from distill.draft import load_draft
from eval.engine import SpeculativeEngine, check_prompt
from eval.prompts import read_prompts
from eval.proposers import DraftModelProposer, NgramProposer, Proposer
from eval.sampling import SamplingParams
from heads.target import Target, default_device_dtype, load_target

METHOD_KINDS = ("plain", "hf", "pld", "hf-pld", "draft:", "hf-assisted:", "eagle:", "medusa:")


@dataclass
class RunResult:
    tokens: list[int]
    seconds: float
    target_passes: int  # decoding forwards of the target, prefill excluded
    accepted_at: list[int] | None = None
    tried_at: list[int] | None = None


@dataclass
class MethodStats:
    name: str
    exact: bool = True
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    passes: int = 0
    new_tokens: int = 0
    decode_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)
    tried_at: list[int] = field(default_factory=list)
    has_acceptance: bool = False

    def add(self, r: RunResult) -> None:
        self.outputs.append(r.tokens)
        self.seconds += r.seconds
        self.passes += r.target_passes
        self.new_tokens += len(r.tokens)
        self.decode_tokens += max(0, len(r.tokens) - 1)
        if r.accepted_at is not None:
            self.has_acceptance = True
            for mine, theirs in ((self.accepted_at, r.accepted_at), (self.tried_at, r.tried_at)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v


class Method:
    """A named way to generate: run(prompt_ids) -> RunResult."""

    name: str
    exact = True

    def run(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
            seed: int) -> RunResult:
        raise NotImplementedError


class EngineMethod(Method):
    def __init__(self, name: str, engine: SpeculativeEngine, proposer: Proposer | None):
        self.name, self.engine, self.proposer = name, engine, proposer
        self.exact = getattr(proposer, "exact", True)

    def run(self, prompt_ids, max_new_tokens, params, seed):
        g = self.engine.generate(prompt_ids, max_new_tokens, params, self.proposer, seed=seed)
        return RunResult(g.tokens, g.seconds, g.target_passes, g.accepted_at, g.tried_at)


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

    @torch.no_grad()
    def run(self, prompt_ids, max_new_tokens, params, seed):
        ids = torch.tensor([prompt_ids], device=self.target.device)
        sampling = (
            {"do_sample": False} if params.greedy else
            {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k,
             "top_p": params.top_p}
        )
        if not params.greedy:
            torch.manual_seed(seed)
        self.calls, self.counting = 0, True
        start = time.perf_counter()
        out = self.target.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            pad_token_id=self.target.eos_token_ids[0] if self.target.eos_token_ids else None,
            **sampling, **self.kwargs,
        )
        seconds = time.perf_counter() - start
        self.counting = False
        tokens = out[0, len(prompt_ids):].tolist()
        return RunResult(tokens, seconds, max(0, self.calls - 1))


def build_methods(specs: list[str], target: Target, args) -> list[Method]:
    """Method names from the command line -> runnable methods (drafts loaded once and shared)."""
    engine = SpeculativeEngine(target)
    drafts: dict[str, torch.nn.Module] = {}

    def draft(spec: str):
        if spec not in drafts:
            drafts[spec] = load_draft(spec, target, dtype=draft_dtype(args))
        return drafts[spec]

    methods: list[Method] = []
    for spec in specs:
        if spec == "plain":
            methods.append(EngineMethod(spec, engine, None))
        elif spec == "hf":
            methods.append(HFMethod(spec, target))
        elif spec == "pld":
            methods.append(EngineMethod(spec, engine, NgramProposer(
                max_ngram=args.pld_max_ngram, max_depth=args.pld_depth,
                max_branches=args.pld_branches, max_nodes=args.pld_nodes)))
        elif spec == "hf-pld":
            methods.append(HFMethod(spec, target, prompt_lookup_num_tokens=args.pld_depth))
        elif spec.startswith("draft:"):
            methods.append(EngineMethod(spec, engine, DraftModelProposer(
                draft(spec[len("draft:"):]), max_depth=args.draft_depth,
                min_confidence=args.draft_min_confidence, name=spec)))
        elif spec.startswith("hf-assisted:"):
            methods.append(HFMethod(spec, target, assistant_model=draft(spec[len("hf-assisted:"):])))
        elif spec.startswith(("eagle:", "medusa:")):
            kind, _, path = spec.partition(":")
            methods.append(EngineMethod(spec, engine, load_head_proposer(kind, path, target, args)))
        else:
            raise ValueError(
                f"unknown method {spec!r}; use one of plain, hf, pld, hf-pld, "
                "draft:<dir|truncate:N>, hf-assisted:<dir|truncate:N>, eagle:<artifact>, "
                "medusa:<artifact>"
            )
    return methods


def draft_dtype(args) -> torch.dtype | None:
    """--draft-dtype as a torch dtype (None: the target's)."""
    name = getattr(args, "draft_dtype", None)
    return None if name is None else default_device_dtype("cpu", name)[1]


def load_head_proposer(kind: str, path: str, target: Target, args) -> Proposer:
    """EAGLE / Medusa artifacts plug in through their own proposer modules."""
    if kind == "eagle":
        from eval.eagle import EagleProposer

        return EagleProposer.from_artifact(path, target, args)
    from eval.medusa import MedusaProposer

    return MedusaProposer.from_artifact(path, target, args)


def summarise(stats: MethodStats, reference: MethodStats | None, greedy: bool) -> dict:
    tokens_per_s = stats.new_tokens / stats.seconds if stats.seconds else None
    record = {
        "method": stats.name,
        "exact": stats.exact,
        "tau": round(stats.decode_tokens / stats.passes, 4) if stats.passes else None,
        "alpha": None,
        "alpha_per_depth": None,
        "tokens_per_s": round(tokens_per_s, 3) if tokens_per_s else None,
        "speedup": None,
        "target_passes": stats.passes,
        "new_tokens": stats.new_tokens,
        "seconds": round(stats.seconds, 3),
        "greedy_identical": None,
    }
    if stats.has_acceptance and stats.tried_at:
        tried = sum(stats.tried_at)
        record["alpha"] = round(sum(stats.accepted_at) / tried, 4) if tried else None
        record["alpha_per_depth"] = [
            round(a / t, 4) if t else None
            for a, t in zip_longest(stats.accepted_at, stats.tried_at, fillvalue=0)
        ]
    if reference is not None and reference.seconds and tokens_per_s:
        record["speedup"] = round(tokens_per_s / (reference.new_tokens / reference.seconds), 4)
    if greedy and reference is not None:
        differ = [i for i, (a, b) in enumerate(zip(stats.outputs, reference.outputs)) if a != b]
        record["greedy_identical"] = not differ
        if differ:
            record["differing_prompts"] = differ
    return record


def format_table(records: list[dict]) -> str:
    cols = ["method", "tau", "alpha", "tokens_per_s", "speedup", "target_passes", "new_tokens",
            "greedy_identical"]

    def cell(v):
        if v is None:
            return "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    rows = [cols] + [[cell(r.get(c)) for c in cols] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_benchmark(target: Target, methods: list[Method], prompts: list[list[int]],
                  max_new_tokens: int, params: SamplingParams, seed: int = 0, warmup: int = 1,
                  progress: bool = True) -> list[dict]:
    """Run every method on every prompt (interleaved, rotated), return one record per method."""
    for ids in prompts[:warmup]:
        for m in methods:
            m.run(ids, min(max_new_tokens, 16), params, seed)
    stats = {m.name: MethodStats(m.name, m.exact) for m in methods}
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", disable=not progress,
               file=sys.stderr)
    for i, ids in enumerate(prompts):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for m in order:
            bar.set_postfix_str(m.name)
            stats[m.name].add(m.run(ids, max_new_tokens, params, seed + i))
            bar.update()
    bar.close()
    reference = stats.get("hf")
    return [summarise(stats[m.name], reference, params.greedy) for m in methods]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m",
                   help="HF model directory, .gguf file, or embedded name (default smollm2-135m)")
    p.add_argument("--method", action="append", required=True, dest="methods",
                   help="repeat for several methods (see above)")
    p.add_argument("--prompts", required=True, help="JSONL with 'turns' or plain text, one per line")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--turn", type=int, default=0, help="which turn of multi-turn prompts (0-based)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="prompts run (16 tokens) before timing")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--draft-depth", type=int, default=6, help="max draft tokens per round")
    p.add_argument("--draft-dtype", default=None,
                   help="precision of draft LMs and EAGLE heads (e.g. bf16 beside an fp32 target "
                        "on a CPU); exactness depends on the target only (default: the target's)")
    p.add_argument("--draft-min-confidence", type=float, default=0.4,
                   help="stop drafting after a token the draft gives less than this")
    p.add_argument("--pld-depth", type=int, default=10, help="n-gram continuation length")
    p.add_argument("--pld-max-ngram", type=int, default=3)
    p.add_argument("--pld-branches", type=int, default=1, help="continuations merged into a tree")
    p.add_argument("--pld-nodes", type=int, default=10, help="node budget of the n-gram tree")
    p.add_argument("--tree-nodes", type=int, default=None,
                   help="node budget for EAGLE/Medusa trees (default: the artifact's)")
    p.add_argument("--tree-depth", type=int, default=None,
                   help="EAGLE tree depth / cap on the Medusa tree's depth")
    p.add_argument("--tree-topk", type=int, default=None,
                   help="EAGLE children per expanded node / cap on the Medusa tree's ranks")
    p.add_argument("--wandb", action="store_true", help="log the report to Weights & Biases")
    p.add_argument("--wandb-project", default="draftsmith")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for spec in args.methods:
        if not (spec in ("plain", "hf", "pld", "hf-pld") or
                spec.startswith(tuple(k for k in METHOD_KINDS if k.endswith(":")))):
            p.error(f"unknown method {spec!r}; known: {', '.join(METHOD_KINDS)}")
    if args.max_new_tokens <= 0:
        p.error(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    return args


def log_wandb(records: list[dict], config: dict, project: str) -> None:
    import wandb

    # offline unless the user configured a mode (WANDB_MODE) themselves
    run = wandb.init(project=project, job_type="bench", config=config,
                     mode=os.environ.get("WANDB_MODE", "offline"))
    cols = sorted({k for r in records for k in r})
    table = wandb.Table(columns=cols, data=[[json.dumps(r.get(c)) if isinstance(r.get(c), list)
                                             else r.get(c) for c in cols] for r in records])
    run.log({"bench": table})
    for r in records:
        for key in ("tau", "alpha", "tokens_per_s", "speedup"):
            if r.get(key) is not None:
                run.summary[f"{r['method']}/{key}"] = r[key]
    run.finish()


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    texts = read_prompts(args.prompts, turn=args.turn, limit=args.num_prompts)
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    prompts = [target.chat_ids(t) for t in texts]
    for ids in prompts:
        check_prompt(ids, args.max_new_tokens, target.vocab_size, target.max_context)
    specs = list(dict.fromkeys(args.methods))
    if "hf" not in specs:
        print("[bench] adding `hf`: speedup is measured against it in the same run", file=sys.stderr)
        specs.insert(0, "hf")
    methods = build_methods(specs, target, args)
    records = run_benchmark(target, methods, prompts, args.max_new_tokens, params, args.seed,
                            args.warmup, progress=not args.no_progress)
    config = {
        "target": args.target, "prompts": str(args.prompts), "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
        "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "draft_dtype": args.draft_dtype,
        "machine": platform.machine(), "python": platform.python_version(),
    }
    import transformers

    config["transformers"] = transformers.__version__
    print(format_table(records))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": config, "methods": records}, indent=2))
        print(f"[bench] report written to {out}", file=sys.stderr)
    if args.wandb:
        log_wandb(records, config, args.wandb_project)
    return records


if __name__ == "__main__":
    main()
