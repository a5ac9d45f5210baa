"""The train floor's table: every trainer, its config class, its recipe and its memory model.

One row per trainer (``train/<name>.py``, configs under ``configs/<name>/``), naming the draft
method it trains (the column of ``draftsmith.heads.methods.HEAD_METHODS``): its config dataclass, ``build``
(the :class:`draftsmith.train.loop.Recipe`), ``main`` and its :class:`draftsmith.train.estimate.MemoryModel` (the
memory one step adds and the keys that shrink it). ``python -m draftsmith.train.speed`` and
``python -m draftsmith.train.memory`` find trainers here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from draftsmith.train import dflash, distill, eagle, medusa
from draftsmith.train.estimate import MemoryModel


@dataclass(frozen=True)
class Trainer:
    """One trainer on the train floor."""

    name: str  # train/<name>.py, configs/<name>/
    column: str  # the draft method it trains (draftsmith.heads.methods.HEAD_METHODS)
    config_class: type
    build: Callable  # cfg -> draftsmith.train.loop.Recipe
    main: Callable  # cfg -> dict (the recipe trained and exported)
    memory: MemoryModel


TRAINERS: dict[str, Trainer] = {
    "eagle": Trainer("eagle", "eagle", eagle.EagleTrainConfig, eagle.build, eagle.main,
                     eagle.MEMORY),
    "medusa": Trainer("medusa", "medusa", medusa.MedusaTrainConfig, medusa.build, medusa.main,
                      medusa.MEMORY),
    "dflash": Trainer("dflash", "dflash", dflash.DFlashTrainConfig, dflash.build, dflash.main,
                      dflash.MEMORY),
    "distill": Trainer("distill", "draft", distill.DistillConfig, distill.build, distill.main,
                       distill.MEMORY),
}


def trainer_of(config_path: str, explicit: str | None) -> Trainer:
    """The trainer a config belongs to: ``--trainer``, else its folder under configs/."""
    name = explicit or Path(config_path).resolve().parent.name
    if name in TRAINERS:
        return TRAINERS[name]
    if explicit:
        raise ValueError(f"unknown trainer {explicit!r}; choose one of {', '.join(TRAINERS)}")
    raise ValueError(f"cannot tell which trainer {config_path} is for (its folder is {name!r}, "
                     f"not one of {', '.join(TRAINERS)}): pass --trainer")
