"""GGUF for llama.cpp: a head's Hugging Face-style layout, converted by llama.cpp's own converter.

    draftsmith export ARTIFACT --format gguf --out draft.gguf [--gguf-type f16]

EAGLE-3 heads are written in the vLLM layout first (llama.cpp's converter reads that as it is,
with ``--target-model-dir``, the target's Hugging Face directory, for its vocabulary and
aux layers) and served with ``llama-server -m TARGET.gguf -md draft.gguf --spec-type
draft-eagle3``; distilled drafts as their Hugging Face directory, served with ``--spec-type
draft-simple``. The head's precision is the converter's ``--outtype`` (``--gguf-type``: f32,
f16, bf16 or q8_0). llama.cpp loads neither EAGLE-1 heads nor Medusa heads; those formats are
refused by the methods' layouts with what to use instead.

The file is written to a temporary name beside ``--out`` and renamed when the converter
succeeded, so a failed conversion leaves no partial GGUF; an existing ``--out`` is replaced only
when it is draftsmith's own earlier export (its metadata names draftsmith as the writer:
:func:`written_by_draftsmith`; any other GGUF only with ``--overwrite``), and never when it is an
input (the artifact, ``--target``). The layout is written into a scratch directory beside
``--out`` (``.<out>.gguf-<host>-<pid>-*``); what a killed export left there and the partial file
are deleted by the next export into the same place once their process is gone.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from draftsmith.files.output_dir import check_file_destination
from draftsmith.layouts.llama_cpp import (
    WRITER,
    WRITER_KEY,
    convert_to_gguf,
    converter,
    host_name,
    stale_writer,
)

FORMAT = "gguf"
DEFAULT_GGUF_TYPE = "f16"


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_value(f, kind: int, depth: int = 0):
    """Read one GGUF metadata value (a string) or skip it (anything else: -> None)."""
    if kind in _GGUF_SCALARS:
        f.seek(_GGUF_SCALARS[kind], os.SEEK_CUR)
        return None
    if kind == _GGUF_STRING:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 1 << 20:
            f.seek(size, os.SEEK_CUR)
            return None
        return f.read(size).decode("utf-8", errors="replace")
    if kind == _GGUF_ARRAY and depth == 0:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SCALARS:
            f.seek(_GGUF_SCALARS[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _gguf_value(f, item, depth + 1)
        return None
    raise ValueError(f"GGUF value type {kind}")


def written_by_draftsmith(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a GGUF file whose metadata names draftsmith as its writer
    (:data:`WRITER_KEY`): a file that merely starts with the GGUF magic is not."""
    try:
        with open(path, "rb") as f:
            magic, version, _tensors, count = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF" or version < 2:
                return False
            for _ in range(min(count, 1 << 16)):
                (size,) = struct.unpack("<Q", f.read(8))
                if size > 1 << 16:
                    return False
                key = f.read(size).decode("utf-8", errors="replace")
                (kind,) = struct.unpack("<I", f.read(4))
                value = _gguf_value(f, kind)
                if key == WRITER_KEY:
                    return value == WRITER
    except (OSError, ValueError, struct.error):
        return False
    return False


def check_gguf_destination(out_file: str | os.PathLike, *, overwrite: bool,
                           protect: list[str | os.PathLike]) -> Path:
    return check_file_destination(out_file, kind="GGUF file draftsmith wrote (its metadata has "
                                  f"no {WRITER_KEY})", replaceable=written_by_draftsmith,
                                  overwrite=overwrite, protect=protect)


def remove_stale_scratch(out_file: str | os.PathLike) -> list[Path]:
    """Delete the scratch directories (``.<out>.gguf-<host>-<pid>-*``, holding only the layout
    being converted) that exports into ``out_file`` killed before they finished left beside it,
    their process gone; -> what was deleted."""
    out_file = Path(out_file)
    prefix = f".{out_file.name}.gguf-"
    removed = []
    if not out_file.parent.is_dir():
        return removed
    for leftover in out_file.parent.iterdir():
        name = leftover.name
        if not name.startswith(prefix) or leftover.is_symlink() or not leftover.is_dir():
            continue
        writer = name[: name.rfind("-")]  # the random part tempfile added
        if not stale_writer(writer, prefix):
            continue
        if all(e.name == "layout" or e.name.startswith(".layout.") for e in leftover.iterdir()):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def write_gguf(out_file: str | os.PathLike, write_layout: Callable[[Path], Path], *,
               gguf_type: str | None, target_model_dir: str | os.PathLike | None = None,
               overwrite: bool = False, protect: list[str | os.PathLike] = ()) -> Path:
    """``write_layout(tmp)`` writes the Hugging Face-style layout into a scratch directory and
    returns it; llama.cpp's converter turns that into ``out_file``."""
    check_gguf_destination(out_file, overwrite=overwrite, protect=list(protect))
    converter()  # the converter is present, before any work
    out_file = Path(out_file)
    remove_stale_scratch(out_file)
    prefix = f".{out_file.name}.gguf-{host_name()}-{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=out_file.parent) as scratch:
        layout = write_layout(Path(scratch) / "layout")
        return convert_to_gguf(layout, out_file, outtype=gguf_type or DEFAULT_GGUF_TYPE,
                               target_model_dir=target_model_dir)


def check_served(draft_gguf: str | os.PathLike, target, spec_type: str,
                 new_tokens: int = 32) -> bool:
    """The consumer's own check: llama-server loads the draft beside the target (its GGUF, f32
    for a Hugging Face directory) and decodes a prompt greedily exactly as without it."""
    from draftsmith.layouts.llama_cpp import LlamaServer, find_llama_server, gguf_for_target
    from draftsmith.layouts.verdicts import say

    try:
        server = find_llama_server((spec_type,))
    except (FileNotFoundError, ValueError) as err:
        say("not verified", f"llama-server loading the GGUF: {err}")
        return True
    target_gguf, kind = gguf_for_target(target.path)
    prompt = target.chat_ids("Name three red fruits and say what colour each one is.")
    common = ["-m", str(target_gguf), "-c", "1024", "-np", "1"]
    with tempfile.TemporaryDirectory(prefix="draftsmith-check-") as logs:
        with LlamaServer(common, name="plain", threads=1, server=server, log_dir=logs) as plain:
            expected = plain.complete(prompt, new_tokens)["tokens"]
        with LlamaServer([*common, "-md", str(draft_gguf), "--spec-type", spec_type],
                         name=spec_type, threads=1, server=server, log_dir=logs) as served:
            out = served.complete(prompt, new_tokens)
    timings = out.get("timings") or {}
    ok = out.get("tokens") == expected
    say("verified" if ok else "FAILED",
        f"llama-server ({server}) served the GGUF with --spec-type {spec_type} beside the "
        f"target's {kind} GGUF: greedy output {'identical to' if ok else 'DIFFERENT from'} plain "
        f"decoding over {len(expected)} tokens, {timings.get('draft_n_accepted', 0)} of "
        f"{timings.get('draft_n', 0)} drafted tokens accepted")
    return ok
