"""How fast a trainer learns, measured: real tokens per second beside the target's own forward.

    python -m draftsmith.train.speed --config configs/eagle/smollm2-135m.yaml --steps 20 [--warmup 3]
                          [--trainer eagle] [--key value ...]

Builds the trainer's recipe exactly as ``train/<method>.py`` does (the method is the config's
folder, ``configs/<method>/...``, or ``--trainer``), times the frozen target's no-grad forward as
the step calls it (``Recipe.target_forward``: the layers it keeps, packed rows' position ids,
the LM head where the step runs it; under the run's autocast, after 3 warm-up micro-batches)
over the micro-batches of the first steps, then trains ``warmup + steps`` optimizer steps and
prints one JSON object:

* ``train_tokens_per_s``: real (non-padding) tokens per second of the timed steps, evaluation and
  checkpointing excluded;
* ``target_forward_tokens_per_s``: the target's forward over the same batches, in this process;
* ``ratio``: the first over the second, so that machines of different speed compare;
* ``padding``: the fraction of computed positions that were padding;
* ``peak_memory_gb`` (the process) and ``step_memory_gb`` (what the training steps added on top
  of the loaded target, data and module: on CUDA the allocator's peak, on Linux CPUs the resident
  set's high-water mark, reset before the first step), beside ``estimated_peak_gb``, the estimate
  of :mod:`draftsmith.train.memory` that ``build`` checks against the device's memory, and
  ``estimated_tensors_gb``, the same less its process term (the CUDA context and the
  allocator's slack, which ``torch.cuda.max_memory_allocated`` does not count);
  ``python -m draftsmith.train.memory_probe`` compares the tensors term by term.

Every key after the options is a config key (``--max_length 2048``, ``--max_tokens_per_batch
8192``...); evaluation, checkpoints and W&B are off and the run goes to a temporary directory
unless ``--output_dir`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from draftsmith.files.command_line import program, run_command
from draftsmith.train.config import parse_config
from draftsmith.train.recipes import TRAINERS, Trainer, trainer_of


def resident_high_water_gib() -> float | None:
    """VmHWM of this process (Linux), in GiB; None where /proc is not available."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def _reset_high_water(device: torch.device) -> float | None:
    """Reset the peak-memory counter; returns the memory in use now (GiB), or None."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**30
    try:  # "5" resets the resident set's high-water mark (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return resident_high_water_gib()


def _high_water(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resident_high_water_gib()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


FORWARD_WARMUP = 3  # micro-batches the target runs before its forward is timed


@torch.no_grad()
def target_forward_tokens_per_s(recipe, steps: int) -> tuple[float, int]:
    """(real tokens per second, tokens) of the target's forward over the first ``steps`` steps'
    micro-batches of this process, as the step calls it (``recipe.target_forward``: the same
    layers kept, packed rows with their position ids, the LM head where the step runs it; the
    decoder alone for a recipe whose step does not run the target), under the run's autocast,
    after :data:`FORWARD_WARMUP` micro-batches (kernel selection, allocator, compiling)."""
    accelerator, target = recipe.accelerator, recipe.target
    forward = recipe.target_forward or (lambda batch: target.decoder(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False))
    micro = [batch for _, (_, _, batches) in zip(range(steps),
                                                 recipe.batches.steps(0, accelerator.device))
             for batch in batches]
    warmup = [micro[i % len(micro)] for i in range(FORWARD_WARMUP)]
    tokens, seconds = 0, 0.0
    with accelerator.autocast():
        for i, batch in enumerate([*warmup, *micro]):
            _sync(accelerator.device)
            started = time.perf_counter()
            forward(dict(batch))
            _sync(accelerator.device)
            if i >= len(warmup):
                seconds += time.perf_counter() - started
                tokens += int(batch["attention_mask"].sum())
    return tokens / seconds, tokens


def measure(trainer: Trainer | str, argv: list[str], steps: int, warmup: int) -> dict:
    trainer = TRAINERS[trainer] if isinstance(trainer, str) else trainer
    config_class = trainer.config_class
    with tempfile.TemporaryDirectory(prefix="draftsmith-speed-") as scratch:
        defaults = ["--output_dir", str(Path(scratch) / "run"), "--eval_every", "0",
                    "--save_every", "0", "--report_to", "none", "--log_every", "1",
                    "--resume", "none"]
        cfg = parse_config(config_class, [*defaults, *argv, "--max_steps", str(warmup + steps),
                                          "--num_epochs", "none"])
        if hasattr(cfg, "heldout_every"):  # the held-out accuracy pass is evaluation too
            cfg.heldout_every = 0
        recipe = trainer.build(cfg)
        device = recipe.accelerator.device
        estimate = trainer.memory.estimate_run(cfg, device.type,
                                               recipe.accelerator.num_processes)
        predicted = estimate.total / 2**30
        # the allocator's peak on a GPU counts tensors only: compare it with this
        predicted_tensors = predicted - sum(
            v for k, v in estimate.parts.items() if k.startswith("process")) / 2**30
        forward, forward_tokens = target_forward_tokens_per_s(recipe, warmup + steps)
        before = _reset_high_water(device)
        result = recipe.train()
        result.metrics.close()
        peak = _high_water(device)
        records = [json.loads(line) for line in
                   (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "tokens_per_s" in r]  # one per step (log_every 1)
    timed, tokens = [], []
    for i, r in enumerate(logged):
        if r["step"] > warmup:
            timed.append(r)
            tokens.append(r["tokens"] - (logged[i - 1]["tokens"] if i else 0))
    if not timed:
        raise ValueError(f"no timed steps: ran {result.state.step} steps, warm-up {warmup}")
    seconds = sum(n / r["tokens_per_s"] for n, r in zip(tokens, timed, strict=True))
    train = sum(tokens) / seconds
    processes = recipe.accelerator.num_processes
    return {
        "trainer": trainer.name, "argv": argv, "steps": len(timed), "warmup_steps": warmup,
        "processes": processes, "mixed_precision": recipe.accelerator.mixed_precision,
        "train_tokens_per_s": round(train, 2),
        # the loop logs tokens over every process; the forward was timed on this one
        "target_forward_tokens_per_s": round(forward * processes, 2),
        "ratio": round(train / (forward * processes), 4),
        "tokens_per_step": round(sum(tokens) / len(timed), 1),
        "padding": round(sum(r["padding"] for r in timed) / len(timed), 4),
        "peak_memory_gb": round(peak, 3) if peak is not None else None,
        "step_memory_gb": round(peak - before, 3) if None not in (peak, before) else None,
        "estimated_peak_gb": round(predicted, 3),  # draftsmith.train.memory's, which build() checks
        "estimated_tensors_gb": round(predicted_tensors, 3),  # the same less the process term
        "loss_last": timed[-1]["loss"],
        "target_forward_tokens": forward_tokens,
        # whether a step runs the target (offline features: the forward is what it would cost)
        "target_forward_in_step": recipe.target_forward is not None,
    }


def logged_step_seconds(records: Sequence[Mapping]) -> list[float]:
    """Seconds of each optimizer step of a run that logged every step (``log_every: 1``): each
    record's new real tokens over its tokens per second (evaluation and checkpoints excluded)."""
    steps = [r for r in records if r.get("tokens_per_s")]
    before = [0] + [r["tokens"] for r in steps[:-1]]
    return [(r["tokens"] - b) / r["tokens_per_s"] for r, b in zip(steps, before, strict=True)]


def steps_for_budget(step_seconds: Sequence[float], probe_seconds: float, budget: float, *,
                     unlogged_steps: int = 0, what: str = "training") -> dict:
    """How many optimizer steps fit ``budget`` seconds of wall time, from a probe run that took
    ``probe_seconds`` and logged ``step_seconds``: a step is the mean of the later half of the
    logged steps (the first few run slower while allocations and caches warm up: 4.0 s falling to
    3.0 s over six steps of an EAGLE-3 run here), the start-up is the probe's time less that many
    such steps (so it holds the early steps' excess, which every run pays again), ``unlogged_steps``
    more ran but were not logged. -> ``{"startup_seconds", "step_seconds", "steps"}``; a budget
    that fits no step is a ValueError."""
    if len(step_seconds) < 2:
        raise ValueError(f"the {what} probe logged {len(step_seconds)} steps; it needs at least 2 "
                         f"(give it more steps)")
    timed = step_seconds[len(step_seconds) // 2:]
    per_step = sum(timed) / len(timed)
    startup = max(0.0, probe_seconds - (len(step_seconds) + unlogged_steps) * per_step)
    fit = math.floor((budget - startup) / per_step)
    if fit < 1:
        raise ValueError(f"a {budget:.0f} s budget fits no {what} step: start-up takes "
                         f"{startup:.0f} s and a step {per_step:.1f} s; give it more time")
    return {"startup_seconds": round(startup, 1), "step_seconds": round(per_step, 2),
            "steps": fit}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog=program("python -m draftsmith.train.speed"), description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a trainer config, configs/<method>/...")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps timed")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps run first, untimed")
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default=None,
                        help="the trainer (default: the config's folder)")
    args, rest = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    trainer = trainer_of(args.config, args.trainer)
    result = measure(trainer, ["--config", args.config, *rest], args.steps, args.warmup)
    result["config"] = args.config
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m draftsmith.train.speed"))
