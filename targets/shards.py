"""A frozen target too large for one device: its decoder layers split over processes (FSDP2).

    mesh = init_device_mesh("cuda", (nodes, 8), mesh_dim_names=("replicate", "shard"))
    target = load_sharded_target("meta-llama/Llama-3.3-70B-Instruct", mesh, device="cuda")
    captured, last = target.hidden_states(input_ids, [2, 40, 77])   # every process, its batch

Each decoder layer is ``fully_shard``-ed over the mesh's ``shard`` dimension (and replicated over
``replicate``: one copy per group of processes), with ``reshard_after_forward``: a forward
gathers one layer at a time (the next one prefetched) and frees it again, so a process holds
1/shards of the layers plus two whole layers. The embedding, the final norm and the LM head stay
whole on every process: the drafts use them by reference (an EAGLE head's embedding and LM head,
Medusa's shared LM head), and they are small beside the layers (4 GB of a 141 GB Llama-3.3-70B).
The hidden states are captured at the layers' inputs as on a whole target: ordinary tensors,
the same values (gathering a layer's shards reassembles its weights bit for bit).

Why FSDP2 rather than tensor parallelism (transformers' ``tp_plan``), measured on two CPU
processes over gloo (docs/design.md): both give the whole target's hidden states (FSDP2 bit for
bit, the TP plan to 1.2e-6, its all-reduces summing partial products in another order); FSDP2
keeps every process's own batch (a TP group computes one batch together, so the trained module's
data parallelism and the batch plan would change), leaves the embedding and LM head whole where
the drafts read them (the TP plan splits them over the vocabulary), and overlaps the gathers
with compute on GPUs, where NVLink carries them.

Every process must run the target the same number of times (each forward gathers from all of
them): the trainers run it once per micro-batch, the feature-cache writer pads the shorter shares
with extra forwards, and evaluations that decode per process are refused with a sharded target.

The weights are read from the safetensors checkpoint one layer at a time (every process reads a
layer whole and keeps its shard), never the whole model on one process; the model is built on
the meta device first. The identity (fingerprint, digest) is read from the checkpoint, as for
:func:`draftsmith.targets.target.load_target_parts`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from draftsmith.targets.resolve import EMBEDDED_TARGETS, resolve_target
from draftsmith.targets.target import (
    Target,
    _read_checkpoint_tensors,
    cached_weights_digest,
    default_device_dtype,
    freeze,
    load_target_tokenizer,
    weights_digest,
    weights_fingerprint,
    wrap_target,
)


def is_sharded(target: Target) -> bool:
    """Whether a target's layers are split over processes (a forward needs all of them)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in target.layers.parameters())


def check_shards(config: dict, shards: int) -> None:
    """Refuse a shard count the target's layers cannot give every process a part of: more
    shards than the rows of its smallest weight (the key/value projections' kv_heads x head_dim,
    the norms' hidden size)."""
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    rows = min(int(config.get("num_key_value_heads") or heads) * head_dim,
               int(config["hidden_size"]))
    if shards > rows:
        raise ValueError(f"target_parallel {shards} is more than the {rows} rows of the target's "
                         f"smallest layer weight (kv heads x head_dim): some processes would hold "
                         f"nothing of it; use at most {rows}")


def load_sharded_target(
    spec: str | os.PathLike,
    mesh,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
) -> Target:
    """The frozen target with its decoder layers sharded over ``mesh`` (a 1-D mesh, or a 2-D
    ``(replicate, shard)`` one), everything else whole (see the module docstring). Safetensors
    model directories (and what :func:`draftsmith.targets.resolve.resolve_target` turns into one)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = resolve_target(spec)
    dev, dt = default_device_dtype(device, dtype)
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    check_shards(config.to_dict(), mesh.size(-1))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dt, trust_remote_code=False)
    freeze(model)
    decoder = model.get_decoder()
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None or not hasattr(decoder, "layers"):
        raise ValueError(f"{type(decoder).__name__} has no layers or rotary_emb to shard by; load "
                         f"the whole target (target_parallel: 1)")
    names = sorted(model.state_dict())  # one order on every process
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight

    def read(parameter: str, count: int) -> torch.Tensor:  # leading values, from the checkpoint
        found = _read_checkpoint_tensors(path, [parameter], leading=count)
        if parameter not in found:
            raise ValueError(f"{path}: the checkpoint has no {parameter!r}; load the whole "
                             f"target (target_parallel: 1)")
        return found[parameter]

    fingerprint = weights_fingerprint(model, read)  # every weight still on the meta device
    digest = cached_weights_digest(path, lambda: weights_digest(model, read))

    layers = list(decoder.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    # the decoder is the root the layers' gathers are set up from, its own weights (embedding,
    # final norm) left whole; the LM head lies outside it, whole too
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True,
                ignored_params={p for p in decoder.parameters() if id(p) not in in_layers})
    for layer, following in zip(layers, layers[1:]):
        layer.set_modules_to_forward_prefetch([following])  # gather the next while this runs
    model.to_empty(device=dev)
    layer_prefix = {id(layer): f"{_prefix(model, layer)}." for layer in layers}
    whole = [n for n in names if not any(n.startswith(p) for p in layer_prefix.values())]
    if tied:
        whole = [n for n in whole if n != _name_of(model, model.get_output_embeddings())]
    _load_whole(model, path, whole, dt)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    with torch.device(dev):  # computed, not stored: to_empty left it uninitialised
        decoder.rotary_emb = type(rotary)(config=model.config)
    for layer in layers:  # one layer's weights whole at a time; each process keeps its shard
        prefix = layer_prefix[id(layer)]
        wanted = [n for n in names if n.startswith(prefix)]
        tensors = _read_checkpoint_tensors(path, wanted)
        missing = [n for n in wanted if n not in tensors]
        if missing:
            raise ValueError(f"{path}: the checkpoint has no {missing[:3]} (other weight names "
                             f"than {type(model).__name__} uses); load the whole target "
                             f"(target_parallel: 1)")
        params = dict(layer.named_parameters())
        params.update(dict(layer.named_buffers()))
        with torch.no_grad():
            for full_name in sorted(tensors):
                target = params[full_name[len(prefix):]]
                full = tensors[full_name].to(dev, dt)
                if isinstance(target, DTensor):  # this process's shard of the whole tensor, cut
                    # here from the copy it read (src_data_rank None: nothing is sent)
                    full = distribute_tensor(full, target.device_mesh, target.placements,
                                             src_data_rank=None).to_local()
                    target = target.to_local()
                target.copy_(full)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    tokenizer = load_target_tokenizer(path)
    name = str(spec) if str(spec) in EMBEDDED_TARGETS else Path(spec).name
    return wrap_target(model, tokenizer, name=name, path=path, fingerprint=fingerprint,
                       digest=digest)


def _prefix(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return f"{_prefix(model, module)}.weight"


def _load_whole(model: nn.Module, path, names: list[str], dtype: torch.dtype) -> None:
    """The weights outside the layers (embedding, final norm, LM head), whole, in place."""
    tensors = _read_checkpoint_tensors(path, names)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{path}: the checkpoint has no {missing[:3]}; load the whole target "
                         f"(target_parallel: 1)")
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor.to(dtype if tensor.is_floating_point() else tensor.dtype))
