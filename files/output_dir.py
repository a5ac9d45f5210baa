"""Atomic writes: the one way draftsmith creates or replaces a directory, or a single file.

    write_dir(dest, fill, kind="export", protect=[source])

``fill(tmp)`` writes the content into a fresh directory beside ``dest``; a marker file
(:data:`MARKER`, JSON naming the ``kind`` of directory and what wrote it) is added, every file and
directory is made readable by others (files 0644, directories 0755: a server running as another
user must be able to read an export), everything is fsynced, and the directory is renamed into
place. A crash leaves either the old directory or the new one (plus, at worst, a ``.tmp-`` or
``.old-`` sibling, which names its writer and is deleted by the next write of ``dest`` once that
process is gone: :func:`remove_leftovers`), never half of one.

Replacing an existing ``dest`` is allowed when it is empty, or when it carries the marker of the
same ``kind`` (an earlier export replaced by a new export), or when the user asked for it
(``overwrite=True``, the CLIs' ``--overwrite``). Never, not even with ``overwrite``, when ``dest``
is or contains one of the ``protect`` paths (the source of the operation). Anything else is
refused with a :class:`ValueError` that names the directory and what to do. The same rule holds
for every command's ``--out``/``--output_dir``, files included: :func:`refuse_inputs` (never an
input, nor a directory holding one), :func:`check_file_destination` (a file is replaced only
when it is an earlier output of its kind), :func:`named_paths` (the inputs a command line names).

When several processes fill one directory (a training checkpoint: every process saves its own
part), the two halves of ``write_dir`` are used apart: :func:`stage_dir` makes the marked staging
directory (under a fixed name every process knows), the processes write into it, and one of them
calls :func:`commit_dir`. The marker is written when the staging directory is made, so whatever a
crash leaves behind is recognisably draftsmith's: :func:`remove_dir` deletes only a directory that
is empty or carries the marker of the expected kind.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterable, Mapping
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


def named_paths(*values: str | os.PathLike | None) -> list[Path]:
    """The existing files and directories that command-line values name, resolved: a value that
    is a path, or a ``kind:path`` spec (``eagle:runs/a/artifact``, ``medusa:typical:DIR``) whose
    part after a colon is one. The inputs a command protects from its own ``--out``."""
    found: list[Path] = []
    for value in values:
        if value is None:
            continue
        text = os.fspath(value)
        parts = text.split(":")
        candidates = [text] + [":".join(parts[i:]) for i in range(1, len(parts))]
        for candidate in candidates:
            if candidate and Path(candidate).expanduser().exists():
                found.append(Path(candidate).expanduser().resolve())
                break
    return list(dict.fromkeys(found))


def refuse_inputs(outputs: Iterable[str | os.PathLike], protect: Iterable[str | os.PathLike],
                  *, into: bool = True) -> None:
    """The one rule of every ``--out``/``--output_dir``: no output replaces one of the operation's
    inputs, nor a directory holding one, not even with ``--overwrite``; a ValueError naming both.

    ``outputs`` are the paths the command writes or replaces (a file, a directory it replaces
    whole); ``protect`` its inputs (files or directories). With ``into``, an output inside an
    input directory is refused too (a report over an artifact's config.json, a copy written into
    the artifact it copies); without, only outputs that are or hold an input.
    """
    protect = [Path(p).expanduser().resolve() for p in protect]
    for output in outputs:
        out = Path(output).expanduser()
        real = out.resolve()
        for source in protect:
            if _inside(source, real) or (into and _inside(real, source)):
                what = ("is" if source == real else "contains" if _inside(source, real)
                        else "is inside")
                raise ValueError(
                    f"{out} {what} an input of this operation ({source}); an input is never "
                    "replaced, not even with --overwrite: choose another output path")


def check_destination(
    dest: str | os.PathLike,
    *,
    kind: str,
    overwrite: bool = False,
    protect: Iterable[str | os.PathLike] = (),
    same_as: Mapping[str, object] | None = None,
) -> Path:
    """Refuse a destination that write_dir may not create or replace; -> its absolute path.

    ``same_as``: an existing directory of the same ``kind`` is replaced only when its marker also
    holds these values (a copy replaces an earlier copy of the same source, never another run's
    directory of that kind). Call it before long work so a bad ``--out`` fails at once, not after
    the work is done.
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
        differs = {k: marker.get(k) for k, v in (same_as or {}).items() if marker.get(k) != v}
        if not differs:
            return real
        raise ValueError(
            f"{dest} holds another draftsmith {kind} ({', '.join(f'{k} {v!r}' for k, v in differs.items())}"
            f", not {', '.join(f'{k} {v!r}' for k, v in same_as.items() if k in differs)}); "
            "choose a new directory, or pass --overwrite to replace it")
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


def check_writable_dir(path: str | os.PathLike, what: str = "output directory") -> Path:
    """Refuse a directory path that cannot be created or written; -> its absolute path.

    Checks without writing anything: ``path`` (or, while it does not exist, its nearest existing
    ancestor) must be a writable directory. Call it before long work, so that a bad output path
    fails at once rather than after the work is done.
    """
    path = Path(path).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what} {path} cannot be created: {existing} is a file, not a "
                         "directory; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "is not writable" if existing == path else f"cannot be created in {existing}"
        raise ValueError(f"{what} {path} {where} (no write permission, or a read-only file "
                         "system); choose a path you can write")
    return path


def check_writable_file(path: str | os.PathLike) -> Path:
    """Fail now, not after a long run, when the file ``path`` cannot be written (creates its
    folder)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give a file name inside it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=True):
            pass
    except OSError as err:
        raise ValueError(f"cannot write {path}: {err.strerror or err}") from err
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"cannot write {path}: the file is read-only")
    return path


def check_file_destination(path: str | os.PathLike, *, kind: str,
                           replaceable: Callable[[Path], bool], overwrite: bool = False,
                           protect: Iterable[str | os.PathLike] = ()) -> Path:
    """Refuse a file path that a command may not create or replace; -> its absolute path.

    Never one of the ``protect`` paths (the inputs of the operation) or a file inside one, not
    even with ``overwrite``; an existing file only when ``replaceable(path)`` says it is an
    earlier output of this ``kind`` (a GGUF file, say) or the user passed ``overwrite``. Call it
    before the work, so a bad ``--out`` fails at once.
    """
    path = Path(path).expanduser()
    real = path.resolve()
    refuse_inputs([path], protect)
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give a file name (e.g. {path / 'draft.gguf'})")
    check_writable_file(path)
    if path.exists() and not overwrite and not replaceable(path):
        raise ValueError(f"{path} exists and is not an earlier {kind}; choose a new file name, or "
                         "pass --overwrite to replace it")
    return real


def write_atomic(path: str | os.PathLike, content: str | bytes) -> Path:
    """Write a file whole or not at all: a temporary file beside it, then a rename.

    The file gets the usual permissions (0666 less the umask), so others can read a report.
    """
    path = Path(path)
    data = content.encode("utf-8") if isinstance(content, str) else content
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


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


def _write_marker(directory: Path, kind: str, marker: dict | None) -> None:
    info = {"written_by": "draftsmith", "kind": kind, **(marker or {})}
    (directory / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def _host() -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:40]


def _writer() -> dict:
    """Who writes a staging directory: its marker says so, for :func:`remove_leftovers`."""
    return {"staged_by": {"host": _host(), "pid": os.getpid()}}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_leftovers(dest: str | os.PathLike, *, kind: str) -> list[Path]:
    """Delete what interrupted writes of ``dest`` left beside it; -> what was deleted.

    A write killed before its rename (SIGKILL, SIGTERM without a handler, a power cut) leaves a
    ``.<dest>.tmp-*`` or ``.<dest>.old-*`` sibling. Only those whose marker is of ``kind`` and
    names a writer process on this host that no longer runs are deleted (or that are empty and
    name such a process): a concurrent write, or another machine's, is left alone.
    """
    dest = Path(dest).expanduser()
    removed = []
    if not dest.parent.is_dir():
        return removed
    host = _host()
    for prefix in (f".{dest.name}.tmp-", f".{dest.name}.old-"):
        for leftover in dest.parent.glob(f"{glob.escape(prefix)}*"):
            if leftover.is_symlink() or not leftover.is_dir():
                continue
            writer = (read_marker(leftover) or {}).get("staged_by")
            if writer is None:  # empty: the name says who made it
                parts = leftover.name[len(prefix):].split("-")
                if any(leftover.iterdir()) or len(parts) < 3 or not parts[-2].isdigit():
                    continue
                writer = {"host": "-".join(parts[:-2]), "pid": int(parts[-2])}
            if not isinstance(writer, dict) or writer.get("host") != host or \
                    not isinstance(writer.get("pid"), int) or _alive(writer["pid"]):
                continue
            held = leftover / dest.name
            if prefix.endswith(".old-") and not dest.exists() and held.is_dir():
                os.replace(held, dest)  # killed mid-swap: the previous directory is put back
            try:
                remove_dir(leftover, kind=kind)
            except (ValueError, OSError):
                continue
            removed.append(leftover)
    return removed


def remove_dir(path: str | os.PathLike, *, kind: str) -> None:
    """Delete a directory draftsmith wrote: one that is empty or carries the marker of ``kind``.

    Anything else (a symbolic link, a file, a directory without that marker) is refused with a
    :class:`ValueError` naming it; nothing is deleted then.
    """
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        raise ValueError(f"{path} is not a directory draftsmith wrote; remove it yourself if it "
                         "is not needed")
    if not any(path.iterdir()):
        path.rmdir()
        return
    marker = read_marker(path)
    if marker is None or marker.get("kind") != kind:
        raise ValueError(f"{path} is not a {kind} directory draftsmith wrote (no {MARKER} marker "
                         f"of kind {kind!r}); it is left as it is: move or remove it yourself")
    shutil.rmtree(path)


def stage_dir(dest: str | os.PathLike, *, kind: str, marker: dict | None = None,
              name: str | None = None) -> Path:
    """A new staging directory beside ``dest``, marked at once, for :func:`commit_dir`.

    ``name`` gives it a fixed name (so that every process of a run finds it); an earlier staging
    directory of that name, left by a crash, is removed first (:func:`remove_dir`: only if it is
    empty or marked as ``kind``). Without ``name`` the name is unique (``.<dest>.tmp-XXXX``).
    """
    dest = Path(dest).expanduser()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if name is None:
        remove_leftovers(dest, kind=kind)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{_host()}-{os.getpid()}-",
                                    dir=dest.parent))
    else:
        tmp = dest.parent / name
        if tmp.exists() or tmp.is_symlink():
            remove_dir(tmp, kind=kind)
        tmp.mkdir()
    _write_marker(tmp, kind, {**(marker or {}), **(_writer() if name is None else {})})
    return tmp


def commit_dir(
    tmp: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    kind: str,
    overwrite: bool = False,
    protect: Iterable[str | os.PathLike] = (),
    same_as: Mapping[str, object] | None = None,
) -> Path:
    """Finish a staged directory (modes, fsync) and rename it to ``dest``; -> ``dest``.

    ``dest`` is replaced under :func:`check_destination`'s rules. On any failure the staged
    directory is removed and a previous ``dest`` is kept (or put back).
    """
    tmp = Path(tmp)
    dest = Path(dest).expanduser()
    protect = list(protect)
    old: Path | None = None
    try:
        marker = read_marker(tmp)
        if marker is not None and "staged_by" in marker:  # the finished directory names no writer
            marker.pop("staged_by")
            _write_marker(tmp, marker.pop("kind"), {k: v for k, v in marker.items()
                                                    if k != "written_by"})
        _finish_tree(tmp)
        # checked just before the swap: the destination may have changed while tmp was filled
        check_destination(dest, kind=kind, overwrite=overwrite, protect=protect,
                          same_as=same_as)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-{_host()}-{os.getpid()}-",
                                        dir=dest.parent))
            _write_marker(old, kind, _writer())  # a crash here leaves a holder ours to delete
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


def write_dir(
    dest: str | os.PathLike,
    fill: Callable[[Path], None],
    *,
    kind: str,
    overwrite: bool = False,
    protect: Iterable[str | os.PathLike] = (),
    marker: dict | None = None,
    same_as: Mapping[str, object] | None = None,
) -> Path:
    """Write a directory atomically (see the module docstring); -> ``dest``.

    ``fill(tmp)`` writes the files into ``tmp``; ``kind`` names what the directory is (``export``,
    ``artifact``, ``checkpoint``, ...); ``marker`` adds fields to the marker file; ``same_as``
    (see :func:`check_destination`) restricts which earlier directory of ``kind`` is replaced.
    """
    protect = list(protect)
    check_destination(dest, kind=kind, overwrite=overwrite, protect=protect, same_as=same_as)
    tmp = stage_dir(dest, kind=kind, marker=marker)
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_dir(tmp, dest, kind=kind, overwrite=overwrite, protect=protect,
                      same_as=same_as)
