#!/usr/bin/env bash
# The GPU path in one short run (at most 12 minutes on one H200): EAGLE-3's flex attention against
# the SDPA kernel (scripts/flex_check.py); bf16 training steps of each trainer on the embedded
# target with token-budget batches, through python -m draftsmith.train.speed (real tokens/s beside the
# target's own forward, the allocator's peak beside draftsmith.train.memory's estimate), every SDPA call in
# the fused kernels (fused_attention_only: a fall-back to the math kernel fails the stage); the
# sharded path (torchrun over every GPU, FSDP2, a checkpoint resumed exactly); then draftsmith.eval.bench on
# GPU (greedy, identical tokens checked, speedups reported), into $OUT (default reports/gpu/). The 8B recipes need the 8B targets, which this script does not
# download: `python -m draftsmith.train.memory --config configs/eagle/llama-3.1-8b-instruct.yaml
# --processes 8` gives their estimate once the target is in the local Hugging Face cache.
#
#   scripts/gpu_check.sh            # needs a CUDA torch, the project installed (make install)
#
# Every stage has its own time limit so that one slow stage cannot eat the others' time; a stage
# that fails is reported and the script goes on, exiting non-zero at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-reports/gpu}
DATA=${DATA:-data/train/selfdistill_answers.jsonl.gz}
mkdir -p "$OUT"
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
failed=0

"$PYTHON" - <<'EOF' || exit 2
import torch
assert torch.cuda.is_available(), "no CUDA device: scripts/gpu_check.sh checks the GPU path"
print("GPU:", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB,",
      "bf16" if torch.cuda.is_bf16_supported() else "no bf16")
EOF

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, keep its output, note a failure
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  if ! timeout "$limit" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"; then
    echo "   FAILED: see $OUT/$name.log"; tail -5 "$OUT/$name.log"; failed=1
  else
    tail -c 600 "$OUT/$name.json"; echo
  fi
}

# flex attention (compiled) against the SDPA kernel on the GPU: outputs, autograd gradients, and
# the memory of a long packed row (no (n, n) scores)
stage flex_attention 150 "$PYTHON" scripts/flex_check.py

# bf16 training steps, token-budget batches, each trainer on the embedded target; the fused
# attention kernels only (a fall-back to the math kernel fails the stage)
FUSED=(--mixed_precision bf16 --fused_attention_only true)
stage speed_eagle3 90 "$PYTHON" -m draftsmith.train.speed --config configs/eagle/smollm2-135m.yaml \
  --data "$DATA" --max_length 2048 --max_tokens_per_batch 16384 --steps 10 --warmup 3 "${FUSED[@]}"
stage speed_eagle3_ckpt 90 "$PYTHON" -m draftsmith.train.speed --config configs/eagle/smollm2-135m.yaml \
  --data "$DATA" --max_length 2048 --max_tokens_per_batch 16384 --steps 10 --warmup 3 \
  --gradient_checkpointing true "${FUSED[@]}"
stage speed_eagle3_packed 90 "$PYTHON" -m draftsmith.train.speed --config configs/eagle/smollm2-135m.yaml \
  --data "$DATA" --max_length 2048 --max_tokens_per_batch 16384 --steps 10 --warmup 3 \
  --packing true "${FUSED[@]}"
stage speed_medusa 60 "$PYTHON" -m draftsmith.train.speed --config configs/medusa/smollm2-135m.yaml \
  --data "$DATA" --max_length 2048 --max_tokens_per_batch 16384 --steps 10 --warmup 3 "${FUSED[@]}"
stage speed_distill 60 "$PYTHON" -m draftsmith.train.speed --config configs/distill/smollm2-135m.yaml \
  --data "$DATA" --max_length 2048 --max_tokens_per_batch 16384 --steps 10 --warmup 3 \
  --on_policy_ratio 0 "${FUSED[@]}"

# the sharded path: torchrun over every GPU, FSDP2, the target sharded over the GPUs, a checkpoint
# resumed exactly (scripts/sharded_check.sh)
stage sharded 300 env OUT="$OUT" DATA="$DATA" PYTHON="$PYTHON" scripts/sharded_check.sh

# the benchmark on GPU: plain decoding, prompt lookup and the shipped heads where present
methods=(--method hf --method plain --method hf-pld --method draft:truncate:8)
for artifact in artifacts/smollm2-135m/eagle3 artifacts/smollm2-135m/medusa1; do
  [ -d "$artifact" ] && methods+=(--method "$(basename "$artifact" | tr -d '0-9'):$artifact")
done
stage bench 180 "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --device cuda "${methods[@]}" \
  --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 --max-new-tokens 128 \
  --temperature 0 --out "$OUT/bench_t0_report.json"

echo "reports in $OUT"
exit $failed
