"""``--tree auto``: the draft tree that maximises expected tokens per second on this machine.

Speculative decoding pays when ``tau`` (tokens per target pass) grows faster than the round's
cost. Both sides are measured:

* **Acceptance** (machine-independent, per artifact): ``rank_accuracies[d][r]``, the chance that
  the target's token at depth d+1 is the head's rank-r guess there, given the path above it was
  right. Medusa artifacts store theirs from training (held-out rows). For EAGLE heads it is
  measured here (:func:`eagle_rank_accuracies`) on the target's own greedy continuations of a few
  held-out prompts: the head drafts along the true continuation (its own features, the true
  tokens: exactly what it sees on an accepted path) for ``depth`` steps at every position.
* **Cost** (per machine): the target's verification forward over 1 + n tokens
  (:func:`draftsmith.eval.tree_cost.measure_verify_cost`, n = 0 being plain decoding) and the draft's cost
  per round: for EAGLE, catching up on the accepted tokens plus an EAGLE-2 tree of each depth and
  branching (:func:`measure_eagle_draft_cost`); for Medusa, the heads' proposal.

:func:`choose_eagle_tree` then tries every depth d and branching k, grows the best static tree of
n nodes from the accuracies (Medusa's greedy construction, as Sequoia and EAGLE-2's node budget
do), and keeps the (d, k, n) with the highest ``expected_tau * plain_cost / round_cost``. The
dynamic EAGLE-2 tree with the same (d, k, n) re-ranks its nodes by the head's own confidence each
round, so it usually does a little better than the static estimate.

Both measurements are kept in ``<artifact>/tree_calibration.json`` (:class:`Calibration`): the
acceptance under the artifact's weights digest (remeasured when the weights change), the costs
under a machine key (device and its model, threads, torch version, target shape and both
precisions). A calibration made on another machine is never used: this machine's costs are
measured and added beside it; nothing in the file is overwritten but this machine's own entry. A
damaged file (not UTF-8, not JSON, entries of the wrong shape) is named and measured again.

What is measured is bounded by a stated time (``budget_seconds``, 60 s by default:
:func:`draftsmith.eval.tree_cost.plan_calibration` shrinks the calibration to fit, estimated from one timed
decoding step); how long it will take is said before it starts, and a budget of 0 skips it: the
stored calibration is used when there is one, else the artifact's fixed tree.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.eval.tree_choice import (
    MAX_DEPTH,
    MAX_NODES,
    MAX_TOPK,
    choose_eagle_tree,
    choose_tree_nodes,
)
from draftsmith.eval.tree_cost import (
    CALIBRATION_BUDGET_S,
    COST_CONTEXT,
    DRAFT_REPEATS,
    CalibrationPlan,
    interpolate,
    machine_description,
    machine_key,
    measure_draft_cost,
    measure_eagle_draft_cost,
    measure_head_cost,
    measure_verify_cost,
    plan_calibration,
)
from draftsmith.files.output_dir import write_atomic
from draftsmith.heads.artifact import read_artifact_config
from draftsmith.heads.medusa_tree import (
    check_tree,
    default_chain,
    rank_table,
)
from draftsmith.targets.target import Target, dtype_name

CALIBRATION_FILE = "tree_calibration.json"
CALIBRATION_FORMAT = "draftsmith-tree-calibration"
CALIBRATION_VERSION = 1
RANKS_MEASURED = 10  # ranks whose acceptance is measured
DEFAULT_CALIBRATION_PROMPTS = Path(__file__).resolve().parents[1] / "data/eval/vicuna_bench_question.jsonl"
CALIBRATION_NUM_PROMPTS = 8
CALIBRATION_NEW_TOKENS = 64


def log(message: str) -> None:
    print(f"[tree auto] {message}", file=sys.stderr)


def artifact_weights_digest(artifact: str | os.PathLike) -> str:
    """sha256 over the artifact's own weight files (``*.safetensors`` at its top level)."""
    files = sorted(Path(artifact).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{artifact} holds no *.safetensors weights")
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode())
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# the stored calibration


def _number(value, low: float = 0.0, high: float = math.inf) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and low <= value <= high)


def _acceptance_problem(entry) -> str | None:
    """What is wrong with a stored acceptance entry (None: usable)."""
    acc = entry.get("rank_accuracies") if isinstance(entry, dict) else None
    if not (isinstance(acc, list) and acc and all(
            isinstance(row, list) and row and all(_number(v, 0, 1) for v in row) for row in acc)):
        return "rank_accuracies is not a table of numbers in [0, 1]"
    return None


def _costs_problem(entry, needs: tuple[str, ...]) -> str | None:
    """What is wrong with a stored machine entry (None: usable); ``needs``: the costs besides
    verification that the method reads (``draft_seconds``, ``head_seconds``)."""
    if not isinstance(entry, dict):
        return "not a mapping"
    verify = entry.get("verify_seconds")
    if not (isinstance(verify, dict) and "1" in verify and len(verify) > 1 and all(
            isinstance(n, str) and n.isdigit() and _number(v) for n, v in verify.items())):
        return "verify_seconds is not a mapping of token counts (1 and more) to seconds"
    draft = entry.get("draft_seconds")
    if "draft_seconds" in needs and not (isinstance(draft, dict) and draft and all(
            isinstance(dk, str) and len(dk.split(",")) == 2
            and all(x.isdigit() for x in dk.split(",")) and _number(v)
            for dk, v in draft.items())):
        return "draft_seconds is not a mapping of 'depth,topk' to seconds"
    if "head_seconds" in needs and not _number(entry.get("head_seconds")):
        return "head_seconds is not a number of seconds"
    return None


@dataclass
class Calibration:
    """``<artifact>/tree_calibration.json``: acceptance per weights digest, costs per machine."""

    path: Path
    acceptance: dict = field(default_factory=dict)  # weights digest -> {rank_accuracies, ...}
    machines: dict = field(default_factory=dict)  # machine key -> {machine, verify_seconds, ...}

    @classmethod
    def load(cls, artifact: str | os.PathLike) -> Calibration:
        """The stored calibration; a damaged file is named and treated as empty (measured again
        and replaced); one written by a newer draftsmith is refused (never replaced)."""
        path = Path(artifact) / CALIBRATION_FILE
        if not path.exists():
            return cls(path)
        problem, data = None, None
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except OSError as err:
            problem = f"cannot be read: {err.strerror or err}"
        except UnicodeDecodeError as err:
            problem = f"byte {err.start} is not UTF-8 text"
        except ValueError as err:
            problem = f"not JSON: {err}"
        if problem is None and not (isinstance(data, dict)
                                    and data.get("format") == CALIBRATION_FORMAT):
            problem = f"not a {CALIBRATION_FORMAT} file"
        if problem is None:
            version = data.get("version")
            if isinstance(version, int) and version > CALIBRATION_VERSION:
                raise ValueError(f"{path} has version {version}; this draftsmith reads version "
                                 f"{CALIBRATION_VERSION}: upgrade draftsmith, or move the file "
                                 "away and it is measured again")
            if version != CALIBRATION_VERSION:
                problem = f"version {version!r}, not {CALIBRATION_VERSION}"
            elif not all(isinstance(data.get(k) or {}, dict) for k in ("acceptance", "machines")):
                problem = "its acceptance or machines are not mappings"
        if problem is not None:
            log(f"{path} is damaged ({problem}); the calibration is measured again and the file "
                "replaced")
            return cls(path)
        return cls(path, dict(data.get("acceptance") or {}), dict(data.get("machines") or {}))

    def usable(self, table: str, key: str, problem) -> dict | None:
        """The entry ``key`` of ``table`` ("acceptance" or "machines") if ``problem(entry)`` finds
        nothing wrong; a damaged entry is named, dropped and measured again."""
        entries = getattr(self, table)
        entry = entries.get(key)
        if entry is None:
            return None
        why = problem(entry)
        if why is None:
            return entry
        log(f"{self.path}: its {table} entry {key} is damaged ({why}); measuring it again")
        del entries[key]
        return None

    def save(self) -> bool:
        """Write atomically; False (and a warning) where the artifact's folder is read-only."""
        data = {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION,
                "acceptance": self.acceptance, "machines": self.machines}
        try:
            write_atomic(self.path, json.dumps(data, indent=1) + "\n")
        except OSError as err:
            log(f"could not store the calibration in {self.path} ({err}); it is measured again "
                "next time")
            return False
        return True


def _plan(artifact, target: Target, *, acceptance: bool, costs: bool, eagle: bool,
          num_prompts: int, max_new_tokens: int, budget_seconds: float | None,
          fixed: str) -> CalibrationPlan | None:
    """What to measure within the budget, said before it starts; None (said too) when nothing
    may be measured: ``fixed`` describes the tree used instead."""
    if not (acceptance or costs):
        return None
    plan = None
    if budget_seconds != 0:
        plan = plan_calibration(target, acceptance=acceptance, costs=costs, eagle=eagle,
                                num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                                budget_seconds=budget_seconds)
    if plan is None:
        why = ("the calibration budget is 0" if budget_seconds == 0 else
               f"even the smallest calibration would take longer than its {budget_seconds:g} s "
               "budget on this machine")
        log(f"{artifact}: --tree auto has no stored calibration here and {why}; using {fixed} "
            "(raise --tree-calibration-seconds to measure one)")
        return None
    limited = (f", reduced to fit the {budget_seconds:g} s budget" if plan.reduced else "")
    log(f"{artifact}: calibrating the tree before the run ({plan.describe(acceptance, costs)}"
        f"{limited}); --tree fixed or --tree-calibration-seconds 0 skips it")
    return plan


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------
# acceptance of an EAGLE head


def _rank_of(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(N, V) logits and (N,) indices (-1: no row) -> the rank of each index (-1 where none)."""
    safe = index.clamp_min(0)
    own = logits.gather(1, safe[:, None])
    rank = (logits > own).sum(-1)
    return torch.where(index >= 0, rank, torch.full_like(rank, -1))


@torch.no_grad()
def eagle_rank_accuracies(head, target: Target, prompts: list[list[int]], *,
                          max_new_tokens: int = CALIBRATION_NEW_TOKENS, depth: int = MAX_DEPTH,
                          ranks: int = RANKS_MEASURED) -> dict:
    """Per-depth, per-rank acceptance of an EAGLE head on the target's greedy continuations.

    For each prompt the target writes its greedy continuation; the head then runs ``depth``
    test-time steps over the whole sequence at once (step i: the true tokens, its own step i-1
    features), and at every anchor after the prompt the rank of the true token in its
    distribution is counted. Depth d+1 is counted only where depths 1..d ranked within
    ``ranks`` (the path could have been in a tree). Returns {"rank_accuracies": (depth, ranks),
    "positions": anchors per depth, "tokens": continuation tokens}.
    """
    from draftsmith.eval.engine import SpeculativeEngine
    from draftsmith.heads.draft_vocab import target_to_draft

    engine = SpeculativeEngine(target)
    hits = torch.zeros(depth, ranks, dtype=torch.float64)
    totals = torch.zeros(depth, dtype=torch.float64)
    generated = 0
    layers = tuple(head.config.aux_layer_ids)
    for prompt in prompts:
        tokens = engine.generate(prompt, max_new_tokens).tokens
        generated += len(tokens)
        seq = list(prompt) + tokens
        S, P = len(seq), len(prompt)
        if S - P < 2:
            continue
        ids = torch.tensor([seq], device=target.device)
        out = target.model(input_ids=ids, output_hidden_states=True, use_cache=False,
                           logits_to_keep=1)
        hidden = head.fuse(torch.cat([out.hidden_states[i] for i in layers], dim=-1)[:, :-1])
        n = S - 1  # anchors t = 0..S-2: entry (feature f_t, token x_{t+1})
        inputs = ids[:, 1:]
        anchors = torch.arange(n, device=head.device)[None]
        alive = torch.zeros(n, dtype=torch.bool)
        alive[P - 1:] = True  # anchors from the last prompt position on, as when decoding
        past = []
        for i in range(depth):
            step_ids = torch.cat([inputs[:, i:], inputs.new_zeros(1, i)], dim=1)
            hidden, kv = head.ttt_step(step_ids, hidden, anchors + i, past)
            past.append(kv)
            # step i at anchor t guesses x_{t+2+i}
            valid = torch.arange(n) + 2 + i < S
            use = alive & valid
            if not bool(use.any()):
                break
            rows = use.nonzero().squeeze(1)
            states = head.logit_states(hidden[0, rows.to(head.device)])
            logits = (states @ head.logit_weight.T.to(states.dtype)).float()
            truth = torch.tensor(seq, device=head.device)[rows.to(head.device) + 2 + i]
            if head.version == 3 and head.config.draft_vocab_size < head.config.vocab_size:
                truth = target_to_draft(head.t2d, truth, head.d2t)
            rank = _rank_of(logits, truth).cpu()
            totals[i] += len(rows)
            within = (rank >= 0) & (rank < ranks)
            hits[i] += torch.bincount(rank[within], minlength=ranks)[:ranks].double()
            keep = torch.zeros(n, dtype=torch.bool)
            keep[rows[within]] = True
            alive = alive & keep
    if totals[0] == 0:
        raise ValueError("no position to measure the head's acceptance on: the prompts' "
                         "continuations were empty (EOS at once?)")
    acc = hits / totals.clamp_min(1)[:, None]
    # depths that no path reached carry no information: drop them
    kept = int((totals > 0).sum())
    return {"rank_accuracies": acc[:kept].tolist(), "positions": totals[:kept].int().tolist(),
            "tokens": generated}


# ---------------------------------------------------------------------------------------------
# the choice


# ---------------------------------------------------------------------------------------------
# the whole job for one artifact


def _calibration_prompts(target: Target, source, num_prompts: int) -> list[list[int]]:
    """A JSONL of questions (its first ``num_prompts``), or token-id lists as they are."""
    from draftsmith.eval.prompts import load_prompts

    if isinstance(source, (list, tuple)):
        return [list(p) for p in source[:num_prompts]]
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"--tree auto measures the head's acceptance on held-out prompts, but {path} does not "
            "exist: pass --tree-calibration-prompts with a JSONL of questions (not the ones you "
            "benchmark on)")
    prompt_set = load_prompts(str(path), limit=num_prompts)
    if not prompt_set.prompts:
        raise ValueError(f"{path} holds no prompts to measure the head's acceptance on")
    return [target.chat_ids(p.text) for p in prompt_set.prompts]


def _source_name(source) -> str:
    return "token-id prompts" if isinstance(source, (list, tuple)) else str(source)


def auto_eagle_tree(proposer, artifact: str | os.PathLike, target: Target, *,
                    draft_dtype: torch.dtype | None = None,
                    max_depth: int | None = None, max_topk: int | None = None,
                    max_nodes: int | None = None,
                    calibration_prompts=DEFAULT_CALIBRATION_PROMPTS,
                    num_prompts: int = CALIBRATION_NUM_PROMPTS,
                    max_new_tokens: int = CALIBRATION_NEW_TOKENS,
                    budget_seconds: float | None = CALIBRATION_BUDGET_S,
                    compile: bool | str = False) -> dict | None:
    """Choose and set the proposer's depth, topk and node count; returns the tree record.

    Reads ``<artifact>/tree_calibration.json``; measures what it lacks (acceptance for these
    weights, costs for this machine) within ``budget_seconds`` (None: no bound), says so
    beforehand, and stores it back. None (the proposer's tree unchanged) when something is
    missing and may not be measured (a budget of 0, or one too small for this machine).
    """
    max_depth = MAX_DEPTH if max_depth is None else max_depth
    max_topk = MAX_TOPK if max_topk is None else max_topk
    max_nodes = MAX_NODES if max_nodes is None else max_nodes
    calibration = Calibration.load(artifact)
    digest = artifact_weights_digest(artifact)
    acceptance = calibration.usable("acceptance", digest, _acceptance_problem)
    description = machine_description(target, draft_dtype, compile)
    key = machine_key(description)
    costs = calibration.usable("machines", key, lambda e: _costs_problem(e, ("draft_seconds",)))
    plan = _plan(artifact, target, acceptance=acceptance is None, costs=costs is None, eagle=True,
                 num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                 budget_seconds=budget_seconds,
                 fixed=f"the fixed tree (depth {proposer.depth}, topk {proposer.topk}, "
                       f"{proposer.tree_nodes} nodes)")
    if (acceptance is None or costs is None) and plan is None:
        return None
    if acceptance is None:
        log(f"{artifact}: no acceptance statistics for these weights; measuring them on "
            f"{plan.num_prompts} prompts of {_source_name(calibration_prompts)} "
            f"({plan.max_new_tokens} tokens each)")
        prompts = _calibration_prompts(target, calibration_prompts, plan.num_prompts)
        started = time.perf_counter()
        stats = eagle_rank_accuracies(proposer.head, target, prompts,
                                      max_new_tokens=plan.max_new_tokens)
        acceptance = {**stats, "prompts": _source_name(calibration_prompts),
                      "num_prompts": len(prompts), "max_new_tokens": plan.max_new_tokens,
                      "draft_dtype": dtype_name(proposer.head.dtype), "measured_at": _now(),
                      "seconds": round(time.perf_counter() - started, 1)}
        calibration.acceptance = {digest: acceptance}  # other weights' statistics are stale
    if costs is None:
        others = len(calibration.machines)
        log(f"{artifact}: measuring this machine's costs"
            + (f" ({others} calibration(s) from other machines are not used here)"
               if others else ""))
        started = time.perf_counter()
        verify = measure_verify_cost(target, plan.sizes, context=COST_CONTEXT,
                                     repeats=plan.repeats, compile=compile)
        depths = range(1, MAX_DEPTH + 1)
        draft = measure_eagle_draft_cost(proposer, target, depths, plan.topks,
                                         repeats=min(DRAFT_REPEATS, plan.repeats),
                                         compile=compile)
        costs = {"machine": description,
                 "verify_seconds": {str(n): s for n, s in verify.items()},
                 "draft_seconds": {f"{d},{k}": s for (d, k), s in draft.items()},
                 "context": COST_CONTEXT, "measured_at": _now(),
                 "seconds": round(time.perf_counter() - started, 1)}
        calibration.machines[key] = costs
    changed = plan is not None
    stored = changed and calibration.save()
    verify = {int(n): s for n, s in costs["verify_seconds"].items()}
    draft = {tuple(int(x) for x in dk.split(",")): s for dk, s in costs["draft_seconds"].items()}
    choice = choose_eagle_tree(acceptance["rank_accuracies"], verify, draft,
                               max_depth=max_depth, max_topk=max_topk, max_nodes=max_nodes)
    proposer.depth, proposer.topk, proposer.tree_nodes = choice.depth, choice.topk, choice.tree_nodes
    log(f"{artifact}: depth {choice.depth}, topk {choice.topk}, {choice.tree_nodes} nodes: "
        f"expected tau {choice.expected_tau:.2f}, predicted {choice.predicted_speedup:.2f}x "
        "plain decoding")
    return {"mode": "auto", **choice.as_dict(), "machine_key": key,
            "calibration": str(calibration.path) if stored or calibration.path.exists() else None,
            "measured_now": changed,
            "acceptance_positions": acceptance.get("positions")}


# ---------------------------------------------------------------------------------------------
# Medusa: the stored accuracies (or measured ones), this machine's costs


@torch.no_grad()
def medusa_rank_accuracies(heads, target: Target, prompts: list[list[int]], *,
                           max_new_tokens: int = CALIBRATION_NEW_TOKENS,
                           ranks: int = RANKS_MEASURED) -> dict:
    """Per-head, per-rank accuracies of Medusa heads on the target's greedy continuations.

    Head k (0-based) reads h_t and guesses x_{t+2+k}; counted at every position from the last
    prompt token on, each head on its own (the convention of the trainer's held-out accuracies).
    """
    from draftsmith.eval.engine import SpeculativeEngine

    engine = SpeculativeEngine(target)
    K = heads.num_heads
    ranks = min(ranks, heads.config.head_vocab_size)
    hits = torch.zeros(K, ranks, dtype=torch.float64)
    totals = torch.zeros(K, dtype=torch.float64)
    generated = 0
    for prompt in prompts:
        tokens = engine.generate(prompt, max_new_tokens).tokens
        generated += len(tokens)
        seq = list(prompt) + tokens
        S, P = len(seq), len(prompt)
        ids = torch.tensor([seq], device=target.device)
        out = target.model(input_ids=ids, output_hidden_states=True, use_cache=False,
                           logits_to_keep=1)
        anchors = torch.arange(P - 1, S - 2)
        if not len(anchors):
            continue
        logits = heads(out.hidden_states[target.num_layers][0, anchors.to(target.device)]).float()
        seq_t = torch.tensor(seq, device=logits.device)
        for k in range(K):
            valid = anchors + 2 + k < S
            if not bool(valid.any()):
                continue
            rows = valid.nonzero().squeeze(1)
            truth = heads.target_to_draft(seq_t[(anchors[rows] + 2 + k).to(logits.device)])
            rank = _rank_of(logits[k, rows.to(logits.device)], truth).cpu()
            totals[k] += len(rows)
            within = (rank >= 0) & (rank < ranks)
            hits[k] += torch.bincount(rank[within], minlength=ranks)[:ranks].double()
    if totals[0] == 0:
        raise ValueError("no position to measure the heads' accuracies on: the prompts' "
                         "continuations were empty (EOS at once?)")
    kept = int((totals > 0).sum())
    return {"rank_accuracies": (hits / totals.clamp_min(1)[:, None])[:kept].tolist(),
            "positions": totals[:kept].int().tolist(), "tokens": generated}


def auto_medusa_tree(artifact: str | os.PathLike, target: Target, heads, tree_info: dict, *,
                     max_depth: int | None = None, max_topk: int | None = None,
                     max_nodes: int | None = None,
                     calibration_prompts=DEFAULT_CALIBRATION_PROMPTS,
                     num_prompts: int = CALIBRATION_NUM_PROMPTS,
                     max_new_tokens: int = CALIBRATION_NEW_TOKENS,
                     budget_seconds: float | None = CALIBRATION_BUDGET_S,
                     compile: bool | str = False, proposer=None) -> tuple[list, dict | None]:
    """The Medusa tree whose size maximises expected tokens/s here -> (tree, record).

    The accuracies are the artifact's stored held-out ones (``tree_info["rank_accuracies"]``),
    else measured on ``calibration_prompts`` and kept in the calibration file; the costs
    (verification, the heads' proposal) are this machine's, measured once and kept. What is
    missing is measured within ``budget_seconds``, said beforehand; when it may not be measured,
    (the artifact's own tree, None). ``proposer``: the artifact's MedusaProposer, whose rounds
    time the heads' side of a round (else the heads' proposal alone is timed).
    """
    calibration = Calibration.load(artifact)
    acc = tree_info.get("rank_accuracies")
    source = "the artifact's held-out accuracies"
    digest = artifact_weights_digest(artifact)
    if acc is None:
        stats = calibration.usable("acceptance", digest, _acceptance_problem)
        if stats is not None:
            acc, source = stats["rank_accuracies"], f"accuracies measured on {stats['prompts']}"
    description = machine_description(target, None, compile)
    key = machine_key(description)
    stored_costs = calibration.usable("machines", key,
                                      lambda e: _costs_problem(e, ("head_seconds",)))

    def table(accuracies) -> list[list[float]]:  # the heads and ranks the tree may use
        rows = rank_table(accuracies)[:heads.num_heads][:max_depth]
        return [row[:max_topk] for row in rows]

    def costs_for(shape: list[int]) -> dict | None:  # this machine's costs for that shape
        if stored_costs is not None and stored_costs.get("head_shape") == shape:
            return stored_costs
        if (tree_info.get("machine_key") == key and tree_info.get("head_shape") == shape
                and _costs_problem(tree_info, ("head_seconds",)) is None):
            # the trainer sized the artifact's tree on this machine: its costs are this machine's
            return {k: tree_info[k] for k in ("machine", "verify_seconds", "head_seconds",
                                               "head_shape", "context")}
        return None

    shape = None if acc is None else [len(table(acc)), len(table(acc)[0])]
    costs = None if shape is None else costs_for(shape)
    own = check_tree(read_artifact_config(artifact).get("tree") or default_chain(heads.num_heads),
                     heads.num_heads)
    plan = _plan(artifact, target, acceptance=acc is None, costs=costs is None, eagle=False,
                 num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                 budget_seconds=budget_seconds,
                 fixed=f"the artifact's own tree ({len(own)} nodes)")
    if (acc is None or costs is None) and plan is None:
        return own, None
    if acc is None:
        log(f"{artifact}: the artifact stores no held-out accuracies; measuring them on "
            f"{plan.num_prompts} prompts of {_source_name(calibration_prompts)} "
            f"({plan.max_new_tokens} tokens each)")
        prompts = _calibration_prompts(target, calibration_prompts, plan.num_prompts)
        stats = {**medusa_rank_accuracies(heads, target, prompts,
                                          max_new_tokens=plan.max_new_tokens),
                 "prompts": _source_name(calibration_prompts), "num_prompts": len(prompts),
                 "max_new_tokens": plan.max_new_tokens, "measured_at": _now()}
        calibration.acceptance = {digest: stats}
        acc, source = stats["rank_accuracies"], f"accuracies measured on {stats['prompts']}"
        costs = costs_for([len(table(acc)), len(table(acc)[0])])
    acc = table(acc)
    depth, topk = len(acc), len(acc[0])
    if costs is None:
        others = sum(1 for k in calibration.machines if k != key)
        log(f"{artifact}: measuring this machine's costs"
            + (f" ({others} calibration(s) from other machines are not used here)"
               if others else ""))
        verify = measure_verify_cost(target, plan.sizes, context=COST_CONTEXT,
                                     repeats=plan.repeats, compile=compile)
        if proposer is not None:  # the deepest, widest tree the search may choose drafts most
            proposer.set_tree([(r,) for r in range(topk)] + [
                (0,) * d for d in range(2, depth + 1)])
            head = measure_draft_cost(proposer, target, repeats=plan.repeats, compile=compile)
        else:
            head = measure_head_cost(heads, depth=depth, topk=topk)
        costs = {"machine": description,
                 "verify_seconds": {str(n): s for n, s in verify.items()},
                 "head_seconds": head,
                 "head_shape": [depth, topk], "context": COST_CONTEXT, "measured_at": _now()}
        calibration.machines[key] = costs
    changed = plan is not None
    stored = changed and calibration.save()
    verify = {int(n): s for n, s in costs["verify_seconds"].items()}
    limit = MAX_NODES if max_nodes is None else max_nodes
    choice = choose_tree_nodes(acc, verify, costs["head_seconds"], max_tree_nodes=limit)
    round_seconds = interpolate(verify, choice.tree_nodes + 1) + costs["head_seconds"]
    record = {"mode": "auto", "depth": max(len(p) for p in choice.tree),
              "topk": max(max(p) for p in choice.tree) + 1, "tree_nodes": choice.tree_nodes,
              "expected_tau": choice.expected_tau, "predicted_speedup": choice.predicted_speedup,
              "expected_tokens_per_s": choice.expected_tau / round_seconds,
              "plain_tokens_per_s_model": 1.0 / verify[1], "round_seconds": round_seconds,
              "accuracies": source, "machine_key": key,
              "calibration": str(calibration.path) if stored or calibration.path.exists() else None,
              "measured_now": changed}
    log(f"{artifact}: {choice.tree_nodes} nodes, depth {record['depth']}: expected tau "
        f"{choice.expected_tau:.2f}, predicted {choice.predicted_speedup:.2f}x plain decoding")
    return choice.tree, record
