"""Atomic directory writes: the one way draftsmith creates or replaces a directory.

    write_dir(dest, fill, kind="export", protect=[source])

``fill(tmp)`` writes the content into a fresh directory beside ``dest``; a marker file
(:data:`MARKER`, JSON naming the ``kind`` of directory and what wrote it) is added, every file and
directory is made readable by others (files 0644, directories 0755: a server running as another
user must be able to read an export), everything is fsynced, and the directory is renamed into
place. A crash leaves either the old directory or the new one (plus, at worst, a ``.tmp-`` or
``.old-`` sibling), never half of one.

Replacing an existing ``dest`` is allowed when it is empty, or when it carries the marker of the
same ``kind`` (an earlier export replaced by a new export), or when the user asked for it
(``overwrite=True``, the CLIs' ``--overwrite``). Never, not even with ``overwrite``, when ``dest``
is or contains one of the ``protect`` paths (the source of the operation). Anything else is
refused with a :class:`ValueError` that names the directory and what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

MARKER = ".draftsmith"
FILE_MODE = 0o644
DIR_MODE = 0o755


def read_marker(directory: str | os.PathLike) -> dict | None:
    """The marker of a directory draftsmith wrote ({"kind": ..., "written_by": ...}), else None."""
    path = Path(directory) / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("written_by") == "draftsmith" else None


def _inside(path: Path, ancestor: Path) -> bool:
    return path == ancestor or ancestor in path.parents


def check_destination(
    dest: str | os.PathLike,
    *,
    kind: str,
    overwrite: bool = False,
    protect: Iterable[str | os.PathLike] = (),
) -> Path:
    """Refuse a destination that write_dir may not create or replace; -> its absolute path.

    Call it before long work so a bad ``--out`` fails at once, not after the work is done.
    """
    dest = Path(dest).expanduser()
    real = dest.resolve()
    for source in protect:
        source = Path(source).expanduser().resolve()
        if _inside(source, real):
            what = "is" if source == real else "contains"
            raise ValueError(
                f"{dest} {what} the source of this operation ({source}); it is never replaced, "
                "not even with --overwrite: choose another output directory"
            )
    if dest.is_symlink():
        raise ValueError(f"{dest} is a symbolic link; give the real directory or a new path")
    if not dest.exists():
        if dest.parent.exists() and not os.access(dest.parent, os.W_OK | os.X_OK):
            raise ValueError(f"cannot create {dest}: {dest.parent} is not writable")
        return real
    if not dest.is_dir():
        raise ValueError(f"{dest} exists and is not a directory; choose a directory path")
    if not os.access(dest.parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot replace {dest}: {dest.parent} is not writable")
    entries = sorted(p.name for p in dest.iterdir())
    if not entries or overwrite:
        return real
    marker = read_marker(dest)
    if marker is not None and marker.get("kind") == kind:
        return real
    if marker is not None:
        raise ValueError(
            f"{dest} holds a draftsmith {marker.get('kind')!r}, not an earlier {kind}; choose a "
            "new directory, or pass --overwrite to replace it"
        )
    raise ValueError(
        f"{dest} exists and holds files draftsmith did not write ({', '.join(entries[:3])}"
        f"{', ...' if len(entries) > 3 else ''}); choose a new directory, or pass --overwrite "
        "to replace it"
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish_tree(root: Path) -> None:
    """Modes 0644 / 0755 and fsync, deepest first (a directory after its entries)."""
    for current, dirs, files in os.walk(root, topdown=False):
        here = Path(current)
        for name in files:
            path = here / name
            if path.is_symlink():
                continue
            os.chmod(path, FILE_MODE)
            _fsync(path)
        for name in dirs:
            if not (here / name).is_symlink():
                os.chmod(here / name, DIR_MODE)
        os.chmod(here, DIR_MODE)
        _fsync(here)


def write_dir(
    dest: str | os.PathLike,
    fill: Callable[[Path], None],
    *,
    kind: str,
    overwrite: bool = False,
    protect: Iterable[str | os.PathLike] = (),
    marker: dict | None = None,
) -> Path:
    """Write a directory atomically (see the module docstring); -> ``dest``.

    ``fill(tmp)`` writes the files into ``tmp``; ``kind`` names what the directory is (``export``,
    ``artifact``, ``checkpoint``, ...); ``marker`` adds fields to the marker file.
    """
    protect = list(protect)
    check_destination(dest, kind=kind, overwrite=overwrite, protect=protect)
    dest = Path(dest).expanduser()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    old: Path | None = None
    try:
        fill(tmp)
        info = {"written_by": "draftsmith", "kind": kind, **(marker or {})}
        (tmp / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        _finish_tree(tmp)
        # checked again just before the swap: the destination may have changed during fill
        check_destination(dest, kind=kind, overwrite=overwrite, protect=protect)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / dest.name)
        os.replace(tmp, dest)
        _fsync(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and (old / dest.name).exists() and not dest.exists():
            os.replace(old / dest.name, dest)  # put the previous directory back
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest
