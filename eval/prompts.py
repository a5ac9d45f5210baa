"""Evaluation prompt files: MT-bench / Spec-Bench JSONL (``turns``, ``category``) or plain text.

* ``.jsonl`` / ``.json`` lines: an object with ``turns`` (a list of user turns; the first is used
  unless another turn is asked for), or ``prompt`` / ``question`` / ``instruction`` / ``text``.
  ``category`` (MT-bench: writing, roleplay, ...; Spec-Bench: translation, summarization, qa,
  math_reasoning, rag and the eight MT-bench ones) and ``question_id`` are kept when present;
  other keys (Spec-Bench's ``reference``) are ignored. Spec-Bench's ``data/spec_bench/question.jsonl``
  reads as it is published. HumanEval's ``HumanEval.jsonl.gz`` (``prompt``: a function's
  signature and docstring, to be completed as code) reads as it is too: a file ending ``.gz`` is
  gzip-compressed and read as the file without that ending.
* anything else: plain text, one prompt per non-empty line, no category.

Rows that lack the turn asked for (Spec-Bench mixes one- and two-turn rows) are skipped and
counted, never silently.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_TEXT_KEYS = ("prompt", "question", "instruction", "text")


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str | None = None
    id: str | int | None = None  # question_id when the file has one, else the line number


@dataclass
class PromptSet:
    prompts: list[Prompt]
    skipped: Counter = field(default_factory=Counter)  # reason -> rows skipped for it

    @property
    def categories(self) -> list[str]:
        """Categories in order of first appearance (empty when no prompt has one)."""
        return list(dict.fromkeys(p.category for p in self.prompts if p.category is not None))


def _positive(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an integer >= 1 (or None for all), got {value!r}")


def load_prompts(path: str | Path, *, turn: int = 0, limit: int | None = None,
                 per_category: int | None = None,
                 categories: list[str] | None = None) -> PromptSet:
    """Prompts of ``path`` with their category.

    ``categories``: keep only these (each must have prompts). ``per_category``: the first N of
    each category (prompts without one form their own group). ``limit``: then the first N.
    """
    _positive("limit", limit)
    _positive("per_category", per_category)
    if isinstance(turn, bool) or not isinstance(turn, int) or turn < 0:
        raise ValueError(f"turn must be an integer >= 0 (0 = the first turn), got {turn!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    compressed = path.suffix == ".gz"
    try:
        data = path.read_bytes()
        text = (gzip.decompress(data) if compressed else data).decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read prompt file {path}: {err}") from err
    prompts: list[Prompt] = []
    skipped: Counter = Counter()
    if (path.with_suffix("") if compressed else path).suffix in (".jsonl", ".json"):
        for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({err.msg})") from err
            prompt = _prompt_of(row, turn, f"{path}:{lineno}", lineno)
            if prompt is None:
                skipped[f"no turn {turn + 1}"] += 1
            else:
                prompts.append(prompt)
    else:
        prompts = [Prompt(line.strip(), None, lineno)
                   for lineno, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not prompts:
        detail = f" ({sum(skipped.values())} rows have no turn {turn + 1})" if skipped else ""
        raise ValueError(f"prompt file {path} holds no prompts{detail}")
    if categories:
        found = Counter(p.category for p in prompts)
        missing = [c for c in categories if not found[c]]
        if missing:
            have = sorted(c for c in found if c is not None)
            raise ValueError(f"{path} has no prompts in categor{'ies' if len(missing) > 1 else 'y'} "
                             f"{missing}; its categories are {have or 'none'}")
        prompts = [p for p in prompts if p.category in categories]
    if per_category:
        taken: Counter = Counter()
        kept = []
        for p in prompts:
            if taken[p.category] < per_category:
                taken[p.category] += 1
                kept.append(p)
        prompts = kept
    return PromptSet(prompts[:limit] if limit else prompts, skipped)


def read_prompts(path: str | Path, turn: int = 0, limit: int | None = None) -> list[str]:
    """The prompt texts alone (the first ``limit``), for training-time acceptance measurements."""
    return [p.text for p in load_prompts(path, turn=turn, limit=limit).prompts]


def _prompt_of(row, turn: int, where: str, lineno: int) -> Prompt | None:
    if isinstance(row, dict) and isinstance(row.get("turns"), list):
        turns = row["turns"]
        if turn >= len(turns):
            return None
        value = turns[turn]
    elif isinstance(row, dict) and any(isinstance(row.get(k), str) for k in _TEXT_KEYS):
        if turn:
            return None
        value = next(row[k] for k in _TEXT_KEYS if isinstance(row.get(k), str))
    else:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(
            f"{where}: expected an object with 'turns' (MT-bench, Spec-Bench) or one of "
            f"{list(_TEXT_KEYS)}, found {keys}"
        )
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: the prompt is empty or not a string")
    category = row.get("category")
    if category is not None and not isinstance(category, str):
        raise ValueError(f"{where}: 'category' must be a string, got {category!r}")
    qid = row.get("question_id", lineno)
    if not isinstance(qid, (str, int)) or isinstance(qid, bool):
        qid = lineno
    return Prompt(value, category or None, qid)
