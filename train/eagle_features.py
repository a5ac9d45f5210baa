"""Offline EAGLE features: run the frozen target once over a tokenised dataset, read them back.

Online mode runs the target inside every training step (``heads.eagle.target_features``);
offline mode pays that once and trains from disk, which pays off over several epochs or when the
target does not fit beside the head. Both give the same batches (keys and tensors), so the loss
is the same (tested)::

    write_feature_cache(target, dataset, "features/", head.config, batch_size=8)
    cache = FeatureCache("features/", head.config, target)        # a torch Dataset
    loader = DataLoader(cache, batch_size=4, shuffle=True,
                        collate_fn=functools.partial(collate_features, pad_token_id=pad_id))
    loss, metrics = eagle_loss(head, next(iter(loader)))

In a distributed run call :func:`write_feature_cache` inside ``accelerator.main_process_first()``:
one process writes, the others find the finished cache and reuse it.

Layout of the cache directory (written to a temporary directory and renamed)::

    index.json               version, aux_layer_ids, feature_layers, hidden_size, dtype, target
                             identity, dataset fingerprint, rows, tokens, shards, bytes_per_token
    shard_00000.safetensors  input_ids (N,) int32, loss_mask (N,) uint8, row_offsets (rows+1,)
                             int64, features (N, F) and, for EAGLE-3, last_hidden (N, h)

Disk per token = cached layers x hidden x dtype bytes + 5 bytes (id, mask). EAGLE-1 caches one
layer (L); EAGLE-3 caches its three aux layers plus L (the target's distribution is recomputed
from it through the frozen LM head, which is far smaller than storing logits). For smollm2-135m
(hidden 576): EAGLE-1 1,157 B/token in bf16 (2,309 in fp32); EAGLE-3 4,613 B/token in bf16
(9,221 in fp32), i.e. about 4.6 GB per million training tokens.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from heads.eagle import EagleConfig, target_features
from heads.target import Target
from train.data import collate_causal_lm

CACHE_VERSION = 1
INDEX = "index.json"
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def bytes_per_token(config: EagleConfig, dtype: torch.dtype) -> int:
    """Disk bytes one training token costs in the cache (features + int32 id + uint8 mask)."""
    width = torch.empty((), dtype=dtype).element_size()
    return len(config.feature_layers) * config.target_hidden_size * width + 5


def _fingerprint(dataset) -> str:
    digest = hashlib.sha256()
    for row in dataset:
        digest.update(torch.as_tensor(row["input_ids"], dtype=torch.int32).numpy().tobytes())
        digest.update(torch.as_tensor(row["loss_mask"], dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, dt in _DTYPES.items() if dt == dtype)


def _expected_index(
    target: Target, config: EagleConfig, dtype: torch.dtype, fingerprint: str, rows: int
) -> dict:
    return {
        "cache_version": CACHE_VERSION,
        "version": config.version,
        "aux_layer_ids": list(config.aux_layer_ids),
        "feature_layers": list(config.feature_layers),
        "hidden_size": config.target_hidden_size,
        "dtype": _dtype_name(dtype),
        "target": target.identity(),
        "dataset": fingerprint,
        "rows": rows,
        "bytes_per_token": bytes_per_token(config, dtype),
    }


def _matches(index: dict, expected: dict) -> bool:
    return all(index.get(k) == v for k, v in expected.items())


def write_feature_cache(
    target: Target,
    dataset: Sequence[Mapping],
    out_dir: str | os.PathLike,
    config: EagleConfig,
    *,
    batch_size: int = 8,
    shard_tokens: int = 1 << 22,
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Path:
    """Run the target over ``dataset`` (rows with input_ids, loss_mask) and cache the features.

    A cache already written for the same target, head layers, dtype and rows is reused as is.
    ``dtype`` defaults to the target's; ``shard_tokens`` bounds the tokens per shard file.
    """
    if batch_size < 1 or shard_tokens < 1:
        raise ValueError(
            f"batch_size and shard_tokens must be >= 1, got {batch_size}, {shard_tokens}"
        )
    out = Path(out_dir)
    dtype = dtype or target.dtype
    if dtype not in _DTYPES.values():
        raise ValueError(f"cache dtype must be one of {sorted(_DTYPES)}, got {dtype}")
    expected = _expected_index(target, config, dtype, _fingerprint(dataset), len(dataset))
    if out.exists():
        index_path = out / INDEX
        if index_path.is_file() and _matches(json.loads(index_path.read_text()), expected):
            return out
        if any(out.iterdir()) and not index_path.is_file():
            raise ValueError(f"{out} exists and is not a feature cache; choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        shards = _write_shards(
            target, dataset, tmp, config, batch_size, shard_tokens, dtype, progress
        )
        index = {**expected, "tokens": sum(s["tokens"] for s in shards), "shards": shards}
        (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_shards(
    target,
    dataset,
    tmp: Path,
    config: EagleConfig,
    batch_size: int,
    shard_tokens: int,
    dtype: torch.dtype,
    progress: bool,
) -> list[dict]:
    shards: list[dict] = []
    pending: list[dict[str, torch.Tensor]] = []
    pending_tokens = 0

    def flush() -> None:
        nonlocal pending, pending_tokens
        if not pending:
            return
        lengths = torch.tensor([len(r["input_ids"]) for r in pending], dtype=torch.int64)
        tensors = {
            "input_ids": torch.cat([r["input_ids"] for r in pending]).to(torch.int32),
            "loss_mask": torch.cat([r["loss_mask"] for r in pending]).to(torch.uint8),
            "row_offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            "features": torch.cat([r["features"] for r in pending]),
        }
        if config.version == 3:
            tensors["last_hidden"] = torch.cat([r["last_hidden"] for r in pending])
        name = f"shard_{len(shards):05d}.safetensors"
        save_file(tensors, str(tmp / name))
        shards.append({"file": name, "rows": len(pending), "tokens": int(lengths.sum())})
        pending, pending_tokens = [], 0

    starts = range(0, len(dataset), batch_size)
    for start in tqdm(starts, desc="target features", disable=not progress):
        rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        batch = collate_causal_lm(rows, pad_token_id=0)  # padding is masked out, any id will do
        feats = target_features(
            target,
            batch["input_ids"].to(target.device),
            batch["attention_mask"].to(target.device),
            config,
        )
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            entry = {
                "input_ids": batch["input_ids"][b, :n],
                "loss_mask": batch["loss_mask"][b, :n],
                "features": feats["features"][b, :n].to("cpu", dtype),
            }
            if config.version == 3:
                entry["last_hidden"] = feats["last_hidden"][b, :n].to("cpu", dtype)
            pending.append(entry)
            pending_tokens += n
            if pending_tokens >= shard_tokens:
                flush()
    flush()
    return shards


class FeatureCache(Dataset):
    """The rows of a feature cache, in dataset order: input_ids, loss_mask, features(, last_hidden).

    ``config`` (and ``target``, when given) are checked against what the cache was written for.
    """

    def __init__(
        self, directory: str | os.PathLike, config: EagleConfig, target: Target | None = None
    ):
        self.directory = Path(directory)
        index_path = self.directory / INDEX
        if not index_path.is_file():
            raise FileNotFoundError(
                f"{self.directory} is not a feature cache (no {INDEX}); write "
                "one with write_feature_cache"
            )
        self.index = json.loads(index_path.read_text())
        if self.index.get("cache_version") != CACHE_VERSION:
            raise ValueError(f"{self.directory} was written by another cache version; rewrite it")
        wanted = {
            "version": config.version,
            "aux_layer_ids": list(config.aux_layer_ids),
            "hidden_size": config.target_hidden_size,
        }
        wrong = {k: (self.index.get(k), v) for k, v in wanted.items() if self.index.get(k) != v}
        if wrong:
            raise ValueError(
                f"feature cache {self.directory} does not fit this head (cache vs "
                f"head: {wrong}); write a cache for this head"
            )
        if target is not None:
            target.check_identity(self.index["target"], what=f"feature cache {self.directory}")
        self.version = config.version
        self.shards = self.index["shards"]
        self.starts = [0]
        for shard in self.shards:
            self.starts.append(self.starts[-1] + shard["rows"])
        self._handles: dict[int, object] = {}
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict:
        # open files do not pickle (DataLoader workers started with spawn): reopen them there
        return {**self.__dict__, "_handles": {}, "_offsets": {}}

    def _open(self, s: int):
        # opened lazily, so each DataLoader worker memory-maps the files itself
        if s not in self._handles:
            handle = safe_open(str(self.directory / self.shards[s]["file"]), framework="pt")
            self._handles[s] = handle
            self._offsets[s] = handle.get_tensor("row_offsets").tolist()
        return self._handles[s], self._offsets[s]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} outside 0..{len(self) - 1}")
        s = bisect.bisect_right(self.starts, i) - 1
        handle, offsets = self._open(s)
        lo, hi = offsets[i - self.starts[s]], offsets[i - self.starts[s] + 1]
        row = {
            "input_ids": handle.get_slice("input_ids")[lo:hi].to(torch.int64),
            "loss_mask": handle.get_slice("loss_mask")[lo:hi].to(torch.int64),
            "features": handle.get_slice("features")[lo:hi],
        }
        if self.version == 3:
            row["last_hidden"] = handle.get_slice("last_hidden")[lo:hi]
        return row


def collate_features(rows: Sequence[Mapping], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch of cached rows with the keys of an online batch.

    input_ids, attention_mask, loss_mask, labels as ``collate_causal_lm``; features (B, S, F) and
    last_hidden (B, S, h) zero-padded (EAGLE-1: last_hidden is features).
    """
    batch = collate_causal_lm(rows, pad_token_id)
    width = batch["input_ids"].shape[1]
    for key in ("features", "last_hidden"):
        if key not in rows[0]:
            continue
        first = rows[0][key]
        out = first.new_zeros((len(rows), width, first.shape[-1]))  # (B, S, F)
        for b, row in enumerate(rows):
            out[b, : row[key].shape[0]] = row[key]
        batch[key] = out
    batch.setdefault("last_hidden", batch["features"])
    return batch
