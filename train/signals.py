"""Stopping on SIGINT / SIGTERM: finish the step, save a checkpoint, leave; a second signal aborts."""

from __future__ import annotations

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


class GracefulStop:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each optimizer step.

    The first signal lets the current step finish; the loop then saves a checkpoint and leaves.
    A second signal aborts at once (KeyboardInterrupt) without saving; the newest complete
    checkpoint stays intact. A repeat within ``grace_s`` seconds counts as the same signal:
    launchers forward a Ctrl-C the workers already received from the terminal (torchrun sends the
    same signal again, then SIGKILL after 30 s). Used as ``with GracefulStop(accelerator) as
    stop:``; outside the main thread no handler can be installed and only :meth:`request` stops.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, accelerator: Accelerator | None = None, grace_s: float = 1.0):
        self.accelerator = accelerator
        self.grace_s = grace_s
        self.reason: str | None = None
        self._first_at = 0.0
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
        if self.reason is not None:
            if now - self._first_at < self.grace_s:
                return
            self.__exit__()
            raise KeyboardInterrupt(f"second stop signal ({name}): aborting without saving")
        self.reason = name
        self._first_at = now
        # os.write, not print: the handler may interrupt a print to the same stream
        os.write(sys.stderr.fileno(), (
            f"\n[draftsmith] {name} received: finishing this step, saving a checkpoint, then "
            f"stopping (send {name} again to abort at once)\n").encode())

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
