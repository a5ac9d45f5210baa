"""Stopping on SIGINT / SIGTERM: finish the step, save a checkpoint, leave; a second signal aborts.

A trainer started by ``accelerate launch`` follows its launcher (:func:`follow_launcher`): in
accelerate 1.15 the launcher of a single process (``simple_launcher``) waits on the trainer with
``subprocess.Popen`` and handles no signal, so a SIGTERM sent to the launcher alone ended the
launcher and left the trainer running to its end unattended. Linux now sends the trainer SIGTERM
the moment its launcher exits, however it ended, and the trainer stops as it would on its own
SIGTERM. (Multi-GPU launches run torchrun inside the launcher, which forwards SIGTERM to every
worker itself and kills them 30 s later: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` gives a slow save
more time.)
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_followed_launcher: int | None = None  # pid of the accelerate launcher this process follows


def _command_line(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def is_accelerate_launch(argv: list[str]) -> bool:
    """Whether a command line is accelerate's launcher: ``accelerate launch ...`` (the console
    script) or ``python -m accelerate.commands.launch ...``."""
    names = [os.path.basename(part) for part in argv]
    if "accelerate" in names and "launch" in argv[names.index("accelerate") + 1:]:
        return True
    modules = [argv[i + 1] for i, part in enumerate(argv[:-1]) if part == "-m"]
    return any(m in ("accelerate.commands.launch", "accelerate.commands.accelerate_cli")
               for m in modules)


def follow_launcher() -> int | None:
    """Have this process receive SIGTERM when the ``accelerate launch`` that started it exits.

    Applies when the parent process is accelerate's launcher and this is not a torchrun worker
    (``LOCAL_RANK`` unset: torchrun forwards signals itself), on Linux (``prctl``
    ``PR_SET_PDEATHSIG``). Returns the launcher's pid, or None when nothing is followed. If the
    launcher has already gone by the time this runs, SIGTERM is sent at once.
    """
    global _followed_launcher
    if _followed_launcher is not None:
        return _followed_launcher
    if not sys.platform.startswith("linux") or "LOCAL_RANK" in os.environ:
        return None
    parent = os.getppid()
    if not is_accelerate_launch(_command_line(parent)):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return None
    _followed_launcher = parent
    if os.getppid() != parent:  # it exited between the check and prctl
        os.kill(os.getpid(), signal.SIGTERM)
    return parent


def launcher_exited() -> bool:
    """Whether the accelerate launcher this process follows has exited."""
    return _followed_launcher is not None and os.getppid() != _followed_launcher


class GracefulStop:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each optimizer step.

    The first signal lets the current step finish; the loop then saves a checkpoint and leaves.
    A second signal aborts at once (KeyboardInterrupt) without saving; the newest complete
    checkpoint stays intact. A repeat within ``grace_s`` seconds counts as the same signal:
    launchers forward a Ctrl-C the workers already received from the terminal (torchrun sends the
    same signal again, then SIGKILL after 30 s), and the SIGTERM of an exiting ``accelerate
    launch`` (:func:`follow_launcher`) never counts as a second signal. Used as ``with GracefulStop(accelerator) as
    stop:``; outside the main thread no handler can be installed and only :meth:`request` stops.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, accelerator: Accelerator | None = None, grace_s: float = 1.0):
        self.accelerator = accelerator
        self.grace_s = grace_s
        self.reason: str | None = None
        self._first_at = 0.0
        self._launcher_seen = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        # the one SIGTERM that follow_launcher arranges when the launcher exits (after a Ctrl-C
        # the launcher received too, say) belongs to the stop already under way
        from_launcher = (signum == signal.SIGTERM and launcher_exited()
                         and not self._launcher_seen)
        self._launcher_seen = self._launcher_seen or from_launcher
        if self.reason is not None:
            if now - self._first_at < self.grace_s or from_launcher:
                return
            self.__exit__()
            raise KeyboardInterrupt(f"second stop signal ({name}): aborting without saving")
        self.reason = name
        self._first_at = now
        why = " (its launcher, accelerate launch, exited)" if from_launcher else ""
        # os.write, not print: the handler may interrupt a print to the same stream
        os.write(sys.stderr.fileno(), (
            f"\n[draftsmith] {name} received{why}: finishing this step, saving a checkpoint, "
            f"then stopping (send {name} again to abort at once)\n").encode())

    def request(self, reason: str = "stop requested") -> None:
        """Stop after the current step, as a signal would (for time limits and tests)."""
        self.reason = reason

    def should_stop(self) -> bool:
        """Whether any process was asked to stop. Every process must call it at the same step."""
        local = self.reason is not None
        accelerator = self.accelerator
        if accelerator is None or accelerator.num_processes == 1:
            return local
        if accelerator.distributed_type == DistributedType.NO:
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=accelerator.device)
        agreed = bool(accelerator.reduce(flag, reduction="sum").item() > 0)
        if agreed and self.reason is None:
            self.reason = "a stop signal on another process"
        return agreed

    def message(self, state, checkpoint: Path) -> str:
        return (f"[draftsmith] stopped by {self.reason} after step {state.step} of "
                f"{state.total_steps}; checkpoint {checkpoint}; continue with --resume latest "
                f"(same --output_dir)")
