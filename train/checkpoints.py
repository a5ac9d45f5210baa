"""The training runtime: the accelerator, the optimizer, the data order, checkpoints and stopping.

A resumed run continues *exactly* (its next losses equal an uninterrupted run's) because every
source of difference is pinned down here:

* the seed (:func:`make_accelerator` seeds Python, NumPy and torch before the model is built);
* the learning rate, a pure function of the optimizer step (:func:`apply_learning_rate`), so the
  schedule needs no saved state and does not depend on the number of processes (accelerate would
  step a prepared scheduler once per process per optimizer step);
* the data order (:func:`make_train_dataloader`): a permutation seeded by ``seed + epoch``, cut
  to whole optimizer steps, and a resumed epoch that starts after the samples already used; the
  DataLoader has its own generator, so starting an epoch draws nothing from the global RNG;
* the head's weights, the optimizer and every process's random state (dropout, noise), saved by
  ``accelerator.save_state``.

Layout under ``<output_dir>/checkpoints/``::

    step_<N>/        accelerate's state (model.safetensors, optimizer.bin, random_states_<i>.pkl)
                     and trainer_state.json: step, data position, the config, the target identity
    .tmp-step_<N>/   a save in progress, renamed to step_<N> once complete: a crash never leaves a
                     half-written "latest" (only a step_<N> holding trainer_state.json counts)

A trainer calls the helpers in order (config -> Accelerator -> data -> model -> optimizer -> loop
-> checkpoint -> export); tests/fixtures/toy_train.py is a complete small example::

    accelerator = make_accelerator(cfg)                      # first: seeds before any weights
    target = load_target(cfg.target, device=accelerator.device)   # frozen; never prepared
    loader = make_train_dataloader(dataset, cfg, accelerator, collate_fn)
    head = build_head(...)
    optimizer = make_optimizer(head, cfg)
    head, optimizer, loader = accelerator.prepare(head, optimizer, loader)
    checkpointer = Checkpointer(accelerator, cfg, target.identity(), loader)
    state = checkpointer.resume()                            # step 0, or where cfg.resume says
    metrics = MetricsLogger(accelerator, cfg, state)         # train/tracking.py
    acceptance = AcceptanceEval(accelerator, cfg, target, make_proposer, metrics)
    with GracefulStop(accelerator) as stop:
        for batch in train_batches(loader, state):
            with accelerator.accumulate(head):
                lr = apply_learning_rate(optimizer, cfg, state)
                loss = ...
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(head.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            metrics.add("loss", loss.detach())
            if not accelerator.sync_gradients:
                continue
            state.step += 1
            stopping = stop.should_stop()
            metrics.step(state, force=stopping or state.done, lr=lr)
            acceptance.maybe_run(state, head)
            if checkpointer.due(state) or stopping or state.done:
                saved = checkpointer.save(state)
            if stopping or state.done:
                break
    # then: export the unwrapped head (accelerator.get_state_dict) with heads.artifact
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate import utils as accelerate_utils
from accelerate.utils import DistributedType, ProjectConfiguration, parse_flag_from_env, set_seed
from torch import nn
from torch.utils.data import DataLoader, Sampler

from train.config import config_diff, config_to_dict, may_change_on_resume, save_config

STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


# ------------------------------------------------------------------------------------------------
# Accelerator and optimizer


def _device_backend_available() -> bool:
    """Whether a device accelerate would run a multi-process job on (CUDA, XPU, NPU, ...) exists."""
    probes = ("is_xpu_available", "is_npu_available", "is_mlu_available", "is_sdaa_available",
              "is_musa_available", "is_hpu_available", "is_neuron_available",
              "is_torch_xla_available")
    return torch.cuda.is_available() or any(getattr(accelerate_utils, name)() for name in probes)


def launched_on_cpu() -> bool:
    """True for a multi-process launch (torchrun sets LOCAL_RANK) on a machine without a device.

    accelerate then needs ``cpu=True`` to set up gloo (MULTI_CPU); without it every process
    would run alone and they would all write the same checkpoints.
    """
    return int(os.environ.get("LOCAL_RANK", -1)) != -1 and not _device_backend_available()


def resolve_mixed_precision(setting: str, cpu: bool = False) -> str:
    """``auto`` -> bf16 on a CUDA device (fp16 where bf16 is unsupported), ``no`` elsewhere.

    The training config decides, not ``accelerate launch``: the launcher always exports a
    precision (``no`` when its config file names none), which would silently turn bf16 off.
    """
    if setting != "auto":
        return setting
    if torch.cuda.is_available() and not cpu and not parse_flag_from_env("ACCELERATE_USE_CPU"):
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "no"


def make_accelerator(cfg) -> Accelerator:
    """The run's Accelerator (precision, accumulation, trackers, project dir), then the seed.

    Call it first: the seed must be set before the head is built so that its initialisation is
    the same on every process and in every rerun.
    """
    cpu = launched_on_cpu()
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=resolve_mixed_precision(cfg.mixed_precision, cpu),
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        log_with="wandb" if cfg.report_to == "wandb" else None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                            logging_dir=cfg.output_dir),
        step_scheduler_with_optimizer=False,
    )
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto":
        # DeepSpeed clips inside its own step; the training config says by how much
        plugin.deepspeed_config["gradient_clipping"] = float(cfg.max_grad_norm)
    set_seed(cfg.seed)
    return accelerator


def refuse_sharded(accelerator: Accelerator, why: str) -> None:
    """Refuse FSDP and DeepSpeed ZeRO-3, which split a model's weights over processes.

    ``why``: what the trainer does from one process that needs the whole model there.
    """
    sharded = accelerator.distributed_type == DistributedType.FSDP or (
        accelerator.distributed_type == DistributedType.DEEPSPEED
        and accelerator.state.deepspeed_plugin.zero_stage == 3)
    if sharded:
        raise ValueError(f"{why}: launch with DDP (configs/accelerate/multi_gpu.yaml) or "
                         "DeepSpeed ZeRO-2, not FSDP / ZeRO-3")


def make_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices only (not biases, norms)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError(f"{type(model).__name__} has no trainable parameters: the module given to "
                         f"make_optimizer must be the draft being trained, not the frozen target")
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.learning_rate,
                             betas=(cfg.adam_beta1, cfg.adam_beta2))


def learning_rate(cfg, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) out of ``total_steps``.

    Linear warmup from ``learning_rate / warmup_steps`` to ``learning_rate`` over the first
    ``warmup_steps`` steps, then constant, or a linear or cosine decay that reaches
    ``min_lr_ratio * learning_rate`` at ``total_steps``.
    """
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.learning_rate * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape)


def apply_learning_rate(optimizer, cfg, state: TrainState) -> float:
    """Set the learning rate of the optimizer step being taken (``state.step`` done so far)."""
    lr = learning_rate(cfg, state.step, state.total_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


# ------------------------------------------------------------------------------------------------
# Data order


class EpochSampler(Sampler[int]):
    """Row indices in a seeded order per epoch, whole optimizer steps only, resumable mid-epoch.

    Epoch ``e`` is a permutation drawn from a generator seeded with ``seed + e`` (or the rows in
    order when ``shuffle`` is off), cut to a multiple of ``samples_per_step``: every optimizer step
    sees a full global batch, and an epoch never ends inside a gradient accumulation cycle. Every
    process draws the same permutation; accelerate hands each process its share of each batch.
    After :meth:`start_at` the epoch holding that step starts at the sample after those used.
    """

    def __init__(self, num_rows: int, samples_per_step: int, seed: int, shuffle: bool = True):
        if samples_per_step < 1:
            raise ValueError(f"samples_per_step must be >= 1, got {samples_per_step}")
        self.num_rows = num_rows
        self.samples_per_step = samples_per_step
        self.steps_per_epoch = num_rows // samples_per_step
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training data has {num_rows} rows, fewer than one global batch of "
                f"{samples_per_step} (per_device_batch_size x processes x "
                f"gradient_accumulation_steps): add data or lower the batch size")
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._start = (0, 0)  # (epoch, samples of it already used)

    @property
    def samples_per_epoch(self) -> int:
        return self.steps_per_epoch * self.samples_per_step

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, step: int) -> None:
        """Continue after ``step`` optimizer steps."""
        epoch, within = divmod(step, self.steps_per_epoch)
        self._start = (epoch, within * self.samples_per_step)

    def _skip(self) -> int:
        return self._start[1] if self.epoch == self._start[0] else 0

    def order(self, epoch: int) -> list[int]:
        """The epoch's full order (before skipping)."""
        if not self.shuffle:
            return list(range(self.samples_per_epoch))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_rows, generator=generator)[: self.samples_per_epoch].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch)[self._skip():])

    def __len__(self) -> int:
        return self.samples_per_epoch - self._skip()


def _ignore_stop_signals(worker_id: int) -> None:
    # Ctrl-C reaches the DataLoader workers too; the main process decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_train_dataloader(dataset, cfg, accelerator: Accelerator,
                          collate_fn: Callable | None = None) -> DataLoader:
    """A DataLoader over ``dataset`` in :class:`EpochSampler` order; pass it to ``prepare``.

    ``per_device_batch_size`` rows per micro-batch; a global batch (one optimizer step) is that
    times the processes times ``gradient_accumulation_steps``.
    """
    samples_per_step = (cfg.per_device_batch_size * accelerator.num_processes
                        * accelerator.gradient_accumulation_steps)
    sampler = EpochSampler(len(dataset), samples_per_step, seed=cfg.seed, shuffle=cfg.shuffle)
    return DataLoader(
        dataset, batch_size=cfg.per_device_batch_size, sampler=sampler, drop_last=True,
        collate_fn=collate_fn, num_workers=cfg.num_workers,
        # its own generator: worker seeds come from it, not from the global RNG that dropout uses
        generator=torch.Generator().manual_seed(cfg.seed),
        worker_init_fn=_ignore_stop_signals if cfg.num_workers else None,
        pin_memory=accelerator.device.type == "cuda",
    )


def epoch_sampler(loader) -> EpochSampler:
    """The :class:`EpochSampler` inside a (possibly prepared) DataLoader."""
    pending, seen = [loader], set()
    while pending:
        obj = pending.pop()
        if isinstance(obj, EpochSampler):
            return obj
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        pending += [getattr(obj, name, None) for name in ("batch_sampler", "sampler")]
    raise ValueError(f"{type(loader).__name__} has no EpochSampler: build the DataLoader with "
                     f"train.checkpoints.make_train_dataloader, so that a resume can continue "
                     f"the data order exactly")


def train_batches(loader, state: TrainState) -> Iterator[Any]:
    """Micro-batches from the state's position on, epoch after epoch, without end.

    The loop stops it (``state.done``); starting an epoch seeds its order from ``seed + epoch``.
    """
    sampler = epoch_sampler(loader)
    if state.done:  # resumed at or past the end (max_steps lowered): nothing left to train
        return
    sampler.start_at(state.step)
    epoch = state.step // sampler.steps_per_epoch
    try:
        while True:
            sampler.set_epoch(epoch)
            if hasattr(loader, "set_epoch"):  # a prepared loader re-sets its sampler's epoch
                loader.set_epoch(epoch)
            yield from loader
            epoch += 1
    finally:
        # leaving mid-epoch: tell accelerate's gradient state that this loader is done
        if hasattr(loader, "end"):
            loader.end()


# ------------------------------------------------------------------------------------------------
# Training state and checkpoints


@dataclass
class TrainState:
    """Where training stands. Everything else about the position is derived from ``step``."""

    step: int  # optimizer steps done
    total_steps: int  # training ends here (max_steps, or num_epochs worth of steps)
    steps_per_epoch: int
    samples_per_step: int  # global batch: rows per optimizer step over all processes
    wandb_run_id: str
    resumed_from: Path | None = None

    @property
    def epoch(self) -> float:
        return self.step / self.steps_per_epoch

    @property
    def samples_seen(self) -> int:
        return self.step * self.samples_per_step

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps


def planned_steps(cfg, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: ``max_steps`` or ``num_epochs`` epochs, whichever is first."""
    limits = [cfg.max_steps] if cfg.max_steps is not None else []
    if cfg.num_epochs is not None:
        limits.append(cfg.num_epochs * steps_per_epoch)
    return min(limits)


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (``step_<N>`` holding trainer_state.json) in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (a ``checkpoints/`` folder), or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def read_checkpoint_state(path: str | os.PathLike) -> dict:
    """The trainer_state.json of a checkpoint directory."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise ValueError(f"{path} is not a complete draftsmith checkpoint (no {STATE_FILE})")
    recorded = json.loads(file.read_text())
    if recorded.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path} was written by a newer draftsmith (checkpoint format "
                         f"{recorded['format_version']} > {FORMAT_VERSION}); upgrade draftsmith")
    return recorded


def _fsync_tree(directory: Path) -> None:
    """Flush a finished checkpoint to disk before it is renamed into place."""
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Checkpointer:
    """Saves ``checkpoints/step_<N>`` atomically, prunes old ones, and resumes from them.

    Build it after ``accelerator.prepare`` (``resume`` loads into the prepared objects).
    ``target_identity`` is ``Target.identity()``: a checkpoint is refused by a run for another
    target. A fresh run (``resume`` none) refuses an ``output_dir`` that already holds
    checkpoints, rather than mixing two runs in one directory.
    """

    def __init__(self, accelerator: Accelerator, cfg, target_identity: dict, loader):
        self.accelerator = accelerator
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.root = self.output_dir / "checkpoints"
        self.sampler = epoch_sampler(loader)
        self.target_identity = dict(target_identity)
        self.last_saved_step: int | None = None
        existing = latest_checkpoint(self.root)
        if cfg.resume is None and existing is not None:
            raise ValueError(
                f"output_dir {self.output_dir} already holds checkpoints (newest: {existing.name});"
                f" continue that run with --resume latest, or start a new one in another "
                f"--output_dir")
        if accelerator.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.output_dir / "config.yaml")
        accelerator.wait_for_everyone()

    def _fresh_state(self) -> TrainState:
        return TrainState(
            step=0, total_steps=planned_steps(self.cfg, self.sampler.steps_per_epoch),
            steps_per_epoch=self.sampler.steps_per_epoch,
            samples_per_step=self.sampler.samples_per_step,
            wandb_run_id=secrets.token_hex(4),
        )

    def resolve(self, spec: str) -> Path | None:
        """The checkpoint ``spec`` names: ``latest`` (None if there is none yet), a ``step_<N>``
        directory, or a run directory / ``checkpoints`` folder (its newest checkpoint)."""
        if spec == "latest":
            return latest_checkpoint(self.root)
        path = Path(spec).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"checkpoint to resume from not found: {spec}")
        if (path / STATE_FILE).is_file():
            return path
        newest = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
        if newest is None:
            raise ValueError(f"{spec} is neither a checkpoint (no {STATE_FILE}) nor a run "
                             f"directory holding checkpoints/step_<N>; give one of those or "
                             f"'latest'")
        return newest

    def check_compatible(self, recorded: dict, path: Path) -> None:
        """Refuse a checkpoint this run cannot continue exactly, naming what differs."""
        cls = type(self.cfg).__name__
        if recorded.get("config_class") != cls:
            raise ValueError(f"{path} was written by a trainer configured with "
                             f"{recorded.get('config_class')}, not {cls}: resume it with the "
                             f"trainer that wrote it")
        changed = config_diff(self.cfg, recorded["config"], ignore=may_change_on_resume(self.cfg))
        if changed:
            mine = config_to_dict(self.cfg)
            detail = "; ".join(f"{k}: {recorded['config'].get(k)!r} in the checkpoint, "
                               f"{mine.get(k)!r} now" for k in changed)
            raise ValueError(
                f"cannot resume from {path}: training-relevant config key(s) "
                f"{', '.join(map(repr, changed))} changed ({detail}); set them back to continue "
                f"this run, or start a new run in another --output_dir")
        theirs = recorded.get("target", {})
        wrong = [k for k in sorted(set(theirs) | set(self.target_identity))
                 if theirs.get(k) != self.target_identity.get(k)]
        if wrong:
            detail = "; ".join(f"{k}: {theirs.get(k)!r} there, {self.target_identity.get(k)!r} "
                               f"here" for k in wrong)
            raise ValueError(f"cannot resume from {path}: it was trained for another target "
                             f"({detail}); resume with the target it was trained for")
        if recorded["samples_per_step"] != self.sampler.samples_per_step:
            raise ValueError(
                f"cannot resume from {path} exactly: its global batch was "
                f"{recorded['samples_per_step']} rows per optimizer step, now it is "
                f"{self.sampler.samples_per_step} (per_device_batch_size "
                f"{self.cfg.per_device_batch_size} x {self.accelerator.num_processes} processes x "
                f"gradient_accumulation_steps {self.accelerator.gradient_accumulation_steps}); "
                f"choose values whose product is {recorded['samples_per_step']}")
        if recorded["dataset_rows"] != self.sampler.num_rows:
            raise ValueError(
                f"cannot resume from {path}: the training data had {recorded['dataset_rows']} "
                f"rows then and {self.sampler.num_rows} now, so the data order would differ; "
                f"resume with the same data (and max_length), or start a new run")

    def resume(self) -> TrainState:
        """A fresh state (``cfg.resume`` none), or the loaded state of the checkpoint it names."""
        spec = self.cfg.resume
        if spec is None:
            return self._fresh_state()
        if not self.accelerator._models:
            raise ValueError("Checkpointer.resume() loads into the prepared head and optimizer: "
                             "call it after accelerator.prepare(head, optimizer, loader)")
        path = self.resolve(spec)
        if path is None:
            self.accelerator.print(f"[draftsmith] --resume latest: no checkpoint in {self.root} "
                                   f"yet, starting at step 0")
            return self._fresh_state()
        recorded = read_checkpoint_state(path)
        self.check_compatible(recorded, path)
        newer = [p.name for p in list_checkpoints(self.root)
                 if int(_STEP_DIR.match(p.name).group(1)) > recorded["step"]]
        if newer:
            raise ValueError(
                f"cannot resume from {path} into {self.output_dir}: it holds newer checkpoints "
                f"({', '.join(newer)}) of another continuation, which 'latest' would pick up "
                f"later; resume into a new --output_dir")
        if recorded.get("num_processes") != self.accelerator.num_processes:
            self.accelerator.print(
                f"[draftsmith] {path} was saved by {recorded.get('num_processes')} process(es), "
                f"this run has {self.accelerator.num_processes}: data order and learning rate "
                f"continue exactly, random streams (dropout, noise) do not")
        self.accelerator.load_state(str(path))
        self.last_saved_step = recorded["step"]
        state = self._fresh_state()
        state.step = recorded["step"]
        state.wandb_run_id = recorded.get("wandb_run_id") or state.wandb_run_id
        state.resumed_from = path
        self.accelerator.print(f"[draftsmith] resumed from {path}: step {state.step} of "
                               f"{state.total_steps}, epoch {state.epoch:.2f}")
        return state

    def due(self, state: TrainState) -> bool:
        """Whether ``save_every`` asks for a checkpoint after this step."""
        return bool(self.cfg.save_every) and state.step % self.cfg.save_every == 0

    def save(self, state: TrainState) -> Path:
        """Write ``checkpoints/step_<N>`` atomically (every process must call it), then prune."""
        final = self.root / f"step_{state.step}"
        if self.last_saved_step == state.step:
            return final
        accelerator = self.accelerator
        tmp = self.root / f".tmp-step_{state.step}"
        if accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            record = {
                "format_version": FORMAT_VERSION, "step": state.step, "epoch": state.epoch,
                "samples_seen": state.samples_seen, "samples_per_step": state.samples_per_step,
                "steps_per_epoch": state.steps_per_epoch, "dataset_rows": self.sampler.num_rows,
                "num_processes": accelerator.num_processes, "wandb_run_id": state.wandb_run_id,
                "config_class": type(self.cfg).__name__, "config": config_to_dict(self.cfg),
                "target": self.target_identity,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            # written last: its presence is what marks a checkpoint complete
            (tmp / STATE_FILE).write_text(json.dumps(record, indent=2))
            _fsync_tree(tmp)
            if final.exists():
                old = self.root / f".old-step_{state.step}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
            self.prune()
        accelerator.wait_for_everyone()
        self.last_saved_step = state.step
        return final

    def prune(self) -> None:
        """Keep the newest ``keep_checkpoints``; remove leftovers of interrupted saves."""
        for child in self.root.iterdir():
            if child.name.startswith((".tmp-step_", ".old-step_")):
                shutil.rmtree(child, ignore_errors=True)
        keep = self.cfg.keep_checkpoints
        if keep is not None:
            for old in list_checkpoints(self.root)[:-keep]:
                shutil.rmtree(old)


# ------------------------------------------------------------------------------------------------
# Stopping on SIGINT / SIGTERM


class GracefulStop:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each optimizer step.

    The first signal lets the current step finish; the loop then saves a checkpoint and leaves.
    A second signal aborts at once (KeyboardInterrupt) without saving; the newest complete
    checkpoint stays intact. A repeat within ``grace_s`` seconds counts as the same signal:
    launchers forward a Ctrl-C the workers already received from the terminal (torchrun sends the
    same signal again, then SIGKILL after 30 s). Used as ``with GracefulStop(accelerator) as
    stop:``; outside the main thread no handler can be installed and only :meth:`request` stops.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, accelerator: Accelerator | None = None, grace_s: float = 1.0):
        self.accelerator = accelerator
        self.grace_s = grace_s
        self.reason: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.reason is not None:
            if now - self._first_at < self.grace_s:
                return
            self.__exit__()
            raise KeyboardInterrupt(f"second stop signal ({name}): aborting without saving")
        self.reason = name
        self._first_at = now
        # os.write, not print: the handler may interrupt a print to the same stream
        os.write(sys.stderr.fileno(), (
            f"\n[draftsmith] {name} received: finishing this step, saving a checkpoint, then "
            f"stopping (send {name} again to abort at once)\n").encode())

    def request(self, reason: str = "stop requested") -> None:
        """Stop after the current step, as a signal would (for time limits and tests)."""
        self.reason = reason

    def should_stop(self) -> bool:
        """Whether any process was asked to stop. Every process must call it at the same step."""
        local = self.reason is not None
        accelerator = self.accelerator
        if accelerator is None or accelerator.num_processes == 1:
            return local
        if accelerator.distributed_type == DistributedType.NO:
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=accelerator.device)
        agreed = bool(accelerator.reduce(flag, reduction="sum").item() > 0)
        if agreed and self.reason is None:
            self.reason = "a stop signal on another process"
        return agreed

    def message(self, state: TrainState, checkpoint: Path) -> str:
        return (f"[draftsmith] stopped by {self.reason} after step {state.step} of "
                f"{state.total_steps}; checkpoint {checkpoint}; continue with --resume latest "
                f"(same --output_dir)")
