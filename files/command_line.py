"""The command lines' one error tail: a user's mistake ends in one line and exit status 2.

Every ``python -m ...`` entry point runs its ``main`` through :func:`run_command`: a
``ValueError`` or ``FileNotFoundError`` (what library code raises at a boundary, saying what it
received and what to do) is printed as ``<prog>: error: <message>`` instead of a traceback.
Anything else is a bug and keeps its traceback.

The same commands run as ``draftsmith <command>`` (``draftsmith/cli.py``); there the dispatcher
calls :func:`invoked_as`, and every parser and error tail names the command the user typed
(:func:`program`).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable

USER_ERRORS = (ValueError, FileNotFoundError)
_INVOKED_AS: dict[str, str] = {}  # a module's own program name -> the name the user typed


def invoked_as(module_program: str, typed: str) -> None:
    """Say that the command whose parser is named ``module_program`` (``python -m draftsmith.eval.bench``)
    was started as ``typed`` (``draftsmith bench``)."""
    _INVOKED_AS[module_program] = typed


def program(module_program: str) -> str:
    """The name to show for a command: what the user typed to start it."""
    return _INVOKED_AS.get(module_program, module_program)


def run_command(main: Callable[[], object], prog: str) -> int:
    """Run ``main()``; -> its exit status (an int it returns, else 0), or 2 on a user error."""
    try:
        result = main()
    except USER_ERRORS as err:
        print(f"{program(prog)}: error: {err}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def shell_command(*words: str | os.PathLike) -> str:
    """A command line to print for the user to paste: each word quoted for the shell (a path with
    a space or a quote stays one word)."""
    return shlex.join(os.fspath(w) for w in words)
