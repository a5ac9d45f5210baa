"""How much memory a training run needs, estimated before the target is loaded.

Every trainer calls :func:`check_fits` with its :class:`MemoryModel` first thing in ``build``: a run whose estimate exceeds
the device's memory is refused with the estimate, its parts and the keys that shrink it, instead
of failing with an out-of-memory error after the target has loaded (minutes on an 8B target) or
after the feature cache is written (hours).

The estimate is the peak of one training step on one process (``python -m draftsmith.train.memory`` prints
it for a config):

* **weights**: the frozen target in the dtype it is loaded in (bf16 on GPU, fp32 on CPU): only
  its embedding, final norm and LM head when a run trains from a finished feature cache; its
  decoder layers split over ``target_parallel`` processes (plus the two layers gathered at a
  time: the one running and the next, prefetched) when it is sharded;
* **trained parameters**: fp32 master weights and AdamW's two moments (12 bytes per parameter),
  and DDP's gradient buckets when there are several processes (4 more); under FSDP2 the 12 bytes
  are split over the processes and the gathered weights (one copy in the compute dtype) are added
  instead of the buckets; the gradients (4 bytes) where they outlive a step (gradient
  accumulation);
* **activations** (the trainer's :class:`MemoryModel` counts its own): per token of a micro-batch (``max_tokens_per_batch``, else
  ``per_device_batch_size x max_length``, padding counted): what the trained module keeps for its
  backward pass, the frozen target's no-grad forward (one layer's temporaries and the hidden
  states the head reads), and one chunk of the large-vocabulary loss (``loss_chunk_size`` x
  vocabulary, a few times), which does not grow with the sequence.

Not everything is held at once. The activations, the loss chunk and the target's forward live
in the forward and backward passes; the gradients (unless accumulated) and the optimizer's own
temporaries (AdamW's ``sqrt`` of the second moment: one float32 copy of every parameter with the
multi-tensor kernels a GPU uses, up to three of the largest parameter in the one-tensor loop a
CPU runs)
live in the optimizer step, after the backward has freed the activations. The peak is what is
held plus the larger of the two phases (:attr:`Estimate.total`); ``python -m draftsmith.train.memory_probe``
measures both phases with the allocator's own events and ``tests/test_memory_probe.py`` checks
the plan against them.

The per-token figures are a decoder layer's saved tensors counted from its shapes, scaled by
factors measured on this machine (``scripts/memory_growth.py`` ->
``reports/memory_growth.json``, which ``tests/test_memory_estimate.py`` checks the estimate
against): a step's memory grows linearly in tokens and test-time steps, and the slopes at
SmolLM2's and Llama-3.1-8B's widths agree with the shape count within the factors below.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1024 ** 3

# measured slope / shape count, the larger of the two widths measured (reports/memory_growth.json)
LAYER_FACTOR = 1.15   # a decoder layer's forward+backward (SmolLM2 1.10, Llama-3.1-8B 1.08)
EAGLE_FACTOR = 1.40   # one EAGLE test-time step (SmolLM2 1.31, Llama-3.1-8B 1.06)
# values per position and test-time step that do not scale with the width (indices, rotary
# tables, the loss's gathered rows): hidden 128 measured 64 MiB per 1000 tokens over 3 steps where
# the shape count gave 52 (reports/memory_growth.json, width "tiny")
EAGLE_STEP_OVERHEAD = 1280
NO_GRAD_FACTOR = 1.15  # the frozen target's no-grad forward, per token (one layer's temporaries)
HEADROOM = 0.92        # the share of a device's memory a run may plan to use
# the process itself: the CUDA context and the caching allocator's slack on a GPU; on a CPU the
# interpreter, torch, the tokenised data and glibc's retained arenas (draftsmith.train.speed measured 2.36 GB
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


FORWARD_BACKWARD, OPTIMIZER_STEP = "forward and backward", "optimizer step"


@dataclass
class Estimate:
    parts: dict[str, float] = field(default_factory=dict)  # bytes
    tokens: int = 0
    device: str = "cpu"
    capacity: float | None = None  # bytes
    # phase -> the parts that exist only during it; every other part is held throughout
    phases: dict[str, list[str]] = field(default_factory=dict)

    def phase_bytes(self) -> dict[str, float]:
        return {phase: sum(self.parts[name] for name in names)
                for phase, names in self.phases.items()}

    @property
    def held(self) -> float:
        transient = {name for names in self.phases.values() for name in names}
        return sum(size for name, size in self.parts.items() if name not in transient)

    @property
    def peak_phase(self) -> str | None:
        sizes = self.phase_bytes()
        return max(sizes, key=sizes.get) if sizes else None

    @property
    def total(self) -> float:
        """The peak: what is held throughout plus the larger phase."""
        return self.held + max(self.phase_bytes().values(), default=0.0)

    def table(self) -> str:
        phase_of = {name: phase for phase, names in self.phases.items() for name in names}
        rows = []
        for name, size in self.parts.items():
            label = name if name not in phase_of else f"{name} [{phase_of[name]}]"
            rows.append(f"  {label:<62} {size / GIB:8.2f} GiB")
        sizes = self.phase_bytes()
        if len(sizes) > 1:
            rows.append("  peak: held throughout + the " + " > the ".join(
                f"{phase} ({sizes[phase] / GIB:.2f} GiB)"
                for phase in sorted(sizes, key=sizes.get, reverse=True)))
        return "\n".join(rows + [f"  {'total':<62} {self.total / GIB:8.2f} GiB"])


# config.json of recipe targets shipped without weights (data/SOURCES.md), for estimates made
# before the target is downloaded
SHIPPED_SHAPES = Path(__file__).resolve().parents[1] / "data" / "target_configs"


def model_shape(spec: str) -> Shape:
    """The shape of a target or draft from its config.json, without loading any weights: the
    downloaded model's, else (for a hub id not downloaded yet) the copy shipped in
    data/target_configs/ when there is one."""
    from draftsmith.files.file_formats import read_json_object
    from draftsmith.targets.resolve import check_model_directory, is_hub_id, resolve_target

    try:
        return Shape.from_config(check_model_directory(resolve_target(spec)))
    except FileNotFoundError:
        shipped = SHIPPED_SHAPES / f"{str(spec).replace('/', '--')}.json"
        if not (is_hub_id(str(spec)) and shipped.is_file()):
            raise
        return Shape.from_config(read_json_object(shipped, fix="reinstall draftsmith"))


def tokens_per_micro_batch(cfg) -> int:
    if cfg.max_tokens_per_batch is not None:
        return int(cfg.max_tokens_per_batch)
    return int(cfg.per_device_batch_size) * int(cfg.max_length)


@dataclass
class StepSizes:
    """What every trainer's memory parts are computed from, besides its config and shapes
    (and what :meth:`optimizer` records of the trained module for the optimizer step)."""

    tokens: int  # per micro-batch, padding counted
    act: int  # bytes of a saved activation (2 under bf16/fp16 autocast or on a GPU, else 4)
    weight: int  # bytes of a frozen target weight (2 on a GPU, 4 on a CPU)
    processes: int
    target_forward: float  # bytes of the frozen target's no-grad forward over the micro-batch
    draft: Shape | None = None  # a separate draft model's shape (distillation from a directory)
    trained_shards: int = 1  # processes the trained module is split over (FSDP2), else 1
    device: str = "cpu"
    trained_params: int = 0  # recorded by optimizer()
    largest_trained: int = 0  # the largest trained tensor's elements, recorded by optimizer()

    def optimizer(self, params: int, largest: int | None = None) -> float:
        """Bytes held throughout for ``params`` trained parameters with AdamW
        (:func:`optimizer_bytes`); ``largest``: the elements of the largest trained tensor (the
        one-tensor optimizer step's temporaries on a CPU), default all of them."""
        self.trained_params += int(params)
        self.largest_trained = max(self.largest_trained, int(largest or params))
        return optimizer_bytes(params, self.processes, self.trained_shards, self.act)

    def loss_chunk(self, cfg, vocab: int, teacher: int | None = None, rows: int | None = None,
                   columns: bool = False) -> float:
        """Bytes of one loss chunk (:func:`loss_chunk_bytes`) over ``rows`` (default the
        micro-batch's tokens)."""
        return loss_chunk_bytes(cfg, self.tokens if rows is None else rows, vocab, teacher,
                                columns)


# float32 (chunk, vocabulary) tensors one chunk of heads/chunked_loss.py holds at once, measured
# with draftsmith.train.memory_probe.allocation_peak (256 rows, 49152 tokens): against hard labels alone 2
# (the logits and their softmax, made the gradient in place); against a teacher over the same
# vocabulary 5 (both log-softmaxes, the teacher's distribution, the product, the gradient); with
# teacher_columns (EAGLE-3's draft vocabulary) 5 over the draft vocabulary and the teacher's
# logits over its whole vocabulary once
HARD_CHUNK_COPIES, SOFT_CHUNK_COPIES = 2, 5


def loss_chunk_bytes(cfg, rows: int, vocab: int, teacher: int | None = None,
                     columns: bool = False) -> float:
    """One chunk of the large-vocabulary loss: ``loss_chunk_size`` of ``rows`` scored rows over
    the student's ``vocab`` against hard labels (``teacher`` None) or a teacher's distribution
    over ``teacher`` tokens (``columns``: restricted to the student's vocabulary)."""
    chunk = min(cfg.loss_chunk_size, rows) * 4
    if teacher is None:
        return HARD_CHUNK_COPIES * chunk * vocab
    if columns:
        return chunk * (SOFT_CHUNK_COPIES * vocab + teacher)
    return SOFT_CHUNK_COPIES * chunk * max(vocab, teacher)


def optimizer_bytes(params: int, processes: int, shards: int = 1, compute: int = 4) -> float:
    """fp32 master weights and AdamW's two moments, and DDP's gradient buckets (with several
    processes), per trained parameter; split over ``shards`` processes under FSDP2, which gathers
    the whole weights in the ``compute`` dtype instead of bucketing. The gradients and the
    optimizer step's temporaries are the estimate's optimizer-step phase."""
    if shards > 1:
        return params * 12 / shards + params * compute
    return params * (12 + (4 if processes > 1 else 0))


def optimizer_step_parts(sizes: StepSizes, accumulated: bool) -> tuple[dict[str, float],
                                                                        list[str]]:
    """({name: bytes}, the names that exist only in the optimizer step): the float32 gradients
    of the trained parameters (held throughout when ``accumulated`` over micro-batches) and
    AdamW's temporaries: one float32 copy of every parameter in the multi-tensor kernels a GPU
    runs, up to three of the largest tensor in the one-tensor loop a CPU runs (measured with
    draftsmith.train.memory_probe beyond the gradients: 2.0 copies of the tiny distillation's 113 MB
    embedding, 3.0 of the 1-5 MB largest tensors of the tiny EAGLE-3, Medusa and DFlash)."""
    shards = max(sizes.trained_shards, 1)
    grads = sizes.trained_params * 4 / shards
    temporaries = (sizes.trained_params * 4 / shards if sizes.device != "cpu"
                   else 3 * 4 * sizes.largest_trained)
    parts = {"gradients (float32)": grads, "optimizer step's temporaries": temporaries}
    transient = ["optimizer step's temporaries"] + ([] if accumulated
                                                    else ["gradients (float32)"])
    return parts, transient


@dataclass(frozen=True)
class MemoryModel:
    """A trainer's share of the estimate, defined beside its recipe (train/<method>.py).

    ``parts(cfg, target, sizes) -> {name: bytes}``: what one step adds beyond the process and
    the frozen target's weights: the trained module with AdamW's moments (``sizes.optimizer``)
    and other weights, held throughout, named ``trained ...`` or ``frozen ...``; every other part
    (activations, the loss chunk, the target's forward) exists in the forward and backward
    passes only; ``shrink_keys``: the config keys that shrink them, named when a run is
    refused; ``draft_spec(cfg)``: a separate model whose config.json the parts read (None: none).
    """

    parts: Callable[[Any, Shape, StepSizes], dict[str, float]]
    shrink_keys: str
    draft_spec: Callable[[Any], str | None] | None = None

    def estimate(self, cfg, target: Shape, *, device: str = "cpu", processes: int = 1,
                 draft: Shape | None = None, trained_shards: int = 1,
                 parts_only: bool = False) -> Estimate:
        """Peak bytes of one training step on one process. ``trained_shards``: processes the
        trained module is split over (FSDP2); ``parts_only``: the target's embedding, norm and
        LM head alone are loaded (training from a finished feature cache); the target's shards
        come from ``cfg.target_parallel``."""
        on_gpu = device != "cpu"
        bf16 = on_gpu or cfg.mixed_precision in ("bf16", "fp16")
        act = 2 if bf16 else 4
        n = tokens_per_micro_batch(cfg)
        sizes = StepSizes(tokens=n, act=act, weight=2 if on_gpu else 4, processes=processes,
                          target_forward=NO_GRAD_FACTOR * target.no_grad_per_token() * act * n,
                          draft=draft, trained_shards=trained_shards, device=device)
        est = Estimate(tokens=n, device=device)
        est.parts["process (CUDA context, allocator)" if on_gpu
                  else "process (python, torch, data)"] = RUNTIME_BYTES["cuda" if on_gpu else "cpu"]
        name, weights = target_weights(target, int(cfg.target_parallel),
                                       parts_only)
        est.parts[name] = weights * sizes.weight
        own = self.parts(cfg, target, sizes)
        est.parts.update(own)
        est.phases[FORWARD_BACKWARD] = [k for k in own if not k.startswith(("trained", "frozen"))]
        step, transient = optimizer_step_parts(
            sizes, int(cfg.gradient_accumulation_steps or 1) > 1)
        est.parts.update(step)
        est.phases[OPTIMIZER_STEP] = transient
        return est

    def estimate_run(self, cfg, device: str = "cpu", processes: int = 1,
                     trained_shards: int = 1) -> Estimate:
        """:meth:`estimate` for a config, the shapes read from the target's (and a draft
        directory's) config.json; only the parts a run loads (draftsmith.train.features)."""
        from draftsmith.train.features import loads_target_parts

        spec = self.draft_spec(cfg) if self.draft_spec else None
        draft = model_shape(spec) if spec else None
        return self.estimate(cfg, model_shape(cfg.target), device=device, processes=processes,
                             draft=draft, trained_shards=trained_shards,
                             parts_only=loads_target_parts(cfg))


def target_weights(target: Shape, shards: int, parts_only: bool) -> tuple[str, float]:
    """(name, parameters held per process) of the frozen target: the whole model; its
    embedding, final norm and LM head alone (``parts_only``); or those whole plus 1/``shards``
    of the decoder layers and the two layers gathered at a time (the one running and the next,
    prefetched)."""
    ends = target.params(layers=0)  # embedding, LM head (unless tied), final norm
    if parts_only:
        return "frozen target: embedding, norm, LM head", ends
    if shards <= 1:
        return "frozen target weights", target.params()
    layers = target.layers * target.layer_params()
    gathered = 2 * target.layer_params()
    return (f"frozen target (layers 1/{shards}, 2 gathered)",
            ends + layers / shards + gathered)


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


class DoesNotFit(ValueError):
    """The run's estimated peak memory exceeds the device's."""


def check_fits(cfg, accelerator, memory: MemoryModel, plan=None) -> Estimate | None:
    """Refuse, before the target loads, a run whose estimated peak exceeds the device's memory.

    Returns the estimate (None where the target's config cannot be read here: loading it then
    reports the problem). ``DRAFTSMITH_SKIP_MEMORY_CHECK=1`` turns the refusal into a warning,
    for a user who knows better than the estimate.
    """
    device = str(accelerator.device.type)
    shards = accelerator.num_processes if plan is not None and plan.trained == "fsdp2" else 1
    try:
        est = memory.estimate_run(cfg, device, accelerator.num_processes, shards)
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
            f"\nShrink it with {memory.shrink_keys} (the README's memory section gives the "
            "figures per key); split the frozen target's layers over processes with "
            "target_parallel (the GPUs of a node) and the trained module with "
            "configs/accelerate/fsdp2.yaml; DRAFTSMITH_SKIP_MEMORY_CHECK=1 runs it anyway.")
        if os.environ.get("DRAFTSMITH_SKIP_MEMORY_CHECK") == "1":
            accelerator.print(f"[draftsmith] warning: {message}")
        else:
            raise DoesNotFit(message)
    return est
