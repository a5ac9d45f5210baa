"""Training metrics: ``metrics.jsonl``, accelerate's trackers (W&B), a progress bar, acceptance.

``<output_dir>/metrics.jsonl`` holds one JSON object per logged step, written by the main
process and flushed line by line, e.g.::

    {"step": 20, "loss": 2.31, "accuracy": 0.41, "lr": 0.0003, "tokens_per_s": 5120.4,
     "epoch": 0.12, "samples": 640}
    {"step": 500, "eval/tau": 2.7, "eval/alpha": 0.62, "eval/alpha_depth_1": 0.8, ...}

The same records go to the trackers accelerate was given (``report_to: wandb``; the W&B run
lives in ``<output_dir>/wandb``; W&B's own convention decides where it goes: ``$WANDB_MODE`` when
set, else online when you are logged in and offline otherwise, said at the start with the
``wandb sync`` command for an offline run). A resumed run first drops the lines past its checkpoint's step,
so the file tells one consistent history.

Values are accumulated as detached tensors on the device; ``.item()`` (one all-reduce and one
host sync) happens only on logging steps.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from draftsmith.eval.engine import measure_acceptance
from draftsmith.eval.prompts import read_prompts
from draftsmith.eval.proposers import Proposer
from draftsmith.eval.report import announce_wandb_run, wandb_mode
from draftsmith.eval.sampling import SamplingParams
from draftsmith.files.output_dir import write_atomic
from draftsmith.train.checkpoints import TrainState
from draftsmith.train.config import config_to_dict

_REPO = Path(__file__).resolve().parents[1]


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process so far: the device's allocator on CUDA, resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def rewind_jsonl(path: Path, step: int) -> None:
    """Keep the records of ``path`` up to ``step`` (a resumed run rewrites what follows).

    A half-written last line (a crash mid-write) is dropped too. Rewritten atomically.
    """
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) \
                and record["step"] <= step:
            kept.append(line)
    write_atomic(path, "".join(line + "\n" for line in kept))


class MetricsLogger:
    """Accumulates per-step metrics and writes them every ``log_every`` optimizer steps.

    In the loop: ``add(name, total, count)`` for every quantity (the logged value is
    sum(total) / sum(count) over the steps since the last log and over all processes: a mean
    loss per micro-batch is ``add("loss", loss.detach())``, a token accuracy
    ``add("accuracy", correct.sum(), mask.sum())``), ``count_tokens(n)`` for tokens/s, then
    ``step(state, lr=lr)`` once after each optimizer step on every process. Every process must
    add the same names. Build it after ``Checkpointer.resume()``.
    """

    def __init__(self, accelerator: Accelerator, cfg, state: TrainState):
        self.accelerator = accelerator
        self.every = cfg.log_every
        self.path = Path(cfg.output_dir) / "metrics.jsonl"
        self.is_main = accelerator.is_main_process
        self.device = accelerator.device
        # float64 sums: many steps of small values, and counts past 2**24 tokens
        self.dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self._sums: dict[str, list[torch.Tensor]] = {}
        self._tokens = torch.zeros((), dtype=self.dtype, device=self.device)
        self._window_start = time.perf_counter()
        self._paused = 0.0
        self._file = None
        if self.is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # a resumed run keeps what was logged up to its checkpoint; a run starting at step 0
            # (a fresh start over its own stopped attempt) keeps nothing, so step 0 is not doubled
            rewind_jsonl(self.path, state.step if state.step > 0 else -1)
            self._file = open(self.path, "a", encoding="utf-8")
        if cfg.report_to == "wandb":  # W&B's convention: online when logged in, else offline
            output_dir = Path(cfg.output_dir).resolve()
            mode = wandb_mode()
            accelerator.init_trackers(cfg.wandb_project, config=config_to_dict(cfg), init_kwargs={
                "wandb": {"name": cfg.run_name or output_dir.name, "dir": str(output_dir),
                          "id": state.wandb_run_id, "resume": "allow", "mode": mode},
            })
            if self.is_main:
                announce_wandb_run(accelerator.get_tracker("wandb", unwrap=True), mode)
        self.bar = tqdm(total=state.total_steps, initial=state.step, desc="training", unit="step",
                        disable=not self.is_main, dynamic_ncols=True)

    def add(self, name: str, total, count=1) -> None:
        """Add ``total`` over ``count`` items to metric ``name`` (tensors stay on the device)."""
        sums = self._sums.get(name)
        if sums is None:
            sums = self._sums[name] = [torch.zeros((), dtype=self.dtype, device=self.device),
                                       torch.zeros((), dtype=self.dtype, device=self.device)]
        sums[0] += torch.as_tensor(total).detach().to(self.device, self.dtype).sum()
        sums[1] += torch.as_tensor(count).detach().to(self.device, self.dtype).sum()

    def count_tokens(self, n) -> None:
        """Tokens this process processed (e.g. ``attention_mask.sum()``), for tokens/s."""
        self._tokens += torch.as_tensor(n).detach().to(self.device, self.dtype).sum()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (evaluation, say) does not count against tokens/s."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - started

    def due(self, state: TrainState) -> bool:
        """Whether this step is a logging step (every ``log_every``)."""
        return state.step % self.every == 0

    def step(self, state: TrainState, force: bool = False, **scalars) -> dict | None:
        """After each optimizer step, on every process. On logging steps (every ``log_every``,
        or ``force``) reduces across processes, writes and returns the record; else None.

        ``scalars`` (say ``lr=...``) are logged as given, from the main process.
        """
        self.bar.update(1)
        if not force and state.step % self.every:
            return None
        names = sorted(self._sums)
        local = torch.stack([self._sums[n][0] for n in names] + [self._sums[n][1] for n in names]
                            + [self._tokens])
        if self.accelerator.num_processes > 1:
            local = self.accelerator.reduce(local, reduction="sum")
        values = local.tolist()
        elapsed = time.perf_counter() - self._window_start - self._paused
        record: dict = {"step": state.step}
        for i, name in enumerate(names):
            count = values[len(names) + i]
            record[name] = values[i] / count if count else None
        if values[-1] and elapsed > 0:
            record["tokens_per_s"] = values[-1] / elapsed
        record.update({k: float(v) if isinstance(v, torch.Tensor) else v
                       for k, v in scalars.items()})
        record["epoch"] = round(state.epoch, 6)
        record["samples"] = state.rows_seen
        record["tokens"] = state.tokens_seen
        self._sums = {}
        self._tokens = torch.zeros((), dtype=self.dtype, device=self.device)
        self._window_start, self._paused = time.perf_counter(), 0.0
        self.log(record)
        if self.is_main:
            shown = {k: f"{record[k]:.4g}" for k in ("loss", "accuracy") if record.get(k) is not None}
            if "tokens_per_s" in record:
                shown["tok/s"] = f"{record['tokens_per_s']:.0f}"
            self.bar.set_postfix(shown, refresh=False)
        return record

    def log(self, record: dict) -> None:
        """Write one record (it must hold ``step``) to metrics.jsonl and the trackers (main only)."""
        if not self.is_main:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        values = {k: v for k, v in record.items() if k != "step" and v is not None}
        self.accelerator.log(values, step=record["step"])

    def close(self) -> None:
        self.bar.close()
        if self._file is not None:
            self._file.close()
            self._file = None


def resolve_prompts_file(name: str) -> Path:
    """A prompts file as given, else relative to the repository (the bundled data/eval files)."""
    for candidate in (Path(name).expanduser(), _REPO / name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"eval_prompts file not found: {name} (looked in the current "
                            f"directory and in {_REPO}); give an existing file or set eval_every 0")


def share_batches(rows: int, accelerator: Accelerator, size: int,
                  lockstep: bool = False) -> list[list[int]]:
    """This process's share of ``rows`` evaluation rows (every ``num_processes``-th, from its
    index) in batches of ``size`` row indices. ``lockstep``: padded with empty batches up to the
    busiest process's count, for modules whose every forward needs all processes (sharded): the
    caller runs those on any row and counts nothing from them."""
    p, processes = accelerator.process_index, accelerator.num_processes
    mine = list(range(p, rows, processes))
    batches = [mine[start:start + size] for start in range(0, len(mine), size)]
    if lockstep:
        share = -(-rows // processes)  # process 0 holds the most rows
        most = -(-share // size)
        batches += [[] for _ in range(most - len(batches))]
    return batches


class PeriodicEval:
    """The skeleton of every periodic measurement a trainer makes while it trains.

    Every ``every`` optimizer steps (and at the end, and at step 0 when forced) each process
    measures its share of the evaluation data with the unwrapped module in eval mode, without
    gradients, under the accelerator's autocast and with the global random state forked (an
    evaluation never changes the training that follows: resumed runs stay exact); the float64
    sums of :meth:`measure` are added over processes and :meth:`summarise` turns them into a
    record, which the main process logs. No process waits while another evaluates alone.

    Subclasses set ``every`` and implement ``measure(module) -> (n,) float64 tensor`` and
    ``summarise(state, sums: list[float]) -> dict | None`` (None: nothing to log).
    """

    every: int = 0
    at_end: bool = True

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator

    def due(self, state: TrainState) -> bool:
        """Every ``every`` steps; at the last step only when ``at_end``, whatever the step."""
        if not self.every:
            return False
        return self.at_end if state.done else state.step % self.every == 0

    def measure(self, module) -> torch.Tensor:
        raise NotImplementedError

    def summarise(self, state: TrainState, sums: list[float]) -> dict | None:
        raise NotImplementedError

    def run(self, state: TrainState, model, metrics: MetricsLogger,
            log: bool = True) -> dict | None:
        """Measure now (every process calls it); returns the record on every process and logs
        it (unless ``log`` is false: the caller logs it with more)."""
        accelerator = self.accelerator
        module = accelerator.unwrap_model(model)
        was_training = module.training
        rng_devices = [accelerator.device] if accelerator.device.type == "cuda" else []
        started = time.perf_counter()
        with (metrics.paused(), torch.random.fork_rng(devices=rng_devices), torch.no_grad(),
              accelerator.autocast()):
            module.eval()
            try:
                sums = self.measure(module).to(accelerator.device, torch.float64)
            finally:
                module.train(was_training)
        if accelerator.num_processes > 1:
            sums = accelerator.reduce(sums, reduction="sum")
        record = self.summarise(state, sums.tolist())
        if record is not None:
            record.setdefault("step", state.step)
            record[f"{self.name}/seconds"] = round(time.perf_counter() - started, 3)
            if log:
                metrics.log(record)
            line = self.describe(record)
            if line and accelerator.is_main_process:
                metrics.bar.write(f"[draftsmith] step {state.step}: {line}")
        return record

    def maybe_run(self, state: TrainState, model, metrics: MetricsLogger,
                  force: bool = False) -> dict | None:
        """:meth:`run` when due (or ``force``); every process calls it at the same step."""
        if not self.every or not (force or self.due(state)):
            return None
        return self.run(state, model, metrics)

    name = "eval"

    def describe(self, record: dict) -> str:
        return ""


# the deepest tree any proposer drafts; per-depth counts are summed over processes in a vector
# of this length
MAX_DEPTH = 64


class AcceptanceEval(PeriodicEval):
    """Acceptance of the draft being trained, measured by the speculative engine as it trains.

    Every ``eval_every`` optimizer steps and at the end, every process builds a proposer from
    the current (unwrapped, eval-mode) module with ``make_proposer(module)`` and decodes its share
    of ``eval_num_prompts`` prompts of ``eval_prompts`` (chat template applied by the target) with
    :func:`draftsmith.eval.engine.measure_acceptance`; the counts are summed over processes, and tau, alpha
    and alpha per depth go to ``metrics`` as ``eval/...``.
    """

    name = "eval"

    def __init__(self, accelerator: Accelerator, cfg, target,
                 make_proposer: Callable[..., Proposer], name: str = "eval"):
        super().__init__(accelerator)
        self.name = name  # the records' prefix: <name>/tau, <name>/alpha, ...
        self.cfg = cfg
        self.target = target
        self.make_proposer = make_proposer
        self.every = cfg.eval_every
        self.prompts: list[list[int]] = []
        if not self.every:
            return
        # every process reads the file, so that a bad one fails everywhere instead of hanging
        texts = read_prompts(resolve_prompts_file(cfg.eval_prompts), limit=cfg.eval_num_prompts)
        self.prompts = [target.chat_ids(text) for text in texts]
        self.mine = self.prompts[accelerator.process_index::accelerator.num_processes]
        self.params = SamplingParams(temperature=cfg.eval_temperature)

    def measure(self, module) -> torch.Tensor:
        sums = torch.zeros(2 + 2 * MAX_DEPTH, dtype=torch.float64)
        if not self.mine:
            return sums
        # seeds follow the prompt's index in the whole list: the same figures on any number of
        # processes
        first = self.accelerator.process_index
        step = self.accelerator.num_processes
        for k, ids in enumerate(self.mine):
            result = measure_acceptance(
                self.target, self.make_proposer(module), [ids],
                max_new_tokens=self.cfg.eval_max_new_tokens, params=self.params,
                seed=self.cfg.seed + first + k * step)
            sums[0] += result["decode_tokens"]
            sums[1] += result["target_passes"]
            for offset, counts in ((2, result["accepted_per_depth"]),
                                   (2 + MAX_DEPTH, result["tried_per_depth"])):
                for depth, count in enumerate(counts[:MAX_DEPTH]):
                    sums[offset + depth] += count
        return sums

    def summarise(self, state: TrainState, sums: list[float]) -> dict:
        decode, passes = sums[0], sums[1]
        accepted, tried = sums[2:2 + MAX_DEPTH], sums[2 + MAX_DEPTH:]
        name = self.name
        record = {"step": state.step, f"{name}/tau": decode / passes if passes else None,
                  f"{name}/alpha": sum(accepted) / sum(tried) if sum(tried) else None}
        for depth, (a, t) in enumerate(zip(accepted, tried, strict=True), start=1):
            if t:
                record[f"{name}/alpha_depth_{depth}"] = a / t
        return record

    def describe(self, record: dict) -> str:
        tau = record[f"{self.name}/tau"]
        tau = "n/a" if tau is None else f"{tau:.3f}"
        return f"acceptance tau {tau} on {len(self.prompts)} prompts"
