#!/usr/bin/env bash
# The 9k self-distillation set: the embedded target's greedy answers (256 new tokens at most) to
# data/train/selfdistill9k_prompts.jsonl.gz, through two llama-servers (the f32 GGUF of the target,
# one thread and 32 parallel slots each: single-threaded servers share a 2-core machine without
# spinning at barriers; no prompt cache, which no prompt here would reuse and which grows to 8 GiB
# per server by default), one shard each. Rerun to continue where the shards stop; then
#   python -m draftsmith.train.data merge --out data/train/selfdistill9k_answers.jsonl
# Another target, the same way (the server renders draftsmith's template for it: a base model's
# prompt is its text continued):
#   TARGET=gemma3-270m MAX_NEW=128 MAX_PROMPTS=1200 OUT=data/train/gemma3_answers.jsonl \
#     scripts/regenerate_9k.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SLOTS=${SLOTS:-32}
TARGET=${TARGET:-smollm2-135m}
PROMPTS=${PROMPTS:-data/train/selfdistill9k_prompts.jsonl.gz}
MAX_NEW=${MAX_NEW:-256}
OUT=${OUT:-data/train/selfdistill9k_answers.jsonl}
LOGS=${LOGS:-runs/regen-$TARGET}
mkdir -p "$LOGS"
limit=()
if [ -n "${MAX_PROMPTS:-}" ]; then limit=(--max-prompts "$MAX_PROMPTS"); fi
server=$($PYTHON -m draftsmith.layouts.llama_cpp where | head -1)
gguf=$($PYTHON -m draftsmith.layouts.llama_cpp target-gguf "$TARGET" --type f32 | tail -1)
$PYTHON -m draftsmith.layouts.llama_cpp chat-template "$TARGET" > "$LOGS/template.jinja"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for shard in 0 1; do
  port=$((8091 + shard))
  "$server" -m "$gguf" -np "$SLOTS" -c $((SLOTS * 1024)) --alias "$TARGET" -t 1 --poll 0 --cache-ram 0 \
    --jinja --chat-template-file "$LOGS/template.jinja" \
    --host 127.0.0.1 --port "$port" > "$LOGS/server-$shard.log" 2>&1 &
  pids+=($!)
done
for shard in 0 1; do
  port=$((8091 + shard))
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; done
done
workers=()
for shard in 0 1; do
  port=$((8091 + shard))
  $PYTHON -m draftsmith.train.data regenerate --backend openai --url "http://127.0.0.1:$port/v1" \
    --model "$TARGET" --target "$TARGET" --data "$PROMPTS" "${limit[@]}" \
    --out "$OUT" --shard "$shard/2" --concurrency "$SLOTS" --max-new-tokens "$MAX_NEW" \
    --temperature 0 > "$LOGS/regenerate-$shard.log" 2>&1 &
  workers+=($!)
done
status=0
for w in "${workers[@]}"; do wait "$w" || status=$?; done
exit $status
