"""Medusa heads in the layouts serving engines load: the writers and the readers, side by side.

    export_medusa(artifact, "trtllm" | "fasterdecoding" | "vllm-0.32", out)
    load_medusa_export(directory)        # an export -> MedusaHeads
    load_medusa_heads(directory, target) # an artifact or an export -> MedusaArtifact

* ``vllm-0.32``: vLLM <= 0.32.0 ``MedusaModel`` (vLLM 0.33 has none): ``config.json``
  (``num_heads``, ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``medusa_fc_bias``,
  ``original_lm_head``, ...) and ``model.safetensors`` with ``blocks.{h}.layers.{j}.weight`` /
  ``.bias`` and ``lm_heads.{h}.weight``;
* ``trtllm`` / ``fasterdecoding``: ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
  ``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` with ``{h}.{j}.linear.weight``,
  ``{h}.{j}.linear.bias`` and ``{h}.{n}.weight`` (n = number of blocks: the vocabulary
  projection); ``fasterdecoding`` adds ``medusa_lm_head.pt`` when asked (its loader's only file).

Heads over a draft vocabulary export to ``vllm-0.32`` only, exactly: vLLM's ``MedusaModel`` reads
``truncated_vocab_size`` (= N) and a ``token_map`` tensor (int64 [N], the target id of every
draft id) and scatters each head's N logits into the full vocabulary with -inf elsewhere.
TensorRT-LLM and FasterDecoding project onto the full vocabulary with a bias-free matrix and
have no token map, and rows for the other tokens cannot keep them out of every head's top k for
every hidden state: a zero row scores 0, above any negative draft logit, and a row inside the
draft rows' convex hull stays below the best draft logit but not below the k-th. Those exports
are refused (train with ``draft_vocab_size: null`` for them).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.files.file_formats import load_safetensors, read_json_object
from draftsmith.files.output_dir import check_destination
from draftsmith.heads.artifact import read_artifact_config
from draftsmith.heads.draft_vocab import maps_from_token_ids
from draftsmith.heads.medusa import METHOD, MedusaArtifact, MedusaConfig, MedusaHeads, load_medusa
from draftsmith.heads.medusa_tree import RankPath, check_tree, default_chain
from draftsmith.layouts.files import (
    ExportOptions,
    check_format,
    find_target,
    read_config,
    recorded_identity,
    resolve_hub_id,
    write_export,
)
from draftsmith.layouts.verdicts import max_diff, say
from draftsmith.targets.target import Target, load_target

ARTIFACT_METHODS = (METHOD,)
FORMATS = {METHOD: ("trtllm", "fasterdecoding", "vllm-0.32")}
REFUSED = {
    (METHOD, "vllm"): (
        "current vLLM (0.33) has no Medusa model; vLLM 0.32.0 was the last release with "
        "MedusaModel. Export with --format vllm-0.32 to serve with vLLM <= 0.32.0, "
        "--format trtllm for TensorRT-LLM, or --format fasterdecoding --write-pt for "
        "FasterDecoding/Medusa"
    ),
    (METHOD, "gguf"): (
        "llama.cpp serves no Medusa heads (its speculative types are draft models, EAGLE-3, "
        "block drafts, MTP and n-gram lookup). For llama.cpp train an EAGLE-3 head "
        "(train/eagle.py) or a distilled draft (train/distill.py) and export that with --format "
        "gguf"
    ),
}
_TRTLLM_WEIGHTS = "medusa_lm_head.safetensors"
_PT_WEIGHTS = "medusa_lm_head.pt"  # FasterDecoding's loader reads only this pickle
_VLLM_WEIGHTS = "model.safetensors"
# what cannot be run here, per format
NOT_RUN_HERE = {
    "trtllm": "TensorRT-LLM needs a GPU build (convert with the printed convert_checkpoint.py "
              "command there)",
    "fasterdecoding": "FasterDecoding/Medusa loads its base model on a GPU and reads "
                      "medusa_lm_head.pt, which draftsmith does not load back",
    "vllm-0.32": "vLLM 0.32.0 needs a GPU build",
}



def _stored_dtype(weights: Path) -> torch.dtype:
    """The dtype of the first floating-point tensor (d2t / t2d are integers and booleans)."""
    with safe_open(str(weights), framework="pt") as f:
        for key in sorted(f.keys()):
            dtype = f.get_slice(key)[:1].dtype
            if dtype.is_floating_point:
                return dtype
    return torch.float32


def _vllm_state(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """vLLM <= 0.32 MedusaModel names; a shared projection is loaded from lm_heads.0 only.

    A draft vocabulary adds ``token_map`` (int64 (N,), the target id of every draft id), which
    vLLM reads when ``truncated_vocab_size`` < ``vocab_size``.
    """
    state = {}
    for h in range(heads.num_heads):
        for j, layer in enumerate(heads.blocks[h].layers):
            state[f"blocks.{h}.layers.{j}.weight"] = layer.weight
            if layer.bias is not None:
                state[f"blocks.{h}.layers.{j}.bias"] = layer.bias
        if h == 0 or not heads.config.share_lm_head:
            state[f"lm_heads.{h}.weight"] = heads.lm_head_weight(h)
    state = {k: v.to(dtype) for k, v in state.items()}
    columns = heads.draft_columns()
    if columns is not None:
        state["token_map"] = columns.to(torch.int64)
    return state


def _trtllm_state(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """FasterDecoding / TensorRT-LLM names: {h}.{j}.linear.weight|bias, {h}.{n}.weight."""
    n = heads.config.num_layers
    state = {}
    for h in range(heads.num_heads):
        for j, layer in enumerate(heads.blocks[h].layers):
            state[f"{h}.{j}.linear.weight"] = layer.weight
            # both loaders read a bias for every block (nn.Linear's default): an absent one is 0
            state[f"{h}.{j}.linear.bias"] = (
                layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features)
            )
        state[f"{h}.{n}.weight"] = heads.lm_head_weight(h)
    return {k: v.to(dtype) for k, v in state.items()}


# FasterDecoding/Medusa (main, commit e2a5d20) builds this many heads whatever config.json says
FASTERDECODING_HEADS = 5
FASTERDECODING_BASE_TYPES = ("llama", "mistral")


def _check_fasterdecoding(cfg: MedusaConfig, target_type: str | None, write_pt: bool) -> None:
    if cfg.num_layers > 1:
        raise ValueError(
            f"these heads have {cfg.num_layers} distinct residual blocks, but FasterDecoding's "
            "MedusaModel builds a head as [ResBlock(h)] * medusa_num_layers, one block object "
            "repeated, so its blocks share one weight: it cannot hold these heads. Use "
            "--format trtllm (TensorRT-LLM loads every block) or --format vllm-0.32"
        )
    if target_type is not None and target_type not in FASTERDECODING_BASE_TYPES:
        raise ValueError(
            f"FasterDecoding/Medusa serves only {' and '.join(FASTERDECODING_BASE_TYPES)} base "
            f"models, and these heads are for a {target_type!r} target: use --format trtllm"
        )
    if not write_pt:
        raise ValueError(
            "FasterDecoding's MedusaModel.from_pretrained reads only medusa_lm_head.pt, a pickle "
            "(torch.load); draftsmith writes one only when asked: add --write-pt. It holds a "
            "plain dict of tensors (loadable with torch.load(weights_only=True)); "
            "medusa_lm_head.safetensors beside it carries the same weights"
        )


def export_medusa(artifact_dir: str | os.PathLike, fmt: str, out_dir: str | os.PathLike,
                  target: Target | None = None, dtype: torch.dtype | None = None, *,
                  base_model: str | None = None, write_pt: bool = False,
                  overwrite: bool = False) -> Path:
    """Write the artifact in a serving layout: ``fmt`` is "trtllm", "fasterdecoding" or "vllm-0.32".

    * trtllm: config.json (medusa_num_heads, medusa_num_layers, base_model_name_or_path,
      medusa_choices) + medusa_lm_head.safetensors; TensorRT-LLM's converter takes the head count
      as a flag (:func:`trtllm_convert_command`).
    * fasterdecoding: the same files plus, with ``write_pt``, medusa_lm_head.pt (torch.save of a
      plain dict of tensors), the only file FasterDecoding's loader reads. One residual block per
      head at most; ``base_model_name_or_path`` must be a hub id (``base_model`` or recorded).
    * vllm-0.32: vLLM <= 0.32.0's MedusaModel (config.json with num_heads, num_hidden_layers,
      medusa_fc_bias, original_lm_head; model.safetensors). vLLM 0.33 has no Medusa model.

    Heads that share the target's LM head get its weight in every slot (vllm-0.32: in lm_heads.0,
    with original_lm_head). That needs the target: pass it, or it is loaded from the artifact's
    ``base_model``. Weights are written in ``dtype``, by default the artifact's.

    Heads over a draft vocabulary (``draft_vocab_size``) export to vllm-0.32 only: their (N, H)
    projections, ``truncated_vocab_size`` N and ``token_map`` (int64 (N,) target ids), which
    vLLM scatters back into the full vocabulary with -inf elsewhere, so the export proposes
    exactly the artifact's tokens. trtllm and fasterdecoding are refused (see the module
    docstring).
    """
    check_format(FORMATS, REFUSED, METHOD, fmt)
    config = read_artifact_config(artifact_dir, METHOD)
    check_destination(out_dir, kind="export", overwrite=overwrite, protect=[artifact_dir])
    hub_id = resolve_hub_id(config, base_model, "--base-model")
    cfg = MedusaConfig.from_dict(config)
    if cfg.draft_vocab_size is not None and fmt != "vllm-0.32":
        raise ValueError(
            f"these heads guess over a draft vocabulary (draft_vocab_size {cfg.draft_vocab_size} "
            f"of the target's {cfg.vocab_size} tokens), and {fmt} projects every head onto the "
            "full vocabulary with no bias and no token map, so no export to it can rank the "
            "tokens as these heads do. Export with --format vllm-0.32 (vLLM's MedusaModel maps "
            "the draft vocabulary through token_map, exactly), or train with draft_vocab_size: "
            "null for TensorRT-LLM and FasterDecoding"
        )
    if fmt == "fasterdecoding":
        _check_fasterdecoding(cfg, (config.get("target") or {}).get("model_type"), write_pt)
        if hub_id is None:
            raise ValueError(
                "FasterDecoding loads the base model named by base_model_name_or_path, and this "
                f"artifact's target {(config.get('target') or {}).get('name')!r} has no hub id "
                "recorded: pass --base-model ORG/NAME"
            )
    if target is None and cfg.reads_target_lm_head:
        spec = config.get("base_model")
        if not spec:
            raise ValueError(f"{artifact_dir} shares the target's LM head but does not say which "
                             "target it is: pass target=...")
        target = load_target(spec, device="cpu", dtype="float32")
    if dtype is None:
        dtype = _stored_dtype(Path(artifact_dir) / "model.safetensors")
    art = load_medusa(artifact_dir, target=target, device="cpu", dtype=dtype)
    heads = art.heads
    choices = [list(p) for p in art.tree]
    if fmt == "vllm-0.32":
        meta = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "num_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "truncated_vocab_size": cfg.head_vocab_size,  # < vocab_size: token_map is read
            "medusa_fc_bias": cfg.bias,
            "original_lm_head": cfg.share_lm_head,
            "max_paths": len(art.tree),
            "topk": max(max(p) for p in art.tree) + 1,
            "medusa_choices": choices,
        }
        files = {"config.json": meta, _VLLM_WEIGHTS: _vllm_state(heads, dtype)}
    else:
        meta = {
            "medusa_num_heads": cfg.num_heads,
            "medusa_num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "medusa_choices": choices,
        }
        files = {"config.json": meta, _TRTLLM_WEIGHTS: _trtllm_state(heads, dtype)}
    if hub_id is not None:
        meta["base_model_name_or_path"] = hub_id
    meta["draftsmith"] = {"method": METHOD, "target": config.get("target") or {},
                          "format_version": config.get("format_version")}
    out = write_export(out_dir, files, source=artifact_dir, fmt=fmt, overwrite=overwrite)
    if fmt == "fasterdecoding":
        _add_pickle(out, files[_TRTLLM_WEIGHTS])
    return out


def export_layout(artifact_dir: str | os.PathLike, fmt: str, out_dir: str | os.PathLike,
                  options: ExportOptions) -> Path:
    """The layouts table's entry: :func:`export_medusa` with the command line's options (a
    target given by name is loaded and checked against the artifact's record)."""
    target = options.target
    if target is not None and not isinstance(target, Target):
        target = find_target(read_artifact_config(artifact_dir), target)
    return export_medusa(artifact_dir, fmt, out_dir, target=target, base_model=options.base_model,
                         write_pt=options.write_pt, overwrite=options.overwrite)


def _add_pickle(out: Path, state: dict[str, torch.Tensor]) -> None:
    """medusa_lm_head.pt beside the safetensors file: torch.save of plain CPU tensors, 0644."""
    tmp = out / (_PT_WEIGHTS + ".tmp")
    torch.save({k: v.detach().contiguous().cpu().clone() for k, v in state.items()}, tmp)
    os.chmod(tmp, 0o644)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out / _PT_WEIGHTS)


def trtllm_convert_command(export_dir: str | os.PathLike, base_model_dir: str | None = None,
                           dtype: str = "float16") -> str:
    """TensorRT-LLM's examples/medusa/convert_checkpoint.py command for an export.

    Its converter takes ``--num_medusa_heads`` (default 4) from the command line, not from
    config.json, and writes ``--num_medusa_layers`` into the engine config before reading the
    export's config, so both are passed; ``--max_medusa_token_len`` (default 63) must cover the
    tree's nodes, and a Qwen2 or Mixtral base needs ``--model_type``.
    """
    directory = Path(export_dir)
    meta = json.loads((directory / "config.json").read_text())
    target_type = (meta.get("draftsmith") or {}).get("target", {}).get("model_type")
    base = base_model_dir or "<the target's Hugging Face directory>"
    parts = [
        "python examples/medusa/convert_checkpoint.py",
        f"--model_dir {base}",
        f"--medusa_model_dir {directory}",
        f"--output_dir {directory}-trtllm-ckpt",
        f"--dtype {dtype}",
        f"--num_medusa_heads {int(meta['medusa_num_heads'])}",
        f"--num_medusa_layers {int(meta['medusa_num_layers'])}",
        f"--max_medusa_token_len {max(63, len(meta.get('medusa_choices') or []))}",
    ]
    if target_type in ("qwen2", "mixtral"):
        parts.append(f"--model_type {target_type}")
    return " ".join(parts)


def medusa_export_notes(export_dir: str | os.PathLike, fmt: str) -> list[str]:
    """What a user must know to serve a Medusa export (printed by ``draftsmith export``)."""
    directory = Path(export_dir)
    meta = json.loads((directory / "config.json").read_text())
    notes = []
    if fmt == "trtllm":
        notes.append("TensorRT-LLM ignores medusa_num_heads in config.json; convert with:")
        notes.append("  " + trtllm_convert_command(directory))
        notes.append(f"  and run with --medusa_choices \"{meta.get('medusa_choices')}\"")
    if fmt == "fasterdecoding":
        k = int(meta["medusa_num_heads"])
        if k != FASTERDECODING_HEADS:
            notes.append(
                f"FasterDecoding's MedusaModel.from_pretrained builds {FASTERDECODING_HEADS} heads "
                f"whatever config.json says and loads medusa_lm_head.pt with strict=False: "
                + (f"heads {k}..{FASTERDECODING_HEADS - 1} stay untrained, so pass "
                   f"medusa_choices no deeper than {k}" if k < FASTERDECODING_HEADS
                   else f"heads {FASTERDECODING_HEADS}..{k - 1} are dropped")
                + " (this export's tree: medusa_choices in config.json)"
            )
    if fmt == "vllm-0.32":
        notes.append("vLLM 0.32.0 was the last release with MedusaModel; vLLM 0.33 cannot load it")
    return notes


def _field(meta: dict, key: str, directory: Path, default: int | None = None) -> int:
    if key not in meta:
        if default is not None:
            return default
        raise ValueError(f"{directory}/config.json has no {key!r}: not a complete Medusa export")
    return int(meta[key])


def _tensor(state: dict, key: str, directory: Path) -> torch.Tensor:
    if key not in state:
        raise ValueError(f"{directory}: weight {key!r} is missing; the export is incomplete")
    return state[key]


_NUMBERED = re.compile(r"(\d+)\.(\d+)\.(linear\.)?(weight|bias)")


def _from_numbered(state: dict[str, torch.Tensor], num_layers: int, directory: Path):
    """FasterDecoding / TensorRT-LLM names -> (num_heads, our state dict with lm_heads.{h})."""
    odd = [k for k in state if not _NUMBERED.fullmatch(k.removeprefix("medusa_heads."))]
    if odd:
        raise ValueError(f"{directory}: weights {odd[:4]} are not Medusa head weights "
                         "({h}.{j}.linear.weight|bias, {h}.{n}.weight)")
    state = {k.removeprefix("medusa_heads."): v for k, v in state.items()}
    heads = sorted({int(k.split(".")[0]) for k in state if k.endswith(f".{num_layers}.weight")})
    if heads != list(range(len(heads))) or not heads:
        raise ValueError(f"{directory}: vocabulary projections {{h}}.{num_layers}.weight found "
                         f"for heads {heads}; expected 0..K-1 (medusa_num_layers {num_layers})")
    mine = {}
    for h in heads:
        for j in range(num_layers):
            mine[f"blocks.{h}.layers.{j}.weight"] = _tensor(state, f"{h}.{j}.linear.weight",
                                                            directory)
            if f"{h}.{j}.linear.bias" in state:
                mine[f"blocks.{h}.layers.{j}.bias"] = state[f"{h}.{j}.linear.bias"]
        mine[f"lm_heads.{h}.weight"] = state[f"{h}.{num_layers}.weight"]
    return len(heads), mine


def _vllm_draft_vocabulary(meta: dict, token_map: torch.Tensor | None,
                           mine: dict[str, torch.Tensor], directory: Path):
    """vLLM's truncated vocabulary -> (d2t, t2d), the projections cut and ordered to match.

    vLLM uses ``token_map`` (the target id of every draft row) only when
    ``truncated_vocab_size`` < ``vocab_size``, and then cuts projections of the full vocabulary
    to its rows; draftsmith's draft ids follow ascending target ids, so the rows are sorted by
    target id (the same tokens, the same logits). Returns None for a full-vocabulary export.
    """
    vocab = meta.get("vocab_size")
    truncated = meta.get("truncated_vocab_size", vocab)
    if vocab is None or truncated is None or int(truncated) >= int(vocab):
        return None
    if token_map is None:
        raise ValueError(f"{directory}: truncated_vocab_size {truncated} < vocab_size {vocab} "
                         "but the weights have no token_map, so the draft rows cannot be mapped "
                         "to target ids; the export is incomplete")
    token_map = token_map.to(torch.int64).reshape(-1)
    if token_map.numel() != int(truncated):
        raise ValueError(f"{directory}: token_map has {token_map.numel()} entries, "
                         f"truncated_vocab_size is {truncated}")
    order = torch.argsort(token_map)
    for key in [key for key in mine if key.startswith("lm_heads.")]:
        rows = mine[key]
        if rows.shape[0] > token_map.numel():  # the full vocabulary: vLLM keeps the mapped rows
            rows = rows[token_map]
        mine[key] = rows[order]
    return maps_from_token_ids(token_map[order], int(vocab))


def load_medusa_export(directory: str | os.PathLike) -> MedusaHeads:
    """Read a Medusa serving layout back into MedusaHeads (a projection per head), on the CPU.

    trtllm / fasterdecoding (medusa_lm_head.safetensors) and vllm-0.32 (model.safetensors with
    num_heads). The head count is taken from the weights (FasterDecoding's published configs
    sometimes name another). A vLLM export with a truncated vocabulary (``token_map``) gives
    heads over that draft vocabulary. A directory with only medusa_lm_head.pt is refused:
    draftsmith never loads pickles; the message gives the one-line conversion.
    """
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not an exported Medusa model")
    fix = "the export is damaged or incomplete: export or download it again"
    meta = read_json_object(cfg_path, fix=fix)
    if "method" in meta:
        raise FileNotFoundError(f"{directory} is a draftsmith artifact, read with load_medusa")
    shared, draft = False, None
    if (directory / _TRTLLM_WEIGHTS).is_file():
        state = load_safetensors(directory / _TRTLLM_WEIGHTS, fix=fix)
        n = _field(meta, "medusa_num_layers", directory, default=1)
        k, mine = _from_numbered(state, n, directory)
    elif (directory / _VLLM_WEIGHTS).is_file() and any(
            key in meta for key in ("num_heads", "medusa_num_heads")):
        state = load_safetensors(directory / _VLLM_WEIGHTS, fix=fix)
        token_map = state.pop("token_map", None)
        n = _field(meta, "num_hidden_layers" if "num_hidden_layers" in meta
                   else "medusa_num_layers", directory, default=1)
        if any(_NUMBERED.fullmatch(key.removeprefix("medusa_heads.")) for key in state):
            k, mine = _from_numbered(state, n, directory)  # vLLM also reads FasterDecoding names
        else:
            mine = dict(state)
            k = _field(meta, "num_heads" if "num_heads" in meta else "medusa_num_heads",
                       directory)
            shared = bool(meta.get("original_lm_head"))  # one projection shared by every head
        draft = _vllm_draft_vocabulary(meta, token_map, mine, directory)
    elif (directory / _PT_WEIGHTS).is_file():
        raise ValueError(
            f"{directory} holds its heads only as {_PT_WEIGHTS}, a pickle, which draftsmith never "
            "loads. Convert it once where you trust the file: python -c \"import torch; "
            "from safetensors.torch import save_file; save_file({k: v.contiguous() for k, v in "
            f"torch.load('{directory / _PT_WEIGHTS}', weights_only=True).items()}}, "
            f"'{directory / _TRTLLM_WEIGHTS}')\""
        )
    else:
        raise FileNotFoundError(
            f"{directory} is neither a vLLM Medusa export ({_VLLM_WEIGHTS} with num_heads) nor a "
            f"FasterDecoding / TensorRT-LLM one ({_TRTLLM_WEIGHTS}); a draftsmith artifact is "
            "read with load_medusa"
        )
    weight = _tensor(mine, "lm_heads.0.weight", directory)  # (V, H), or (N, H) over a draft
    maps, vocab = {}, int(weight.shape[0])
    if draft is not None:
        maps = dict(zip(("d2t", "t2d"), draft, strict=True))
        vocab = int(draft[1].numel())
    if shared and draft is not None:  # the heads' own projection, shared: lm_head.weight
        mine["lm_head.weight"] = weight
        for key in [key for key in mine if key.startswith("lm_heads.")]:
            del mine[key]  # vLLM reads lm_heads.0 alone when original_lm_head
    elif shared:  # the target's LM head in one slot: a copy for every head
        mine.update({f"lm_heads.{h}.weight": weight for h in range(k)})
    cfg = MedusaConfig(hidden_size=int(weight.shape[1]), vocab_size=vocab, num_heads=k,
                       num_layers=n, bias=any(key.endswith(".bias") for key in mine),
                       share_lm_head=shared and draft is not None,
                       draft_vocab_size=None if draft is None else int(weight.shape[0]))
    heads = MedusaHeads(cfg, dtype=weight.dtype, **maps)
    mine.update(maps)
    expected = heads.state_dict()
    for key, value in mine.items():
        if key in expected and tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(f"{directory}: {key} has shape {tuple(value.shape)}, heads of hidden "
                             f"{cfg.hidden_size} / vocab {cfg.vocab_size} need "
                             f"{tuple(expected[key].shape)}")
    missing, unexpected = heads.load_state_dict(mine, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match config.json (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    return heads.eval()


def export_tree(directory: str | os.PathLike, num_heads: int) -> list[RankPath]:
    """An export's tree: its ``medusa_choices`` (cut to the heads it has), else each head's top-1."""
    meta = read_json_object(Path(directory) / "config.json",
                            fix="the export is damaged: export or download it again")
    choices = meta.get("medusa_choices")
    if not choices:
        return default_chain(num_heads)
    kept = [p for p in choices if isinstance(p, (list, tuple)) and 0 < len(p) <= num_heads]
    return check_tree(kept or default_chain(num_heads), num_heads)


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
    recorded = recorded_identity(config)
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


# ------------------------------------------------------------------------------------------------
# the check


def check_medusa_export(artifact_dir, fmt, out_dir, target) -> bool:
    """Round trip: the export read back gives the artifact's heads' logits and token ids."""
    meta = read_artifact_config(artifact_dir)
    if MedusaConfig.from_dict(meta).reads_target_lm_head and not isinstance(target, Target):
        target = find_target(meta, target)
        if target is None:
            say("not verified", "round trip: heads sharing the target's LM head need the target "
                 "(pass --target)")
            return True
    art = load_medusa(artifact_dir, target=target if isinstance(target, Target) else None,
                      device="cpu")
    back = load_medusa_export(out_dir)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, art.heads.config.hidden_size, generator=gen)
    with torch.no_grad():
        ours = art.heads(hidden.to(art.heads.lm_head_weight(0).dtype))
        theirs = back(hidden.to(back.lm_head_weight(0).dtype))
    ok = ours.shape == theirs.shape and torch.equal(ours, theirs.to(ours.dtype))
    # the same draft ids must name the same target ids (a wrong token_map keeps the logits)
    ids = torch.arange(art.heads.config.head_vocab_size)
    ok = ok and art.heads.config.head_vocab_size == back.config.head_vocab_size and torch.equal(
        art.heads.draft_to_target(ids), back.draft_to_target(ids))
    say("verified" if ok else "FAILED",
         f"round trip: {fmt} export read back gives the artifact's {art.heads.num_heads} heads' "
         f"logits (max |diff| {max_diff(ours, theirs):.3g})")
    if fmt == "fasterdecoding":
        say("not verified", "medusa_lm_head.pt is not read back (draftsmith never loads "
             "pickles); it was written from the same tensors as medusa_lm_head.safetensors")
    return ok
