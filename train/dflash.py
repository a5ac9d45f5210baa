"""Block-draft trainer: a DFlash (or DSpark) draft learns to propose whole blocks from the frozen
target's hidden states.

    accelerate launch train/dflash.py --config configs/dflash/smollm2-135m.yaml
    python train/dflash.py --config configs/dflash/tiny.yaml                     # one process
    torchrun --nproc_per_node 2 train/dflash.py --config ...                     # two CPU procs

Every micro-batch runs the frozen target once (no gradient) for the hidden states at
``target_layer_ids`` and its last hidden state, draws ``anchors`` block starts per row (positions
whose next token the loss scores, from a generator seeded by the run's seed and the micro-batch's
index, so a resumed run draws the same), and scores every block in one forward of the draft
(heads/dflash_loss.py: the true token of each slot, optionally the target's distribution there,
weighted by exp(-(k - 1) / gamma); DSpark's Markov head teacher-forced and its confidence head
against 1 - TV). A row's weight in the step's mean is its number of blocks times the sum of the
position weights, known before the anchors are drawn.

Logged: ``loss``, ``acc_<k>`` (top-1 of the k-th predicted slot), ``conf_loss`` (DSpark),
``eval/tau`` and ``eval/alpha`` every ``eval_every`` steps from the engine decoding held-out
prompts with the draft. At the end ``<output_dir>/artifact`` holds the draft (``draftsmith
export ARTIFACT --format vllm|sglang|speculators|gguf``; ``python -m draftsmith.eval.bench --method
dflash:<artifact>``).
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

from draftsmith.eval.dflash import BlockProposer
from draftsmith.files.command_line import run_command
from draftsmith.heads import draft_vocab
from draftsmith.heads.dflash import DEFAULT_BLOCK_SIZE, DEFAULT_LAYERS, DFlashConfig, DFlashDraft
from draftsmith.heads.dflash_loss import (
    DEFAULT_ANCHORS,
    DEFAULT_CONF_WEIGHT,
    DEFAULT_GAMMA,
    DFlashLoss,
    anchor_candidates,
    sample_anchors,
)
from draftsmith.targets.features import FeatureSpec
from draftsmith.targets.target import Target
from draftsmith.train.batches import make_batches, row_sizes
from draftsmith.train.config import FeatureKeys, TrainConfig, option, parse_config
from draftsmith.train.estimate import LAYER_FACTOR, MemoryModel, Shape, StepSizes
from draftsmith.train.features import feature_rows, load_feature_target
from draftsmith.train.loop import Recipe, StepOutput, TrainResult, start_run, write_run_artifact
from draftsmith.train.rows import load_sft_dataset
from draftsmith.train.tracking import AcceptanceEval


@dataclass
class DFlashTrainConfig(FeatureKeys, TrainConfig):
    """Train a DFlash or DSpark block draft on a frozen target (train/dflash.py)."""

    method: Literal["dflash", "dspark"] = option(
        "dflash", "dflash: slots 1..B-1 predict in place (z-lab); dspark: slots 0..B-1 shifted, "
        "with a Markov head and a confidence head")
    num_layers: int = option(DEFAULT_LAYERS, "the draft's decoder layers")
    block_size: int = option(DEFAULT_BLOCK_SIZE, "B: tokens per block (the anchor and B-1 masks)")
    target_layer_ids: list[int] | None = option(
        None, "target layers the draft reads (id k = the output of decoder layer k, z-lab's "
        "count), ascending in 0..L-2 (none: z-lab's spread from 1 to L-3)")
    mask_token_id: int | None = option(
        None, "the block's mask token (none: the tokenizer's mask or unknown token, else its "
        "highest special id that is not BOS/EOS/padding)")
    draft_vocab_size: int | None = option(
        None, "size of the draft vocabulary, the most frequent assistant tokens of the training "
        "data, with an LM head of its own (none: the target's LM head, shared and frozen)")
    markov_rank: int | None = option(None, "dspark: the Markov head's rank (none: 64)")
    confidence_head: bool = option(True, "dspark: train a confidence head too")
    anchors: int = option(DEFAULT_ANCHORS, "blocks drawn per row and micro-batch")
    gamma: float = option(DEFAULT_GAMMA, "position decay: slot k's weight is exp(-(k-1)/gamma)")
    hard_weight: float = option(1.0, "weight of the cross-entropy on the true tokens")
    soft_weight: float = option(
        0.0, "weight of the cross-entropy on the target's distribution at each slot")
    conf_weight: float = option(DEFAULT_CONF_WEIGHT, "dspark: weight of the confidence loss")
    eval_block_size: int | None = option(
        None, "evaluation: draft tokens per round (none: the whole block)",
        may_change_on_resume=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, low in {"num_layers": 1, "block_size": 2, "anchors": 1, "draft_vocab_size": 1,
                         "markov_rank": 1, "eval_block_size": 1}.items():
            value = getattr(self, key)
            if value is not None and value < low:
                raise ValueError(f"config key {key!r} must be >= {low}, got {value}")
        if self.gamma <= 0:
            raise ValueError(f"config key 'gamma' must be > 0, got {self.gamma}")
        if self.hard_weight < 0 or self.soft_weight < 0 or self.hard_weight + self.soft_weight == 0:
            raise ValueError("config keys 'hard_weight' and 'soft_weight' must be >= 0 and not "
                             f"both 0, got {self.hard_weight} and {self.soft_weight}")
        if self.method == "dflash" and self.markov_rank is not None:
            raise ValueError("config key 'markov_rank' applies to method dspark only")
        if self.feature_cache_dir is not None and self.feature_mode != "offline":
            raise ValueError(f"config key 'feature_cache_dir' is set ({self.feature_cache_dir!r}) "
                             f"but feature_mode is {self.feature_mode!r}; set feature_mode: "
                             f"offline to train from the cache, or remove feature_cache_dir")


def draft_config(cfg: DFlashTrainConfig, target: Target) -> DFlashConfig:
    return DFlashConfig.from_target(
        target, cfg.method, num_layers=cfg.num_layers, block_size=cfg.block_size,
        target_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id,
        draft_vocab_size=cfg.draft_vocab_size, markov_rank=cfg.markov_rank,
        confidence_head=cfg.confidence_head)


def row_weights(dataset, anchors: int, weights: list[float]) -> list[float]:
    """Each row's blocks times the position weights' sum (the step's normalisation)."""
    total = sum(weights)
    out = []
    for part in dataset.select_columns(["loss_mask"]).iter(batch_size=1024):
        for mask in part["loss_mask"]:
            count = int(anchor_candidates(torch.tensor(mask)).sum())
            out.append(min(anchors, count) * total)
    return out


# ------------------------------------------------------------------------------------------------
# Memory: what one step adds to the estimate (train/estimate.py), checked before the target loads


def memory_parts(cfg, target: Shape, sizes: StepSizes) -> dict[str, float]:
    """The trained draft with AdamW, the blocks' activations, the target's forward, the loss."""
    n, act, h = sizes.tokens, sizes.act, target.hidden
    layers = cfg.num_layers
    ids = len(cfg.target_layer_ids or ()) or max(layers, 2)
    vocab = cfg.draft_vocab_size or target.vocab
    trained = layers * target.layer_params() + ids * h * h + 2 * h
    if cfg.draft_vocab_size:
        trained += vocab * h
    if cfg.method == "dspark":
        rank = cfg.markov_rank or 64
        trained += rank * (target.vocab + vocab) + h + rank
    largest = max(vocab * h if cfg.draft_vocab_size else 0, h * target.intermediate, ids * h * h,
                  (cfg.markov_rank or 64) * target.vocab if cfg.method == "dspark" else 0)
    # blocks start at distinct positions, so a micro-batch holds at most its tokens' worth; with
    # rows batched by count, at most `anchors` per row as well (a token budget bounds only the
    # first: its rows can be as short as a prompt)
    blocks = n if cfg.max_tokens_per_batch else min(n, cfg.anchors * cfg.per_device_batch_size)
    block_tokens = blocks * cfg.block_size
    per_layer = LAYER_FACTOR * target.layer_saved_per_token() * act  # bytes per block token
    if cfg.gradient_checkpointing:  # each layer keeps its input; one layer is rebuilt at a time
        saved = per_layer + layers * h * act
    else:
        saved = layers * per_layer
    return {
        f"trained draft ({trained / 1e6:.0f} M parameters, AdamW)":
            sizes.optimizer(trained, largest),
        f"block activations ({layers} layers)": saved * block_tokens
        + layers * 2 * target.kv_dim * act * n,
        "target forward and features": sizes.target_forward + (ids + 1) * h * act * n,
        # each block slot's loss holds the trained head's gradient, (draft vocabulary, h + the
        # Markov rank) float32, for backward (heads/chunked_loss.py); a frozen head none
        "loss's gradient buffers": (cfg.block_size - 1) * 4 * (
            vocab * (h + ((cfg.markov_rank or 64) if cfg.method == "dspark" else 0))
            if cfg.draft_vocab_size else 0)
        + 4 * block_tokens * h,
        f"loss chunk ({min(cfg.loss_chunk_size, block_tokens)} x {vocab})":
            sizes.loss_chunk(cfg, vocab, rows=block_tokens,
                             teacher=target.vocab if cfg.soft_weight else None,
                             columns=bool(cfg.draft_vocab_size)),
    }


MEMORY = MemoryModel(memory_parts, shrink_keys=(
    "max_tokens_per_batch (or per_device_batch_size), anchors, block_size, "
    "gradient_checkpointing: true, draft_vocab_size, loss_chunk_size"))


def build(cfg: DFlashTrainConfig) -> Recipe:
    """The run, ready to train: target, data, draft, loss, evaluation and export."""
    accelerator = start_run(cfg, MEMORY)  # seeds first, then the memory check
    target = load_feature_target(cfg, accelerator)  # frozen; never prepared
    pad_id = target.tokenizer.pad_token_id
    pad_id = target.eos_token_ids[0] if pad_id is None else pad_id
    with accelerator.main_process_first():
        dataset, report = load_sft_dataset(cfg.data, target.tokenizer, cfg.max_length)
    accelerator.print(report.summary())
    config = draft_config(cfg, target)
    maps, coverage = {}, None
    if config.draft_vocab_size is not None:
        d2t, t2d, coverage = draft_vocab.draft_vocabulary(
            dataset["input_ids"], dataset["loss_mask"], config.vocab_size,
            config.draft_vocab_size)
        maps = {"d2t": d2t, "t2d": t2d}
        accelerator.print(f"[draftsmith] draft vocabulary: {config.draft_vocab_size} of "
                          f"{config.vocab_size} target tokens, covering {coverage:.2%} of the "
                          f"training data's assistant tokens")
    layers = list(config.hidden_states_read)
    spec = FeatureSpec(tuple(layers), target.hidden_size, target.num_layers)
    rows, collate = feature_rows(cfg, accelerator, target, dataset, spec, pad_id)
    draft = DFlashDraft(config, target, dtype=torch.float32, **maps)
    model = DFlashLoss(draft, gamma=cfg.gamma, hard_weight=cfg.hard_weight,
                       soft_weight=cfg.soft_weight, conf_weight=cfg.conf_weight,
                       chunk_size=cfg.loss_chunk_size,
                       gradient_checkpointing=cfg.gradient_checkpointing)
    weights = [float(w) for w in torch.exp(-torch.arange(config.drafts_per_block) / cfg.gamma)]
    lengths, _ = row_sizes(dataset)
    batches = make_batches(rows, cfg, accelerator, collate, lengths=lengths,
                           weights=row_weights(dataset, cfg.anchors, weights))

    @torch.no_grad()
    def target_forward(batch: dict) -> dict:  # the target's states, its LM head not run
        states, last = target.hidden_states(batch["input_ids"], layers, batch["attention_mask"])
        return {"features": torch.cat([states[i] for i in layers], dim=-1),  # (B, S, L*H)
                "last_hidden": last}  # (B, S, H)

    def step(model, batch: dict, micro_index: int) -> StepOutput:
        if cfg.feature_mode == "online":
            batch.update(target_forward(batch))
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + micro_index)
        anchors = sample_anchors(batch["loss_mask"], cfg.anchors, generator)
        loss, metrics = model(batch, anchors)
        return StepOutput(loss, metrics)

    def check_vocabulary(state, module) -> None:
        if maps and state.resumed_from is not None:
            draft_vocab.check_same_vocabulary((module.draft.d2t, module.draft.t2d),
                                              (maps["d2t"], maps["t2d"]), state.resumed_from)

    first = {**{f"data/{k}": v for k, v in report.totals().items()},
             "data/sequences": len(dataset)}
    if coverage is not None:
        first.update({"draft_vocab/size": config.draft_vocab_size,
                      "draft_vocab/coverage": coverage})
    acceptance = AcceptanceEval(
        accelerator, cfg, target,
        lambda module: BlockProposer(module.draft, block_size=cfg.eval_block_size))
    return Recipe(cfg, accelerator, target, batches, model, step,
                  export=partial(export, cfg, accelerator, target, config, report),
                  evaluators=[acceptance], first_record=first, on_resume=check_vocabulary,
                  target_forward=target_forward if cfg.feature_mode == "online" else None)


def export(cfg: DFlashTrainConfig, accelerator, target: Target, config: DFlashConfig, report,
           result: TrainResult) -> dict:
    """The artifact, written by the main process after a completed run."""
    artifact, draft = write_run_artifact(cfg, accelerator, result, method=config.method,
                                         config=config.to_dict(), target=target, module="draft",
                                         formats="sglang, speculators, gguf",
                                         bench_prefix=config.method)
    return {"step": result.state.step, "stopped": result.stopped, "artifact": artifact,
            "report": report, "target": target, "draft": draft}


def main(cfg: DFlashTrainConfig) -> dict:
    """Train, checkpoint and export; returns step, stop message, artifact, report, target and
    the trained draft (unwrapped)."""
    recipe = build(cfg)
    return recipe.export(recipe.train())


if __name__ == "__main__":
    raise SystemExit(run_command(lambda: main(parse_config(DFlashTrainConfig)),
                                 "train/dflash.py"))
