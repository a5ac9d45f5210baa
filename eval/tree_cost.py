"""What a speculative round costs on this machine, measured: the tree sizing's timings.

* :func:`measure_verify_cost`: the target's verification forward over n tokens (n = 1 being
  plain decoding), ``context`` tokens already cached, the engine's 4-D tree mask;
* :func:`measure_eagle_draft_cost`: an EAGLE head's draft round (catching up on the accepted
  tokens, then an EAGLE-2 tree) per depth and branching;
* :func:`measure_head_cost`: Medusa heads' proposal of one round.

Costs depend on the machine, never on a head's training, so they are stored per
:func:`machine_key` (:func:`machine_description`: device and its model, threads, torch, target
shape, both precisions) in ``<artifact>/tree_calibration.json`` by :mod:`draftsmith.eval.tree_auto`, which
turns them and a head's acceptance into the tree to use (``--tree auto``, and the Medusa
trainer's ``tree_nodes: auto``).
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.eval.forward import compile_mode
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.targets.target import Target, dtype_name

# verification sizes timed (1 = plain decoding); small ones densely, where CPU optima lie
TIMED_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
COST_CONTEXT = 128  # tokens already cached when a verification or a draft round is timed
COST_REPEATS = 9  # timings per size (the median is kept): a few % of noise moves a CPU's optimum
TOPK_CHOICES = (1, 2, 3, 4, 6, 8)  # the EAGLE tree branchings whose draft rounds are timed
# the round whose costs these are: a calibration timed with another engine is measured again
ENGINE_ROUND = "static caches, device acceptance, one host read"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(target: Target, draft_dtype: torch.dtype | None,
                        compile: bool | str = False) -> dict:
    """What the measured costs depend on: device, its model, threads, software, shapes,
    precisions, and how the engine runs (its round, compiled or not)."""
    device = target.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    cfg = target.config
    return {
        "device": device.type,
        "device_name": name,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "platform": platform.machine(),
        "target_shape": f"{cfg.model_type} layers={target.num_layers} hidden={target.hidden_size} "
                        f"vocab={target.vocab_size}",
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "target_dtype": dtype_name(target.dtype),
        "draft_dtype": dtype_name(draft_dtype or target.dtype),
        "engine": ENGINE_ROUND,
        "compiled": compile_mode(compile),
    }


def machine_key(description: dict) -> str:
    text = json.dumps(description, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@torch.no_grad()
def measure_verify_cost(target: Target, sizes=TIMED_SIZES, context: int = COST_CONTEXT,
                        repeats: int = COST_REPEATS, seed: int = 0, *,
                        compile: bool | str = False) -> dict[int, float]:
    """Median seconds of the engine's side of a round verifying n tokens (root + n-1 tree
    nodes; n = 1 is plain decoding) with ``context`` tokens cached: whole rounds of the engine
    (its forward, mask, acceptance, host read and compaction), from a proposer whose trees cost
    nothing to propose (:class:`draftsmith.eval.round_cost.ReplayTree`), sizes interleaved so drifting load
    hits them alike. ``compile``: the engine's compiled forward (compiling happens first, apart).
    """
    from draftsmith.eval.engine import SpeculativeEngine
    from draftsmith.eval.round_cost import replay_rounds

    sizes = sorted({int(n) for n in sizes})
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes must be token counts >= 1, got {sizes}")
    if context < 1 or context + len(sizes) + sizes[-1] + 1 > target.max_context:
        raise ValueError(f"context {context} + a pass over {len(sizes)} sizes of up to "
                         f"{sizes[-1]} tokens must fit the target's context of "
                         f"{target.max_context}")
    engine = SpeculativeEngine(target, compile=compile)
    timed = replay_rounds(engine, [n - 1 for n in sizes], context, repeats + 1, seed=seed)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for n, _, seconds in timed[len(sizes):]:  # the first pass warms up
        times[n + 1].append(seconds)
    return {n: statistics.median(t) for n, t in times.items() if t}


@torch.no_grad()
def measure_head_cost(heads: MedusaHeads, depth: int | None = None, topk: int = 10,
                      repeats: int = 20) -> float:
    """Median seconds for the heads' proposal of one round: ``depth`` heads on h_t, then top-k."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    depth = heads.num_heads if depth is None else min(depth, heads.num_heads)
    param = next(heads.parameters(), None)
    weight = heads.lm_head_weight(0)
    device = param.device if param is not None else weight.device
    h = torch.randn(heads.config.hidden_size, device=device,
                    dtype=param.dtype if param is not None else weight.dtype)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        heads.top_tokens(h, min(topk, heads.config.head_vocab_size), num=depth).cpu()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@torch.no_grad()
def measure_eagle_draft_cost(proposer, target: Target, depths, topks, *,
                             context: int = COST_CONTEXT, repeats: int = 5, seed: int = 0,
                             compile: bool | str = False) -> dict[tuple[int, int], float]:
    """Median seconds an EAGLE proposer adds to a round, per (depth, topk): its ``propose``
    (catching up on the accepted tokens, the expansion, the tree) and ``observe``, timed inside
    whole rounds of the engine after ``context`` tokens, with every frontier row of that depth
    and branching expanded (``depth * topk`` nodes: the most the shape costs)."""
    from draftsmith.eval.engine import SpeculativeEngine
    from draftsmith.eval.round_cost import _context_prompt, _rounds, timed_proposer

    engine = SpeculativeEngine(target, compile=compile)
    prompt = _context_prompt(target.vocab_size, context, seed)
    settings = (proposer.depth, proposer.topk, proposer.tree_nodes)
    found = {}
    try:
        for d in depths:
            for k in topks:
                proposer.depth, proposer.topk, proposer.tree_nodes = d, k, d * k
                _rounds(engine, proposer, prompt, 1)  # a new shape compiles, warms up
                with timed_proposer(proposer, engine.device) as timing:
                    _rounds(engine, proposer, prompt, repeats)
                found[(d, k)] = timing.seconds()
    finally:
        proposer.depth, proposer.topk, proposer.tree_nodes = settings
    return found


@torch.no_grad()
def measure_draft_cost(proposer, target: Target, *, context: int = COST_CONTEXT,
                       repeats: int = 5, seed: int = 0, compile: bool | str = False) -> float:
    """Median seconds ``proposer`` adds to a round as it drafts now: whole rounds of the engine
    with it after ``context`` tokens, minus the engine's side of rounds of the same sizes."""
    from draftsmith.eval.engine import SpeculativeEngine
    from draftsmith.eval.round_cost import _context_prompt, _rounds

    engine = SpeculativeEngine(target, compile=compile)
    timed = _rounds(engine, proposer, _context_prompt(target.vocab_size, context, seed),
                    repeats + 1)[1:]  # the first warms up
    verify = measure_verify_cost(target, sorted({n + 1 for n, _, _ in timed} | {1}),
                                 context=context, repeats=repeats, seed=seed, compile=compile)
    return max(0.0, statistics.median(s - verify[n + 1] for n, _, s in timed))


def interpolate(costs: dict[int, float], n: int) -> float:
    """Cost of n tokens, linear between the measured sizes."""
    sizes = sorted(costs)
    if n in costs:
        return costs[n]
    if not sizes[0] <= n <= sizes[-1]:
        raise ValueError(f"no cost measured around {n} tokens (measured {sizes})")
    hi = next(s for s in sizes if s > n)
    lo = max(s for s in sizes if s < n)
    w = (n - lo) / (hi - lo)
    return costs[lo] * (1 - w) + costs[hi] * w


# ---------------------------------------------------------------------------------------------
# the calibration's budget: what --tree auto measures, sized to fit a stated time

CALIBRATION_BUDGET_S = 60.0  # seconds a calibration may take before the run it serves
SPARSE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # the verification sizes timed under a tight budget
SPARSE_TOPKS = (1, 2, 4, 8)
DRAFT_REPEATS = 5  # timings per EAGLE draft round shape


@dataclass(frozen=True)
class CalibrationPlan:
    """What a calibration measures: acceptance on ``num_prompts`` x ``max_new_tokens`` (when the
    artifact has none), verification at ``sizes`` x ``repeats`` and EAGLE draft rounds of
    ``topks`` (when this machine's costs are missing), and about how long that takes."""

    num_prompts: int
    max_new_tokens: int
    sizes: tuple[int, ...]
    repeats: int
    topks: tuple[int, ...]
    seconds: float  # the estimate, from one timed decoding step
    reduced: bool  # smaller than asked, to fit the budget

    def describe(self, acceptance: bool, costs: bool) -> str:
        parts = []
        if acceptance:
            parts.append(f"acceptance on {self.num_prompts} prompts x {self.max_new_tokens} tokens")
        if costs:
            parts.append(f"costs of {len(self.sizes)} verification sizes x {self.repeats} timings")
        return f"about {self.seconds:.0f} s: " + ", ".join(parts)


def plan_calibration(target: Target, *, acceptance: bool, costs: bool, eagle: bool,
                     num_prompts: int, max_new_tokens: int,
                     budget_seconds: float | None = CALIBRATION_BUDGET_S,
                     ) -> CalibrationPlan | None:
    """The largest calibration within ``budget_seconds`` (None: no bound), shrunk step by step
    from the one asked for (fewer tokens, then prompts, sizes, timings, branchings), each
    estimated from one timed decoding step of ``target``; None when even the smallest does not
    fit (the caller then keeps a fixed tree and says so)."""
    step = measure_verify_cost(target, (1,), context=COST_CONTEXT, repeats=2)[1]

    def plan(p: int, t: int, sizes, repeats: int, topks, reduced: bool) -> CalibrationPlan:
        seconds = 0.0
        if acceptance:  # the target's continuation, then a forward over it per prompt
            seconds += p * (t + 4) * step
        if costs:  # a verification of n tokens costs about 1 + n / 32 decoding steps on a CPU
            seconds += (repeats + 1) * sum(1 + n / 32 for n in sizes) * step
            if eagle:  # a draft round: a few head passes, a tenth of a target step or so each
                seconds += (DRAFT_REPEATS + 1) * 6 * len(topks) * 0.3 * step
        return CalibrationPlan(p, t, tuple(sizes), repeats, tuple(topks), seconds, reduced)

    asked = plan(num_prompts, max_new_tokens, TIMED_SIZES, COST_REPEATS, TOPK_CHOICES, False)
    if budget_seconds is None or asked.seconds <= budget_seconds:
        return asked
    ladder = []
    p, t = num_prompts, max_new_tokens
    while t > 16 or p > 1:  # fewer tokens first (down to 16), then fewer prompts
        t, p = (max(16, t // 2), p) if t > 16 else (t, max(1, p // 2))
        ladder.append((p, t, TIMED_SIZES, COST_REPEATS, TOPK_CHOICES))
    for repeats in (5, 3):
        ladder.append((p, t, SPARSE_SIZES, repeats, SPARSE_TOPKS))
    for args in ladder:
        candidate = plan(*args, True)
        if candidate.seconds <= budget_seconds:
            return candidate
    return None
