"""Training configuration: a dataclass per method, YAML over its defaults, the command line on top.

Every training script declares one dataclass whose fields are its keys, each with one default and
a help text::

    @dataclass
    class EagleConfig:
        target: str = field(default="smollm2-135m", metadata={"help": "target name or directory"})
        lr: float = field(default=3e-4, metadata={"help": "peak learning rate"})
        layers: list[int] = field(default_factory=lambda: [2, 15, 28])

    cfg = parse_config(EagleConfig)  # reads sys.argv[1:]

and is launched as ``python train/eagle.py --config configs/eagle/smollm2.yaml --lr 1e-4``.
Precedence: dataclass default < YAML file < command line. Keys may be written ``--max_length`` or
``--max-length``, with the value after a space or an ``=``. An unknown key is an error that
names it and suggests the closest valid key; a value of the wrong type is an error that names the
key, the expected type and the value received. ``--help`` lists every key.

Supported field types: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, ``list[int]``,
``list[float]``, ``list[str]`` and ``Optional[...]`` of any of these. On the command line a list is
comma-separated (``--layers 2,15,28``; an empty value is an empty list; a list of strings
given as the name of an existing file is that one file, commas and all), a bool is one of
true/false/yes/no/1/0 (a bare ``--flag`` means true) and ``none``/``null`` sets an Optional to None.

Every trainer's dataclass subclasses :class:`TrainConfig`, which holds the keys they all share
(target, data, optimisation, checkpoints, tracking, evaluation); dataclass inheritance keeps one
default per key. Declare keys with :func:`option`, which also marks the keys that may change when a
run is resumed (``may_change_on_resume=True``, e.g. how often to log; every other key is
training-relevant and a resumed run refuses a checkpoint that used another value), and the
range of numbers a key accepts, checked when the config is built (at parse, before any target
loads)::

    @dataclass
    class EagleConfig(TrainConfig):
        layers: list[int] = option([2, 15, 28], "target hidden states the head reads")
        tree_nodes: int = option(60, "draft tree size at evaluation", may_change_on_resume=True,
                                 at_least=1)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from draftsmith.files.output_dir import write_atomic

C = TypeVar("C")

_TRUE = ("true", "yes", "1", "on")
_FALSE = ("false", "no", "0", "off")
_NONE = ("none", "null", "~")


def parse_config(cls: type[C], argv: Sequence[str] | None = None) -> C:
    """Build ``cls`` from its defaults, then ``--config FILE.yaml``, then ``--key value`` overrides.

    ``argv`` defaults to ``sys.argv[1:]``. ``--help``/``-h`` prints every key and exits.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(config_help(cls))
        raise SystemExit(0)
    config_file, overrides = _split_command_line(cls, argv)
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(_checked(cls, _read_yaml(config_file), source=config_file))
    values.update(_checked(cls, overrides, source="the command line"))
    return _instantiate(cls, values)


def config_from_dict(cls: type[C], values: Mapping[str, Any], source: str = "a dict") -> C:
    """``cls(**values)`` after checking every key and coercing/validating every value.

    ``source`` says where the values came from, for error messages (a file name, say).
    """
    return _instantiate(cls, _checked(cls, values, source))


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as a plain dict of its fields (lists copied), in declaration order."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise ValueError(f"expected a config dataclass instance, got {type(cfg).__name__}")
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


SAVED_HEADER = "# draftsmith: the resolved config of the run in this directory (draftsmith.train.config)\n"


def save_config(cfg: Any, path: str | os.PathLike) -> Path:
    """Write the config as YAML (readable back with ``--config``), atomically, under a header
    line that :func:`read_saved_config` recognises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, SAVED_HEADER + yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def read_saved_config(path: str | os.PathLike, cls: type) -> dict[str, Any] | None:
    """The values of a config that :func:`save_config` wrote for ``cls`` (its header, or, from an
    older draftsmith, exactly ``cls``'s keys); None for any other file (a user's own YAML)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(data, dict):
        return None
    if text.startswith(SAVED_HEADER) or set(data) == set(_dataclass_fields(cls)):
        return data
    return None


def config_diff(a: Any, b: Any, ignore: Sequence[str] = ()) -> list[str]:
    """Keys whose values differ between two configs (dataclasses or dicts, e.g. a saved YAML).

    A key present in only one of them counts as different. Used on resume: a run must continue
    with the config it started with, except for keys in ``ignore`` (say ``max_steps``).
    """
    da = a if isinstance(a, Mapping) else config_to_dict(a)
    db = b if isinstance(b, Mapping) else config_to_dict(b)
    keys = list(da) + [k for k in db if k not in da]
    missing = object()
    return [
        k for k in keys
        if k not in ignore and _plain(da.get(k, missing)) != _plain(db.get(k, missing))
    ]


def config_help(cls: type) -> str:
    """Every key with its type, default and help text, for ``--help``."""
    lines = [f"{cls.__name__} options (YAML keys or --key value; command line wins over YAML):"]
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        lines.insert(0, cls.__doc__.strip() + "\n")
    lines.append("  --config FILE.yaml    YAML file with any of the keys below")
    for name, f in _dataclass_fields(cls).items():
        kind = _type_name(_fields(cls)[name])
        if f.default is not dataclasses.MISSING:
            default = f"default: {f.default!r}"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"default: {f.default_factory()!r}"
        else:
            default = "required"
        lines.append(f"  --{name} {kind}  ({default})")
        if f.metadata.get("help"):
            lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


def _split_command_line(cls: type, argv: list[str]) -> tuple[str | None, dict[str, str | bool]]:
    """``--config`` and the ``--key value`` / ``--key=value`` pairs, values still strings."""
    fields = _fields(cls)
    config_file = None
    overrides: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ValueError(f"unexpected command-line argument {arg!r}: give options as "
                             f"--key value or --key=value (see --help)")
        name, has_value, value = arg[2:].partition("=")
        key = name.replace("-", "_")
        if not has_value:
            next_is_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if next_is_value:
                value = argv[i + 1]
                i += 1
            elif key in fields and _strip_optional(fields[key]) is bool:
                value = True  # a bare --flag switches a bool on
            else:
                raise ValueError(f"--{name} needs a value (--{name} VALUE or --{name}=VALUE)")
        i += 1
        if key == "config":
            if config_file is not None:
                raise ValueError(f"--config given twice ({config_file!r} and {value!r}); give one "
                                 f"YAML file and put further overrides on the command line")
            config_file = str(value)
        elif key not in fields:
            raise ValueError(_unknown_key_message(cls, key, "the command line"))
        else:
            overrides[key] = value
    return config_file, overrides


def _read_yaml(path: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"config file {path} is not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of key: value, "
                         f"got a {type(data).__name__}")
    return data


def _checked(cls: type, values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Every key known and every value of its field's type, or a ValueError naming the key.

    Strings are parsed as on the command line, so a YAML ``lr: 1e-4`` (which PyYAML reads as
    the string "1e-4") is still a float; other values must already have the field's type.
    """
    fields = _fields(cls)
    checked = {}
    for key, value in values.items():
        if key not in fields:
            raise ValueError(_unknown_key_message(cls, str(key), source))
        checked[key] = _coerce(key, value, fields[key], source)
    return checked


def _instantiate(cls: type[C], values: dict[str, Any]) -> C:
    missing = [
        name for name, f in _dataclass_fields(cls).items()
        if name not in values
        and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"missing required config key(s) {missing} for {cls.__name__}; "
                         f"set them in the YAML file or as --key value")
    return cls(**values)


def _unknown_key_message(cls: type, key: str, source: str) -> str:
    valid = list(_fields(cls))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"unknown config key {key!r} in {source}; {hint}"
            f"valid keys for {cls.__name__}: {', '.join(valid)}")


def _coerce(key: str, value: Any, hint: Any, source: str) -> Any:
    """``value`` converted to the field type ``hint``, or a ValueError naming key and type."""

    def wrong(detail: str = "") -> ValueError:
        return ValueError(f"config key {key!r} (from {source}) expects {_type_name(hint)}, "
                          f"got {value!r} ({type(value).__name__}){detail}")

    inner = _strip_optional(hint)
    if inner is not hint and (value is None or (isinstance(value, str) and value.lower() in _NONE)):
        return None
    origin = typing.get_origin(inner)
    if origin is Literal:
        choices = typing.get_args(inner)
        for choice in choices:
            if value == choice or (isinstance(value, str) and value == str(choice)):
                return choice
        raise wrong(f"; choose one of {list(choices)}")
    if origin is list:
        (element,) = typing.get_args(inner) or (str,)
        if isinstance(value, str) and element is str and Path(value).expanduser().exists():
            items: list[Any] = [value]  # a file whose name holds a comma is one item
        elif isinstance(value, str):
            items = [v.strip() for v in value.split(",")] if value.strip() else []
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise wrong()
        return [_coerce(f"{key}[{i}]", item, element, source) for i, item in enumerate(items)]
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise wrong("; use true/false, yes/no, 1/0 or on/off")
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise wrong() from None
        raise wrong()
    if inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise wrong() from None
        else:
            raise wrong()
        if not math.isfinite(number):
            raise wrong("; give a finite number")
        return number
    if inner is str:
        if isinstance(value, str):
            return value
        raise wrong("; quote it in YAML if you mean a string")
    raise TypeError(f"config field {key!r} has type {hint!r}, which draftsmith.train.config does not support")


def _strip_optional(hint: Any) -> Any:
    """``X`` for ``Optional[X]`` / ``X | None``; ``hint`` itself otherwise."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _type_name(hint: Any) -> str:
    inner = _strip_optional(hint)
    suffix = " or none" if inner is not hint else ""
    origin = typing.get_origin(inner)
    if origin is Literal:
        return "{" + ",".join(str(c) for c in typing.get_args(inner)) + "}" + suffix
    if origin is list:
        (element,) = typing.get_args(inner) or (str,)
        return f"list of {_type_name(element)} (comma-separated)" + suffix
    return getattr(inner, "__name__", str(inner)) + suffix


def _dataclass_fields(cls: type) -> dict[str, dataclasses.Field]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved type hint (works with ``from __future__ import annotations``)."""
    hints = typing.get_type_hints(cls)
    return {name: hints[name] for name in _dataclass_fields(cls)}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


# ------------------------------------------------------------------------------------------------
# The keys every trainer shares

_MAY_CHANGE = "may_change_on_resume"
_RANGE = "range"


@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers a key accepts: ``at_least`` / ``above`` a low end, ``at_most`` / ``below`` a high
    end (None: no bound there), and ``why`` the high end is there."""

    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    why: str = ""  # said when a value above the range is refused

    def too_low(self, value: float) -> bool:
        return ((self.at_least is not None and value < self.at_least)
                or (self.above is not None and not value > self.above))

    def too_high(self, value: float) -> bool:
        return ((self.at_most is not None and value > self.at_most)
                or (self.below is not None and not value < self.below))

    def __str__(self) -> str:
        low = [(op, v) for op, v in ((">=", self.at_least), (">", self.above)) if v is not None]
        high = [(op, v) for op, v in (("<=", self.at_most), ("<", self.below)) if v is not None]
        if low and high:  # an interval: [0, 1), (0, 1]
            (lop, lv), (hop, hv) = low[0], high[0]
            return (f"in {'[' if lop == '>=' else '('}{_number(lv)}, {_number(hv)}"
                    f"{']' if hop == '<=' else ')'}")
        return " and ".join(f"{op} {_number(v)}" for op, v in low + high)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def option(default: Any, help: str, *, may_change_on_resume: bool = False,
           at_least: float | None = None, above: float | None = None,
           at_most: float | None = None, below: float | None = None, why: str = "") -> Any:
    """A config key: its one default, its help text, whether a resumed run may change it, and the
    range of numbers it accepts (checked with the type when the config is built: a value out of
    range is refused at parse, before a target is loaded; :func:`check_ranges`).

    A list default is copied for every instance (``default_factory``).
    """
    metadata: dict[str, Any] = {"help": help, _MAY_CHANGE: may_change_on_resume}
    if any(v is not None for v in (at_least, above, at_most, below)):
        metadata[_RANGE] = Range(at_least, above, at_most, below, why)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_ranges(cfg: Any) -> None:
    """Every key declared with a range (:func:`option`) holds numbers within it (each element of
    a list; None, where a key allows it, has no range); a ValueError naming the key otherwise."""
    for f in dataclasses.fields(cfg):
        bounds = f.metadata.get(_RANGE)
        if bounds is None:
            continue
        value = getattr(cfg, f.name)
        for v in value if isinstance(value, list) else [value]:
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"config key {f.name!r} expects a number, got {v!r} "
                                 f"({type(v).__name__})")
            if bounds.too_low(v) or bounds.too_high(v):
                raise ValueError(f"config key {f.name!r} must be {bounds}, got {v}"
                                 + (f" ({bounds.why})" if bounds.why and bounds.too_high(v)
                                    else ""))


def may_change_on_resume(cfg_or_cls: Any) -> list[str]:
    """Keys a resumed run may set differently from its checkpoint (the rest must match)."""
    cls = cfg_or_cls if isinstance(cfg_or_cls, type) else type(cfg_or_cls)
    return [name for name, f in _dataclass_fields(cls).items() if f.metadata.get(_MAY_CHANGE)]


@dataclasses.dataclass
class LoraKeys:
    """LoRA adapters (peft): the keys of every recipe that trains through them (Medusa-2, a
    distilled draft with ``lora: true``)."""

    lora_r: int = option(16, "LoRA rank", at_least=1)
    lora_alpha: float = option(32.0, "LoRA alpha (the update is scaled by alpha / r)", above=0)
    lora_dropout: float = option(0.0, "dropout on the LoRA input", at_least=0, below=1)
    lora_target_modules: list[str] = option(
        ["all-linear"], "modules that get adapters: all-linear (every linear layer but the LM "
        "head) or names such as q_proj,v_proj")


@dataclasses.dataclass
class FeatureKeys:
    """The option group of a trainer whose draft reads the target's hidden states (EAGLE heads,
    block drafts): online in every step, or offline from the feature cache they share
    (``train/features.py``). Shared code reads it only from a config that declares it."""

    feature_mode: Literal["online", "offline"] = option(
        "online", "online: run the target inside every step; offline: once over the data into a "
        "feature cache, then train from disk (same batches; may change on resume)",
        may_change_on_resume=True)
    feature_cache_dir: str | None = option(
        None, "offline mode: the feature cache directory (none: <output_dir>/features); a cache "
        "written for the same target, head layers, dtype and data is reused (and finished if a "
        "run was interrupted), anything else is refused", may_change_on_resume=True)
    feature_dtype: Literal["bf16", "fp32"] = option(
        "bf16", "offline mode: the dtype the cache stores features in (bf16 halves the disk; "
        "the head reads them in its own precision)", may_change_on_resume=True)


@dataclasses.dataclass
class PackingKeys:
    """The option group of a trainer that can pack a micro-batch's rows into one row."""

    packing: bool = option(
        False, "lay the rows of a micro-batch end to end in one row (no padding; a token budget "
        "counts real tokens); every position attends within its own row, so the loss is the "
        "unpacked one")


@dataclasses.dataclass
class TrainConfig:
    """Keys shared by every draftsmith trainer (each script's config subclasses this)."""

    target: str = option(
        "smollm2-135m", "target: embedded name, Hugging Face directory or .gguf (a resume may name "
        "it by another path; its name, shapes and weights must stay those of the checkpoint)",
        may_change_on_resume=True)
    data: list[str] = option([], "training data: JSON/JSONL files or Hub dataset ids")
    max_length: int = option(2048, "longest training sequence in tokens (longer ones are cut)",
                             at_least=2)
    output_dir: str = option(
        "runs/train", "run directory: checkpoints/, artifact/, metrics.jsonl, config.yaml, wandb/",
        may_change_on_resume=True)
    seed: int = option(0, "seed for initialisation, data order, dropout and noise")
    shuffle: bool = option(True, "shuffle the data every epoch (seeded by seed and epoch)")

    learning_rate: float = option(
        3e-4, "peak learning rate (AdamW)", above=0, at_most=1,
        why="AdamW moves every weight by about the learning rate at each step, so a rate above 1 "
        "destroys the weights at once; drafts train at 1e-5 to 1e-3")
    weight_decay: float = option(0.0, "AdamW weight decay on matrices (not biases or norms)",
                                 at_least=0)
    adam_beta1: float = option(0.9, "AdamW beta1", at_least=0, below=1,
                               why="a moving-average coefficient; 1 never updates, torch refuses it")
    adam_beta2: float = option(0.95, "AdamW beta2", at_least=0, below=1,
                               why="a moving-average coefficient; 1 never updates, torch refuses it")
    warmup_steps: int = option(50, "optimizer steps of linear warmup from 0 to learning_rate",
                               at_least=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = option(
        "cosine", "learning rate after warmup: constant, or a decay to min_lr_ratio at the end")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of learning_rate",
                                 at_least=0, at_most=1)
    max_steps: int | None = option(
        1000, "optimizer steps to train (none: until num_epochs); the LR schedule spans them",
        may_change_on_resume=True, at_least=1)
    num_epochs: int | None = option(
        None, "passes over the data (none: until max_steps); the first limit reached ends training",
        may_change_on_resume=True, at_least=1)
    per_device_batch_size: int = option(
        8, "rows per process per micro-batch when max_tokens_per_batch is none (a resume may "
        "change it if the global batch, per_device_batch_size x processes x "
        "gradient_accumulation_steps, stays the same)", may_change_on_resume=True, at_least=1)
    max_tokens_per_batch: int | None = option(
        None, "token budget of a micro-batch, padding counted (rows x longest row): rows of "
        "similar length are grouped and each micro-batch filled up to it (none: fixed "
        "per_device_batch_size rows, padded to the longest)", at_least=2)
    gradient_accumulation_steps: int = option(
        1, "micro-batches per process per optimizer step (a resume may change it if processes x "
        "gradient_accumulation_steps stays the same)", may_change_on_resume=True, at_least=1)
    max_grad_norm: float = option(1.0, "clip the gradient norm to this (0: no clipping)",
                                  at_least=0)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = option(
        "auto", "auto: bf16 autocast on GPU (fp16 where bf16 is unsupported) and on a CPU with "
        "native bf16 instructions (AVX-512 BF16, AMX), no (fp32) elsewhere")
    loss_chunk_size: int = option(
        256, "positions per chunk of the large-vocabulary losses: the extra memory of a loss is "
        "about chunk x vocabulary x 4 bytes a few times, whatever the sequence length",
        at_least=1)
    gradient_checkpointing: bool = option(
        False, "recompute the trained module's activations in the backward pass instead of "
        "keeping them (less memory, about a third more compute)", may_change_on_resume=True)
    fused_attention_only: bool = option(
        False, "run every scaled_dot_product_attention of a step (the target's, the trained "
        "module's) in the fused kernels only (flash, memory-efficient, cuDNN): a step that would "
        "fall back to the math kernel, which materialises the whole score matrix, fails instead "
        "(a GPU check: scripts/gpu_check.sh)", may_change_on_resume=True)
    target_parallel: int = option(
        1, "processes that hold one copy of the frozen target between them (FSDP2 shards of its "
        "decoder layers, gathered one layer at a time; every process keeps its own batch): 1 = a "
        "whole copy per process; the GPUs of a node for a target that does not fit one GPU. It "
        "must divide the number of processes", may_change_on_resume=True, at_least=1)
    dist_timeout_minutes: float = option(
        60.0, "how long a process waits for the others at a collective before the run fails "
        "(NCCL's default is 10 minutes)", may_change_on_resume=True, above=0)

    save_every: int = option(
        500, "save a resumable checkpoint every N optimizer steps (0: only at the end)",
        may_change_on_resume=True, at_least=0)
    keep_checkpoints: int | None = option(
        2, "keep the newest N checkpoints (none: keep all)", may_change_on_resume=True,
        at_least=1)
    resume: str | None = option(
        None, "continue a run: 'latest' (the newest checkpoint in output_dir, or a fresh start "
        "when there is none), 'previous' (the one before the newest, when the newest is "
        "damaged) or a checkpoint directory", may_change_on_resume=True)
    overwrite: bool = option(
        False, "start in an output_dir that holds the results (artifact, metrics.jsonl) of an "
        "earlier run without checkpoints, replacing them", may_change_on_resume=True)

    log_every: int = option(10, "write metrics every N optimizer steps", may_change_on_resume=True,
                            at_least=1)
    report_to: Literal["none", "wandb"] = option(
        "none", "also log to Weights & Biases (online when logged in, else offline; WANDB_MODE "
        "decides when set)",
        may_change_on_resume=True)
    wandb_project: str = option("draftsmith", "W&B project name", may_change_on_resume=True)
    run_name: str | None = option(
        None, "run name for W&B (default: the output_dir's name)", may_change_on_resume=True)

    eval_every: int = option(
        500, "measure acceptance (tau) every N optimizer steps and at the end (0: never)",
        may_change_on_resume=True, at_least=0)
    eval_prompts: str = option(
        "data/eval/mt_bench_question.jsonl", "held-out prompts for the acceptance evaluation",
        may_change_on_resume=True)
    eval_num_prompts: int = option(8, "prompts per acceptance evaluation",
                                   may_change_on_resume=True, at_least=1)
    eval_max_new_tokens: int = option(64, "tokens generated per evaluation prompt",
                                      may_change_on_resume=True, at_least=1)
    eval_temperature: float = option(0.0, "sampling temperature of the evaluation (0: greedy)",
                                     may_change_on_resume=True, at_least=0)
    num_workers: int = option(0, "DataLoader worker processes", may_change_on_resume=True,
                              at_least=0)

    def __post_init__(self) -> None:
        """Range checks that name the key. Subclasses with their own checks call this first."""
        for f in dataclasses.fields(self):  # also when built directly, without parse_config
            value = getattr(self, f.name)
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise ValueError(f"config key {f.name!r} must be a finite number, got {value}")
        check_ranges(self)
        if self.max_steps is None and self.num_epochs is None:
            raise ValueError("config keys 'max_steps' and 'num_epochs' are both none: set at least "
                             "one, so that training ends")
        if self.resume is not None and not self.resume.strip():
            raise ValueError("config key 'resume' is empty: give 'latest', a checkpoint directory "
                             "or none")
