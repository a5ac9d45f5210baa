"""The files :mod:`draftsmith.train.regenerate` writes and reads back: the rows, the settings they record,
resuming a file left half-written, the shard files, their finished marks and the merge.

* Each row is ``{"messages", "prompt_index", "turns", "finished", "cut", "settings"}``; the
  ``settings`` (backend, model, max_new_tokens, temperature, top_p, seed, max_turns, max_length)
  are what it was answered with. A resume, and a merge of shards, refuses rows answered otherwise,
  naming the setting.
* A file is only ever changed when it is provably regenerate's own: every complete line is a row
  with its settings, and the one thing cut off is a half-written last row. The first row of a file
  is written whole (a temporary file, then a rename), so a partial row always follows a complete
  one; a file that ends in a partial line with no complete row before it is someone else's.
* ``answers.shard-I-of-N.jsonl.done`` marks shard I of N finished; :func:`merge_shards` joins the
  finished shards in input order.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from draftsmith.files.output_dir import write_atomic

# the setting each key of a row's "settings" records, as the command line spells it
SETTING_FLAGS = {"backend": "--backend", "model": "--model", "max_new_tokens": "--max-new-tokens",
                 "temperature": "--temperature", "top_p": "--top-p", "seed": "--seed",
                 "max_turns": "--max-turns", "max_length": "--max-length"}
_GREEDY_IGNORES = ("top_p", "seed")  # what greedy decoding (temperature 0) does not use

# what every row starts with (json.dumps of a record, "messages" first)
ROW_START = b'{"messages": '


def shard_path(out_path: str | os.PathLike, index: int, count: int) -> Path:
    """Where shard ``index`` of ``count`` writes: ``answers.shard-I-of-N.jsonl`` beside ``out``."""
    out = Path(out_path)
    return out.with_name(f"{out.stem}.shard-{index}-of-{count}{out.suffix}")


def done_path(shard: Path) -> Path:
    """The mark regenerate leaves beside a shard that has finished."""
    return shard.with_name(shard.name + ".done")


def refuse_directory(path: Path, flag: str = "--out") -> None:
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file, such as "
                         f"{path / 'answers.jsonl'}")


def _shown(value) -> str:
    return "unset" if value is None else json.dumps(value)


def settings_differences(written: Mapping, asked: Mapping, other: str = "this run") -> list[str]:
    """The settings ``written`` and ``asked`` differ in, as ``--flag A (this run: B)``; the top-p
    and seed do not count when both are greedy."""
    greedy = written.get("temperature") == 0 and asked.get("temperature") == 0
    differences = []
    for key in sorted({*written, *asked}):
        if written.get(key) != asked.get(key) and not (greedy and key in _GREEDY_IGNORES):
            flag = SETTING_FLAGS.get(key, key)
            if key == "model" and "hf" in (written.get("backend"), asked.get("backend")):
                flag = "--model/--target"
            differences.append(f"{flag} {_shown(written.get(key))} "
                               f"({other}: {_shown(asked.get(key))})")
    return differences


def records(path: Path, data: bytes | None = None) -> Iterable[tuple[int, str, dict]]:
    """(line number, line, record) of every complete line of a regenerate file (``data``: its
    bytes, when already read); a line that is not a row regenerate wrote is a ValueError naming
    the file and the line."""
    data = path.read_bytes() if data is None else data
    try:
        text = data[: data.rfind(b"\n") + 1].decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not a file regenerate wrote (byte {err.start} is not UTF-8 "
                         f"text); give another --out file") from None
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line:
            continue
        try:
            record = json.loads(line)
            if not (isinstance(record, dict) and isinstance(record["prompt_index"], int)
                    and isinstance(record["messages"], list)
                    and isinstance(record.get("settings", {}), dict)):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}: line {lineno} is not a row regenerate wrote; give another "
                             f"--out file") from None
        yield lineno, line, record


def answered(path: Path, prompts: Sequence[list[list[dict]]], shard: tuple[int, int],
             settings: Mapping) -> set[int]:
    """Prompt indices already answered in ``path``, whose rows must record ``settings``; a
    half-written last row is cut off, and only then, after every check has passed."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    rows = list(records(path, data))  # a file regenerate did not write is refused untouched
    complete = data.rfind(b"\n") + 1
    tail = data[complete:]
    if tail and not rows:
        raise ValueError(f"{path} is not a file regenerate wrote: it holds no complete row and "
                         f"does not end with a line break (regenerate writes its first row whole); "
                         f"it was left untouched: give another --out file")
    if tail and not (tail.startswith(ROW_START) or ROW_START.startswith(tail)):
        raise ValueError(f"{path}: its last line is not a row regenerate wrote; give another "
                         f"--out file")
    done = set()
    for lineno, _, record in rows:
        if "settings" not in record:
            raise ValueError(f"{path} line {lineno} records no settings (an older draftsmith wrote "
                             f"it), so continuing it cannot check that these rows are answered "
                             f"alike; give another --out file")
        differences = settings_differences(record["settings"], settings)
        if differences:
            raise ValueError(f"{path} was written with {'; '.join(differences)} (line {lineno}): "
                             f"continuing it would mix answers of other settings in one file; "
                             f"rerun with the settings it was written with, or give another "
                             f"--out file")
        index = record["prompt_index"]
        given = [m for m in record["messages"] if m.get("role") != "assistant"]
        turns = record.get("turns", 1)
        if not (0 <= index < len(prompts) and index % shard[1] == shard[0]
                and given == [m for turn in prompts[index][:turns] for m in turn]):
            raise ValueError(f"{path} line {lineno} answers another prompt than prompt {index} "
                             f"of these data (shard {shard[0]}/{shard[1]}); resume with the same "
                             f"data files and shards, or give another --out file")
        done.add(index)
    if tail:  # killed in the middle of writing a row: that row is answered again
        with open(path, "r+b") as f:
            f.truncate(complete)
    return done


class Writer:
    """Appends finished conversations to a JSONL file: flushed per line (a killed process loses
    nothing written), fsynced every few seconds and at the end (a crashed machine). The first row
    of an empty file is written whole, so that a file of ours never holds only part of a row."""

    def __init__(self, path: Path):
        self.path = path
        path.touch()
        self.file = None  # opened on the first write
        self.synced = time.monotonic()

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if self.file is None:
            if self.path.stat().st_size == 0:
                write_atomic(self.path.resolve(), line)  # (through a symbolic link, if one)
                self.file = open(self.path, "a", encoding="utf-8")  # closed by close()
                return
            self.file = open(self.path, "a", encoding="utf-8")
        self.file.write(line)
        self.file.flush()
        if time.monotonic() - self.synced > 5:
            os.fsync(self.file.fileno())
            self.synced = time.monotonic()

    def close(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()


def write_done(shard: Path, index: int, count: int, prompts: int, skipped: list[int]) -> None:
    write_atomic(done_path(shard), json.dumps({"shard": [index, count], "prompts": prompts,
                                               "skipped": skipped}))


def read_done(shard: Path, index: int, count: int) -> int:
    """How many prompts the finished shard ``index`` of ``count`` was given; a damaged mark is a
    ValueError naming it and what to do."""
    mark = done_path(shard)
    try:
        value = json.loads(mark.read_bytes().decode("utf-8"))
        prompts = value["prompts"]
        if not (isinstance(prompts, int) and not isinstance(prompts, bool) and prompts >= 0
                and value.get("shard", [index, count]) == [index, count]):
            raise TypeError
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{mark} is damaged (it is not the mark regenerate leaves when shard "
                         f"{index}/{count} finishes): rerun regenerate for shard {index}/{count} "
                         f"(it answers what is missing and marks the shard again), or delete it "
                         f"and merge with --partial") from None
    return prompts


def shard_count(out: Path) -> int:
    """The N of the ``OUT.shard-I-of-N`` files beside ``out``. A file named almost so (``-of-y``,
    I >= N) is no shard of ours: it is ignored, with a warning naming it."""
    stem, suffix = out.stem, out.suffix
    pattern = re.compile(rf"{re.escape(stem)}\.shard-(\d+)-of-(\d+){re.escape(suffix)}")
    found: set[int] = set()
    stray = []
    names = sorted(p.name for p in out.parent.iterdir()) if out.parent.is_dir() else []
    for name in names:
        if not (name.startswith(f"{stem}.shard-") and name.endswith(suffix)
                and not name.endswith(".done")):
            continue
        match = pattern.fullmatch(name)
        if match and int(match[1]) < int(match[2]) \
                and shard_path(out, int(match[1]), int(match[2])).name == name:
            found.add(int(match[2]))
        else:
            stray.append(name)
    for name in stray:
        print(f"[draftsmith] ignoring {out.parent / name}: its name is not {stem}.shard-I-of-N"
              f"{suffix} with whole numbers I < N, so it is no shard of {out.name}",
              file=sys.stderr, flush=True)
    if len(found) != 1:
        raise FileNotFoundError(
            f"no shard files {stem}.shard-I-of-N{suffix} in {out.parent or '.'}" if not found else
            f"shard files of several shard counts {sorted(found)} beside {out}; pass --shards")
    return found.pop()


def merge_shards(out_path: str | os.PathLike, num_shards: int | None = None, *,
                 partial: bool = False) -> int:
    """Join ``answers.shard-I-of-N.jsonl`` into ``out_path`` in input (prompt) order.

    ``num_shards`` defaults to the N of the shard files found. Every shard must have finished
    (regenerate marks it) unless ``partial``, and every row must record the same settings. An
    existing ``out_path`` is replaced only when every row in it is also in the shards, unchanged
    (an earlier merge of the same shards), so nothing written is lost. Written to a temporary
    file and renamed. Returns the number of rows.
    """
    out = Path(out_path)
    refuse_directory(out)
    if num_shards is not None and (isinstance(num_shards, bool) or not isinstance(num_shards, int)
                                   or num_shards < 1):
        raise ValueError(f"the number of shards (--shards) must be a whole number >= 1, got "
                         f"{num_shards!r}")
    if num_shards is None:
        num_shards = shard_count(out)
    paths = [shard_path(out, i, num_shards) for i in range(num_shards)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"shard files missing: {missing}; run regenerate for those shards")
    unfinished = [str(p) for p in paths if not done_path(p).is_file()]
    if unfinished and not partial:
        raise ValueError(f"shards not finished: {unfinished}; rerun regenerate for them (it "
                         f"continues where they stopped), or merge what is there with --partial")
    considered = {str(p): read_done(p, i, num_shards) for i, p in enumerate(paths)
                  if done_path(p).is_file()}
    if len(set(considered.values())) > 1 and not partial:
        raise ValueError(f"the shards answered different numbers of prompts {considered} (other "
                         f"--max-prompts or data); rerun the short ones with the same settings, "
                         f"or merge what is there with --partial")
    lines: dict[int, str] = {}
    first: tuple[Path, int, dict] | None = None  # the first row's settings, which all must share
    for path in paths:
        for lineno, line, record in records(path):
            index = record["prompt_index"]
            if index in lines:
                raise ValueError(f"{path} line {lineno}: prompt {index} is answered twice in the "
                                 f"shards of {out}; were shards of different runs mixed?")
            settings = record.get("settings", {})
            if first is None:
                first = (path, lineno, settings)
            differences = settings_differences(first[2], settings, f"{path.name} line {lineno}")
            if differences:
                raise ValueError(f"{path} line {lineno} was answered with other settings than "
                                 f"{first[0]} line {first[1]}, which has {'; '.join(differences)}: "
                                 f"shards of different runs; rerun that shard with the same "
                                 f"settings into another --out")
            lines[index] = line
    if out.exists():
        data = out.read_bytes()
        if data and not data.endswith(b"\n"):
            raise ValueError(f"{out} exists and is not a file merge or regenerate wrote (it does "
                             f"not end with a line break): merging would replace it; give another "
                             f"--out file")
        for lineno, line, record in records(out, data):
            if lines.get(record["prompt_index"]) != line:
                raise ValueError(f"{out} exists and line {lineno} is not in the shards: merging "
                                 f"would lose it; give another output file")
    write_atomic(out, "".join(lines[i] + "\n" for i in sorted(lines)))
    return len(lines)
