"""The layouts floor's table: every method's serving layouts, their writer and their check.

One row per method (the column names of ``draftsmith.heads.methods.HEAD_METHODS``), each from the method's
own module here (layouts/eagle.py, layouts/medusa.py, layouts/dflash.py, layouts/draft.py), which keeps its writers
and its readers side by side:

* ``formats``: artifact method -> the formats written (``--format``);
* ``refused``: (artifact method, format) -> why that consumer cannot load it and what to use;
* ``export(artifact_dir, fmt, out_dir, options)``: write one layout;
* ``check(artifact_dir, fmt, out_dir, target) -> bool``: read the export back (and run the
  consumer's own loader where it runs here), printing what was and was not verified;
* ``not_run_here``: format -> why its consumer's own loader cannot run on this machine;
* ``notes(export_dir, fmt)``: what a user must know to serve it (printed after the export).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from draftsmith.layouts import dflash, draft, eagle, medusa


@dataclass(frozen=True)
class MethodLayouts:
    """One method on the layouts floor."""

    method: str  # the column's name (draftsmith.heads.methods.HEAD_METHODS)
    formats: dict[str, tuple[str, ...]]
    refused: dict[tuple[str, str], str]
    export: Callable
    check: Callable
    not_run_here: dict[str, str] = field(default_factory=dict)
    notes: Callable | None = None


LAYOUTS: dict[str, MethodLayouts] = {
    "eagle": MethodLayouts("eagle", eagle.FORMATS, eagle.REFUSED, eagle.export_layout,
                           eagle.check_eagle_export, eagle.NOT_RUN_HERE),
    "medusa": MethodLayouts("medusa", medusa.FORMATS, medusa.REFUSED, medusa.export_layout,
                            medusa.check_medusa_export, medusa.NOT_RUN_HERE,
                            medusa.medusa_export_notes),
    "dflash": MethodLayouts("dflash", dflash.FORMATS, dflash.REFUSED, dflash.export_layout,
                            dflash.check_block_export, dflash.NOT_RUN_HERE),
    "draft": MethodLayouts("draft", draft.FORMATS, draft.REFUSED, draft.export_layout,
                           draft.check_draft_export, draft.NOT_RUN_HERE),
}


def layouts_of(artifact_method: str) -> MethodLayouts:
    """The row whose formats include this artifact method."""
    for row in LAYOUTS.values():
        if artifact_method in row.formats:
            return row
    raise ValueError(f"no serving layout is known for {artifact_method!r} artifacts")


def all_formats() -> dict[str, tuple[str, ...]]:
    """artifact method -> formats, over every row."""
    return {m: f for row in LAYOUTS.values() for m, f in row.formats.items()}


def refused_formats() -> dict[tuple[str, str], str]:
    return {key: why for row in LAYOUTS.values() for key, why in row.refused.items()}
