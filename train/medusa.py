"""Medusa trainer: K heads on the target's last hidden state (Medusa-1), or jointly with LoRA
adapters on the target itself (Medusa-2).

    accelerate launch train/medusa.py --config configs/medusa/smollm2-135m.yaml
    python train/medusa.py --config configs/medusa/tiny.yaml                     # one process
    torchrun --nproc_per_node 2 train/medusa.py --config ...                     # two CPU procs

Head k (k = 1..K) reads ``h_t``, the target's final-normed last hidden state at position t, and
is trained on token t+1+k (where ``loss_mask`` scores it) with weight ``loss_decay``**k: against
the data's token (cross-entropy), or with ``soft_labels`` against the target's own distribution
of that token given the true prefix (self-distillation). ``regenerate: true`` first lets the
target answer the data's prompts itself (``train.data.regenerate``) and trains on its answers, so
that the heads learn what the target will actually write.

* **Medusa-1** (default): the target is frozen; only the heads are prepared, optimised and saved.
  Verification stays exact with respect to the target.
* **Medusa-2** (``medusa2: true``): a second copy of the target gets LoRA adapters (peft) and is
  trained together with the heads (their loss weighted ``heads_loss_weight``), held near the
  frozen original by ``kl_weight`` x KL(original || adapted) on the next-token distributions,
  plus ``lm_loss_weight`` x its cross-entropy on the data. At the end the adapters are merged and
  the adapted model is written into the artifact (``artifact/target/``, a plain Hugging Face
  directory with the tokenizer). **This changes what "exact" means**: the heads are verified
  against the adapted model, so speculative decoding reproduces the adapted model's distribution
  (its greedy output at temperature 0), not the original target's. How far the two differ is
  logged while training (``lm_kl``, ``lm_agreement``: how often their argmax agree). Evaluate it
  with ``--target <artifact>/target``; loading the artifact against any other target is refused.

Memory: the heads' vocabulary projections are never materialised as (K, batch, seq, vocab)
logits. Each head's scored positions are projected ``loss_chunk_size`` at a time by
:func:`projected_cross_entropy`, which computes the gradient in closed form chunk by chunk; the
frozen target runs without its LM head (its decoder only), and its distributions (soft labels,
the KL) are also computed chunk by chunk.

Logged to ``<output_dir>/metrics.jsonl`` (and W&B with ``report_to: wandb``): ``loss``,
``medusa/head<k>_loss``, ``medusa/head<k>_top1`` and ``_top5`` (the data's token among head k's
guesses, on the training batches), ``lr``, ``tokens_per_s``, ``peak_memory_gb``; Medusa-2 also
``lm_kl``, ``lm_ce``, ``lm_agreement``. Every ``heldout_every`` steps, on held-out rows excluded
from training: ``heldout/head<k>_top1`` / ``_top5``, ``heldout/head<k>_loss`` and
``heldout/expected_tau`` (of a tree of ``eval_tree_nodes`` nodes built from the measured per-rank
accuracies). Every ``eval_every`` steps ``eval/tau`` and ``eval/alpha``, measured by the
speculative engine with that tree.

At the end the heads' per-rank accuracies on the held-out rows give the static token tree
(``tree_budget: auto``: the node budget that maximises expected tau per measured verification
cost on this machine, see ``eval.medusa.plan_medusa_tree``; or a fixed node count), saved in
``<output_dir>/artifact`` with the heads; ``final/expected_tau`` and (with ``eval_every`` > 0)
``final/tau`` measured with that tree are logged. ``python -m eval.bench --method
medusa:<artifact>`` measures it; ``python -m heads.export`` writes the vLLM / TensorRT-LLM layouts.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from accelerate import Accelerator
from torch import nn

from distill.draft import add_lora, merge_lora
from distill.losses import next_token_mask
from eval.engine import measure_acceptance
from eval.medusa import MedusaProposer, build_medusa_tree, expected_tau, plan_medusa_tree
from heads.artifact import FORMAT_VERSION
from heads.chunked_loss import projected_cross_entropy
from heads.medusa import (
    ADAPTED_TARGET_INFO_KEY,
    MedusaConfig,
    MedusaHeads,
    accuracy_metrics,
    default_chain,
    medusa_param_counts,
    rank_accuracy,
    save_medusa,
)
from heads.target import Target, load_target, wrap_target
from train.checkpoints import (
    Checkpointer,
    GracefulStop,
    TrainState,
    apply_learning_rate,
    make_accelerator,
    make_optimizer,
    make_train_dataloader,
    refuse_sharded,
    train_batches,
)
from train.config import TrainConfig, option, parse_config
from train.data import collate_causal_lm, load_sft_dataset, regenerate
from train.tracking import AcceptanceEval, MetricsLogger, peak_memory_gb

TRAIN_TOPK = 5  # ranks counted on training batches: enough for the logged top-1 and top-5
_MEDUSA2_ONLY = {"kl_weight": 1.0, "lm_loss_weight": 0.0, "lora_r": 16, "lora_alpha": 32.0,
                 "lora_dropout": 0.0, "lora_target_modules": ["all-linear"]}
_NOT_ADAPTABLE = ("lm_head", "embed_tokens")


@dataclass
class MedusaTrainConfig(TrainConfig):
    """Train Medusa heads on a frozen target (Medusa-1) or with LoRA on it (Medusa-2)."""

    num_heads: int = option(4, "K, the number of Medusa heads: head k guesses token t+1+k")
    num_layers: int = option(1, "residual blocks per head (x + SiLU(W x + b)), zero-initialised")
    share_lm_head: bool = option(
        False, "every head projects with the target's own LM head (frozen, not stored: 1.33M "
        "trainable parameters on smollm2-135m) instead of a trainable copy each (114.6M)")
    head_bias: bool = option(True, "the blocks' linear layers have a bias (as in FasterDecoding)")
    loss_decay: float = option(0.8, "head k's loss is weighted loss_decay**k (0 < decay <= 1)")
    soft_labels: bool = option(
        False, "self-distillation: head k at t matches the target's distribution of token t+1+k "
        "given the true prefix, instead of the data's token")
    loss_chunk_size: int = option(
        256, "positions per chunk of the vocabulary projections in the loss (memory: about 6 x "
        "chunk x vocab x 4 bytes at a time)")

    regenerate: bool = option(
        False, "first let the target answer the data's prompts itself (train.data.regenerate, "
        "into <output_dir>/regenerated.jsonl; resumable) and train on its answers")
    regenerate_max_new_tokens: int = option(512, "regenerate: longest answer in tokens")
    regenerate_temperature: float = option(0.7, "regenerate: sampling temperature (0: greedy)")
    regenerate_max_prompts: int | None = option(None, "regenerate: at most this many prompts")
    regenerate_batch_size: int = option(8, "regenerate: prompts per generate call",
                                        may_change_on_resume=True)

    medusa2: bool = option(
        False, "Medusa-2: train the target jointly through LoRA adapters (merged and exported "
        "with the heads; the heads must then be verified against that adapted target)")
    heads_loss_weight: float = option(
        1.0, "weight of the heads' loss in the total (Medusa-2 recipes use about 0.2, so that "
        "the heads do not pull the target away from its own distribution)")
    kl_weight: float = option(
        1.0, "Medusa-2: weight of KL(original || adapted) on the next-token distributions")
    lm_loss_weight: float = option(
        0.0, "Medusa-2: weight of the adapted target's cross-entropy on the data's tokens")
    lora_r: int = option(16, "Medusa-2: LoRA rank")
    lora_alpha: float = option(32.0, "Medusa-2: LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = option(0.0, "Medusa-2: dropout on the LoRA input")
    lora_target_modules: list[str] = option(
        ["all-linear"], "Medusa-2: modules that get adapters: all-linear (every linear layer but "
        "the LM head) or names such as q_proj,v_proj")

    heldout_fraction: float = option(
        0.02, "fraction of the data's rows held out (never trained on) for the heads' per-rank "
        "accuracies, from which the tree is built (0: no tree, each head's top-1 chain)")
    heldout_max_rows: int = option(64, "at most this many held-out rows")
    heldout_every: int = option(
        100, "measure held-out accuracies every N optimizer steps, at the start and the end "
        "(0: only at the end, for the tree)", may_change_on_resume=True)

    tree_topk: int = option(
        10, "ranks counted per head on the held-out rows: the tree's widest branching",
        may_change_on_resume=True)
    tree_budget: str = option(
        "auto", "nodes of the final tree: auto (the budget maximising expected tau per measured "
        "verification cost on this machine) or a node count", may_change_on_resume=True)
    eval_tree_nodes: int = option(
        16, "nodes of the tree used by the acceptance evaluation while training",
        may_change_on_resume=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_heads < 1:
            raise ValueError(f"config key 'num_heads' (K, the number of Medusa heads) must be "
                             f">= 1, got {self.num_heads}")
        at_least = {"num_layers": 0, "loss_chunk_size": 1, "regenerate_max_new_tokens": 1,
                    "regenerate_max_prompts": 1, "regenerate_batch_size": 1, "lora_r": 1,
                    "heldout_max_rows": 1, "heldout_every": 0, "tree_topk": 1,
                    "eval_tree_nodes": 1}
        for key, low in at_least.items():
            value = getattr(self, key)
            if value is not None and value < low:
                raise ValueError(f"config key {key!r} must be >= {low}, got {value}")
        if not 0.0 < self.loss_decay <= 1.0:
            raise ValueError(f"config key 'loss_decay' must be in (0, 1], got {self.loss_decay}")
        if not self.heads_loss_weight > 0:
            raise ValueError(f"config key 'heads_loss_weight' must be > 0, got "
                             f"{self.heads_loss_weight}")
        for key in ("kl_weight", "lm_loss_weight", "regenerate_temperature"):
            if getattr(self, key) < 0:
                raise ValueError(f"config key {key!r} must be >= 0, got {getattr(self, key)}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"config key 'lora_dropout' must be in [0, 1), got "
                             f"{self.lora_dropout}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"config key 'heldout_fraction' must be in [0, 1), got "
                             f"{self.heldout_fraction}")
        if self.tree_budget != "auto" and not (self.tree_budget.isdigit()
                                               and int(self.tree_budget) >= 1):
            raise ValueError(f"config key 'tree_budget' must be 'auto' or a node count >= 1, "
                             f"got {self.tree_budget!r}")
        if not self.medusa2:
            for key, default in _MEDUSA2_ONLY.items():
                if getattr(self, key) != default:
                    raise ValueError(f"config key {key!r} applies to Medusa-2 only, but medusa2 "
                                     f"is false and {key} is {getattr(self, key)!r}; remove it "
                                     f"or set medusa2: true")
            return
        if self.kl_weight == 0 and self.lm_loss_weight == 0:
            raise ValueError("Medusa-2 with kl_weight 0 and lm_loss_weight 0 lets the heads' loss "
                             "move the target anywhere; set kl_weight > 0 (keeps it close to the "
                             "original) or lm_loss_weight > 0")
        if not self.lora_target_modules:
            raise ValueError("config key 'lora_target_modules' is empty: give all-linear or "
                             "module names such as q_proj,v_proj")
        refused = [m for m in self.lora_target_modules if m in _NOT_ADAPTABLE]
        if refused:
            raise ValueError(f"config key 'lora_target_modules' names {refused}: the LM head and "
                             f"the embedding stay frozen in Medusa-2 (the heads and the KL read "
                             f"the LM head as a plain matrix); adapt the decoder layers only")


# ------------------------------------------------------------------------------------------------
# The loss: vocabulary projections chunk by chunk, the gradient in closed form


def head_rows(loss_mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch index, position) of the positions t where head k (1-based) is scored.

    Head k at t guesses token t+1+k, scored where ``loss_mask[:, t+1+k]`` is 1.
    """
    scored = torch.zeros_like(loss_mask, dtype=torch.bool)  # (B, T)
    seq = loss_mask.shape[1]
    if seq > 1 + k:
        scored[:, : seq - 1 - k] = loss_mask[:, 1 + k:].bool()
    return scored.nonzero(as_tuple=True)


@torch.no_grad()
def target_hidden(target: Target, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, H) the frozen target's final-normed last hidden state, its LM head skipped.

    The same as ``target.features(ids, [target.num_layers])[1][0]`` without the (B, T, V)
    logits nobody here needs.
    """
    return target.decoder(input_ids=input_ids, attention_mask=attention_mask,
                          use_cache=False).last_hidden_state


# ------------------------------------------------------------------------------------------------
# The trained module


@dataclass
class StepStats:
    """Detached per-micro-batch quantities for logging (tensors stay on the device)."""

    head_loss: torch.Tensor  # (K,) mean loss of each head over its rows
    hits: torch.Tensor  # (K, topk) int64
    counts: torch.Tensor  # (K,) scored positions per head
    lm: dict[str, torch.Tensor] = field(default_factory=dict)  # Medusa-2: sums and the count


class MedusaObjective(nn.Module):
    """What is prepared, optimised and checkpointed: the heads and, in Medusa-2, a LoRA-adapted
    copy of the target (``adapted``, a peft model). The frozen original target is held by
    reference (teacher for soft labels and the KL), outside the module's parameters.

    In Medusa-2 the copy's frozen base weights are left out of ``state_dict`` (and may be absent
    when loading one): checkpoints hold the adapters and heads alone.
    """

    def __init__(self, heads: MedusaHeads, target: Target, cfg: MedusaTrainConfig,
                 adapted: nn.Module | None = None):
        super().__init__()
        self.heads = heads
        self.adapted = adapted
        self._target = (target,)  # a tuple: not a submodule, never saved or wrapped
        self.decay = cfg.loss_decay
        self.soft_labels = cfg.soft_labels
        self.heads_loss_weight = cfg.heads_loss_weight
        self.kl_weight = cfg.kl_weight
        self.lm_loss_weight = cfg.lm_loss_weight
        self.chunk_size = cfg.loss_chunk_size
        self._frozen_keys: frozenset[str] = frozenset()
        if adapted is not None:
            state = self.state_dict(keep_vars=True)
            self._frozen_keys = frozenset(
                k for k, v in state.items() if not (isinstance(v, nn.Parameter) and v.requires_grad))
            self.register_state_dict_post_hook(_drop_frozen_keys)
            self.register_load_state_dict_post_hook(_allow_missing_frozen_keys)

    @property
    def target(self) -> Target:
        return self._target[0]

    def adapted_model(self) -> nn.Module:
        """The Hugging Face model inside the peft wrapper (adapters active)."""
        return self.adapted.get_base_model()

    def verifier(self) -> Target:
        """The model the heads are verified against: the target, or its adapted copy."""
        if self.adapted is None:
            return self.target
        target = self.target
        return Target(model=self.adapted_model(), tokenizer=target.tokenizer,
                      name=f"{target.name}+medusa2", eos_token_ids=target.eos_token_ids)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor, teacher_hidden: torch.Tensor,
                topk: int = TRAIN_TOPK) -> tuple[torch.Tensor, StepStats]:
        """-> (loss, stats) for one micro-batch; teacher_hidden (B, T, H) from the frozen target.

        loss = heads_loss_weight * sum_k decay**k * mean loss of head k
               [+ kl_weight * KL(original || adapted) + lm_loss_weight * CE(adapted), Medusa-2]
        """
        target = self.target
        if self.adapted is None:
            hidden = teacher_hidden  # (B, T, H), no gradient: the target is frozen
        else:
            hidden = self.adapted_model().get_decoder()(
                input_ids=input_ids, attention_mask=attention_mask,
                use_cache=False).last_hidden_state  # (B, T, H), through the adapters
        heads_loss = None
        losses, hits, counts = [], [], []
        for k, state in enumerate(self.heads.head_states(hidden), start=1):
            b, t = head_rows(loss_mask, k)
            out = projected_cross_entropy(
                state[b, t], self.heads.lm_head_weight(k - 1), input_ids[b, t + 1 + k],
                teacher_states=teacher_hidden[b, t + k] if self.soft_labels else None,
                teacher_head=target.lm_head if self.soft_labels else None,
                hard_weight=0.0 if self.soft_labels else 1.0,
                soft_weight=1.0 if self.soft_labels else 0.0,
                chunk_size=self.chunk_size, topk=topk)
            mean = out.loss / max(out.count, 1)
            weighted = self.decay ** k * mean
            heads_loss = weighted if heads_loss is None else heads_loss + weighted
            losses.append(mean.detach())
            hits.append(out.hits)
            counts.append(out.count)
        loss = self.heads_loss_weight * heads_loss
        stats = StepStats(torch.stack(losses), torch.stack(hits),
                          torch.tensor(counts, device=hidden.device))
        if self.adapted is not None:
            loss, stats.lm = self._adapted_lm_loss(loss, hidden, input_ids, loss_mask,
                                                   teacher_hidden)
        return loss, stats

    def _adapted_lm_loss(self, loss, hidden, input_ids, loss_mask, teacher_hidden):
        """Medusa-2: add kl_weight * KL(original || adapted) + lm_loss_weight * CE(adapted)."""
        b, t = next_token_mask(loss_mask).bool().nonzero(as_tuple=True)  # positions t -> t+1
        out = projected_cross_entropy(
            hidden[b, t], self.adapted_model().get_output_embeddings().weight,
            input_ids[b, t + 1], teacher_states=teacher_hidden[b, t],
            teacher_head=self.target.lm_head, hard_weight=self.lm_loss_weight,
            soft_weight=self.kl_weight, chunk_size=self.chunk_size, topk=1)
        n = max(out.count, 1)
        # the teacher's entropy is a constant: subtracting it turns the soft cross-entropy into
        # the KL without changing the gradient
        lm_loss = (out.loss - self.kl_weight * out.teacher_entropy) / n
        stats = {"kl": out.soft_ce - out.teacher_entropy, "ce": out.hard_ce,
                 "agree": out.agree, "count": torch.tensor(float(out.count))}
        return loss + lm_loss, stats


def _drop_frozen_keys(module: MedusaObjective, state_dict: dict, prefix: str,
                      local_metadata) -> None:
    for key in module._frozen_keys:
        state_dict.pop(prefix + key, None)


def _allow_missing_frozen_keys(module: MedusaObjective, incompatible) -> None:
    frozen = module._frozen_keys
    # keys arrive with the prefix of any wrapper (DDP's "module."), so match their tails
    kept = [k for k in incompatible.missing_keys
            if not any(k == f or k.endswith("." + f) for f in frozen)]
    incompatible.missing_keys[:] = kept


def build_objective(cfg: MedusaTrainConfig, target: Target) -> MedusaObjective:
    """Fresh heads (identity blocks, projections from the LM head) and, for Medusa-2, a LoRA
    copy of the target in its own dtype, with fp32 adapters, in training mode."""
    heads = MedusaHeads.from_target(target, num_heads=cfg.num_heads, num_layers=cfg.num_layers,
                                    share_lm_head=cfg.share_lm_head, bias=cfg.head_bias)
    adapted = None
    if cfg.medusa2:
        # a separate copy: peft edits the model it wraps, and the original stays the KL reference
        model = copy.deepcopy(target.model)
        modules = cfg.lora_target_modules
        adapted = add_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                           target_modules="all-linear" if modules == ["all-linear"] else modules)
    return MedusaObjective(heads, target, cfg, adapted).train()


# ------------------------------------------------------------------------------------------------
# Data


def training_sources(cfg: MedusaTrainConfig, target: Target, accelerator: Accelerator) -> list[str]:
    """``cfg.data``, or the file of the target's own answers to its prompts (``regenerate``)."""
    if not cfg.regenerate:
        return list(cfg.data)
    if not cfg.data:
        raise ValueError("regenerate: true needs prompts: set config key 'data'")
    out = Path(cfg.output_dir) / "regenerated.jsonl"
    if accelerator.is_main_process:
        # the frozen original answers (Medusa-2 too): the data the adapted model is kept close to
        written = regenerate(target, cfg.data, out, max_new_tokens=cfg.regenerate_max_new_tokens,
                             temperature=cfg.regenerate_temperature,
                             batch_size=cfg.regenerate_batch_size,
                             max_prompts=cfg.regenerate_max_prompts, seed=cfg.seed)
        accelerator.print(f"[draftsmith] the target answered {written} more prompts into {out}")
    accelerator.wait_for_everyone()
    return [str(out)]


def split_heldout(dataset, fraction: float, max_rows: int, seed: int):
    """(training rows, held-out rows or None): a seeded random ``fraction``, at most ``max_rows``."""
    n = len(dataset)
    if fraction <= 0 or n < 2:
        return dataset, None
    count = min(max_rows, max(1, round(fraction * n)), n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return dataset.select(sorted(order[count:])), dataset.select(sorted(order[:count]))


# ------------------------------------------------------------------------------------------------
# Held-out accuracies (what the tree is built from)


class HeldOutAccuracy:
    """Per-rank hits of every head on the held-out rows, summed over processes.

    Each process scores its share of the rows; ``run`` reduces the counts, logs
    ``heldout/head<k>_top1`` / ``_top5``, ``heldout/head<k>_loss`` and ``heldout/expected_tau``
    (of an ``eval_tree_nodes`` tree built from them) and returns (hits (K, topk), totals (K,)).
    Nothing random is drawn, so a measurement never changes training.
    """

    def __init__(self, accelerator: Accelerator, cfg: MedusaTrainConfig, target: Target,
                 rows, metrics: MetricsLogger, pad_token_id: int):
        self.accelerator = accelerator
        self.cfg = cfg
        self.target = target
        self.metrics = metrics
        self.num_rows = 0 if rows is None else len(rows)
        self.batches: list[dict] = []
        if rows is None:
            return
        mine = list(range(accelerator.process_index, len(rows), accelerator.num_processes))
        size = cfg.per_device_batch_size
        for start in range(0, len(mine), size):
            batch = collate_causal_lm([rows[i] for i in mine[start:start + size]], pad_token_id)
            self.batches.append({k: batch[k].to(accelerator.device)
                                 for k in ("input_ids", "attention_mask", "loss_mask")})

    def due(self, state: TrainState) -> bool:
        every = self.cfg.heldout_every
        return bool(every) and bool(self.num_rows) and state.step % every == 0

    def run(self, state: TrainState, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Measure (every process calls it); logs on the main process."""
        accelerator, cfg = self.accelerator, self.cfg
        module = accelerator.unwrap_model(model)
        k, topk = cfg.num_heads, min(cfg.tree_topk, self.target.vocab_size)
        # float64 sums: hits (K * topk), totals (K), loss sums (K)
        sums = torch.zeros(k * topk + 2 * k, dtype=torch.float64, device=accelerator.device)
        was_training = module.training
        with self.metrics.paused(), torch.no_grad(), accelerator.autocast():
            module.eval()
            try:
                for batch in self.batches:
                    teacher = target_hidden(self.target, batch["input_ids"],
                                            batch["attention_mask"])
                    _, stats = module(batch["input_ids"], batch["attention_mask"],
                                      batch["loss_mask"], teacher, topk=topk)
                    counts = stats.counts.double()
                    sums += torch.cat([stats.hits.double().flatten(), counts,
                                       stats.head_loss.double() * counts])
            finally:
                module.train(was_training)
        if accelerator.num_processes > 1:
            sums = accelerator.reduce(sums, reduction="sum")
        hits = sums[: k * topk].reshape(k, topk).round().long().cpu()
        totals = sums[k * topk: k * topk + k].round().long().cpu()
        losses = (sums[k * topk + k:] / sums[k * topk: k * topk + k].clamp_min(1)).cpu()
        if accelerator.is_main_process and int(totals.sum()):
            acc = rank_accuracy(hits, totals)
            tree = build_medusa_tree(acc.tolist(), cfg.eval_tree_nodes)
            record = {"step": state.step,
                      **accuracy_metrics(hits, totals, ks=(1, 5), prefix="heldout"),
                      **{f"heldout/head{i}_loss": v for i, v in
                         enumerate(losses.tolist(), start=1)},
                      "heldout/expected_tau": expected_tau(tree, acc.tolist()),
                      "heldout/positions": int(totals[0])}
            self.metrics.log(record)
            self.metrics.bar.write(
                f"[draftsmith] step {state.step}: held-out top-1 per head "
                f"{[round(record[f'heldout/head{i}_top1'], 3) for i in range(1, k + 1)]}, "
                f"expected tau {record['heldout/expected_tau']:.3f} ({cfg.eval_tree_nodes} nodes)")
        return hits, totals


def eval_tree(cfg: MedusaTrainConfig, hits: torch.Tensor, totals: torch.Tensor):
    """The tree the acceptance evaluation uses while training."""
    if not int(totals.sum()):
        return default_chain(cfg.num_heads)
    return build_medusa_tree(rank_accuracy(hits, totals).tolist(), cfg.eval_tree_nodes)


def final_tree(cfg: MedusaTrainConfig, verifier: Target, heads: MedusaHeads, hits: torch.Tensor,
               totals: torch.Tensor) -> tuple[list, dict]:
    """(tree, tree_info) for the artifact, from the final held-out accuracies."""
    info: dict = {"heldout_positions": totals.tolist()}
    if not int(totals.sum()):
        info["note"] = ("no held-out positions (heldout_fraction 0, or no scored tokens): each "
                        "head's top-1 chain")
        return default_chain(cfg.num_heads), info
    acc = rank_accuracy(hits, totals).tolist()
    if cfg.tree_budget == "auto":
        tree, planned = plan_medusa_tree(verifier, heads, acc)
        info.update(planned)
        return tree, info
    tree = build_medusa_tree(acc, int(cfg.tree_budget))
    info.update({"rank_accuracies": acc, "node_budget": int(cfg.tree_budget),
                 "expected_tau": expected_tau(tree, acc)})
    return tree, info


# ------------------------------------------------------------------------------------------------
# Export


def weights_digest(model: nn.Module) -> str:
    """sha256 over a model's state dict (names, dtypes, shapes, bytes): its exact identity."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_adapted_target(model: nn.Module, tokenizer, out_dir: Path, base_identity: dict,
                        digest: str) -> Path:
    """The merged Medusa-2 target as a plain Hugging Face directory with the tokenizer.

    config.json gets a ``draftsmith`` block (method ``medusa2-target``, the original target's
    identity, the weights' digest) that ``heads.medusa.load_medusa`` checks.
    """
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    config[ADAPTED_TARGET_INFO_KEY] = {
        "method": "medusa2-target", "format_version": FORMAT_VERSION,
        "base_target": dict(base_identity), "digest": digest,
        "note": "the target as adapted by Medusa-2 training (LoRA merged); the Medusa heads in "
                "the parent directory are verified against this model"}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def write_artifact(out_dir: Path, heads: MedusaHeads, target: Target, tree, tree_info: dict,
                   extra: dict, adapted: nn.Module | None = None) -> Path:
    """Heads (+ the adapted target in ``target/`` for Medusa-2), staged and renamed into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        staged = staging / out_dir.name
        extra = dict(extra)
        if adapted is not None:
            digest = weights_digest(adapted)
            extra["adapted_target"] = {"path": "target", "digest": digest}
            extra["base_model"] = str((out_dir / "target").resolve())
        save_medusa(staged, heads, target, tree=tree, tree_info=tree_info, extra=extra)
        if adapted is not None:
            save_adapted_target(adapted, target.tokenizer, staged / "target", target.identity(),
                                extra["adapted_target"]["digest"])
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staged, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


# ------------------------------------------------------------------------------------------------
# The run


def _log_step(metrics: MetricsLogger, loss: torch.Tensor, stats: StepStats) -> None:
    metrics.add("loss", loss.detach())
    for k in range(stats.hits.shape[0]):
        n = stats.counts[k]
        metrics.add(f"medusa/head{k + 1}_loss", stats.head_loss[k])
        metrics.add(f"medusa/head{k + 1}_top1", stats.hits[k, :1].sum(), n)
        metrics.add(f"medusa/head{k + 1}_top5", stats.hits[k, :5].sum(), n)
    if stats.lm:
        n = stats.lm["count"]
        metrics.add("lm_kl", stats.lm["kl"], n)
        metrics.add("lm_ce", stats.lm["ce"], n)
        metrics.add("lm_agreement", stats.lm["agree"], n)


def main(cfg: MedusaTrainConfig) -> dict:
    """Train, checkpoint, plan the tree and export; returns step, stop message, artifact path,
    tree, tree_info, the frozen target, the verifier (the adapted target in Medusa-2) and heads."""
    accelerator = make_accelerator(cfg)  # first: seeds before any weights
    refuse_sharded(accelerator, "train/medusa.py measures held-out accuracies, plans the tree and exports "
                   "from one process, which needs the whole heads there")
    target = load_target(cfg.target, device=accelerator.device)  # frozen; never prepared
    pad_id = target.tokenizer.pad_token_id
    pad_id = target.eos_token_ids[0] if pad_id is None else pad_id

    sources = training_sources(cfg, target, accelerator)  # data
    with accelerator.main_process_first():
        dataset, report = load_sft_dataset(sources, target.tokenizer, cfg.max_length)
    train_rows, heldout_rows = split_heldout(dataset, cfg.heldout_fraction, cfg.heldout_max_rows,
                                             cfg.seed)
    held = 0 if heldout_rows is None else len(heldout_rows)
    accelerator.print(f"{report.summary()}\nheld out {held} rows for the heads' accuracies and "
                      f"the tree; {len(train_rows)} rows to train on")
    loader = make_train_dataloader(train_rows, cfg, accelerator,
                                   partial(collate_causal_lm, pad_token_id=pad_id))

    objective = build_objective(cfg, target)  # model: heads (+ the LoRA copy in Medusa-2)
    counts = medusa_param_counts(MedusaConfig(
        target.hidden_size, target.vocab_size, cfg.num_heads, cfg.num_layers, cfg.share_lm_head,
        cfg.head_bias))
    trainable = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    accelerator.print(
        f"[draftsmith] {'Medusa-2' if cfg.medusa2 else 'Medusa-1'}: {cfg.num_heads} heads, "
        f"{counts['blocks']:,} block parameters + "
        f"{'the shared LM head' if cfg.share_lm_head else 'an LM head copy each'} "
        f"({counts['lm_head_copies']:,} as copies); {trainable:,} parameters trained")
    verifier = objective.verifier()
    optimizer = make_optimizer(objective, cfg)
    model, optimizer, loader = accelerator.prepare(objective, optimizer, loader)
    checkpointer = Checkpointer(accelerator, cfg, target.identity(), loader)
    state = checkpointer.resume()
    metrics = MetricsLogger(accelerator, cfg, state)
    heldout = HeldOutAccuracy(accelerator, cfg, target, heldout_rows, metrics, pad_id)
    current = {"tree": default_chain(cfg.num_heads)}  # the evaluation's tree, updated below
    acceptance = AcceptanceEval(
        accelerator, cfg, verifier,
        lambda module: MedusaProposer(verifier, module.heads, current["tree"]), metrics)

    def measure_heldout() -> None:
        current["tree"] = eval_tree(cfg, *heldout.run(state, model))

    if state.step == 0:  # where the heads start, for comparison
        if heldout.due(state) or acceptance.every:
            measure_heldout()
        acceptance.maybe_run(state, model, force=True)

    saved = stopped = None
    with GracefulStop(accelerator) as stop:  # loop
        for batch in train_batches(loader, state):
            teacher = target_hidden(target, batch["input_ids"], batch["attention_mask"])
            with accelerator.accumulate(model):
                lr = apply_learning_rate(optimizer, cfg, state)
                loss, stats = model(batch["input_ids"], batch["attention_mask"],
                                    batch["loss_mask"], teacher)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            _log_step(metrics, loss, stats)
            metrics.count_tokens(batch["attention_mask"].sum())
            del teacher, stats
            if not accelerator.sync_gradients:
                continue
            state.step += 1
            stopping = stop.should_stop()  # every process, every step
            metrics.step(state, force=stopping or state.done, lr=lr,
                         peak_memory_gb=round(peak_memory_gb(accelerator.device), 3))
            if not state.done:  # the end is measured below, with the final tree
                if heldout.due(state) or (heldout.num_rows and acceptance.due(state)):
                    measure_heldout()
                acceptance.maybe_run(state, model)
            if checkpointer.due(state) or stopping or state.done:  # checkpoint
                saved = checkpointer.save(state)
            if stopping:
                stopped = stop.message(state, saved)
                accelerator.print(stopped)
                break
            if state.done:
                break

    artifact = tree = tree_info = None
    module = accelerator.unwrap_model(model)
    if stopped is None:  # export: held-out accuracies -> tree -> artifact (-> measured tau)
        hits, totals = heldout.run(state, model)
        if accelerator.is_main_process:
            module.eval()
            adapted = None
            if cfg.medusa2:
                adapted = merge_lora(module.adapted).eval()
                verifier = wrap_target(adapted, target.tokenizer, name=f"{target.name}+medusa2")
            tree, tree_info = final_tree(cfg, verifier, module.heads, hits, totals)
            extra = {"trainer": "train/medusa.py", "medusa2": cfg.medusa2, "steps": state.step,
                     "loss_decay": cfg.loss_decay, "soft_labels": cfg.soft_labels,
                     "regenerated": cfg.regenerate}
            if cfg.medusa2:
                extra.update({"kl_weight": cfg.kl_weight, "lm_loss_weight": cfg.lm_loss_weight,
                              "heads_loss_weight": cfg.heads_loss_weight,
                              "lora": {"r": cfg.lora_r, "alpha": cfg.lora_alpha,
                                       "target_modules": cfg.lora_target_modules}})
            artifact = write_artifact(Path(cfg.output_dir) / "artifact", module.heads, target,
                                      tree, tree_info, extra, adapted)
            record = {"step": state.step, "final/expected_tau": tree_info.get("expected_tau"),
                      "final/tree_nodes": len(tree),
                      "final/predicted_speedup": tree_info.get("predicted_speedup")}
            if acceptance.every:
                with torch.no_grad(), accelerator.autocast():
                    measured = measure_acceptance(
                        verifier, MedusaProposer(verifier, module.heads, tree),
                        acceptance.prompts, max_new_tokens=cfg.eval_max_new_tokens,
                        params=acceptance.params, seed=cfg.seed)
                record.update({"final/tau": measured["tau"], "final/alpha": measured["alpha"]})
            metrics.log(record)
            bench_target = artifact / "target" if cfg.medusa2 else cfg.target
            accelerator.print(
                f"[draftsmith] Medusa heads written to {artifact} with a {len(tree)}-node tree: "
                f"expected tau {_fmt(record['final/expected_tau'])}, measured "
                f"{_fmt(record.get('final/tau'))}\n"
                f"  measure: python -m eval.bench --target {bench_target} --method plain "
                f"--method medusa:{artifact} --prompts {cfg.eval_prompts}\n"
                f"  export:  python -m heads.export {artifact} --format vllm --out "
                f"{Path(cfg.output_dir) / 'vllm'}   (or trtllm)")
            if cfg.medusa2:
                accelerator.print(
                    f"  Medusa-2: the heads are verified against the adapted target in "
                    f"{artifact / 'target'}; speculative decoding is exact with respect to it, "
                    f"not to {cfg.target}")
    accelerator.wait_for_everyone()
    metrics.close()
    accelerator.end_training()
    return {"step": state.step, "stopped": stopped, "artifact": artifact, "tree": tree,
            "tree_info": tree_info, "target": target, "verifier": verifier,
            "heads": module.heads}


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main(parse_config(MedusaTrainConfig))
