"""Which rows form each micro-batch of each optimizer step, on every process, resumably.

A :class:`BatchPlan` turns the rows' lengths into optimizer steps, epoch by epoch. Each step
holds ``num_processes x gradient_accumulation_steps`` micro-batches; process p trains on
micro-batches ``p * accumulation ... (p + 1) * accumulation - 1`` of every step. Two ways to fill a
micro-batch:

* **token budget** (``max_tokens_per_batch``): rows of similar length share a micro-batch, and each
  is filled with as many rows as fit under the budget, padding counted (rows x longest row). The
  epoch's seeded permutation is cut into windows of about 64 micro-batches; a window is sorted by
  length and cut greedily; the micro-batches of the whole epoch are then shuffled (seeded), so
  consecutive steps mix short and long rows while each micro-batch wastes little on padding.
* **fixed rows** (``max_tokens_per_batch`` none): ``per_device_batch_size`` rows in the epoch's
  seeded order, padded to the longest of them.

With ``packed`` (a trainer's ``packing: true``) the rows of a micro-batch are laid end to end in
one row, so a micro-batch costs its tokens (no padding) and a token budget is filled up to it.

Epoch ``e``'s plan is a pure function of (seed, e, lengths, settings, processes, accumulation):
a resumed run recomputes it and skips the steps already done, so it sees exactly the rows an
uninterrupted run would. The leftover micro-batches of an epoch that do not fill a whole step are
dropped (an epoch never ends inside an accumulation cycle).

Losses are normalised per optimizer step: every row carries a ``weight`` (its number of scored
tokens, say), and the step's objective is the sum of the per-token losses of all its micro-batches
divided by the sum of their weights over every process and micro-batch. The plan knows that sum
before the step starts, so no process waits for another to learn it, and a token weighs the same
whichever micro-batch, process or batch size it lands in (:func:`loss_scale`).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from draftsmith.train.config import PackingKeys

# A length-sorted window spans about this many micro-batches: big enough that rows of similar
# length meet, small enough that a micro-batch's rows still come from a random part of the epoch.
WINDOW_MICRO_BATCHES = 64


@dataclass(frozen=True)
class Step:
    """One optimizer step: its micro-batches (all processes) and the sum of their rows' weights."""

    micro_batches: tuple[tuple[int, ...], ...]  # (processes x accumulation) lists of row indices
    weight: float  # sum of the weights of every row of the step

    def rows(self) -> int:
        return sum(len(m) for m in self.micro_batches)


class BatchPlan:
    """Optimizer steps of every epoch, resumable at any step (see the module docstring).

    ``lengths`` (tokens per row) and ``weights`` (what a row's loss is a sum over, e.g. its scored
    tokens; default its length) are read once; ``weight_fn(rows, micro_index)`` overrides the
    weight of a micro-batch whose rows are not known in advance (a distillation trainer's
    on-policy micro-batches; ``micro_index`` is the micro-batch's index within its process, counted
    over the whole run).
    """

    def __init__(self, lengths: Sequence[int], *, seed: int, shuffle: bool = True,
                 per_device_batch_size: int = 8, max_tokens_per_batch: int | None = None,
                 num_processes: int = 1, accumulation: int = 1,
                 weights: Sequence[float] | None = None,
                 weight_fn: Callable[[Sequence[int], int], float] | None = None,
                 packed: bool = False):
        self.lengths = [int(n) for n in lengths]
        self.weights = [float(w) for w in (self.lengths if weights is None else weights)]
        if len(self.weights) != len(self.lengths):
            raise ValueError(f"{len(self.weights)} row weights for {len(self.lengths)} rows")
        if not self.lengths:
            raise ValueError("the training data has no rows: nothing to train on")
        if per_device_batch_size < 1 or num_processes < 1 or accumulation < 1:
            raise ValueError(f"per_device_batch_size ({per_device_batch_size}), num_processes "
                             f"({num_processes}) and accumulation ({accumulation}) must be >= 1")
        self.seed = seed
        self.shuffle = shuffle
        self.rows_per_batch = per_device_batch_size
        self.max_tokens = max_tokens_per_batch
        self.num_processes = num_processes
        self.accumulation = accumulation
        self.weight_fn = weight_fn
        self.packed = packed  # rows end to end: a micro-batch costs its tokens, no padding
        self.micro_per_step = num_processes * accumulation
        self._cache: dict[int, tuple] = {}
        longest = max(self.lengths)
        if self.max_tokens is not None and self.max_tokens < longest:
            raise ValueError(
                f"max_tokens_per_batch {self.max_tokens} is smaller than the longest training row "
                f"({longest} tokens): raise max_tokens_per_batch to at least {longest}, or lower "
                f"max_length so that rows are cut shorter")
        if self.steps_in_epoch(0) == 0:
            raise ValueError(
                f"the training data ({len(self.lengths)} rows, {sum(self.lengths)} tokens) make "
                f"fewer micro-batches than one optimizer step needs ({num_processes} processes x "
                f"{accumulation} accumulation steps): add data, or lower the batch size "
                f"(per_device_batch_size / max_tokens_per_batch) or gradient_accumulation_steps")

    # -- the plan

    @property
    def budget(self) -> dict:
        """What fixes the plan's shape (recorded in checkpoints: a resume must keep it)."""
        return {"per_device_batch_size": None if self.max_tokens else self.rows_per_batch,
                "max_tokens_per_batch": self.max_tokens, "num_processes": self.num_processes,
                "accumulation": self.accumulation}

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.lengths)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.lengths), generator=generator).tolist()

    def _micro_batches(self, epoch: int) -> list[tuple[int, ...]]:
        order = self._order(epoch)
        if self.max_tokens is None:
            size = self.rows_per_batch
            return [tuple(order[i:i + size]) for i in range(0, len(order) - size + 1, size)]
        mean = sum(self.lengths) / len(self.lengths)
        window = max(1, WINDOW_MICRO_BATCHES * max(1, int(self.max_tokens // mean)))
        batches: list[tuple[int, ...]] = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start:start + window], key=lambda i: (self.lengths[i], i))
            current: list[int] = []
            used = 0
            for i in chunk:  # ascending length: the newest row is the longest of the batch
                cost = (used + self.lengths[i] if self.packed
                        else (len(current) + 1) * self.lengths[i])
                if current and cost > self.max_tokens:
                    batches.append(tuple(current))
                    current, used = [], 0
                current.append(i)
                used += self.lengths[i]
            if current:
                batches.append(tuple(current))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch + 1_000_003)
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        return batches

    def _groups(self, epoch: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """The epoch's micro-batches, grouped into optimizer steps (cached: a few epochs)."""
        groups = self._cache.get(epoch)
        if groups is None:
            micro = self._micro_batches(epoch)
            n = self.micro_per_step
            groups = tuple(tuple(micro[s * n:(s + 1) * n]) for s in range(len(micro) // n))
            if len(self._cache) >= 4:
                self._cache.pop(next(iter(self._cache)))
            self._cache[epoch] = groups
        return groups

    def micro_weight(self, rows: Sequence[int], micro_index: int) -> float:
        """The weight of one micro-batch (``micro_index``: the process's micro-batch count)."""
        if self.weight_fn is not None:
            return float(self.weight_fn(rows, micro_index))
        return sum(self.weights[i] for i in rows)

    def _step(self, index: int, group: tuple[tuple[int, ...], ...]) -> Step:
        # slot s of the group is accumulation slot s % accumulation of process s // accumulation:
        # the same micro_index on every process for the same slot
        a = self.accumulation
        return Step(group, sum(self.micro_weight(rows, index * a + slot % a)
                               for slot, rows in enumerate(group)))

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self._groups(epoch))

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within it) of global optimizer step ``step`` (0-based)."""
        epoch = 0
        while step >= self.steps_in_epoch(epoch):
            step -= self.steps_in_epoch(epoch)
            epoch += 1
        return epoch, step

    def total_steps(self, max_steps: int | None, num_epochs: int | None) -> int:
        """Optimizer steps of the run: ``max_steps`` or ``num_epochs`` epochs, the first reached."""
        limits = [max_steps] if max_steps is not None else []
        if num_epochs is not None:
            limits.append(sum(self.steps_in_epoch(e) for e in range(num_epochs)))
        if not limits:
            raise ValueError("give max_steps or num_epochs, so that training ends")
        return min(limits)

    def epoch_of(self, step: int) -> float:
        """Fractional epoch after ``step`` optimizer steps (for logs)."""
        epoch, within = self.locate(step)
        return epoch + within / self.steps_in_epoch(epoch)

    def steps(self, start: int) -> Iterator[tuple[int, Step]]:
        """(global step index, step) from ``start`` on, epoch after epoch, without end."""
        epoch, within = self.locate(start)
        index = start
        while True:
            groups = self._groups(epoch)
            for group in groups[within:]:
                yield index, self._step(index, group)
                index += 1
            epoch += 1
            within = 0

    def rows_of(self, step: Step, process_index: int) -> list[tuple[int, ...]]:
        """The micro-batches process ``process_index`` trains on in ``step``."""
        a = self.accumulation
        return list(step.micro_batches[process_index * a:(process_index + 1) * a])


def padded_tokens(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]],
                  packed: bool = False) -> tuple[int, int]:
    """(real tokens, tokens including padding) of micro-batches padded to their longest row
    (``packed``: laid end to end, no padding)."""
    real = sum(lengths[i] for rows in micro_batches for i in rows)
    if packed:
        return real, real
    padded = sum(len(rows) * max(lengths[i] for i in rows) for rows in micro_batches if rows)
    return real, padded


def loss_scale(step_weight: float, num_processes: int, accumulation: int) -> float:
    """Factor turning a micro-batch's summed loss into its share of the step's per-token mean.

    The backward pass divides by ``accumulation`` (accelerate) and averages over processes (DDP),
    so a summed loss is scaled by processes x accumulation / the step's total weight.
    """
    return num_processes * accumulation / max(step_weight, 1e-12)


# ------------------------------------------------------------------------------------------------
# The process's micro-batches as a DataLoader


class _ProcessBatches(Sampler[list[int]]):
    """This process's micro-batches (lists of row indices) from a given step on, without end."""

    def __init__(self, plan: BatchPlan, process_index: int, start_step: int):
        self.plan = plan
        self.process_index = process_index
        self.start_step = start_step

    def __iter__(self) -> Iterator[list[int]]:
        for _, step in self.plan.steps(self.start_step):
            for rows in self.plan.rows_of(step, self.process_index):
                yield list(rows)

    def __len__(self) -> int:  # endless; DataLoader asks only for progress displays
        return 2**62


def _ignore_stop_signals(worker_id: int) -> None:
    # Ctrl-C reaches the DataLoader workers too; the main process decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@dataclass
class TrainBatches:
    """The run's data: a dataset, its :class:`BatchPlan` and how rows become a batch.

    ``steps(start, device)`` yields ``(step_index, step, micro_batches)`` where micro_batches are
    this process's collated batches (dicts of tensors on ``device``), ``accumulation`` of them.
    """

    dataset: Any
    plan: BatchPlan
    collate_fn: Callable
    _: KW_ONLY
    process_index: int = 0
    num_workers: int = 0
    pin_memory: bool = False

    def __post_init__(self):
        if len(self.dataset) != len(self.plan.lengths):
            raise ValueError(f"the plan has {len(self.plan.lengths)} rows, the dataset "
                             f"{len(self.dataset)}")

    def __len__(self) -> int:
        return len(self.dataset)

    def loader(self, start_step: int) -> DataLoader:
        return DataLoader(
            self.dataset, batch_sampler=_ProcessBatches(self.plan, self.process_index, start_step),
            collate_fn=self.collate_fn, num_workers=self.num_workers,
            # its own generator: starting an iterator draws a seed from it, not from the global
            # random state that dropout and noise use (a resumed run must not draw an extra one)
            generator=torch.Generator().manual_seed(self.plan.seed),
            worker_init_fn=_ignore_stop_signals if self.num_workers else None,
            pin_memory=self.pin_memory, persistent_workers=False)

    def steps(self, start_step: int, device: torch.device) -> Iterator[tuple[int, Step, list[dict]]]:
        micro = iter(self.loader(start_step))
        for index, step in self.plan.steps(start_step):
            batches = []
            for _ in range(self.plan.accumulation):
                batch = next(micro)
                batches.append({k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                                for k, v in batch.items()})
            yield index, step, batches


def make_batches(dataset, cfg, accelerator, collate_fn: Callable, *, lengths: Sequence[int],
                 weights: Sequence[float] | None = None,
                 weight_fn: Callable[[Sequence[int], int], float] | None = None) -> TrainBatches:
    """The run's :class:`TrainBatches` from the config's batch keys and the accelerator's layout."""
    plan = BatchPlan(lengths, seed=cfg.seed, shuffle=cfg.shuffle,
                     per_device_batch_size=cfg.per_device_batch_size,
                     max_tokens_per_batch=cfg.max_tokens_per_batch,
                     num_processes=accelerator.num_processes,
                     accumulation=accelerator.gradient_accumulation_steps,
                     weights=weights, weight_fn=weight_fn,
                     packed=isinstance(cfg, PackingKeys) and cfg.packing)
    return TrainBatches(dataset, plan, collate_fn, process_index=accelerator.process_index,
                        num_workers=cfg.num_workers,
                        pin_memory=accelerator.device.type == "cuda")


def scored_tokens(loss_mask) -> int:
    """How many tokens a row's loss scores: the ones of its ``loss_mask`` (a list, or a tensor of
    any integer type: an int8 mask is summed in int64, never in its own type, where 200 ones
    would sum to -56)."""
    if isinstance(loss_mask, torch.Tensor):
        return int(loss_mask.sum(dtype=torch.int64))
    return int(sum(loss_mask))


def row_sizes(rows, chunk: int = 1024) -> tuple[list[int], list[int]]:
    """(tokens, scored tokens) of every row: ``len(input_ids)`` and ``sum(loss_mask)``.

    ``rows``: a ``datasets.Dataset`` (read ``chunk`` rows at a time) or a list of row dicts.
    """
    lengths: list[int] = []
    scored: list[int] = []
    if hasattr(rows, "iter"):
        for part in rows.select_columns(["input_ids", "loss_mask"]).iter(batch_size=chunk):
            lengths += [len(ids) for ids in part["input_ids"]]
            scored += [scored_tokens(mask) for mask in part["loss_mask"]]
    else:
        for row in rows:
            lengths.append(len(row["input_ids"]))
            scored.append(scored_tokens(row["loss_mask"]))
    return lengths, scored


def split_heldout(rows, fraction: float, max_rows: int, seed: int):
    """(training rows, held-out rows or None): a seeded random ``fraction``, at most ``max_rows``.

    ``rows``: a ``datasets.Dataset`` (split with ``select``) or a list. Rows keep their order.
    """
    n = len(rows)
    if fraction <= 0 or n < 2:
        return rows, None
    count = min(max_rows, max(1, round(fraction * n)), n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    train, held = sorted(order[count:]), sorted(order[:count])
    if hasattr(rows, "select"):
        return rows.select(train), rows.select(held)
    return [rows[i] for i in train], [rows[i] for i in held]
