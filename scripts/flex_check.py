"""EAGLE-3's flex attention on a GPU (scripts/gpu_check.sh): the compiled flex kernel against the
fused SDPA kernel, outputs and autograd gradients through the test-time steps, with packed
documents and holes; and what a long packed row's seven steps add to the allocator's peak,
beside the (B, H, n, 7n) fp32 scores the math kernel would materialise. Prints one JSON object;
exits non-zero when the kernels disagree or the memory is of that order.

    python scripts/flex_check.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.heads.ttt_attention import documents_of, flex_ttt_attention, sdpa_ttt_attention  # noqa: E402


def kernels_agree(device: str = "cuda") -> dict[str, float]:
    """Largest relative difference of outputs and gradients, flex vs SDPA, per case."""
    torch.manual_seed(0)
    worst = {}
    for n, packed, holes in ((300, False, False), (700, True, False), (500, False, True)):
        q = torch.randn(2, 8, n, 64, device=device)
        keys = [torch.randn(2, 2, n, 64, device=device) for _ in range(4)]
        values = [torch.randn(2, 2, n, 64, device=device) for _ in range(4)]
        documents = None
        if packed:
            positions = torch.cat([torch.arange(n // 2), torch.arange(n - n // 2)])
            documents = documents_of(positions.to(device)[None].expand(2, -1))
        valid = None
        if holes:
            valid = torch.ones(2, n, dtype=torch.bool, device=device)
            valid[1, :7] = False
        rows = 1 if valid is None else valid[:, None, :, None]
        probe = torch.randn(2, 8, n, 64, device=device) * rows
        for steps in (1, 2, 4):
            results = []
            for kernel in (flex_ttt_attention, sdpa_ttt_attention):
                inputs = [x.clone().requires_grad_() for x in (q, *keys[:steps], *values[:steps])]
                out = kernel(inputs[0], inputs[1:1 + steps], inputs[1 + steps:], scaling=0.125,
                             key_valid=valid, documents=documents)
                (out * probe).sum().backward()
                results.append([out.detach() * rows] + [x.grad for x in inputs])
            worst[f"n{n}{'_packed' if packed else ''}{'_holes' if holes else ''}_steps{steps}"] = \
                max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
                    for a, b in zip(*results, strict=True))
    return worst


def long_row_memory(n: int = 16384, steps: int = 7, device: str = "cuda") -> tuple[float, float]:
    """(GiB the flex steps of one packed row of n tokens add at their peak, GiB of the math
    kernel's fp32 scores of the last step), 32 heads / 8 kv of 128, bf16."""
    q = torch.randn(1, 32, n, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    keys = [torch.randn(1, 8, n, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(steps)]
    documents = documents_of((torch.arange(n, device=device) % 2048)[None])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    flex_ttt_attention(q, keys, keys, scaling=0.088, documents=documents).sum().backward()
    torch.cuda.synchronize()
    added = (torch.cuda.max_memory_allocated() - before) / 2**30
    return added, 32 * n * steps * n * 4 / 2**30


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: scripts/flex_check.py checks the GPU kernels", file=sys.stderr)
        return 2
    worst = kernels_agree()
    added, scores = long_row_memory()
    print(json.dumps({"relative_difference": worst, "long_row_added_gib": round(added, 3),
                      "math_kernel_scores_gib": round(scores, 1)}))
    if max(worst.values()) > 1e-3:
        print(f"flex and SDPA disagree: {worst}", file=sys.stderr)
        return 1
    if added > scores / 50:
        print(f"flex added {added:.2f} GiB, of the order of the {scores:.1f} GiB of scores",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
