"""``python -m draftsmith.eval.bench --engine llama.cpp``: every method in the engine people serve with.

    python -m draftsmith.eval.bench --engine llama.cpp --target smollm2-135m --method plain \\
        --method ngram:ngram-simple --method eagle:artifacts/smollm2-135m/eagle3 \\
        --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 --max-new-tokens 128

One ``llama-server`` per method on 127.0.0.1 (free ports, ``--poll 0`` so idle servers do not
spin, ``--threads``), all up at once and driven over HTTP with the same chat-templated token ids,
interleaved prompt by prompt with the order rotated, after a warm-up; every server is stopped when
the run ends, fails or is interrupted. The target is a GGUF file: the embedded name's own GGUF,
a ``.gguf`` given as it is, or a Hugging Face directory converted once by llama.cpp's converter
(``--gguf-target-type``, f32 by default). Heads and drafts are exported to GGUF for the run
(``--gguf-type``). Each row of ``draftsmith.eval.methods.BENCH_METHODS`` says what its method is in
llama.cpp (``serve``): ``plain``; ``ngram:<type>`` (llama.cpp's own n-gram lookups);
``eagle:<artifact>`` (``--spec-type draft-eagle3``); ``draft:<dir>`` (``draft-simple``).

Figures come from the server's own timings: tokens/s over ``predicted_ms`` (decoding; the
prefill's ``prompt_ms`` is kept beside it), accepted / drafted from ``draft_n_accepted`` /
``draft_n``, per round and depth from the server's trace log (``LLAMA_TRACE=1``: "accepted k/n
draft tokens"), tokens per target pass = (new tokens - 1) / (new tokens - 1 - accepted).
``speedup`` is over llama.cpp's ``plain`` in the same run; at temperature 0 every method's
output is compared with plain's, and each differing prompt is replayed asking the server for
its token probabilities (top 5) to say whether the first difference is a near-tie. With
``--cross-check`` each head's acceptance per depth is measured in draftsmith's own engine too,
on the same prompts as a chain of the same length, and put beside llama.cpp's.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.eval.acceptance import DepthCounts
from draftsmith.eval.methods import build_methods, method_for, resolve
from draftsmith.eval.runners import Method, run_benchmark
from draftsmith.eval.sampling import SamplingParams
from draftsmith.eval.summary import PromptRun
from draftsmith.files.output_dir import check_writable_dir
from draftsmith.layouts.llama_cpp import LlamaServer, find_llama_server
from draftsmith.targets.target import Target

ENGINE = "llama.cpp"
# llama.cpp quantises activations to 8 bits (q8) for quantised weights' dot products, so a
# quantised target's near-ties are judged at bf16 precision (8 significant bits). Its KV cache is
# f16 (the servers run with llama.cpp's default --cache-type-k/v), and attention's queries are
# rounded to f16 to meet it, so even an f32 target's logits carry f16 rounding, in an order that
# differs between a one-token step and a batched verification: judged at f16 (seen: an f32 GGUF's
# top two 0.0016 apart in log-probability traded places, 1 prompt in 20, for two methods alike)
TIE_DTYPES = {"f32": torch.float16, "f16": torch.float16, "bf16": torch.bfloat16}
TOP_PROBS = 5


@dataclass
class ServeContext:
    """What every row's ``serve`` is handed for ``--engine llama.cpp``."""

    target: Target  # the target's tokenizer and identity (its weights are llama.cpp's GGUF)
    target_gguf: Path
    work_dir: Path  # the run's GGUF exports and server logs
    draft_max: int | None = None  # --spec-draft-n-max (None: each method's own default)
    draft_p_min: float = 0.0  # --spec-draft-p-min
    gguf_type: str = "f16"  # the heads' and drafts' GGUF precision
    options: dict[str, dict] = field(default_factory=dict)

    def draft_args(self, draft_gguf: Path, spec_type: str, default_max: int) -> list[str]:
        """llama-server's arguments for a draft model file: ``--spec-draft-n-max`` is the
        command line's when given, else the method's own (``default_max``)."""
        return ["-md", str(draft_gguf), "--spec-type", spec_type,
                "--spec-draft-n-max", str(self.draft_max or default_max),
                "--spec-draft-p-min", str(self.draft_p_min)]


def chain_rounds(rounds: list[tuple[int, int]]) -> tuple[DepthCounts, list[int]]:
    """(acceptance per depth, accepted lengths) of chain rounds (accepted, drafted)."""
    counts = DepthCounts()
    for accepted, drafted in rounds:
        counts.add_round(range(1, accepted + 1), range(1, min(accepted + 1, drafted) + 1))
    return counts, [accepted for accepted, _ in rounds]


class LlamaMethod(Method):
    """One method served by its own llama-server; ``run`` is one /completion request."""

    def __init__(self, name: str, server: LlamaServer):
        self.name, self.server = name, server

    def _request(self, prompt_ids, max_new_tokens, params: SamplingParams, seed: int,
                 n_probs: int = 0) -> dict:
        if not params.greedy:
            raise ValueError("--engine llama.cpp measures greedy decoding (--temperature 0): "
                             "its servers' samplers are not draftsmith's warped distributions")
        return self.server.complete(prompt_ids, max_new_tokens, n_probs=n_probs)

    def run(self, prompt_ids, max_new_tokens, params, seed) -> PromptRun:
        self.server.rounds()  # what earlier requests logged
        out = self._request(prompt_ids, max_new_tokens, params, seed)
        tokens = [int(t) for t in out.get("tokens") or []]
        timings = out.get("timings") or {}
        accepted = int(timings.get("draft_n_accepted", 0))
        counts, lengths = chain_rounds(self.server.rounds())
        if sum(lengths) != accepted:
            raise ValueError(f"{self.name}: the server's trace log counts {sum(lengths)} accepted "
                             f"draft tokens, its timings {accepted}; the log is "
                             f"{self.server.log_path}")
        passes = max(0, len(tokens) - 1 - accepted)
        run = PromptRun(tokens, float(timings.get("predicted_ms", 0.0)) / 1000.0, passes,
                        counts if timings.get("draft_n") else None, lengths or None)
        run.server_timings = timings
        return run

    def trace(self, prompt_ids, max_new_tokens, params):
        """Greedy tokens and, per position, a (vocab,) row of the server's top log-probabilities
        (-inf elsewhere), for the greedy report."""
        out = self._request(prompt_ids, max_new_tokens, params, 0, n_probs=TOP_PROBS)
        tokens = [int(t) for t in out.get("tokens") or []]
        vocab = self.server_vocab
        rows = []
        for entry in out.get("completion_probabilities") or []:
            row = torch.full((vocab,), -math.inf, dtype=torch.float64)
            for top in entry.get("top_logprobs") or entry.get("top_probs") or []:
                value = top.get("logprob")
                if value is None:
                    value = math.log(max(float(top["prob"]), 1e-300))
                row[int(top["id"])] = float(value)
            rows.append(row)
        return tokens, rows


def serve_methods(specs: list[str], ctx: ServeContext, *, threads: int, ctx_size: int,
                  stack: contextlib.ExitStack) -> list[LlamaMethod]:
    """One started llama-server per method (stopped by ``stack``), in the order given."""
    planned = []
    for spec in specs:
        row, arg = resolve(spec, ENGINE)
        planned.append((spec, row.serve(arg, spec, ctx)))
    needed = sorted({a for _, args in planned for i, a in enumerate(args)
                     if i and args[i - 1] == "--spec-type"})
    server_path = find_llama_server(needed)
    methods = []
    for spec, args in planned:
        server = LlamaServer(["-m", str(ctx.target_gguf), "-c", str(ctx_size), "-np", "1",
                              *args], name=spec, threads=threads, server=server_path,
                             log_dir=ctx.work_dir / "logs")
        stack.callback(server.stop)  # registered before it starts: a stop while it loads ends it
        server.start()
        method = LlamaMethod(spec, server)
        method.server_vocab = ctx.target.vocab_size
        method.draft_max = (int(args[args.index("--spec-draft-n-max") + 1])
                            if "--spec-draft-n-max" in args else None)
        methods.append(method)
    return methods


def check_work_dir(requested: str, inputs) -> Path:
    """``--llama-work-dir``: a directory (made if missing) that can be written and is none of the
    run's inputs nor inside one (its GGUF exports and logs would land there); a ValueError else."""
    path = Path(requested).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{requested} exists and is not a directory: give a directory for the "
                         "run's GGUF exports and server logs (a new path is made)")
    real = path.resolve()
    for source in inputs:  # files are added to it, so it may hold an input, not be or sit in one
        source = Path(source).resolve()
        if real == source or source in real.parents:
            raise ValueError(f"{requested} {'is' if real == source else 'is inside'} an input of "
                             f"this run ({source}); choose another directory")
    return check_writable_dir(path, "work directory")


def work_dir(requested: str | None) -> tuple[Path, contextlib.AbstractContextManager]:
    """The run's scratch directory: the one asked for (kept), else a temporary one (removed
    however the run ends, a signal included)."""
    if requested:
        path = Path(requested).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--llama-work-dir {requested} cannot be made: "
                             f"{err.strerror or err}") from err
        return path, contextlib.nullcontext()
    tmp = tempfile.TemporaryDirectory(prefix="draftsmith-llama-")
    return Path(tmp.name), tmp


def tie_dtype(gguf_type: str | None) -> torch.dtype:
    return TIE_DTYPES.get((gguf_type or "").lower(), torch.bfloat16)


@dataclass
class EngineRun:
    """What the benchmark measures with one engine: its methods on the tokenised prompts."""

    methods: list
    prompts: list[list[int]]
    target: Target
    reference: str  # the greedy reference (and the speedup baseline unless speed_reference)
    tie_dtype: torch.dtype  # the precision near-ties are judged at
    config: dict
    speed_reference: str | None = None  # the speedup baseline when not the greedy reference


def llama_engine(args, prompt_set, specs: list[str], stack: contextlib.ExitStack) -> EngineRun:
    """Start the servers of ``specs`` (``plain`` first, added when missing) for ``args``."""
    from draftsmith.layouts.llama_cpp import COMMIT, gguf_for_target
    from draftsmith.targets.target import load_target, load_target_parts

    if "plain" not in specs:
        print("[bench] adding `plain`: with --engine llama.cpp speedup is measured against "
              "llama.cpp's plain decoding in the same run", flush=True)
        specs = ["plain", *specs]
    load = load_target if args.cross_check else load_target_parts
    target = load(args.target, device="cpu", dtype="float32")
    prompts = [target.prompt_ids(p.text, args.prompt_format) for p in prompt_set.prompts]
    longest = max(len(p) for p in prompts) + args.max_new_tokens + 16
    ctx_size = max(args.llama_ctx, 256 * math.ceil(longest / 256))
    target_gguf, target_type = gguf_for_target(args.target, args.gguf_target_type)
    scratch, keeper = work_dir(args.llama_work_dir)
    stack.enter_context(keeper)
    ctx = ServeContext(target, target_gguf, scratch, draft_max=args.llama_draft_max,
                       draft_p_min=args.llama_draft_p_min, gguf_type=args.gguf_type)
    methods = serve_methods(specs, ctx, threads=args.threads or 1, ctx_size=ctx_size,
                            stack=stack)
    server = methods[0].server.server
    config = {"engine": ENGINE, "llama_server": str(server), "llama_cpp_commit": COMMIT,
              "target_gguf": str(target_gguf), "target_gguf_type": target_type,
              "head_gguf_type": args.gguf_type,
              "spec_draft_n_max": {m.name: m.draft_max for m in methods if m.draft_max},
              "spec_draft_p_min": args.llama_draft_p_min, "ctx_size": ctx_size,
              "server_args": {m.name: m.server.args for m in methods},
              "timing": "the server's predicted_ms (decoding; prompt_ms beside it per prompt)"}
    return EngineRun(methods, prompts, target, "plain", tie_dtype(target_type), config)


def cross_check(records: list[dict], target: Target, prompts: list[list[int]], *,
                max_new_tokens: int, chains: dict[str, int]) -> None:
    """Each head's acceptance per depth in draftsmith's engine beside llama.cpp's (in place).

    The same prompts, greedy, each head drafting a chain of ``chains[method]`` tokens (its
    server's ``--spec-draft-n-max``), with the options its row in ``BENCH_METHODS`` gives for a
    chain (``chain``: EAGLE heads with topk 1, draft models with no confidence stop, block drafts
    with that many tokens per round).
    """
    heads = [r for r in records if method_for(r["method"]).chain is not None]
    for record in heads:
        chain = chains[record["method"]]
        row = method_for(record["method"])
        options = {row.kind: row.chain(chain)}
        ours = build_methods([record["method"]], target, options=options, tree="fixed")
        method_runs, = run_benchmark(ours, prompts, max_new_tokens=max_new_tokens,
                                     params=SamplingParams(temperature=0.0), warmup=0,
                                     progress=False)
        total = DepthCounts()
        for run in method_runs.runs[0]:
            total.add(run.acceptance)
        record["cross_check"] = {
            "chain": chain,
            ENGINE: {"alpha_per_depth": record.get("alpha_per_depth"),
                     "accepted_per_depth": record.get("accepted_per_depth"),
                     "tried_per_depth": record.get("tried_per_depth")},
            "draftsmith": {"alpha_per_depth": [None if a is None else round(a, 4)
                                               for a in total.alpha_per_depth],
                           "accepted_per_depth": total.accepted_per_depth,
                           "tried_per_depth": total.tried_per_depth},
        }
