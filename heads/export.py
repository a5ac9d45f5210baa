"""Export trained drafts into the layouts serving engines load.

    python -m heads.export <artifact> --format vllm|sglang|speculators --out DIR   # EAGLE-3
    python -m heads.export <artifact> --format vllm|sglang --out DIR               # EAGLE-1
    python -m heads.export <artifact> --format trtllm|fasterdecoding|vllm-0.32 --out DIR  # Medusa
    python -m heads.export <artifact> --format hf --out DIR                        # distilled draft
    ... [--check] [--overwrite] [--verifier ORG/NAME] [--base-model ORG/NAME] [--target T]

The artifact's ``config.json`` says which method it holds; each method has its own formats. Every
layout is written as its consumer's own loader reads it, at a named version (see the README and
``tests/fixtures/consumers/``):

* EAGLE-1, vLLM ``EagleLlamaForCausalLM`` / SGLang ``LlamaForCausalLMEagle``: ``fc.weight`` over
  cat(embedding, feature), ``layers.0.*`` without ``input_layernorm``; the engines use the
  target's embedding and LM head. SGLang's ``fc`` has a bias, written as zeros.
* EAGLE-3, vLLM and SGLang ``LlamaForCausalLMEagle3``: ``fc.weight`` [h, 3h], ``midlayer.*``
  (q/k/v over 2h, ``midlayer.hidden_norm.weight``), ``norm.weight``, ``lm_head.weight``
  [draft_vocab, h]; with a reduced draft vocabulary also ``d2t`` (int64: target_id = draft_id +
  d2t[draft_id]) and ``t2d`` (bool over the target vocabulary). A full-vocabulary head has no
  ``d2t``: vLLM 0.33 creates no ``draft_id_to_target_id`` parameter when the two vocabularies are
  equal and refuses a checkpoint that carries one. The aux layers are written twice because the
  engines count differently: top-level ``eagle_aux_hidden_state_layer_ids`` for vLLM (index i =
  input of layer i, our convention) and ``eagle_config.eagle_aux_hidden_state_layer_ids`` for
  SGLang (index i = output of layer i, so ours minus one).
* speculators (EAGLE-3 only, ``speculators_model_type: eagle3``): the same weights with
  ``layers.0.*`` for ``midlayer.*``, plus ``embed_tokens.weight`` (the target's embedding:
  speculators does not fill it from the verifier), a ``transformer_layer_config`` and a
  ``speculators_config`` naming the verifier by its hub id (vLLM refuses a local path there).
* Medusa: see :func:`heads.medusa.export_medusa`.

Only Llama-style layers (q/k/v/o, gate/up/down, RMS norms) can be served by these engines; a head
built from another architecture is refused with the names of the weights that do not fit. Output
directories are written atomically by :func:`heads.output_dir.write_dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from heads.artifact import load_artifact, read_artifact_config
from heads.draft_vocab import check_vocab_maps
from heads.eagle import EagleConfig
from heads.output_dir import check_destination, write_dir
from heads.target import Target, dtype_name, is_hub_id, target_hub_id

FORMATS = {
    "eagle1": ("vllm", "sglang"),
    "eagle3": ("vllm", "sglang", "speculators"),
    "medusa": ("trtllm", "fasterdecoding", "vllm-0.32"),
    "draft": ("hf",),
}
# formats a consumer cannot load, with what to use instead
REFUSED = {
    ("eagle1", "speculators"): (
        "speculators has no EAGLE-1 model (speculators 0.9.0 registers eagle3, peagle, dflash, "
        "dflash2, dspark, mtp and xpress; an 'eagle' config fails its validation) and vLLM's "
        "speculators path loads none either. Export EAGLE-1 with --format vllm (vLLM "
        "EagleLlamaForCausalLM) or --format sglang, or train an EAGLE-3 head "
        "(train/eagle.py --version 3) for speculators"
    ),
    ("medusa", "vllm"): (
        "current vLLM (0.33) has no Medusa model; vLLM 0.32.0 was the last release with "
        "MedusaModel. Export with --format vllm-0.32 to serve with vLLM <= 0.32.0, "
        "--format trtllm for TensorRT-LLM, or --format fasterdecoding --write-pt for "
        "FasterDecoding/Medusa"
    ),
}
ARCHITECTURES = {
    (1, "vllm"): "EagleLlamaForCausalLM",
    (1, "sglang"): "LlamaForCausalLMEagle",
    (3, "vllm"): "LlamaForCausalLMEagle3",
    (3, "sglang"): "LlamaForCausalLMEagle3",
}
# the speculators release whose config schema and loader this writer follows
SPECULATORS_VERSION = "0.9.0"
DEFAULT_SPECULATIVE_TOKENS = 5
_LLAMA_LAYER_WEIGHT = re.compile(
    r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.(weight|bias)"
    r"|(input_layernorm|post_attention_layernorm|hidden_norm)\.weight"
)
def artifact_method(directory: str | os.PathLike) -> str:
    """The method an artifact holds: config.json's ``method``, or ``draft`` for an HF draft."""
    config = read_artifact_config(directory)
    method = config.get("method")
    if method is None and "draftsmith" in config:
        method = "draft"  # a distilled draft is a plain HF directory with a draftsmith block
    if method not in FORMATS:
        raise ValueError(
            f"{directory}: config.json names method {method!r}; expected one of "
            f"{sorted(FORMATS)} (is it a draftsmith artifact?)"
        )
    return method


def check_format(method: str, fmt: str) -> None:
    """Refuse a format this method has no consumer for, saying what to use instead."""
    if (method, fmt) in REFUSED:
        raise ValueError(f"cannot export a {method} artifact as {fmt!r}: {REFUSED[(method, fmt)]}")
    if fmt not in FORMATS[method]:
        raise ValueError(
            f"this {method} artifact exports to {' | '.join(FORMATS[method])}, not {fmt!r}"
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
    from heads.target import load_target, resolve_target

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


# ------------------------------------------------------------------------------------------------
# EAGLE


def _llama_config(cfg: EagleConfig, dtype: torch.dtype) -> dict:
    """The one-layer Llama config serving engines build the draft from."""
    layer = cfg.layer_config
    rope = dict(layer.get("rope_parameters") or {})
    rope_theta = rope.get("rope_theta", layer.get("rope_theta", 10000.0))
    scaling = None
    if rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    out = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "hidden_act": layer.get("hidden_act", "silu"),
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": layer.get("max_position_embeddings", 4096),
        "attention_bias": bool(layer.get("attention_bias", False)),
        "mlp_bias": bool(layer.get("mlp_bias", False)),
        # the EAGLE-3 lm_head is the draft's own: never tie it to the embedding (SGLang would)
        "tie_word_embeddings": False,
        # transformers < 5 reads rope_theta/rope_scaling, transformers 5 rope_parameters
        "rope_theta": rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope or {"rope_type": "default", "rope_theta": rope_theta},
        "torch_dtype": dtype_name(dtype),
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if layer.get(key) is not None:
            out[key] = layer[key]
    return out


def _check_llama_layer(state: dict[str, torch.Tensor], prefix: str, fmt: str, cfg: EagleConfig):
    odd = [
        k
        for k in state
        if k.startswith(prefix) and not _LLAMA_LAYER_WEIGHT.fullmatch(k[len(prefix) :])
    ]
    model_type = cfg.layer_config.get("model_type")
    if odd:
        raise ValueError(
            f"this EAGLE head was built from {model_type!r} decoder layers with weights {odd[:4]} "
            f"that {fmt}'s Llama-style EAGLE drafter has no place for; it cannot be exported"
        )


def _eagle_config_block(cfg: EagleConfig) -> dict:
    """SGLang's ``eagle_config``: aux layers counted as layer outputs (ours minus one)."""
    return {
        "eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
        "use_aux_hidden_state": True,
    }


def _speculators_block(verifier: str, architectures: list[str]) -> dict:
    return {
        "algorithm": "eagle3",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": DEFAULT_SPECULATIVE_TOKENS,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": architectures},
    }


def eagle_serving_files(
    meta: dict,
    state: dict[str, torch.Tensor],
    fmt: str,
    *,
    verifier: str | None = None,
    embedding: torch.Tensor | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights) of an EAGLE artifact in ``fmt``; see the module docstring.

    speculators needs ``verifier`` (a hub id) and ``embedding`` (the target's input embedding,
    (vocab, hidden)).
    """
    cfg = EagleConfig.from_dict(meta)
    check_format(cfg.method, fmt)
    dtype = state["fc.weight"].dtype
    llama = _llama_config(cfg, dtype)
    provenance = {
        "method": cfg.method,
        "target": meta.get("target") or {},
        "format_version": meta.get("format_version"),
    }
    prefix = "layers.0." if cfg.version == 1 else "midlayer."
    _check_llama_layer(state, prefix, fmt, cfg)
    weights = dict(state)
    if cfg.version == 3:
        check_vocab_maps(state["d2t"], state["t2d"], cfg.vocab_size)
        if cfg.draft_vocab_size == cfg.vocab_size:
            # identity maps; vLLM has no draft_id_to_target_id to load them into
            weights.pop("d2t")
            weights.pop("t2d")

    if fmt in ("vllm", "sglang"):
        config = {
            **llama,
            "architectures": [ARCHITECTURES[(cfg.version, fmt)]],
            "draftsmith": provenance,
        }
        if cfg.version == 1 and fmt == "sglang":
            weights["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=dtype)
        if cfg.version == 3:
            config.update(
                draft_vocab_size=cfg.draft_vocab_size,
                target_hidden_size=cfg.target_hidden_size,
                eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
                eagle_config=_eagle_config_block(cfg),
                norm_before_residual=False,
            )
        return config, weights

    # speculators (EAGLE-3; check_format refused EAGLE-1)
    if verifier is None:
        raise ValueError(
            "the speculators format names the verifier by its Hugging Face hub id, and this "
            f"artifact's target {provenance['target'].get('name')!r} has none recorded: pass "
            "--verifier ORG/NAME (the hub id of the target it was trained for)"
        )
    checked_hub_id(verifier, "verifier")
    if embedding is None:
        raise ValueError(
            "the speculators format carries the target's embedding (embed_tokens.weight; "
            "speculators does not fill it from the verifier): pass the target (--target)"
        )
    if tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(
            f"embed_tokens.weight: the target's embedding has shape {tuple(embedding.shape)}, the "
            f"head needs ({cfg.vocab_size}, {cfg.hidden_size}): pass the target it was trained for"
        )
    layer_config = {**llama, "architectures": ["LlamaForCausalLM"]}
    layer_config.pop("torch_dtype")
    weights = {
        ("layers.0." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in weights.items()
    }
    weights["embed_tokens.weight"] = embedding.detach().to(device="cpu", dtype=dtype)
    verifier_arch = list(cfg.layer_config.get("architectures") or ["LlamaForCausalLM"])
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        # vLLM's speculators bridge defaults this to True when absent; our layer normalises the
        # feature for attention only, the residual starts from the un-normed feature
        "norm_before_residual": False,
        "transformer_layer_config": layer_config,
        "speculators_config": _speculators_block(verifier, verifier_arch),
        "torch_dtype": llama["torch_dtype"],
        "draftsmith": provenance,
    }
    return config, weights


def _save_tensors(weights: dict[str, torch.Tensor], path: Path) -> None:
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
                _save_tensors(content, tmp / name)

    return write_dir(out_dir, fill, kind="export", overwrite=overwrite, protect=[source],
                     marker={"format": fmt, "source": str(Path(source).resolve())})


def export_eagle(
    artifact_dir: str | os.PathLike,
    fmt: str,
    out_dir: str | os.PathLike,
    *,
    verifier: str | None = None,
    target: Target | str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an eagle1/eagle3 artifact in ``fmt`` (vllm | sglang | speculators) to ``out_dir``.

    speculators: ``verifier`` (default: the target's recorded hub id) and the target itself for
    its embedding (``target``: a Target or a spec; default: the recorded target when it can be
    found on this machine).
    """
    meta = read_artifact_config(artifact_dir, ("eagle1", "eagle3"))
    check_format(meta["method"], fmt)
    check_destination(out_dir, kind="export", overwrite=overwrite, protect=[artifact_dir])
    _, state = load_artifact(artifact_dir, ("eagle1", "eagle3"))
    embedding = None
    if fmt == "speculators":
        verifier = resolve_hub_id(meta, verifier, "--verifier")
        found = find_target(meta, target)
        embedding = None if found is None else found.embed.weight
    config, weights = eagle_serving_files(meta, state, fmt, verifier=verifier, embedding=embedding)
    return write_export(out_dir, {"config.json": config, "model.safetensors": weights},
                        source=artifact_dir, fmt=fmt, overwrite=overwrite)


# ------------------------------------------------------------------------------------------------
# Distilled drafts


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


# ------------------------------------------------------------------------------------------------
# Dispatch and command line


def export(
    artifact_dir: str | os.PathLike,
    fmt: str,
    out_dir: str | os.PathLike,
    *,
    verifier: str | None = None,
    base_model: str | None = None,
    target: Target | str | os.PathLike | None = None,
    write_pt: bool = False,
    overwrite: bool = False,
) -> Path:
    """Dispatch on the artifact's method; an unknown or refused format says what to use."""
    artifact_dir = Path(artifact_dir)
    if not artifact_dir.exists():
        raise FileNotFoundError(f"artifact {artifact_dir} does not exist")
    method = artifact_method(artifact_dir)
    check_format(method, fmt)
    if method in ("eagle1", "eagle3"):
        return export_eagle(artifact_dir, fmt, out_dir, verifier=verifier, target=target,
                            overwrite=overwrite)
    if method == "medusa":
        from heads.medusa import export_medusa

        found = target if isinstance(target, Target) or target is None else None
        if found is None and target is not None:
            found = find_target(read_artifact_config(artifact_dir), target)
        return export_medusa(artifact_dir, fmt, out_dir, target=found, base_model=base_model,
                             write_pt=write_pt, overwrite=overwrite)
    return export_draft_hf(artifact_dir, out_dir, overwrite=overwrite)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m heads.export",
        description="Export a draftsmith artifact into a serving layout. Formats per method: "
        + "; ".join(f"{m}: {', '.join(f)}" for m, f in FORMATS.items()),
    )
    parser.add_argument("artifact", help="artifact directory (the run's artifact/)")
    parser.add_argument(
        "--format",
        required=True,
        dest="fmt",
        choices=sorted({f for fs in FORMATS.values() for f in fs} | {m for _, m in REFUSED}),
    )
    parser.add_argument("--out", required=True, help="directory to write (new, or an earlier "
                        "export; anything else needs --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out even if it holds other files (never the artifact)")
    parser.add_argument("--verifier", default=None,
                        help="speculators: the target's hub id (default: the recorded one)")
    parser.add_argument("--base-model", default=None,
                        help="Medusa: the target's hub id written as base_model_name_or_path")
    parser.add_argument("--target", default=None,
                        help="the target (HF dir, .gguf, embedded name) when the artifact's "
                        "record does not locate it (speculators needs its embedding)")
    parser.add_argument("--write-pt", action="store_true",
                        help="fasterdecoding: also write medusa_lm_head.pt (a torch.save pickle "
                        "of plain tensors), the only file FasterDecoding's loader reads")
    parser.add_argument("--check", action="store_true",
                        help="after writing, read the export back and run the consumer checks "
                        "available here; print what was verified and what was not")
    args = parser.parse_args(argv)
    try:
        out = export(args.artifact, args.fmt, args.out, verifier=args.verifier,
                     base_model=args.base_model, target=args.target, write_pt=args.write_pt,
                     overwrite=args.overwrite)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    if args.fmt in FORMATS["medusa"]:
        from heads.medusa import medusa_export_notes

        for line in medusa_export_notes(out, args.fmt):
            print(line)
    if args.check:
        from heads.export_check import check_export

        try:
            ok = check_export(args.artifact, args.fmt, out, target=args.target)
        except (ValueError, FileNotFoundError) as err:
            print(f"error: --check could not run: {err}", file=sys.stderr)
            return 2
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
