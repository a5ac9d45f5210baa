"""``--tree auto`` for block drafts: the tokens per round that pay most on this machine.

A block draft proposes its whole block in one forward, so the draft's cost per round hardly
depends on how many of its tokens are used; verifying them does. For n tokens per round the
expected tokens per target pass are ``1 + sum_{d <= n} P(the first d accepted)`` and the round
costs ``verify(n + 1) + block``; :func:`choose_block_length` keeps the n with the most expected
tokens per second.

* **Acceptance** (per artifact): along the target's greedy continuations of a few held-out
  prompts, every position is an anchor of one block run in parallel (the training layout,
  :func:`draftsmith.heads.dflash.block_mask`); depth d is accepted where the block's first d greedy tokens
  equal the continuation (DSpark's Markov term teacher-forced with the true tokens, which are the
  draft's own wherever the earlier slots were accepted). Stored under the weights' digest as
  ``rank_accuracies`` (one rank per depth: P(depth d | depth d - 1)).
* **Costs** (per machine): the verification forward of 1 .. B tokens and one block forward,
  measured with :mod:`draftsmith.eval.tree_cost` and stored under the machine key, as trees' costs are.

Both live in ``<artifact>/tree_calibration.json`` beside trees' calibrations (draftsmith.eval.tree_auto).
"""

from __future__ import annotations

import os

import torch

from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.tree_auto import (
    Calibration,
    _acceptance_problem,
    _calibration_prompts,
    _now,
    artifact_weights_digest,
    log,
)
from draftsmith.eval.tree_cost import (
    COST_CONTEXT,
    interpolate,
    machine_description,
    machine_key,
    measure_draft_cost,
    measure_verify_cost,
)
from draftsmith.heads.dflash import block_mask
from draftsmith.targets.target import Target

BLOCK_PROMPTS = 4
BLOCK_NEW_TOKENS = 64
BLOCK_REPEATS = 9


@torch.no_grad()
def block_acceptance(draft, target: Target, prompts: list[list[int]], *,
                     max_new_tokens: int = BLOCK_NEW_TOKENS) -> dict:
    """P(depth d accepted | depth d - 1 accepted) of a block draft's greedy chain, per depth."""
    cfg = draft.config
    engine = SpeculativeEngine(target)
    layers = list(cfg.hidden_states_read)
    depth = cfg.drafts_per_block
    hits, tried = torch.zeros(depth), torch.zeros(depth)
    for prompt in prompts:
        seq = list(prompt) + engine.generate(prompt, max_new_tokens).tokens
        S, P = len(seq), len(prompt)
        ids = torch.tensor([seq], device=target.device)
        states, _ = target.hidden_states(ids, layers)
        context = draft.context(torch.cat([states[i] for i in layers], -1),
                                torch.arange(S, device=target.device)[None])
        anchors = torch.arange(P, S - 1, device=target.device)[None]  # the block's anchor p
        if anchors.numel() == 0:
            continue
        size = cfg.block_size
        block = torch.full((1, anchors.shape[1], size), cfg.mask_token_id, device=target.device)
        block[0, :, 0] = ids[0, anchors[0]]
        pos = anchors[0][:, None] + torch.arange(size, device=target.device)
        hidden = draft.block(block.view(1, -1), pos.view(1, -1), context,
                             block_mask(torch.ones(1, S, dtype=torch.bool, device=target.device),
                                        anchors, size))[0].view(-1, size, cfg.hidden_size)
        first = 0 if cfg.sample_from_anchor else 1
        alive = torch.ones(anchors.shape[1], dtype=torch.bool)
        for k in range(depth):
            truth_at = anchors[0] + k + 1
            inside = (truth_at < S).cpu()
            alive &= inside
            if not bool(alive.any()):
                break
            rows = alive.nonzero().flatten()
            previous = ids[0, truth_at[rows] - 1]
            logits = draft.logits(hidden[rows, first + k],
                                  previous if cfg.markov_rank else None)
            guess = draft.draft_to_target(logits.argmax(-1))
            right = (guess == ids[0, truth_at[rows]]).cpu()
            tried[k] += len(rows)
            hits[k] += int(right.sum())
            keep = torch.zeros_like(alive)
            keep[rows[right]] = True
            alive &= keep
    if tried[0] == 0:
        raise ValueError("no position to measure the block draft's acceptance on")
    kept = int((tried > 0).sum())
    rates = (hits / tried.clamp_min(1))[:kept]
    return {"rank_accuracies": [[float(r)] for r in rates],
            "positions": tried[:kept].int().tolist()}


@torch.no_grad()
def measure_block_cost(proposer, target: Target, *, context: int = COST_CONTEXT,
                       repeats: int = BLOCK_REPEATS, seed: int = 0, compile: bool | str = False) -> float:
    """Median seconds a block draft adds to a round (its block forward, reading the block,
    committing the accepted states): whole rounds minus the engine's side
    (:func:`draftsmith.eval.tree_cost.measure_draft_cost`)."""
    return measure_draft_cost(proposer, target, context=context, repeats=repeats, seed=seed,
                              compile=compile)


def choose_block_length(rates: list[list[float]], verify_seconds: dict[int, float],
                        block_seconds: float, most: int) -> dict:
    """The tokens per round n <= most maximising (1 + sum_d P(first d)) / (verify(n+1) + block)."""
    plain = verify_seconds[1]
    table, tau, alive = [], 1.0, 1.0
    for n in range(1, min(most, len(rates), max(verify_seconds) - 1) + 1):
        alive *= rates[n - 1][0]
        tau += alive
        cost = interpolate(verify_seconds, n + 1)
        cost += block_seconds
        table.append({"tokens_per_round": n, "expected_tau": tau, "round_seconds": cost,
                      "predicted_speedup": tau * plain / cost})
    if not table:
        raise ValueError("no block length could be sized: measure verification of 2 or more "
                         "tokens")
    best = max(table, key=lambda r: (r["predicted_speedup"], -r["tokens_per_round"]))
    return {**best, "plain_tokens_per_s_model": 1.0 / plain,
            "expected_tokens_per_s": best["expected_tau"] / best["round_seconds"], "table": table}


def auto_block_length(proposer, artifact: str | os.PathLike, target: Target, *,
                      draft_dtype: torch.dtype | None = None, calibration_prompts=None,
                      num_prompts: int = BLOCK_PROMPTS,
                      max_new_tokens: int = BLOCK_NEW_TOKENS,
                      budget_seconds: float | None = None, compile: bool | str = False,
                      **_) -> dict | None:
    """Set the proposer's tokens per round to the best for this machine; -> the record (None:
    ``budget_seconds`` 0 and nothing stored, so the whole block is kept)."""
    calibration = Calibration.load(artifact)
    digest = artifact_weights_digest(artifact)
    changed = False
    acceptance = calibration.usable("acceptance", digest, _acceptance_problem)
    key = machine_key(machine_description(target, draft_dtype, compile))
    stored = isinstance(calibration.machines.get(key), dict) and acceptance is not None
    if budget_seconds == 0 and not stored:
        log(f"{artifact}: --tree-calibration-seconds 0 and no stored calibration here: the "
            f"draft's whole block ({proposer.tokens_per_round} tokens per round)")
        return None
    if acceptance is None:
        log(f"{artifact}: measuring the block draft's acceptance on {num_prompts} held-out "
            f"prompts ({max_new_tokens} tokens each)")
        prompts = _calibration_prompts(target, calibration_prompts, num_prompts)
        acceptance = {**block_acceptance(proposer.draft, target, prompts,
                                         max_new_tokens=max_new_tokens),
                      "num_prompts": len(prompts), "measured_at": _now()}
        calibration.acceptance = {digest: acceptance}
        changed = True
    description = machine_description(target, draft_dtype, compile)
    costs = calibration.machines.get(key)
    if not (isinstance(costs, dict) and "block_seconds" in costs):
        log(f"{artifact}: measuring this machine's cost of verification and of a block")
        most = proposer.draft.config.drafts_per_block
        verify = measure_verify_cost(target, tuple(range(1, most + 2)), compile=compile)
        costs = {"machine": description, "verify_seconds": {str(n): s for n, s in verify.items()},
                 "block_seconds": measure_block_cost(proposer, target, compile=compile),
                 "context": COST_CONTEXT, "measured_at": _now()}
        calibration.machines[key] = costs
        changed = True
    stored = changed and calibration.save()
    verify = {int(n): s for n, s in costs["verify_seconds"].items()}
    choice = choose_block_length(acceptance["rank_accuracies"], verify, costs["block_seconds"],
                                 proposer.tokens_per_round)
    proposer.tokens_per_round = choice["tokens_per_round"]
    log(f"{artifact}: {choice['tokens_per_round']} tokens per round: expected tau "
        f"{choice['expected_tau']:.2f}, predicted {choice['predicted_speedup']:.2f}x plain")
    return {"mode": "auto", "depth": choice["tokens_per_round"], "topk": 1,
            "tree_nodes": choice["tokens_per_round"], **{k: v for k, v in choice.items()
                                                         if k != "table"},
            "machine_key": key, "measured_now": changed,
            "calibration": str(calibration.path) if stored or calibration.path.exists() else None}
