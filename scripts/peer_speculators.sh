#!/usr/bin/env bash
# The peer, side by side: vllm-project/speculators' EAGLE-3 trainer (speculators==0.9.0 from PyPI,
# in its own virtual environment) against draftsmith's, on exactly the same rows and the same CPU
# wall time, both heads measured in one draftsmith.eval.bench run on held-out prompts.
#
#   scripts/peer_speculators.sh --data data/train/selfdistill_answers.jsonl.gz --minutes 60 \
#       --ours configs/eagle/smollm2-135m.yaml --out runs/peer
#
# Options: --data FILE (JSON/JSONL, .gz too; required)  --minutes M (each trainer's wall time;
# required)  --ours CONFIG (draftsmith's EAGLE-3 recipe; default configs/eagle/smollm2-135m.yaml)
# --out DIR (runs/peer)  --name NAME (the report: reports/peer_speculators_NAME.json and
# .meta.json; default <data>-<M>min)  --rows N (the first N conversations only)  --variants
# "defaults ours" (speculators' runs, below)  --prompts FILE (held-out prompts;
# data/eval/vicuna_bench_question.jsonl, never MT-bench, the test set)  --num-prompts N (all)
# --max-new-tokens N (128)  --probe-steps N (8)  --memory-gib G (what speculators' losses may use;
# default what the machine has available)  --threads N (nproc)  --bench-args "..." (more
# draftsmith.eval.bench flags, e.g. "--draft-dtype bf16").
#
# Stages (each prints its time; every time lands in the .meta.json):
#   1. speculators' venv: built or reused by `draftsmith consumer-check install` (CPU torch
#      2.13.0, speculators 0.9.0 and its requirements from PyPI, without torchvision/torchaudio).
#   2. speculators' data, counted in its budget: draftsmith's own tokenised rows of --data (its
#      chat template, loss mask on assistant tokens, max_length of --ours) written as speculators'
#      pre-tokenised rows (input_ids, loss_mask), its datasets directory and token frequencies
#      (scripts/speculators_cpu.py dataset), and the target's hidden states in the files its
#      trainer reads (hs_<i>.safetensors: aux layers 2, L/2, L-3 and the last layer before the
#      final norm, vLLM's numbering), computed with transformers on this CPU in place of vLLM
#      (scripts/peer_speculators.py features).
#   3. draftsmith: train/eagle.py --config --ours --data ... for M minutes: a probe of a few steps
#      gives start-up and step time, the run gets max_steps = what fits (its learning-rate schedule
#      spans them; num_epochs lifted so only time binds) and is stopped at M minutes if it runs
#      over (SIGTERM: the step finishes and is saved; the artifact is then written by resuming
#      with max_steps at the step reached). No periodic evaluation, no W&B.
#   4. speculators, per variant, for M minutes minus stage 2: the same probe and plan, then
#      `speculators train` (its own CLI and config resolution) with --max-steps, stopped at the
#      deadline by SIGTERM (its handler saves an "interrupted" checkpoint):
#        defaults: its documented eagle3 defaults: 1 llama layer, norm_before_fc,
#                  norm_before_residual and norm_output on, the whole target vocabulary, 3
#                  test-time steps, kl_div loss, Muon at lr 1e-3, linear decay after 1% warmup,
#                  8192-token packing, 2048-position sliding window, bf16;
#        ours:     the same with every knob it shares with --ours set as --ours sets it: test-time
#                  steps, their loss decay, learning rate, AdamW, weight decay, schedule, warmup,
#                  draft vocabulary size, aux layers, tokens per step, and the architecture flags
#                  off (draftsmith's head has none); what it lacks (min_lr_ratio, Adam betas, the
#                  clipping norm, feature noise) is listed in the .meta.json.
#   5. one `python -m draftsmith.eval.bench` of hf and all heads on the held-out prompts (greedy, exact), every
#      head with the same fixed tree, the one --ours evaluates with (tree_depth, tree_topk,
#      tree_nodes): reports/peer_speculators_NAME.json, and the .meta.json beside it (timings,
#      steps, tokens, settings, the CPU changes).
#
# What had to be changed to run speculators' trainer on a CPU (applied by speculators_cpu.py at
# run time; nothing of speculators is copied or edited on disk):
#   1. its Trainer moves the draft and every batch to get_local_rank(), the integer 0, which torch
#      reads as cuda:0: here "cpu";
#   2. its autocast names the device "cuda" when there is no accelerator, which turns autocast off
#      on a CPU (the draft then meets bf16 hidden states with fp32 weights and fails): "cpu", so it
#      trains under bf16 autocast as on a GPU;
#   3. its step timer calls torch.accelerator.synchronize(), which raises without an accelerator:
#      a no-op here (CPU work is finished when the call returns);
# and documented options set for a CPU (peer_speculators.py CPU_FLAGS):
#   4. --loss-implementation eager: its default fused losses are Triton kernels (GPU only);
#   5. --draft-attn-impl sdpa: its default flex attention has no backward on a CPU in torch 2.13;
#   6. --num-workers 1: its default 12 data-loader processes on a 2-core machine;
#   7. --total-seq-len halved while its eager losses (about 15 bytes per token x vocabulary x
#      test-time step, measured) would not fit the memory available (8192 -> 4096 on 24 GiB);
#   8. the hidden states come from transformers on this CPU, not from vLLM (none here); the
#      target runs in bf16, as vLLM would serve it;
#   9. the rows are draftsmith's tokenisation in speculators' pre-tokenised format (prepare-data
#      passes such rows through; it would render conversations through a vLLM server), kept in
#      order, plus a copy of the first row as its validation split (it refuses to train without
#      one and would hold out 10% by default).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
DATA="" MINUTES="" OURS=configs/eagle/smollm2-135m.yaml OUT=runs/peer NAME="" ROWS=""
VARIANTS="defaults ours" PROMPTS=data/eval/vicuna_bench_question.jsonl NUM_PROMPTS=""
NEW_TOKENS=128 PROBE_STEPS=8 MEMORY_GIB="" THREADS="$(nproc)" BENCH_ARGS=""
die() { echo "scripts/peer_speculators.sh: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in -h|--help) ;; *) [ $# -ge 2 ] || die "$1 needs a value" ;; esac
  case "$1" in
    --data) DATA="$2" ;;
    --minutes) MINUTES="$2" ;;
    --ours) OURS="$2" ;;
    --out) OUT="$2" ;;
    --name) NAME="$2" ;;
    --rows) ROWS="$2" ;;
    --variants) VARIANTS="$2" ;;
    --prompts) PROMPTS="$2" ;;
    --num-prompts) NUM_PROMPTS="$2" ;;
    --max-new-tokens) NEW_TOKENS="$2" ;;
    --probe-steps) PROBE_STEPS="$2" ;;
    --memory-gib) MEMORY_GIB="$2" ;;
    --threads) THREADS="$2" ;;
    --bench-args) BENCH_ARGS="$2" ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
  shift 2
done
[ -n "$DATA" ] || die "--data FILE is required (the training conversations)"
[ -f "$DATA" ] || die "--data $DATA does not exist"
[ -f "$OURS" ] || die "--ours $OURS does not exist (an EAGLE-3 config of configs/eagle/)"
[ -f "$PROMPTS" ] || die "--prompts $PROMPTS does not exist"
case "$PROMPTS" in *mt_bench*) die "--prompts $PROMPTS: MT-bench is the test set; compare on \
held-out prompts (data/eval/vicuna_bench_question.jsonl)" ;; esac
[[ "$MINUTES" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--minutes must be a number of minutes, got '$MINUTES'"
[[ "$PROBE_STEPS" =~ ^[0-9]+$ ]] && [ "$PROBE_STEPS" -ge 3 ] || die "--probe-steps must be >= 3"
for v in $VARIANTS; do
  [ "$v" = defaults ] || [ "$v" = ours ] || die "--variants takes defaults and/or ours, got '$v'"
done
if [ -z "$NAME" ]; then
  NAME="$(basename "$DATA")"; NAME="${NAME%%.*}-${MINUTES}min"
fi
REPORT="reports/peer_speculators_${NAME}.json"
BUDGET=$(awk -v m="$MINUTES" 'BEGIN { printf "%.0f", m * 60 }')
export OMP_NUM_THREADS="$THREADS" TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT/timings" reports
rm -f "$OUT"/timings/*.json

pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
trap 'exit 130' INT TERM
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
record() { printf '%s\n' "$2" > "$OUT/timings/$1.json"; }  # record STAGE JSON
say() { printf '\n=== [peer] %s\n' "$*"; }
# run_until SECONDS LOG COMMAND...: run it in the background, SIGTERM it at the deadline (it
# saves and stops), SIGKILL two minutes later; returns 124 when the deadline stopped it
run_until() {
  local limit="$1" log="$2" pid status=0
  shift 2
  "$@" > "$log" 2>&1 &
  pid=$!
  pids+=("$pid")
  local deadline=$(( $(date +%s) + limit )) stopped=0
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$stopped" = 0 ] && [ "$(date +%s)" -ge "$deadline" ]; then
      kill -TERM "$pid" 2>/dev/null || true; stopped=1; deadline=$(( $(date +%s) + 120 ))
    elif [ "$stopped" = 1 ] && [ "$(date +%s)" -ge "$deadline" ]; then
      kill -KILL "$pid" 2>/dev/null || true
    fi
    sleep 1
  done
  wait "$pid" || status=$?
  if [ "$stopped" = 1 ]; then return 124; fi
  return "$status"
}
fail_with_log() { tail -30 "$1" >&2; die "$2 failed (log: $1)"; }

# 1. speculators' venv -------------------------------------------------------------------------
say "speculators 0.9.0 venv (draftsmith consumer-check install)"
SPY="$("$PYTHON" -m draftsmith consumer-check install 2> "$OUT/venv.log" | tail -1)" \
  || fail_with_log "$OUT/venv.log" "building speculators' venv (it needs PyPI)"
[ -x "$SPY" ] || fail_with_log "$OUT/venv.log" "building speculators' venv"
SPEC_ENV=(env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONNOUSERSITE=1)

# the conversations both trainers read
if [ -n "$ROWS" ]; then
  mkdir -p "$OUT/data"
  "$PYTHON" scripts/peer_speculators.py subset "$DATA" "$ROWS" "$OUT/data/conversations.jsonl"
  DATA="$OUT/data/conversations.jsonl"
fi

# 2. speculators' data -------------------------------------------------------------------------
say "speculators' data: draftsmith's rows, its dataset, the target's hidden states"
SPEC="$OUT/speculators"
mkdir -p "$SPEC"
t=$(now)
"$PYTHON" scripts/peer_speculators.py rows --ours "$OURS" --data "$DATA" --out "$SPEC/rows.jsonl" \
  > "$SPEC/rows.out" 2> "$SPEC/rows.log" || fail_with_log "$SPEC/rows.log" "writing the rows"
rows_s=$(since "$t")
rows_sha=$(sha256sum "$SPEC/rows.jsonl" | cut -c1-12)
t=$(now)
rm -rf "$SPEC/data"
"${SPEC_ENV[@]}" "$SPY" scripts/speculators_cpu.py dataset "$SPEC/rows.jsonl" "$SPEC/data" \
  > "$SPEC/dataset.out" 2> "$SPEC/dataset.log" \
  || fail_with_log "$SPEC/dataset.log" "writing speculators' dataset"
dataset_s=$(since "$t")
record data "{\"rows_seconds\": $rows_s, \"dataset_seconds\": $dataset_s, \"rows\": $(tail -1 "$SPEC/rows.out")}"
N_ROWS=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['rows'])" \
  "$SPEC/rows.info.json")
# its train split is int((N + 1) * ratio) rows: exactly the N rows, the copy validates
RATIO=$(awk -v n="$N_ROWS" 'BEGIN { printf "%.12f", (n + 0.5) / (n + 1) }')
declare -A HS PREP
for v in $VARIANTS; do
  layers="$("$PYTHON" scripts/peer_speculators.py layers --ours "$OURS" --variant "$v")"
  hs="$SPEC/hidden_states-${layers// /-}-$rows_sha"
  HS[$v]="$hs"
  if [ ! -f "$hs/done.json" ]; then
    say "hidden states, layers $layers -> $hs"
    "$PYTHON" scripts/peer_speculators.py features --ours "$OURS" --rows "$SPEC/rows.jsonl" \
      --layers $layers --out "$hs" > "$SPEC/features.out" 2> "$SPEC/features.log" \
      || fail_with_log "$SPEC/features.log" "computing the hidden states"
  fi
  features_s=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['seconds'])" \
    "$hs/done.json")
  PREP[$v]=$(awk -v a="$rows_s" -v b="$dataset_s" -v c="$features_s" 'BEGIN { print a + b + c }')
  record "features-$v" "$(cat "$hs/done.json")"
  echo "[peer] speculators ($v) spends ${PREP[$v]} s of its ${BUDGET} s on its data"
done

# 3. draftsmith --------------------------------------------------------------------------------
say "draftsmith: train/eagle.py for ${BUDGET} s (scripts/train_budget.py: probe, plan, run)"
rm -rf "$OUT/ours"
"$PYTHON" scripts/train_budget.py --minutes "$MINUTES" --out "$OUT/ours" \
  --probe-steps "$PROBE_STEPS" -- --config "$OURS" --data "$DATA" --eval_every 0 \
  > "$OUT/ours.log" 2>&1 || fail_with_log "$OUT/ours.log" "draftsmith's training"
record ours "{\"budget\": $(cat "$OUT/ours/budget.json"), \
\"run\": $("$PYTHON" scripts/peer_speculators.py summary --kind ours \
  --metrics "$OUT/ours/run/metrics.jsonl")}"
echo "[peer] draftsmith: $(grep -o '"train_seconds": [0-9.]*' "$OUT/ours/budget.json")"
METHODS=(--method "eagle:$OUT/ours/run/artifact")

# 4. speculators -------------------------------------------------------------------------------
for v in $VARIANTS; do
  run="$SPEC/$v"
  rm -rf "$run"
  mkdir -p "$run"
  mem=()
  [ -n "$MEMORY_GIB" ] && mem=(--memory-gib "$MEMORY_GIB")
  "$PYTHON" scripts/peer_speculators.py flags --ours "$OURS" --variant "$v" \
    --rows "$SPEC/rows.jsonl" "${mem[@]}" --record "$run/settings.json" > "$run/flags.txt"
  mapfile -t flags < "$run/flags.txt"
  common=("${flags[@]}" --data-path "$SPEC/data" --hidden-states-path "${HS[$v]}"
          --train-data-ratio "$RATIO" --no-resume-from-checkpoint)
  budget=$(awk -v b="$BUDGET" -v p="${PREP[$v]}" 'BEGIN { printf "%.0f", b - p }')
  [ "$budget" -gt 0 ] || die "speculators ($v) spent ${PREP[$v]} s of the ${BUDGET} s budget on \
its data and has none left to train: give more --minutes"
  say "speculators ($v): probe of $PROBE_STEPS steps"
  t=$(now)
  "${SPEC_ENV[@]}" "$SPY" scripts/speculators_cpu.py train "$run/probe.metrics.jsonl" \
    "$PROBE_STEPS" -- "${common[@]}" --save-path "$run/probe" --log-dir "$run/probe-logs" \
    > "$run/probe.log" 2>&1 || fail_with_log "$run/probe.log" "speculators' probe ($v)"
  probe_s=$(since "$t")
  steps=$("$PYTHON" scripts/peer_speculators.py plan --kind speculators \
    --metrics "$run/probe.metrics.jsonl" --seconds "$probe_s" --budget "$budget" \
    --record "$run/plan.json")
  rm -rf "$run/probe" "$run/probe-logs"
  say "speculators ($v): $steps steps in $budget s"
  t=$(now)
  status=0
  run_until "$budget" "$run/train.log" "${SPEC_ENV[@]}" "$SPY" scripts/speculators_cpu.py train \
    "$run/metrics.jsonl" "$steps" -- "${common[@]}" --save-path "$run/checkpoints" \
    --log-dir "$run/logs" || status=$?
  train_s=$(since "$t")
  stopped=false
  if [ "$status" = 124 ]; then
    stopped=true
    head_dir="$run/checkpoints/interrupted"
  elif [ "$status" = 0 ]; then  # the last epoch's checkpoint
    head_dir="$run/checkpoints/$(ls "$run/checkpoints" | grep -E '^[0-9]+$' | sort -n | tail -1)"
  else
    fail_with_log "$run/train.log" "speculators' training ($v)"
  fi
  [ -f "$head_dir/model.safetensors" ] || fail_with_log "$run/train.log" \
    "speculators' training ($v) saved no checkpoint"
  ln -sfn "$(realpath "$head_dir")" "$run/head"
  record "speculators-$v" "{\"settings\": $(cat "$run/settings.json"), \"flags\": \
$("$PYTHON" -c "import json,sys; print(json.dumps(sys.argv[1:]))" "${common[@]}"), \
\"data_seconds\": ${PREP[$v]}, \"probe_seconds\": $probe_s, \"plan\": $(cat "$run/plan.json"), \
\"train_seconds\": $train_s, \"total_seconds\": $(awk -v a="${PREP[$v]}" -v b="$train_s" \
'BEGIN { print a + b }'), \"stopped_at_deadline\": $stopped, \"budget_seconds\": $BUDGET, \
\"head\": \"$head_dir\", \"run\": $("$PYTHON" scripts/peer_speculators.py summary \
--kind speculators --metrics "$run/metrics.jsonl")}"
  echo "[peer] speculators ($v): data ${PREP[$v]} s + training ${train_s} s"
  METHODS+=(--method "eagle:$run/head")
done

# 5. one benchmark -----------------------------------------------------------------------------
say "benchmark: hf and every head on $PROMPTS"
# the target and the tree --ours evaluates with, the same for every head
read -r target tree_depth tree_topk tree_nodes < <("$PYTHON" -c "import sys; \
from draftsmith.train.config import parse_config; from draftsmith.train.eagle import EagleTrainConfig; \
c = parse_config(EagleTrainConfig, ['--config', sys.argv[1]]); \
print(c.target, c.tree_depth, c.tree_topk, c.tree_nodes)" "$OURS")
count=()
[ -n "$NUM_PROMPTS" ] && count=(--num-prompts "$NUM_PROMPTS")
read -r -a extra <<< "$BENCH_ARGS"
t=$(now)
"$PYTHON" -m draftsmith.eval.bench --target "$target" --threads "$THREADS" --method hf "${METHODS[@]}" \
  --prompts "$PROMPTS" "${count[@]}" --max-new-tokens "$NEW_TOKENS" --temperature 0 \
  --tree fixed --tree-depth "$tree_depth" --tree-topk "$tree_topk" --tree-nodes "$tree_nodes" \
  "${extra[@]}" --no-progress --out "$REPORT" 2>&1 | tee "$OUT/bench.log"
record bench "{\"seconds\": $(since "$t"), \"report\": \"$REPORT\", \"prompts\": \"$PROMPTS\", \
\"max_new_tokens\": $NEW_TOKENS, \"tree\": [$tree_depth, $tree_topk, $tree_nodes], \
\"bench_args\": \"$BENCH_ARGS\", \"threads\": $THREADS, \"cores\": $(nproc)}"
record versions "$("${SPEC_ENV[@]}" "$SPY" -c "import json, importlib.metadata as m; \
print(json.dumps({p: m.version(p) for p in ('speculators', 'torch', 'transformers')}))")"
"$PYTHON" scripts/peer_speculators.py meta --dir "$OUT" --out "${REPORT%.json}.meta.json"
