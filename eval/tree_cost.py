"""What a speculative round costs on this machine, measured: the tree sizing's timings.

* :func:`measure_verify_cost`: the target's verification forward over n tokens (n = 1 being
  plain decoding), ``context`` tokens already cached, the engine's 4-D tree mask;
* :func:`measure_eagle_draft_cost`: an EAGLE head's draft round (catching up on the accepted
  tokens, then an EAGLE-2 tree) per depth and branching;
* :func:`measure_head_cost`: Medusa heads' proposal of one round.

Costs depend on the machine, never on a head's training, so they are stored per
:func:`machine_key` (:func:`machine_description`: device and its model, threads, torch, target
shape, both precisions) in ``<artifact>/tree_calibration.json`` by :mod:`eval.tree_auto`, which
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

from eval.kv import crop
from heads.medusa import MedusaHeads
from heads.target import Target, dtype_name, tree_attention_mask

# verification sizes timed (1 = plain decoding); small ones densely, where CPU optima lie
TIMED_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
COST_CONTEXT = 128  # tokens already cached when a verification or a draft round is timed
COST_REPEATS = 9  # timings per size (the median is kept): a few % of noise moves a CPU's optimum
TOPK_CHOICES = (1, 2, 3, 4, 6, 8)  # the EAGLE tree branchings whose draft rounds are timed


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


def machine_description(target: Target, draft_dtype: torch.dtype | None) -> dict:
    """What the measured costs depend on: device, its model, threads, software, shapes, precisions."""
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
    }


def machine_key(description: dict) -> str:
    text = json.dumps(description, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@torch.no_grad()
def measure_verify_cost(target: Target, sizes=TIMED_SIZES, context: int = COST_CONTEXT,
                        repeats: int = COST_REPEATS, seed: int = 0) -> dict[int, float]:
    """Median seconds of one verification forward over n tokens (root + n-1 tree nodes).

    The forward is the engine's: ``context`` tokens already cached, a 4-D tree mask and per-node
    positions for n > 1, the final hidden state collected, the cache cropped back afterwards.
    """
    from transformers import DynamicCache

    sizes = sorted({int(n) for n in sizes})
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes must be token counts >= 1, got {sizes}")
    if context < 1 or context + sizes[-1] > target.max_context:
        raise ValueError(f"context {context} + {sizes[-1]} tokens must fit the target's context "
                         f"of {target.max_context}")
    model, device, dtype = target.model, target.device, target.dtype
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, context + sizes[-1]), generator=gen)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :context].to(device), cache=cache, use_cache=True, logits_to_keep=1)
    calls = {}
    for n in sizes:
        kwargs = {}
        if n > 1:
            # the mask's shape sets the cost of the forward, not its pattern: a chain will do
            allowed = torch.ones(n, n, dtype=torch.bool).tril()
            kwargs["attention_mask"] = tree_attention_mask(allowed, context, dtype, device)
            kwargs["position_ids"] = torch.arange(context, context + n, device=device)[None]
        calls[n] = (ids[:, context:context + n].to(device), kwargs)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    # sizes interleaved within each repeat, so drifting machine load hits them alike; the first
    # repeat pays for warm-up and is dropped
    for _ in range(repeats + 1):
        for n in sizes:
            block, kwargs = calls[n]
            sync(device)
            start = time.perf_counter()
            out = model(input_ids=block, cache=cache, use_cache=True, output_hidden_states=True,
                        **kwargs)
            out.hidden_states[target.num_layers].sum().item()
            sync(device)
            times[n].append(time.perf_counter() - start)
            cache.crop(-n)  # drop the n verified tokens (transformers 5: a negative count)
    return {n: statistics.median(t[1:]) for n, t in times.items()}


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
                             context: int = COST_CONTEXT, accepted: int = 1,
                             repeats: int = 5, seed: int = 0) -> dict[tuple[int, int], float]:
    """Median seconds of one EAGLE draft round per (depth, topk): catching up on ``accepted``
    verified tokens, then the EAGLE-2 tree. The head's cache holds ``context`` entries."""
    head = proposer.head
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, target.vocab_size, (context + 1,), generator=gen).tolist()
    out = target.model(input_ids=torch.tensor([seq[:context]], device=target.device),
                       output_hidden_states=True, use_cache=False, logits_to_keep=1)
    hidden = [out.hidden_states[i] for i in proposer.hidden_layers]
    proposer.start(seq[:context], hidden, None, None)  # catches up on context - 1 entries
    fused = proposer._fuse(hidden)  # (1, context, h)
    saved = (proposer.root_hidden, proposer.root_logits)
    base = proposer.cached
    settings = (proposer.depth, proposer.topk, proposer.tree_nodes)
    times: dict[tuple[int, int], list[float]] = {(d, k): [] for d in depths for k in topks}
    try:
        for _ in range(repeats + 1):
            for d, k in times:
                proposer.depth, proposer.topk = d, k
                # every scored child may enter the tree, so nothing is pruned: the full
                # expansion's cost, an upper bound on a smaller tree's (see eval.eagle)
                proposer.tree_nodes = k + (d - 1) * k * k
                # rewind: the last ``accepted`` entries are to be caught up on again
                crop(proposer.cache, base - accepted)
                proposer.cached = base - accepted
                proposer.pending = fused[:, base - accepted: base + 1]
                sync(head.device)
                start = time.perf_counter()
                proposer.propose(seq, d)
                sync(head.device)
                times[(d, k)].append(time.perf_counter() - start)
    finally:
        proposer.depth, proposer.topk, proposer.tree_nodes = settings
        proposer.root_hidden, proposer.root_logits = saved
    return {key: statistics.median(t[1:]) for key, t in times.items()}


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
