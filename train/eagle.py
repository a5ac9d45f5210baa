"""EAGLE trainer: one decoder layer learns to autoregress in the frozen target's feature space.

    accelerate launch train/eagle.py --config configs/eagle/smollm2-135m.yaml          # EAGLE-3
    accelerate launch train/eagle.py --config configs/eagle/smollm2-135m-eagle1.yaml   # EAGLE-1
    python train/eagle.py --config configs/eagle/tiny.yaml                             # one process
    torchrun --nproc_per_node 2 train/eagle.py --config ...                            # two CPU procs

EAGLE-1 (``version: 1``) reads the target's final-normed hidden state and regresses the next one
(SmoothL1) plus ``ce_weight`` x the cross-entropy against the target's next-token distribution,
with uniform noise of amplitude ``feature_noise`` on its input features. EAGLE-3 (``version: 3``)
fuses three hidden states of the target (low, mid, high: ``aux_layer_ids``), predicts over a
reduced draft vocabulary (the ``draft_vocab_size`` most frequent assistant tokens of the training
data) and is trained by training-time test: ``ttt_steps`` unrolled steps on its own features, step
i weighted ``ttt_decay``^i. The losses and the head live in ``heads/eagle.py``; this script only
feeds them.

Features come from the frozen target in one of two ways (``feature_mode``), giving the same batches:

* ``online``: the target runs on every batch inside the step (no disk, the target's cost every
  epoch);
* ``offline``: the target runs once over the data before training and its hidden states are read
  back from a cache (``feature_cache_dir``, default ``<output_dir>/features``); this pays off over
  several epochs. Every process writes its share of the cache; a finished cache is reused, and a
  run from it (with ``eval_every 0``) loads only the target's embedding, final norm and LM head.
  Disk for EAGLE-3 on smollm2-135m in bf16: 3.5 KB per token plus 1.2 KB per scored token (see
  ``train/features.py``).

``packing: true`` lays each micro-batch's rows end to end in one row (positions restarting at
each row; the target and the head attend within it): no padding, the same loss. The test-time
attention runs in flex attention on a GPU and in the fused SDPA kernel on a CPU (``attention``,
heads/ttt_attention.py). A target too large for one GPU is sharded over ``target_parallel``
processes and the head may be trained under FSDP2 (``accelerate launch --config_file
configs/accelerate/fsdp2.yaml``; train/sharding.py).

Training data is what ``draftsmith.train.rows.load_sft_dataset`` reads. EAGLE recommends answers the target
wrote itself; write them first with ``python -m draftsmith.train.data regenerate`` (see the configs). The
draft vocabulary (``d2t``/``t2d``) is computed from the data's assistant tokens the same way on
every process, saved with the head in every checkpoint and checked again on resume.

Logged to ``<output_dir>/metrics.jsonl`` (and W&B with ``report_to: wandb``): ``loss``, ``lr``,
``tokens_per_s`` (every token the target and head processed), ``peak_memory_gb``; EAGLE-1
``feature_loss``, ``ce_loss``, ``acc_0``; EAGLE-3 ``ce_loss_<i>`` and ``acc_<i>`` (top-1 agreement
with the target at training-time-test step i); at step 0 the data report (``data/...``) and the
draft vocabulary's coverage of the assistant tokens; every ``eval_every`` steps ``eval/tau`` and
``eval/alpha`` measured by the speculative engine with the head's EAGLE-2 tree on held-out prompts
(``eval_prompts``, MT-bench by default, never trained on).

At the end ``<output_dir>/artifact`` holds the head (``draftsmith export`` turns it into the
vLLM, SGLang and speculators layouts; ``python -m draftsmith.eval.bench --method eagle:<artifact>``
measures it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from draftsmith.eval.eagle import DEFAULT_DEPTH, DEFAULT_TOPK, DEFAULT_TREE_NODES, EagleProposer
from draftsmith.files.command_line import run_command
from draftsmith.heads import draft_vocab
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle_config import (
    DEFAULT_CE_WEIGHT,
    DEFAULT_STEP_DECAY,
    DEFAULT_TTT_STEPS,
    EagleConfig,
)
from draftsmith.heads.eagle_loss import EagleLoss
from draftsmith.heads.ttt_attention import resolve_backend
from draftsmith.targets.features import target_features
from draftsmith.targets.target import Target
from draftsmith.train.batches import make_batches, row_sizes
from draftsmith.train.config import FeatureKeys, PackingKeys, TrainConfig, option, parse_config
from draftsmith.train.estimate import (
    EAGLE_FACTOR,
    EAGLE_STEP_OVERHEAD,
    MemoryModel,
    Shape,
    StepSizes,
)
from draftsmith.train.features import feature_rows, load_feature_target, target_layer_weights
from draftsmith.train.loop import Recipe, StepOutput, TrainResult, start_run, write_run_artifact
from draftsmith.train.rows import load_sft_dataset
from draftsmith.train.tracking import AcceptanceEval


@dataclass
class EagleTrainConfig(FeatureKeys, PackingKeys, TrainConfig):
    """Train an EAGLE-1 or EAGLE-3 head on a frozen target (train/eagle.py)."""

    version: Literal[1, 3] = option(
        3, "3: EAGLE-3 (fused low/mid/high features, training-time test, reduced draft "
        "vocabulary); 1: EAGLE-1 (last-layer feature regression)")
    aux_layer_ids: list[int] | None = option(
        None, "EAGLE-3: the three target hidden-state indices the head fuses (index i = input of "
        "decoder layer i, vLLM's convention), ascending in 1..L-1 (none: 2, L//2, L-3)")
    draft_vocab_size: int | None = option(
        None, "EAGLE-3: size of the draft vocabulary, the most frequent assistant tokens of the "
        "training data (none: the target's whole vocabulary)")
    ttt_steps: int = option(DEFAULT_TTT_STEPS, "EAGLE-3: training-time-test steps unrolled")
    ttt_decay: float = option(DEFAULT_STEP_DECAY, "EAGLE-3: loss weight of step i is decay^i")
    feature_noise: float | None = option(
        None, "amplitude of uniform noise on the input features while training (none: the "
        "recipe's own, 0.2 for EAGLE-1 as in the paper, 0 for EAGLE-3)")
    ce_weight: float = option(
        DEFAULT_CE_WEIGHT, "EAGLE-1: weight of the cross-entropy against the target's "
        "distribution next to the feature regression")
    init_layer: int | None = option(
        None, "EAGLE-3: start the head as the target's decoder layer of this index applied to "
        "its input, one of aux_layer_ids (fc passing that feature through, the embedding half "
        "of q/k/v zero), instead of a random start (none)")
    attention: Literal["auto", "flex", "sdpa"] = option(
        "auto", "test-time attention kernel: flex (flex attention with a block mask, compiled; "
        "GPU only: torch has no flex backward on a CPU), sdpa (fused scaled_dot_product_attention "
        "with the diagonal as extra keys), auto (flex on a GPU, sdpa on a CPU)",
        may_change_on_resume=True)
    tree_depth: int = option(DEFAULT_DEPTH, "evaluation: EAGLE-2 tree depth",
                             may_change_on_resume=True)
    tree_topk: int = option(DEFAULT_TOPK, "evaluation: children per expanded tree node",
                            may_change_on_resume=True)
    tree_nodes: int = option(DEFAULT_TREE_NODES, "evaluation: draft tokens per tree",
                             may_change_on_resume=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.version == 1:
            only_eagle3 = {"aux_layer_ids": (self.aux_layer_ids, None),
                           "draft_vocab_size": (self.draft_vocab_size, None),
                           "ttt_steps": (self.ttt_steps, DEFAULT_TTT_STEPS),
                           "ttt_decay": (self.ttt_decay, DEFAULT_STEP_DECAY),
                           "init_layer": (self.init_layer, None)}
            for key, (value, default) in only_eagle3.items():
                if value != default:
                    raise ValueError(f"config key {key!r} applies to EAGLE-3 only, but version "
                                     f"is 1 and {key} is {value!r}; remove it or set version: 3")
        elif self.ce_weight != DEFAULT_CE_WEIGHT:
            raise ValueError(f"config key 'ce_weight' applies to EAGLE-1 only (EAGLE-3 is trained "
                             f"on the cross-entropy alone), got {self.ce_weight}; remove it or "
                             f"set version: 1")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"config key 'aux_layer_ids' needs three hidden-state indices (low, "
                             f"mid, high), got {self.aux_layer_ids}")
        at_least = {"draft_vocab_size": 1, "ttt_steps": 1, "tree_depth": 1, "tree_topk": 1,
                    "tree_nodes": 1}
        for key, low in at_least.items():
            value = getattr(self, key)
            if value is not None and value < low:
                raise ValueError(f"config key {key!r} must be >= {low}, got {value}")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"config key 'ttt_decay' must be in (0, 1], got {self.ttt_decay}")
        for key in ("feature_noise", "ce_weight"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ValueError(f"config key {key!r} must be >= 0, got {value}")
        if self.feature_cache_dir is not None and self.feature_mode != "offline":
            raise ValueError(f"config key 'feature_cache_dir' is set ({self.feature_cache_dir!r}) "
                             f"but feature_mode is {self.feature_mode!r}; set feature_mode: "
                             f"offline to train from the cache, or remove feature_cache_dir")


# ------------------------------------------------------------------------------------------------
# The head and its draft vocabulary


def head_config(cfg: EagleTrainConfig, target: Target) -> EagleConfig:
    """The head's shapes: one layer shaped like the target's, reading the configured features."""
    return EagleConfig.from_target(target, cfg.version, draft_vocab_size=cfg.draft_vocab_size,
                                   aux_layer_ids=cfg.aux_layer_ids)


def draft_vocabulary(dataset, config: EagleConfig) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(d2t, t2d, coverage): the draft vocabulary of the training data's assistant tokens
    (:func:`draftsmith.heads.draft_vocab.draft_vocabulary`; ``coverage`` is the fraction of assistant tokens
    whose target id has a draft id)."""
    return draft_vocab.draft_vocabulary(dataset["input_ids"], dataset["loss_mask"],
                                        config.vocab_size, config.draft_vocab_size)


def check_resumed_vocabulary(head: EagleHead, d2t: torch.Tensor, t2d: torch.Tensor,
                             resumed_from) -> None:
    """The checkpoint's maps (loaded into the head) must be the ones this run's data gives."""
    if head.version != 3 or resumed_from is None:
        return
    draft_vocab.check_same_vocabulary((head.d2t, head.t2d), (d2t, t2d), resumed_from)


def check_attention(setting: str, device) -> str:
    """The test-time attention kernel of a run on ``device``; flex is refused on a CPU."""
    kernel = resolve_backend(setting, device)
    if kernel == "flex" and device.type == "cpu":
        raise ValueError("config key 'attention' is flex, but torch has no flex-attention "
                         "backward on a CPU; set attention: sdpa (or auto) to train here")
    return kernel


# ------------------------------------------------------------------------------------------------
# Memory: what one step adds to the estimate (train/estimate.py), checked before the target loads


def memory_parts(cfg, target: Shape, sizes: StepSizes) -> dict[str, float]:
    """The trained module with AdamW, its activations, the target's forward and the loss chunk."""
    n, act, h = sizes.tokens, sizes.act, target.hidden
    parts: dict[str, float] = {}
    version = cfg.version
    draft_vocab = (cfg.draft_vocab_size or target.vocab) if version == 3 else target.vocab
    layer_in = 2 * h
    trained = target.layer_params(layer_in) + (3 if version == 3 else 2) * h * h
    if version == 3:  # the fused features' norm and the final norm
        trained += 2 * h
    if version == 3:
        trained += draft_vocab * h
    steps = cfg.ttt_steps if version == 3 else 1
    # plus what a step keeps per position whatever the width (indices, rotary tables, the
    # loss's gathered rows): the tests' width (hidden 128) measured it
    per_step = (EAGLE_FACTOR * (target.layer_saved_per_token(layer_in) + 6 * h)
                + EAGLE_STEP_OVERHEAD) * act
    if cfg.gradient_checkpointing:  # each step keeps its input; one step is rebuilt at a time
        kept = per_step + steps * 6 * h * act
    else:
        kept = steps * per_step
    features = (4 if version == 3 else 2) * h * act  # the hidden states the head reads
    largest = max(draft_vocab * h if version == 3 else 0, (3 if version == 3 else 2) * h * h,
                  h * target.intermediate)
    parts[f"trained head ({trained / 1e6:.0f} M parameters, AdamW)"] = \
        sizes.optimizer(trained, largest)
    parts[f"head activations ({steps} test-time step{'s' if steps > 1 else ''})"] = \
        kept * n
    # the attention's own inputs and output, kept for its backward: flex lays every earlier
    # step's keys and values beside step i's (1 + 2 + ... + steps copies); the SDPA kernel keeps
    # each step's widened queries and output, the step-0 keys and values with the diagonal sinks
    # and the diagonal's combination, plus a (n, n + i) bool mask per step for packed rows (their
    # documents told apart) and three more while the next one is built
    if resolve_backend(cfg.attention, torch.device(sizes.device)) == "flex":
        kernel, attention = "flex", 2 * target.kv_dim * act * steps * (steps + 1) / 2
    else:
        kernel = "sdpa"
        attention = (3 * target.q_dim + 2 * target.kv_dim) * act * steps
        if cfg.packing:
            attention += (steps + 3) * n  # bytes per token of the masks
    parts[f"test-time attention activations ({kernel})"] = attention * n
    parts["target forward and features"] = sizes.target_forward + features * n
    # the loss's gradients, formed in its forward and held for backward: the states' and (EAGLE-3)
    # its own head's, (draft vocabulary, h) float32 (heads/chunked_loss.py)
    parts["loss's gradient buffers"] = (steps * n * h + (draft_vocab * h if version == 3
                                                          else 0)) * 4
    parts[f"loss chunk ({min(cfg.loss_chunk_size, n)} x {draft_vocab})"] = \
        sizes.loss_chunk(cfg, draft_vocab, teacher=target.vocab,
                         columns=version == 3 and bool(cfg.draft_vocab_size))
    return parts


MEMORY = MemoryModel(memory_parts, shrink_keys=(
    "max_tokens_per_batch (or per_device_batch_size), gradient_checkpointing: true, "
    "draft_vocab_size (EAGLE-3), loss_chunk_size, ttt_steps"))


def build(cfg: EagleTrainConfig) -> Recipe:
    """The run, ready to train: target, data, head, loss, evaluation and export."""
    accelerator = start_run(cfg, MEMORY)  # seeds first, then the memory check
    target = load_feature_target(cfg, accelerator)  # frozen; never prepared
    pad_id = target.tokenizer.pad_token_id
    pad_id = target.eos_token_ids[0] if pad_id is None else pad_id

    with accelerator.main_process_first():  # data
        dataset, report = load_sft_dataset(cfg.data, target.tokenizer, cfg.max_length)
    accelerator.print(report.summary())
    config = head_config(cfg, target)
    d2t, t2d, coverage = draft_vocabulary(dataset, config)
    if config.version == 3:
        accelerator.print(f"[draftsmith] draft vocabulary: {config.draft_vocab_size} of "
                          f"{config.vocab_size} target tokens, covering {coverage:.2%} of the "
                          f"training data's assistant tokens")
    rows, collate = feature_rows(cfg, accelerator, target, dataset, config, pad_id)
    lengths, scored = row_sizes(dataset)
    batches = make_batches(rows, cfg, accelerator, collate, lengths=lengths, weights=scored)

    # model: fp32 master weights (accelerate's autocast runs them in bf16 where configured); the
    # loss wraps the head so that the whole training-time test is one DDP forward
    head = EagleHead(config, target, d2t=d2t, t2d=t2d, dtype=torch.float32)
    if cfg.init_layer is not None:  # a resumed run loads its checkpoint's weights over these
        head.start_as_target_layer(
            target_layer_weights(target, cfg.init_layer, EagleHead.LAYER_WEIGHTS), cfg.init_layer)
    maps = (d2t.clone(), t2d.clone())  # the head's buffers may share them; a resume overwrites
    model = EagleLoss(head, steps=cfg.ttt_steps, decay=cfg.ttt_decay,
                      feature_noise=cfg.feature_noise, ce_weight=cfg.ce_weight,
                      chunk_size=cfg.loss_chunk_size,
                      gradient_checkpointing=cfg.gradient_checkpointing,
                      attention=check_attention(cfg.attention, accelerator.device))

    def target_forward(batch: dict) -> dict:  # (B, S, F) features and (B, S, h) last hidden
        return target_features(target, batch["input_ids"], batch["attention_mask"], config,
                               position_ids=batch.get("position_ids"))

    def step(model, batch: dict, micro_index: int) -> StepOutput:
        if cfg.feature_mode == "online":
            batch.update(target_forward(batch))
        loss, parts = model(batch, reduction="sum")
        tokens = parts.pop("tokens")  # predicted positions of this micro-batch (step 0)
        logged = {}
        for name, value in parts.items():
            if name == "loss":
                continue  # the loop logs the loss itself, per token over the whole step
            # a fraction of tokens is weighted by them; other parts are means per micro-batch
            logged[name] = (value * tokens, tokens) if name.startswith("acc_") else (value, 1)
        return StepOutput(loss, logged)

    def check_vocabulary(state, module) -> None:
        check_resumed_vocabulary(module.head, *maps, state.resumed_from)

    first = {**{f"data/{k}": v for k, v in report.totals().items()},
             "data/sequences": len(dataset)}
    if config.version == 3:
        first.update({"draft_vocab/size": config.draft_vocab_size,
                      "draft_vocab/coverage": coverage})
    acceptance = AcceptanceEval(
        accelerator, cfg, target,
        lambda module: EagleProposer(module.head, depth=cfg.tree_depth, topk=cfg.tree_topk,
                                     tree_nodes=cfg.tree_nodes))
    return Recipe(cfg, accelerator, target, batches, model, step,
                  export=partial(export, cfg, accelerator, target, config, report),
                  evaluators=[acceptance], first_record=first, on_resume=check_vocabulary,
                  target_forward=target_forward if cfg.feature_mode == "online" else None)


def export(cfg: EagleTrainConfig, accelerator, target: Target, config: EagleConfig, report,
           result: TrainResult) -> dict:
    """The artifact, written by the main process after a completed run; returns step, stop
    message, artifact path, data report, target and the trained head (unwrapped)."""
    artifact, head = write_run_artifact(cfg, accelerator, result, method=config.method,
                                        config=config.to_dict(), target=target, module="head",
                                        formats="sglang, speculators, gguf", bench_prefix="eagle")
    return {"step": result.state.step, "stopped": result.stopped, "artifact": artifact,
            "report": report, "target": target, "head": head}


def main(cfg: EagleTrainConfig) -> dict:
    """Train, checkpoint and export; returns step, stop message, artifact path, data report,
    target and the trained head (unwrapped)."""
    recipe = build(cfg)
    return recipe.export(recipe.train())


if __name__ == "__main__":
    raise SystemExit(run_command(lambda: main(parse_config(EagleTrainConfig)), "train/eagle.py"))
