#!/usr/bin/env bash
# The EAGLE-3 demo on a CPU: data -> training -> export -> benchmark, about 15 minutes on 2 cores.
#
#   scripts/demo.sh [OUTPUT_DIR]          (default runs/demo; `make demo` runs this)
#
# It runs the main job of the project on the embedded target (SmolLM2-135M-Instruct) with the
# data shipped in data/, in four stages, and prints how long each took:
#
#   1. data:      tokenise the training rows with the target's chat template and report what was
#                 used, skipped or truncated (the trainer reads the same cache);
#   2. training:  draftsmith train configs/eagle/smollm2-135m.yaml (accelerate launch
#                 train/eagle.py --config ...)
#                 with the config's recipe, the one the shipped head was trained with (4
#                 training-time-test steps, a 4096-token draft vocabulary, the decoder layer
#                 started from the target's layer 27, lr 1e-3, 2048-token batches), shortened to
#                 DEMO_STEPS optimizer steps; acceptance (tau) measured at the start, every 40
#                 steps and at the end on 2 Vicuna-bench prompts (held out: never trained on);
#   3. export:    draftsmith export ... --format vllm (the layout vLLM and SGLang load);
#   4. benchmark: draftsmith bench on 5 MT-bench prompts, 128 tokens each: plain
#                 transformers generate (hf), its prompt lookup (hf-pld) and assisted generation
#                 with an untrained truncated draft (hf-assisted), beside the freshly trained head
#                 and the shipped one (artifacts/smollm2-135m/eagle3), exact greedy decoding
#                 throughout. Each head's tree is chosen by --tree auto: its acceptance measured
#                 on 8 Vicuna-bench prompts, this machine's costs measured (about a minute).
#                 The engine runs eagerly here (COMPILE=max to compile it): on 5 prompts the
#                 minutes a compiled target takes to build outweigh the ~25% it saves a round.
#
# The training data are the target's own answers to 9k prompts, shipped compressed in
# data/train/selfdistill9k_answers.jsonl.gz (data/SOURCES.md says how they were made), as EAGLE
# recommends.
#
# The demo's few minutes of training give a head well short of the shipped one (66 minutes of
# the same recipe); the point is the pipeline and its measurements. Rerunning continues from the
# checkpoints in OUTPUT_DIR.
#
# Settings (environment): PYTHON (python3), THREADS (2: torch threads), DEMO_STEPS (80),
# DEMO_PROMPTS (5: benchmark prompts), DEMO_NEW_TOKENS (128), DEMO_ASSISTED (truncate:27: the
# assisted-generation draft, the target's first N layers), DEMO_TREE (the heads' tree options).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${1:-runs/demo}"
PYTHON="${PYTHON:-python3}"
THREADS="${THREADS:-2}"
STEPS="${DEMO_STEPS:-80}"
PROMPTS_N="${DEMO_PROMPTS:-5}"
NEW_TOKENS="${DEMO_NEW_TOKENS:-128}"
ASSISTED="${DEMO_ASSISTED:-truncate:27}"
TARGET=smollm2-135m
DATA=data/train/selfdistill9k_answers.jsonl.gz
EVAL_PROMPTS=data/eval/mt_bench_question.jsonl
MAX_LENGTH=512
RUN="$OUT/eagle3"
# The draft trees (DEMO_TREE): --tree auto measures this machine's costs and each head's
# acceptance and picks depth, branching and size (on this 2-core CPU verifying 5 tokens costs
# ~1.15x one, 33 ~2x, so small trees win); the heads draft in bf16 beside the fp32 target
# (measured: 1.19x -> 1.28x `hf`; one token's matmuls are bound by reading the weights, which
# bf16 halves), and exactness does not depend on it.
TREE="${DEMO_TREE:---tree auto --draft-dtype bf16}"
export OMP_NUM_THREADS="$THREADS"

TIMINGS=()
stage() {  # stage NAME COMMAND...: run it, echo the command, record its duration
  local name="$1" start end
  shift
  printf '\n=== %s\n$ %s\n' "$name" "$*"
  start=$(date +%s)
  "$@"
  end=$(date +%s)
  TIMINGS+=("$(printf '%-10s %4d s' "$name" $((end - start)))")
}
started=$(date +%s)
mkdir -p "$OUT"

stage data "$PYTHON" -m draftsmith data inspect --target "$TARGET" --data "$DATA" \
  --max-length "$MAX_LENGTH"

stage training "$PYTHON" -m draftsmith train configs/eagle/smollm2-135m.yaml \
  --processes 1 --threads "$THREADS" \
  --output_dir "$RUN" --resume latest --data "$DATA" --max_length "$MAX_LENGTH" \
  --max_steps "$STEPS" --warmup_steps 10 --save_every 40 --log_every 5 --eval_every 40 \
  --eval_num_prompts 2 --eval_max_new_tokens 32 --report_to none

stage export "$PYTHON" -m draftsmith export "$RUN/artifact" --format vllm --out "$OUT/eagle3-vllm"

SHIPPED=()  # the head trained for longer and shipped in artifacts/, beside the fresh one
[ -d artifacts/smollm2-135m/eagle3 ] && SHIPPED=(--method eagle:artifacts/smollm2-135m/eagle3)
stage benchmark "$PYTHON" -m draftsmith bench --target "$TARGET" --threads "$THREADS" \
  --method hf --method hf-pld --method "hf-assisted:$ASSISTED" --method "eagle:$RUN/artifact" \
  "${SHIPPED[@]}" \
  --prompts "$EVAL_PROMPTS" --num-prompts "$PROMPTS_N" --max-new-tokens "$NEW_TOKENS" \
  --temperature 0 --out "$OUT/bench.json" $TREE --compile "${COMPILE:-off}"

printf '\n=== demo finished in %d s (%s, %s torch threads)\n' "$(($(date +%s) - started))" \
  "$(nproc) cores" "$THREADS"
printf '  %s\n' "${TIMINGS[@]}"
echo "  training metrics: $RUN/metrics.jsonl (loss, acc_<i>, lr, tokens_per_s, eval/tau)"
echo "  vLLM export:      $OUT/eagle3-vllm     benchmark report: $OUT/bench.json"
