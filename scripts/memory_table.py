"""The README's memory table: every shipped 8B / 70B recipe's estimate for 8 GPUs, bf16.

    python scripts/memory_table.py

Reads config.json files only (data/target_configs/ until a target is downloaded); prints one
markdown row per recipe: frozen target, trained module (held: fp32 weights and AdamW's moments,
DDP's buckets or FSDP2's share), the forward-and-backward and optimizer-step phases (each alone at
its time), and the peak (process term + held + the larger phase), in GiB.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftsmith.train.config import parse_config  # noqa: E402
from draftsmith.train.recipes import trainer_of  # noqa: E402

GIB = 2**30
ROWS = [
    ("configs/eagle/llama-3.1-8b-instruct.yaml", [], False, ""),
    ("configs/eagle/qwen3-8b.yaml", [], False, ""),
    ("configs/medusa/llama-3.1-8b-instruct.yaml", [], False, ""),
    ("configs/medusa/qwen3-8b.yaml", [], False, ""),
    ("configs/distill/llama-3.1-8b-instruct.yaml", [], False, ""),
    ("configs/distill/qwen3-8b.yaml", [], False, ""),
    ("configs/dflash/llama-3.1-8b-instruct.yaml", [], False, ""),
    ("configs/dflash/qwen3-8b.yaml", [], False, ""),
    ("configs/eagle/llama-3.3-70b-instruct.yaml", [], False, ", target over 8, DDP"),
    ("configs/eagle/llama-3.3-70b-instruct.yaml", [], True, ", `fsdp2.yaml` (the head over 8)"),
    ("configs/dflash/llama-3.3-70b-instruct.yaml", [], True, ", target over 8, `fsdp2.yaml`"),
    ("configs/eagle/llama-3.3-70b-instruct.yaml", ["--target_parallel", "1"], False,
     " with the target whole on each GPU"),
    ("configs/eagle/llama-3.1-8b-instruct.yaml", ["--gradient_checkpointing", "false"], False,
     ", `gradient_checkpointing: false`"),
    ("configs/medusa/llama-3.1-8b-instruct.yaml", ["--share_lm_head", "false"], False,
     ", `share_lm_head: false`"),
]


def row(config: str, extra: list[str], fsdp2: bool, note: str) -> str:
    trainer = trainer_of(str(REPO / config), None)
    cfg = parse_config(trainer.config_class, ["--config", str(REPO / config), *extra])
    est = trainer.memory.estimate_run(cfg, "cuda", 8, 8 if fsdp2 else 1)
    phases = est.phase_bytes()
    frozen = sum(v for k, v in est.parts.items() if k.startswith("frozen target"))
    trained = sum(v for k, v in est.parts.items() if k.startswith("trained"))
    peak = f"**{est.total / GIB:.1f}**"
    if est.total > 80 * GIB:
        peak += " (over an 80 GB GPU)"
    return (f"| `{config}`{note} | {est.tokens} | {frozen / GIB:.1f} | {trained / GIB:.1f} | "
            f"{phases.get('forward and backward', 0) / GIB:.1f} | "
            f"{phases.get('optimizer step', 0) / GIB:.1f} | {peak} |")


def main() -> None:
    print("| recipe | tokens per micro-batch | frozen target | trained (held) | forward and backward "
          "| optimizer step | peak |")
    print("|---|---|---|---|---|---|---|")
    for spec in ROWS:
        print(row(*spec))


if __name__ == "__main__":
    main()
