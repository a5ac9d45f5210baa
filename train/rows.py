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

Self-distillation (the target's own answers to the prompts, written as training rows) is
train/regenerate.py; ``python -m draftsmith.train.data regenerate|merge|inspect`` is its command line.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import shutil
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import torch
from jinja2.exceptions import TemplateError

from draftsmith.files.file_formats import FileFormatError
from draftsmith.files.output_dir import write_dir
from draftsmith.targets.resolve import cache_root

ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
         "assistant": "assistant"}
# Bump when the tokenisation below changes, so that old caches are not reused.
CACHE_VERSION = "1"
_REPORT_FILE = "report.json"
_CACHE_KIND = "tokenised-data"  # the draftsmith.files.output_dir marker kind of a cache directory


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
            reasons = ", ".join(f"{len(rows)} with {reason} (rows {examples(rows)})"
                                for reason, rows in self.skipped.items())
            lines.append(f"  skipped {self.num_skipped} rows of {self.name}: {reasons}")
        if self.truncated:
            lines.append(f"  truncated {len(self.truncated)} rows of {self.name} to max_length "
                         f"{max_length} (rows {examples(self.truncated)})")
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
                         "python -m draftsmith.train.data regenerate --help")
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


def examples(rows: list[int], shown: int = 5) -> str:
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


# local data files: JSON (an array of rows) or JSONL, each also gzip-compressed
LOCAL_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")


def _is_local(source: str) -> bool:
    path = Path(source).expanduser()
    return (path.exists() or path.name.endswith(LOCAL_SUFFIXES)
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
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            raise FileFormatError(path, f"is not a whole gzip file ({err})", "compress it again "
                                  "with gzip, or give the uncompressed JSON/JSONL file") from None
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
        if cache.exists():
            try:
                return _read_cache(cache)
            except (OSError, ValueError, KeyError, TypeError) as err:
                # derived data (a hash of the sources names it): rebuilt, never trusted damaged
                print(f"[draftsmith] the tokenisation cache {cache} is damaged ({type(err).__name__}"
                      f": {str(err)[:200]}); tokenising again", file=sys.stderr, flush=True)
                shutil.rmtree(cache)
        _tokenize_into(cache, names, tokenizer, max_length, num_proc)
        return _read_cache(cache)


def _read_cache(cache: Path) -> tuple[datasets.Dataset, DataReport]:
    """The dataset and report a tokenisation wrote; any damage raises (the caller rebuilds)."""
    report = DataReport.from_dict(json.loads((cache / _REPORT_FILE).read_text()))
    dataset = datasets.load_from_disk(str(cache / "dataset"))
    if len(dataset):  # the last row is read: a truncated arrow file fails here, not in training
        dataset[len(dataset) - 1]
    if len(dataset) != sum(source.used for source in report.sources.values()):
        raise ValueError(f"{len(dataset)} rows, but its report counts "
                         f"{sum(source.used for source in report.sources.values())}")
    return dataset, report


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

    if cache.exists():  # a process on another machine (no shared lock) finished first: identical
        return

    def fill(tmp: Path) -> None:
        dataset.save_to_disk(str(tmp / "dataset"))
        (tmp / _REPORT_FILE).write_text(json.dumps(report.to_dict()))

    # written beside the final directory and renamed: a crash never leaves half a cache, and what
    # a killed tokenisation leaves beside it is removed by the next one (draftsmith.files.output_dir)
    write_dir(cache, fill, kind=_CACHE_KIND)


def collate_causal_lm(rows: Sequence[Mapping], pad_token_id: int,
                      packed: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids``, ``attention_mask``, ``loss_mask``, ``labels``.

    All ``(batch, longest row)``; see the module docstring for what each means. Use as
    ``DataLoader(dataset, collate_fn=functools.partial(collate_causal_lm, pad_token_id=...))``.
    ``packed``: the rows end to end in one row instead (:func:`pack_rows`), no padding at all.
    """
    if packed:
        return pack_rows(rows)
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


def pack_rows(rows: Sequence[Mapping], keys: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Rows end to end in one row of a batch of 1, as SpecForge and speculators pack: no padding.

    ``input_ids``, ``loss_mask``, ``labels`` (1, N) with N the rows' tokens; ``position_ids``
    (1, N) restarting at 0 at each row's first token, which is how the target and the EAGLE loss
    tell the documents apart (every position attends within its own row: the loss equals the
    rows' loss unpacked); ``attention_mask`` all ones. ``keys``: further per-token tensors of
    the rows ((n, F) each) concatenated the same way, (1, N, F).
    """
    input_ids = torch.cat([torch.as_tensor(r["input_ids"], dtype=torch.long) for r in rows])
    loss_mask = torch.cat([torch.as_tensor(r["loss_mask"], dtype=torch.long) for r in rows])
    position_ids = torch.cat([torch.arange(len(r["input_ids"])) for r in rows])
    # a row's first token is never a label of the row before it
    labels = input_ids.masked_fill((loss_mask == 0) | (position_ids == 0), -100)
    batch = {"input_ids": input_ids[None], "attention_mask": torch.ones_like(input_ids)[None],
             "loss_mask": loss_mask[None], "labels": labels[None],
             "position_ids": position_ids[None]}
    for key in keys:
        batch[key] = torch.cat([torch.as_tensor(r[key]) for r in rows])[None]  # (1, N, F)
    return batch
