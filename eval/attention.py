"""The engine's attention: transformers' own modules, one attention function of ours.

Every forward the engine runs (the target's verification, a draft LM's, an EAGLE head's) goes
through the model's own transformers modules with the attention implementation switched to
:data:`ENGINE_ATTENTION` for that call (:func:`engine_attention`), registered with transformers'
``AttentionInterface``. It differs from transformers' ``sdpa`` in two ways, neither of which
changes what is computed:

* it reads only as many cached entries as the mask is long: the engine's caches hand back their
  whole preallocated buffers (:mod:`draftsmith.eval.kv`), so a compiled forward sees the same buffers every
  round and the mask alone says how much of them is real;
* grouped-query attention with a mask (a token tree, several queries) keeps the keys and values
  as they are: the queries of the heads sharing one key/value head are stacked along the query
  axis and the mask repeated for them, where transformers' ``sdpa`` copies every key and value
  head ``heads / kv_heads`` times per layer per forward (``repeat_kv``). For a single query this
  is what transformers itself does (``pack_gqa``); for several it is the same arithmetic row by
  row.

The mask is the engine's 4-D additive float mask (0 where a query may attend, the dtype's minimum
elsewhere; :func:`tree_attention_mask`), with the positions passed as ``position_ids``. A model
with sliding-window layers gets one mask per layer type (:func:`layer_masks`): the sliding
layers' mask also hides every entry a window or more behind the query, by the positions the cache
records for its entries, so the attention function takes a layer's window as already in its
mask. Features it does not implement (soft-capping, attention sinks, position biases) are
refused by name rather than computed otherwise.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from transformers import AttentionInterface

from draftsmith.targets.target import attention_bias

ENGINE_ATTENTION = "draftsmith"
_REFUSED = ("softcap", "s_aux", "sinks", "position_bias")


def tree_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0,
                   scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (b, heads, q, d); key, value (b, kv_heads, >= kv, d); attention_mask (b or 1, 1, q,
    kv) additive -> (b, q, heads, d), as transformers' attention functions return it."""
    for name in _REFUSED:
        if kwargs.get(name) is not None:
            raise ValueError(f"the engine's attention does not implement {name} (asked for by "
                             f"{type(module).__name__}); this architecture is not supported yet")
    if attention_mask is None:
        raise ValueError("the engine's attention needs the engine's 4-D mask")
    batch, heads, q, dim = query.shape
    kv = attention_mask.shape[-1]
    key, value = key[:, :, :kv], value[:, :, :kv]
    kv_heads = key.shape[1]
    group = heads // kv_heads
    mask = attention_mask.to(query.dtype)
    if group > 1:
        # heads h = k * group + r read key/value head k (transformers' repeat_kv order): stack the
        # group's queries along the query axis, (b, kv_heads, group * q, d), rows r-major
        query = query.reshape(batch, kv_heads, group * q, dim)
        mask = mask.expand(-1, -1, q, kv).repeat(1, 1, group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                           scale=scaling)
    return out.reshape(batch, heads, q, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(ENGINE_ATTENTION, tree_attention)


_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _configs(model: torch.nn.Module) -> list:
    """Every distinct config object the model's modules read their attention implementation
    from (one for most models; a sub-config per tower for multimodal ones), found once."""
    if model not in _CONFIGS:
        found: dict[int, object] = {}
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                found.setdefault(id(config), config)
        _CONFIGS[model] = list(found.values())
    return _CONFIGS[model]


@contextlib.contextmanager
def engine_attention(model: torch.nn.Module):
    """Within the block, ``model``'s attention layers call :func:`tree_attention`; outside it
    (transformers' ``generate``, the ``hf`` baselines, training) they are as they were."""
    configs = _configs(model)
    saved = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = ENGINE_ATTENTION
    try:
        yield
    finally:
        for config, name in zip(configs, saved, strict=True):
            config._attn_implementation = name


def layer_masks(cache, attention_mask: torch.Tensor, position_ids: torch.Tensor):
    """The mask a forward's layers read, from the engine's mask (1, 1, q, kv) over the cache's
    first kv entries (the q new ones among them, already recorded in ``cache.positions``).

    Without sliding layers it is the mask itself. With them, the sliding layers' copy also hides
    every entry at or beyond the window behind the query (transformers' rule: query position
    minus key position < window); a model whose layers all slide gets that tensor, a hybrid one
    (Gemma-3: five sliding layers to one global) the dict keyed by layer type its model reads.
    """
    window = getattr(cache, "window", None)
    if window is None:
        return attention_mask
    kv = attention_mask.shape[-1]
    behind = position_ids.reshape(-1, 1) - cache.positions[:kv].reshape(1, -1)  # (q, kv)
    sliding = attention_mask.masked_fill(behind >= window,
                                         torch.finfo(attention_mask.dtype).min)
    if cache.layer_types == ["sliding_attention"]:
        return sliding
    return {"full_attention": attention_mask, "sliding_attention": sliding}


def tree_attention_mask(allowed: torch.Tensor, past: int, dtype: torch.dtype,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """The 4-D additive mask for a forward over tree nodes on top of ``past`` cached positions.

    allowed (q, k) bool: [i, j] True when new position i may attend to new position j (itself
    and its tree ancestors). Every new position sees the whole cached prefix. Returns
    (1, 1, q, past + k) in ``dtype`` (:func:`attention_bias`), the form transformers' attention
    takes together with per-node ``position_ids``.
    """
    seen = torch.ones(allowed.shape[0], past + allowed.shape[1], dtype=torch.bool, device=device)
    seen[:, past:] = allowed.to(seen.device)
    return attention_bias(seen, dtype)[None, None]
