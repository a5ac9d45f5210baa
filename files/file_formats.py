"""Reading the files draftsmith is handed: one error type when a file is not what it should be.

Every reader at a file boundary (artifacts, checkpoints, targets, data, caches) raises
:class:`FileFormatError` for a file that exists but cannot be read as what it should be (truncated,
garbled, another format): a ``ValueError`` whose message names the file, says what was wrong and
what to do. A file that does not exist stays a ``FileNotFoundError``.

    config = read_json_object(path, fix="re-export the artifact")
    state = load_safetensors(path, fix="re-export the artifact")
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file


class FileFormatError(ValueError):
    """A file that exists but cannot be read as what it should be.

    ``path`` is the file, ``problem`` what was wrong with it, ``fix`` what to do; the message is
    ``"<path>: <problem>; <fix>"``.
    """

    def __init__(self, path: str | os.PathLike, problem: str, fix: str):
        self.path = Path(path)
        self.problem = problem
        self.fix = fix
        super().__init__(f"{self.path}: {problem}; {fix}")


def read_json_object(path: str | os.PathLike, *, fix: str) -> dict:
    """The JSON object in ``path``; :class:`FileFormatError` (with ``fix``) if it is not one."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileFormatError(path, f"is not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x})",
                              fix) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        what = "is empty" if not text.strip() else (
            f"is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})")
        raise FileFormatError(path, what, fix) from None
    if not isinstance(value, dict):
        raise FileFormatError(path, f"holds a JSON {type(value).__name__}, not an object", fix)
    return value


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """What is wrong with a safetensors file (None: its header and size are whole), read cheaply.

    safetensors checks that the header's tensors cover the file exactly, so a truncated file or one
    with bytes missing is caught without reading the tensors.
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                handle.get_slice(name).get_shape()
    except SafetensorError as err:
        return f"is not a complete safetensors file ({err})"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    return None


def load_safetensors(path: str | os.PathLike, *, fix: str,
                     device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; :class:`FileFormatError` if it is damaged."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; {fix}")
    try:
        return load_file(str(path), device=str(device))
    except SafetensorError as err:
        raise FileFormatError(path, f"is not a complete safetensors file ({err})", fix) from None
