"""Medusa trainer: K heads on the target's last hidden state (Medusa-1), or jointly with LoRA
adapters on the target itself (Medusa-2).

    accelerate launch train/medusa.py --config configs/medusa/smollm2-135m.yaml
    python train/medusa.py --config configs/medusa/tiny.yaml                     # one process
    torchrun --nproc_per_node 2 train/medusa.py --config ...                     # two CPU procs

Head k (k = 1..K) reads ``h_t``, the target's final-normed last hidden state at position t, and
is trained on token t+1+k (where ``loss_mask`` scores it) with weight ``loss_decay``**k: against
the data's token (cross-entropy), or with ``soft_labels`` against the target's own distribution
of that token given the true prefix (self-distillation). ``regenerate: true`` first lets the
target answer the data's prompts itself (``draftsmith.train.data.regenerate``) and trains on its answers, so
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

Draft vocabulary (``draft_vocab_size: N``, as EAGLE-3 does): the heads guess among the N most
frequent assistant tokens of the training rows only (chosen exactly as train/eagle.py chooses
EAGLE-3's, :func:`draftsmith.heads.draft_vocab.draft_vocabulary`), through one trained (N, hidden)
projection of their own shared by every head (``share_lm_head: true``) or a copy per head,
initialised from the target's LM-head rows of those tokens; that cuts the vocabulary projection,
most of a head's cost on a large vocabulary, by V / N per step. Hard labels whose token has no
draft id are not scored (they still count as misses in the accuracies); soft labels use the
target's distribution restricted to the draft tokens and renormalised, skipping positions whose
target argmax has no draft id (EAGLE-3's rule). The draft vocabulary's coverage of the assistant
tokens is printed and logged at step 0 (``draft_vocab/coverage``). Such heads export to
``vllm-0.32`` only (its ``token_map``); TensorRT-LLM and FasterDecoding project onto the whole
vocabulary, so train with ``draft_vocab_size: null`` for them.

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
(``tree_nodes: auto``: the node count that maximises expected tau per measured verification
cost on this machine, see ``draftsmith.eval.tree_choice.size_medusa_tree``; or a fixed node count), saved in
``<output_dir>/artifact`` with the heads; ``final/expected_tau`` and (with ``eval_every`` > 0)
``final/tau`` measured with that tree are logged. ``python -m draftsmith.eval.bench --method
medusa:<artifact>`` measures it; ``draftsmith export`` writes the vLLM / TensorRT-LLM layouts.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch import nn

from draftsmith.eval.medusa import MedusaProposer
from draftsmith.eval.tree_choice import size_medusa_tree
from draftsmith.files.command_line import run_command, shell_command
from draftsmith.files.output_dir import write_dir
from draftsmith.heads.artifact import FORMAT_VERSION, check_finite
from draftsmith.heads.distill import add_lora, merge_lora
from draftsmith.heads.draft_vocab import check_same_vocabulary, draft_vocabulary
from draftsmith.heads.medusa import (
    ADAPTED_TARGET_INFO_KEY,
    MedusaHeads,
    accuracy_metrics,
    medusa_param_counts,
    rank_accuracy,
    save_medusa,
)
from draftsmith.heads.medusa_loss import (
    DEFAULT_LOSS_DECAY,
    MedusaObjective,
    StepStats,
    target_hidden,
)
from draftsmith.heads.medusa_tree import choose_tree, default_chain, expected_tau
from draftsmith.targets.target import Target, wrap_target
from draftsmith.train.accelerator import close_process_group
from draftsmith.train.batches import make_batches, row_sizes, split_heldout
from draftsmith.train.checkpoints import TrainState
from draftsmith.train.config import LoraKeys, TrainConfig, option, parse_config
from draftsmith.train.estimate import LAYER_FACTOR, MemoryModel, Shape, StepSizes
from draftsmith.train.loop import Recipe, StepOutput, TrainResult, start_run
from draftsmith.train.regenerate import merge_shards, regenerate
from draftsmith.train.rows import collate_causal_lm, load_sft_dataset
from draftsmith.train.sharding import load_run_target, run_plan, whole_module
from draftsmith.train.tracking import AcceptanceEval, PeriodicEval, share_batches

_MEDUSA2_ONLY = {"kl_weight": 1.0, "lm_loss_weight": 0.0, "lora_r": 16, "lora_alpha": 32.0,
                 "lora_dropout": 0.0, "lora_target_modules": ["all-linear"]}
_NOT_ADAPTABLE = ("lm_head", "embed_tokens")


@dataclass
class MedusaTrainConfig(LoraKeys, TrainConfig):
    """Train Medusa heads on a frozen target (Medusa-1) or with LoRA on it (Medusa-2)."""

    num_heads: int = option(4, "K, the number of Medusa heads: head k guesses token t+1+k")
    num_layers: int = option(1, "residual blocks per head (x + SiLU(W x + b)), zero-initialised")
    share_lm_head: bool = option(
        True, "every head projects with the target's own LM head (frozen, not stored: 1.33M "
        "trainable parameters on smollm2-135m, 67M on an 8B target) instead of a trainable copy "
        "each (false: 114.6M on smollm2-135m, 2.1B with AdamW state of 34 GB on a 128k-vocabulary "
        "8B target)")
    head_bias: bool = option(True, "the blocks' linear layers have a bias (as in FasterDecoding)")
    draft_vocab_size: int | None = option(
        None, "the heads guess among this many target tokens, the most frequent assistant tokens "
        "of the training data (as EAGLE-3 does), through a trained projection of that size of "
        "their own (shared by every head with share_lm_head: true); exports to vllm-0.32 only "
        "(none: the whole vocabulary)")
    loss_decay: float = option(DEFAULT_LOSS_DECAY, "head k's loss is weighted loss_decay**k (0 < decay <= 1)")
    soft_labels: bool = option(
        False, "self-distillation: head k at t matches the target's distribution of token t+1+k "
        "given the true prefix, instead of the data's token")

    regenerate: bool = option(
        False, "first let the target answer the data's prompts itself (draftsmith.train.data.regenerate, "
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
    tree_nodes: str = option(
        "auto", "nodes of the final tree: auto (the count maximising expected tau per measured "
        "verification cost on this machine) or a node count", may_change_on_resume=True)
    eval_tree_nodes: int = option(
        16, "nodes of the tree used by the acceptance evaluation while training",
        may_change_on_resume=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_parallel > 1 and (self.medusa2 or self.regenerate):
            why = ("medusa2 trains a copy of the target" if self.medusa2 else
                   "regenerate: true answers the prompts with the target, each process its own")
            fix = ("train Medusa-1" if self.medusa2 else
                   "regenerate the data first (python -m draftsmith.train.data regenerate)")
            raise ValueError(f"target_parallel is {self.target_parallel}, but {why}; a sharded "
                             f"target serves frozen forwards in lockstep only: set "
                             f"target_parallel: 1, or {fix}")
        if self.num_heads < 1:
            raise ValueError(f"config key 'num_heads' (K, the number of Medusa heads) must be "
                             f">= 1, got {self.num_heads}")
        at_least = {"num_layers": 0, "draft_vocab_size": 1, "regenerate_max_new_tokens": 1,
                    "regenerate_max_prompts": 1, "regenerate_batch_size": 1,
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
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"config key 'heldout_fraction' must be in [0, 1), got "
                             f"{self.heldout_fraction}")
        if self.tree_nodes != "auto" and not (self.tree_nodes.isdigit()
                                              and int(self.tree_nodes) >= 1):
            raise ValueError(f"config key 'tree_nodes' must be 'auto' or a node count >= 1, "
                             f"got {self.tree_nodes!r}")
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


def loss_options(cfg: MedusaTrainConfig) -> dict:
    """The config's keys for :class:`draftsmith.heads.medusa_loss.MedusaObjective`."""
    return {"loss_decay": cfg.loss_decay, "soft_labels": cfg.soft_labels,
            "heads_loss_weight": cfg.heads_loss_weight, "kl_weight": cfg.kl_weight,
            "lm_loss_weight": cfg.lm_loss_weight, "loss_chunk_size": cfg.loss_chunk_size}


def build_objective(cfg: MedusaTrainConfig, target: Target, *, d2t: torch.Tensor | None = None,
                    t2d: torch.Tensor | None = None) -> MedusaObjective:
    """Fresh heads (identity blocks, projections from the LM head; over the draft vocabulary
    ``d2t`` / ``t2d`` when given) and, for Medusa-2, a LoRA copy of the target in its own dtype,
    with fp32 adapters, in training mode (its activations recomputed in the backward pass with
    ``gradient_checkpointing``)."""
    heads = MedusaHeads.from_target(target, num_heads=cfg.num_heads, num_layers=cfg.num_layers,
                                    share_lm_head=cfg.share_lm_head, bias=cfg.head_bias,
                                    d2t=d2t, t2d=t2d)
    adapted = None
    if cfg.medusa2:
        # a separate copy: peft edits the model it wraps, and the original stays the KL reference
        model = copy.deepcopy(target.model)
        if cfg.gradient_checkpointing:  # recompute the adapted target's layers in backward
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        modules = cfg.lora_target_modules
        adapted = add_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                           target_modules="all-linear" if modules == ["all-linear"] else modules)
    return MedusaObjective(heads, target, adapted, **loss_options(cfg)).train()


# ------------------------------------------------------------------------------------------------
# Data


def training_sources(cfg: MedusaTrainConfig, target: Target, accelerator: Accelerator) -> list[str]:
    """``cfg.data``, or the file of the target's own answers to its prompts (``regenerate``).

    Every process answers its share of the prompts at the same time (shard i of n), then the
    main process joins the shards in input order; a rerun continues where each shard stopped.
    """
    if not cfg.regenerate:
        return list(cfg.data)
    if not cfg.data:
        raise ValueError("regenerate: true needs prompts: set config key 'data'")
    out = Path(cfg.output_dir) / "regenerated.jsonl"
    shard = (accelerator.process_index, accelerator.num_processes)
    # the frozen original answers (Medusa-2 too): the data the adapted model is kept close to
    written = regenerate(target, cfg.data, out, max_new_tokens=cfg.regenerate_max_new_tokens,
                         temperature=cfg.regenerate_temperature,
                         batch_size=cfg.regenerate_batch_size,
                         max_prompts=cfg.regenerate_max_prompts, seed=cfg.seed, shard=shard,
                         progress=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    if accelerator.num_processes > 1 and accelerator.is_main_process:
        merge_shards(out, accelerator.num_processes)
    accelerator.wait_for_everyone()
    accelerator.print(f"[draftsmith] the target answered {written} more prompts (this process) "
                      f"into {out}")
    return [str(out)]


# ------------------------------------------------------------------------------------------------
# Held-out accuracies (what the tree is built from)


class HeldOutAccuracy(PeriodicEval):
    """Per-rank hits of every head on the held-out rows, summed over processes.

    Runs every ``heldout_every`` steps, whenever the acceptance evaluation is due (its tree is
    built from these accuracies) and at the end (for the artifact's tree). Each process scores its
    share of the rows; the record holds ``heldout/head<k>_top1`` / ``_top5``,
    ``heldout/head<k>_loss`` and ``heldout/expected_tau`` (of an ``eval_tree_nodes`` tree built
    from them); ``hits`` (K, topk) and ``totals`` (K,) and ``tree`` keep the latest figures.
    Nothing random is drawn, so a measurement never changes training.
    """

    name = "heldout"
    at_end = False  # measured by the export, which needs the figures on every process

    def __init__(self, accelerator: Accelerator, cfg: MedusaTrainConfig, target: Target,
                 rows, pad_token_id: int, acceptance: AcceptanceEval):
        super().__init__(accelerator)
        self.cfg = cfg
        self.target = target
        self.acceptance = acceptance
        self.num_rows = 0 if rows is None else len(rows)
        self.every = (cfg.heldout_every or acceptance.every) if self.num_rows else 0
        self.topk = min(cfg.tree_topk, cfg.draft_vocab_size or target.vocab_size)
        self.hits = torch.zeros(cfg.num_heads, self.topk, dtype=torch.long)
        self.totals = torch.zeros(cfg.num_heads, dtype=torch.long)
        self.tree = default_chain(cfg.num_heads)
        self.batches: list[dict] = []
        self.idle: list[bool] = []  # batches run only because a sharded forward needs everyone
        if not self.num_rows:
            return
        lockstep = run_plan(cfg, accelerator).any
        for rows_of_batch in share_batches(self.num_rows, accelerator, cfg.per_device_batch_size,
                                           lockstep):
            batch = collate_causal_lm([rows[i] for i in rows_of_batch or [0]], pad_token_id)
            self.idle.append(not rows_of_batch)
            self.batches.append({k: batch[k].to(accelerator.device)
                                 for k in ("input_ids", "attention_mask", "loss_mask")})

    def due(self, state: TrainState) -> bool:
        if not self.every or state.done:
            return False
        every = self.cfg.heldout_every
        return bool(every and state.step % every == 0) or self.acceptance.due(state)

    def measure(self, module) -> torch.Tensor:
        k = self.cfg.num_heads
        # float64 sums: hits (K * topk), totals (K), loss sums and scored positions (K each)
        sums = torch.zeros(k * self.topk + 3 * k, dtype=torch.float64,
                           device=self.accelerator.device)
        for batch, idle in zip(self.batches, self.idle, strict=True):
            teacher = target_hidden(self.target, batch["input_ids"], batch["attention_mask"])
            _, stats = module(batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                              teacher, topk=self.topk)
            if idle:
                continue
            scored = stats.scored.double()
            sums += torch.cat([stats.hits.double().flatten(), stats.counts.double(),
                               stats.head_loss.double() * scored, scored])
        return sums

    def summarise(self, state: TrainState, sums: list[float]) -> dict | None:
        k, topk = self.cfg.num_heads, self.topk
        sums = torch.tensor(sums, dtype=torch.float64)
        self.hits = sums[: k * topk].reshape(k, topk).round().long()
        self.totals = sums[k * topk: k * topk + k].round().long()
        losses = (sums[k * topk + k: k * topk + 2 * k]
                  / sums[k * topk + 2 * k:].clamp_min(1)).tolist()
        self.tree = eval_tree(self.cfg, self.hits, self.totals)
        if not int(self.totals.sum()):
            return None
        acc = rank_accuracy(self.hits, self.totals)
        return {"step": state.step,
                **accuracy_metrics(self.hits, self.totals, ks=(1, 5), prefix="heldout"),
                **{f"heldout/head{i}_loss": v for i, v in enumerate(losses, start=1)},
                "heldout/expected_tau": expected_tau(self.tree, acc.tolist()),
                "heldout/positions": int(self.totals[0])}

    def describe(self, record: dict) -> str:
        top1 = [round(record[f"heldout/head{i}_top1"], 3)
                for i in range(1, self.cfg.num_heads + 1)]
        return (f"held-out top-1 per head {top1}, expected tau "
                f"{record['heldout/expected_tau']:.3f} ({self.cfg.eval_tree_nodes} nodes)")


def _accuracies(hits: torch.Tensor, totals: torch.Tensor) -> list | None:
    return rank_accuracy(hits, totals).tolist() if int(totals.sum()) else None


def eval_tree(cfg: MedusaTrainConfig, hits: torch.Tensor, totals: torch.Tensor):
    """The tree the acceptance evaluation uses while training."""
    return choose_tree(_accuracies(hits, totals), cfg.num_heads, cfg.eval_tree_nodes)[0]


def final_tree(cfg: MedusaTrainConfig, verifier: Target, heads: MedusaHeads, hits: torch.Tensor,
               totals: torch.Tensor) -> tuple[list, dict]:
    """(tree, tree_info) for the artifact, from the final held-out accuracies."""
    nodes = cfg.tree_nodes if cfg.tree_nodes == "auto" else int(cfg.tree_nodes)
    tree, info = size_medusa_tree(_accuracies(hits, totals), cfg.num_heads, nodes,
                                  target=verifier, heads=heads)
    return tree, {**info, "heldout_positions": totals.tolist()}


# ------------------------------------------------------------------------------------------------
# Export


def parameters_digest(model: nn.Module) -> str:
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
    identity, the weights' digest) that ``draftsmith.heads.medusa.load_medusa`` checks.
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
                   extra: dict, adapted: nn.Module | None = None, overwrite: bool = False) -> Path:
    """Heads (+ the adapted target in ``target/`` for Medusa-2), written atomically."""
    extra = dict(extra)
    if adapted is not None:
        check_finite(adapted.state_dict(), f"the Medusa-2 artifact {out_dir} was not written")
        digest = parameters_digest(adapted)
        extra["adapted_target"] = {"path": "target", "digest": digest}
        extra["base_model"] = str((out_dir / "target").resolve())

    def fill(staged: Path) -> None:
        save_medusa(staged, heads, target, tree=tree, tree_info=tree_info, extra=extra)
        if adapted is not None:
            save_adapted_target(adapted, target.tokenizer, staged / "target", target.identity(),
                                extra["adapted_target"]["digest"])

    return write_dir(out_dir, fill, kind="artifact", overwrite=overwrite,
                     marker={"method": "medusa"})


# ------------------------------------------------------------------------------------------------
# The run


def _logged(stats: StepStats) -> dict:
    """The step's metrics as (total, count) pairs for the loop's logger."""
    logged = {}
    for k in range(stats.hits.shape[0]):
        n = stats.counts[k]
        logged[f"medusa/head{k + 1}_loss"] = (stats.head_loss[k], 1)
        logged[f"medusa/head{k + 1}_top1"] = (stats.hits[k, :1].sum(), n)
        logged[f"medusa/head{k + 1}_top5"] = (stats.hits[k, :5].sum(), n)
    if stats.lm:
        n = stats.lm["count"]
        logged.update({"lm_kl": (stats.lm["kl"], n), "lm_ce": (stats.lm["ce"], n),
                       "lm_agreement": (stats.lm["agree"], n)})
    return logged


# ------------------------------------------------------------------------------------------------
# Memory: what one step adds to the estimate (train/estimate.py), checked before the target loads


def memory_parts(cfg, target: Shape, sizes: StepSizes) -> dict[str, float]:
    """The trained module with AdamW, its activations, the target's forward and the loss chunk."""
    n, act, h = sizes.tokens, sizes.act, target.hidden
    parts: dict[str, float] = {}
    k = cfg.num_heads
    draft_vocab = cfg.draft_vocab_size
    vocab = draft_vocab or target.vocab  # what the heads' logits range over
    trained = k * cfg.num_layers * (h * h + h)
    if draft_vocab:  # a trained projection onto the draft tokens, shared or one per head
        trained += (1 if cfg.share_lm_head else k) * draft_vocab * h
    elif not cfg.share_lm_head:
        trained += k * target.vocab * h
    kept = k * cfg.num_layers * 4 * h * act
    if cfg.medusa2:  # backpropagation through the adapted target
        layer = LAYER_FACTOR * target.layer_saved_per_token() * act
        kept += (layer + target.layers * 2 * h * act) if cfg.gradient_checkpointing \
            else target.layers * layer
        trained += target.layers * cfg.lora_r * 4 * (h + target.intermediate)  # LoRA, roughly
    own_head = draft_vocab or (0 if cfg.share_lm_head else target.vocab)
    largest = max(own_head * h, h * h, target.intermediate * cfg.lora_r if cfg.medusa2 else 0)
    parts[f"trained heads ({trained / 1e6:.0f} M parameters, AdamW)"] = \
        sizes.optimizer(trained, largest)
    parts[f"activations ({k} heads{', adapted target' if cfg.medusa2 else ''})"] = kept * n
    parts["target forward"] = (0 if cfg.medusa2 else sizes.target_forward) + h * act * n
    # one head's loss at a time; Medusa-2's LM loss (data and the target) after them
    chunk = sizes.loss_chunk(cfg, vocab, teacher=target.vocab if cfg.soft_labels else None,
                             columns=bool(draft_vocab))
    if cfg.medusa2:
        chunk = max(chunk, sizes.loss_chunk(cfg, target.vocab, teacher=target.vocab))
    parts[f"loss chunk ({min(cfg.loss_chunk_size, n)} x {vocab})"] = chunk
    # each head's loss holds its own projection's gradient, (vocabulary, h) float32, for backward
    # (heads/chunked_loss.py), plus its states'
    own = (1 if cfg.share_lm_head else k) * vocab * h if (draft_vocab or not cfg.share_lm_head) \
        else 0
    parts["loss's gradient buffers"] = (own + k * n * h) * 4
    return parts


MEMORY = MemoryModel(memory_parts, shrink_keys=(
    "max_tokens_per_batch (or per_device_batch_size), share_lm_head: true, "
    "gradient_checkpointing: true (Medusa-2), loss_chunk_size"))


def build(cfg: MedusaTrainConfig) -> Recipe:
    """The run, ready to train: target, data, heads (+ the LoRA copy), evaluation and export."""
    accelerator = start_run(cfg, MEMORY)  # seeds first, then the memory check
    if run_plan(cfg, accelerator).any and cfg.tree_nodes == "auto":
        raise ValueError("tree_nodes is auto, which times the target and heads on the main "
                         "process alone, but this run shards them (every forward needs all "
                         "processes): give a node count (tree_nodes: 60, say), or size the tree "
                         "afterwards with python -m draftsmith.eval.bench --tree auto")
    target = load_run_target(cfg, accelerator)  # frozen; never prepared; maybe sharded
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
    lengths, scored = row_sizes(train_rows)
    batches = make_batches(train_rows, cfg, accelerator,
                           partial(collate_causal_lm, pad_token_id=pad_id),
                           lengths=lengths, weights=scored)

    maps, first = None, None
    if cfg.draft_vocab_size is not None:  # a pure function of the training rows: every process
        # and every resumed run computes the same maps (checked against the checkpoint's)
        if cfg.draft_vocab_size > target.vocab_size:
            raise ValueError(f"config key 'draft_vocab_size' is {cfg.draft_vocab_size}, more than "
                             f"the target's {target.vocab_size} tokens; set it lower or null")
        *maps, coverage = draft_vocabulary(train_rows["input_ids"], train_rows["loss_mask"],
                                           target.vocab_size, cfg.draft_vocab_size)
        first = {"draft_vocab/size": cfg.draft_vocab_size, "draft_vocab/coverage": coverage}
        accelerator.print(
            f"[draftsmith] draft vocabulary: {cfg.draft_vocab_size} of {target.vocab_size} "
            f"target tokens, covering {coverage:.2%} of the training rows' assistant tokens"
            + ("" if cfg.soft_labels else "; positions whose token has none are not scored"))
    d2t, t2d = maps or (None, None)
    # model: heads (+ the LoRA copy in Medusa-2)
    objective = build_objective(cfg, target, d2t=d2t, t2d=t2d)
    counts = medusa_param_counts(objective.heads.config)
    trainable = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    if objective.heads.config.reads_target_lm_head:
        projection = "the target's LM head, shared"
    elif cfg.share_lm_head:
        projection = f"one {cfg.draft_vocab_size}-token projection of their own, shared"
    else:
        projection = (f"a {objective.heads.config.head_vocab_size}-token projection each "
                      f"({counts['lm_head_copies']:,} parameters)")
    accelerator.print(
        f"[draftsmith] {'Medusa-2' if cfg.medusa2 else 'Medusa-1'}: {cfg.num_heads} heads, "
        f"{counts['blocks']:,} block parameters + {projection}; {trainable:,} parameters "
        f"trained")
    verifier = objective.verifier()

    def target_forward(batch: dict) -> torch.Tensor:  # (B, T, H), the LM head skipped
        return target_hidden(target, batch["input_ids"], batch["attention_mask"])

    def step(model, batch: dict, micro_index: int) -> StepOutput:
        teacher = target_forward(batch)
        loss, stats = model(batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                            teacher, reduction="sum")
        return StepOutput(loss, _logged(stats))

    acceptance = AcceptanceEval(
        accelerator, cfg, verifier,
        lambda module: MedusaProposer(verifier, module.heads, heldout.tree))
    acceptance.at_end = False  # the end is measured below, with the artifact's tree
    heldout = HeldOutAccuracy(accelerator, cfg, target, heldout_rows, pad_id, acceptance)

    def check_vocabulary(state, module) -> None:
        if maps:
            check_same_vocabulary((module.heads.d2t, module.heads.t2d), maps, state.resumed_from)

    def rebuild() -> MedusaObjective:  # the same module, whole (exports of an FSDP2 run)
        return build_objective(cfg, target, d2t=d2t, t2d=t2d)

    return Recipe(cfg, accelerator, target, batches, objective, step,
                  export=partial(export, cfg, accelerator, target, heldout, acceptance, verifier,
                                 rebuild),
                  evaluators=[heldout, acceptance], first_record=first,
                  on_resume=check_vocabulary, target_forward=target_forward)


def export(cfg: MedusaTrainConfig, accelerator, target: Target, heldout: HeldOutAccuracy,
           acceptance: AcceptanceEval, verifier: Target, rebuild, result: TrainResult) -> dict:
    """Held-out accuracies -> tree -> artifact -> measured tau, after a completed run; returns
    step, stop message, artifact path, tree, tree_info, the frozen target, the verifier (the
    adapted target in Medusa-2) and heads."""
    state, metrics = result.state, result.metrics

    artifact = tree = tree_info = None
    module = accelerator.unwrap_model(result.model)
    if result.completed:  # export: held-out accuracies -> tree -> artifact -> measured tau
        heldout.run(state, result.model, metrics)  # every process: the sums are reduced
        module = whole_module(module, rebuild) or module  # FSDP2: gathered on the main process
        module.eval()
        adapted = None
        if cfg.medusa2:  # every process merges its own replica: the final measurement needs it
            adapted = merge_lora(module.adapted).eval()
            verifier = wrap_target(adapted, target.tokenizer, name=f"{target.name}+medusa2")
        plan = [None, None]
        if accelerator.is_main_process:
            plan = list(final_tree(cfg, verifier, module.heads, heldout.hits, heldout.totals))
        plan = broadcast_object_list(plan)  # the tree is planned once, used everywhere
        tree, tree_info = plan
        if accelerator.is_main_process:
            extra = {"trainer": "train/medusa.py", "medusa2": cfg.medusa2, "steps": state.step,
                     "loss_decay": cfg.loss_decay, "soft_labels": cfg.soft_labels,
                     "regenerated": cfg.regenerate}
            if cfg.medusa2:
                extra.update({"kl_weight": cfg.kl_weight, "lm_loss_weight": cfg.lm_loss_weight,
                              "heads_loss_weight": cfg.heads_loss_weight,
                              "lora": {"r": cfg.lora_r, "alpha": cfg.lora_alpha,
                                       "target_modules": cfg.lora_target_modules}})
            artifact = write_artifact(Path(cfg.output_dir) / "artifact", module.heads, target,
                                      tree, tree_info, extra, adapted,
                                      overwrite=cfg.overwrite)
        record = {"step": state.step, "final/expected_tau": tree_info.get("expected_tau"),
                  "final/tree_nodes": len(tree),
                  "final/predicted_speedup": tree_info.get("predicted_speedup")}
        if acceptance.every:  # every process decodes its share of the prompts with the tree
            final = AcceptanceEval(accelerator, cfg, verifier,
                                   lambda _: MedusaProposer(verifier, module.heads, tree),
                                   name="final")
            record.update(final.run(state, result.model, metrics, log=False))  # final/tau, alpha
        metrics.log(record)
        if accelerator.is_main_process:
            bench_target = artifact / "target" if cfg.medusa2 else cfg.target
            fmt = "vllm-0.32" if cfg.draft_vocab_size is not None else "trtllm"
            export_command = shell_command("draftsmith", "export", artifact, "--format",
                                           fmt, "--out", Path(cfg.output_dir) / fmt)
            measure = shell_command("python", "-m", "draftsmith.eval.bench", "--target", bench_target,
                                    "--method", "plain", "--method", f"medusa:{artifact}",
                                    "--prompts", cfg.eval_prompts)
            accelerator.print(
                f"[draftsmith] Medusa heads written to {artifact} with a {len(tree)}-node tree: "
                f"expected tau {_fmt(record['final/expected_tau'])}, measured "
                f"{_fmt(record.get('final/tau'))}\n"
                f"  measure: {measure}\n"
                f"  export:  {export_command}   "
                + ("(a draft vocabulary: TensorRT-LLM and FasterDecoding need draft_vocab_size: "
                   "null)" if cfg.draft_vocab_size is not None else
                   "(or fasterdecoding --write-pt, vllm-0.32)"))
            if cfg.medusa2:
                accelerator.print(
                    f"  Medusa-2: the heads are verified against the adapted target in "
                    f"{artifact / 'target'}; speculative decoding is exact with respect to it, "
                    f"not to {cfg.target}")
    accelerator.wait_for_everyone()
    metrics.close()
    close_process_group(accelerator)
    return {"step": state.step, "stopped": result.stopped, "artifact": artifact, "tree": tree,
            "tree_info": tree_info, "target": target, "verifier": verifier,
            "heads": module.heads}


def main(cfg: MedusaTrainConfig) -> dict:
    """Train, checkpoint, plan the tree and export (see :func:`export` for what it returns)."""
    recipe = build(cfg)
    return recipe.export(recipe.train())


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    raise SystemExit(run_command(lambda: main(parse_config(MedusaTrainConfig)), "train/medusa.py"))
