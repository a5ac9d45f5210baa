"""What a training step really holds, measured by the allocator, beside what the planner planned.

    python -m draftsmith.train.memory_probe --config configs/eagle/tiny.yaml [--steps 2] [--key value ...]

Builds the trainer's recipe as ``train/<method>.py`` does (evaluation, checkpoints and W&B off,
a temporary output directory), then runs ``steps`` optimizer steps and measures:

* ``held_before``: the bytes of the tensors that exist before the first step and stay through
  it: the frozen target's parameters and buffers, the trained module's parameters (counted once
  per storage: tied weights are one tensor);
* ``step_peak``: the most bytes the steps had allocated at once on top of those, from the
  allocator's own events (on a GPU ``torch.cuda.max_memory_allocated``; on a CPU the profiler's
  allocation events, ``profile_memory=True``, whose running total is c10's CPU allocator);
* ``saved_for_backward``: the largest total, over the micro-batches, of the tensors autograd
  saved for the backward pass (``saved_tensors_hooks``; each storage once, parameters and the
  frozen target's weights excluded): what the planner's "activations" terms stand for;
* ``trained_parameters`` and ``frozen_target_parameters``: counted on the modules;

and prints one JSON object with them beside the planner's parts (``draftsmith.train.memory``'s estimate for
the same config, device and process count) and ``planned_tensors`` (its total less the process
term, which is not tensors) over ``measured_tensors`` (``held_before + step_peak``). The process
term itself is ``resident - measured_tensors`` on a CPU: the resident set's high-water mark
(VmHWM) less the tensors.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from draftsmith.files.command_line import program, run_command
from draftsmith.train.config import parse_config
from draftsmith.train.estimate import GIB
from draftsmith.train.recipes import TRAINERS, Trainer, trainer_of
from draftsmith.train.speed import resident_high_water_gib

PROCESS_PART = "process"  # the estimate's process term starts with this word


def held_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the parameters and buffers of ``modules``, each storage counted once."""
    seen: dict[int, int] = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def cpu_allocation_peak(events, windows: list[tuple[int, int]] = ()) -> tuple[int, int]:
    """(largest running total of the allocation events outside ``windows``, largest inside
    them), bytes over the total when the events start; events are (time ns, bytes), frees
    negative, windows (start ns, end ns)."""
    running = outside = inside = 0
    for moment, size in sorted(events):
        running += size
        if any(start <= moment <= end for start, end in windows):
            inside = max(inside, running)
        else:
            outside = max(outside, running)
    return outside, inside


class OptimizerSteps:
    """The (start ns, end ns) of every optimizer step taken while it is entered (torch's global
    optimizer-step hooks), in the profiler's clock (``time.time_ns``)."""

    def __enter__(self):
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.windows: list[tuple[int, int]] = []
        self._start = 0

        def before(*_):
            self._start = time.time_ns()

        def after(*_):
            self.windows.append((self._start, time.time_ns()))

        self._handles = [register_optimizer_step_pre_hook(before),
                         register_optimizer_step_post_hook(after)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()


def _allocation_events(prof) -> list[tuple[int, int]]:
    """(time ns, bytes) of every allocation and free the CPU allocator reported to ``prof``."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            out.append((node.start_time_ns, int(node.extra_fields.alloc_size)))
        stack.extend(node.children)
    return out


@contextmanager
def allocation_peak(device: torch.device):
    """``with allocation_peak(device) as peak:`` ... then ``peak["bytes"]``: the most bytes
    allocated at once inside the block beyond what was allocated when it began; on a CPU also
    ``peak["optimizer"]`` and ``peak["forward_backward"]``, the most inside optimizer steps and
    outside them."""
    result: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["bytes"] = int(torch.cuda.max_memory_allocated(device) - start)
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            OptimizerSteps() as steps:
        yield result
    outside, inside = cpu_allocation_peak(_allocation_events(prof), steps.windows)
    result.update(bytes=max(outside, inside), optimizer=inside, forward_backward=outside)


class SavedTensors:
    """The bytes autograd saves for backward in each micro-batch (each storage once), excluding
    the storages in ``exclude`` (weights, which exist anyway)."""

    def __init__(self, exclude: Iterable[nn.Module]):
        self.exclude = {t.untyped_storage().data_ptr() for m in exclude
                        for t in [*m.parameters(), *m.buffers()]}
        self.per_micro_batch: list[int] = []
        self._seen: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.exclude and storage.device.type != "meta":
            self._seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def wrap(self, step):
        def counted(model, batch, micro_index):
            self._seen = {}
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                out = step(model, batch, micro_index)
            self.per_micro_batch.append(sum(self._seen.values()))
            return out
        return counted


def probe(trainer: Trainer | str, argv: list[str], steps: int = 2) -> dict:
    """Run ``steps`` optimizer steps of the config in ``argv`` and measure them (module doc)."""
    trainer = TRAINERS[trainer] if isinstance(trainer, str) else trainer
    with tempfile.TemporaryDirectory(prefix="draftsmith-memory-") as scratch:
        defaults = ["--output_dir", str(Path(scratch) / "run"), "--eval_every", "0",
                    "--save_every", "0", "--report_to", "none", "--resume", "none"]
        cfg = parse_config(trainer.config_class, [*defaults, *argv, "--max_steps", str(steps),
                                                  "--num_epochs", "none"])
        if hasattr(cfg, "heldout_every"):
            cfg.heldout_every = 0
        recipe = trainer.build(cfg)
        device = recipe.accelerator.device
        processes = recipe.accelerator.num_processes
        planned = trainer.memory.estimate_run(cfg, device.type, processes)
        frozen = recipe.target.model
        trained = recipe.model
        before = held_bytes([frozen, trained])
        target_bytes = held_bytes([frozen])
        saved = SavedTensors([frozen, trained])
        recipe.step = saved.wrap(recipe.step)
        # the target's weight digest, once per directory and before any step: one weight's copy
        # at a time, freed before the first forward; computed here, outside the window
        recipe.target.identity()
        with allocation_peak(device) as peak:
            result = recipe.train()
        result.metrics.close()
    process = {k: v for k, v in planned.parts.items() if k.startswith(PROCESS_PART)}
    tensors = {k: v for k, v in planned.parts.items() if k not in process}
    measured = before + peak["bytes"]
    planned_tensors = planned.total - sum(process.values())  # held + the larger phase
    resident = resident_high_water_gib() if device.type == "cpu" else None
    return {
        "trainer": trainer.name, "argv": argv, "device": device.type, "steps": steps,
        "tokens_per_micro_batch": planned.tokens,
        "held_before_gib": round(before / GIB, 4),
        "step_peak_gib": round(peak["bytes"] / GIB, 4),
        "forward_backward_peak_gib": (round(peak["forward_backward"] / GIB, 4)
                                      if "forward_backward" in peak else None),
        "optimizer_step_peak_gib": (round(peak["optimizer"] / GIB, 4)
                                    if "optimizer" in peak else None),
        "measured_tensors_gib": round(measured / GIB, 4),
        "planned_tensors_gib": round(planned_tensors / GIB, 4),
        "planned_over_measured": round(planned_tensors / measured, 4),
        "saved_for_backward_gib": round(max(saved.per_micro_batch, default=0) / GIB, 4),
        "trained_parameters": sum(p.numel() for p in trained.parameters() if p.requires_grad),
        "frozen_target_parameters": sum(p.numel() for p in frozen.parameters()),
        "frozen_target_bytes": target_bytes,
        "planned_parts_gib": {k: round(v / GIB, 4) for k, v in tensors.items()},
        "planned_parts_bytes": {k: int(v) for k, v in tensors.items()},
        "planned_phases_gib": {k: round(v / GIB, 4) for k, v in planned.phase_bytes().items()},
        "process_term_planned_gib": round(sum(process.values()) / GIB, 4),
        "resident_peak_gib": round(resident, 4) if resident is not None else None,
        "process_term_measured_gib": (round(resident - measured / GIB, 4)
                                      if resident is not None else None),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog=program("python -m draftsmith.train.memory_probe"),
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a trainer config, configs/<method>/...")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps measured")
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default=None,
                        help="the trainer (default: the config's folder)")
    parser.add_argument("--out", default=None, help="also write the JSON object here")
    args, rest = parser.parse_known_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    trainer = trainer_of(args.config, args.trainer)
    result = probe(trainer, ["--config", args.config, *rest], args.steps)
    result["config"] = args.config
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m draftsmith.train.memory_probe"))
