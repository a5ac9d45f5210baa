"""The artifact layout every trainer writes and every loader reads.

    <dir>/config.json        {"method": ..., "target": {identity}, "format_version": 1, ...shapes}
    <dir>/model.safetensors  the trained draft's weights (nothing of the target)

Written through :func:`heads.output_dir.write_dir` (a temporary directory renamed into place,
marked as an ``artifact``), so a crash never leaves half an artifact and a directory that is not an
earlier artifact is never replaced unless the caller asks.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from heads.file_formats import load_safetensors, read_json_object
from heads.output_dir import write_dir

FORMAT_VERSION = 1
# an artifact method names the files that read it: lower-case letters, digits, "_" and "-"
_METHOD_NAME = re.compile(r"[a-z][a-z0-9_-]*")


def save_artifact(directory: str | os.PathLike, method: str, config: dict,
                  state_dict: dict[str, torch.Tensor], target_identity: dict,
                  extra_files: dict[str, str] | None = None, overwrite: bool = False) -> Path:
    """Write config.json + model.safetensors (+ small text files) atomically into ``directory``.

    An existing ``directory`` is replaced when it is an earlier artifact (or empty); anything else
    only with ``overwrite=True``.
    """
    if not isinstance(method, str) or not _METHOD_NAME.fullmatch(method):
        raise ValueError(f"artifact method {method!r} must be a lower-case name such as "
                         "'eagle3' (heads.methods.HEAD_METHODS lists the methods)")
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    meta = {"method": method, "format_version": FORMAT_VERSION, "target": target_identity,
            **config}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)

    return write_dir(directory, fill, kind="artifact", overwrite=overwrite,
                     marker={"method": method})


def read_artifact_config(directory: str | os.PathLike, method: str | tuple[str, ...] | None = None) -> dict:
    """config.json of an artifact (checked to hold ``method`` when given); a damaged one is a
    :class:`heads.file_formats.FileFormatError`."""
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a draftsmith artifact (no config.json)")
    config = read_json_object(path, fix="the artifact is damaged: train or export it again")
    wanted = (method,) if isinstance(method, str) else method
    if wanted and config.get("method") not in wanted:
        raise ValueError(
            f"{directory} holds a {config.get('method')!r} artifact, expected {' or '.join(wanted)}"
        )
    if config.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{directory} was written by a newer draftsmith (format "
                         f"{config['format_version']} > {FORMAT_VERSION}); upgrade draftsmith")
    return config


def load_artifact(directory: str | os.PathLike, method: str | tuple[str, ...] | None = None,
                  device: str | torch.device = "cpu") -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (config, state_dict)."""
    config = read_artifact_config(directory, method)
    weights = Path(directory) / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{directory} has config.json but no model.safetensors")
    return config, load_safetensors(weights, device=device,
                                    fix="the artifact is damaged: train or export it again")


def cast_artifact(source: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype,
                  overwrite: bool = False) -> Path:
    """A copy of the artifact at ``source`` with its floating-point weights in ``dtype`` (integer
    buffers such as EAGLE-3's vocabulary maps unchanged), e.g. bf16 to halve what is shipped.
    The loaders cast to the precision they run in, so a bf16 artifact drafts in fp32 on a CPU."""
    config, tensors = load_artifact(source)
    method = config.pop("method")
    target = config.pop("target")
    config.pop("format_version", None)
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    extra = {p.name: p.read_text() for p in Path(source).iterdir()
             if p.is_file() and p.suffix in (".md", ".txt")}
    return save_artifact(out, method, config, cast, target, extra_files=extra,
                         overwrite=overwrite)


def main(argv: list[str] | None = None) -> None:
    """``python -m heads.artifact cast SOURCE OUT --dtype bf16``."""
    import argparse

    from heads.target import parse_dtype

    parser = argparse.ArgumentParser(prog="python -m heads.artifact",
                                     description="Operations on draftsmith artifacts.")
    sub = parser.add_subparsers(dest="command", required=True)
    cast = sub.add_parser("cast", help="copy an artifact with its weights in another precision")
    cast.add_argument("source")
    cast.add_argument("out")
    cast.add_argument("--dtype", type=parse_dtype, required=True, help="bf16, fp16 or fp32")
    cast.add_argument("--overwrite", action="store_true",
                      help="replace OUT even if it holds other files (never SOURCE)")
    args = parser.parse_args(argv)
    if Path(args.source).resolve() == Path(args.out).resolve():
        parser.error("OUT must differ from SOURCE: the artifact is never replaced in place")
    written = cast_artifact(args.source, args.out, args.dtype, overwrite=args.overwrite)
    print(f"wrote {written} ({args.dtype})")


if __name__ == "__main__":
    import sys

    try:
        main()
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
