"""The one place the engine reads device values on the host.

A serving engine's round reads the device once: the accepted path and the next token, to know
what was emitted and how long the sequence is. Every value the engine, its proposers and its
acceptance rules bring to the host goes through :func:`to_host`, so the count of reads per round
is a number the benchmark reports (``host_reads_per_round``) and a test checks; on a GPU each
read is a synchronisation that idles the device until the work queued before it is done.
"""

from __future__ import annotations

import torch

_reads = 0


def to_host(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``, counted."""
    global _reads
    _reads += 1
    return tensor.tolist()


def host_reads() -> int:
    """Reads so far in this process (differences of it count a stretch of work)."""
    return _reads
