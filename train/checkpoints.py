"""Checkpoints: where training stands, saved atomically, verified and resumed exactly.

A resumed run continues *exactly* (its next losses equal an uninterrupted run's) because every
source of difference is pinned down: the seed (train/accelerator.py), the learning rate (a pure
function of the step, train/optimizer.py), the data order (a pure function of the seed, the epoch
and the rows, train/batches.py), and the trained module's weights, the optimizer and every
process's random state (dropout, noise), saved by ``accelerator.save_state``.

Layout under ``<output_dir>/checkpoints/``::

    step_<N>/          accelerate's state (model.safetensors, optimizer.bin, random_states_<i>.pkl)
                       and trainer_state.json: step, data position, the config, the target identity;
                       an FSDP2 run's module and optimizer are in dcp/ instead
                       (torch.distributed.checkpoint: loads at any number of processes)
    .step_<N>.tmp-save/  a save in progress, renamed to step_<N> once complete: a crash never
                       leaves a half-written "latest" (only a step_<N> holding trainer_state.json
                       counts)
    damaged-step_<N>/  a checkpoint found damaged when resuming from an older one (kept, not used)

Every directory here is written through files/output_dir.py and carries its ``.draftsmith``
marker (kind ``checkpoint``) from the moment it is made; saving and pruning delete or replace only
directories that carry it or are complete checkpoints, never anything else.

Before loading, every part of a checkpoint is checked (the weights' header, the optimizer state,
every process's random state, trainer_state.json); a damaged one is reported by name with the
previous complete checkpoint offered (``--resume previous``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import load as accelerate_load
from safetensors.torch import load_file

from draftsmith.files.file_formats import FileFormatError, read_json_object, safetensors_problem
from draftsmith.files.output_dir import (
    check_destination,
    check_writable_dir,
    commit_dir,
    named_paths,
    read_marker,
    refuse_inputs,
    remove_dir,
    stage_dir,
)
from draftsmith.heads.artifact import NonFiniteWeights, check_finite
from draftsmith.train.batches import BatchPlan
from draftsmith.train.config import (
    config_diff,
    config_to_dict,
    may_change_on_resume,
    read_saved_config,
    save_config,
)
from draftsmith.train.sharding import (
    DCP_DIR,
    FSDP2,
    REPLICATED,
    ShardingPlan,
    all_finite,
    dcp_digests,
    dcp_problems,
    load_sharded,
    save_sharded,
)

STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")
_RESULTS = ("artifact", "metrics.jsonl", "config.yaml")  # what a run writes beside checkpoints/
CHECKPOINT_KIND = "checkpoint"  # the draftsmith.files.output_dir marker kind of a checkpoint directory
# identity keys that say where the target was found, not what it is
_TARGET_LOCATION = ("path", "hub_id")


@dataclass
class TrainState:
    """Where training stands: optimizer steps done and what they consumed."""

    step: int  # optimizer steps done
    total_steps: int  # training ends here (max_steps, or num_epochs worth of steps)
    plan: BatchPlan
    wandb_run_id: str
    rows_seen: int = 0  # rows trained on, over every process
    tokens_seen: int = 0  # real (non-padding) tokens trained on, over every process
    resumed_from: Path | None = None

    @property
    def epoch(self) -> float:
        return self.plan.epoch_of(self.step)

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps


def data_fingerprint(plan: BatchPlan) -> str:
    """A digest of the rows' lengths and weights: the data a plan orders (checked on resume)."""
    digest = hashlib.sha256(json.dumps([plan.lengths, plan.weights]).encode())
    return digest.hexdigest()[:16]


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (``step_<N>`` holding trainer_state.json) in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (a ``checkpoints/`` folder), or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def read_checkpoint_state(path: str | os.PathLike) -> dict:
    """The trainer_state.json of a checkpoint directory (a damaged one is a
    :class:`draftsmith.files.file_formats.FileFormatError`)."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise ValueError(f"{path} is not a complete draftsmith checkpoint (no {STATE_FILE})")
    fix = "the checkpoint is damaged: resume from another one"
    recorded = read_json_object(file, fix=fix)
    if not isinstance(recorded.get("step"), int):
        raise FileFormatError(file, "records no step", fix)
    if recorded.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path} was written by a newer draftsmith (checkpoint format "
                         f"{recorded['format_version']} > {FORMAT_VERSION}); upgrade draftsmith")
    if recorded.get("format_version", 0) < FORMAT_VERSION:
        raise ValueError(f"{path} was written by an older draftsmith (checkpoint format "
                         f"{recorded.get('format_version', 0)} < {FORMAT_VERSION}), whose data "
                         f"order this version cannot reproduce; start a new run")
    return recorded


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """What is missing or unreadable in a checkpoint (empty: every part exists and loads).

    Checks trainer_state.json, the weights (every ``model*.safetensors`` header and tensor
    count), the optimizer state (a readable archive) and the random state of every process that
    saved it. The weights and optimizer are read fully by the resume itself; this catches a
    truncated or deleted file before anything is loaded.
    """
    path = Path(path)
    try:
        recorded = read_checkpoint_state(path)
    except ValueError as err:
        return [str(err)]
    problems = []
    if recorded.get("sharding") == FSDP2:  # the module and optimizer: torch.distributed.checkpoint
        problems += dcp_problems(path, recorded)
        weights = optimizers = []
    else:
        weights = sorted(path.glob("model*.safetensors"))
        optimizers = sorted(path.glob("optimizer*.bin"))
    if not weights and recorded.get("sharding") != FSDP2:
        problems.append("no model weights (model.safetensors)")
    for file in weights:
        problem = safetensors_problem(file)
        if problem:
            problems.append(f"{file.name} {problem}")
            continue
        try:
            check_finite(load_file(file), file.name, "the run had diverged when it was saved")
        except NonFiniteWeights as err:
            problems.append(str(err))
    if not optimizers and recorded.get("sharding") != FSDP2:
        problems.append("no optimizer state (optimizer.bin)")
    for file in optimizers:
        try:
            with zipfile.ZipFile(file) as archive:
                bad = archive.testzip()
            if bad is not None:
                raise ValueError(f"corrupt member {bad}")
        except (zipfile.BadZipFile, ValueError, OSError) as err:
            problems.append(f"{file.name} is unreadable ({err})")
    for i in range(int(recorded.get("num_processes", 1))):
        file = path / f"random_states_{i}.pkl"
        try:
            states = accelerate_load(file)
            if not {"random_state", "numpy_random_seed", "torch_manual_seed"} <= set(states):
                raise ValueError("random states missing")
        except Exception as err:  # noqa: BLE001 - torch.load raises many types on garbage
            problems.append(f"{file.name} (process {i}'s random state) is missing or unreadable "
                            f"({type(err).__name__}), so dropout and noise would not continue "
                            f"exactly")
    return problems


def resolve_checkpoint(root: Path, spec: str) -> Path | None:
    """The checkpoint ``spec`` names in ``root`` (a run's ``checkpoints/``): ``latest`` (None if there is none yet), ``previous`` (the
    one before the newest), a ``step_<N>`` directory, or a run directory / ``checkpoints``
    folder (its newest checkpoint)."""
    if spec == "latest":
        return latest_checkpoint(root)
    if spec == "previous":
        found = list_checkpoints(root)
        if len(found) < 2:
            raise ValueError(f"--resume previous: {root} holds "
                             f"{len(found)} complete checkpoint(s), no previous one")
        return found[-2]
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint to resume from not found: {spec}")
    if (path / STATE_FILE).is_file():
        return path
    newest = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
    if newest is None:
        raise ValueError(f"{spec} is neither a checkpoint (no {STATE_FILE}) nor a run "
                         f"directory holding checkpoints/step_<N>; give one of those, "
                         f"'latest' or 'previous'")
    return newest


def _layout_problem(recorded: dict, path: Path, layout: str) -> str | None:
    """Why a checkpoint cannot be resumed by a run that holds the trained module as ``layout``
    (DDP's whole module or FSDP2's shards), or None."""
    theirs = recorded.get("sharding", REPLICATED)
    if theirs == layout:
        return None
    if theirs == FSDP2:
        return (f"cannot resume from {path}: it holds the trained module as FSDP2 shards "
                f"({DCP_DIR}/) and this launch trains it whole (DDP or one process); resume "
                f"with accelerate launch --config_file configs/accelerate/fsdp2.yaml (any number "
                f"of processes), or start a new run in another --output_dir")
    return (f"cannot resume from {path}: it holds the trained module whole, as DDP trains it "
            f"(model.safetensors, optimizer.bin), and this launch shards it with FSDP2; resume "
            f"with configs/accelerate/multi_gpu.yaml (DDP), or start a new run in another "
            f"--output_dir")


def check_resume_layout(cfg, plan: ShardingPlan) -> None:
    """Refuse, before the target loads, a ``--resume`` checkpoint whose trained module is held
    another way than this launch trains it (FSDP2 shards vs DDP's whole module). Anything else
    wrong with it is reported later, by the :class:`Checkpointer`, with its context."""
    if cfg.resume is None:
        return
    try:
        path = resolve_checkpoint(Path(cfg.output_dir) / "checkpoints", cfg.resume)
        recorded = read_checkpoint_state(path) if path is not None else None
    except (ValueError, OSError):
        return
    problem = recorded and _layout_problem(recorded, path, plan.trained)
    if problem:
        raise ValueError(problem)


class Checkpointer:
    """Saves ``checkpoints/step_<N>`` atomically, prunes old ones, and resumes from them.

    Build it after ``accelerator.prepare`` (``resume`` loads into the prepared objects).
    ``target_identity`` is ``Target.identity()``: a checkpoint is refused by a run for another
    target (name, shapes, weights fingerprint; the target's ``path`` and ``hub_id`` may change). A
    fresh run refuses an ``output_dir`` that already holds checkpoints (continue it with
    ``--resume latest``) or the results of another run (an artifact or metrics.jsonl: replace them
    with ``--overwrite``), so that nothing a user has is replaced by accident; an ``output_dir``
    that cannot be written, or an ``artifact/`` there that is not an artifact, is refused before
    any training. Nothing is written before the run has been accepted: a refused resume changes no
    file.
    """

    def __init__(self, accelerator: Accelerator, cfg, target_identity: dict, plan: BatchPlan, *,
                 model=None, optimizer=None, sharded: bool = False):
        self.accelerator = accelerator
        self.model, self.optimizer = model, optimizer
        self.layout = FSDP2 if sharded else REPLICATED  # how checkpoints hold the module
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.root = self.output_dir / "checkpoints"
        self.plan = plan
        self.target_identity = dict(target_identity)
        self.last_saved_step: int | None = None
        # before any training: a run that cannot write its results fails now, not at its end
        check_writable_dir(self.output_dir, what="output_dir")
        # what the run writes never replaces one of its inputs (a data file, the target, ...)
        inputs = named_paths(*(v for key, value in config_to_dict(cfg).items()
                               if key not in ("output_dir", "resume")
                               for v in (value if isinstance(value, list) else [value])
                               if isinstance(v, str)))
        refuse_inputs([self.output_dir / name for name in (*_RESULTS, "checkpoints")], inputs,
                      into=False)
        check_destination(self.output_dir / "artifact", kind="artifact",
                          overwrite=bool(cfg.overwrite))
        saved = self.output_dir / "config.yaml"
        if saved.exists() and read_saved_config(saved, type(cfg)) is None:
            raise ValueError(
                f"output_dir {self.output_dir} holds a config.yaml that draftsmith did not write "
                f"(your own config?); the run writes its resolved config there, so it is never "
                f"replaced, not even with --overwrite: move it, or give another --output_dir")
        existing = latest_checkpoint(self.root)
        if cfg.resume is None and existing is not None:
            raise ValueError(
                f"output_dir {self.output_dir} already holds checkpoints (newest: {existing.name});"
                f" continue that run with --resume latest, or start a new one in another "
                f"--output_dir")
        if existing is None and cfg.resume in (None, "latest"):
            results = [name for name in _RESULTS if (self.output_dir / name).exists()]
            if results and not cfg.overwrite and not self._own_unfinished_start():
                raise ValueError(
                    f"output_dir {self.output_dir} holds the results of an earlier run "
                    f"({', '.join(results)}) but no checkpoint to continue from; starting here "
                    f"would replace them. Give another --output_dir, or --overwrite true to "
                    f"replace them")

    def _own_unfinished_start(self) -> bool:
        """Whether output_dir holds only what this very run wrote before a first checkpoint (it
        was stopped early): its config.yaml, with every training-relevant key as now, and
        metrics, but no artifact. Starting again then replaces nothing of another run's."""
        if (self.output_dir / "artifact").exists():
            return False
        saved = read_saved_config(self.output_dir / "config.yaml", type(self.cfg))
        if saved is None:
            return False
        changed = config_diff(self.cfg, saved, ignore=may_change_on_resume(self.cfg))
        return not [k for k in changed if not _names_same(saved.get(k), getattr(self.cfg, k))]

    def _fresh_state(self) -> TrainState:
        return TrainState(step=0, total_steps=self.plan.total_steps(self.cfg.max_steps,
                                                                      self.cfg.num_epochs),
                          plan=self.plan, wandb_run_id=secrets.token_hex(4))

    def resolve(self, spec: str) -> Path | None:
        """The checkpoint ``spec`` names (:func:`resolve_checkpoint`)."""
        return resolve_checkpoint(self.root, spec)

    def check_compatible(self, recorded: dict, path: Path) -> None:
        """Refuse a checkpoint this run cannot continue exactly, naming what differs."""
        problem = _layout_problem(recorded, path, self.layout)
        if problem:
            raise ValueError(problem)
        cls = type(self.cfg).__name__
        if recorded.get("config_class") != cls:
            raise ValueError(f"{path} was written by a trainer configured with "
                             f"{recorded.get('config_class')}, not {cls}: resume it with the "
                             f"trainer that wrote it")
        changed = [k for k in config_diff(self.cfg, recorded["config"],
                                          ignore=may_change_on_resume(self.cfg))
                   if not _names_same(recorded["config"].get(k), getattr(self.cfg, k, None))]
        if changed:
            mine = config_to_dict(self.cfg)
            detail = "; ".join(f"{k}: {recorded['config'].get(k)!r} in the checkpoint, "
                               f"{mine.get(k)!r} now" for k in changed)
            raise ValueError(
                f"cannot resume from {path}: training-relevant config key(s) "
                f"{', '.join(map(repr, changed))} changed ({detail}); set them back to continue "
                f"this run, or start a new run in another --output_dir")
        theirs = recorded.get("target", {})
        # where the target lives may change (a moved directory); what it is may not. A key the
        # checkpoint lacks (written before weights_fingerprint existed) has nothing to compare.
        wrong = [k for k in sorted(theirs) if k not in _TARGET_LOCATION
                 and theirs[k] != self.target_identity.get(k)]
        if wrong:
            detail = "; ".join(f"{k}: {theirs.get(k)!r} there, {self.target_identity.get(k)!r} "
                               f"here" for k in wrong)
            where = theirs.get("path") or theirs.get("hub_id")
            raise ValueError(f"cannot resume from {path}: it was trained for another target "
                             f"({detail}); resume with the target it was trained for"
                             + (f" ({where})" if where else ""))
        theirs, mine = recorded["batches"], self.plan.budget
        if _step_rows(theirs) != _step_rows(mine):
            raise ValueError(
                f"cannot resume from {path} exactly: each optimizer step took "
                f"{_describe_step(theirs)} then and would take {_describe_step(mine)} now; "
                f"keep max_tokens_per_batch, and keep per_device_batch_size x processes x "
                f"gradient_accumulation_steps (with a token budget: processes x "
                f"gradient_accumulation_steps) as they were")
        if recorded["dataset_rows"] != len(self.plan.lengths):
            raise ValueError(
                f"cannot resume from {path}: the training data had {recorded['dataset_rows']} "
                f"rows then and {len(self.plan.lengths)} now, so the data order would differ; "
                f"resume with the same data (and max_length), or start a new run")
        if recorded["data"] != data_fingerprint(self.plan):
            raise ValueError(
                f"cannot resume from {path}: the training data changed (the same number of "
                f"rows, {len(self.plan.lengths)}, but rows of other lengths), so the batches "
                f"would differ; resume with the same data (and max_length), or start a new run")

    def _checked(self, path: Path) -> None:
        problems = checkpoint_problems(path)
        if not problems:
            return
        older = [p for p in list_checkpoints(path.parent) if step_of(p) < step_of(path)
                 and not checkpoint_problems(p)] if _STEP_DIR.match(path.name) else []
        offer = (f"resume from the previous complete checkpoint with --resume previous "
                 f"({older[-1]}) or --resume {older[-1]}" if older else
                 "no older complete checkpoint is left; start a new run")
        raise ValueError(f"checkpoint {path} is damaged: {'; '.join(problems)}. {offer}")

    def _set_aside_newer(self, recorded: dict, path: Path) -> None:
        """Newer checkpoints: refused if complete (another continuation), kept aside if damaged."""
        newer = [p for p in list_checkpoints(self.root) if step_of(p) > recorded["step"]]
        intact = [p.name for p in newer if not checkpoint_problems(p)]
        if intact:
            raise ValueError(
                f"cannot resume from {path} into {self.output_dir}: it holds newer complete "
                f"checkpoints ({', '.join(intact)}) of another continuation, which 'latest' "
                f"would pick up later; resume into a new --output_dir")
        if self.accelerator.is_main_process:
            for damaged in newer:
                aside = damaged.with_name(f"damaged-{damaged.name}")
                count = 1
                while aside.exists() or aside.is_symlink():  # an earlier one is kept too
                    count += 1
                    aside = damaged.with_name(f"damaged-{damaged.name}-{count}")
                os.replace(damaged, aside)
                self.accelerator.print(f"[draftsmith] damaged checkpoint {damaged} kept as "
                                       f"{aside}")
        self.accelerator.wait_for_everyone()

    def _accept(self) -> None:
        """The run is accepted: now (and only now) its files may be written."""
        if self.accelerator.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.output_dir / "config.yaml")
        self.accelerator.wait_for_everyone()

    def resume(self) -> TrainState:
        """A fresh state (``cfg.resume`` none), or the loaded state of the checkpoint it names."""
        spec = self.cfg.resume
        if spec is None:
            self._accept()
            return self._fresh_state()
        if self.model is None and not self.accelerator._models:
            raise ValueError("Checkpointer.resume() loads into the prepared model and optimizer: "
                             "call it after accelerator.prepare(model, optimizer)")
        path = self.resolve(spec)
        if path is None:
            self.accelerator.print(f"[draftsmith] --resume latest: no checkpoint in {self.root} "
                                   f"yet, starting at step 0")
            self._accept()
            return self._fresh_state()
        self._checked(path)
        recorded = read_checkpoint_state(path)
        self.check_compatible(recorded, path)
        self._set_aside_newer(recorded, path)
        if recorded.get("num_processes") != self.accelerator.num_processes:
            self.accelerator.print(
                f"[draftsmith] {path} was saved by {recorded.get('num_processes')} process(es), "
                f"this run has {self.accelerator.num_processes}: data order and learning rate "
                f"continue exactly, random streams (dropout, noise) do not")
        self._accept()
        self.accelerator.load_state(str(path))  # DDP's module and optimizer; random states
        if self.layout == FSDP2:
            load_sharded(self.model, self.optimizer, path, recorded)
        self.last_saved_step = recorded["step"]
        state = self._fresh_state()
        state.step = recorded["step"]
        state.rows_seen = recorded["rows_seen"]
        state.tokens_seen = recorded["tokens_seen"]
        state.wandb_run_id = recorded.get("wandb_run_id") or state.wandb_run_id
        state.resumed_from = path
        self.accelerator.print(f"[draftsmith] resumed from {path}: step {state.step} of "
                               f"{state.total_steps}, epoch {state.epoch:.2f}")
        return state

    def due(self, state: TrainState) -> bool:
        """Whether ``save_every`` asks for a checkpoint after this step."""
        return bool(self.cfg.save_every) and state.step % self.cfg.save_every == 0

    def save(self, state: TrainState) -> Path:
        """Write ``checkpoints/step_<N>`` atomically (every process must call it), then prune.

        The main process stages a marked directory (:func:`draftsmith.files.output_dir.stage_dir`), every
        process saves its part of the state into it, trainer_state.json is written last, and
        :func:`draftsmith.files.output_dir.commit_dir` fsyncs it and renames it into place.
        """
        final = self.root / f"step_{state.step}"
        if self.last_saved_step == state.step:
            return final
        accelerator = self.accelerator
        diverged = ("the training diverged: lower learning_rate (or set max_grad_norm) and "
                    "continue from the last checkpoint"
                    + (f" (step {self.last_saved_step}) with --resume latest"
                       if self.last_saved_step else " (none was saved): start again"))
        for model in accelerator._models:  # a diverged run saves nothing it could resume into
            check_finite(accelerator.unwrap_model(model).state_dict(),
                         f"checkpoint step_{state.step} was not saved", diverged)
        if self.layout == FSDP2 and not all_finite(self.model):
            raise NonFiniteWeights(f"checkpoint step_{state.step} was not saved: weights hold "
                                   f"NaN or infinite values; {diverged}")
        tmp = self.root / f".{final.name}.tmp-save"
        if accelerator.is_main_process:
            stage_dir(final, kind=CHECKPOINT_KIND, name=tmp.name, marker={"step": state.step})
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        if self.layout == FSDP2:
            save_sharded(self.model, self.optimizer, tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            record = {"sharding": self.layout,
                "format_version": FORMAT_VERSION, "step": state.step, "epoch": state.epoch,
                "rows_seen": state.rows_seen, "tokens_seen": state.tokens_seen,
                "batches": self.plan.budget, "dataset_rows": len(self.plan.lengths),
                "data": data_fingerprint(self.plan),
                "num_processes": accelerator.num_processes, "wandb_run_id": state.wandb_run_id,
                "config_class": type(self.cfg).__name__, "config": config_to_dict(self.cfg),
                "target": self.target_identity,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            if self.layout == FSDP2:  # what torch will read back (a pickle among it), verified
                record["dcp"] = dcp_digests(tmp)
            # written last: its presence is what marks a checkpoint complete
            (tmp / STATE_FILE).write_text(json.dumps(record, indent=2))
            # a step_<N> that is neither marked nor complete is someone else's: refused
            commit_dir(tmp, final, kind=CHECKPOINT_KIND, overwrite=_is_checkpoint(final))
            self.prune()
        accelerator.wait_for_everyone()
        self.last_saved_step = state.step
        return final

    def prune(self) -> None:
        """Keep the newest ``keep_checkpoints``; remove leftovers of interrupted saves.

        Only directories that are draftsmith's checkpoints are deleted: complete ones
        (trainer_state.json) and marked leftovers (``.step_<N>.tmp-*``, ``.step_<N>.old-*``).
        """
        for child in self.root.iterdir():
            if child.name.startswith(".step_"):
                try:
                    remove_dir(child, kind=CHECKPOINT_KIND)  # marked, or empty
                except (ValueError, OSError):
                    continue  # not ours, or already gone: left as it is
        keep = self.cfg.keep_checkpoints
        if keep is not None:
            for old in list_checkpoints(self.root)[:-keep]:
                shutil.rmtree(old)


def _is_checkpoint(path: Path) -> bool:
    """A directory draftsmith may replace or delete as a checkpoint: complete or marked."""
    if path.is_symlink() or not path.is_dir():
        return False
    return (path / STATE_FILE).is_file() or \
        (read_marker(path) or {}).get("kind") == CHECKPOINT_KIND


def _names_same(a, b) -> bool:
    """Two config values equal up to how the files they name are spelled (``x.jsonl``,
    ``./x.jsonl``, ``/abs/x.jsonl``: resolved here)."""
    def named(value) -> list:
        values = value if isinstance(value, list) else [value]
        return [str(Path(v).expanduser().resolve())
                if isinstance(v, str) and v and Path(v).expanduser().exists() else v
                for v in values]
    return named(a) == named(b)


def _step_rows(budget: dict) -> tuple:
    """What one optimizer step takes from the plan; equal values give the same steps' rows."""
    micro = budget["num_processes"] * budget["accumulation"]
    if budget["max_tokens_per_batch"] is not None:
        return ("tokens", budget["max_tokens_per_batch"], micro)
    return ("rows", budget["per_device_batch_size"] * micro)


def _describe_step(budget: dict) -> str:
    micro = budget["num_processes"] * budget["accumulation"]
    size = (f"up to {budget['max_tokens_per_batch']} tokens"
            if budget["max_tokens_per_batch"] is not None
            else f"{budget['per_device_batch_size']} rows")
    return (f"{micro} micro-batches of {size} ({budget['num_processes']} processes x "
            f"{budget['accumulation']} accumulation steps)")
