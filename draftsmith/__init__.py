"""draftsmith: train speculative-decoding drafts from a frozen target and measure them exactly.

The ``draftsmith`` command (:mod:`draftsmith.cli`) is the front door. Everything installed lives
under this one name; its floors, lowest first (docs/design.md):

- ``draftsmith.files``: output directories and atomic writes, the file formats read and written,
  the command line's one error tail;
- ``draftsmith.targets``: loading the frozen target (one process or sharded) and its features;
- ``draftsmith.heads``: the draft modules and their losses (Medusa, EAGLE, DFlash, the distilled
  draft LM), their artifacts and draft vocabularies;
- ``draftsmith.layouts``: exports into serving engines' layouts, llama.cpp;
- ``draftsmith.eval``: the evaluator (engine, proposers, benchmark, reports);
- ``draftsmith.train``: data, the trainers, memory and speed planning.

In a wheel they are subpackages of this folder. In a checkout they are the top-level folders
``files/``, ``targets/``, ``heads/``, ... beside this one (where ``accelerate launch
train/eagle.py`` and ``python -m draftsmith.eval.bench`` keep working): this package then also searches the
checkout's root for its subpackages.
"""

from pathlib import Path as _Path

FLOORS = ("files", "targets", "heads", "layouts", "eval", "train")


def _checkout_root() -> _Path | None:
    """The repository root when this is a source checkout (its floors beside this folder)."""
    here = _Path(__file__).resolve().parent
    if (here / "heads").is_dir():  # a wheel: the floors are inside
        return None
    root = here.parent
    marker = root / "pyproject.toml"
    if marker.is_file() and all((root / f / "__init__.py").is_file() for f in FLOORS):
        return root
    return None


_root = _checkout_root()
if _root is not None and str(_root) not in __path__:
    __path__.append(str(_root))
