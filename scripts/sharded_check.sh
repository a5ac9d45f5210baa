#!/usr/bin/env bash
# The sharded training path on every GPU of this machine (scripts/gpu_check.sh runs it): torchrun
# with the environment configs/accelerate/fsdp2.yaml gives (the head under FSDP2), the target's
# decoder layers sharded over the GPUs when there are several (one GPU: FSDP2 over one process,
# the target whole), packed rows, every SDPA call in the fused kernels; 6 bf16 steps of EAGLE-3
# on the embedded target, then the step-3 checkpoint resumed: steps 4-6 again, the same losses.
# Prints one JSON object; exits non-zero on any failure.
#   OUT=reports/gpu DATA=data/train/selfdistill_answers.jsonl.gz scripts/sharded_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-reports/gpu}
DATA=${DATA:-data/train/selfdistill_answers.jsonl.gz}
gpus=$(nvidia-smi -L | wc -l)
args=(--config configs/eagle/smollm2-135m.yaml --data "$DATA" --max_length 2048
      --max_tokens_per_batch 16384 --max_steps 6 --save_every 3 --eval_every 0 --log_every 1
      --target_parallel "$gpus" --packing true --report_to none --mixed_precision bf16
      --fused_attention_only true)
rm -rf "$OUT/sharded" "$OUT/sharded_resumed"
export ACCELERATE_USE_FSDP=true FSDP_VERSION=2 WANDB_MODE=disabled
torchrun --standalone --nproc_per_node "$gpus" train/eagle.py "${args[@]}" \
  --output_dir "$OUT/sharded" >&2
torchrun --standalone --nproc_per_node "$gpus" train/eagle.py "${args[@]}" \
  --output_dir "$OUT/sharded_resumed" --resume "$OUT/sharded/checkpoints/step_3" >&2
"$PYTHON" - "$OUT" "$gpus" <<'EOF'
import json, sys
out, gpus = sys.argv[1], int(sys.argv[2])
def losses(run):
    rows = map(json.loads, open(f"{out}/{run}/metrics.jsonl"))
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
first, resumed = losses("sharded"), losses("sharded_resumed")
print(json.dumps({"gpus": gpus, "losses": first, "resumed": resumed}))
assert all(abs(first[s] - resumed[s]) <= 1e-3 * abs(first[s]) for s in (4, 5, 6)), resumed
EOF
