"""Distillation trainer: a small draft LM learns the frozen target's next-token distributions.

    accelerate launch train/distill.py --config configs/distill/smollm2-135m.yaml
    python train/distill.py --config configs/distill/tiny.yaml --max_steps 20   # one process
    torchrun --nproc_per_node 2 train/distill.py --config ...                    # two CPU processes

The draft (``truncate:N``: a trainable copy of the target's first N layers; ``fresh:L``: a new
L-layer model of the target's architecture; or a Hugging Face model directory sharing the target's
tokenizer) is the only module prepared, optimised and checkpointed. The target stays frozen, in
eval mode, bf16 on GPU. Every micro-batch is one of two kinds, chosen by a schedule that depends
only on the seed and the micro-batch's index (so a resumed run makes the same choices):

* **off-policy**: the data's own responses (or responses the target wrote itself:
  ``python -m draftsmith.train.data regenerate``), the loss on their assistant tokens;
* **on-policy** (DistillSpec / GKD), a fraction ``on_policy_ratio`` of the micro-batches: the draft
  samples a continuation of each row's prompt (the conversation up to its first assistant turn,
  rendered with the chat template) at ``on_policy_temperature``, stopping at an end-of-sequence
  token or after ``on_policy_max_new_tokens``; the target scores prompt + continuation in one
  forward and the divergence is taken on exactly the tokens the draft sampled.

Rows without a response (prompt-only data such as ShareGPT first turns) have nothing to distil
off-policy, so they are always trained on the draft's samples; with ``on_policy_ratio 0`` they are
dropped (and the report says how to let the target answer them first).

The loss is a divergence between the draft's and the target's distributions at ``temperature``
(forward_kl, reverse_kl, jsd with ``beta``, tvd), computed only at the scored positions: both
models return logits for those positions alone (``logits_to_keep`` with a boolean mask), so no
(batch, seq, vocab) tensor exists. Full fine-tuning, or LoRA adapters through peft (``lora: true``)
merged into plain weights at export.

Logged to ``<output_dir>/metrics.jsonl`` (and W&B with ``report_to: wandb``): ``loss``,
``agreement`` (argmax agreement: greedy acceptance per token), ``on_policy`` (fraction of
micro-batches), ``sampled_tokens`` (mean continuation length of sampled rows), ``peak_memory_gb``; every
``heldout_every`` steps ``heldout/acceptance`` (mean 1 - TVD at ``temperature``: the per-token
acceptance rate of exact speculative sampling), ``heldout/agreement`` and ``heldout/<divergence>``
on held-out rows excluded from training; every ``eval_every`` steps ``eval/tau`` and
``eval/alpha`` measured by the speculative engine with the draft as proposer.

At the end ``<output_dir>/artifact`` is a plain Hugging Face model directory with the target's
tokenizer and a ``draftsmith`` block in config.json: ``python -m draftsmith.eval.bench --method
draft:<output_dir>/artifact``, ``model.generate(..., assistant_model=...)`` in transformers, or a
draft model in vLLM.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from accelerate import Accelerator
from torch import nn

from draftsmith.eval.draft import PROPOSAL_KEY, DraftModelProposer
from draftsmith.files.command_line import run_command, shell_command
from draftsmith.heads.distill import (
    add_lora,
    fresh_draft,
    load_draft,
    merge_lora,
    restrict_vocabulary,
    save_draft,
)
from draftsmith.heads.distill_loss import DIVERGENCES, teacher_logits
from draftsmith.heads.distill_projected import (
    ProjectedDivergence,
    distill_scores,
    hugging_face_model,
    projects_from_states,
    teacher_states,
)
from draftsmith.heads.draft_vocab import (
    check_same_vocabulary,
    draft_token_ids,
    draft_vocabulary,
    maps_from_token_ids,
)
from draftsmith.targets.resolve import is_hub_id
from draftsmith.targets.target import Target
from draftsmith.train.accelerator import close_process_group
from draftsmith.train.batches import make_batches, scored_tokens, split_heldout
from draftsmith.train.checkpoints import TrainState
from draftsmith.train.config import LoraKeys, TrainConfig, option, parse_config
from draftsmith.train.distill_rows import collate_distill, load_distill_rows
from draftsmith.train.estimate import LAYER_FACTOR, MemoryModel, Shape, StepSizes
from draftsmith.train.loop import Recipe, StepOutput, TrainResult, start_run
from draftsmith.train.on_policy import draft_sampled_batch, is_on_policy, seed_from
from draftsmith.train.sharding import FSDP2, load_run_target, run_plan, whole_module
from draftsmith.train.tracking import AcceptanceEval, PeriodicEval, share_batches

FRESH_PREFIX = "fresh:"
TRUNCATE_PREFIX = "truncate:"


@dataclass
class DistillConfig(LoraKeys, TrainConfig):
    """Knowledge distillation of a draft LM from the frozen target (train/distill.py)."""

    draft: str = option(
        "truncate:6", "the draft: truncate:N (a trainable copy of the target's first N layers), "
        "fresh:L (a new L-layer model of the target's architecture), or a Hugging Face model "
        "directory or hub id (from the local cache) with the target's tokenizer")
    draft_vocab_size: int | None = option(
        None, "the draft's vocabulary: its LM head keeps the N most frequent answer tokens of the "
        "training data and gives every other token probability 0 (logit -inf), so a draft token "
        "costs N rows instead of the target's whole vocabulary; draftsmith's engine runs it, "
        "Hugging Face / vLLM / llama.cpp do not (none: the target's vocabulary)")
    draft_hidden_size: int | None = option(
        None, "fresh:L only: the new model's hidden size (none: the target's; the embedding and "
        "LM head then start as copies of the target's)")
    freeze_embedding: bool = option(
        False, "keep the draft's input embedding the target's, frozen: the draft learns its layers "
        "and LM head only, and its directory leaves the embedding out (the loader takes it from "
        "the target, whose weights digest the directory records); on SmolLM2 that is 28 M of a "
        "2-layer draft's 31 M parameters. Needs draft_vocab_size (the LM head its own) and the "
        "target's width (truncate:N, or fresh:L without draft_hidden_size)")
    divergence: Literal["forward_kl", "reverse_kl", "jsd", "tvd"] = option(
        "jsd", "forward_kl = KL(target||draft), reverse_kl = KL(draft||target), jsd (generalised, "
        "with beta), tvd (1 - tvd is the acceptance rate)")
    beta: float = option(0.5, "jsd mixture weight of the target: 0 = forward_kl, 1 = reverse_kl")
    temperature: float = option(
        1.0, "both distributions are softmax(logits / temperature) in the loss and the held-out "
        "1 - TVD")

    on_policy_ratio: float = option(
        0.5, "fraction of micro-batches trained on the draft's own samples (0..1), drawn per "
        "micro-batch from the seed; rows without a response are always sampled")
    on_policy_max_new_tokens: int = option(
        128, "longest continuation the draft samples (also the target's answers to prompt-only "
        "held-out rows)")
    on_policy_temperature: float = option(
        1.0, "the draft's sampling temperature for on-policy continuations (0: greedy)")

    lora: bool = option(False, "train LoRA adapters (peft) instead of every weight; merged at "
                        "export")

    heldout_fraction: float = option(
        0.01, "fraction of the training rows held out (excluded from training) for the 1 - TVD "
        "estimate; 0 with no heldout_data: no held-out estimate")
    heldout_data: list[str] = option(
        [], "held-out rows from these files instead of a fraction of the training data")
    heldout_max_rows: int = option(64, "at most this many held-out rows")
    heldout_every: int = option(
        100, "estimate 1 - TVD on the held-out rows every N optimizer steps, at the start and "
        "at the end (0: never)", may_change_on_resume=True)

    draft_depth: int = option(6, "evaluation (and the artifact's default drafting, draftsmith.eval.draft): "
                              "most draft tokens per round",
                              may_change_on_resume=True)
    draft_min_confidence: float = option(
        0.0, "evaluation: stop a chain after a token the draft gives less than this",
        may_change_on_resume=True)
    draft_branching: list[int] = option(
        [], "evaluation: children per depth for a token tree (empty: a chain)",
        may_change_on_resume=True)
    draft_children: Literal["topk", "sample"] = option(
        "topk", "evaluation tree children: the draft's top-k, or i.i.d. samples",
        may_change_on_resume=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_parallel > 1 and self.draft.startswith("truncate:"):
            raise ValueError(f"draft {self.draft!r} copies the target's first layers, which "
                             f"target_parallel {self.target_parallel} splits over processes; "
                             f"give a draft directory, or fresh:N")
        kind, count = draft_kind(self.draft)
        if kind == "directory" and not Path(self.draft).expanduser().is_dir() \
                and not is_hub_id(self.draft):
            raise ValueError(
                f"config key 'draft' is {self.draft!r}: expected truncate:N (N target layers), "
                f"fresh:L (a new model of L layers), an existing model directory or a hub id")
        if self.draft_hidden_size is not None and kind != "fresh":
            raise ValueError(f"config key 'draft_hidden_size' applies to fresh:L drafts only, "
                             f"the draft is {self.draft!r}; remove it or use fresh:L")
        if self.draft_hidden_size is not None and self.draft_hidden_size < 1:
            raise ValueError(f"config key 'draft_hidden_size' must be >= 1, got "
                             f"{self.draft_hidden_size}")
        if self.freeze_embedding and (self.draft_vocab_size is None
                                      or self.draft_hidden_size is not None
                                      or kind == "directory" or self.lora):
            raise ValueError(
                "freeze_embedding: true keeps the target's input embedding in a draft of the "
                "target's width with its own LM head: it needs draft_vocab_size, a truncate:N or "
                "fresh:L draft without draft_hidden_size, and lora: false; got "
                f"draft {self.draft!r}, draft_vocab_size {self.draft_vocab_size}, "
                f"draft_hidden_size {self.draft_hidden_size}, lora {self.lora}")
        if self.lora and kind == "fresh":
            raise ValueError("lora: true with a fresh:L draft would train adapters on random "
                             "weights; train a fresh draft fully (lora: false), or give "
                             "truncate:N or a pretrained directory")
        for key, low, high in (("beta", 0.0, 1.0), ("on_policy_ratio", 0.0, 1.0)):
            value = getattr(self, key)
            if not low <= value <= high:
                raise ValueError(f"config key {key!r} must be in [{low}, {high}], got {value}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"config key 'heldout_fraction' must be in [0, 1), got "
                             f"{self.heldout_fraction}")
        if self.heldout_data and self.heldout_fraction > 0:
            raise ValueError("config keys 'heldout_data' and 'heldout_fraction' both set: hold out "
                             "either given files (heldout_fraction 0) or a fraction of the "
                             "training rows (heldout_data empty)")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"config key 'temperature' must be > 0, got {self.temperature}")
        if not (math.isfinite(self.on_policy_temperature) and self.on_policy_temperature >= 0):
            raise ValueError(f"config key 'on_policy_temperature' must be >= 0, got "
                             f"{self.on_policy_temperature}")
        if not self.lora_target_modules:
            raise ValueError("config key 'lora_target_modules' is empty: give all-linear or "
                             "module names such as q_proj,v_proj")
        at_least = {"on_policy_max_new_tokens": 1, "heldout_max_rows": 1,
                    "heldout_every": 0, "draft_depth": 1}
        for key, low in at_least.items():
            value = getattr(self, key)
            if value is not None and value < low:
                raise ValueError(f"config key {key!r} must be >= {low}, got {value}")
        if any(k < 1 for k in self.draft_branching):
            raise ValueError(f"config key 'draft_branching' needs counts >= 1, got "
                             f"{self.draft_branching}")
        if self.divergence not in DIVERGENCES:  # DistillConfig(...) skips parse_config's check
            raise ValueError(f"config key 'divergence' must be one of {DIVERGENCES}")
        if self.draft_vocab_size is not None and (
                self.divergence == "forward_kl" or (self.divergence == "jsd" and self.beta == 0)):
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} with divergence "
                             f"{self.divergence!r} (beta {self.beta}): KL(target || draft) is "
                             f"infinite where the target gives probability to a token the draft "
                             f"cannot propose; use jsd with beta > 0, reverse_kl or tvd")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"config key 'draft_vocab_size' must be >= 1, got "
                             f"{self.draft_vocab_size}")


def draft_kind(spec: str) -> tuple[str, int | None]:
    """("truncate", N), ("fresh", L) or ("directory", None) for a ``draft`` value."""
    for kind, prefix in (("truncate", TRUNCATE_PREFIX), ("fresh", FRESH_PREFIX)):
        if spec.startswith(prefix):
            text = spec[len(prefix):]
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"config key 'draft' is {spec!r}: {prefix}N needs a layer count "
                                 f"N >= 1, e.g. {prefix}6")
            return kind, int(text)
    return "directory", None


# ------------------------------------------------------------------------------------------------
# The draft and the loss


def build_draft(cfg: DistillConfig, target: Target, kept: torch.Tensor | None = None) -> nn.Module:
    """The trainable draft: float32 master weights (autocast runs it in bf16 on GPU), a copy
    that shares nothing with the target, its LM head restricted to the target ids ``kept``
    (``draft_vocab_size``), wrapped in LoRA adapters when ``cfg.lora``."""
    kind, count = draft_kind(cfg.draft)
    if kind == "fresh":
        draft = fresh_draft(target, num_layers=count, hidden_size=cfg.draft_hidden_size,
                            seed=cfg.seed)
    else:
        # truncate:N -> an independent copy; a directory -> its vocabulary/tokenizer checked
        draft = load_draft(cfg.draft, target, trainable=True)
    draft = draft.float()
    if kept is not None:
        restrict_vocabulary(draft, kept)
    if cfg.freeze_embedding:  # the target's rows, never trained (and never written)
        embedding = draft.get_input_embeddings().weight
        with torch.no_grad():
            embedding.copy_(target.model.get_input_embeddings().weight)
        embedding.requires_grad_(False)
    if cfg.gradient_checkpointing:  # recompute the draft's layers in the backward pass
        draft.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora:
        modules = cfg.lora_target_modules
        draft = add_lora(draft, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                         target_modules="all-linear" if modules == ["all-linear"] else modules)
    return draft


def inference_model(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft wrapper (adapters active), else ``module``."""
    return hugging_face_model(module)


def distill_loss(model: nn.Module, target: Target, batch: dict, cfg: DistillConfig,
                 reduction: str = "mean", with_tvd: bool = False) -> ProjectedDivergence:
    """The divergence over the positions that predict loss-mask tokens, with the argmax
    agreement (and the TVD sum): from the two models' final hidden states, the logits formed a
    chunk at a time (heads/distill_projected.py), unless a sharded model or a wrapped LM head needs
    whole (n, vocab) logits."""
    projected = projects_from_states(model, target, cfg.target_parallel > 1)
    return distill_scores(model, target, batch, cfg, reduction=reduction, with_tvd=with_tvd,
                          projected=projected)


# ------------------------------------------------------------------------------------------------
# Held-out estimate of the acceptance rate


class HeldOutAcceptance(PeriodicEval):
    """Mean 1 - TVD (acceptance of exact speculative sampling at ``temperature``), argmax
    agreement and the training divergence of the draft against the target on held-out rows.

    Rows without a response are answered once, here, by the target itself (sampled at
    ``temperature``, seeded): acceptance is measured along text the target writes. Each process
    scores its share of the rows; the sums are reduced and the main process logs
    ``heldout/...`` records. Nothing random is drawn, so evaluations never change training.
    """

    name = "heldout"

    def __init__(self, accelerator: Accelerator, cfg: DistillConfig, target: Target,
                 rows: list[dict], pad_token_id: int):
        super().__init__(accelerator)
        self.cfg = cfg
        self.target = target
        self.every = cfg.heldout_every if rows else 0
        self.batches: list[dict] = []
        self.idle: list[bool] = []  # batches run only because a sharded forward needs everyone
        if not self.every:
            return
        plan = run_plan(cfg, accelerator)
        if plan.shards_target and not all(row["answered"] for row in rows):
            raise ValueError("held-out rows without an answer are answered by the target, one "
                             "generation per process, which a sharded target cannot do; answer "
                             "them first (python -m draftsmith.train.data regenerate) or set heldout_every: "
                             "0")
        size = cfg.per_device_batch_size
        for index, chosen in enumerate(share_batches(len(rows), accelerator, size, plan.any)):
            start = index * size  # the batch's first row within this process's share
            self.idle.append(not chosen)
            batch = collate_distill([rows[i] for i in chosen or [0]], pad_token_id)
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            # the target answers the prompt-only rows (on_policy True would answer them all)
            batch, _, _ = draft_sampled_batch(
                batch, target.model, False, max_new_tokens=cfg.on_policy_max_new_tokens,
                temperature=cfg.temperature, eos_token_ids=target.eos_token_ids,
                pad_token_id=pad_token_id, max_length=cfg.max_length,
                seed=seed_from(cfg.seed, 2, accelerator.process_index, start))
            self.batches.append({k: batch[k] for k in ("input_ids", "attention_mask",
                                                       "loss_mask")})

    def measure(self, module) -> torch.Tensor:
        # float64 sums: (1 - tvd), agreement, divergence, positions
        sums = torch.zeros(4, dtype=torch.float64, device=self.accelerator.device)
        for batch, idle in zip(self.batches, self.idle, strict=True):
            scores = distill_loss(module, self.target, batch, self.cfg, reduction="sum",
                                  with_tvd=True)
            if idle:
                continue
            n = scores.count
            sums += torch.stack([n - scores.rejected, scores.agree, scores.loss.double(),
                                 torch.tensor(float(n), dtype=torch.float64, device=sums.device)])
        return sums

    def summarise(self, state: TrainState, sums: list[float]) -> dict | None:
        accepted, agree, loss_sum, count = sums
        if not count:
            return None
        return {"step": state.step, "heldout/acceptance": accepted / count,
                "heldout/agreement": agree / count,
                f"heldout/{self.cfg.divergence}": loss_sum / count,
                "heldout/positions": int(count)}

    def describe(self, record: dict) -> str:
        return (f"held-out 1 - TVD {record['heldout/acceptance']:.4f}, argmax agreement "
                f"{record['heldout/agreement']:.4f} over {record['heldout/positions']} positions")


# ------------------------------------------------------------------------------------------------
# The run


def planned_sizes(rows: list[dict], cfg: DistillConfig) -> tuple[list[int], list[int]]:
    """(tokens a row may take, tokens its loss may score), known before any sampling.

    A row the draft may continue (any row when ``on_policy_ratio`` > 0; a prompt-only row always)
    is planned at its prompt plus ``on_policy_max_new_tokens``, so a token budget is never
    exceeded by a sampled continuation.
    """
    lengths, scored = [], []
    for row in rows:
        sampled_length = min(cfg.max_length, len(row["prompt_ids"]) + cfg.on_policy_max_new_tokens)
        may_sample = cfg.on_policy_ratio > 0 or not row["answered"]
        lengths.append(max(len(row["input_ids"]), sampled_length) if may_sample
                       else len(row["input_ids"]))
        scored.append(scored_tokens(row["loss_mask"]))
    return lengths, scored


def _draft_directory(cfg) -> str | None:
    """A draft given as a directory or hub id, whose config.json the estimate reads."""
    draft = cfg.draft
    return draft if draft and not draft.startswith(("truncate:", "fresh:")) else None


# ------------------------------------------------------------------------------------------------
# Memory: what one step adds to the estimate (train/estimate.py), checked before the target loads


def memory_parts(cfg, target: Shape, sizes: StepSizes) -> dict[str, float]:
    """The trained draft with AdamW (a frozen embedding apart), its activations with the float32
    residual stream of its float32 master weights, the target's forward, and the loss: chunks of
    both models' logits from their final states, or whole (n, vocab) logits where a sharded
    target or draft needs them (heads/distill_projected.py)."""
    n, act = sizes.tokens, sizes.act
    parts: dict[str, float] = {}
    d = sizes.draft or target
    layers = d.layers
    if sizes.draft is None and cfg.draft.split(":")[0] in ("truncate", "fresh"):
        layers = int(cfg.draft.split(":")[1])
    embedding = d.vocab * d.hidden
    head = (cfg.draft_vocab_size * d.hidden if cfg.draft_vocab_size
            else 0 if d.tied else d.vocab * d.hidden)
    whole = embedding + layers * d.layer_params() + d.hidden + head
    trained = whole - (embedding if cfg.freeze_embedding else 0)
    if cfg.lora:
        trained = layers * cfg.lora_r * 4 * (d.hidden + d.intermediate)
    if trained != whole:  # float32, like the trained weights (build_draft)
        parts["frozen draft weights (float32)"] = (whole - trained) * 4
    # per token: each layer's saved tensors, the residual stream and norms in float32 whatever
    # autocast computes in (the draft's master weights are float32)
    layer = LAYER_FACTOR * d.layer_saved_per_token() * act + 4 * d.hidden * (4 - act)
    kept = (layer + layers * 2 * d.hidden * 4) if cfg.gradient_checkpointing else layers * layer
    largest = (cfg.lora_r * max(d.hidden, d.intermediate) if cfg.lora else
               max(0 if cfg.freeze_embedding else embedding, head, d.hidden * d.intermediate))
    parts[f"trained draft ({trained / 1e6:.0f} M parameters, AdamW)"] = \
        sizes.optimizer(trained, largest)
    parts[f"draft activations ({layers} layers)"] = kept * n
    parts["target forward"] = sizes.target_forward + n * target.hidden * act
    # the loss holds the trained LM head's gradient, float32, for backward (heads/distill_projected.py)
    parts["loss's gradient buffers"] = (0 if cfg.lora else (
        cfg.draft_vocab_size or d.vocab) * d.hidden * 4) + n * d.hidden * 4
    chunk = min(cfg.loss_chunk_size, n)
    parts[f"loss chunk ({chunk} x {target.vocab})"] = \
        DISTILL_CHUNK_COPIES[cfg.divergence == "jsd"] * chunk * target.vocab * 4
    if cfg.target_parallel > 1 or sizes.trained_shards > 1:
        # whole logits at the scored positions: the target's (its dtype), the draft's (cast to
        # float32 by mixed precision's output wrapper) and the loss's float32 gradient buffer
        parts[f"whole logits ({n} x {target.vocab}, sharded models)"] = \
            n * target.vocab * (sizes.weight + 4 + 4)
    return parts


# float32 (chunk, vocab) tensors a chunk of the projected divergence holds at once (both logits
# and log-softmaxes, the kernel's terms, the gradient), measured with
# draftsmith.train.memory_probe.allocation_peak: 6.75 for forward_kl, reverse_kl and tvd; 8.5 for jsd
DISTILL_CHUNK_COPIES = {False: 7, True: 9}


MEMORY = MemoryModel(memory_parts, shrink_keys=(
    "max_tokens_per_batch (or per_device_batch_size), gradient_checkpointing: true, "
    "lora: true, a smaller draft, loss_chunk_size"), draft_spec=_draft_directory)


def build(cfg: DistillConfig) -> Recipe:
    """The run, ready to train: target, rows, the draft, its loss, evaluation and export."""
    accelerator = start_run(cfg, MEMORY)  # seeds first, then the memory check
    if run_plan(cfg, accelerator).trained == FSDP2 and cfg.on_policy_ratio > 0:
        raise ValueError(f"on_policy_ratio is {cfg.on_policy_ratio}, but the launch shards the "
                         f"draft with FSDP2: every forward of a sharded draft needs all "
                         f"processes, and each samples continuations of its own length; set "
                         f"on_policy_ratio: 0, or launch with DDP (configs/accelerate/"
                         f"multi_gpu.yaml)")
    target = load_run_target(cfg, accelerator)  # frozen; never prepared; maybe sharded
    pad_id = target.tokenizer.pad_token_id
    pad_id = target.eos_token_ids[0] if pad_id is None else pad_id

    with accelerator.main_process_first():  # data
        rows, summary = load_distill_rows(cfg.data, target, cfg.max_length,
                                          keep_prompt_only=cfg.on_policy_ratio > 0)
        if cfg.heldout_data:
            heldout_rows, heldout_summary = load_distill_rows(cfg.heldout_data, target,
                                                              cfg.max_length)
            heldout_rows = heldout_rows[: cfg.heldout_max_rows]
            summary += f"\nheld-out data ({len(heldout_rows)} rows used):\n{heldout_summary}"
        else:
            rows, heldout_rows = split_heldout(rows, cfg.heldout_fraction, cfg.heldout_max_rows,
                                               cfg.seed)
            heldout_rows = heldout_rows or []
            summary += (f"\nheld out {len(heldout_rows)} of them for the 1 - TVD estimate; "
                        f"{len(rows)} rows to train on")
    accelerator.print(summary)
    lengths, scored = planned_sizes(rows, cfg)

    def weight(micro_rows, micro_index: int) -> float:
        # a sampled row's loss is a sum over up to on_policy_max_new_tokens tokens
        on_policy = is_on_policy(cfg.seed, micro_index, cfg.on_policy_ratio)
        return float(sum(cfg.on_policy_max_new_tokens if on_policy or not rows[i]["answered"]
                         else scored[i] for i in micro_rows))

    batches = make_batches(rows, cfg, accelerator, partial(collate_distill, pad_token_id=pad_id),
                           lengths=lengths, weight_fn=weight)
    kept, first = None, None
    if cfg.draft_vocab_size is not None:  # a pure function of the training rows, as for heads
        answered = [r for r in rows if r["answered"]]
        d2t, _, coverage = draft_vocabulary([r["input_ids"].tolist() for r in answered],
                                            [r["loss_mask"].tolist() for r in answered],
                                            target.vocab_size, cfg.draft_vocab_size)
        kept = draft_token_ids(d2t)
        first = {"draft_vocab/size": cfg.draft_vocab_size, "draft_vocab/coverage": coverage}
        accelerator.print(f"[draftsmith] draft vocabulary: {cfg.draft_vocab_size} of "
                          f"{target.vocab_size} target tokens, covering {coverage:.2%} of the "
                          f"training rows' answer tokens")
    draft = build_draft(cfg, target, kept)  # model: the only trainable module

    def check_vocabulary(state, module) -> None:  # a resumed run's draft vocabulary
        if kept is not None:
            saved = inference_model(module).get_output_embeddings().kept
            check_same_vocabulary(maps_from_token_ids(saved, target.vocab_size),
                                  maps_from_token_ids(kept, target.vocab_size),
                                  state.resumed_from)
    sampling = {"max_new_tokens": cfg.on_policy_max_new_tokens,
                "temperature": cfg.on_policy_temperature, "eos_token_ids": target.eos_token_ids,
                "pad_token_id": pad_id, "max_length": cfg.max_length}

    def step(model, batch: dict, micro_index: int) -> StepOutput:
        on_policy = is_on_policy(cfg.seed, micro_index, cfg.on_policy_ratio)
        batch, sampled_rows, sampled_tokens = draft_sampled_batch(
            batch, accelerator.unwrap_model(model), on_policy,
            seed=seed_from(cfg.seed, 1, micro_index, accelerator.process_index), **sampling)
        scores = distill_loss(model, target, batch, cfg, reduction="sum")
        agree, n = scores.agree, scores.count
        return StepOutput(scores.loss, {"agreement": (agree, n),
                                        "on_policy": (float(on_policy), 1),
                                        "sampled_tokens": (sampled_tokens, sampled_rows)})

    acceptance = AcceptanceEval(
        accelerator, cfg, target,
        lambda module: DraftModelProposer(inference_model(module), **proposal(cfg)))
    heldout = HeldOutAcceptance(accelerator, cfg, target, heldout_rows, pad_id)
    return Recipe(cfg, accelerator, target, batches, draft, step,
                  export=partial(export, cfg, accelerator, target, kept),
                  evaluators=[heldout, acceptance], first_record=first,
                  on_resume=check_vocabulary,
                  target_forward=partial(teacher_states if projects_from_states(
                      draft, target, cfg.target_parallel > 1) else teacher_logits, target))


def export(cfg: DistillConfig, accelerator, target: Target, kept: torch.Tensor | None,
           result: TrainResult) -> dict:
    """The merged plain model, written by the main process after a completed run; returns step,
    stop message, artifact path, target, draft."""
    accelerator.wait_for_everyone()
    module = accelerator.unwrap_model(result.model)
    if result.completed:  # FSDP2: the draft gathered whole on the main process
        module = whole_module(module, lambda: build_draft(cfg, target, kept)) or module
    artifact = None
    if accelerator.is_main_process and result.completed:
        plain = merge_lora(module) if cfg.lora else module
        plain.eval()
        artifact = save_draft(plain, target.tokenizer, Path(cfg.output_dir) / "artifact",
                              target.identity(), overwrite=bool(cfg.overwrite),
                              embedding_from_target=cfg.freeze_embedding, extra={
                                  "trainer": "train/distill.py", "draft": cfg.draft,
                                  "divergence": cfg.divergence, "beta": cfg.beta,
                                  "temperature": cfg.temperature,
                                  "on_policy_ratio": cfg.on_policy_ratio, "lora": cfg.lora,
                                  "steps": result.state.step, PROPOSAL_KEY: proposal(cfg)})
        module = plain
        measure = shell_command("python", "-m", "draftsmith.eval.bench", "--target", cfg.target, "--method",
                                "plain", "--method", f"draft:{artifact}", "--prompts",
                                cfg.eval_prompts)
        accelerator.print(f"[draftsmith] draft written to {artifact}; measure it with {measure}")
    accelerator.wait_for_everyone()
    result.metrics.close()
    close_process_group(accelerator)
    return {"step": result.state.step, "stopped": result.stopped, "artifact": artifact,
            "target": target, "draft": module}


def proposal(cfg: DistillConfig) -> dict:
    """How the run's evaluation drafts, recorded in the artifact as its default drafting."""
    return {"max_depth": cfg.draft_depth, "min_confidence": cfg.draft_min_confidence,
            "branching": cfg.draft_branching or None, "children": cfg.draft_children}


def main(cfg: DistillConfig) -> dict:
    """Train, checkpoint and export (see :func:`export` for what it returns)."""
    recipe = build(cfg)
    return recipe.export(recipe.train())


if __name__ == "__main__":
    raise SystemExit(run_command(lambda: main(parse_config(DistillConfig)), "train/distill.py"))
