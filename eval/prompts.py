"""Evaluation prompt files: MT-bench / Spec-Bench style JSONL (``turns``) or plain text.

* ``.jsonl`` / ``.json`` lines: an object with ``turns`` (a list of user turns; the first is used
  unless another turn is asked for), or ``prompt`` / ``question`` / ``instruction`` / ``text``.
* anything else: plain text, one prompt per non-empty line.
"""

from __future__ import annotations

import json
from pathlib import Path

_TEXT_KEYS = ("prompt", "question", "instruction", "text")


def read_prompts(path: str | Path, turn: int = 0, limit: int | None = None) -> list[str]:
    """User prompts from ``path`` (first ``limit`` of them)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read prompt file {path}: {err}") from err
    prompts: list[str] = []
    if path.suffix in (".jsonl", ".json"):
        for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({err.msg})") from err
            prompts.append(_prompt_of(row, turn, f"{path}:{lineno}"))
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts[:limit] if limit else prompts


def _prompt_of(row, turn: int, where: str) -> str:
    if isinstance(row, dict) and isinstance(row.get("turns"), list):
        turns = row["turns"]
        if turn >= len(turns):
            raise ValueError(f"{where} has {len(turns)} turns; turn {turn} was asked for")
        value = turns[turn]
    elif isinstance(row, dict) and any(isinstance(row.get(k), str) for k in _TEXT_KEYS):
        value = next(row[k] for k in _TEXT_KEYS if isinstance(row.get(k), str))
    else:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(
            f"{where}: expected an object with 'turns' (MT-bench, Spec-Bench) or one of "
            f"{list(_TEXT_KEYS)}, found {keys}"
        )
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: the prompt is empty or not a string")
    return value
