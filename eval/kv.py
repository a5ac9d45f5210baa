"""KV caches the engine verifies into: preallocated, one buffer per layer, a length pointer.

:class:`StaticCache` is a transformers ``Cache`` whose layers hold keys and values in buffers of a
fixed capacity, (batch, kv_heads, capacity, head_dim), allocated at the first write and reused by
every later generation of the same engine. A length pointer says how many entries are real.

* Cropping is setting the pointer (:func:`crop`): nothing is copied or freed.
* The accepted path of a verified tree is compacted in place (:func:`compact`): one indexed
  read and one indexed write per buffer, from a device index, so no value comes to the host.
* Two ways to write. Called like any transformers cache (``model(..., cache=cache)``), a layer
  appends its new entries at the pointer and returns views of its real entries, as
  ``DynamicCache`` does; the tests and transformers' own ``generate`` use it so. The engine
  instead names the slots to write (:attr:`StaticCache.slots`, a device tensor) and gets the
  whole buffers back: its attention (:mod:`draftsmith.eval.attention`) reads only as many entries as its
  mask is long, so the shapes a compiled forward sees do not depend on the values of the lengths
  and the engine moves the pointer itself after the round.

Why not transformers' ``StaticCache``: it attends over the whole capacity on every forward (its
mask is as long as the buffer), keeps its length in a device tensor (reading it back is a host
sync) and crops by subtracting, with no way to keep a tree's accepted path.

Sliding-window layers (Gemma-2/3, Mistral, gpt-oss). transformers' own sliding caches drop the
entries that leave the window, and a dropped entry cannot come back when a rejected branch is
rolled back. Here a sliding layer keeps every entry in place, like a full one, and the window goes
into its mask instead: the cache records the position of every entry it holds
(:attr:`StaticCache.positions`, on the device, compacted with the entries), and
:func:`draftsmith.eval.attention.layer_masks` hides from each query the entries a window or more
behind it. Entries cost the memory of the whole context (a serving engine's paged cache frees
them; at batch 1 and these lengths that is not what limits), and the masks read the positions of
the entries, not their slots, so a draft's tree nodes, whose slots follow the sequence's, are
windowed right too. Layers of any other kind (chunked attention, linear attention, recurrent
states) are refused with a clear error.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

MIN_CAPACITY = 256  # entries a buffer holds at least; it grows by doubling past that
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' names of the layer types


def attention_windows(config) -> list[int | None]:
    """Each layer's attention window as transformers lays out its cache from ``config``: None
    for full attention, the window (a query sees the entries fewer than this many positions
    behind it, itself included) for a sliding layer; any other kind of layer (chunked
    attention, whose cache transformers also builds as a sliding one; linear attention;
    recurrent states) is refused."""
    types, kwargs = get_layer_types_and_kwargs(getattr(config, "get_text_config",
                                                       lambda **_: config)(decoder=True))
    windows, other = [], []
    for layer_type, layer_kwargs in zip(types, kwargs, strict=True):
        if layer_type == FULL:
            windows.append(None)
        elif layer_type == SLIDING and layer_kwargs.get("sliding_window"):
            windows.append(int(layer_kwargs["sliding_window"]))
        else:
            other.append(layer_type)
    if other:
        architecture = (getattr(config, "architectures", None) or [config.model_type])[0]
        raise ValueError(
            f"{architecture} has {', '.join(sorted(set(other)))} layers, which the engine "
            "cannot verify into: full-attention and sliding-window decoders are supported")
    if len({w for w in windows if w is not None}) > 1:
        raise ValueError(f"layers slide windows of different sizes {sorted(set(windows) - {None})}"
                         "; the engine supports one window size per model")
    return windows


class StaticLayer(CacheLayerMixin):
    """One decoder layer's keys and values in preallocated buffers (see the module docstring)."""

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: StaticCache):
        self._keys = self._values = None
        super().__init__()
        self.cache = cache
        self.length = 0

    # transformers' mixin stores keys and values as attributes; here they are the real entries
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("a StaticLayer's keys live in its buffer; write them with update")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("a StaticLayer's values live in its buffer; write them with update")

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(key_states, value_states, self.cache.capacity)

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """Buffers of ``capacity`` entries shaped like ``key_states`` / ``value_states``, holding
        the real entries there were."""
        batch, heads = key_states.shape[:2]
        keys = key_states.new_zeros(batch, heads, capacity, key_states.shape[-1])
        values = value_states.new_zeros(batch, heads, capacity, value_states.shape[-1])
        if self._keys is not None:
            keys[:, :, : self.length] = self._keys[:, :, : self.length]
            values[:, :, : self.length] = self._values[:, :, : self.length]
        self._keys, self._values = keys, values
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if self._keys is None:
            self.lazy_initialization(key_states, value_states)
        slots = self.cache.slots
        if slots is not None:  # the engine's forward: whole buffers, its attention reads its part
            self._keys.index_copy_(2, slots, key_states)
            self._values.index_copy_(2, slots, value_states)
            return self._keys, self._values
        new = key_states.shape[2]
        if self.length + new > self.capacity:
            self.allocate(key_states, value_states, grown(self.length + new))
        self._keys[:, :, self.length: self.length + new] = key_states
        self._values[:, :, self.length: self.length + new] = value_states
        self.length += new
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows on demand

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: a negative count of entries to drop."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of entries to remove")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0


def grown(needed: int) -> int:
    """The capacity a buffer grows to for ``needed`` entries: a power of two, at least
    :data:`MIN_CAPACITY` (few sizes, so a compiled forward sees few buffer shapes)."""
    capacity = MIN_CAPACITY
    while capacity < needed:
        capacity *= 2
    return capacity


class StaticCache(Cache):
    """Preallocated keys and values for every layer of the model ``config`` describes (a
    transformers config); see the module docstring.

    ``slots``: None (writes append at the pointer, transformers' way) or the (q,) device tensor of
    positions the next forward writes (the engine's way, which then sets the pointer itself).
    """

    def __init__(self, config, capacity: int = MIN_CAPACITY):
        windows = attention_windows(config)
        self.capacity = grown(capacity)
        self.slots: torch.Tensor | None = None
        # the sliding layers' window (None: every layer attends to everything), and which layer
        # types the model's masks are keyed by (transformers' ``config.layer_types`` names)
        self.window = next((w for w in windows if w is not None), None)
        self.layer_types = sorted({FULL if w is None else SLIDING for w in windows})
        # (capacity,) the position of the entry in each slot, kept where a window needs it
        self.positions: torch.Tensor | None = None
        super().__init__(layers=[StaticLayer(self) for _ in windows])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def set_length(self, length: int) -> None:
        for layer in self.layers:
            layer.length = length

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` entries in every allocated buffer (and in those to come)."""
        if needed <= self.capacity:
            return
        self.capacity = grown(needed)
        for layer in self.layers:
            if layer._keys is not None:
                layer.allocate(layer._keys, layer._values, self.capacity)
        if self.positions is not None:
            positions = self.positions.new_zeros(self.capacity)
            positions[: self.positions.shape[0]] = self.positions
            self.positions = positions

    def record_positions(self, slots: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Note the positions (1, q) of the entries a forward writes at ``slots`` (q,), where a
        sliding window will need them (:func:`draftsmith.eval.attention.layer_masks`)."""
        if self.window is None:
            return
        if self.positions is None or self.positions.device != slots.device:
            self.positions = torch.zeros(self.capacity, dtype=torch.long, device=slots.device)
        self.positions.index_copy_(0, slots, position_ids.reshape(-1).to(torch.long))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def buffers(self) -> list[torch.Tensor]:
        """Every allocated key and value buffer, layer by layer."""
        return [t for layer in self.layers if layer._keys is not None
                for t in (layer._keys, layer._values)]

    def __deepcopy__(self, memo):
        copy = StaticCache.__new__(StaticCache)
        memo[id(self)] = copy
        Cache.__init__(copy, layers=[])
        copy.capacity, copy.slots = self.capacity, None
        copy.window, copy.layer_types = self.window, self.layer_types
        copy.positions = None if self.positions is None else self.positions.clone()
        for layer in self.layers:
            twin = StaticLayer(copy)
            twin.length = layer.length
            if layer._keys is not None:
                twin._keys, twin._values = layer._keys.clone(), layer._values.clone()
                twin.device, twin.is_initialized = layer.device, True
            copy.layers.append(twin)
        return copy


def new_cache(model, capacity: int = MIN_CAPACITY) -> StaticCache:
    """An empty cache for a transformers model (or anything with its ``config``)."""
    return StaticCache(model.config, capacity)


def cache_length(cache: StaticCache) -> int:
    return cache.get_seq_length()


def crop(cache: Cache, length: int) -> None:
    """Drop every entry at position >= length (a :class:`StaticCache` moves its pointer; a
    transformers cache is cropped its own way)."""
    if isinstance(cache, StaticCache):
        cache.set_length(min(length, cache.length))
        return
    current = cache.get_seq_length()
    if length < current:
        cache.crop(length - current)


def compact(cache: StaticCache, past: int, keep: torch.Tensor | list[int] | None,
            count: int | None = None) -> None:
    """Keep the first ``past`` entries and, after them, the entries at offsets ``keep`` of the
    block the last forward appended (0 = its first entry), in order: ``count`` of them (default
    all of ``keep``). ``keep`` may live on the device (a round's accepted path): it is never read
    on the host; None says the kept entries are the block's first ``count`` (a prefix, a chain's
    accepted tokens), which needs no copy. The pointer moves either way.
    """
    if keep is None:
        cache.set_length(past + count)
        return
    if not isinstance(keep, torch.Tensor):
        keep = list(keep)
        count = len(keep) if count is None else count
        if keep[:count] == list(range(count)):
            cache.set_length(past + count)
            return
        keep = torch.tensor(keep[:count], dtype=torch.long)
    count = keep.shape[0] if count is None else count
    index = keep[:count].to(torch.long)
    for buffer in cache.buffers():  # (batch, heads, capacity, dim): one gather, one write each
        index = index.to(buffer.device)
        buffer[:, :, past: past + count] = buffer.index_select(2, index + past)
    if cache.positions is not None:
        positions = cache.positions
        positions[past: past + count] = positions.index_select(0, index.to(positions.device) + past)
    cache.set_length(past + count)


def keep_tree_path(cache: StaticCache, past_len: int, keep: list[int]) -> None:
    """``compact`` with a host list of offsets (the draft LM's own cache)."""
    compact(cache, past_len, keep)
