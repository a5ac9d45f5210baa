"""The feature cache: run the frozen target once over a tokenised dataset, read its features back.

Shared by every draft that reads the target's hidden states (EAGLE heads, block drafts) and by
the memory estimate. Online mode runs the target inside every training step
(:func:`draftsmith.targets.features.target_features`);
offline mode pays that once and trains from disk, which pays off over several epochs or when the
target does not fit beside the head. Both give the same batches (keys and tensors), so the loss
is the same (tested). Every process writes its share of the files at the same time::

    write_feature_cache(target, dataset, "features/", head.config,         # on every rank
                        process_index=rank, num_processes=world_size, batch_size=8,
                        dtype=torch.bfloat16)
    accelerator.wait_for_everyone()
    cache = FeatureCache("features/", head.config)   # a torch Dataset; cache.lengths per row
    loader = DataLoader(cache, batch_size=4, shuffle=True, num_workers=2,
                        collate_fn=functools.partial(collate_features, pad_token_id=pad_id))
    head = EagleHead(head.config, load_target_parts(name), d2t=d2t, t2d=t2d)  # no decoder layers
    loss, metrics = eagle_loss(head, next(iter(loader)))

Layout of the cache directory::

    index.json                 the marker and the plan: format "draftsmith-feature-cache", what
                               the cache was written for (target, head layers, dtype, data),
                               its files (first row, rows, tokens, bytes) and every row's length
    features-00000.safetensors  rows first_row .. first_row + rows - 1:
                               row_offsets (rows+1,) int64, scored_offsets (rows+1,) int64
                               (EAGLE-3), features (N, F), last_hidden (M, h) (EAGLE-3),
                               input_ids (N,) int32, loss_mask (N,) uint8

The plan depends on the data, the head's layers, the dtype and ``max_file_bytes`` only, never on
the number of processes: file k is written by process k mod num_processes, its rows batched in
the same way whoever writes it, so a cache written by 2 processes is byte for byte the one 1
process writes. Each file is written to a temporary name, streamed batch by batch (host memory is
one batch of features, not a file, not the cache) and renamed when complete; a rerun skips the
complete files, so a killed run resumes file by file. Before writing, the size of the whole
cache is printed and the run refused if the disk lacks the room still needed.

What is stored: ``features`` at every position (the head reads its input features at every
position of the prefix it attends to): EAGLE-1 the final-normed last layer (index L), EAGLE-3
the three aux layers concatenated (3h). EAGLE-3 also needs the target's distribution, from the
last layer (index L) through the frozen LM head, but only where the loss scores it: at the
positions p that predict an assistant token (``loss_mask[p + 1] = 1``). ``last_hidden`` is
stored there alone (M rows) and read back as a dense (N, h) tensor, zero elsewhere; the loss
never looks at those zeros. Per token: EAGLE-1 h x dtype bytes; EAGLE-3 3h plus h over scored
positions; plus 5 bytes (id, mask). For smollm2-135m (h 576) in bf16: EAGLE-1 1,157 B/token,
EAGLE-3 3,461 B/token + 1,152 B per scored token (4,613 B when every token is scored).

A directory is used only when it is empty, absent, or a cache this module wrote for the same
target, head layers, dtype, data and file size; anything else is an error before any work, and
nothing in it is deleted or overwritten (index paths are confined to the directory).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import shutil
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from draftsmith.targets.features import FeatureSpec, target_features
from draftsmith.targets.shards import is_sharded
from draftsmith.targets.target import Target, dtype_name
from draftsmith.train.config import FeatureKeys, PackingKeys
from draftsmith.train.rows import collate_causal_lm, pack_rows

FORMAT = "draftsmith-feature-cache"
CACHE_VERSION = 3
INDEX = "index.json"
DEFAULT_MAX_FILE_BYTES = 256 << 20
_FILE_NAME = re.compile(r"features-\d{5}\.safetensors")
_TMP = ".tmp-"
_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.uint8: "U8"}
_OPEN_FILES = 64  # memory maps a reader keeps open at once


def _width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def row_bytes(config: FeatureSpec, dtype: torch.dtype, tokens: int, scored: int) -> int:
    """Disk bytes of one cached row of ``tokens`` tokens, ``scored`` of them scored positions."""
    width = _width(dtype)
    features = len(config.aux_layer_ids) * config.target_hidden_size * width
    last = config.target_hidden_size * width if config.version == 3 else 0
    return tokens * (features + 5) + scored * last + 16


def _scored(loss_mask) -> torch.Tensor:
    """(n,) bool: the positions whose last hidden state the loss reads (they predict a masked
    token: ``loss_mask[p + 1] = 1``)."""
    mask = torch.as_tensor(loss_mask).bool()
    return torch.cat([mask[1:], mask.new_zeros(1)])


def _numpy_rows(dataset):
    """Rows with numpy columns from a ``datasets.Dataset`` (fast), else the rows as they are."""
    with_format = getattr(dataset, "with_format", None)
    return with_format("numpy") if with_format is not None else dataset


def _target_record(target: Target) -> dict:
    """What the cache records about its target: name, shapes and the weights' fingerprint (not
    where the target was loaded from: a moved target directory still fits its cache)."""
    return {k: v for k, v in target.identity().items() if k not in ("path", "hub_id")}


def _plan(dataset, config: FeatureSpec, dtype: torch.dtype, max_file_bytes: int
          ) -> tuple[dict, list[int]]:
    """(files and totals, row lengths): consecutive rows packed into files of at most
    ``max_file_bytes`` (a longer row gets a file of its own), and the data's fingerprint."""
    digest = hashlib.sha256()
    lengths, scored_counts = [], []
    for row in _numpy_rows(dataset):
        ids = torch.as_tensor(row["input_ids"]).to(torch.int32)
        mask = torch.as_tensor(row["loss_mask"]).to(torch.uint8)
        if ids.ndim != 1 or ids.shape != mask.shape or len(ids) < 1:
            raise ValueError(f"row {len(lengths)} of the dataset has input_ids of shape "
                             f"{tuple(ids.shape)} and loss_mask {tuple(mask.shape)}; expected "
                             f"two equal non-empty 1-D sequences (draftsmith.train.rows.load_sft_dataset)")
        digest.update(struct.pack("<q", len(ids)))
        digest.update(ids.numpy().tobytes())
        digest.update(mask.numpy().tobytes())
        lengths.append(len(ids))
        scored_counts.append(int(_scored(mask).sum()))
    if not lengths:
        raise ValueError("the dataset has no rows: nothing to cache")
    files: list[dict] = []
    for index, (n, m) in enumerate(zip(lengths, scored_counts, strict=True)):
        size = row_bytes(config, dtype, n, m)
        if not files or (files[-1]["rows"] and files[-1]["bytes"] + size > max_file_bytes):
            files.append({"file": f"features-{len(files):05d}.safetensors", "first_row": index,
                          "rows": 0, "tokens": 0, "scored": 0, "bytes": 0})
        last = files[-1]
        last["rows"] += 1
        last["tokens"] += n
        last["scored"] += m if config.version == 3 else 0
        last["bytes"] += size
    plan = {"dataset": digest.hexdigest()[:24], "rows": len(lengths), "tokens": sum(lengths),
            "files": files}
    return plan, lengths


def _key(target: Target, config: FeatureSpec, dtype: torch.dtype, max_file_bytes: int) -> dict:
    """What a cache is written for; a cache is reused only when all of it agrees."""
    return {
        "format": FORMAT,
        "cache_version": CACHE_VERSION,
        "version": config.version,
        "aux_layer_ids": list(config.aux_layer_ids),
        "feature_layers": list(config.feature_layers),
        "hidden_size": config.target_hidden_size,
        "dtype": dtype_name(dtype),
        "target": _target_record(target),
        "max_file_bytes": max_file_bytes,
    }


def _is_ours_tmp(name: str) -> bool:
    return _TMP in name and (name.startswith(INDEX) or _FILE_NAME.fullmatch(name.split(_TMP)[0])
                             is not None)


def _read_index(directory: Path) -> dict:
    """The index of a cache this module wrote; a clear error for anything else."""
    path = directory / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} cannot be read as a feature cache index ({err}); choose "
                         f"another cache directory") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{directory} holds an {INDEX} that draftsmith's feature cache did not "
                         f"write (or an older version of it); nothing was changed there: choose "
                         f"another cache directory, or delete it yourself if it is a cache")
    if index.get("cache_version") != CACHE_VERSION:
        raise ValueError(f"{directory} is a feature cache of version {index.get('cache_version')}"
                         f", this is version {CACHE_VERSION}: choose another cache directory, or "
                         f"delete it yourself")
    files = index.get("files")
    if not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("file"), str)
            and _FILE_NAME.fullmatch(f["file"]) for f in files):
        raise ValueError(f"{path} names files outside the pattern features-NNNNN.safetensors "
                         f"in {directory}; it was not written by draftsmith: choose another "
                         f"cache directory")
    return index


def _differences(index: dict, expected: dict) -> dict:
    return {k: (index.get(k), v) for k, v in expected.items() if index.get(k) != v}


def _existing_index(directory: Path, expected: dict) -> dict | None:
    """The index of the cache in ``directory`` when it is one written for ``expected``; None
    when the directory is absent or empty (or holds only temporary files of this module)."""
    if (directory / INDEX).exists():
        index = _read_index(directory)
        wrong = _differences(index, expected)
        if wrong:
            detail = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in wrong.items())
            raise ValueError(f"the feature cache {directory} was written for something else "
                             f"({detail}); nothing was changed there: use another cache "
                             f"directory, or delete this one yourself")
        return index
    if directory.exists():
        if not directory.is_dir():
            raise ValueError(f"feature cache {directory} is a file; choose a directory")
        foreign = [p.name for p in directory.iterdir() if not _is_ours_tmp(p.name)]
        if foreign:
            raise ValueError(f"{directory} is not empty and not a feature cache (it holds "
                             f"{sorted(foreign)[:5]}); nothing was changed there: choose an "
                             f"empty or new cache directory")
    return None


def _create_index(directory: Path, index: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # every process may get here at once: each writes the same bytes under its own name
    tmp = directory / f"{INDEX}{_TMP}{os.getpid()}"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, directory / INDEX)


def _free_bytes(directory: Path) -> int:
    existing = directory
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


def _complete(directory: Path, entry: dict) -> bool:
    path = directory / entry["file"]
    return path.is_file() and path.stat().st_size == entry["bytes"]


def cache_is_complete(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a feature cache with every file written (its target, layers
    and data are checked by :func:`write_feature_cache` and :class:`FeatureCache`)."""
    directory = Path(directory)
    if not (directory / INDEX).is_file():
        return False
    index = _read_index(directory)
    return all(_complete(directory, entry) for entry in index["files"])


def write_feature_cache(
    target: Target,
    dataset: Sequence[Mapping],
    cache_dir: str | os.PathLike,
    config: FeatureSpec,
    *,
    process_index: int = 0,
    num_processes: int = 1,
    batch_size: int = 8,
    dtype: torch.dtype | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    progress: bool = False,
    lockstep: Callable[[int], int] | None = None,
) -> Path:
    """Run the target over ``dataset`` (rows with input_ids, loss_mask) and cache the features.

    Call it on every process with its ``process_index`` and ``num_processes``: each writes its
    share of the files, then the caller waits for all (a barrier) before reading with
    :class:`FeatureCache`. Called with the defaults on one process it writes every file. Files
    already complete are kept, so a rerun finishes an interrupted cache; a cache written for
    another target, head layers, dtype, data or ``max_file_bytes`` is an error (see the module
    docstring). ``dtype`` defaults to the target's (bf16 where the target runs in bf16, as on
    GPU). Returns the cache directory.

    The target runs in this thread; a writer thread copies each batch's features into the file
    (seeks, writes, the final fsync and rename), so the disk is not on the target's critical
    path. ``lockstep(forwards) -> the most forwards any process runs``: for a sharded target,
    whose every forward needs all processes, this process then runs extra forwards (discarded)
    until it has run as many as the busiest.
    """
    if batch_size < 1 or max_file_bytes < 1:
        raise ValueError(f"batch_size and max_file_bytes must be >= 1, got {batch_size}, "
                         f"{max_file_bytes}")
    if not 0 <= process_index < num_processes:
        raise ValueError(f"need 0 <= process_index < num_processes, got {process_index}, "
                         f"{num_processes}")
    dtype = dtype or target.dtype
    if dtype not in _CACHE_DTYPES:
        raise ValueError(f"cache dtype must be one of {[dtype_name(d) for d in _CACHE_DTYPES]}, "
                         f"got {dtype}")
    directory = Path(cache_dir)
    plan, lengths = _plan(dataset, config, dtype, max_file_bytes)
    for entry in plan["files"]:
        entry["bytes"] = _layout(config, dtype, entry)[2]  # exact, header included
    expected = {**_key(target, config, dtype, max_file_bytes), "dataset": plan["dataset"],
                "rows": plan["rows"]}
    index = _existing_index(directory, expected)
    new = index is None
    if new:
        index = {**expected, "tokens": plan["tokens"],
                 "bytes": sum(f["bytes"] for f in plan["files"]), "files": plan["files"],
                 "lengths": lengths}
    files = index["files"]
    missing = [f for f in files if new or not _complete(directory, f)]
    to_write = sum(f["bytes"] for f in missing)
    free = _free_bytes(directory)
    if process_index == 0 and (progress or missing):
        print(f"[draftsmith] feature cache {directory}: {index['rows']:,} rows, "
              f"{index['tokens']:,} tokens, {index['bytes'] / 1e9:.3f} GB in {len(files)} files "
              f"({to_write / 1e9:.3f} GB still to write, {free / 1e9:.1f} GB free)", flush=True)
    if to_write > free:
        raise ValueError(f"the feature cache {directory} needs {to_write / 1e9:.3f} GB more but "
                         f"the disk has {free / 1e9:.3f} GB free; nothing was written: free "
                         f"space, choose another cache directory, or store it in bf16 (dtype)")
    if new:
        _create_index(directory, index)
    mine = [f for k, f in enumerate(files) if k % num_processes == process_index]
    for stale in directory.iterdir():  # left by a killed run of this process's files
        if _TMP in stale.name and stale.name.split(_TMP)[0] in {f["file"] for f in mine}:
            stale.unlink()
    todo = [f for f in mine if not _complete(directory, f)]
    forwards = sum(-(-f["rows"] // batch_size) for f in todo)
    extra = lockstep(forwards) - forwards if lockstep is not None else 0
    with (ThreadPoolExecutor(max_workers=1, thread_name_prefix="feature-cache") as writer,
          tqdm(total=sum(f["tokens"] for f in todo), desc="target features", unit="tok",
               disable=not (progress and process_index == 0)) as bar):
        for entry in todo:
            _write_file(target, dataset, directory, config, dtype, entry, batch_size, bar,
                        writer)
        idle = torch.zeros((1, 2), dtype=torch.int64, device=target.device)
        for _ in range(extra):  # the busiest process's forwards need this one too
            target_features(target, idle, None, config)
    return directory


def _layout(config: FeatureSpec, dtype: torch.dtype, entry: dict
            ) -> tuple[bytes, dict[str, int], int]:
    """(the safetensors header, each tensor's first byte in the file, the file size) of a file.

    Tensors are ordered by element size, largest first, so every one starts aligned to its
    element size (safetensors' own writer does the same).
    """
    h, rows, n, m = config.target_hidden_size, entry["rows"], entry["tokens"], entry["scored"]
    specs = [("row_offsets", torch.int64, [rows + 1]),
             ("features", dtype, [n, len(config.aux_layer_ids) * h]),
             ("input_ids", torch.int32, [n]), ("loss_mask", torch.uint8, [n])]
    if config.version == 3:
        specs += [("scored_offsets", torch.int64, [rows + 1]), ("last_hidden", dtype, [m, h])]
    specs.sort(key=lambda s: (-_width(s[1]), s[0]))
    described, begins, offset = {}, {}, 0
    for name, dt, shape in specs:
        size = _width(dt) * shape[0] * (shape[1] if len(shape) > 1 else 1)
        described[name] = {"dtype": _SAFETENSORS_DTYPES[dt], "shape": shape,
                           "data_offsets": [offset, offset + size]}
        begins[name] = offset
        offset += size
    header = json.dumps({**described, "__metadata__": {"format": FORMAT}},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    start = 8 + len(header)
    return (struct.pack("<Q", len(header)) + header, {k: start + v for k, v in begins.items()},
            start + offset)


def _write_file(target: Target, dataset, directory: Path, config: FeatureSpec,
                dtype: torch.dtype, entry: dict, batch_size: int, bar, writer) -> None:
    """One file, streamed to a temporary name batch by batch, then renamed (atomic). The
    target runs here; ``writer`` (one thread) does every write, in order, at most two batches
    behind."""
    header, begins, size = _layout(config, dtype, entry)
    first, count = entry["first_row"], entry["rows"]
    rows = [dataset[i] for i in range(first, first + count)]
    ids = [torch.as_tensor(r["input_ids"]).to(torch.int64) for r in rows]
    masks = [torch.as_tensor(r["loss_mask"]).to(torch.int64) for r in rows]
    lengths = torch.tensor([len(x) for x in ids])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    scored = [_scored(m) for m in masks]
    scored_offsets = torch.cat([torch.zeros(1, dtype=torch.int64),
                                torch.tensor([int(s.sum()) for s in scored]).cumsum(0)])
    tmp = directory / f"{entry['file']}{_TMP}{os.getpid()}"
    out = open(tmp, "wb")  # noqa: SIM115 - closed by the writer thread's last job

    def put(name: str, tensor: torch.Tensor, start: int = 0) -> None:
        """Write ``tensor`` into tensor ``name`` of the file, from its element row ``start``
        (rows of the tensor's last dimension)."""
        data = tensor.contiguous().view(torch.uint8).numpy()
        row_width = _width(tensor.dtype) * (tensor.shape[-1] if tensor.ndim > 1 else 1)
        out.seek(begins[name] + start * row_width)
        out.write(memoryview(data))

    def head() -> None:
        out.write(header)
        out.truncate(size)
        put("row_offsets", offsets)
        put("input_ids", torch.cat(ids).to(torch.int32))
        put("loss_mask", torch.cat(masks).to(torch.uint8))
        if config.version == 3:
            put("scored_offsets", scored_offsets)

    def rows_of(chunk, feats: torch.Tensor, lasts: list[torch.Tensor]) -> None:
        for b, k in enumerate(chunk):
            n = int(lengths[k])
            put("features", feats[b, :n], int(offsets[k]))
            if config.version == 3:
                put("last_hidden", lasts[b], int(scored_offsets[k]))

    def finish() -> None:
        out.flush()
        os.fsync(out.fileno())
        out.close()
        os.replace(tmp, directory / entry["file"])

    pending = [writer.submit(head)]
    try:
        # longest first: similar lengths share a batch (less padding); the order never changes
        # what is written where, so any process writes the same bytes
        order = sorted(range(count), key=lambda k: (-int(lengths[k]), k))
        for start in range(0, count, batch_size):
            chunk = order[start:start + batch_size]
            batch = collate_causal_lm([{"input_ids": ids[k], "loss_mask": masks[k]}
                                       for k in chunk], pad_token_id=0)  # padding is masked
            with torch.no_grad():
                feats = target_features(target, batch["input_ids"].to(target.device),
                                        batch["attention_mask"].to(target.device), config)
            # one copy to the host per batch; the rows are cut from it in the writer thread
            features = feats["features"].to("cpu", dtype)  # (B, S, F)
            lasts = []
            if config.version == 3:
                last = feats["last_hidden"].to("cpu", dtype)  # (B, S, h)
                lasts = [last[b, :int(lengths[k])][scored[k]] for b, k in enumerate(chunk)]
            while len(pending) > 2:  # at most two batches wait for the disk
                pending.pop(0).result()
            pending.append(writer.submit(rows_of, chunk, features, lasts))
            bar.update(sum(int(lengths[k]) for k in chunk))
        pending.append(writer.submit(finish))
    finally:
        for job in pending:
            job.result()  # the writer's errors surface here
        if not out.closed:
            out.close()


class FeatureCache(Dataset):
    """The rows of a feature cache, in dataset order: input_ids, loss_mask, features and, for
    EAGLE-3, last_hidden (dense (n, h), zero where the loss does not read it).

    ``config`` (and ``target``, when given) are checked against what the cache was written for;
    every file must be complete. ``lengths`` holds every row's token count (read from the index,
    no file opened), for batching by a token budget. Files are memory-mapped and opened lazily,
    at most 64 at once, so each DataLoader worker (``num_workers``, which prefetch) maps its own.
    """

    def __init__(self, directory: str | os.PathLike, config: FeatureSpec,
                 target: Target | None = None):
        self.directory = Path(directory)
        if not (self.directory / INDEX).is_file():
            raise FileNotFoundError(f"{self.directory} is not a feature cache (no {INDEX}); write "
                                    f"one with write_feature_cache")
        self.index = _read_index(self.directory)
        wanted = {"version": config.version, "aux_layer_ids": list(config.aux_layer_ids),
                  "hidden_size": config.target_hidden_size}
        wrong = _differences(self.index, wanted)
        if wrong:
            raise ValueError(f"feature cache {self.directory} does not fit this head (cache vs "
                             f"head: {wrong}); write a cache for this head")
        if target is not None:
            what = f"feature cache {self.directory}"
            target.check_identity(self.index["target"], what=what)
        self.files = self.index["files"]
        incomplete = [f["file"] for f in self.files if not _complete(self.directory, f)]
        if incomplete:
            raise FileNotFoundError(f"feature cache {self.directory} is incomplete ({len(incomplete)}"
                                    f" of {len(self.files)} files missing, e.g. {incomplete[0]}); "
                                    f"rerun write_feature_cache on every process to finish it")
        self.version = config.version
        self.lengths: list[int] = self.index["lengths"]
        self.starts = [f["first_row"] for f in self.files]
        self._handles: OrderedDict[int, tuple] = OrderedDict()

    def __len__(self) -> int:
        return self.index["rows"]

    def __getstate__(self) -> dict:
        # memory maps do not pickle (DataLoader workers started with spawn): reopen them there
        return {**self.__dict__, "_handles": OrderedDict()}

    def _open(self, k: int) -> tuple:
        if k in self._handles:
            self._handles.move_to_end(k)
            return self._handles[k]
        handle = safe_open(str(self.directory / self.files[k]["file"]), framework="pt")
        offsets = handle.get_tensor("row_offsets").tolist()
        scored = handle.get_tensor("scored_offsets").tolist() if self.version == 3 else None
        self._handles[k] = (handle, offsets, scored)
        if len(self._handles) > _OPEN_FILES:
            self._handles.popitem(last=False)
        return self._handles[k]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} outside 0..{len(self) - 1}")
        k = bisect.bisect_right(self.starts, i) - 1
        handle, offsets, scored = self._open(k)
        r = i - self.starts[k]
        lo, hi = offsets[r], offsets[r + 1]
        row = {
            "input_ids": handle.get_slice("input_ids")[lo:hi].to(torch.int64),
            "loss_mask": handle.get_slice("loss_mask")[lo:hi].to(torch.int64),
            "features": handle.get_slice("features")[lo:hi],
        }
        if self.version == 3:
            sparse = handle.get_slice("last_hidden")[scored[r]:scored[r + 1]]  # (m, h)
            last = sparse.new_zeros((hi - lo, sparse.shape[-1]))  # (n, h)
            last[_scored(row["loss_mask"])] = sparse
            row["last_hidden"] = last
        return row


def collate_features(rows: Sequence[Mapping], pad_token_id: int,
                     packed: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded batch of cached rows with the keys of an online batch.

    input_ids, attention_mask, loss_mask, labels as ``collate_causal_lm``; features (B, S, F) and
    last_hidden (B, S, h) zero-padded (EAGLE-1: last_hidden is features). ``packed``: the rows
    end to end in one row with their position_ids (:func:`draftsmith.train.rows.pack_rows`).
    """
    if packed:
        batch = pack_rows(rows, keys=[k for k in ("features", "last_hidden") if k in rows[0]])
        batch.setdefault("last_hidden", batch["features"])
        return batch
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


# ------------------------------------------------------------------------------------------------
# what a trainer with ``feature_mode`` (EAGLE, block drafts) reads its rows from


def loads_target_parts(cfg) -> bool:
    """Whether a run needs only the target's embedding, final norm and LM head: it trains from a
    finished feature cache without evaluating (``feature_mode: offline``, ``eval_every: 0``)."""
    if not isinstance(cfg, FeatureKeys) or cfg.feature_mode != "offline" or cfg.eval_every:
        return False
    try:
        return cache_is_complete(feature_cache_dir(cfg))
    except ValueError:
        return False  # not a cache: reported where the cache is opened


def load_feature_target(cfg, accelerator) -> Target:
    """The target a run needs: only its embedding, final norm and LM head when it trains from a
    finished cache without evaluating (:func:`loads_target_parts`), else all of it (sharded
    when ``target_parallel`` > 1: :func:`draftsmith.train.sharding.load_run_target`)."""
    from draftsmith.train.sharding import load_run_target

    return load_run_target(cfg, accelerator, parts_only=loads_target_parts(cfg))


def target_layer_weights(target: Target, layer: int, names: Sequence[str]) -> dict:
    """The named tensors of the target's decoder layer ``layer``, whole, by the layer's own names:
    from the loaded layer (gathered from every process when the target is sharded: every process
    must call it), or from the checkpoint when the run loaded the target in parts (its layers
    exist only on the meta device). Names the layer lacks are left out."""
    from torch.distributed.tensor import DTensor

    from draftsmith.targets.target import _read_checkpoint_tensors

    module = target.layers[layer]
    own = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    if any(t.is_meta for t in own.values()):
        prefix = next(n for n, m in target.model.named_modules() if m is module) + "."
        read = _read_checkpoint_tensors(Path(target.path), [prefix + n for n in own])
        return {n[len(prefix):]: t for n, t in read.items() if n[len(prefix):] in names}
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach()
            for n, t in own.items() if n in names}


def feature_cache_dir(cfg) -> Path:
    return Path(cfg.feature_cache_dir or Path(cfg.output_dir) / "features")


def feature_rows(cfg, accelerator, target: Target, dataset, config, pad_id: int):
    """(rows, collate) of a run: the tokenised dataset (online: the target runs in the step), or
    the feature cache, written first by every process at once (offline)."""
    packed = isinstance(cfg, PackingKeys) and cfg.packing
    if cfg.feature_mode != "offline":
        return dataset, partial(collate_causal_lm, pad_token_id=pad_id, packed=packed)
    directory = feature_cache_dir(cfg)
    lockstep = None
    if is_sharded(target):  # every forward needs every process: the shares are evened out
        def lockstep(forwards: int) -> int:
            counts = accelerator.gather(torch.tensor([forwards], device=accelerator.device))
            return int(counts.max())
    write_feature_cache(target, dataset, directory, config,
                        process_index=accelerator.process_index,
                        num_processes=accelerator.num_processes,
                        batch_size=cfg.per_device_batch_size,
                        dtype=torch.bfloat16 if cfg.feature_dtype == "bf16" else torch.float32,
                        progress=accelerator.is_main_process, lockstep=lockstep)
    accelerator.wait_for_everyone()
    return FeatureCache(directory, config, target), partial(collate_features, pad_token_id=pad_id,
                                                            packed=packed)
