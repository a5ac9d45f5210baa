"""KV-cache bookkeeping: after verification, only the accepted path may remain in a cache.

Works on transformers' ``DynamicCache`` (one ``DynamicLayer`` per decoder layer, keys and values
shaped (batch, kv_heads, seq, head_dim)). Caches that drop old entries (sliding windows) or store
them quantised cannot be compacted in place and are refused with a clear error.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


def new_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            kind = "sliding-window" if isinstance(layer, DynamicSlidingWindowLayer) else type(layer).__name__
            raise ValueError(
                f"{type(model).__name__} uses {kind} cache layers, which speculative verification "
                "cannot roll back in place; only full-attention decoders are supported for now"
            )
    return cache


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def keep_tree_path(cache: DynamicCache, past_len: int, keep: list[int]) -> None:
    """Keep the first ``past_len`` entries plus the tree entries at offsets ``keep`` after them.

    ``keep`` lists offsets into the block appended by the last forward (0 = root), in order. A
    contiguous prefix (a chain) is a crop; otherwise the accepted entries are moved into place.
    """
    new_len = past_len + len(keep)
    contiguous = keep == list(range(len(keep)))
    index = None
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        if not contiguous:
            if index is None:
                index = torch.tensor(keep, device=layer.keys.device) + past_len
            layer.keys[:, :, past_len:new_len] = layer.keys.index_select(2, index)
            layer.values[:, :, past_len:new_len] = layer.values.index_select(2, index)
        layer.keys = layer.keys[:, :, :new_len]
        layer.values = layer.values[:, :, :new_len]


def crop(cache: DynamicCache, length: int) -> None:
    """Drop every entry at position >= length."""
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
