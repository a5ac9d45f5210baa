"""EAGLE-3's training-time-test attention: one rule, two kernels.

At test-time step i, anchor t attends to the step-0 entries 0..t of its own document (causal;
padding excluded where rows have holes) and to its own entries of steps 1..i only: the diagonal
of each earlier step, as in the EAGLE reference. Nothing of size (i + 1) n x n is kept.

* ``sdpa`` (:func:`sdpa_ttt_attention`): one fused ``scaled_dot_product_attention`` call over the
  n step-0 keys plus i "sink" keys whose logits are the diagonal dot products (appended to each
  query as extra coordinates) and whose values read out the softmax weight of each diagonal term.
  Right-padded rows without documents need no mask at all (a real position never sees the
  padding after it); a mask is built only for rows with holes or several documents.
* ``flex`` (:func:`flex_ttt_attention`): ``flex_attention`` over the keys of every step laid end
  to end, with a :class:`~torch.nn.attention.flex_attention.BlockMask` built from block tables
  (causal over the step-0 keys plus each step's diagonal block, within one document): no n x n
  tensor is ever formed, not even while building the mask. Compiled on a GPU; torch has no flex
  backward on a CPU, where training uses ``sdpa`` (``auto`` picks by device).

Packed rows (several documents laid end to end in one row, as SpecForge and speculators pack)
carry ``documents`` (B, n): each anchor's document, non-decreasing along a row
(:func:`documents_of`). Every query attends within its document only.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

BACKENDS = ("auto", "flex", "sdpa")
# flex attention's tile: the step-0 keys of every step are padded to a multiple of it, so that
# each step's keys start on a tile of their own
BLOCK = 128


def documents_of(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) positions restarting at 0 for each packed document -> (B, S) document index."""
    return (position_ids == 0).cumsum(-1) - 1


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on a GPU, ``sdpa`` elsewhere (torch has no flex backward on a CPU)."""
    if backend not in BACKENDS:
        raise ValueError(f"test-time attention must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def ttt_attention(
    query: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    *,
    scaling: float,
    key_valid: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Attention of training-time-test step i = len(keys) - 1.

    query (B, H, n, d): step i's queries (rotated); keys / values: (B, H_kv, n, d) per step,
    step 0 first (step i's own included); key_valid (B, n) bool: the real anchors, None when
    rows are right-padded (nothing to exclude); documents (B, n): each anchor's document, None
    for one document per row. ``backend``: ``sdpa`` or ``flex`` (see the module docstring).
    -> (B, H, n, d).
    """
    if backend == "flex":
        if len(keys) == 1 and documents is None and key_valid is None:
            # plain causal attention: the fused kernels need no mask at all
            return sdpa_ttt_attention(query, keys, values, scaling=scaling)
        return flex_ttt_attention(query, keys, values, scaling=scaling, key_valid=key_valid,
                                  documents=documents)
    if backend != "sdpa":
        raise ValueError(f"unknown test-time attention kernel {backend!r}: flex or sdpa")
    return sdpa_ttt_attention(query, keys, values, scaling=scaling, key_valid=key_valid,
                              documents=documents)


def _step0_allowed(n: int, device, key_valid, documents) -> torch.Tensor:
    """(B or 1, n, n) bool: query t sees step-0 key s <= t of its document (valid, or its own)."""
    allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]
    if documents is not None:
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])
    if key_valid is not None:
        eye = torch.eye(n, dtype=torch.bool, device=device)
        # a padded query attends to something rather than nothing: its output, unused, stays
        # finite
        allowed = allowed & (key_valid.bool()[:, None, :] | eye)
    return allowed


def sdpa_ttt_attention(query, keys, values, *, scaling, key_valid=None, documents=None):
    """:func:`ttt_attention` through one fused SDPA call; the diagonal terms ride along as sink
    keys. Each query gets i extra coordinates holding its diagonal dot products q_t . keys[j][t];
    i sink keys, one-hot in those coordinates, placed before the step-0 keys, then score exactly
    those logits; their values, one-hot in i extra value coordinates, read out each diagonal
    term's softmax weight, which then multiplies values[j][t]."""
    B, H, n, d = query.shape
    kv_heads = keys[0].shape[1]
    groups = H // kv_heads
    extra = len(keys) - 1
    gqa = dict(enable_gqa=True) if groups > 1 else {}
    masked = key_valid is not None or documents is not None
    allowed = _step0_allowed(n, query.device, key_valid, documents) if masked else None
    if extra == 0:
        if not masked:
            return F.scaled_dot_product_attention(
                query, keys[0], values[0], is_causal=True, scale=scaling, **gqa)
        return F.scaled_dot_product_attention(
            query, keys[0], values[0], attn_mask=allowed[:, None], scale=scaling, **gqa)
    # per-position products, one step at a time: autograd keeps views of q and k, not i copies
    grouped = query.reshape(B, kv_heads, groups, n, d)
    diag_logits = torch.stack(
        [(grouped * key[:, :, None]).sum(-1) for key in keys[1:]], dim=-1
    )  # (B, H_kv, G, n, i)
    width = -(-(d + extra) // 8) * 8  # fused kernels want head dims in multiples of 8
    pad = width - d - extra
    q = torch.cat(
        [query, diag_logits.reshape(B, H, n, extra), query.new_zeros(B, H, n, pad)], dim=-1
    )  # (B, H, n, width)
    sinks = torch.eye(extra, width - d, dtype=query.dtype, device=query.device)  # (i, width - d)
    sinks = F.pad(sinks, (d, 0)).expand(B, kv_heads, extra, width)  # (B, H_kv, i, width)
    k = torch.cat([sinks, F.pad(keys[0], (0, width - d))], dim=2)  # (B, H_kv, i + n, width)
    v = torch.cat([sinks, F.pad(values[0], (0, width - d))], dim=2)  # (B, H_kv, i + n, width)
    if not masked:
        mask = causal_lower_right(n, extra + n)
    else:
        mask = F.pad(allowed, (extra, 0), value=True)[:, None]  # (B, 1, n, i + n)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, **gqa)
    weights = out[..., d : d + extra].reshape(B, kv_heads, groups, n, extra)  # diagonal softmax
    diag = sum(weights[..., j, None] * value[:, :, None] for j, value in enumerate(values[1:]))
    return out[..., :d] + diag.reshape(B, H, n, d)  # (B, H, n, d)


# ------------------------------------------------------------------------------------------------
# flex attention


def _padded(x: torch.Tensor, length: int, value) -> torch.Tensor:
    """x (B, n) padded along its last dimension to ``length`` with ``value``."""
    return F.pad(x, (0, length - x.shape[-1]), value=value)


def _block_extremes(values: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, n_pad) document ids and (B, n_pad) bool real positions -> per tile of BLOCK: the
    smallest and largest document among its real positions, (B, tiles) each."""
    B, length = values.shape
    tiles = values.reshape(B, length // BLOCK, BLOCK)
    real = real.reshape(B, length // BLOCK, BLOCK)
    big = torch.iinfo(values.dtype).max
    low = torch.where(real, tiles, big).amin(-1)
    high = torch.where(real, tiles, -1).amax(-1)
    return low, high


def ttt_block_mask(n: int, steps: int, *, key_valid: torch.Tensor | None,
                   documents: torch.Tensor | None, batch: int, device):
    """The :class:`BlockMask` of test-time step ``steps - 1`` over n queries and ``steps`` key
    segments of ``n_pad`` (n rounded up to a tile) keys each, built from (B, tiles, tiles x steps)
    block tables: no (n, steps x n) mask is ever formed.

    Step-0 tiles at or below the diagonal are computed when their documents overlap the query
    tile's (documents never decrease along a row); those strictly below it, with one document on
    both sides and every key real, are full (no mask evaluated inside). Each later step adds the
    one tile on its diagonal. The mask function decides inside the partial tiles.
    """
    from torch.nn.attention.flex_attention import BlockMask

    tiles = -(-n // BLOCK)
    n_pad = tiles * BLOCK
    ones = torch.ones(batch, n, dtype=torch.bool, device=device)
    real = _padded(ones, n_pad, False)  # (B, n_pad)
    valid = real if key_valid is None else _padded(key_valid.bool(), n_pad, False)
    docs = torch.zeros(batch, n, dtype=torch.int64, device=device) if documents is None \
        else documents.to(torch.int64)
    docs = _padded(docs, n_pad, -1)
    low, high = _block_extremes(docs, real)  # (B, tiles) each
    every_valid = _block_extremes(valid.to(torch.int64), real)[0] == 1  # (B, tiles)
    q_tile = torch.arange(tiles, device=device)[:, None]  # (tiles, 1)
    k_tile = torch.arange(tiles, device=device)[None, :]  # (1, tiles)
    below = (k_tile <= q_tile)[None]  # (1, tiles, tiles)
    overlap = high[:, None, :] >= low[:, :, None]  # key tile's last doc >= query tile's first
    step0 = below & overlap  # (B, tiles, tiles)
    one_doc = (low == high)
    full0 = ((k_tile < q_tile)[None] & one_doc[:, :, None] & one_doc[:, None, :]
             & (low[:, :, None] == low[:, None, :]) & every_valid[:, None, :]
             & (k_tile * BLOCK + BLOCK <= n)[None])
    partial0 = step0 & ~full0
    diagonal = torch.eye(tiles, dtype=torch.bool, device=device)[None].expand(batch, -1, -1)
    partial = torch.cat([partial0, *[diagonal] * (steps - 1)], dim=-1)  # (B, tiles, steps x t)
    full = torch.cat([full0, *[torch.zeros_like(diagonal)] * (steps - 1)], dim=-1)

    def table(present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = present.sum(-1, dtype=torch.int32)[:, None]  # (B, 1, tiles)
        order = torch.argsort((~present).to(torch.int8), dim=-1, stable=True)
        return counts, order.to(torch.int32)[:, None]  # (B, 1, tiles, steps x tiles)

    doc_keys, valid_keys = docs, valid

    def mask_mod(b, h, q, kv):
        segment, position = kv // n_pad, kv % n_pad
        step0 = ((segment == 0) & (position <= q) & (doc_keys[b, position] == doc_keys[b, q])
                 & (valid_keys[b, position] | (position == q)))
        return step0 | ((segment > 0) & (position == q))

    kv_num, kv_index = table(partial)
    full_num, full_index = table(full)
    return BlockMask.from_kv_blocks(kv_num, kv_index, full_num, full_index, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(n, steps * n_pad))


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_ttt_attention(query, keys, values, *, scaling, key_valid=None, documents=None,
                       compiled: bool | None = None):
    """:func:`ttt_attention` through ``flex_attention`` with :func:`ttt_block_mask`; the keys of
    every step laid end to end, each padded to a whole tile. ``compiled`` (default: on a GPU)
    runs the fused kernel; uncompiled, torch evaluates the mask densely (for tests on a CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    B, H, n, d = query.shape
    steps = len(keys)
    n_pad = -(-n // BLOCK) * BLOCK

    def laid_out(parts):  # (B, H_kv, steps x n_pad, d)
        return torch.cat([F.pad(p, (0, 0, 0, n_pad - n)) for p in parts], dim=2)

    mask = ttt_block_mask(n, steps, key_valid=key_valid, documents=documents, batch=B,
                          device=query.device)
    if compiled is None:
        compiled = query.device.type == "cuda"
    attend = _compiled_flex() if compiled else flex_attention
    return attend(query, laid_out(keys), laid_out(values), block_mask=mask, scale=scaling,
                  enable_gqa=H != keys[0].shape[1])
