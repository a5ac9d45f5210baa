"""EAGLE heads in the layouts serving engines load: the writers and the reader, side by side.

    export_eagle(artifact, "vllm" | "sglang" | "speculators", out)   # EAGLE-3
    export_eagle(artifact, "vllm" | "sglang", out)                   # EAGLE-1
    load_eagle_head(directory, target)   # an artifact, an export, or a published head

Every layout is written as its consumer's own loader reads it, at a named version (see
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

Only Llama-style layers (q/k/v/o, gate/up/down, RMS norms) can be served by these engines; a head
built from another architecture is refused with the names of the weights that do not fit.

The reader (:func:`load_eagle_head`) takes a draftsmith artifact, one of these exports, or a head
published for a serving engine:

* EAGLE-3 in the vLLM / SGLang layout (``LlamaForCausalLMEagle3``, ``Eagle3LlamaForCausalLM``;
  weights ``midlayer.*`` or ``layers.0.*``, as the EAGLE authors, SpecForge and AngelSlim publish
  them), with or without ``d2t``/``t2d`` (none: the full vocabulary), with or without its own
  ``lm_head`` (none: the target's, as vLLM shares it) and ``embed_tokens`` (which must then be the
  target's: the head reads the target's embedding);
* EAGLE-3 in the speculators layout (``speculators_model_type: eagle3``, RedHatAI's heads, and
  what ``speculators train`` 0.9.0 writes: its defaults ``norm_before_fc`` (``input_norm.weight``),
  ``norm_before_residual`` and ``norm_output`` are computed as speculators computes them (see
  heads/eagle.py), an absent ``norm_before_residual`` read as true as vLLM's speculators bridge
  reads it; its sliding window (2048 positions for every layer by default) is kept as a limit:
  full attention is the same computation below it, and a longer context is refused);
* EAGLE-1 in the vLLM / SGLang layout (``EagleLlamaForCausalLM``, ``LlamaForCausalLMEagle``).

Aux layers are read in vLLM's convention from top-level ``eagle_aux_hidden_state_layer_ids``,
else in SGLang's from ``eagle_config`` (plus one), else vLLM's and SGLang's default
(2, L // 2, L - 3). A head that does not fit the target (hidden size, vocabulary, d2t range, aux
layers beyond its depth, head_dim, rope) is refused naming the tensor or key and both values.
Weights are read from safetensors only (:func:`draftsmith.layouts.files.read_safetensors`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from draftsmith.files.output_dir import check_destination
from draftsmith.heads.artifact import load_artifact, read_artifact_config
from draftsmith.heads.draft_vocab import check_vocab_maps
from draftsmith.heads.eagle import EagleHead, load_eagle
from draftsmith.heads.eagle_config import EagleConfig, default_aux_layer_ids
from draftsmith.layouts.consumer_check import run_speculators_check, speculators_python
from draftsmith.layouts.files import (
    ExportOptions,
    check_format,
    checked_hub_id,
    find_target,
    read_config,
    read_safetensors,
    recorded_identity,
    resolve_hub_id,
    write_export,
)
from draftsmith.layouts.gguf import check_gguf_destination, check_served, write_gguf
from draftsmith.layouts.verdicts import max_diff, say
from draftsmith.targets.features import target_features
from draftsmith.targets.target import Target, dtype_name

ARTIFACT_METHODS = ("eagle1", "eagle3")
# what cannot be run here, per format
NOT_RUN_HERE = {
    "vllm": "vLLM 0.33.0 needs a GPU build",
    "sglang": "SGLang 0.5.23 needs a GPU build",
}
FORMATS = {
    "eagle1": ("vllm", "sglang"),
    "eagle3": ("vllm", "sglang", "speculators", "gguf"),
}
REFUSED = {
    ("eagle1", "speculators"): (
        "speculators has no EAGLE-1 model (speculators 0.9.0 registers eagle3, peagle, dflash, "
        "dflash2, dspark, mtp and xpress; an 'eagle' config fails its validation) and vLLM's "
        "speculators path loads none either. Export EAGLE-1 with --format vllm (vLLM "
        "EagleLlamaForCausalLM) or --format sglang, or train an EAGLE-3 head "
        "(train/eagle.py --version 3) for speculators"
    ),
    ("eagle1", "gguf"): (
        "llama.cpp serves EAGLE-3 heads only (--spec-type draft-eagle3; its converter has no "
        "EAGLE-1 model). Train an EAGLE-3 head (train/eagle.py --version 3) for llama.cpp, or "
        "export this one with --format vllm or --format sglang"
    ),
}
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE1_ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
# config flags of EAGLE-3 variants whose computation draftsmith's head does not have
_UNSUPPORTED_FLAGS = ("fc_norm", "use_aux_norm")
# the variants it has (heads/eagle.py), read from a published config
VARIANT_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")
# a layer config's sliding-window keys: the window becomes the head's sliding_window limit
_WINDOW_KEYS = ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers")
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
    check_format(FORMATS, REFUSED, cfg.method, fmt)
    read = [k for k in VARIANT_FLAGS if getattr(cfg, k)] + (
        ["sliding_window"] if cfg.sliding_window else [])
    if read:
        raise ValueError(f"this head sets {read}, speculators' variants that draftsmith reads to "
                         "evaluate published heads; its exports write draftsmith's own EAGLE-3")
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
    check_format(FORMATS, REFUSED, meta["method"], fmt)
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


def export_eagle_gguf(artifact_dir: str | os.PathLike, out_file: str | os.PathLike, *,
                      target: Target | str | os.PathLike | None = None,
                      gguf_type: str | None = None, overwrite: bool = False) -> Path:
    """An EAGLE-3 head as a GGUF file for llama.cpp (``--spec-type draft-eagle3``): the vLLM
    layout converted by llama.cpp's converter, which reads the target's Hugging Face directory
    (``target``, default the recorded one) for its vocabulary and aux layers."""
    meta = read_artifact_config(artifact_dir, ("eagle1", "eagle3"))
    check_format(FORMATS, REFUSED, meta["method"], "gguf")
    found = find_target(meta, target)
    if found is None or found.path is None:
        raise ValueError(
            "llama.cpp's converter reads the target's Hugging Face directory for an EAGLE-3 "
            "head (its vocabulary and layers), and this artifact's target is not on this machine"
            ": pass --target (a directory, a .gguf or an embedded name)")
    check_gguf_destination(out_file, overwrite=overwrite, protect=[artifact_dir, found.path])
    return write_gguf(out_file, lambda tmp: export_eagle(artifact_dir, "vllm", tmp),
                      gguf_type=gguf_type, target_model_dir=found.path, overwrite=overwrite,
                      protect=[artifact_dir, found.path])


def export_layout(artifact_dir: str | os.PathLike, fmt: str, out_dir: str | os.PathLike,
                  options: ExportOptions) -> Path:
    """The layouts table's entry: :func:`export_eagle` (or the GGUF) with the options."""
    if fmt == "gguf":
        return export_eagle_gguf(artifact_dir, out_dir, target=options.target,
                                 gguf_type=options.gguf_type, overwrite=options.overwrite)
    return export_eagle(artifact_dir, fmt, out_dir, verifier=options.verifier,
                        target=options.target, overwrite=options.overwrite)


# ------------------------------------------------------------------------------------------------
# the reader


def eagle_layout(config: dict, directory: Path) -> tuple[int, str]:
    """(EAGLE version, layout) from a config.json: layout is "speculators" or "engine"."""
    kind = config.get("speculators_model_type")
    if kind == "eagle3":
        return 3, "speculators"
    if kind == "eagle":
        return 1, "speculators"
    if kind is not None:
        raise ValueError(f"{directory}: speculators_model_type {kind!r} is not an EAGLE head "
                         "draftsmith can evaluate (eagle3, or eagle from older speculators)")
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch in EAGLE3_ARCHITECTURES:
        return 3, "engine"
    if arch in EAGLE1_ARCHITECTURES:
        return 1, "engine"
    raise ValueError(
        f"{directory}: config.json has architectures {archs} and no speculators_model_type: not "
        f"an EAGLE head (expected one of {EAGLE3_ARCHITECTURES + EAGLE1_ARCHITECTURES})"
    )


def _our_names(state: dict[str, torch.Tensor], version: int, layout: str,
               directory: Path) -> dict[str, torch.Tensor]:
    """Rename a published head's weights to draftsmith's (fc, midlayer.* / layers.0.*, ...)."""
    layer = "midlayer." if version == 3 else "layers.0."
    out = {}
    for key, value in state.items():
        name = key.removeprefix("model.")
        if layout == "speculators" and version == 1:
            name = name.replace("fusion_fc.", "fc.").replace("transformer.", "layers.0.")
        for prefix in ("midlayer.", "layers.0."):
            if name.startswith(prefix):
                name = layer + name[len(prefix):]
        if name.startswith(("verifier_lm_head.", "verifier_norm.")):
            continue  # speculators' frozen copies of the verifier's, never part of the head
        out[name] = value
    odd = [k for k in out if k.startswith("layers.") and not k.startswith(layer)
           or k.startswith("fc_norm.")]
    if odd:
        raise ValueError(f"{directory}: weights {odd[:4]} belong to a drafter with more than one "
                         "layer or normed aux features, which draftsmith's EAGLE head does not have")
    return out


def _same_as_target(name: str, value: torch.Tensor, expected: torch.Tensor, directory: Path,
                    what: str) -> None:
    if tuple(value.shape) != tuple(expected.shape):
        raise ValueError(f"{directory}: {name} has shape {tuple(value.shape)}, the target's "
                         f"{what} has {tuple(expected.shape)}: a head for another target")
    close = torch.allclose(value.to(torch.float32), expected.detach().cpu().to(torch.float32),
                           rtol=1e-2, atol=1e-2)
    if not close:
        raise ValueError(f"{directory}: {name} differs from the target's {what}; draftsmith's "
                         "head reads the target's own, so this head was trained for another "
                         "target (or with its own, which it cannot evaluate)")


def _target_rope_theta(target: Target) -> float | None:
    tc = target.config
    rope = getattr(tc, "rope_parameters", None) or {}
    if isinstance(rope, dict) and "rope_theta" in rope:
        return float(rope["rope_theta"])
    theta = getattr(tc, "rope_theta", None)
    return None if theta is None else float(theta)


def _aux_ids(config: dict, llama: dict, version: int, target: Target) -> tuple[int, ...]:
    L = target.num_layers
    if version == 1:
        return (L,)
    for source in (config, llama):
        if source.get("eagle_aux_hidden_state_layer_ids"):
            return tuple(int(i) for i in source["eagle_aux_hidden_state_layer_ids"])
    sglang = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if sglang:
        return tuple(int(i) + 1 for i in sglang)  # SGLang counts layer outputs
    return default_aux_layer_ids(L)


def _sliding_window(llama: dict) -> int | None:
    """The window a layer config slides its attention over, or None for full attention."""
    sliding = llama.get("use_sliding_window") or "sliding_attention" in (
        llama.get("layer_types") or [])
    window = llama.get("sliding_window")
    return int(window) if sliding and window else None


def _eagle_config(config: dict, llama: dict, version: int, state: dict, target: Target,
                  directory: Path, variant: dict[str, bool]) -> EagleConfig:
    def need(key):
        if key not in llama:
            raise ValueError(f"{directory}/config.json has no {key!r}")
        return llama[key]

    hidden = int(need("hidden_size"))
    vocab = int(need("vocab_size"))
    heads = int(need("num_attention_heads"))
    head_dim = int(llama.get("head_dim") or hidden // heads)
    L = target.num_layers
    checks = [
        ("hidden_size", hidden, target.hidden_size),
        ("vocab_size", vocab, target.vocab_size),
        ("target_hidden_size", int(config.get("target_hidden_size") or hidden),
         target.hidden_size),
    ]
    target_heads = int(target.config.num_attention_heads)
    target_head_dim = int(getattr(target.config, "head_dim", None)
                          or target.hidden_size // target_heads)
    checks.append(("head_dim", head_dim, target_head_dim))
    for key, mine, theirs in checks:
        if mine != theirs:
            raise ValueError(f"{directory}: config {key} is {mine}, the target "
                             f"{target.name!r} has {theirs}: this head is for another target")
    rope = llama.get("rope_parameters") or {}
    theta = rope.get("rope_theta", llama.get("rope_theta")) if isinstance(rope, dict) else None
    target_theta = _target_rope_theta(target)
    if theta is not None and target_theta is not None and float(theta) != target_theta:
        raise ValueError(f"{directory}: config rope_theta is {theta}, the target's is "
                         f"{target_theta}; draftsmith's head uses the target's rotary tables")
    aux = _aux_ids(config, llama, version, target)
    if version == 3 and not (len(aux) == 3 and all(1 <= i <= L - 1 for i in aux)
                             and list(aux) == sorted(set(aux))):
        raise ValueError(
            f"{directory}: eagle_aux_hidden_state_layer_ids {list(aux)} (vLLM's count: inputs of "
            f"decoder layers) must be three ascending indices in 1..{L - 1} for the target "
            f"{target.name!r} with {L} layers: this head reads layers the target does not have"
        )
    lm_head = state.get("lm_head.weight")
    draft_vocab = config.get("draft_vocab_size") or llama.get("draft_vocab_size")
    if draft_vocab is None:
        draft_vocab = lm_head.shape[0] if (version == 3 and lm_head is not None) else vocab
    layer = {k: v for k, v in llama.items()
             if k not in ("architectures", "draftsmith", "eagle_config", "torch_dtype", "dtype",
                          "draft_vocab_size", "target_hidden_size",
                          "eagle_aux_hidden_state_layer_ids", "_name_or_path",
                          "transformers_version", *_UNSUPPORTED_FLAGS, *VARIANT_FLAGS,
                          *_WINDOW_KEYS)}
    layer["num_hidden_layers"] = 1
    layer["head_dim"] = head_dim
    return EagleConfig(
        version=version,
        vocab_size=vocab,
        draft_vocab_size=int(draft_vocab),
        hidden_size=hidden,
        target_hidden_size=int(config.get("target_hidden_size") or hidden),
        aux_layer_ids=aux,
        num_attention_heads=heads,
        num_key_value_heads=int(llama.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(need("intermediate_size")),
        target_num_layers=L,
        layer_config=layer,
        sliding_window=_sliding_window(llama),
        **variant,
    )


def _vocab_maps(state: dict, cfg: EagleConfig, directory: Path):
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    V, N = cfg.vocab_size, cfg.draft_vocab_size
    if d2t is not None and tuple(d2t.shape) != (N,):
        raise ValueError(f"{directory}: d2t has shape {tuple(d2t.shape)}, draft_vocab_size "
                         f"{N} needs ({N},)")
    if t2d is not None and tuple(t2d.shape) != (V,):
        raise ValueError(f"{directory}: t2d has shape {tuple(t2d.shape)}, the target's "
                         f"vocabulary needs ({V},)")
    if d2t is None and t2d is None:
        if N != V:
            raise ValueError(f"{directory}: draft_vocab_size {N} < vocab_size {V} but the head "
                             "has no d2t mapping draft ids to target ids")
        return None, None
    if d2t is None:  # target ids of the draft vocabulary, ascending
        kept = torch.nonzero(t2d.to(torch.bool)).flatten()
        d2t = kept - torch.arange(kept.numel())
    d2t = d2t.to(torch.int64)
    target_ids = torch.arange(N) + d2t
    if N and (int(target_ids.min()) < 0 or int(target_ids.max()) >= V):
        raise ValueError(f"{directory}: d2t maps draft ids to target ids "
                         f"{int(target_ids.min())}..{int(target_ids.max())}, outside the "
                         f"target's vocabulary 0..{V - 1}")
    if t2d is None:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[target_ids] = True
    return d2t, t2d.to(torch.bool)


def load_eagle_head(directory: str | os.PathLike, target: Target,
                    dtype: torch.dtype | None = None, *,
                    allow_other_weights: bool = False) -> EagleHead:
    """An EagleHead on ``target`` from a draftsmith artifact, an export or a published head.

    ``dtype`` defaults to the target's (as :func:`draftsmith.heads.eagle.load_eagle`);
    ``allow_other_weights`` accepts a target of the recorded shapes with other weights.
    """
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"EAGLE head directory {directory} does not exist")
    config = read_config(directory)
    if config.get("method") in ("eagle1", "eagle3"):
        return load_eagle(directory, target, dtype=dtype,
                          allow_other_weights=allow_other_weights)
    version, layout = eagle_layout(config, directory)
    llama = config.get("transformer_layer_config") or config if layout == "speculators" else config
    flags = {**llama, **config}
    if layout == "speculators" and version == 3:
        # vLLM's speculators bridge reads an absent norm_before_residual as true
        flags.setdefault("norm_before_residual", True)
    on = [k for k in _UNSUPPORTED_FLAGS if flags.get(k)]
    if on:
        raise ValueError(f"{directory}: config sets {on}, an EAGLE-3 variant whose computation "
                         "draftsmith's head does not implement; it cannot be evaluated here")
    variant = {k: bool(flags.get(k, False)) for k in VARIANT_FLAGS}
    if version == 1 and any(variant.values()):
        raise ValueError(f"{directory}: config sets {[k for k, v in variant.items() if v]}, "
                         "EAGLE-3 variants, on an EAGLE-1 head")
    recorded = recorded_identity(config)
    if recorded:
        target.check_identity(recorded, what=f"export {directory}",
                              allow_other_weights=allow_other_weights)
    state = _our_names(read_safetensors(directory), version, layout, directory)
    cfg = _eagle_config(config, llama, version, state, target, directory, variant)
    bias = state.pop("fc.bias", None)
    if bias is not None and bool(bias.ne(0).any()):
        raise ValueError(f"{directory}: fc has a non-zero bias, which draftsmith heads do not have")
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None:
        _same_as_target("embed_tokens.weight", embed, target.embed.weight, directory, "embedding")
    maps = {}
    if version == 3:
        d2t, t2d = _vocab_maps(state, cfg, directory)
        maps = {"d2t": d2t, "t2d": t2d}
        if "lm_head.weight" not in state:
            if cfg.draft_vocab_size != cfg.vocab_size:
                raise ValueError(f"{directory}: no lm_head.weight for a draft vocabulary of "
                                 f"{cfg.draft_vocab_size} tokens")
            state["lm_head.weight"] = target.lm_head.weight.detach().clone()  # as vLLM shares it
    else:
        lm_head = state.pop("lm_head.weight", None)
        if lm_head is not None:
            _same_as_target("lm_head.weight", lm_head, target.lm_head.weight, directory,
                            "LM head")
    head = EagleHead(cfg, target, dtype=dtype, **maps)
    expected = head.state_dict()
    if version == 3:
        state["d2t"], state["t2d"] = head.d2t, head.t2d
    for key, value in state.items():
        if key not in expected:
            raise ValueError(f"{directory}: weight {key} has no place in an EAGLE-{version} head "
                             f"built like the target's layers (expected {sorted(expected)[:6]}...)")
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(f"{directory}: {key} has shape {tuple(value.shape)}, the head for "
                             f"target {target.name!r} needs {tuple(expected[key].shape)}")
    missing = sorted(set(expected) - set(state))
    if missing:
        layer = type(target.layers[0]).__name__
        raise ValueError(f"{directory}: weights {missing[:6]} are missing: the head as published "
                         f"has none, and a head built like the target's {layer} needs them")
    head.load_state_dict({k: v.to(expected[k].device) for k, v in state.items()}, strict=True)
    return head


# ------------------------------------------------------------------------------------------------
# the check


def _eagle_inputs(target: Target, version: int, aux, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, 12), generator=gen).to(target.device)
    cfg = EagleConfig.from_target(target, version, aux_layer_ids=aux if version == 3 else None)
    return ids, target_features(target, ids, None, cfg)["features"]


def _eagle_logits(head, ids, features):
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    return head(ids, head.fuse(features), positions)[1]


def check_eagle_export(artifact_dir, fmt, out_dir, target) -> bool:
    """Round trip (the export read back gives the artifact's draft logits) and, for speculators,
    speculators' own ``from_pretrained`` in its venv when that venv is built."""
    meta = read_artifact_config(artifact_dir)
    target = find_target(meta, target)
    if target is None:
        say("not verified", "round trip and consumer load: the target is needed (pass --target)")
        return True
    if fmt == "gguf":  # the consumer runs here: serve it
        return check_served(out_dir, target, "draft-eagle3")
    head = load_eagle(artifact_dir, target).eval()
    back = load_eagle_head(out_dir, target).eval()
    ids, features = _eagle_inputs(target, head.version, head.config.aux_layer_ids)
    with torch.no_grad():
        ours = _eagle_logits(head, ids, features)
        theirs = _eagle_logits(back, ids, features)
    ok = torch.equal(ours, theirs)
    say("verified" if ok else "FAILED",
         f"round trip: {fmt} export read back gives the artifact's draft logits "
         f"(max |diff| {max_diff(ours, theirs):.3g} over {ids.shape[1]} positions)")
    if fmt != "speculators":
        return ok
    python = speculators_python()
    if python is None:
        say("not verified", "speculators' own from_pretrained: its venv is not built here "
             "(draftsmith consumer-check install, about 1 GB, CPU torch)")
        return ok
    if target.path is None:
        say("not verified", "speculators load: the target has no local directory to serve as "
             "the verifier")
        return ok
    report = run_speculators_check(python, out_dir, target.path, features.float().cpu(),
                                   ids.cpu())
    problems = {k: report[k] for k in ("missing", "unexpected", "uninitialised", "mismatched")
                if report[k]}
    diff = max_diff(report["logits"], ours.float().cpu())
    # speculators computes in the export's dtype; draftsmith's head here in the target's (a bf16
    # artifact loads as fp32), so a bf16 export differs by speculators' own rounding
    tol = 1e-3 if report.get("dtype", "float32") == "float32" else 3e-2
    scale = float(ours.abs().max())
    good = not problems and diff <= tol * max(1.0, scale)
    say("verified" if good else "FAILED",
         f"speculators 0.9.0 SpeculatorModel.from_pretrained: {report['class']}, "
         + (f"problems {problems}, " if problems else "no missing, unexpected or uninitialised "
            "weights, ")
         + f"logits max |diff| {diff:.3g} from draftsmith's head")
    return ok and good
