"""What every serving layout's writer and reader shares: hub ids, the target a head was trained
for, the export directory writer, and reading a head directory's config and weights.

An export directory is written whole or not at all by :func:`write_export`
(:func:`draftsmith.files.output_dir.write_dir`: a temporary sibling renamed into place, marked ``export``,
files 0644, the artifact it came from never replaced).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.files.file_formats import load_safetensors, read_json_object
from draftsmith.files.output_dir import write_dir
from draftsmith.targets.resolve import is_hub_id, resolve_target, target_hub_id
from draftsmith.targets.target import Target, load_target

_PICKLES = ("pytorch_model.bin", "model.pt", "pytorch_model.pt")


@dataclass(frozen=True)
class ExportOptions:
    """The options of ``draftsmith export``; each layout reads the ones it needs."""

    verifier: str | None = None  # speculators: the target's hub id
    base_model: str | None = None  # Medusa: the hub id written as base_model_name_or_path
    target: Target | str | os.PathLike | None = None  # the target, when the record does not find it
    write_pt: bool = False  # fasterdecoding: also medusa_lm_head.pt
    overwrite: bool = False  # replace --out even if it holds other files (never the artifact)
    gguf_type: str | None = None  # gguf: the head's precision (f32, f16, bf16, q8_0)


def check_format(formats: dict[str, tuple[str, ...]], refused: dict[tuple[str, str], str],
                 method: str, fmt: str) -> None:
    """Refuse a format this artifact method has no consumer for, saying what to use instead.

    ``formats``: artifact method -> the formats its layouts module writes; ``refused``:
    (method, format) -> why that consumer cannot load it and what to use.
    """
    if (method, fmt) in refused:
        raise ValueError(f"cannot export a {method} artifact as {fmt!r}: {refused[(method, fmt)]}")
    if fmt not in formats.get(method, ()):
        raise ValueError(
            f"this {method} artifact exports to {' | '.join(formats.get(method, ()))}, not {fmt!r}"
        )


def checked_hub_id(value: str, what: str) -> str:
    """``value`` if it is a Hugging Face hub id, else a ValueError saying why it must be one."""
    if not is_hub_id(value):
        reason = (
            "it is a path on this machine" if Path(str(value)).expanduser().exists()
            else "it is not of the form ORG/NAME"
        )
        raise ValueError(
            f"{what} {value!r} is not a Hugging Face hub id ({reason}); the exported config is "
            "read on the serving machine, where a local path means nothing (vLLM refuses a local "
            "verifier). Pass the target's hub id, e.g. meta-llama/Llama-3.1-8B-Instruct"
        )
    return value


def recorded_hub_id(meta: dict) -> str | None:
    """The target's hub id as the artifact records it (``target.hub_id``), or derived from it."""
    target = meta.get("target") or {}
    for candidate in (target.get("hub_id"), meta.get("base_model"), target.get("path"),
                      target.get("name")):
        hub_id = target_hub_id(candidate) if candidate else None
        if hub_id:
            return hub_id
    return None


def resolve_hub_id(meta: dict, override: str | None, what: str) -> str | None:
    """``override`` (checked) if given, else the recorded hub id, else None."""
    if override is not None:
        return checked_hub_id(override, what)
    return recorded_hub_id(meta)


def find_target(meta: dict, target: Target | str | os.PathLike | None) -> Target | None:
    """The target the artifact was trained for: ``target`` (loaded if a spec), else its record."""
    if isinstance(target, Target):
        found = target
    else:
        spec = target
        if spec is None:
            recorded = meta.get("target") or {}
            for candidate in (recorded.get("path"), meta.get("base_model"), recorded.get("name")):
                if not candidate:
                    continue
                try:
                    resolve_target(candidate)
                except (FileNotFoundError, ValueError):
                    continue
                spec = candidate
                break
        if spec is None:
            return None
        found = load_target(spec, device="cpu", dtype="float32")
    found.check_identity(meta.get("target") or {}, what="artifact")
    return found


def save_tensors(weights: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors refuses shared storage: a tensor written in two slots gets its own copy."""
    tensors, seen = {}, set()
    for key, value in weights.items():
        value = value.detach().contiguous().cpu()
        if value.numel() and value.data_ptr() in seen:
            value = value.clone()
        seen.add(value.data_ptr())
        tensors[key] = value
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_export(
    out_dir: str | os.PathLike,
    files: dict[str, dict | dict[str, torch.Tensor]],
    *,
    source: str | os.PathLike,
    fmt: str,
    overwrite: bool = False,
) -> Path:
    """Write {name: JSON dict | tensors} as an export directory (atomic, marked, 0644/0755)."""

    def fill(tmp: Path) -> None:
        for name, content in files.items():
            if name.endswith(".json"):
                write_json(tmp / name, content)
            else:
                save_tensors(content, tmp / name)

    return write_dir(out_dir, fill, kind="export", overwrite=overwrite, protect=[source],
                     marker={"format": fmt, "source": str(Path(source).resolve())})


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not a draft head directory")
    return read_json_object(path, fix="re-download or re-export the head")


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards a model.safetensors.index.json names (inside directory)."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    fix = "download or export the head again"
    if single.is_file():
        return load_safetensors(single, fix=fix)
    if index.is_file():
        weight_map = read_json_object(index, fix=fix).get("weight_map") or {}
        state: dict[str, torch.Tensor] = {}
        root = directory.resolve()
        for shard in sorted(set(weight_map.values())):
            path = (directory / shard).resolve()
            if root not in path.parents:
                raise ValueError(f"{index} names shard {shard!r} outside {directory}; refused")
            state.update(load_safetensors(path, fix=fix))
        return state
    pickles = [p.name for p in directory.iterdir() if p.name in _PICKLES or p.suffix == ".pt"]
    if pickles:
        name = pickles[0]
        raise ValueError(
            f"{directory} holds its weights only as {name}, a pickle, which draftsmith never "
            "loads. Convert it once where you trust the file: python -c \"import torch; from "
            "safetensors.torch import save_file; save_file({k: v.contiguous() for k, v in "
            f"torch.load('{directory / name}', weights_only=True).items()}}, "
            f"'{directory / 'model.safetensors'}')\""
        )
    raise FileNotFoundError(f"{directory} has no model.safetensors")


def recorded_identity(config: dict) -> dict:
    """The target identity an export records in its ``draftsmith`` block ({} when none)."""
    block = config.get("draftsmith")
    return (block or {}).get("target") or {} if isinstance(block, dict) else {}
