"""From per-prompt runs to the report's figures: totals, 95% intervals, categories, greedy equality.

Every figure of a method is a ratio of sums over prompts (and over repeats): tau = decode tokens /
target passes, tokens/s = new tokens / seconds, speedup = tokens/s / ``hf``'s tokens/s on the same
prompts. Its 95% interval comes from a paired bootstrap over prompts: the same resampled prompts
for the method and for ``hf``, 2000 resamples, percentile interval (both fixed here, and said so
in the report). With several repeats, a prompt's figures are its sums over the repeats, and each
repeat's own speedup and tau are reported beside them (the spread between whole runs).

Greedy equality in bf16 / fp16: verifying several tokens in one forward rounds differently from
decoding them one at a time, so where the target's two best tokens are within rounding of each
other, a speculative method may emit the other one and the outputs part. :func:`classify_divergence`
tells such a tie ("identical up to numerics", as vLLM promises) from a real divergence, from the
target's own logits at the first differing position in both runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import zip_longest

import numpy as np
import torch

from draftsmith.eval.acceptance import DepthCounts
from draftsmith.eval.prompts import Prompt

REPORT_FORMAT = "draftsmith-bench"
REPORT_VERSION = 2
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95
# Two runs of the same target whose forwards group tokens differently give logits that differ by
# rounding. Measured on SmolLM2-135M (CPU, 1,890 top-5 logits, one-token decoding against 2- to
# 33-token verification forwards), a logit moved by at most 7 units in the last place of bf16 at
# its magnitude (99.9%: 5), 5 of fp16 (99.9%: 4) and 20 of fp32 (99.9%: 17). The gap between two
# tokens can move by twice that, so a differing token counts as a tie "up to numerics" when in
# both runs the two tokens' logits lie within these many ulps of each other (and the emitted
# token within as much of its run's best). Fixed here, not an option: docs/exactness.md.
NUMERIC_ULPS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 64, torch.float64: 64}

IDENTICAL = "identical"
UP_TO_NUMERICS = "identical up to numerics"
DIVERGED = "diverged"
NUMERICAL_TIE = "numerical tie"
REAL_DIVERGENCE = "real divergence"
UNEXPLAINED = "unexplained"  # a logit it needs is unknown (llama.cpp's top-n: -inf beyond)
DIFFERS_UNEXPLAINED = "differs, unexplained"


@dataclass
class PromptRun:
    """One method's generation for one prompt."""

    tokens: list[int]
    seconds: float
    target_passes: int  # decoding forwards of the target, prefill excluded
    acceptance: DepthCounts | None = None  # None: the method does not expose it (transformers)
    accepted_lengths: list[int] | None = None  # accepted draft tokens per round
    # our engine's rounds: (draft tokens, tokens cached, seconds) each; its reads of the device
    rounds: list[tuple[int, int, float]] | None = None
    host_reads: int | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tokens(self) -> int:
        return max(0, len(self.tokens) - 1)


@dataclass
class MethodRuns:
    name: str
    exact: bool
    runs: list[list[PromptRun]]  # [repeat][prompt]


def _round(value, digits: int = 4):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return round(float(value), digits)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _per_prompt(runs: list[list[PromptRun]], index: list[int], field: str) -> np.ndarray:
    """(repeats, prompts) array of one figure."""
    return np.array([[float(getattr(rep[i], field)) for i in index] for rep in runs],
                    dtype=np.float64).reshape(len(runs), len(index))


def bootstrap_interval(num: np.ndarray, den: np.ndarray, ref_num: np.ndarray | None = None,
                       ref_den: np.ndarray | None = None, resamples: int = BOOTSTRAP_RESAMPLES,
                       confidence: float = CONFIDENCE, seed: int = 0) -> list[float] | None:
    """Percentile interval of sum(num)/sum(den) [/ (sum(ref_num)/sum(ref_den))] over prompts.

    Arrays are per prompt (P,); the prompts are resampled with replacement, the same resample for
    the method and the reference (they ran on the same prompts in the same run). None with fewer
    than 2 prompts, where a resample says nothing.
    """
    count = len(num)
    if count < 2:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, count, size=(resamples, count))
    with np.errstate(divide="ignore", invalid="ignore"):
        stat = num[idx].sum(1) / den[idx].sum(1)
        if ref_num is not None:
            stat = stat / (ref_num[idx].sum(1) / ref_den[idx].sum(1))
    stat = stat[np.isfinite(stat)]
    if stat.size == 0:
        return None
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(stat, [tail, 100 - tail])
    return [float(lo), float(hi)]


def _speedup(tokens, seconds, other: MethodRuns, index: list[int], seed: int
             ) -> tuple[float | None, list[float] | None, list | None]:
    """tokens/s over ``other``'s on the same prompts: the ratio, its 95% interval, per repeat."""
    ref_tokens = _per_prompt(other.runs, index, "new_tokens")
    ref_seconds = _per_prompt(other.runs, index, "seconds")
    tps, ref_tps = _ratio(tokens.sum(), seconds.sum()), _ratio(ref_tokens.sum(), ref_seconds.sum())
    ratio = _round(tps / ref_tps) if tps and ref_tps else None
    interval = bootstrap_interval(tokens.sum(0), seconds.sum(0), ref_tokens.sum(0),
                                  ref_seconds.sum(0), seed=seed)
    repeats = None
    if len(tokens) > 1:
        repeats = [_round(_ratio(t.sum(), s.sum()) / _ratio(rt.sum(), rs.sum()))
                   if s.sum() and rs.sum() and rt.sum() else None
                   for t, s, rt, rs in zip(tokens, seconds, ref_tokens, ref_seconds)]
    return ratio, None if interval is None else [_round(v) for v in interval], repeats


def summarise_method(method: MethodRuns, reference: MethodRuns | None, index: list[int],
                     greedy: bool, seed: int = 0, per_prompt: bool = True,
                     speed_reference: MethodRuns | None = None) -> dict:
    """The report record of one method over the prompts ``index`` (all repeats).

    ``speedup`` is over ``speed_reference`` (our engine's plain decoding) when given, else over
    ``reference``; greedy equality is always against ``reference`` (transformers' generate),
    whose ratio is then ``speedup_vs_<reference>`` beside it."""
    runs = method.runs
    tokens = _per_prompt(runs, index, "new_tokens")
    seconds = _per_prompt(runs, index, "seconds")
    passes = _per_prompt(runs, index, "target_passes")
    decode = _per_prompt(runs, index, "decode_tokens")
    tps = _ratio(tokens.sum(), seconds.sum())
    record = {
        "method": method.name,
        "exact": method.exact,
        "num_prompts": len(index),
        "repeats": len(runs),
        "tau": _round(_ratio(decode.sum(), passes.sum())),
        "tau_ci95": None,
        "alpha": None,
        "alpha_per_depth": None,
        "accepted_per_depth": None,
        "tried_per_depth": None,
        "tokens_per_s": _round(tps, 3),
        "speedup": None,
        "speedup_ci95": None,
        "target_passes": int(passes.sum()),
        "new_tokens": int(tokens.sum()),
        "seconds": _round(seconds.sum(), 3),
        "accepted_length_histogram": None,
        "greedy_identical": None,
    }
    tau_ci = bootstrap_interval(decode.sum(0), passes.sum(0), seed=seed)
    record["tau_ci95"] = None if tau_ci is None else [_round(v) for v in tau_ci]
    counted = [rep[i] for rep in runs for i in index if rep[i].acceptance is not None]
    if any(sum(r.acceptance.tried_per_depth) for r in counted):  # the method drafted something
        total = DepthCounts()
        histogram: list[int] = []
        for r in counted:
            total.add(r.acceptance)
            for n in r.accepted_lengths or []:
                histogram.extend([0] * (n + 1 - len(histogram)))
                histogram[n] += 1
        record["alpha"] = _round(total.alpha)
        record["alpha_per_depth"] = [_round(a) for a in total.alpha_per_depth]
        record["accepted_per_depth"] = total.accepted_per_depth
        record["tried_per_depth"] = total.tried_per_depth
        record["accepted_length_histogram"] = histogram
    speed = speed_reference or reference
    if speed is not None:
        record["speedup"], record["speedup_ci95"], per_repeat = _speedup(
            tokens, seconds, speed, index, seed)
        if per_repeat is not None:
            record["speedup_per_repeat"] = per_repeat
    if reference is not None and speed_reference is not None:
        ratio, interval, _ = _speedup(tokens, seconds, reference, index, seed)
        record[f"speedup_vs_{reference.name}"] = ratio
        record[f"speedup_vs_{reference.name}_ci95"] = interval
    engine_runs = [rep[i] for rep in runs for i in index if rep[i].rounds is not None]
    if engine_runs:  # our engine: its rounds and its reads of the device
        rounds = sum(len(r.rounds) for r in engine_runs)
        decode_seconds = sum(sec for r in engine_runs for _, _, sec in r.rounds)
        record["rounds"] = rounds
        record["host_reads_per_round"] = _round(_ratio(sum(r.host_reads for r in engine_runs),
                                                       rounds), 3)
        record["decode_seconds"] = _round(decode_seconds, 3)
        record["decode_tokens_per_s"] = _round(
            _ratio(sum(r.decode_tokens for r in engine_runs), decode_seconds), 3)
    if reference is not None:
        if greedy:
            differ = [i for i in index
                      if any(rep[i].tokens != ref_rep[i].tokens
                             for rep, ref_rep in zip(runs, reference.runs))]
            record["greedy_identical"] = not differ
            record["greedy_verdict"] = IDENTICAL if not differ else None
            if differ:
                record["differing_prompts"] = differ
    if len(runs) > 1:
        record["tau_per_repeat"] = [_round(_ratio(d.sum(), p.sum())) for d, p in zip(decode, passes)]
    if per_prompt:
        record["per_prompt"] = {"new_tokens": tokens.astype(int).tolist(),
                                "seconds": np.round(seconds, 4).tolist(),
                                "target_passes": passes.astype(int).tolist()}
    return record


def summarise(methods: list[MethodRuns], prompts: list[Prompt], greedy: bool,
              reference: str = "hf", seed: int = 0, speed_reference: str | None = None) -> dict:
    """Records over all prompts, and per category when the prompts carry categories; speedups
    over ``speed_reference`` when given (else ``reference``), greedy equality with
    ``reference``."""
    ref = next((m for m in methods if m.name == reference), None)
    speed = next((m for m in methods if m.name == speed_reference), None)
    everything = list(range(len(prompts)))
    overall = [summarise_method(m, ref, everything, greedy, seed, speed_reference=speed)
               for m in methods]
    categories = []
    names = list(dict.fromkeys(p.category for p in prompts if p.category is not None))
    if names:
        groups = {name: [i for i, p in enumerate(prompts) if p.category == name] for name in names}
        uncategorised = [i for i, p in enumerate(prompts) if p.category is None]
        if uncategorised:
            groups["(no category)"] = uncategorised
        for name, index in groups.items():
            categories.append({
                "category": name, "num_prompts": len(index),
                "methods": [summarise_method(m, ref, index, greedy, seed, per_prompt=False,
                                             speed_reference=speed) for m in methods],
            })
    return {"methods": overall, "categories": categories}


# ---------------------------------------------------------------------------------------------
# greedy equality up to numerics


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of ``dtype`` numbers at ``magnitude`` (its unit in the last place)."""
    info = torch.finfo(dtype)
    if not math.isfinite(magnitude):
        return math.nan  # no spacing at an unknown value; nothing compares within it
    magnitude = max(abs(magnitude), info.tiny)
    return 2.0 ** math.floor(math.log2(magnitude)) * info.eps


def classify_divergence(reference_logits: torch.Tensor, method_logits: torch.Tensor,
                        reference_token: int, method_token: int, dtype: torch.dtype) -> dict:
    """Why two greedy runs of one target emitted different tokens at the same position.

    ``*_logits`` (vocab,): the target's logits behind that position in each run (the reference,
    one token per forward; the method, its verification forward). A numerical tie: in both runs
    the two tokens lie within ``NUMERIC_ULPS[dtype]`` ulps of ``dtype`` of each other, and the
    method's token is within as much of its run's best. Anything else is a real divergence: the method
    emitted a token its own target did not prefer (a broken verifier, or a broken cache).
    """
    ref = reference_logits.double()
    mine = method_logits.double()
    a, b = int(reference_token), int(method_token)

    def known(value: float) -> float | None:
        return value if math.isfinite(value) else None

    def top2(row: torch.Tensor) -> dict:
        values, ids = row.topk(2)
        top = [int(i) if math.isfinite(float(v)) else None for v, i in zip(values, ids)]
        return {"top1": top[0], "top2": top[1], "margin": known(float(values[0] - values[1]))}

    needed = torch.stack([ref[a], ref[b], mine[a], mine[b], mine.max()])
    found = {"reference_token": a, "method_token": b, "reference_top2": top2(ref),
             "method_top2": top2(mine), "dtype": str(dtype).removeprefix("torch.")}
    if not bool(torch.isfinite(needed).all()):
        # a logit the comparison needs is not known (llama.cpp reports only its top-n
        # log-probabilities, -inf beyond them): neither a tie nor a divergence can be shown
        return {**found, "reference_gap": known(float(ref[a] - ref[b])),
                "method_gap": known(float(mine[b] - mine[a])),
                "method_behind_best": known(float(mine.max() - mine[b])), "tolerance": None,
                "classification": UNEXPLAINED,
                "note": "a logit this comparison needs is unknown (not among the top-n "
                        "log-probabilities the engine returned): the margin cannot be measured"}
    magnitude = max(abs(float(ref[a])), abs(float(mine[b])))
    tolerance = NUMERIC_ULPS.get(dtype, 64) * ulp(dtype, magnitude)
    ref_gap = float(ref[a] - ref[b])  # how far the reference run preferred its own token
    method_gap = float(mine[b] - mine[a])  # how far the method's run preferred its own token
    behind = float(mine.max() - mine[b])  # > 0: the method's token was not its run's best
    tie = abs(ref_gap) <= tolerance and abs(method_gap) <= tolerance and behind <= tolerance
    return {
        **found,
        "reference_gap": ref_gap,
        "method_gap": method_gap,
        "method_behind_best": behind,
        "tolerance": tolerance,
        "classification": NUMERICAL_TIE if tie else REAL_DIVERGENCE,
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip_longest(a, b)):
        if x != y:
            return i
    return None


def greedy_verdict(divergences: list[dict]) -> str:
    """identical / identical up to numerics / differs, unexplained / diverged, from a method's
    classified divergences (diverged only on evidence: a real divergence among them)."""
    if not divergences:
        return IDENTICAL
    if all(d.get("classification") == NUMERICAL_TIE for d in divergences):
        return UP_TO_NUMERICS
    if any(d.get("classification") == REAL_DIVERGENCE for d in divergences):
        return DIVERGED
    return DIFFERS_UNEXPLAINED  # ties and unknowns: no evidence either way


def greedy_summary(records: list[dict], reference: str = "hf") -> str:
    """One paragraph a user reads first: which methods matched ``reference`` and how."""
    checked = [r for r in records
               if r.get("greedy_identical") is not None and r["method"] != reference]
    if not checked:
        return "greedy equality: not checked (temperature > 0)"
    lines = []
    for r in checked:
        verdict = r.get("greedy_verdict") or (IDENTICAL if r["greedy_identical"]
                                              else DIFFERS_UNEXPLAINED)
        if verdict == IDENTICAL:
            continue
        count = len(r.get("differing_prompts") or [])
        detail = f"{count} of {r.get('num_prompts', '?')} prompts differ from {reference}"
        if verdict == UP_TO_NUMERICS:
            lines.append(f"{r['method']}: identical up to numerics ({detail}; each at a tie of "
                         f"the target's two best tokens within its dtype's rounding)")
        elif verdict == DIFFERS_UNEXPLAINED:
            lines.append(f"{r['method']}: differs, unexplained ({detail}; no real divergence "
                         f"shown, but not every difference could be measured as a tie: see its "
                         f"'divergences')")
        else:
            lines.append(f"{r['method']}: REAL DIVERGENCE ({detail}; at least one where the "
                         f"emitted token was not the target's choice): the engine is wrong")
    if not lines:
        return f"greedy equality: every method's output equals {reference}'s token for token"
    return "greedy equality: " + "; ".join(lines)
