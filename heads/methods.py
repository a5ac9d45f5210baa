"""The heads floor's table: every draft method, the module that defines it and its artifact.

Each floor has one table with one row per method (a column through the house): this one,
``draftsmith.layouts.table.LAYOUTS`` (its serving layouts), ``draftsmith.eval.methods.BENCH_METHODS`` (its proposer
and benchmark prefix) and ``draftsmith.train.recipes.TRAINERS`` (its trainer, config class and memory
parts). A new method is new files plus one row in each; ``tests/test_house.py`` fails when a
floor lacks a row and shows a toy method working through all four with no other edit.

A row here names the ``method`` values its artifacts' config.json carries (one column may write
several: EAGLE-1 and EAGLE-3), the module that holds its nn.Module and loss, and how an artifact
is loaded onto a target (None for a draft LM, a plain Hugging Face directory that
``heads/distill.py`` loads).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from draftsmith.heads.artifact import read_artifact_config
from draftsmith.heads.dflash import load_dflash
from draftsmith.heads.eagle import load_eagle
from draftsmith.heads.medusa import load_medusa


@dataclass(frozen=True)
class HeadMethod:
    """One method on the heads floor."""

    name: str  # the column's name, the same in every floor's table
    artifact_methods: tuple[str, ...]  # config.json "method" values its artifacts carry
    module: str  # where its nn.Module (and its loss, beside it) live
    load: Callable | None  # load(directory, target, **options) -> the module on the target
    summary: str


HEAD_METHODS: dict[str, HeadMethod] = {
    "eagle": HeadMethod(
        "eagle", ("eagle1", "eagle3"), "draftsmith.heads.eagle", load_eagle,
        "one decoder layer autoregressing in the target's feature space (EAGLE-1: the last "
        "layer's feature; EAGLE-3: fused low/mid/high features, a draft vocabulary)"),
    "medusa": HeadMethod(
        "medusa", ("medusa",), "draftsmith.heads.medusa", load_medusa,
        "K heads on the target's last hidden state, head k guessing token t+1+k"),
    "dflash": HeadMethod(
        "dflash", ("dflash", "dspark"), "draftsmith.heads.dflash", load_dflash,
        "a block draft: a few decoder layers over the target's hidden states proposing a whole "
        "block in one forward (DFlash; DSpark adds a Markov and a confidence head)"),
    "draft": HeadMethod(
        "draft", ("draft",), "draftsmith.heads.distill", None,
        "a small causal LM with the target's tokenizer, distilled from it (a Hugging Face "
        "directory)"),
}


def artifact_methods() -> tuple[str, ...]:
    """Every config.json ``method`` value some row owns."""
    return tuple(m for row in HEAD_METHODS.values() for m in row.artifact_methods)


def head_method(artifact_method: str) -> HeadMethod:
    """The row that owns an artifact's ``method``."""
    for row in HEAD_METHODS.values():
        if artifact_method in row.artifact_methods:
            return row
    raise ValueError(f"unknown artifact method {artifact_method!r}; expected one of "
                     f"{sorted(artifact_methods())}")


def artifact_method(directory: str | os.PathLike) -> str:
    """The method an artifact holds: config.json's ``method``, or ``draft`` for an HF draft."""
    config = read_artifact_config(directory)
    method = config.get("method")
    if method is None and "draftsmith" in config:
        method = "draft"  # a distilled draft is a plain HF directory with a draftsmith block
    if method not in artifact_methods():
        raise ValueError(
            f"{directory}: config.json names method {method!r}; expected one of "
            f"{sorted(artifact_methods())} (is it a draftsmith artifact?)"
        )
    return method
