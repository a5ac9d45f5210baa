"""``python -m draftsmith.train.memory``: the memory estimate a training run is checked against.

    python -m draftsmith.train.memory --config configs/eagle/llama-3.1-8b-instruct.yaml --processes 8

Reads nothing but config.json files. The estimate itself (the parts every run has, the
constants measured in ``reports/memory_growth.json``, the check) is train/estimate.py; each
trainer counts its own parts beside its recipe (``MEMORY`` in train/<method>.py), found through
``draftsmith.train.recipes.TRAINERS``.
"""

from __future__ import annotations

import argparse
import sys

from draftsmith.files.command_line import program, run_command
from draftsmith.train.config import parse_config
from draftsmith.train.estimate import Estimate, Shape
from draftsmith.train.recipes import TRAINERS, trainer_of


def estimate(trainer: str, cfg, target: Shape, *, device: str = "cpu", processes: int = 1,
             draft: Shape | None = None) -> Estimate:
    """Peak bytes of one training step of ``trainer`` (a name in TRAINERS) on one process."""
    if trainer not in TRAINERS:
        raise ValueError(f"unknown trainer {trainer!r}")
    return TRAINERS[trainer].memory.estimate(cfg, target, device=device, processes=processes,
                                             draft=draft)


def estimate_run(trainer: str, cfg, device: str = "cpu", processes: int = 1) -> Estimate:
    """:func:`estimate` for a config, the shapes read from config.json files."""
    return TRAINERS[trainer].memory.estimate_run(cfg, device, processes)


def main(argv: list[str] | None = None) -> Estimate:
    """``python -m draftsmith.train.memory --config CONFIG [--device cuda] [--processes 8] [--key value]``:
    the estimate a run would be checked against, without loading anything but config.json."""
    parser = argparse.ArgumentParser(prog=program("python -m draftsmith.train.memory"), description=main.__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--fsdp2", action="store_true",
                        help="the trained module split over the processes (a launch with "
                        "configs/accelerate/fsdp2.yaml); the target's shards are the config's "
                        "target_parallel")
    args, rest = parser.parse_known_args(argv)
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    trainer = trainer_of(args.config, args.trainer)
    cfg = parse_config(trainer.config_class, ["--config", args.config, *rest])
    if args.processes % cfg.target_parallel:
        raise ValueError(f"target_parallel {cfg.target_parallel} does not divide --processes "
                         f"{args.processes}")
    est = trainer.memory.estimate_run(cfg, args.device, args.processes,
                                      args.processes if args.fsdp2 else 1)
    sharding = []
    if cfg.target_parallel > 1:
        sharding.append(f"the target sharded over {cfg.target_parallel}")
    if args.fsdp2:
        sharding.append(f"the trained module over {args.processes} (FSDP2)")
    print(f"{trainer.name}: one step over {est.tokens} tokens per micro-batch, {args.processes} "
          f"process{'es' if args.processes > 1 else ''} on {args.device}"
          f"{', ' + ' and '.join(sharding) if sharding else ''}:\n{est.table()}")
    return est


if __name__ == "__main__":
    sys.exit(run_command(main, "python -m draftsmith.train.memory"))
