"""Block drafts in the layouts serving engines load: the writers and the reader, side by side.

    export_block(artifact, "vllm" | "sglang" | "speculators" | "gguf", out)
    load_block_draft(directory, target)   # an artifact, an export, or a published draft

* ``vllm`` / ``sglang``: z-lab's layout, which vLLM (``dflash``, ``dspark``), SGLang (``DFLASH``,
  ``DSPARK``) and llama.cpp's converter read. DFlash: ``architectures ["DFlashDraftModel"]``,
  ``model_type qwen3``, the Qwen3 keys of the draft's layers, ``block_size`` and
  ``dflash_config`` ``{mask_token_id, target_layer_ids, block_size}`` (ids counted as outputs of
  layer k, as z-lab's are); weights ``layers.{i}.*``, ``fc.weight``, ``hidden_norm.weight``,
  ``norm.weight``, no ``model.`` prefix, no embedding (the engines use the target's). DSpark:
  ``architectures ["Qwen3DSparkModel"]`` (the name vLLM and llama.cpp both accept for a dense
  DSpark), top-level ``target_layer_ids``, ``mask_token_id``, ``block_size``, ``markov_rank``,
  ``markov_head_type: vanilla``, ``enable_confidence_head``, ``confidence_head_with_markov:
  true``, ``sample_from_anchor: true``, plus ``markov_head.markov_w1/w2.weight`` and
  ``confidence_head.proj.weight/bias``. A draft vocabulary adds ``lm_head.weight`` (N, H) and
  ``d2t`` (int64 offsets, target id = draft id + d2t[draft id]); without one the engines take
  the target's LM head.
* ``speculators``: ``speculators_model_type`` dflash/dspark, the layer config as
  ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` (speculators counts one more: the
  input of layer k + 1), ``speculators_config`` naming the verifier by its hub id, and the
  target's embedding and LM head copied in (``embed_tokens.weight``, ``lm_head.weight``).
* ``gguf``: the z-lab layout converted by llama.cpp's own converter with ``--target-model-dir``
  (llama-server ``--spec-type draft-dflash`` / ``draft-dspark``). llama.cpp's DFlash graph needs
  per-head q/k norms and no biases, which these layers have.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from draftsmith.files.output_dir import check_destination
from draftsmith.heads.artifact import load_artifact, read_artifact_config
from draftsmith.heads.dflash import METHODS, DFlashConfig, DFlashDraft, load_dflash
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
from draftsmith.targets.target import Target, dtype_name

ARTIFACT_METHODS = METHODS
FORMATS = {m: ("vllm", "sglang", "speculators", "gguf") for m in METHODS}
REFUSED: dict[tuple[str, str], str] = {}
NOT_RUN_HERE = {"vllm": "vLLM 0.33.0 needs a GPU build", "sglang": "SGLang 0.5.23 needs a GPU build",
                "speculators": "speculators' DFlash and DSpark models are checked here by reading "
                               "the export back, not by speculators itself"}
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}
SPEC_TYPES = {"dflash": "draft-dflash", "dspark": "draft-dspark"}
# llama.cpp 0c1e570 serves a DFlash draft with a draft vocabulary (its loader reads ``d2t`` and
# scatters the draft's logits onto the target's vocabulary), but only its converter's DSpark
# class writes ``d2t``; the DFlash class cannot map the tensor. So the conversion layout of such
# a draft names that class: without Markov tensors the GGUF is a plain DFlash draft (the same
# architecture, the Markov head absent) and --spec-type draft-dflash reads it as one.
GGUF_VOCAB_ARCHITECTURE = "DSparkDraftModel"
SPECULATORS_VERSION = "0.9.0"


def _layer_keys(cfg: DFlashConfig, dtype: torch.dtype) -> dict:
    return {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "torch_dtype": dtype_name(dtype),
    }


def serving_files(meta: dict, state: dict[str, torch.Tensor], fmt: str, *,
                  verifier: str | None = None,
                  target: Target | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights) of a block-draft artifact in ``fmt``; see the module docstring."""
    cfg = DFlashConfig.from_dict(meta)
    check_format(FORMATS, REFUSED, cfg.method, fmt)
    dtype = state["fc.weight"].dtype
    provenance = {"method": cfg.method, "target": meta.get("target") or {},
                  "format_version": meta.get("format_version")}
    weights = {k: v for k, v in state.items() if k != "t2d"}
    dflash_config = {"mask_token_id": cfg.mask_token_id,
                     "target_layer_ids": list(cfg.target_layer_ids), "block_size": cfg.block_size}
    layer = _layer_keys(cfg, dtype)
    if fmt in ("vllm", "sglang", "gguf"):
        arch = ARCHITECTURES[cfg.method]
        if fmt == "gguf" and cfg.method == "dflash" and cfg.draft_vocab_size is not None:
            arch = GGUF_VOCAB_ARCHITECTURE
        config = {**layer, "architectures": [arch],
                  "block_size": cfg.block_size, "num_target_layers": cfg.target_num_layers,
                  "draft_vocab_size": cfg.head_vocab_size, "draftsmith": provenance}
        if cfg.method == "dflash":
            config["dflash_config"] = dflash_config
        else:
            config.update(dflash_config, markov_rank=cfg.markov_rank,
                          markov_head_type="vanilla", enable_confidence_head=cfg.confidence_head,
                          confidence_head_with_markov=True, sample_from_anchor=True)
        return config, weights
    # speculators
    if verifier is None:
        raise ValueError("the speculators format names the verifier by its Hugging Face hub id "
                         "and this artifact records none: pass --verifier ORG/NAME")
    checked_hub_id(verifier, "verifier")
    if target is None:
        raise ValueError("the speculators format carries the target's embedding and LM head "
                         "(speculators does not fill them from the verifier): pass --target")
    weights["embed_tokens.weight"] = target.embed.weight.detach().to("cpu", dtype)
    if cfg.draft_vocab_size is None:
        weights["lm_head.weight"] = target.lm_head.weight.detach().to("cpu", dtype)
    else:
        weights["t2d"] = state["t2d"]
    layer.pop("torch_dtype")
    config = {
        "architectures": ["DSparkSpeculator" if cfg.method == "dspark" else "DFlashSpeculator"],
        "speculators_model_type": cfg.method, "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {**layer, "architectures": ["Qwen3ForCausalLM"]},
        "draft_vocab_size": cfg.head_vocab_size, "block_size": cfg.block_size,
        "target_hidden_size": None, "mask_token_id": cfg.mask_token_id,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "sample_from_anchor": cfg.sample_from_anchor,
        "speculators_config": {
            "algorithm": cfg.method, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": cfg.drafts_per_block}],
            "verifier": {"name_or_path": verifier,
                         "architectures": list((meta.get("target") or {}).get("architectures")
                                               or ["LlamaForCausalLM"])}},
        "torch_dtype": dtype_name(dtype), "draftsmith": provenance,
    }
    if cfg.method == "dspark":
        config.update(markov_rank=cfg.markov_rank, markov_head_type="vanilla",
                      enable_confidence_head=cfg.confidence_head,
                      confidence_head_with_markov=True)
    return config, weights


def export_block(artifact_dir: str | os.PathLike, fmt: str, out: str | os.PathLike, *,
                 verifier: str | None = None, target: Target | str | os.PathLike | None = None,
                 gguf_type: str | None = None, overwrite: bool = False) -> Path:
    """Write a dflash/dspark artifact in ``fmt`` to ``out`` (a directory; a file for gguf)."""
    meta = read_artifact_config(artifact_dir, METHODS)
    check_format(FORMATS, REFUSED, meta["method"], fmt)
    if fmt == "gguf":
        found = find_target(meta, target)
        if found is None or found.path is None:
            raise ValueError("llama.cpp's converter reads the target's Hugging Face directory for "
                             "a block draft (its vocabulary): pass --target")
        check_gguf_destination(out, overwrite=overwrite, protect=[artifact_dir, found.path])

        def layout(tmp: Path) -> Path:
            _, state = load_artifact(artifact_dir, METHODS)
            config, weights = serving_files(meta, state, "gguf")
            return write_export(tmp, {"config.json": config, "model.safetensors": weights},
                                source=artifact_dir, fmt="gguf")

        return write_gguf(out, layout, gguf_type=gguf_type, target_model_dir=found.path,
                          overwrite=overwrite, protect=[artifact_dir, found.path])
    check_destination(out, kind="export", overwrite=overwrite, protect=[artifact_dir])
    _, state = load_artifact(artifact_dir, METHODS)
    found = None
    if fmt == "speculators":
        verifier = resolve_hub_id(meta, verifier, "--verifier")
        found = find_target(meta, target)
    config, weights = serving_files(meta, state, fmt, verifier=verifier, target=found)
    return write_export(out, {"config.json": config, "model.safetensors": weights},
                        source=artifact_dir, fmt=fmt, overwrite=overwrite)


def export_layout(artifact_dir, fmt, out, options: ExportOptions) -> Path:
    """The layouts table's entry: :func:`export_block` with the command line's options."""
    return export_block(artifact_dir, fmt, out, verifier=options.verifier, target=options.target,
                        gguf_type=options.gguf_type, overwrite=options.overwrite)


# ------------------------------------------------------------------------------------------------
# the reader


def _method_of(config: dict, directory: Path) -> str:
    kind = config.get("speculators_model_type")
    if kind in METHODS:
        return kind
    archs = config.get("architectures") or []
    if archs and archs[0] in ("DFlashDraftModel", "DFlashSpeculator"):
        return "dflash"
    if archs and archs[0] in ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator"):
        return "dspark"
    raise ValueError(f"{directory}: config.json has architectures {archs}: not a DFlash or "
                     "DSpark draft (expected DFlashDraftModel, Qwen3DSparkModel or a speculators "
                     "dflash/dspark config)")


def _config_from_layout(config: dict, method: str, target: Target, directory: Path,
                        state: dict) -> DFlashConfig:
    layer = config.get("transformer_layer_config") or config
    block = config.get("dflash_config") or {}
    if "aux_hidden_state_layer_ids" in config:  # speculators counts layer inputs
        ids = [int(i) - 1 for i in config["aux_hidden_state_layer_ids"]]
    else:
        ids = block.get("target_layer_ids", config.get("target_layer_ids"))
    mask = block.get("mask_token_id", config.get("mask_token_id"))
    if ids is None or mask is None:
        raise ValueError(f"{directory}: no target_layer_ids / mask_token_id: not a complete "
                         f"{method} draft")
    hidden, vocab = int(layer["hidden_size"]), int(layer["vocab_size"])
    if (hidden, vocab) != (target.hidden_size, target.vocab_size):
        raise ValueError(f"{directory}: a draft for a target of hidden {hidden} and vocabulary "
                         f"{vocab}; {target.name!r} has {target.hidden_size} and "
                         f"{target.vocab_size}: this draft is for another target")
    lm_head = state.get("lm_head.weight")
    draft_vocab = None
    if lm_head is not None and lm_head.shape[0] < vocab:
        draft_vocab = int(lm_head.shape[0])
    rope = layer.get("rope_parameters") or {}
    return DFlashConfig(
        method=method, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(layer["intermediate_size"]),
        num_hidden_layers=int(layer["num_hidden_layers"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        head_dim=int(layer.get("head_dim") or hidden // int(layer["num_attention_heads"])),
        target_layer_ids=tuple(ids), target_num_layers=target.num_layers,
        mask_token_id=int(mask),
        block_size=int(block.get("block_size") or config.get("block_size") or 16),
        draft_vocab_size=draft_vocab,
        markov_rank=int(config.get("markov_rank") or 0) if method == "dspark" else 0,
        confidence_head=bool(config.get("enable_confidence_head")) if method == "dspark"
        else False,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)))


def load_block_draft(directory: str | os.PathLike, target: Target,
                     dtype: torch.dtype | None = None, *, method: str | None = None,
                     allow_other_weights: bool = False) -> DFlashDraft:
    """A DFlashDraft on ``target`` from a draftsmith artifact, an export, or a published draft
    (z-lab's layout, vLLM's dense DSpark, speculators')."""
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"block draft directory {directory} does not exist")
    config = read_config(directory)
    if config.get("method") in METHODS:
        return load_dflash(directory, target, dtype=dtype, method=method,
                           allow_other_weights=allow_other_weights)
    found = _method_of(config, directory)
    if method is not None and found != method:
        raise ValueError(f"{directory} holds a {found} draft, not {method}: use --method "
                         f"{found}:{directory}")
    recorded = recorded_identity(config)
    if recorded:
        target.check_identity(recorded, what=f"export {directory}",
                              allow_other_weights=allow_other_weights)
    state = read_safetensors(directory)
    cfg = _config_from_layout(config, found, target, directory, state)
    for name in ("embed_tokens.weight", "t2d"):
        state.pop(name, None)
    if cfg.draft_vocab_size is None:
        state.pop("lm_head.weight", None)  # the target's own, which the draft shares
    maps = {}
    if cfg.draft_vocab_size is not None:
        d2t = state.get("d2t")
        if d2t is None:
            raise ValueError(f"{directory}: lm_head has {cfg.draft_vocab_size} rows but there is "
                             "no d2t mapping them to target ids")
        target_ids = torch.arange(d2t.numel()) + d2t.to(torch.int64)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        maps = {"d2t": d2t.to(torch.int64), "t2d": t2d}
        state["t2d"] = t2d
    draft = DFlashDraft(cfg, target, dtype=dtype, **maps)
    expected = draft.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not fit a {found} draft built from its config "
                         f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    draft.load_state_dict({k: v.to(expected[k].device) for k, v in state.items()}, strict=True)
    return draft.eval()


# ------------------------------------------------------------------------------------------------
# the check


def check_block_export(artifact_dir, fmt, out_dir, target) -> bool:
    """Round trip (the export read back gives the artifact's block outputs); a GGUF is served
    by llama-server beside its target."""
    meta = read_artifact_config(artifact_dir)
    target = find_target(meta, target)
    if target is None:
        say("not verified", "round trip: the target is needed (pass --target)")
        return True
    if fmt == "gguf":
        return check_served(out_dir, target, SPEC_TYPES[meta["method"]])
    ours = load_dflash(artifact_dir, target).eval()
    back = load_block_draft(out_dir, target).eval()
    gen = torch.Generator().manual_seed(0)
    cfg = ours.config
    feats = torch.randn(1, 10, len(cfg.target_layer_ids) * cfg.hidden_size, generator=gen)
    positions = torch.arange(10)[None]
    block = torch.full((1, cfg.block_size), cfg.mask_token_id)
    block[0, 0] = 5
    pos = torch.arange(10, 10 + cfg.block_size)[None]
    allowed = torch.ones(1, cfg.block_size, 10 + cfg.block_size, dtype=torch.bool)
    with torch.no_grad():
        a = ours.block(block, pos, ours.context(feats.to(ours.dtype), positions), allowed)
        b = back.block(block, pos, back.context(feats.to(back.dtype), positions), allowed)
        ok = torch.equal(a, b) and torch.equal(ours.logit_weight, back.logit_weight)
    say("verified" if ok else "FAILED",
        f"round trip: the {fmt} export read back gives the artifact's block states "
        f"(max |diff| {max_diff(a, b):.3g})")
    return ok
