"""How an export check reports: one line per thing verified, failed or not verified here.

``draftsmith export ... --check`` reads an export back and runs the consumer checks that
can run on this machine; each layout's check prints its verdicts with :func:`say` and names what
it could not verify (the consumer needs a GPU build, say) rather than passing it silently.
"""

from __future__ import annotations

import torch


def say(kind: str, text: str) -> None:
    """One verdict line: ``kind`` is "verified", "FAILED" or "not verified"."""
    print(f"{kind:>13}: {text}", flush=True)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())
