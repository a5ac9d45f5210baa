"""Conversations -> token ids + loss masks, shared by every trainer; prompts and self-distillation.

Sources are local JSON / JSONL files (a JSON array of rows, or one JSON object per line) or
Hugging Face Hub datasets (``org/name``, ``org/name:split`` or ``org/name:config:split``; the
split defaults to ``train``; this needs the network or a warm ``datasets`` cache). The format of
a source is detected from the keys of its first row; every row becomes a list of chat messages
``[{"role": "system" | "user" | "assistant", "content": str}, ...]``:

==============  ======================================================================
messages        ``messages``: [{role, content}] (OpenAI style)
sharegpt        ``conversations``: [{from, value}], from = human/user, gpt/assistant, system
self-instruct   ``instruction``, ``instances``: [{input, output}] (the first instance is used)
alpaca          ``instruction``, ``input`` (optional), ``response`` or ``output`` (optional)
question-answer ``question``, ``answer`` (optional), as in GSM8K
mbpp            ``text``, ``test_list`` (shown to the model as in the MBPP paper), ``code``
==============  ======================================================================

Rows that cannot be used (no assistant turn for training, an unknown role, empty content, a value
of the wrong type) are never dropped silently: they are counted per reason with example row
numbers (counting from 0) in a :class:`DataReport`, which the trainers log. So are sequences
truncated to ``max_length``.

Token conventions (what :func:`collate_causal_lm` returns, all ``(batch, seq)``, right-padded):

* ``input_ids``: the conversation rendered with the target's chat template, then ``pad_token_id``;
* ``attention_mask``: 1 on real tokens, 0 on padding;
* ``loss_mask``: 1 exactly on the tokens of assistant turns (their content and the end-of-turn
  token that closes them, such as ``<|im_end|>``), 0 on system/user turns, template markup and
  padding. ``loss_mask[b, t] = 1`` means token ``t`` is one the model must predict from the
  positions ``< t``: the logits at ``t - 1`` are scored against ``input_ids[b, t]``, so a
  next-token loss is ``ce(logits[:, :-1], input_ids[:, 1:])`` weighted by ``loss_mask[:, 1:]``;
* ``labels``: ``input_ids`` with -100 where ``loss_mask`` is 0, unshifted, as Hugging Face models
  expect (they shift internally).

Tokenised datasets are cached under ``<draftsmith cache>/data/<key>/`` (``~/.cache/draftsmith``
unless ``$DRAFTSMITH_CACHE`` or ``$XDG_CACHE_HOME`` says otherwise), ``key`` being a hash of the
sources' contents, the tokenizer, its chat template and ``max_length``: a rerun loads the arrow
files and the report instead of tokenising again. The first process to ask tokenises (with
``num_proc`` worker processes); the others wait on a file lock and read what it wrote, so the
ranks of a distributed run tokenise once between them.

Self-distillation: :func:`regenerate` lets the target answer every user turn of the prompts
itself, through ``transformers`` in this process (``--backend hf``) or any OpenAI-compatible
server (``--backend openai``), sharded over processes and resumable, and writes the
conversations as JSONL (``messages`` format) that :func:`load_sft_dataset` reads back::

    python -m train.data regenerate --target smollm2-135m --data a.json b.jsonl \\
        --out answers.jsonl --max-new-tokens 512 --temperature 0.7 --batch-size 16
    python -m train.data regenerate --backend openai --url http://127.0.0.1:8000/v1 \\
        --model NAME --target TARGET --data a.json --out answers.jsonl --concurrency 64
    torchrun --nproc_per_node 8 -m train.data regenerate --target TARGET --data a.json \\
        --out answers.jsonl          # one shard per process, merged when the last one ends
    python -m train.data regenerate ... --shard 3/8   # shard 3 of 8 (counting from 0)
    python -m train.data merge --out answers.jsonl    # join answers.shard-I-of-N.jsonl
    python -m train.data inspect --target smollm2-135m --data answers.jsonl
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import fcntl
import hashlib
import http.client
import json
import math
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from jinja2.exceptions import TemplateError
from tqdm.auto import tqdm

from heads.file_formats import FileFormatError
from heads.target import Target, cache_root

ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
         "assistant": "assistant"}
# Bump when the tokenisation below changes, so that old caches are not reused.
CACHE_VERSION = "1"
_REPORT_FILE = "report.json"


class RowError(ValueError):
    """A row (or conversation) that cannot be used, with the reason the report shows."""


# ------------------------------------------------------------------------------------------------
# Reports


@dataclass
class SourceReport:
    """What happened to the rows of one source. Row numbers count from 0."""

    name: str
    format: str
    rows: int = 0
    used: int = 0
    skipped: dict[str, list[int]] = field(default_factory=dict)  # reason -> row numbers
    truncated: list[int] = field(default_factory=list)
    tokens: int = 0  # after truncation
    assistant_tokens: int = 0

    def skip(self, row: int, reason: str) -> None:
        self.skipped.setdefault(reason, []).append(row)

    @property
    def num_skipped(self) -> int:
        return sum(len(rows) for rows in self.skipped.values())

    def lines(self, max_length: int | None) -> list[str]:
        lines = [f"{self.name} ({self.format}): {self.rows} rows, {self.used} used"
                 + (f", {self.tokens:,} tokens ({self.assistant_tokens:,} on assistant turns)"
                    if self.tokens else "")]
        if self.skipped:
            reasons = ", ".join(f"{len(rows)} with {reason} (rows {_examples(rows)})"
                                for reason, rows in self.skipped.items())
            lines.append(f"  skipped {self.num_skipped} rows of {self.name}: {reasons}")
        if self.truncated:
            lines.append(f"  truncated {len(self.truncated)} rows of {self.name} to max_length "
                         f"{max_length} (rows {_examples(self.truncated)})")
        return lines


@dataclass
class DataReport:
    """Per-source counts of rows read, used, skipped (by reason) and truncated.

    Trainers log ``summary()`` (text) and ``totals()`` (numbers).
    """

    sources: dict[str, SourceReport] = field(default_factory=dict)
    max_length: int | None = None

    def summary(self) -> str:
        lines = [line for source in self.sources.values() for line in source.lines(self.max_length)]
        totals = self.totals()
        lines.append(f"total: {totals['rows']} rows, {totals['used']} used, {totals['skipped']} "
                     f"skipped, {totals['truncated']} truncated (row numbers count from 0)")
        if any("no assistant turn" in s.skipped for s in self.sources.values()):
            lines.append("rows with no assistant turn can be answered by the target itself: "
                         "python -m train.data regenerate --help")
        return "\n".join(lines)

    def totals(self) -> dict[str, int]:
        """Counts summed over sources, for metrics."""
        sources = self.sources.values()
        return {
            "rows": sum(s.rows for s in sources),
            "used": sum(s.used for s in sources),
            "skipped": sum(s.num_skipped for s in sources),
            "truncated": sum(len(s.truncated) for s in sources),
            "tokens": sum(s.tokens for s in sources),
            "assistant_tokens": sum(s.assistant_tokens for s in sources),
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> DataReport:
        sources = {name: SourceReport(**s) for name, s in data["sources"].items()}
        return cls(sources=sources, max_length=data["max_length"])


def _examples(rows: list[int], shown: int = 5) -> str:
    return ", ".join(map(str, rows[:shown])) + (", ..." if len(rows) > shown else "")


# ------------------------------------------------------------------------------------------------
# Reading sources and normalising rows to chat messages


def _text(row: Mapping, key: str, required: bool = True) -> str | None:
    """``row[key]`` as a string; None when it is optional and absent (or null)."""
    if key not in row:
        if required:
            raise RowError(f"missing key {key!r}")
        return None
    value = row[key]
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise RowError(f"wrong type: {key!r} is {type(value).__name__}, expected str")
    return value


def _list(row: Mapping, key: str) -> list:
    if key not in row:
        raise RowError(f"missing key {key!r}")
    if not isinstance(row[key], list):
        raise RowError(f"wrong type: {key!r} is {type(row[key]).__name__}, expected list")
    return row[key]


def _turns(row: Mapping, key: str, role_key: str, content_key: str) -> list[dict]:
    messages = []
    for turn in _list(row, key):
        if not isinstance(turn, dict):
            raise RowError(f"wrong type: a turn is {type(turn).__name__}, expected an object")
        role = _text(turn, role_key)
        if role not in ROLES:
            raise RowError(f"unknown role {role!r}")
        messages.append({"role": ROLES[role], "content": _text(turn, content_key)})
    return messages


def _joined(instruction: str, extra: str | None) -> str:
    return f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction


def _exchange(prompt: str, answer: str | None) -> list[dict]:
    messages = [{"role": "user", "content": prompt}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return messages


def _from_messages(row: Mapping) -> list[dict]:
    return _turns(row, "messages", "role", "content")


def _from_sharegpt(row: Mapping) -> list[dict]:
    return _turns(row, "conversations", "from", "value")


def _from_self_instruct(row: Mapping) -> list[dict]:
    instances = _list(row, "instances")
    if not instances:
        return _exchange(_text(row, "instruction"), None)
    # The instances of a seed task are examples of one task: one conversation per task keeps
    # the task mix as the file has it.
    if not isinstance(instances[0], dict):
        raise RowError(f"wrong type: an instance is {type(instances[0]).__name__}, expected object")
    first = instances[0]
    prompt = _joined(_text(row, "instruction"), _text(first, "input", required=False))
    return _exchange(prompt, _text(first, "output", required=False))


def _from_alpaca(row: Mapping) -> list[dict]:
    prompt = _joined(_text(row, "instruction"), _text(row, "input", required=False))
    answer_key = "response" if "response" in row else "output"
    return _exchange(prompt, _text(row, answer_key, required=False))


def _from_question_answer(row: Mapping) -> list[dict]:
    return _exchange(_text(row, "question"), _text(row, "answer", required=False))


def _from_mbpp(row: Mapping) -> list[dict]:
    tests = _list(row, "test_list")
    if not all(isinstance(t, str) for t in tests):
        raise RowError("wrong type: 'test_list' must be a list of strings")
    prompt = f"{_text(row, 'text')}\nYour code should pass these tests:\n\n" + "\n".join(tests)
    return _exchange(prompt, _text(row, "code", required=False))


@dataclass(frozen=True)
class _Format:
    keys: frozenset[str]  # a row having all of these is taken to be in this format
    convert: Callable[[Mapping], list[dict]]
    description: str


# Checked in order: the first format whose keys the first row has wins.
FORMATS = {
    "messages": _Format(frozenset({"messages"}), _from_messages, "messages: [{role, content}]"),
    "sharegpt": _Format(frozenset({"conversations"}), _from_sharegpt,
                        "conversations: [{from, value}]"),
    "self-instruct": _Format(frozenset({"instruction", "instances"}), _from_self_instruct,
                             "instruction, instances: [{input, output}]"),
    "alpaca": _Format(frozenset({"instruction"}), _from_alpaca,
                      "instruction, input?, response|output?"),
    "question-answer": _Format(frozenset({"question"}), _from_question_answer,
                               "question, answer?"),
    "mbpp": _Format(frozenset({"text", "test_list"}), _from_mbpp, "text, test_list, code?"),
}


def _check_conversation(messages: list[dict]) -> list[dict]:
    if not messages:
        raise RowError("an empty conversation")
    if any(not m["content"].strip() for m in messages):
        raise RowError("empty content")
    roles = [m["role"] for m in messages]
    if "assistant" in roles and roles.index("assistant") < (
        roles.index("user") if "user" in roles else len(roles)
    ):
        raise RowError("an assistant turn before any user turn")
    return messages


def _source_list(sources: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    listed = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    names = [str(s) for s in listed]
    if not names:
        raise ValueError("no data sources given: pass JSON/JSONL files or Hub dataset ids")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"data sources given more than once: {repeated}")
    return names


def _is_local(source: str) -> bool:
    path = Path(source).expanduser()
    return (path.exists() or path.suffix in (".json", ".jsonl")
            or source.startswith((".", "/", "~")) or source.count("/") > 1)


def _hub_dataset(source: str) -> datasets.Dataset:
    name, *rest = source.split(":")
    if len(rest) > 2:
        raise ValueError(f"Hub dataset {source!r}: expected org/name, org/name:split or "
                         f"org/name:config:split")
    config, split = (rest if len(rest) == 2 else [None, rest[0] if rest else "train"])
    return datasets.load_dataset(name, config, split=split)


def _local_path(source: str) -> Path:
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {source}")
    if not path.is_file():
        raise ValueError(f"data source {source} is a directory; give the JSON/JSONL files in it")
    return path


def _read_rows(source: str) -> Sequence:
    """The rows of a source: a list from a local file, a ``datasets.Dataset`` from the Hub."""
    if not _is_local(source):
        return _hub_dataset(source)
    path = _local_path(source)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise FileFormatError(path, f"is not UTF-8 text (byte {err.start}, line {line}, is "
                              f"{data[err.start]:#04x})", "save it as UTF-8 (e.g. iconv -f "
                              "latin1 -t utf-8) or remove the row") from None
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise FileFormatError(path, f"is not valid JSON at line {err.lineno}, column "
                                  f"{err.colno} ({err.msg})", "fix that line, or give one JSON "
                                  "object per line (JSONL)") from None
    rows = []
    # JSONL lines end at \n only: str.splitlines() would also split inside strings holding
    # U+2028, U+0085 and the like, which json.dumps(ensure_ascii=False) writes raw
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise FileFormatError(path, f"line {lineno} is not valid JSON ({err.msg})",
                                  "expected a JSON array of rows or one JSON object per line "
                                  "(JSONL)") from None
    return rows


def _detect_format(source: str, rows: Sequence) -> str:
    first = next((row for row in rows if isinstance(row, dict)), None)
    if first is None:
        raise ValueError(f"{source}: no rows (JSON objects) found")
    for name, fmt in FORMATS.items():
        if fmt.keys <= first.keys():
            return name
    accepted = "; ".join(f"{name} ({fmt.description})" for name, fmt in FORMATS.items())
    raise ValueError(f"{source}: rows have keys {sorted(first)}, which match no known format; "
                     f"accepted formats: {accepted}")


def read_conversations(
    sources: str | os.PathLike | Iterable[str | os.PathLike],
) -> tuple[list[dict], DataReport]:
    """Every usable row of every source as ``{"messages", "source", "row"}``, and the report.

    Rows without an assistant turn are kept (they are prompts); the callers decide what to do
    with them. The report's ``used`` counts are left to the callers too.
    """
    report = DataReport()
    conversations = []
    for source in _source_list(sources):
        rows = _read_rows(source)
        fmt = _detect_format(source, rows)
        counts = report.sources[source] = SourceReport(source, fmt)
        for index, row in enumerate(rows):
            counts.rows += 1
            try:
                if not isinstance(row, dict):
                    raise RowError(f"wrong type: row is {type(row).__name__}, expected an object")
                messages = _check_conversation(FORMATS[fmt].convert(row))
            except RowError as err:
                counts.skip(index, str(err))
                continue
            conversations.append({"messages": messages, "source": source, "row": index})
    return conversations, report


# ------------------------------------------------------------------------------------------------
# Tokenisation and loss masks


def end_of_turn_ids(tokenizer) -> set[int]:
    """Special tokens: the first one after an assistant's content closes its turn."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {i for i, tok in decoder.items() if tok.special}


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as err:
        raise RowError(f"a chat template error ({err})") from None


def tokenize_conversation(
    messages: list[dict], tokenizer, max_length: int | None = None,
    end_ids: set[int] | None = None,
) -> dict:
    """``input_ids`` and ``loss_mask`` of one conversation (truncated to ``max_length``).

    The assistant spans are found without knowing the template's markers: rendering the
    conversation up to an assistant turn with the generation prompt, then through that turn,
    gives the characters the turn adds; the tokens starting inside them are masked in, up to and
    including the first special token after the content (the end-of-turn marker). Tokenising the
    whole text once, with offsets, keeps the ids identical to what the template alone produces.
    Raises :class:`RowError` when the template is not prefix-stable (a prefix renders as
    something other than the start of the whole) or no assistant token is left after truncation.

    Returns ``input_ids`` and ``loss_mask`` (lists of length ``length``), ``num_tokens`` (before
    truncation) and ``assistant_tokens``.
    """
    end_ids = end_of_turn_ids(tokenizer) if end_ids is None else end_ids
    text = _render(tokenizer, messages)
    spans = []  # character offsets: (turn starts, its content ends, turn ends)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise RowError("a chat template that is not prefix-stable")
        content = message["content"].strip()
        found = through.find(content, len(before))
        spans.append((len(before), found + len(content) if found >= 0 else len(before),
                      len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"])
    starts = [start for start, _ in encoded["offset_mapping"]]
    loss_mask = [0] * len(input_ids)
    for turn_start, content_end, turn_end in spans:
        first, stop = bisect.bisect_left(starts, turn_start), bisect.bisect_left(starts, turn_end)
        for t in range(first, stop):
            loss_mask[t] = 1
            if starts[t] >= content_end and input_ids[t] in end_ids:
                break
    num_tokens = len(input_ids)
    if not any(loss_mask):
        raise RowError("no assistant tokens in the rendered chat template")
    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    assistant_tokens = sum(loss_mask)
    if not assistant_tokens:
        raise RowError(f"no assistant tokens within max_length {max_length}")
    return {"input_ids": input_ids, "loss_mask": loss_mask, "length": len(input_ids),
            "num_tokens": num_tokens, "assistant_tokens": assistant_tokens}


def _tokenize_row(row: dict, tokenizer, max_length: int | None, end_ids: set[int]) -> dict:
    """``datasets.map`` function: a RowError becomes an ``error`` column, counted afterwards."""
    try:
        return {**tokenize_conversation(row["messages"], tokenizer, max_length, end_ids),
                "error": ""}
    except RowError as err:
        return {"input_ids": [], "loss_mask": [], "length": 0, "num_tokens": 0,
                "assistant_tokens": 0, "error": str(err)}


def default_cache_dir() -> Path:
    return cache_root() / "data"


def _cache_key(sources: list[str], tokenizer, max_length: int | None) -> str:
    digest = hashlib.sha256()
    parts = [CACHE_VERSION, str(max_length), str(tokenizer.chat_template),
             tokenizer.backend_tokenizer.to_str()]
    for source in sources:
        if _is_local(source):
            content = hashlib.sha256(_local_path(source).read_bytes()).hexdigest()
        else:
            content = _hub_dataset(source)._fingerprint
        parts += [source, content]
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _check_tokenizer(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; the loss "
                         f"mask needs one to find the assistant turns: use a chat model's "
                         f"tokenizer or set tokenizer.chat_template")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} is not a fast tokenizer; the "
                         f"loss mask needs its offset mapping")


def load_sft_dataset(
    sources: str | os.PathLike | Iterable[str | os.PathLike],
    tokenizer,
    max_length: int | None = 2048,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
) -> tuple[datasets.Dataset, DataReport]:
    """Tokenised conversations with loss masks, and the report of what was skipped/truncated.

    Returns ``(dataset, report)``: a ``datasets.Dataset`` with columns ``input_ids``,
    ``loss_mask``, ``length``, ``source``, ``row`` (one row per usable conversation, in source
    order), ready for :func:`collate_causal_lm`. Cached as the module docstring says: the first
    process to get here tokenises (``num_proc`` processes, default one per core for large data)
    while every other one waits on a file lock and then reads what it wrote, so the ranks of a
    distributed run tokenise once between them, with or without ``main_process_first``.
    """
    names = _source_list(sources)
    _check_tokenizer(tokenizer)
    cache = Path(cache_dir or default_cache_dir()) / _cache_key(names, tokenizer, max_length)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache.with_name(cache.name + ".lock")):
        if not (cache / _REPORT_FILE).is_file():
            _tokenize_into(cache, names, tokenizer, max_length, num_proc)
    report = DataReport.from_dict(json.loads((cache / _REPORT_FILE).read_text()))
    return datasets.load_from_disk(str(cache / "dataset")), report


@contextlib.contextmanager
def _file_lock(path: Path):
    """Hold an exclusive lock on ``path`` (created if absent) while the block runs."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _tokenize_into(cache: Path, names: list[str], tokenizer, max_length: int | None,
                   num_proc: int | None) -> None:
    conversations, report = read_conversations(names)
    report.max_length = max_length
    answered = []
    for conversation in conversations:
        if any(m["role"] == "assistant" for m in conversation["messages"]):
            answered.append(conversation)
        else:
            report.sources[conversation["source"]].skip(conversation["row"], "no assistant turn")
    if not answered:
        raise ValueError(f"no usable conversations in {names}:\n{report.summary()}")
    if num_proc is None:  # a process costs about a second to start: worth it from ~2k rows
        num_proc = max(1, min(len(os.sched_getaffinity(0)), len(answered) // 2000))
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")

    # int32 ids and int8 masks: a quarter and an eighth of the disk that int64 would take
    int8, int32 = datasets.Value("int8"), datasets.Value("int32")
    features = datasets.Features({
        "input_ids": datasets.Sequence(int32), "loss_mask": datasets.Sequence(int8),
        "length": int32, "num_tokens": int32, "assistant_tokens": int32,
        "error": datasets.Value("string"), "source": datasets.Value("string"),
        "row": datasets.Value("int64"),
    })
    dataset = datasets.Dataset.from_list(answered).map(
        _tokenize_row, remove_columns=["messages"], features=features,
        num_proc=num_proc if num_proc > 1 else None,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length,
                   "end_ids": end_of_turn_ids(tokenizer)},
        new_fingerprint=cache.name, desc="tokenising",
    )
    keep = []
    columns = zip(*(dataset[c] for c in ("source", "row", "error", "num_tokens", "length",
                                          "assistant_tokens")), strict=True)
    for index, (source, row, error, num_tokens, length, assistant_tokens) in enumerate(columns):
        counts = report.sources[source]
        if error:
            counts.skip(row, error)
            continue
        keep.append(index)
        counts.used += 1
        counts.tokens += length
        counts.assistant_tokens += assistant_tokens
        if num_tokens > length:
            counts.truncated.append(row)
    if not keep:
        raise ValueError(f"no usable conversations in {names}:\n{report.summary()}")
    dataset = dataset.select(keep).remove_columns(["num_tokens", "assistant_tokens", "error"])

    # Written beside the final directory and renamed, so a crash never leaves half a cache.
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp / "dataset"))
    (tmp / _REPORT_FILE).write_text(json.dumps(report.to_dict()))
    if cache.exists():  # a process on another machine (no shared lock) finished first: identical
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, cache)


def collate_causal_lm(rows: Sequence[Mapping], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids``, ``attention_mask``, ``loss_mask``, ``labels``.

    All ``(batch, longest row)``; see the module docstring for what each means. Use as
    ``DataLoader(dataset, collate_fn=functools.partial(collate_causal_lm, pad_token_id=...))``.
    """
    width = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # (batch, seq)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
    labels = input_ids.masked_fill(loss_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "labels": labels}


# ------------------------------------------------------------------------------------------------
# Prompts and self-distillation

Prompt = list[list[dict]]  # the user turns of one conversation, each turn a list of messages


def user_turns(messages: Sequence[Mapping]) -> Prompt:
    """What a conversation gives its assistant to answer: one list of messages per turn.

    Assistant messages close a turn and are dropped (regeneration answers in their place); the
    system and user messages before an answer form the turn it answers, so ``[system, user,
    assistant, user]`` has two turns. Trailing messages with no user message are dropped.
    """
    turns: Prompt = []
    pending: list[dict] = []
    for message in messages:
        if message["role"] != "assistant":
            pending.append(dict(message))
        elif any(m["role"] == "user" for m in pending):
            turns.append(pending)
            pending = []
    if any(m["role"] == "user" for m in pending):
        turns.append(pending)
    return turns


def load_prompts(
    sources: str | os.PathLike | Iterable[str | os.PathLike],
) -> tuple[list[Prompt], DataReport]:
    """Each usable row's user turns (:func:`user_turns`; its answers dropped), and the report.

    Rows without an assistant turn (such as ShareGPT first turns) are one-turn prompts.
    """
    conversations, report = read_conversations(sources)
    prompts = []
    for conversation in conversations:
        turns = user_turns(conversation["messages"])
        counts = report.sources[conversation["source"]]
        if not turns:
            counts.skip(conversation["row"], "no user turn")
            continue
        prompts.append(turns)
        counts.used += 1
    return prompts, report


@dataclass
class Answer:
    """One generated assistant turn."""

    text: str
    finished: bool  # ended with an end-of-sequence token; false when it hit max_new_tokens
    prompt_tokens: int | None = None  # the server's own counts (OpenAI backend), when it says
    completion_tokens: int | None = None


class HFBackend:
    """Answers with ``generate`` on a loaded target: one turn of ``batch_size`` conversations per
    call, left-padded."""

    def __init__(self, target: Target, *, batch_size: int = 8):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.target = target
        self.batch_size = batch_size
        self.tokenizer = target.tokenizer
        self.max_context = target.max_context

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.target.chat_ids(messages)

    def answer_batch(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                     top_p: float) -> list[Answer]:
        pad_id = self.tokenizer.pad_token_id
        pad_id = self.target.eos_token_ids[0] if pad_id is None else pad_id
        answers = _generate(self.target, prompts, pad_id, max_new_tokens, temperature, top_p)
        return [Answer(text, finished) for text, finished in answers]


class OpenAIBackend:
    """Answers through an OpenAI-compatible server's ``/chat/completions`` (vLLM, SGLang, TGI,
    ``transformers serve``), ``concurrency`` requests in flight.

    ``url`` ends in ``/v1``. The server applies its own chat template; ``tokenizer`` is the
    target's, which counts what fits in ``max_context`` and checks on the first answer that the
    server's template and tokenizer give the tokens training will see
    (:func:`check_server_tokens`). Connection errors, HTTP 429 and 5xx are retried ``retries``
    times, waiting ``backoff`` x 2^attempt seconds (at most a minute); any other 4xx is a
    ValueError with the server's message. ``api_key`` is sent as a bearer token when given.
    """

    def __init__(self, url: str, model: str, tokenizer, *, concurrency: int = 8,
                 max_context: int | None = None, timeout: float = 600.0, retries: int = 5,
                 backoff: float = 1.0, api_key: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--url must be an http(s) address such as http://127.0.0.1:8000/v1, "
                             f"got {url!r}")
        if concurrency < 1 or retries < 0 or not timeout > 0 or not backoff >= 0:
            raise ValueError(f"need concurrency >= 1, retries >= 0, timeout > 0 and backoff >= 0, "
                             f"got {concurrency}, {retries}, {timeout}, {backoff}")
        _check_chat_tokenizer(tokenizer)
        self.url = url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.max_context = max_context or 1 << 30
        self.timeout, self.retries, self.backoff, self.api_key = timeout, retries, backoff, api_key
        self._tokenizer_lock = threading.Lock()  # a Rust tokenizer is not safe across threads

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        with self._tokenizer_lock:
            return _template_ids(self.tokenizer, messages)

    def request(self, method: str, path: str, body: dict | None = None,
                retries: int | None = None) -> dict:
        """One JSON request, retried on connection errors, 429 and 5xx; a 4xx is a ValueError."""
        url = self.url + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                request = urllib.request.Request(url, data=data, headers=headers, method=method)
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    payload = response.read()
                break
            except urllib.error.HTTPError as err:
                detail = err.read().decode("utf-8", "replace")[:800]
                if err.code != 429 and err.code < 500:
                    hint = " (does --url end in /v1?)" if err.code == 404 else ""
                    raise ValueError(f"{method} {url} was refused with HTTP {err.code}{hint}: "
                                     f"{detail}") from None
                problem = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
                problem = str(getattr(err, "reason", None) or err) or type(err).__name__
            if attempt == retries:
                raise ConnectionError(f"{method} {url} failed {attempt + 1} times, last with "
                                      f"{problem}; check that the server runs at {self.url}")
            time.sleep(min(self.backoff * 2**attempt, 60.0))
        try:
            return json.loads(payload)
        except json.JSONDecodeError:
            raise ValueError(f"{url} answered with something other than JSON: "
                             f"{payload[:200]!r}") from None

    def check(self) -> None:
        """The server answers and serves ``model``: a clear error before any work."""
        listed = self.request("GET", "/models", retries=min(self.retries, 2))
        served = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
        if self.model not in served:
            raise ValueError(f"the server at {self.url} serves {served}, not {self.model!r}; "
                             f"pass --model with one of those names")

    def answer(self, messages: list[dict], *, max_new_tokens: int, temperature: float,
               top_p: float, seed: int) -> Answer:
        body = {"model": self.model, "messages": messages, "max_tokens": max_new_tokens,
                "temperature": temperature, "seed": seed, "stream": False}
        if temperature > 0:
            body["top_p"] = top_p
        reply = self.request("POST", "/chat/completions", body)
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"] or ""
            reason = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"{self.url}/chat/completions answered without a message: "
                             f"{json.dumps(reply)[:300]}") from None
        usage = reply.get("usage") or {}
        return Answer(text, reason == "stop", usage.get("prompt_tokens"),
                      usage.get("completion_tokens"))


def _template_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def check_server_tokens(tokenizer, prompt: list[dict], answer: Answer) -> None:
    """On one first-turn answer: the server saw and wrote the tokens training will see.

    The server's ``usage.prompt_tokens`` must be the length of the prompt under the target's
    template, and re-tokenising the conversation with it must mask as many tokens as the server
    generated (the answer's tokens, plus the end-of-turn token when it stopped by itself and
    counts it). Raises ValueError otherwise; says so when the server reports no usage.
    """
    if answer.prompt_tokens is None or answer.completion_tokens is None:
        print("[draftsmith] the server reports no token usage: cannot check that its chat "
              "template and tokenizer are the target's", flush=True)
        return
    expected = len(_template_ids(tokenizer, prompt))
    if answer.prompt_tokens != expected:
        raise ValueError(
            f"the server counted {answer.prompt_tokens} prompt tokens where the target's chat "
            f"template and tokenizer ({tokenizer.name_or_path}) give {expected}: it serves "
            f"another template or tokenizer, so its answers would not be the tokens training "
            f"masks; serve the target itself, or name the model the server runs as --target")
    conversation = [*prompt, {"role": "assistant", "content": answer.text}]
    try:
        masked = sum(tokenize_conversation(conversation, tokenizer)["loss_mask"])
    except RowError as err:
        raise ValueError(f"the server's first answer cannot be tokenised for training ({err}): "
                         f"{answer.text[:200]!r}") from None
    content = masked - 1  # the loss also masks the end-of-turn token that closes the answer
    if answer.completion_tokens not in (content, content + 1):
        raise ValueError(
            f"the server generated {answer.completion_tokens} tokens, but re-tokenising its "
            f"answer with the target's template gives {content} (+1 end-of-turn): it uses "
            f"another tokenizer than {tokenizer.name_or_path}, so training would not see the "
            f"tokens it wrote; serve the target itself. Answer: {answer.text[:200]!r}")


def parse_shard(spec: str | Sequence[int]) -> tuple[int, int]:
    """``"I/N"`` (or ``(I, N)``) -> (I, N): shard I of N, counting from 0."""
    try:
        index, count = (int(x) for x in (spec.split("/") if isinstance(spec, str) else spec))
    except (ValueError, TypeError):
        raise ValueError(f"a shard is I/N with whole numbers, such as 0/4, got {spec!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: I/N needs 0 <= I < N (shards count from 0), "
                         f"got {spec!r}")
    return index, count


def shard_path(out_path: str | os.PathLike, index: int, count: int) -> Path:
    """Where shard ``index`` of ``count`` writes: ``answers.shard-I-of-N.jsonl`` beside ``out``."""
    out = Path(out_path)
    return out.with_name(f"{out.stem}.shard-{index}-of-{count}{out.suffix}")


def _done_path(shard: Path) -> Path:
    return shard.with_name(shard.name + ".done")


@dataclass
class _Conversation:
    """A conversation being regenerated: its user turns and the history answered so far."""

    index: int
    turns: Prompt
    messages: list[dict] = field(default_factory=list)
    answered: int = 0
    finished: bool = True
    cut: bool = False
    next_ids: list[int] | None = None

    def next_input(self) -> list[dict]:
        return [*self.messages, *self.turns[self.answered]]

    def add(self, prompt: list[dict], answer: Answer) -> None:
        self.messages = [*prompt, {"role": "assistant", "content": answer.text}]
        self.answered += 1
        self.finished = self.finished and answer.finished

    def record(self) -> dict:
        return {"messages": self.messages, "prompt_index": self.index, "turns": self.answered,
                "finished": self.finished, "cut": self.cut}


def _prepare(conversation: _Conversation, backend, limit: int, max_new_tokens: int) -> str:
    """"more" (the next turn fits; its ids are set), "done" (every turn answered, or the next no
    longer fits: cut at this turn boundary) or "skip" (not even the first turn fits)."""
    if conversation.answered == len(conversation.turns):
        return "done"
    ids = backend.prompt_ids(conversation.next_input())
    if len(ids) + max_new_tokens <= limit:
        conversation.next_ids = ids
        return "more"
    if conversation.answered == 0:
        return "skip"
    conversation.cut = True
    return "done"


def _records(path: Path) -> Iterable[tuple[int, str, dict]]:
    """(line number, line, record) of every complete line of a regenerate file."""
    data = path.read_bytes()
    for lineno, line in enumerate(data[: data.rfind(b"\n") + 1].decode("utf-8").split("\n"), 1):
        if not line:
            continue
        try:
            record = json.loads(line)
            if not (isinstance(record, dict) and isinstance(record["prompt_index"], int)
                    and isinstance(record["messages"], list)):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}: line {lineno} is not a row regenerate wrote; give another "
                             f"--out file") from None
        yield lineno, line, record


def _answered(path: Path, prompts: list[Prompt], shard: tuple[int, int]) -> set[int]:
    """Prompt indices already answered in ``path``; a half-written last line is cut off."""
    if not path.exists():
        return set()
    size = path.stat().st_size
    complete = path.read_bytes().rfind(b"\n") + 1
    if complete < size:  # killed in the middle of a line
        with open(path, "r+b") as f:
            f.truncate(complete)
    done = set()
    for lineno, _, record in _records(path):
        index = record["prompt_index"]
        given = [m for m in record["messages"] if m.get("role") != "assistant"]
        turns = record.get("turns", 1)
        if not (0 <= index < len(prompts) and index % shard[1] == shard[0]
                and given == [m for turn in prompts[index][:turns] for m in turn]):
            raise ValueError(f"{path} line {lineno} answers another prompt than prompt {index} "
                             f"of these data (shard {shard[0]}/{shard[1]}); resume with the same "
                             f"data files and shards, or give another --out file")
        done.add(index)
    return done


class _Writer:
    """Appends finished conversations to a JSONL file: flushed per line (a killed process loses
    nothing written), fsynced every few seconds and at the end (a crashed machine)."""

    def __init__(self, path: Path):
        self.file = open(path, "a", encoding="utf-8")  # closed by close()
        self.synced = time.monotonic()

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()
        if time.monotonic() - self.synced > 5:
            os.fsync(self.file.fileno())
            self.synced = time.monotonic()

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def _request_seed(seed: int, index: int, turn: int) -> int:
    """A per-request seed: reproducible whatever order the requests are answered in."""
    return ((seed * 1_000_003 + index) * 1009 + turn) % (1 << 31)


def regenerate(
    backend: Target | HFBackend | OpenAIBackend,
    prompts_or_files: Sequence[list[dict]] | str | os.PathLike | Iterable[str | os.PathLike],
    out_path: str | os.PathLike,
    *,
    max_new_tokens: int = 512,
    temperature: float = 0.7,
    top_p: float = 0.95,
    batch_size: int = 8,
    max_prompts: int | None = None,
    max_turns: int | None = None,
    max_length: int | None = None,
    seed: int = 0,
    shard: tuple[int, int] | str = (0, 1),
    progress: bool = True,
) -> int:
    """Let the target answer every user turn of the prompts itself; write them as JSONL.

    ``backend`` is a loaded :class:`Target` (run as ``HFBackend(target, batch_size=batch_size)``),
    an :class:`HFBackend` or an :class:`OpenAIBackend`. ``prompts_or_files`` are conversations
    (lists of messages; their assistant turns are dropped) or data sources read with
    :func:`load_prompts`; only the first ``max_prompts`` count. Turn 1 is answered, the answer
    appended, turn 2 answered given that history, and so on, at most ``max_turns`` turns. A
    conversation whose next turn plus ``max_new_tokens`` no longer fits in ``max_length`` (default:
    the target's context) is cut at that turn boundary and counted; one whose first turn does
    not fit is skipped and counted.

    Sharding: ``shard=(I, N)`` (or ``"I/N"``) answers prompts ``I, I + N, ...`` into
    :func:`shard_path` (``answers.shard-I-of-N.jsonl``), so N processes (``torchrun``, ``accelerate
    launch``, several machines) share the work; :func:`merge_shards` then joins them in input
    order. With N = 1, ``out_path`` itself is written.

    Each line is ``{"messages", "prompt_index", "turns", "finished", "cut"}`` (``finished``: every
    answer ended by itself rather than at ``max_new_tokens``; ``cut``: turns were left unanswered
    because the history no longer fit), written and flushed when its conversation is complete.
    Rerunning with the same prompts and shard continues where the file stops; a process killed
    at any moment loses only the conversations in flight. ``temperature`` 0 is greedy. Returns
    the number of conversations answered by this call.
    """
    if isinstance(backend, Target):
        backend = HFBackend(backend, batch_size=batch_size)
    for name, value in (("max_new_tokens", max_new_tokens), ("max_prompts", max_prompts),
                        ("max_turns", max_turns), ("max_length", max_length)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not (math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1):
        raise ValueError(f"need a finite temperature >= 0 and 0 < top_p <= 1, got {temperature}, "
                         f"{top_p}")
    index, count = parse_shard(shard)
    if _is_prompt_list(prompts_or_files):
        prompts = [user_turns(p) for p in prompts_or_files]
        empty = [i for i, turns in enumerate(prompts) if not turns]
        if empty:
            raise ValueError(f"prompts {_examples(empty)} have no user message")
    else:
        prompts, report = load_prompts(prompts_or_files)
        if progress:
            print(report.summary(), flush=True)
    prompts = prompts[:max_prompts]
    out = Path(out_path) if count == 1 else shard_path(out_path, index, count)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _answered(out, prompts, (index, count))
    todo = [_Conversation(i, prompts[i][:max_turns]) for i in range(index, len(prompts), count)
            if i not in done]
    limit = min(backend.max_context, max_length or backend.max_context)
    finished_mark = _done_path(out)
    if todo and finished_mark.exists():
        finished_mark.unlink()
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    skipped: list[int] = []
    cut: list[int] = []
    writer = _Writer(out)

    def finish(conversation: _Conversation) -> None:
        writer.write(conversation.record())
        if conversation.cut:
            cut.append(conversation.index)

    try:
        with tqdm(total=len(todo), desc=f"regenerating {out.name}", unit="conv",
                  disable=not progress) as bar:
            if isinstance(backend, OpenAIBackend):
                if todo:
                    backend.check()
                _converse_concurrently(backend, todo, limit, seed, settings, finish,
                                       skipped, bar)
            else:
                _converse_batched(backend, todo, limit, seed, settings, finish, skipped, bar)
    finally:
        writer.close()
    answered = len(todo) - len(skipped)
    if progress:
        where = f"shard {index}/{count} " if count > 1 else ""
        print(f"[draftsmith] {where}answered {answered} conversations into {out}" + (
            f"; {len(cut)} cut at a turn boundary (history + max_new_tokens > {limit} tokens; "
            f"prompt indices {_examples(cut)})" if cut else "") + (
            f"; {len(skipped)} skipped, their first turn + max_new_tokens > {limit} tokens "
            f"(prompt indices {_examples(skipped)})" if skipped else ""), flush=True)
    if count > 1:
        finished_mark.write_text(json.dumps({"shard": [index, count], "prompts": len(prompts),
                                             "skipped": skipped}))
    return answered


def _converse_batched(backend: HFBackend, todo, limit, seed, settings, finish, skipped, bar):
    """A pool of ``batch_size`` conversations; each call answers the next turn of all of them,
    finished conversations leave and new ones take their place."""
    ready = {c.index: _prepare(c, backend, limit, settings["max_new_tokens"]) for c in todo}
    # longest first: similar lengths share a batch, and memory errors come early
    queue = deque(sorted(todo, key=lambda c: (-len(c.next_ids or ()), c.index)))
    rng_devices = [backend.target.device] if backend.target.device.type == "cuda" else []
    active: list[_Conversation] = []
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        while queue or active:
            while queue and len(active) < backend.batch_size:
                conversation = queue.popleft()
                if ready[conversation.index] == "skip":
                    skipped.append(conversation.index)
                    bar.update(1)
                else:
                    active.append(conversation)
            if not active:
                break
            inputs = [c.next_input() for c in active]
            answers = backend.answer_batch([c.next_ids for c in active], **settings)
            still = []
            for conversation, prompt, answer in zip(active, inputs, answers, strict=True):
                conversation.add(prompt, answer)
                if _prepare(conversation, backend, limit, settings["max_new_tokens"]) == "more":
                    still.append(conversation)
                else:
                    finish(conversation)
                    bar.update(1)
            active = still


def _converse_concurrently(backend: OpenAIBackend, todo, limit, seed, settings, finish,
                           skipped, bar):
    """Each conversation is one task answering its turns in order; ``concurrency`` tasks run at
    once. The first turn of the first conversation is asked alone and checked first."""

    def converse(conversation: _Conversation, check: bool = False) -> tuple[_Conversation, str]:
        while (status := _prepare(conversation, backend, limit, settings["max_new_tokens"])) == "more":
            prompt = conversation.next_input()
            answer = backend.answer(prompt, seed=_request_seed(seed, conversation.index,
                                                               conversation.answered), **settings)
            if check and conversation.answered == 0:
                check_server_tokens(backend.tokenizer, prompt, answer)
            conversation.add(prompt, answer)
            if check:
                return conversation, "more"
        return conversation, status

    rest = list(todo)
    while rest:  # the check: the first conversation whose first turn fits
        conversation, status = converse(rest.pop(0), check=True)
        if status == "skip":
            skipped.append(conversation.index)
            bar.update(1)
            continue
        rest.insert(0, conversation)
        break
    pool = ThreadPoolExecutor(max_workers=backend.concurrency)
    try:
        futures = [pool.submit(converse, c) for c in rest]
        for future in as_completed(futures):
            conversation, status = future.result()
            if status == "skip":
                skipped.append(conversation.index)
            else:
                finish(conversation)
            bar.update(1)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def merge_shards(out_path: str | os.PathLike, num_shards: int | None = None, *,
                 partial: bool = False) -> int:
    """Join ``answers.shard-I-of-N.jsonl`` into ``out_path`` in input (prompt) order.

    ``num_shards`` defaults to the N of the shard files found. Every shard must have finished
    (regenerate marks it) unless ``partial``. An existing ``out_path`` is replaced only when every
    row in it is also in the shards, unchanged (an earlier merge of the same shards), so nothing
    written is lost. Written to a temporary file and renamed. Returns the number of rows.
    """
    out = Path(out_path)
    if num_shards is None:
        found = {int(p.name.rsplit("-of-", 1)[1].split(".")[0])
                 for p in out.parent.glob(f"{out.stem}.shard-*-of-*{out.suffix}")}
        if len(found) != 1:
            raise FileNotFoundError(
                f"no shard files {out.stem}.shard-I-of-N{out.suffix} in {out.parent or '.'}"
                if not found else
                f"shard files of several shard counts {sorted(found)} beside {out}; pass --shards")
        num_shards = found.pop()
    paths = [shard_path(out, i, num_shards) for i in range(num_shards)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"shard files missing: {missing}; run regenerate for those shards")
    unfinished = [str(p) for p in paths if not _done_path(p).is_file()]
    if unfinished and not partial:
        raise ValueError(f"shards not finished: {unfinished}; rerun regenerate for them (it "
                         f"continues where they stopped), or merge what is there with --partial")
    considered = {str(p): json.loads(_done_path(p).read_text())["prompts"] for p in paths
                  if _done_path(p).is_file()}
    if len(set(considered.values())) > 1 and not partial:
        raise ValueError(f"the shards answered different numbers of prompts {considered} (other "
                         f"--max-prompts or data); rerun the short ones with the same settings, "
                         f"or merge what is there with --partial")
    lines: dict[int, str] = {}
    for path in paths:
        for lineno, line, record in _records(path):
            index = record["prompt_index"]
            if index in lines:
                raise ValueError(f"{path} line {lineno}: prompt {index} is answered twice in the "
                                 f"shards of {out}; were shards of different runs mixed?")
            lines[index] = line
    if out.exists():
        for lineno, line, record in _records(out):
            if lines.get(record["prompt_index"]) != line:
                raise ValueError(f"{out} exists and line {lineno} is not in the shards: merging "
                                 f"would lose it; give another output file")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines[i] + "\n" for i in sorted(lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return len(lines)


@torch.no_grad()
def _generate(target, batch: list[list[int]], pad_id: int, max_new_tokens: int,
              temperature: float, top_p: float) -> list[tuple[str, bool]]:
    """(answer text, whether it ended with an end-of-sequence token) for each prompt."""
    width = max(map(len, batch))
    # Left padding, so that every row's next token is generated at the same position.
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # (batch, width)
    attention_mask = torch.zeros_like(input_ids)
    for b, ids in enumerate(batch):
        input_ids[b, width - len(ids):] = torch.tensor(ids)
        attention_mask[b, width - len(ids):] = 1
    sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p}
                if temperature > 0 else {"do_sample": False})
    output = target.model.generate(
        input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
        max_new_tokens=max_new_tokens, eos_token_id=list(target.eos_token_ids),
        pad_token_id=pad_id, **sampling,
    )  # (batch, width + new)
    answers = []
    for tokens in output[:, width:].tolist():
        end = next((k for k, t in enumerate(tokens) if t in target.eos_token_ids), None)
        text = target.tokenizer.decode(tokens[:end], skip_special_tokens=True)
        answers.append((text, end is not None))
    return answers


def _is_prompt_list(value: Any) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0
            and all(isinstance(p, list) and all(isinstance(m, dict) for m in p) for p in value))


def _check_chat_tokenizer(tokenizer) -> None:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", None)
        raise ValueError(f"tokenizer {name!r} has no chat template; regenerating through a "
                         f"server needs the target's template to count and check tokens")


# ------------------------------------------------------------------------------------------------
# Command line


def _launcher_shard() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as torchrun and accelerate launch set them; (0, 1) otherwise."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.data",
                                     description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    regen_parser = commands.add_parser(
        "regenerate", help="let the target answer every turn of the prompts itself")
    inspect_parser = commands.add_parser("inspect", help="tokenise the data and print the report")
    merge_parser = commands.add_parser(
        "merge", help="join the shard files of regenerate --shard into one file, in input order")
    for command in (regen_parser, inspect_parser):
        command.add_argument("--target", required=True,
                             help="target: embedded name, Hugging Face directory or .gguf file "
                                  "(--backend openai: its tokenizer and template count and check "
                                  "tokens; the model runs in the server)")
        command.add_argument("--data", nargs="+", required=True,
                             help="JSON/JSONL files or Hub dataset ids")
    regen_parser.add_argument("--out", required=True,
                              help="JSONL file to append to (resumable); with shards, "
                                   "OUT.shard-I-of-N.jsonl beside it")
    regen_parser.add_argument("--backend", choices=("hf", "openai"), default="hf",
                              help="hf: transformers generate in this process; openai: an "
                                   "OpenAI-compatible server (vLLM, SGLang, TGI, transformers serve)")
    regen_parser.add_argument("--url", help="openai: the server's address, e.g. "
                                            "http://127.0.0.1:8000/v1")
    regen_parser.add_argument("--model", help="openai: the model name the server serves")
    regen_parser.add_argument("--concurrency", type=int, default=8,
                              help="openai: conversations in flight")
    regen_parser.add_argument("--timeout", type=float, default=600.0,
                              help="openai: seconds to wait for one answer")
    regen_parser.add_argument("--retries", type=int, default=5,
                              help="openai: retries of a request after a connection error, "
                                   "429 or 5xx (exponential backoff)")
    regen_parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                              help="openai: bearer token, if the server wants one (default: "
                                   "$OPENAI_API_KEY)")
    regen_parser.add_argument("--shard", default=None,
                              help="I/N: answer prompts I, I+N, ... into OUT.shard-I-of-N.jsonl "
                                   "(default: RANK/WORLD_SIZE under torchrun or accelerate "
                                   "launch, else 0/1)")
    regen_parser.add_argument("--max-new-tokens", type=int, default=512)
    regen_parser.add_argument("--max-turns", type=int, default=None,
                              help="answer at most this many user turns per conversation")
    regen_parser.add_argument("--max-length", type=int, default=None,
                              help="longest conversation in tokens (default: the target's "
                                   "context); later turns are cut at a turn boundary")
    regen_parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    regen_parser.add_argument("--top-p", type=float, default=0.95)
    regen_parser.add_argument("--batch-size", type=int, default=8,
                              help="hf: conversations per generate call")
    regen_parser.add_argument("--max-prompts", type=int, default=None)
    regen_parser.add_argument("--seed", type=int, default=0)
    regen_parser.add_argument("--device", default=None,
                              help="hf: default cuda (cuda:LOCAL_RANK under a launcher) when "
                                   "available, else cpu")
    regen_parser.add_argument("--dtype", default=None, help="hf: default bf16 on GPU, fp32 on CPU")
    inspect_parser.add_argument("--max-length", type=int, default=2048)
    inspect_parser.add_argument("--num-proc", type=int, default=None,
                                help="tokenising processes (default: one per core, for large data)")
    inspect_parser.add_argument("--cache-dir", default=None, help=f"default: {default_cache_dir()}")
    merge_parser.add_argument("--out", required=True,
                              help="the --out given to regenerate; its shard files are joined")
    merge_parser.add_argument("--shards", type=int, default=None,
                              help="N (default: the N of the shard files found)")
    merge_parser.add_argument("--partial", action="store_true",
                              help="merge shards that have not finished too")
    args = parser.parse_args(argv)

    if args.command == "merge":
        rows = merge_shards(args.out, args.shards, partial=args.partial)
        print(f"merged {rows} conversations into {args.out}")
    elif args.command == "regenerate":
        shard = parse_shard(args.shard if args.shard is not None else _launcher_shard())
        if args.backend == "openai":
            backend = _openai_backend(args, parser)
        else:
            from heads.target import load_target

            device = args.device
            if device is None and torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
                device = f"cuda:{os.environ['LOCAL_RANK']}"
            target = load_target(args.target, device=device, dtype=args.dtype)
            backend = HFBackend(target, batch_size=args.batch_size)
        written = regenerate(
            backend, args.data, args.out, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, batch_size=args.batch_size,
            max_prompts=args.max_prompts, max_turns=args.max_turns, max_length=args.max_length,
            seed=args.seed, shard=shard,
        )
        print(f"answered {written} prompts")
        if shard[1] > 1:
            marks = [_done_path(shard_path(args.out, i, shard[1])) for i in range(shard[1])]
            if all(m.is_file() for m in marks):  # the last shard to finish joins them
                rows = merge_shards(args.out, shard[1])
                print(f"every shard has finished: merged {rows} conversations into {args.out}")
    else:
        from transformers import AutoTokenizer

        from heads.target import resolve_target

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_target(args.target)),
                                                  trust_remote_code=False)
        dataset, report = load_sft_dataset(args.data, tokenizer, max_length=args.max_length,
                                           cache_dir=args.cache_dir, num_proc=args.num_proc)
        print(report.summary())
        if len(dataset):
            print(f"{len(dataset)} sequences, longest {max(dataset['length'])} tokens")


def _openai_backend(args, parser) -> OpenAIBackend:
    from transformers import AutoConfig, AutoTokenizer

    from heads.target import resolve_target

    if not args.url or not args.model:
        parser.error("--backend openai needs --url (e.g. http://127.0.0.1:8000/v1) and --model")
    path = resolve_target(args.target)
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    context = getattr(AutoConfig.from_pretrained(str(path), trust_remote_code=False),
                      "max_position_embeddings", None)
    return OpenAIBackend(args.url, args.model, tokenizer, concurrency=args.concurrency,
                         max_context=context, timeout=args.timeout, retries=args.retries,
                         api_key=args.api_key)


if __name__ == "__main__":
    main()
