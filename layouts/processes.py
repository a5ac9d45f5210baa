"""Child processes a command starts (llama-server, the GGUF converter) stopped however the command
ends: SIGTERM, SIGINT and SIGHUP raise :class:`Stopped` where the command runs, so every cleanup
runs and the servers it started are reaped; sections that start or stop a process hold the
signal until they are whole (:func:`signals_held`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(SystemExit):
    """The command was stopped by a signal: raised where it ran, so that every cleanup runs;
    its exit status is 128 + the signal's number (143 for SIGTERM, 130 for Ctrl-C)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


_signals = {"installed": 0, "held": 0, "pending": None, "raised": False}


def _on_signal(signum, frame) -> None:
    if _signals["pending"] is not None:  # already stopping: the cleanup under way finishes
        return
    _signals["pending"] = signum
    if not _signals["held"]:
        _signals["raised"] = True
        raise Stopped(signum)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """A section a stop must not cut in two (a process started and recorded, a process stopped
    and reaped): a signal arriving inside it is acted on at its end."""
    _signals["held"] += 1
    try:
        yield
    finally:
        _signals["held"] -= 1
        if not _signals["held"] and _signals["pending"] is not None and not _signals["raised"]:
            _signals["raised"] = True  # the stop wins over whatever else ended the section
            raise Stopped(_signals["pending"])


@contextlib.contextmanager
def stop_on_signals(prog: str) -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP raise :class:`Stopped` in the main thread while the block runs
    (a repeated signal does not cut the cleanup short); the stop is said in one line on stderr.
    The previous handlers are put back after it. Elsewhere than the main thread: nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _on_signal) for sig in STOP_SIGNALS}
    _signals["installed"] += 1
    try:
        yield
    except Stopped as stop:
        print(f"{prog}: stopped by {signal.Signals(stop.signum).name}: the processes it started "
              "were stopped and its temporary files removed", file=sys.stderr, flush=True)
        raise
    finally:
        _signals["installed"] -= 1
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not _signals["installed"]:
            _signals.update(pending=None, raised=False)


def end_process(process: subprocess.Popen, *, group: bool = False, grace: float = 15.0) -> None:
    """SIGTERM (to its process group when ``group``), SIGKILL after ``grace`` seconds; reaped."""
    with signals_held():
        if process.poll() is not None:
            return
        send = (lambda sig: os.killpg(process.pid, sig)) if group else process.send_signal
        with contextlib.suppress(ProcessLookupError):
            send(signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                send(signal.SIGKILL)
            process.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
