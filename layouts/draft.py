"""Distilled drafts in the layout serving engines load: a plain Hugging Face model directory.

    export_draft_hf(artifact, out)

A distilled draft is already a Hugging Face directory (``config.json`` with a ``draftsmith``
block, ``model.safetensors``, the target's tokenizer); the export is a clean copy without
draftsmith's keys, usable as ``assistant_model`` in transformers and as a draft model in vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from draftsmith.files.file_formats import read_json_object
from draftsmith.files.output_dir import write_dir
from draftsmith.layouts.files import ExportOptions, check_format, write_json
from draftsmith.layouts.gguf import check_served, write_gguf
from draftsmith.layouts.verdicts import say

ARTIFACT_METHODS = ("draft",)
FORMATS = {"draft": ("hf", "gguf")}
REFUSED: dict[tuple[str, str], str] = {}
NOT_RUN_HERE: dict[str, str] = {}  # transformers and llama-server both run here


def export_layout(artifact_dir: str | os.PathLike, fmt: str, out_dir: str | os.PathLike,
                  options: ExportOptions) -> Path:
    """The layouts table's entry: a distilled draft in ``fmt`` (hf, or gguf for llama.cpp's
    ``--spec-type draft-simple``: the Hugging Face export converted by llama.cpp's converter)."""
    check_format(FORMATS, REFUSED, "draft", fmt)
    info = read_json_object(Path(artifact_dir) / "config.json",
                            fix="the draft is damaged").get("draftsmith") or {}
    if info.get("draft_vocab_size"):
        raise ValueError(
            f"{artifact_dir} has a reduced vocabulary ({info['draft_vocab_size']} tokens, -inf "
            f"logits elsewhere): only draftsmith's engine runs it (draftsmith.eval.bench --method "
            f"draft:{artifact_dir}); transformers, vLLM and llama.cpp need a draft over the "
            f"target's whole vocabulary: train with draft_vocab_size: none to serve it there")
    if fmt == "gguf":
        return write_gguf(out_dir, lambda tmp: export_draft_hf(artifact_dir, tmp),
                          gguf_type=options.gguf_type, overwrite=options.overwrite,
                          protect=[artifact_dir])
    return export_draft_hf(artifact_dir, out_dir, overwrite=options.overwrite)


def export_draft_hf(
    artifact_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False
) -> Path:
    """Copy a distilled draft into a clean Hugging Face directory (draftsmith's key removed)."""
    src = Path(artifact_dir)
    config = json.loads((src / "config.json").read_text())
    weights = [p for p in src.iterdir() if p.suffix == ".safetensors"]
    if not weights:
        raise FileNotFoundError(f"{src} has no model weights (*.safetensors)")
    if not any((src / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"{src} has no tokenizer files; a draft must ship the target's tokenizer"
        )
    config.pop("draftsmith", None)
    config.pop("method", None)

    def fill(tmp: Path) -> None:
        for path in src.iterdir():
            if path.is_file() and path.name not in ("config.json", ".draftsmith"):
                shutil.copy2(path, tmp / path.name)
        write_json(tmp / "config.json", config)

    return write_dir(out_dir, fill, kind="export", overwrite=overwrite, protect=[src],
                     marker={"format": "hf", "source": str(src.resolve())})


def check_draft_export(artifact_dir, fmt, out_dir, target) -> bool:
    """Round trip: transformers loads the export with the artifact's logits; a GGUF is served by
    llama-server beside its target."""
    if fmt == "gguf":
        from draftsmith.targets.target import load_target

        recorded = (read_json_object(Path(artifact_dir) / "config.json",
                                     fix="the draft is damaged").get("draftsmith") or {})
        spec = (recorded.get("target") or {}).get("path") or target
        if spec is None:
            say("not verified", "llama-server loading the GGUF: the target is needed (--target)")
            return True
        return check_served(out_dir, load_target(spec, device="cpu", dtype="float32"),
                            "draft-simple")
    a = AutoModelForCausalLM.from_pretrained(artifact_dir, trust_remote_code=False).eval()
    b = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=False).eval()
    ids = torch.randint(0, a.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ok = torch.equal(a(ids).logits, b(ids).logits)
    say("verified" if ok else "FAILED",
         "round trip: transformers loads the export with the artifact's logits")
    return ok
