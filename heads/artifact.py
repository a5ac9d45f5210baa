"""The artifact layout every trainer writes and every loader reads.

    <dir>/config.json        {"method": ..., "target": {identity}, "format_version": 1, ...shapes}
    <dir>/model.safetensors  the trained draft's weights (nothing of the target)

Written through :func:`draftsmith.files.output_dir.write_dir` (a temporary directory renamed into place,
marked as an ``artifact``), so a crash never leaves half an artifact and a directory that is not an
earlier artifact is never replaced unless the caller asks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.files.command_line import program, run_command
from draftsmith.files.file_formats import load_safetensors, read_json_object
from draftsmith.files.output_dir import check_destination, refuse_inputs, write_dir

FORMAT_VERSION = 1
# an artifact method names the files that read it: lower-case letters, digits, "_" and "-"
_METHOD_NAME = re.compile(r"[a-z][a-z0-9_-]*")


class NonFiniteWeights(ValueError):
    """Weights hold NaN or infinite values: nothing is written from (or loaded into) them."""


def check_integers(config: object, names: Iterable[str], what: str, low: int = 1) -> None:
    """Each of ``names`` (attributes of ``config``) an integer >= ``low``, else a ValueError naming
    the key: a damaged or hand-edited config.json (``num_attention_heads: "nine"``) is refused
    when it is read, before anything is built or exported from it."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{what}.{name} must be an integer >= {low}, got {value!r} (read "
                             "from a config.json: that file is damaged or hand-edited; write it "
                             "again by training or exporting)")


DIVERGED = ("the training diverged: lower learning_rate (or set max_grad_norm) and train again "
            "from an earlier checkpoint")


# config.json key under which a distilled draft (a Hugging Face model directory) records what it
# is and which target it was made for
DRAFT_INFO_KEY = "draftsmith"


def check_finite(tensors: Mapping[str, torch.Tensor], what: str, fix: str = DIVERGED) -> None:
    """Refuse weights with a NaN or infinite value, naming the first such tensor and ``fix``.

    Called before every artifact and checkpoint is written and when a checkpoint is read: a
    diverged run must not leave a draft that loads and silently proposes garbage.
    """
    bad = [name for name, t in tensors.items()
           if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())]
    if bad:
        raise NonFiniteWeights(
            f"{what}: {len(bad)} weight tensor(s) hold NaN or infinite values ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); {fix}")


def save_artifact(directory: str | os.PathLike, method: str, config: dict,
                  state_dict: dict[str, torch.Tensor], target_identity: dict,
                  extra_files: dict[str, str] | None = None, overwrite: bool = False, *,
                  extra_dirs: Iterable[str | os.PathLike] = (),
                  protect: Iterable[str | os.PathLike] = (), marker: dict | None = None,
                  same_as: dict | None = None) -> Path:
    """Write config.json + model.safetensors (+ small text files, + copies of ``extra_dirs``)
    atomically into ``directory``; weights with a NaN or inf are refused before anything is
    written.

    An existing ``directory`` is replaced when it is an earlier artifact (or empty; ``same_as``:
    an artifact whose marker holds those values), anything else only with ``overwrite=True``, and
    never one of the ``protect`` paths (see :func:`draftsmith.files.output_dir.write_dir`).
    """
    if not isinstance(method, str) or not _METHOD_NAME.fullmatch(method):
        raise ValueError(f"artifact method {method!r} must be a lower-case name such as "
                         "'eagle3' (draftsmith.heads.methods.HEAD_METHODS lists the methods)")
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    check_finite(tensors, f"the {method} artifact {directory} was not written")
    meta = {"method": method, "format_version": FORMAT_VERSION, "target": target_identity,
            **config}
    extra_dirs = [Path(d) for d in extra_dirs]

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        for sub in extra_dirs:
            shutil.copytree(sub, tmp / sub.name, symlinks=True)

    return write_dir(directory, fill, kind="artifact", overwrite=overwrite, protect=protect,
                     marker={"method": method, **(marker or {})}, same_as=same_as)


def read_artifact_config(directory: str | os.PathLike, method: str | tuple[str, ...] | None = None) -> dict:
    """config.json of an artifact (checked to hold ``method`` when given); a damaged one is a
    :class:`draftsmith.files.file_formats.FileFormatError`."""
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
    The loaders cast to the precision they run in, so a bf16 artifact drafts in fp32 on a CPU.

    The copy is whole: small text files and subdirectories (a Medusa-2 artifact's adapted
    ``target/``, copied unchanged) come along, and config values that locate a part of the
    source (Medusa-2's ``base_model``) point into the copy. ``out`` is checked before anything
    is read: never ``source``, a directory holding it or one inside it (not even with
    ``overwrite``); an existing ``out`` is replaced only when it is an earlier cast of the same
    source, anything else only with ``overwrite``. A distilled draft's model directory is cast
    the same way (:func:`_cast_draft`).
    """
    source = Path(source).expanduser()
    origin = str(source.resolve())
    refuse_inputs([out], [source])
    check_destination(out, kind="artifact", overwrite=overwrite, protect=[source],
                      same_as={"cast_from": origin})
    if (source / "config.json").is_file():
        fields = read_json_object(source / "config.json", fix="the artifact is damaged: train or "
                                  "export it again")
        if "method" not in fields and DRAFT_INFO_KEY in fields:  # a distilled draft's directory
            return _cast_draft(source, fields, out, dtype, overwrite)
    config, tensors = load_artifact(source)
    method = config.pop("method")
    target = config.pop("target")
    config.pop("format_version", None)
    copy = Path(out).expanduser().resolve()
    for key, value in config.items():
        if isinstance(value, str) and Path(value).is_absolute():
            located = Path(value).resolve()
            if located == Path(origin) or Path(origin) in located.parents:
                config[key] = str(copy / located.relative_to(origin))
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    extra = {p.name: p.read_text() for p in source.iterdir()
             if p.is_file() and p.suffix in (".md", ".txt")}
    subdirs = [p for p in source.iterdir()
               if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")]
    return save_artifact(out, method, config, cast, target, extra_files=extra,
                         overwrite=overwrite, extra_dirs=subdirs, protect=[source],
                         marker={"cast_from": origin}, same_as={"cast_from": origin})


def _cast_draft(source: Path, config: dict, out: str | os.PathLike, dtype: torch.dtype,
                overwrite: bool) -> Path:
    """:func:`cast_artifact` for a distilled draft (a Hugging Face model directory written by
    ``draftsmith.heads.distill.save_draft``): its one model.safetensors cast (a reduced vocabulary's
    ``lm_head.kept`` ids unchanged), config.json's ``dtype`` set, every other file copied."""
    origin = str(source.resolve())
    weights = sorted(source.glob("*.safetensors"))
    if [w.name for w in weights] != ["model.safetensors"]:
        raise FileNotFoundError(f"{source}: a draft to cast is one model.safetensors, found "
                                f"{[w.name for w in weights]}")
    tensors = load_safetensors(weights[0], fix="the draft is damaged: write it again")
    cast = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
            for k, v in tensors.items()}
    check_finite(cast, f"the draft {source} does not fit in {dtype}",
                 fix="it was not cast; cast it to bf16 or fp32")
    config = {**config, "dtype": str(dtype).removeprefix("torch.")}
    config.pop("torch_dtype", None)

    def fill(tmp: Path) -> None:
        for path in source.iterdir():
            if path.is_file() and not path.name.startswith(".") and path.suffix != ".safetensors" \
                    and path.name != "config.json":
                shutil.copyfile(path, tmp / path.name)
        save_file(cast, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return write_dir(out, fill, kind="artifact", overwrite=overwrite, protect=[source],
                     marker={"method": "draft", "cast_from": origin},
                     same_as={"cast_from": origin})


def build_parser():
    import argparse

    from draftsmith.targets.target import parse_dtype

    parser = argparse.ArgumentParser(prog=program("python -m draftsmith.heads.artifact"),
                                     description="Operations on draftsmith artifacts.")
    sub = parser.add_subparsers(dest="command", required=True)
    cast = sub.add_parser("cast", help="copy an artifact (or a distilled draft's directory) with "
                          "its weights in another precision")
    cast.add_argument("source")
    cast.add_argument("out", help="a new directory, or an earlier cast of SOURCE (anything else "
                      "needs --overwrite; never SOURCE or a directory holding it)")
    cast.add_argument("--dtype", type=parse_dtype, required=True, help="bf16, fp16 or fp32")
    cast.add_argument("--overwrite", action="store_true",
                      help="replace OUT even if it holds other files (never SOURCE or a "
                           "directory holding it)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m draftsmith.heads.artifact cast SOURCE OUT --dtype bf16``; a user's mistake is one line on
    stderr and exit status 2."""
    args = build_parser().parse_args(argv)

    def run() -> None:
        written = cast_artifact(args.source, args.out, args.dtype, overwrite=args.overwrite)
        print(f"wrote {written} ({args.dtype})")

    return run_command(run, "python -m draftsmith.heads.artifact")


if __name__ == "__main__":
    raise SystemExit(main())
