"""Export trained drafts into the layouts serving engines load.

    python -m heads.export <artifact> --format vllm|sglang|speculators --out DIR   # eagle1/eagle3
    python -m heads.export <artifact> --format vllm|trtllm --out DIR               # medusa
    python -m heads.export <artifact> --format hf --out DIR                        # draft

The artifact's ``config.json`` says which method it holds; each method has its own formats.

EAGLE layouts (``model.safetensors`` + ``config.json``, a one-layer Llama config):

* EAGLE-1, vLLM ``EagleLlamaForCausalLM`` / SGLang ``LlamaForCausalLMEagle``: ``fc.weight`` over
  cat(embedding, feature), ``layers.0.*`` without ``input_layernorm``; the engines use the
  target's embedding and LM head. SGLang's ``fc`` has a bias, written as zeros.
* EAGLE-3, vLLM and SGLang ``LlamaForCausalLMEagle3``: ``fc.weight`` [h, 3h], ``midlayer.*``
  (q/k/v over 2h, ``midlayer.hidden_norm.weight``), ``norm.weight``, ``lm_head.weight``
  [draft_vocab, h], ``d2t`` (int64: target_id = draft_id + d2t[draft_id]), ``t2d`` (bool over the
  target vocabulary). The aux layers are written twice because the engines count differently:
  top-level ``eagle_aux_hidden_state_layer_ids`` for vLLM (index i = input of layer i, our
  convention) and ``eagle_config.eagle_aux_hidden_state_layer_ids`` for SGLang (index i = output
  of layer i, so ours minus one).
* speculators (``speculators_model_type`` eagle / eagle3): the same weights under the speculators
  names (EAGLE-1 ``fusion_fc``, ``transformer.*``; EAGLE-3 ``layers.0.*``) with a
  ``transformer_layer_config`` and a ``speculators_config`` block naming the verifier.

Only Llama-style layers (q/k/v/o, gate/up/down, RMS norms) can be served by these engines; a head
built from another architecture is refused with the names of the weights that do not fit.
:func:`load_exported_eagle` reads every EAGLE layout back into an :class:`EagleHead`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from heads.artifact import load_artifact, read_artifact_config
from heads.eagle import EagleConfig, EagleHead, check_vocab_maps, default_aux_layer_ids
from heads.target import Target

FORMATS = {
    "eagle1": ("vllm", "sglang", "speculators"),
    "eagle3": ("vllm", "sglang", "speculators"),
    "medusa": ("vllm", "trtllm"),
    "draft": ("hf",),
}
ARCHITECTURES = {
    (1, "vllm"): "EagleLlamaForCausalLM",
    (1, "sglang"): "LlamaForCausalLMEagle",
    (3, "vllm"): "LlamaForCausalLMEagle3",
    (3, "sglang"): "LlamaForCausalLMEagle3",
}
# speculators' config schema this writer follows (Eagle3SpeculatorConfig / EagleSpeculatorConfig)
SPECULATORS_VERSION = "0.1.0"
DEFAULT_SPECULATIVE_TOKENS = 5
_LLAMA_LAYER_WEIGHT = re.compile(
    r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.(weight|bias)"
    r"|(input_layernorm|post_attention_layernorm|hidden_norm)\.weight"
)
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


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


def export(
    artifact_dir: str | os.PathLike,
    fmt: str,
    out_dir: str | os.PathLike,
    verifier: str | None = None,
) -> Path:
    """Dispatch on the artifact's method; an unknown format names the valid ones."""
    artifact_dir = Path(artifact_dir)
    if not artifact_dir.exists():
        raise FileNotFoundError(f"artifact {artifact_dir} does not exist")
    method = artifact_method(artifact_dir)
    if fmt not in FORMATS[method]:
        raise ValueError(
            f"this {method} artifact exports to {' | '.join(FORMATS[method])}, not {fmt!r}"
        )
    if method in ("eagle1", "eagle3"):
        return export_eagle(artifact_dir, fmt, out_dir, verifier=verifier)
    if method == "medusa":
        from heads.medusa import export_medusa

        return Path(export_medusa(artifact_dir, fmt, out_dir))
    return export_draft_hf(artifact_dir, out_dir)


# ------------------------------------------------------------------------------------------------
# Writing


def _write_dir(out_dir: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Fill a temporary directory and rename it to ``out_dir`` (never half an export).

    An existing ``out_dir`` is replaced only when it is empty or a previous export (has a
    config.json), so a mistyped path never wipes unrelated files.
    """
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").is_file()):
            raise ValueError(
                f"--out {out} exists and is not an earlier export; choose a new directory"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        fill(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


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
        "torch_dtype": _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
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


def _speculators_block(cfg: EagleConfig, verifier: str, architectures: list[str]) -> dict:
    return {
        "algorithm": cfg.method.replace("eagle1", "eagle"),
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
    meta: dict, state: dict[str, torch.Tensor], fmt: str, verifier: str | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights) of an EAGLE artifact in ``fmt``; see the module docstring."""
    cfg = EagleConfig.from_dict(meta)
    if fmt not in FORMATS[cfg.method]:
        raise ValueError(
            f"this {cfg.method} artifact exports to {' | '.join(FORMATS[cfg.method])}, not {fmt!r}"
        )
    dtype = state["fc.weight"].dtype
    llama = _llama_config(cfg, dtype)
    target = meta.get("target") or {}
    provenance = {
        "method": cfg.method,
        "target": target,
        "format_version": meta.get("format_version"),
    }
    verifier = verifier or target.get("name") or "unknown"
    verifier_arch = list(cfg.layer_config.get("architectures") or ["LlamaForCausalLM"])
    prefix = "layers.0." if cfg.version == 1 else "midlayer."
    _check_llama_layer(state, prefix, fmt, cfg)
    if cfg.version == 3:
        check_vocab_maps(state["d2t"], state["t2d"], cfg.vocab_size)

    if fmt in ("vllm", "sglang"):
        weights = dict(state)
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

    # speculators
    layer_config = {**llama, "architectures": ["LlamaForCausalLM"]}
    layer_config.pop("torch_dtype")
    if cfg.version == 1:
        weights = {
            ("fusion_fc.weight" if k == "fc.weight" else "transformer." + k[len(prefix) :]): v
            for k, v in state.items()
        }
        config = {
            "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
            "speculators_model_type": "eagle",
            "transformer_layer_architecture": "LlamaDecoderLayer",
            "layernorms": False,
            "fusion_bias": False,
        }
    else:
        weights = {
            ("layers.0." + k[len(prefix) :] if k.startswith(prefix) else k): v
            for k, v in state.items()
        }
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            # speculators' loaders default this to True when absent; our layer normalises the
            # feature for attention only, the residual starts from the un-normed feature
            "norm_before_residual": False,
        }
    config.update(
        speculators_version=SPECULATORS_VERSION,
        transformer_layer_config=layer_config,
        speculators_config=_speculators_block(cfg, verifier, verifier_arch),
        torch_dtype=llama["torch_dtype"],
        draftsmith=provenance,
    )
    return config, weights


def export_eagle(
    artifact_dir: str | os.PathLike,
    fmt: str,
    out_dir: str | os.PathLike,
    verifier: str | None = None,
) -> Path:
    """Write an eagle1/eagle3 artifact in ``fmt`` (vllm | sglang | speculators) to ``out_dir``.

    ``verifier`` (speculators only): the target's Hugging Face id or path recorded as the
    verifier; default the name the artifact was trained for.
    """
    meta, state = load_artifact(artifact_dir, ("eagle1", "eagle3"))
    config, weights = eagle_serving_files(meta, state, fmt, verifier)

    def fill(tmp: Path) -> None:
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        _write_json(tmp / "config.json", config)

    return _write_dir(out_dir, fill)


# ------------------------------------------------------------------------------------------------
# Reading an export back


def _layout_of(config: dict) -> tuple[int, str]:
    kind = config.get("speculators_model_type")
    if kind in ("eagle", "eagle3"):
        return (1 if kind == "eagle" else 3), "speculators"
    arch = (config.get("architectures") or [None])[0]
    for (version, fmt), name in ARCHITECTURES.items():
        if arch == name or (version == 3 and arch == "Eagle3LlamaForCausalLM"):
            return version, fmt
    raise ValueError(
        f"config.json has architectures {config.get('architectures')} and no "
        "speculators_model_type: not an EAGLE export"
    )


def load_exported_eagle(
    directory: str | os.PathLike, target: Target, dtype: torch.dtype | None = None
) -> EagleHead:
    """Rebuild an :class:`EagleHead` from a vLLM / SGLang / speculators export, as an engine would.

    The layout is recognised from config.json; shapes must match ``target``.
    """
    directory = Path(directory)
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(f"{directory} has no config.json + model.safetensors export")
    config = json.loads((directory / "config.json").read_text())
    version, fmt = _layout_of(config)
    llama = config["transformer_layer_config"] if fmt == "speculators" else config
    state = load_file(str(directory / "model.safetensors"), device=str(target.device))
    if fmt == "speculators" and version == 1:
        state = {
            ("fc.weight" if k == "fusion_fc.weight" else "layers.0." + k[len("transformer.") :]): v
            for k, v in state.items()
            if k == "fusion_fc.weight" or k.startswith("transformer.")
        }
    elif fmt == "speculators":
        state = {
            ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
            for k, v in state.items()
            if not k.startswith(("embed_tokens.", "verifier_"))
        }
    bias = state.pop("fc.bias", None)
    if bias is not None and bool(bias.ne(0).any()):
        raise ValueError(f"{directory}: fc has a non-zero bias, which draftsmith heads do not have")

    L = target.num_layers
    if version == 1:
        aux: Sequence[int] = (L,)
    elif config.get("eagle_aux_hidden_state_layer_ids"):
        aux = config["eagle_aux_hidden_state_layer_ids"]
    elif (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        aux = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    else:
        aux = default_aux_layer_ids(L)
    layer = {
        k: v
        for k, v in llama.items()
        if k not in ("architectures", "draftsmith", "eagle_config", "torch_dtype")
    }
    cfg = EagleConfig(
        version=version,
        vocab_size=int(llama["vocab_size"]),
        draft_vocab_size=int(config.get("draft_vocab_size") or llama["vocab_size"]),
        hidden_size=int(llama["hidden_size"]),
        target_hidden_size=int(config.get("target_hidden_size") or llama["hidden_size"]),
        aux_layer_ids=tuple(aux),
        num_attention_heads=int(llama["num_attention_heads"]),
        num_key_value_heads=int(llama.get("num_key_value_heads") or llama["num_attention_heads"]),
        head_dim=int(llama.get("head_dim") or llama["hidden_size"] // llama["num_attention_heads"]),
        intermediate_size=int(llama["intermediate_size"]),
        target_num_layers=L,
        layer_config=layer,
    )
    maps = {"d2t": state.get("d2t"), "t2d": state.get("t2d")} if version == 3 else {}
    head = EagleHead(cfg, target, dtype=dtype or state["fc.weight"].dtype, **maps)
    head.load_state_dict(state, strict=True)
    return head


# ------------------------------------------------------------------------------------------------
# Distilled drafts


def export_draft_hf(artifact_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Copy a distilled draft into a clean Hugging Face directory (draftsmith's key removed)."""
    src = Path(artifact_dir)
    config = json.loads((src / "config.json").read_text())
    weights = [p for p in src.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".bin")]
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
            if path.is_file() and path.name != "config.json":
                shutil.copy2(path, tmp / path.name)
        _write_json(tmp / "config.json", config)

    return _write_dir(out_dir, fill)


# ------------------------------------------------------------------------------------------------
# Command line


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
        choices=sorted({f for fs in FORMATS.values() for f in fs}),
    )
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument(
        "--verifier",
        default=None,
        help="speculators: the target's HF id or path (default: its recorded name)",
    )
    args = parser.parse_args(argv)
    try:
        out = export(args.artifact, args.fmt, args.out, verifier=args.verifier)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
