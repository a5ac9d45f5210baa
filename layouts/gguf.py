"""GGUF for llama.cpp: a head's Hugging Face-style layout, converted by llama.cpp's own converter.

    python -m heads.export ARTIFACT --format gguf --out draft.gguf [--gguf-type f16]

EAGLE-3 heads are written in the vLLM layout first (llama.cpp's converter reads that as it is,
with ``--target-model-dir``, the target's Hugging Face directory, for its vocabulary and
aux layers) and served with ``llama-server -m TARGET.gguf -md draft.gguf --spec-type
draft-eagle3``; distilled drafts as their Hugging Face directory, served with ``--spec-type
draft-simple``. The head's precision is the converter's ``--outtype`` (``--gguf-type``: f32,
f16, bf16 or q8_0). llama.cpp loads neither EAGLE-1 heads nor Medusa heads; those formats are
refused by the methods' layouts with what to use instead.

The file is written to a temporary name beside ``--out`` and renamed when the converter
succeeded, so a failed conversion leaves no partial GGUF; an existing ``--out`` is replaced only
when it is a GGUF file (or with ``--overwrite``), and never when it is an input.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from heads.output_dir import check_file_destination
from layouts.llama_cpp import convert_to_gguf, converter

FORMAT = "gguf"
DEFAULT_GGUF_TYPE = "f16"
GGUF_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def check_gguf_destination(out_file: str | os.PathLike, *, overwrite: bool,
                           protect: list[str | os.PathLike]) -> Path:
    return check_file_destination(out_file, kind="GGUF file", replaceable=is_gguf,
                                  overwrite=overwrite, protect=protect)


def write_gguf(out_file: str | os.PathLike, write_layout: Callable[[Path], Path], *,
               gguf_type: str | None, target_model_dir: str | os.PathLike | None = None,
               overwrite: bool = False, protect: list[str | os.PathLike] = ()) -> Path:
    """``write_layout(tmp)`` writes the Hugging Face-style layout into a scratch directory and
    returns it; llama.cpp's converter turns that into ``out_file``."""
    check_gguf_destination(out_file, overwrite=overwrite, protect=list(protect))
    converter()  # the converter is present, before any work
    out_file = Path(out_file)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out_file.parent) as scratch:
        layout = write_layout(Path(scratch) / "layout")
        return convert_to_gguf(layout, out_file, outtype=gguf_type or DEFAULT_GGUF_TYPE,
                               target_model_dir=target_model_dir)


def check_served(draft_gguf: str | os.PathLike, target, spec_type: str,
                 new_tokens: int = 32) -> bool:
    """The consumer's own check: llama-server loads the draft beside the target (its GGUF, f32
    for a Hugging Face directory) and decodes a prompt greedily exactly as without it."""
    from layouts.llama_cpp import LlamaServer, find_llama_server, gguf_for_target
    from layouts.verdicts import say

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
