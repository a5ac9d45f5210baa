"""How much memory a training run needs, estimated before the target is loaded.

Every trainer calls :func:`check_fits` first thing in ``build``: a run whose estimate exceeds
the device's memory is refused with the estimate, its parts and the keys that shrink it, instead
of failing with an out-of-memory error after the target has loaded (minutes on an 8B target) or
after the feature cache is written (hours).

The estimate is the peak of one training step on one process:

* **weights**: the frozen target in the dtype it is loaded in (bf16 on GPU, fp32 on CPU);
* **trained parameters**: fp32 master weights, gradients and AdamW's two moments (16 bytes per
  parameter), the gradient being accumulated as it arrives (4 more: the measured intercept of a
  step), and DDP's gradient buckets when there are several processes (4 more);
* **activations**: per token of a micro-batch (``max_tokens_per_batch``, else
  ``per_device_batch_size x max_length``, padding counted): what the trained module keeps for its
  backward pass, the frozen target's no-grad forward (one layer's temporaries and the hidden
  states the head reads), and one chunk of the large-vocabulary loss (``loss_chunk_size`` x
  vocabulary, a few times), which does not grow with the sequence.

The per-token figures are a decoder layer's saved tensors counted from its shapes, scaled by
factors measured on this machine (``scripts/memory_growth.py`` ->
``reports/memory_growth.json``, which ``tests/test_memory_estimate.py`` checks the estimate
against): a step's memory grows linearly in tokens and test-time steps, and the slopes at
SmolLM2's and Llama-3.1-8B's widths agree with the shape count within the factors below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024 ** 3

# measured slope / shape count, the larger of the two widths measured (reports/memory_growth.json)
LAYER_FACTOR = 1.15   # a decoder layer's forward+backward (SmolLM2 1.10, Llama-3.1-8B 1.08)
EAGLE_FACTOR = 1.40   # one EAGLE test-time step (SmolLM2 1.31, Llama-3.1-8B 1.06)
NO_GRAD_FACTOR = 1.15  # the frozen target's no-grad forward, per token (one layer's temporaries)
LOSS_CHUNK_COPIES = 6  # logits, log-softmax, the target's logits and distribution, gradients
#                        (Llama-3.1-8B's EAGLE-1, full vocabulary, T 128 -> 256: 5.4 measured)
HEADROOM = 0.92        # the share of a device's memory a run may plan to use
# the process itself: the CUDA context and the caching allocator's slack on a GPU; on a CPU the
# interpreter, torch, the tokenised data and glibc's retained arenas (train.speed measured 2.36 GB
# peak for 1.56 GB of tensors, an EAGLE-3 step of 2048 tokens on smollm2-135m)
RUNTIME_BYTES = {"cuda": 2.0 * 1024 ** 3, "cpu": 1.0 * 1024 ** 3}


@dataclass(frozen=True)
class Shape:
    """The few numbers of a decoder-only model's config.json that memory depends on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict) -> Shape:
        config = config.get("text_config", config)  # multimodal wrappers keep the LM inside
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(hidden=hidden, intermediate=int(config["intermediate_size"]),
                       layers=int(config["num_hidden_layers"]), heads=heads,
                       kv_heads=int(config.get("num_key_value_heads") or heads),
                       head_dim=int(config.get("head_dim") or hidden // heads),
                       vocab=int(config["vocab_size"]),
                       tied=bool(config.get("tie_word_embeddings", False)))
        except KeyError as missing:
            raise ValueError(f"config.json lacks {missing}: not a decoder-only language "
                             "model draftsmith can estimate") from None

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self, input_dim: int | None = None) -> int:
        """One decoder layer; ``input_dim`` is what q, k and v read (2 x hidden in EAGLE-3)."""
        x = input_dim or self.hidden
        return (x * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
                + 3 * self.hidden * self.intermediate + 2 * self.hidden)

    def params(self, layers: int | None = None) -> int:
        n = self.layers if layers is None else layers
        return (self.vocab * self.hidden * (1 if self.tied else 2) + n * self.layer_params()
                + self.hidden)

    def layer_saved_per_token(self, input_dim: int | None = None) -> int:
        """Values a layer keeps for its backward pass, per token (elements): norms and
        residuals, q/k/v and the attention output, the MLP's gate, up, activation and product."""
        x = input_dim or self.hidden
        return 3 * self.hidden + x + 2 * self.q_dim + 2 * self.kv_dim + 4 * self.intermediate

    def no_grad_per_token(self) -> int:
        """Temporaries of one layer's no-grad forward, per token (elements)."""
        return 2 * self.hidden + self.q_dim + 2 * self.kv_dim + 3 * self.intermediate


@dataclass
class Estimate:
    parts: dict[str, float] = field(default_factory=dict)  # bytes
    tokens: int = 0
    device: str = "cpu"
    capacity: float | None = None  # bytes

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def table(self) -> str:
        rows = [f"  {name:<46} {size / GIB:8.2f} GiB" for name, size in self.parts.items()]
        return "\n".join(rows + [f"  {'total':<46} {self.total / GIB:8.2f} GiB"])


def model_shape(spec: str) -> Shape:
    """The shape of a target or draft from its config.json, without loading any weights."""
    from heads.target import check_model_directory, resolve_target

    return Shape.from_config(check_model_directory(resolve_target(spec)))


def tokens_per_micro_batch(cfg) -> int:
    if cfg.max_tokens_per_batch is not None:
        return int(cfg.max_tokens_per_batch)
    return int(cfg.per_device_batch_size) * int(cfg.max_length)


def _loss_chunk(cfg, tokens: int, vocab: int) -> float:
    return LOSS_CHUNK_COPIES * min(cfg.loss_chunk_size, tokens) * vocab * 4


def _optimizer_bytes(params: int, processes: int) -> float:
    return params * (16 + 4 + (4 if processes > 1 else 0))


def estimate(trainer: str, cfg, target: Shape, *, device: str = "cpu", processes: int = 1,
             draft: Shape | None = None) -> Estimate:
    """Peak bytes of one training step of ``trainer`` (eagle, medusa, distill) on one process."""
    on_gpu = device != "cpu"
    bf16 = on_gpu or getattr(cfg, "mixed_precision", "no") in ("bf16", "fp16")
    act = 2 if bf16 else 4            # bytes of a saved activation
    weight = 2 if on_gpu else 4       # bytes of a frozen target weight
    n = tokens_per_micro_batch(cfg)
    h = target.hidden
    est = Estimate(tokens=n, device=device)
    est.parts["process (CUDA context, allocator)" if on_gpu else "process (python, torch, data)"] = \
        RUNTIME_BYTES["cuda" if on_gpu else "cpu"]
    est.parts["frozen target weights"] = target.params() * weight
    target_fwd = NO_GRAD_FACTOR * target.no_grad_per_token() * act * n

    if trainer == "eagle":
        version = cfg.version
        draft_vocab = (cfg.draft_vocab_size or target.vocab) if version == 3 else target.vocab
        layer_in = 2 * h
        trained = target.layer_params(layer_in) + (3 if version == 3 else 2) * h * h
        if version == 3:
            trained += draft_vocab * h
        steps = cfg.ttt_steps if version == 3 else 1
        per_step = EAGLE_FACTOR * (target.layer_saved_per_token(layer_in) + 6 * h) * act
        if cfg.gradient_checkpointing:  # each step keeps its input; one step is rebuilt at a time
            kept = per_step + steps * 6 * h * act
        else:
            kept = steps * per_step
        features = (4 if version == 3 else 2) * h * act  # the hidden states the head reads
        est.parts[f"trained head ({trained / 1e6:.0f} M parameters, AdamW)"] = \
            _optimizer_bytes(trained, processes)
        est.parts[f"head activations ({steps} test-time step{'s' if steps > 1 else ''})"] = \
            kept * n
        est.parts["target forward and features"] = target_fwd + features * n
        est.parts[f"loss chunk ({min(cfg.loss_chunk_size, n)} x {draft_vocab})"] = \
            _loss_chunk(cfg, n, draft_vocab)
    elif trainer == "medusa":
        k = cfg.num_heads
        draft_vocab = getattr(cfg, "draft_vocab_size", None)
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
        est.parts[f"trained heads ({trained / 1e6:.0f} M parameters, AdamW)"] = \
            _optimizer_bytes(trained, processes)
        est.parts[f"activations ({k} heads{', adapted target' if cfg.medusa2 else ''})"] = kept * n
        est.parts["target forward"] = (0 if cfg.medusa2 else target_fwd) + h * act * n
        est.parts[f"loss chunk ({min(cfg.loss_chunk_size, n)} x {vocab})"] = \
            _loss_chunk(cfg, n, vocab)
    elif trainer == "distill":
        d = draft or target
        layers = d.layers
        if draft is None and cfg.draft.split(":")[0] in ("truncate", "fresh"):
            layers = int(cfg.draft.split(":")[1])
        trained = d.params(layers)
        if cfg.lora:
            trained = layers * cfg.lora_r * 4 * (d.hidden + d.intermediate)
            est.parts["frozen draft weights"] = d.params(layers) * weight
        layer = LAYER_FACTOR * d.layer_saved_per_token() * act
        kept = (layer + layers * 2 * d.hidden * act) if cfg.gradient_checkpointing \
            else layers * layer
        est.parts[f"trained draft ({trained / 1e6:.0f} M parameters, AdamW)"] = \
            _optimizer_bytes(trained, processes)
        est.parts[f"draft activations ({layers} layers)"] = kept * n
        est.parts["target forward"] = target_fwd
        est.parts[f"loss chunk ({min(cfg.loss_chunk_size, n)} x {target.vocab})"] = \
            _loss_chunk(cfg, n, target.vocab)
    else:
        raise ValueError(f"unknown trainer {trainer!r}")
    return est


def device_capacity(device) -> float | None:
    """Bytes a run on ``device`` may use: the GPU's total memory, or the memory the system has
    available now (``MemAvailable``) on a CPU. None where it cannot be read."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


SHRINK_KEYS = {
    "eagle": "max_tokens_per_batch (or per_device_batch_size), gradient_checkpointing: true, "
             "draft_vocab_size (EAGLE-3), loss_chunk_size, ttt_steps",
    "medusa": "max_tokens_per_batch (or per_device_batch_size), share_lm_head: true, "
              "gradient_checkpointing: true (Medusa-2), loss_chunk_size",
    "distill": "max_tokens_per_batch (or per_device_batch_size), gradient_checkpointing: true, "
               "lora: true, a smaller draft, loss_chunk_size",
}


class DoesNotFit(ValueError):
    """The run's estimated peak memory exceeds the device's."""


def estimate_run(trainer: str, cfg, device: str = "cpu", processes: int = 1) -> Estimate:
    """:func:`estimate` for a config, the shapes read from the target's (and a draft
    directory's) config.json."""
    draft = getattr(cfg, "draft", None) if trainer == "distill" else None
    draft_shape = None
    if draft and not draft.startswith(("truncate:", "fresh:")):  # a directory or a hub id
        draft_shape = model_shape(draft)
    return estimate(trainer, cfg, model_shape(cfg.target), device=device, processes=processes,
                    draft=draft_shape)


def check_fits(trainer: str, cfg, accelerator) -> Estimate | None:
    """Refuse, before the target loads, a run whose estimated peak exceeds the device's memory.

    Returns the estimate (None where the target's config cannot be read here: loading it then
    reports the problem). ``DRAFTSMITH_SKIP_MEMORY_CHECK=1`` turns the refusal into a warning,
    for a user who knows better than the estimate.
    """
    device = str(accelerator.device.type)
    try:
        est = estimate_run(trainer, cfg, device, accelerator.num_processes)
    except (FileNotFoundError, ValueError, OSError):
        return None
    est.capacity = device_capacity(accelerator.device)
    if est.capacity is None:
        return est
    budget = HEADROOM * est.capacity
    if est.total > budget:
        message = (
            f"this run needs about {est.total / GIB:.1f} GiB per process on {device}, more than "
            f"the {budget / GIB:.1f} GiB it may use ({HEADROOM:.0%} of "
            f"{est.capacity / GIB:.1f} GiB {'total' if device == 'cuda' else 'available'}); "
            f"estimated peak of one step over {est.tokens} tokens per micro-batch:\n{est.table()}"
            f"\nShrink it with {SHRINK_KEYS[trainer]} (the README's memory section gives the "
            "figures per key); DRAFTSMITH_SKIP_MEMORY_CHECK=1 runs it anyway.")
        if os.environ.get("DRAFTSMITH_SKIP_MEMORY_CHECK") == "1":
            accelerator.print(f"[draftsmith] warning: {message}")
        else:
            raise DoesNotFit(message)
    return est


def main(argv: list[str] | None = None) -> Estimate:
    """``python -m train.memory --config CONFIG [--device cuda] [--processes 8] [--key value]``:
    the estimate a run would be checked against, without loading anything but config.json."""
    import argparse
    import importlib

    from train.config import parse_config
    from train.speed import _CONFIG_CLASSES, trainer_of

    parser = argparse.ArgumentParser(prog="python -m train.memory", description=main.__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--trainer", choices=sorted(_CONFIG_CLASSES), default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--processes", type=int, default=1)
    args, rest = parser.parse_known_args(argv)
    trainer = trainer_of(args.config, args.trainer)
    module = importlib.import_module(f"train.{trainer}")
    cfg = parse_config(getattr(module, _CONFIG_CLASSES[trainer]), ["--config", args.config, *rest])
    est = estimate_run(trainer, cfg, args.device, args.processes)
    print(f"{trainer}: one step over {est.tokens} tokens per micro-batch, {args.processes} "
          f"process{'es' if args.processes > 1 else ''} on {args.device}:\n{est.table()}")
    return est


if __name__ == "__main__":
    import sys

    try:
        main()
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
