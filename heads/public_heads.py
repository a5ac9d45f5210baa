"""Load a draft head from a directory in any layout draftsmith knows, for evaluation on a target.

    head = load_eagle_head(directory, target)         # -> EagleHead bound to the target
    artifact = load_medusa_heads(directory, target)   # -> MedusaArtifact

``directory`` is a draftsmith artifact, one of our exports, or a head published for a serving
engine:

* EAGLE-3 in the vLLM / SGLang layout (``LlamaForCausalLMEagle3``, ``Eagle3LlamaForCausalLM``;
  weights ``midlayer.*`` or ``layers.0.*``, as the EAGLE authors, SpecForge and AngelSlim publish
  them), with or without ``d2t``/``t2d`` (none: the full vocabulary), with or without its own
  ``lm_head`` (none: the target's, as vLLM shares it) and ``embed_tokens`` (which must then be the
  target's: the head reads the target's embedding);
* EAGLE-3 in the speculators layout (``speculators_model_type: eagle3``, RedHatAI's heads);
* EAGLE-1 in the vLLM / SGLang layout (``EagleLlamaForCausalLM``, ``LlamaForCausalLMEagle``);
* Medusa in the FasterDecoding / TensorRT-LLM layout (``medusa_lm_head.safetensors``) and vLLM
  <= 0.32's ``MedusaModel`` layout.

Aux layers are read in vLLM's convention from top-level ``eagle_aux_hidden_state_layer_ids``,
else in SGLang's from ``eagle_config`` (plus one), else vLLM's and SGLang's default
(2, L // 2, L - 3). A head that does not fit the target (hidden size, vocabulary, d2t range, aux
layers beyond its depth, head_dim, rope) is refused naming the tensor or key and both values.
Weights are read from safetensors only: a directory holding only ``pytorch_model.bin`` or a
``.pt`` (pickles) is refused with the one-line conversion to run where the file is trusted.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from heads.eagle import EagleConfig, EagleHead, default_aux_layer_ids, load_eagle
from heads.file_formats import load_safetensors, read_json_object
from heads.medusa import (
    MedusaArtifact,
    export_tree,
    load_medusa,
    load_medusa_export,
)
from heads.target import Target

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE1_ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
# config flags of EAGLE-3 variants whose computation draftsmith's head does not have
_UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                      "use_aux_norm")
_PICKLES = ("pytorch_model.bin", "model.pt", "pytorch_model.pt")


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


def _recorded_identity(config: dict) -> dict:
    block = config.get("draftsmith")
    return (block or {}).get("target") or {} if isinstance(block, dict) else {}


# ------------------------------------------------------------------------------------------------
# EAGLE


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
           or k.startswith(("fc_norm.", "input_norm."))]
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


def _eagle_config(config: dict, llama: dict, version: int, state: dict, target: Target,
                  directory: Path) -> EagleConfig:
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
                          "transformers_version", *_UNSUPPORTED_FLAGS)}
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

    ``dtype`` defaults to the target's (as :func:`heads.eagle.load_eagle`);
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
    recorded = _recorded_identity(config)
    if recorded:
        target.check_identity(recorded, what=f"export {directory}",
                              allow_other_weights=allow_other_weights)
    state = _our_names(read_safetensors(directory), version, layout, directory)
    cfg = _eagle_config(config, llama, version, state, target, directory)
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
# Medusa


def load_medusa_heads(directory: str | os.PathLike, target: Target,
                      device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None, *,
                      allow_other_weights: bool = False) -> MedusaArtifact:
    """A MedusaArtifact for ``target`` from a draftsmith artifact or a Medusa serving layout.

    An export's tree is its ``medusa_choices`` (cut to its heads), else each head's top-1 chain;
    no held-out accuracies come with it, so a tree for another node budget cannot be rebuilt.
    """
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"Medusa head directory {directory} does not exist")
    config = read_config(directory)
    if config.get("method") == "medusa":
        return load_medusa(directory, target, device=device, dtype=dtype,
                           allow_other_weights=allow_other_weights)
    recorded = _recorded_identity(config)
    if recorded:
        target.check_identity(recorded, what=f"export {directory}",
                              allow_other_weights=allow_other_weights)
    heads = load_medusa_export(directory)
    cfg = heads.config
    if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
        if cfg.draft_vocab_size is not None:
            raise ValueError(f"{directory}: heads of hidden {cfg.hidden_size} over a draft "
                             f"vocabulary of a {cfg.vocab_size}-token target, the target "
                             f"{target.name!r} has hidden {target.hidden_size} and "
                             f"{target.vocab_size} tokens")
        got = tuple(heads.lm_head_weight(0).shape)
        raise ValueError(f"{directory}: the vocabulary projection of head 0 has shape {got}, the "
                         f"target {target.name!r} needs ({target.vocab_size}, "
                         f"{target.hidden_size})")
    heads.to(device=device or target.device, dtype=dtype or target.dtype)
    tree = export_tree(directory, cfg.num_heads)
    return MedusaArtifact(heads.eval(), tree, {}, config)
