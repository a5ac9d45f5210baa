#!/usr/bin/env bash
# How the README's trained-draft results were made on the 2-core CPU machine, stage by stage.
#
#   scripts/cpu_results.sh STAGE        STAGE: prompts | regenerate | eagle | medusa | distill | bench
#                                              | distill-fixed
#                                              | shipped-eagle3 | shipped-eagle3-bench
#                                              | shipped-medusa | shipped-medusa-bench
#                                              | shipped-distill | shipped-distill-tune
#                                              | shipped-distill-bench
#                                              | shipped-bench | shipped-heads-t1
#                                              | shipped-dflash | block-bench | llama-costs
#                                              | llama-bench | llama-cross-check
#                                              | llama-regenerate | llama-bench-eagle3
#                                              | peer-speculators | sweep-eagle3-axes
#                                              | shipped-eagle3-trees | shipped-eagle3-tree10
#                                              | sweep-eagle3-shipped | sweep-medusa-more
#                                              | sweep-eagle3-offline
#                                              | engine-costs | engine-bench | engine-chain
#                                              | memory-probe | gemma-bench | gemma-regenerate
#                                              | gemma-eagle3 | gemma-dflash | gemma-drafts-bench
#                                              | shipped-dspark | dspark-bench
#
# Each stage is what was run, with its wall-clock on 2 cores noted beside it; the README quotes
# the figures. Outputs go under runs/ (training) and reports/ (benchmark JSON). Every training
# stage resumes from its checkpoints when rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
export MKL_CBWR=AUTO  # MKL's small-GEMM path is slow on AMD EPYC: see the README's engine results
LAUNCH=(accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no
        --dynamo_backend no)
HELDOUT=data/eval/vicuna_bench_question.jsonl  # tuning and training-time tau; MT-bench is the test

case "${1:-}" in
prompts)  # 1,500 short training prompts (<= 160 chat tokens), never MT-bench: seconds
  "$PYTHON" - <<'EOF'
import json
import random

from draftsmith.targets.target import load_target
from draftsmith.train.regenerate import load_prompts

target = load_target("smollm2-135m")
files = {"data/train/sharegpt_first_turns.json.gz": 700,
         "data/train/gpteacher_roleplay_instruct.json.gz": 500, "data/train/gsm8k_train.jsonl.gz": 300}
rng = random.Random(0)
rows = []
for path, count in files.items():
    prompts, _ = load_prompts([path])
    short = [p for p in prompts if len(target.chat_ids(p)) <= 160]
    rows += rng.sample(short, min(count, len(short)))
rng.shuffle(rows)
with open("runs/prompts_mix.jsonl", "w") as fh:
    fh.writelines(json.dumps({"messages": p}) + "\n" for p in rows)
print(f"{len(rows)} prompts -> runs/prompts_mix.jsonl")
EOF
  ;;
regenerate)  # the target's own greedy answers to the first 768 prompts: 15m46s, ~150 tokens/s
  "$PYTHON" -m draftsmith.train.data regenerate --target smollm2-135m --data runs/prompts_mix.jsonl \
    --out runs/selfdistill.jsonl --max-new-tokens 256 --temperature 0 --batch-size 64 \
    --max-prompts 768
  ;;
eagle)  # EAGLE-3, 400 steps of 4 x <=512 tokens, 2 threads: 40 min, ~200 tokens/s, 2.7 GB
  "${LAUNCH[@]}" --num_cpu_threads_per_process 2 train/eagle.py \
    --config configs/eagle/smollm2-135m.yaml --output_dir runs/eagle3 --resume latest \
    --data runs/selfdistill.jsonl --max_length 512 --per_device_batch_size 4 --max_steps 400 \
    --num_epochs none --warmup_steps 20 --learning_rate 6e-4 --ttt_steps 5 --save_every 50 \
    --log_every 10 --eval_every 200 --eval_prompts "$HELDOUT" --eval_num_prompts 4 \
    --eval_max_new_tokens 64 --report_to none
  ;;
medusa)  # Medusa-1, 4 heads sharing the LM head, 100 steps, 1 thread (beside another job): 18 min
  OMP_NUM_THREADS=1 "${LAUNCH[@]}" --num_cpu_threads_per_process 1 train/medusa.py \
    --config configs/medusa/smollm2-135m.yaml --output_dir runs/medusa1 --resume latest \
    --data runs/selfdistill.jsonl --soft_labels false --max_steps 100 --warmup_steps 10 \
    --max_tokens_per_batch none --draft_vocab_size none --save_every 50 --log_every 5 \
    --heldout_every 50 --eval_every 100 \
    --eval_prompts "$HELDOUT" --eval_num_prompts 2 --eval_max_new_tokens 32 --report_to none
  ;;
distill)  # truncate:6 distilled off-policy (JSD) on the answers, 200 steps, 2 threads: 22 min
  "${LAUNCH[@]}" --num_cpu_threads_per_process 2 train/distill.py \
    --config configs/distill/smollm2-135m.yaml --output_dir runs/distill6 --resume latest \
    --draft truncate:6 --draft_vocab_size none --freeze_embedding false \
    --data runs/selfdistill.jsonl --max_length 512 --per_device_batch_size 4 \
    --on_policy_ratio 0 --learning_rate 3e-4 --warmup_steps 10 --max_steps 200 \
    --save_every 50 --log_every 5 --heldout_every 50 --heldout_max_rows 16 --eval_every 200 \
    --eval_prompts "$HELDOUT" --eval_num_prompts 2 --eval_max_new_tokens 32 --report_to none
  ;;
distill-fixed)  # the same recipe after the loss-weight overflow fix (an int8 sum of the loss mask
  # wrapped past 127 and scaled some micro-batches by 1e12), on the shipped answers (the 768-prompt
  # data of the run above is gone), then before/after at temperature 0 on 8 prompts
  "${LAUNCH[@]}" --num_cpu_threads_per_process 2 train/distill.py \
    --config configs/distill/smollm2-135m.yaml --output_dir runs/distill6-fixed --resume latest \
    --draft truncate:6 --draft_vocab_size none --freeze_embedding false \
    --data data/train/selfdistill_answers.jsonl.gz --max_length 512 --per_device_batch_size 4 \
    --on_policy_ratio 0 --learning_rate 3e-4 --warmup_steps 10 --max_steps 200 \
    --save_every 50 --log_every 5 --heldout_every 50 --heldout_max_rows 16 --eval_every 200 \
    --eval_prompts "$HELDOUT" --eval_num_prompts 2 --eval_max_new_tokens 32 --report_to none
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
    --method draft:truncate:6 --method draft:runs/distill6-fixed/artifact \
    --prompts data/eval/mt_bench_question.jsonl --num-prompts 8 --max-new-tokens 128 \
    --temperature 0 --out reports/distill_fixed_t0.json
  ;;
shipped-eagle3)  # artifacts/smollm2-135m/eagle3: the recipe that led the 7-minute sweeps
  # (reports/sweep_eagle3_combo.json: learning rate 1e-3, a 4096-token draft vocabulary, the
  # decoder layer started from the target's layer 27, 4 test-time steps) on the 9k self-distilled
  # answers: 1400 steps of 2048-token batches (about one epoch), held-out tau on 8 Vicuna-bench
  # prompts every 200 steps; about 70 min. (The head shipped before it: the shipped 1728
  # answers, learning rate 5e-4, 8192 draft tokens, 450 steps, 58 min; git history has both.)
  "$PYTHON" train/eagle.py --config configs/eagle/smollm2-135m.yaml --output_dir runs/ship/eagle3 \
    --resume latest --data data/train/selfdistill9k_answers.jsonl.gz --max_length 512 \
    --max_tokens_per_batch 2048 --ttt_steps 4 --learning_rate 1e-3 --draft_vocab_size 4096 \
    --init_layer 27 --warmup_steps 20 --max_steps 1400 --num_epochs none --save_every 200 \
    --log_every 10 --eval_every 200 --eval_num_prompts 8 --eval_max_new_tokens 64 \
    --report_to none --mixed_precision auto
  "$PYTHON" -m draftsmith.heads.artifact cast runs/ship/eagle3/artifact artifacts/smollm2-135m/eagle3 \
    --dtype bf16 --overwrite
  ;;
shipped-medusa)  # artifacts/smollm2-135m/medusa: Medusa-1, 4 heads over a 4096-token draft
  # vocabulary (the 6-minute sweep's best two points together: 4096 draft tokens, the 9k answers),
  # hard labels, lr 1e-3, 850 steps of 2048-token batches, held-out acceptance every 250 steps
  "$PYTHON" train/medusa.py --config configs/medusa/smollm2-135m.yaml \
    --output_dir runs/ship/medusa --resume latest --max_length 512 --max_tokens_per_batch 2048 \
    --data data/train/selfdistill9k_answers.jsonl.gz --draft_vocab_size 4096 \
    --soft_labels false --learning_rate 1e-3 --warmup_steps 20 --max_steps 850 --save_every 50 \
    --log_every 10 --heldout_every 250 --eval_every 250 --eval_num_prompts 8 \
    --eval_max_new_tokens 64 --report_to none
  "$PYTHON" -m draftsmith.heads.artifact cast runs/ship/medusa/artifact artifacts/smollm2-135m/medusa \
    --dtype bf16 --overwrite
  ;;
shipped-distill)  # artifacts/smollm2-135m/draft: the target's first 2 layers, distilled (JSD,
  # off-policy on the 9k answers), its LM head over 4096 draft tokens, its input embedding the
  # target's, frozen and not shipped; the 4-minute sweep's cheapest point at equal tau, 280 steps
  # of 2048-token batches, held-out acceptance every 70 steps
  "$PYTHON" train/distill.py --config configs/distill/smollm2-135m.yaml \
    --output_dir runs/ship/distill --resume latest --draft truncate:2 --draft_vocab_size 4096 \
    --freeze_embedding true --data data/train/selfdistill9k_answers.jsonl.gz --max_length 512 \
    --max_tokens_per_batch 2048 --on_policy_ratio 0 --learning_rate 3e-4 --warmup_steps 10 \
    --max_steps 280 --save_every 40 --log_every 10 --heldout_every 0 --eval_every 70 \
    --eval_num_prompts 4 --eval_max_new_tokens 64 --draft_depth 5 --draft_branching "" \
    --report_to none
  "$PYTHON" -m draftsmith.heads.artifact cast runs/ship/distill/artifact artifacts/smollm2-135m/draft \
    --dtype bf16 --overwrite
  # the drafting shipped-distill-tune chose (the held-out curve above drafts chains of 5)
  "$PYTHON" -m draftsmith.eval.draft propose artifacts/smollm2-135m/draft --draft-branching 3
  ;;
shipped-distill-tune)  # how the shipped draft proposes, on 8 held-out Vicuna-bench prompts, each
  # setting in a run of its own beside hf (reports/distill_tune_*.json): chains (most tokens,
  # confidence stop) and static trees (children per depth); 3 children at depth 1 won
  for setting in "--draft-depth 5 --draft-min-confidence 0.4" \
      "--draft-depth 3 --draft-min-confidence 0.4" "--draft-depth 5 --draft-min-confidence 0.6" \
      "--draft-depth 8 --draft-min-confidence 0.5" "--draft-branching 3" "--draft-branching 4,1" \
      "--draft-branching 5"; do
    # shellcheck disable=SC2086  # the setting is flags
    name=$(echo $setting | sed -e 's/--draft-//g' -e 's/min-confidence /conf/' -e 's/depth /depth/' \
           -e 's/branching /branching/' -e 's/,/-/g' -e 's/ /_/g')
    # shellcheck disable=SC2086
    "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
      --method draft:artifacts/smollm2-135m/draft --draft-dtype bf16 $setting \
      --prompts "$HELDOUT" --num-prompts 8 --max-new-tokens 128 --temperature 0 \
      --out "reports/distill_tune_$name.json"
  done
  ;;
shipped-distill-bench)  # the draft of shipped-distill on the 80 MT-bench first turns, 128 tokens,
  # greedy, beside plain generate, with the tuning's 3 children at depth 1; then its held-out
  # acceptance against training minutes
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
    --method draft:artifacts/smollm2-135m/draft --draft-dtype bf16 --draft-branching 3 \
    --prompts data/eval/mt_bench_question.jsonl --num-prompts 80 \
    --max-new-tokens 128 --temperature 0 --out reports/shipped_distill_t0.json
  "$PYTHON" scripts/acceptance_curve.py runs/ship/distill --out reports/shipped_distill_curve.json
  # sampling at temperature 1, the first 20 prompts (no greedy check at T > 0)
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
    --method draft:artifacts/smollm2-135m/draft --draft-dtype bf16 --draft-branching 3 \
    --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 --max-new-tokens 128 \
    --temperature 1 --seed 0 --out reports/shipped_distill_t1.json
  ;;
shipped-bench)  # the shipped heads on the 80 MT-bench first turns, 128 tokens, trees by --tree auto
  # (acceptance measured on 8 Vicuna-bench prompts, kept in each artifact's tree_calibration.json)
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf --method hf-pld \
    --method eagle:artifacts/smollm2-135m/eagle3 --method medusa:artifacts/smollm2-135m/medusa \
    --tree auto --draft-dtype bf16 --prompts data/eval/mt_bench_question.jsonl --num-prompts 80 \
    --max-new-tokens 128 --temperature 0 --out reports/shipped_t0.json
  # sampling at temperature 1, the first 20 prompts (no greedy check: exactness at T > 0 is the
  # statistical tests' job)
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
    --method eagle:artifacts/smollm2-135m/eagle3 --method medusa:artifacts/smollm2-135m/medusa \
    --tree auto --draft-dtype bf16 --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 \
    --max-new-tokens 128 --temperature 1 --seed 0 --out reports/shipped_t1.json
  ;;
shipped-eagle3-bench)  # the EAGLE-3 head of shipped-eagle3 on the 80 MT-bench first turns, 128
  # tokens, greedy, its tree by --tree auto, beside plain generate and prompt lookup; then its
  # held-out acceptance against training minutes, from the run's own measurements
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf --method hf-pld \
    --method eagle:artifacts/smollm2-135m/eagle3 --tree auto --draft-dtype bf16 \
    --prompts data/eval/mt_bench_question.jsonl --num-prompts 80 --max-new-tokens 128 \
    --temperature 0 --out reports/shipped_eagle3_t0.json
  "$PYTHON" scripts/acceptance_curve.py runs/ship/eagle3 --out reports/shipped_eagle3_curve.json
  # the same head with the config's 32-node tree: the tau it reaches when speed is not the aim
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
    --method eagle:artifacts/smollm2-135m/eagle3 --tree fixed --tree-depth 5 --tree-topk 8 \
    --tree-nodes 32 --draft-dtype bf16 --prompts data/eval/mt_bench_question.jsonl \
    --num-prompts 80 --max-new-tokens 128 --temperature 0 --out reports/shipped_eagle3_tree32_t0.json
  ;;
shipped-eagle3-tree10)  # the shipped EAGLE-3 head with the tree shipped-eagle3-trees found
  # between speed and tau (depth 5, 8 children, 10 nodes: held-out tau 1.95 at 1.36x `hf`), on the
  # 80 MT-bench first turns, 128 tokens, greedy, beside plain generate and prompt lookup: 35 min
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf --method hf-pld \
    --method eagle:artifacts/smollm2-135m/eagle3 --tree fixed --tree-depth 5 --tree-topk 8 \
    --tree-nodes 10 --draft-dtype bf16 --prompts data/eval/mt_bench_question.jsonl \
    --num-prompts 80 --max-new-tokens 128 --temperature 0 --out reports/shipped_eagle3_tree10_t0.json
  ;;
shipped-heads-t1)  # the shipped EAGLE-3 and Medusa-1 heads sampling at temperature 1: the first
  # 20 MT-bench first turns, 128 tokens, trees by --tree auto (no greedy check at T > 0)
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
    --method eagle:artifacts/smollm2-135m/eagle3 --method medusa:artifacts/smollm2-135m/medusa \
    --tree auto --draft-dtype bf16 --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 \
    --max-new-tokens 128 --temperature 1 --seed 0 --out reports/shipped_heads_t1.json
  ;;
shipped-medusa-bench)  # the Medusa-1 heads of shipped-medusa on the 80 MT-bench first turns, 128
  # tokens, greedy, their tree by --tree auto, beside plain generate; then their held-out
  # acceptance against training minutes, from the run's own measurements
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
    --method medusa:artifacts/smollm2-135m/medusa --tree auto --draft-dtype bf16 \
    --prompts data/eval/mt_bench_question.jsonl --num-prompts 80 --max-new-tokens 128 \
    --temperature 0 --out reports/shipped_medusa_t0.json
  "$PYTHON" scripts/acceptance_curve.py runs/ship/medusa --out reports/shipped_medusa_curve.json
  ;;
bench)  # MT-bench first turns, 128 tokens; tree settings tuned on 4 Vicuna-bench prompts
  # heads, temperature 0, 80 prompts: ~40 min
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf --method hf-pld \
    --method eagle:runs/eagle3/artifact --method medusa:runs/medusa1/artifact \
    --tree-depth 2 --tree-topk 3 --tree-nodes 4 --draft-dtype bf16 \
    --prompts data/eval/mt_bench_question.jsonl --num-prompts 80 --max-new-tokens 128 \
    --temperature 0 --out reports/heads_t0.json
  # the draft before and after distillation, temperature 0 and 1, 8 prompts: ~20 min
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
    --method draft:truncate:6 --method draft:runs/distill6/artifact \
    --method hf-assisted:truncate:6 --method hf-assisted:runs/distill6/artifact \
    --prompts data/eval/mt_bench_question.jsonl --num-prompts 8 --max-new-tokens 128 \
    --temperature 0 --out reports/distill_t0.json
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
    --method draft:truncate:6 --method draft:runs/distill6/artifact \
    --prompts data/eval/mt_bench_question.jsonl --num-prompts 8 --max-new-tokens 128 \
    --temperature 1 --seed 0 --out reports/distill_t1.json
  ;;
shipped-dflash)  # artifacts/smollm2-135m/dflash: DFlash, 2 layers, blocks of 8, 12 epochs of the
  # shipped self-distilled answers from an offline bf16 feature cache: 29 min of target features
  # (2.1 GB) then 41 min of training (2592 steps, ~3500 block tokens/s)
  "$PYTHON" train/dflash.py --config configs/dflash/smollm2-135m.yaml --resume latest \
    --report_to none
  "$PYTHON" -m draftsmith.heads.artifact cast runs/dflash-smollm2-135m/artifact \
    artifacts/smollm2-135m/dflash --dtype bf16 --overwrite
  ;;
block-bench)  # the shipped block draft beside the shipped EAGLE-3 head and prompt lookup, in our
  # engine: 80 MT-bench first turns, 128 tokens, T=0
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf --method hf-pld \
    --method eagle:artifacts/smollm2-135m/eagle3 --method dflash:artifacts/smollm2-135m/dflash \
    --tree auto --draft-dtype bf16 --prompts data/eval/mt_bench_question.jsonl --num-prompts 80 \
    --max-new-tokens 128 --temperature 0 --out reports/shipped_block_t0.json
  ;;
shipped-dspark)  # runs/dspark-smollm2-135m: DSpark on DFlash's recipe (the same layers, taps,
  # blocks, draft vocabulary, data and feature cache), method dspark: 17 min of target features,
  # then 65 min of training (52 min of steps, 2592 at ~1.2 s; 13 min of held-out evaluations)
  "$PYTHON" train/dflash.py --config configs/dflash/smollm2-135m-dspark.yaml --resume latest \
    --report_to none
  "$PYTHON" -m draftsmith.heads.artifact cast runs/dspark-smollm2-135m/artifact \
    artifacts/smollm2-135m/dspark --dtype bf16 --overwrite
  "$PYTHON" scripts/acceptance_curve.py runs/dspark-smollm2-135m --out reports/dspark_curve.json
  ;;
dspark-bench)  # DSpark beside the shipped DFlash draft in the engine, eager (--compile off: the
  # 8 minutes of compiling buy ~10% on every method alike): 80 MT-bench first turns, 128 tokens,
  # T=0, bf16 drafts, --tree auto (a chain each, its length from the draft's calibration): 43 min
  # (the report names the run's bf16 copy, runs/dspark-smollm2-135m/artifact-bf16: the same bytes)
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --compile off \
    --method plain --method hf \
    --method dflash:artifacts/smollm2-135m/dflash \
    --method dspark:artifacts/smollm2-135m/dspark \
    --tree auto --draft-dtype bf16 --prompts data/eval/mt_bench_question.jsonl --num-prompts 80 \
    --max-new-tokens 128 --temperature 0 --out reports/dspark_vs_dflash_t0.json
  ;;
llama-costs)  # what a round costs in llama.cpp and in our engine (verification of n tokens, a
  # draft step), on an idle machine
  "$PYTHON" scripts/llama_costs.py --out reports/llama_costs.json \
    --dflash artifacts/smollm2-135m/dflash
  ;;
engine-costs)  # the engine's round beside llama.cpp's forward after the engine rework (static
  # caches, acceptance on the device, compiled steps), 2 threads, eager and compiled: ~5 min
  "$PYTHON" scripts/llama_costs.py --threads 2 --compile off max \
    --out reports/llama_costs_engine.json
  ;;
engine-bench)  # every shipped draft in the reworked engine, compiled (max), beside plain, hf,
  # transformers' compiled static-cache generate and both prompt lookups: 20 MT-bench first
  # turns, 128 tokens, greedy, with the cost model's prediction beside each method's decoding
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --compile max \
    --method plain --method hf --method hf-static --method pld --method hf-pld \
    --method eagle:artifacts/smollm2-135m/eagle3 --method medusa:artifacts/smollm2-135m/medusa \
    --method dflash:artifacts/smollm2-135m/dflash --method draft:artifacts/smollm2-135m/draft \
    --tree auto --draft-dtype bf16 --prompts data/eval/mt_bench_question.jsonl \
    --num-prompts 20 --max-new-tokens 128 --temperature 0 --out reports/engine_bench_t0.json
  ;;
engine-chain)  # what the shipped EAGLE-3 head is worth as a 3-token chain in both engines, on
  # the f32 target, 2 threads each: our speedup over our plain beside llama.cpp's over its own
  # (llama.cpp drafts the full chain: no p-min stop, as ours)
  "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --compile max \
    --method plain --method eagle:artifacts/smollm2-135m/eagle3 --tree fixed --tree-topk 1 \
    --tree-depth 3 --tree-nodes 3 --draft-dtype bf16 \
    --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 --max-new-tokens 128 \
    --temperature 0 --out reports/engine_eagle_chain3.json
  "$PYTHON" -m draftsmith.eval.bench --engine llama.cpp --target smollm2-135m --threads 2 \
    --gguf-target-type f32 --method plain --method eagle:artifacts/smollm2-135m/eagle3 \
    --llama-draft-max 3 --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 \
    --max-new-tokens 128 --temperature 0 --out reports/llama_eagle_chain3_f32.json
  ;;
memory-probe)  # the memory planner against the allocator, every trainer's tiny config on the
  # embedded target, full micro-batches and the config's own data, each in a fresh process: ~8 min
  "$PYTHON" scripts/memory_probe_tiny.py --out reports/memory_probe_tiny.json
  "$PYTHON" scripts/memory_table.py  # the README's 8B / 70B table (config.json files only)
  ;;
llama-bench)  # the shipped drafts served by llama.cpp itself: 20 MT-bench first turns, 128
  # tokens, greedy, one thread per server, on the embedded Q4_1 target and an f32 GGUF of it;
  # drafting stops below p 0.6 (the best of 0, 0.6 and 0.9 on 5 prompts for both heads)
  for target_type in "" f32; do
    "$PYTHON" -m draftsmith.eval.bench --engine llama.cpp --target smollm2-135m --threads 1 \
      ${target_type:+--gguf-target-type $target_type} \
      --method plain --method ngram:ngram-simple --method ngram:ngram-mod \
      --method eagle:artifacts/smollm2-135m/eagle3 --method dflash:artifacts/smollm2-135m/dflash \
      --llama-draft-p-min "${P_MIN:-0.6}" \
      --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 --max-new-tokens 128 \
      --temperature 0 --out "reports/llama_${target_type:-q4_1}.json"
  done
  ;;
llama-bench-eagle3)  # the shipped EAGLE-3 head (the swept recipe) served by llama.cpp, as
  # llama-bench measured the head before it: 20 MT-bench first turns, 128 tokens, greedy, one
  # thread per server, p-min 0.6, beside plain decoding and the best n-gram lookup
  for target_type in "" f32; do
    "$PYTHON" -m draftsmith.eval.bench --engine llama.cpp --target smollm2-135m --threads 1 \
      ${target_type:+--gguf-target-type $target_type} \
      --method plain --method ngram:ngram-mod --method eagle:artifacts/smollm2-135m/eagle3 \
      --llama-draft-p-min "${P_MIN:-0.6}" \
      --prompts data/eval/mt_bench_question.jsonl --num-prompts 20 --max-new-tokens 128 \
      --temperature 0 --out "reports/llama_eagle3_${target_type:-q4_1}.json"
  done
  ;;
llama-cross-check)  # each head's acceptance per depth in llama.cpp and in our engine, the same
  # prompts and chains (f32 target, full chains: no p-min)
  "$PYTHON" -m draftsmith.eval.bench --engine llama.cpp --target smollm2-135m --threads 1 \
    --gguf-target-type f32 --method plain --method eagle:artifacts/smollm2-135m/eagle3 \
    --method dflash:artifacts/smollm2-135m/dflash --cross-check \
    --prompts data/eval/mt_bench_question.jsonl --num-prompts 8 --max-new-tokens 128 \
    --temperature 0 --out reports/llama_cross_check.json
  ;;
llama-regenerate)  # regeneration through llama-server's parallel slots against the in-process
  # backend, the first 64 of the shipped training prompts, 128 tokens, greedy
  "$PYTHON" scripts/regenerate_speed.py --prompts data/train/selfdistill_prompts.jsonl.gz --num-prompts 64 \
    --max-new-tokens 128 --out reports/regenerate_speed.json
  ;;
peer-speculators)  # speculators' EAGLE-3 trainer against the shipped recipe on the same 1500
  # conversations, 20 minutes each (its data and hidden states counted: 438 s), then one bench on
  # 16 Vicuna-bench prompts: 75 min in all
  # (its probes timed 4 steps, the script's default then; it now times 8, as the sweeps do)
  scripts/peer_speculators.sh --data data/train/selfdistill9k_answers.jsonl.gz --rows 1500 \
    --minutes 20 --num-prompts 16 --probe-steps 4 --out runs/peer20
  ;;
sweep-eagle3-axes)  # an EAGLE-3 axis the 7-minute sweep left out, beside its pinned recipe again
  # (the machine was slower than in that sweep). `offline` was started too and stopped: writing
  # the feature cache of the 1728 conversations (497k tokens) ran at 430-530 tokens/s, about 17
  # minutes, more than the 7-minute budget (and the probe writes it once more)
  "$PYTHON" scripts/sweep.py eagle3 --minutes 7 --points base,vocab2048 --name eagle3_axes
  ;;
shipped-eagle3-trees)  # the shipped EAGLE-3 head's tau against speed as its tree grows, on 8
  # held-out Vicuna-bench prompts, 128 tokens, greedy, each tree in a run of its own beside hf
  # (--tree picks one tree per run): about 3 minutes a tree
  for tree in "1 8 3" "4 8 8" "5 8 10" "5 8 12" "5 8 16"; do
    set -- $tree
    "$PYTHON" -m draftsmith.eval.bench --target smollm2-135m --threads 2 --method hf \
      --method eagle:artifacts/smollm2-135m/eagle3 --tree fixed --tree-depth "$1" --tree-topk "$2" \
      --tree-nodes "$3" --draft-dtype bf16 --prompts "$HELDOUT" --num-prompts 8 \
      --max-new-tokens 128 --temperature 0 --out "reports/shipped_eagle3_tree_d$1_k$2_n$3.json"
  done
  ;;
sweep-eagle3-shipped)  # around the shipped recipe at equal wall time, 8 minutes a point: all
  # 9191 answers (under 0.1 epoch), seeded samples of 1150 and 230 of them (about 0.6 and 3
  # epochs), and a constant learning rate; then one bench on 16 Vicuna-bench prompts with the
  # config's 32-node tree
  "$PYTHON" scripts/sweep.py eagle3-shipped --minutes 8 \
    --points shipped,rows1150,rows230,constant-lr --name eagle3_shipped
  ;;
sweep-medusa-more)  # the two Medusa-1 axes the 6-minute sweep left out (a lower learning
  # rate, a fifth head) beside its base point again, 6 minutes a point, then one bench on 16
  # Vicuna-bench prompts with the config's 16-node tree: about 30 minutes
  "$PYTHON" scripts/sweep.py medusa --minutes 6 --points base,lr5e-4,heads5 --name medusa_6min_more
  ;;
sweep-eagle3-offline)  # offline features on the 230-conversation sample against the same sample
  # online, 8 minutes each, the cache written inside the budget; rows230 is the head
  # sweep-eagle3-shipped trained (its run linked in, so it is benchmarked, not trained, again):
  # about 25 minutes
  mkdir -p runs/sweep/eagle3_shipped_offline
  if [ -d runs/sweep/eagle3_shipped/rows230 ]; then
    ln -sfn ../eagle3_shipped/rows230 runs/sweep/eagle3_shipped_offline/rows230
  fi
  "$PYTHON" scripts/sweep.py eagle3-shipped --minutes 8 --points rows230,rows230-offline \
    --name eagle3_shipped_offline
  ;;
gemma-bench)  # the second family, Gemma-3 270M base (make install-gemma), in our engine: plain,
  # generate and both prompt lookups on 20 HumanEval prompts and 20 MT-bench first turns, both as
  # plain text, 128 tokens, greedy; about 20 minutes each on 2 cores
  for set in humaneval:data/eval/humaneval.jsonl.gz mt_bench:data/eval/mt_bench_question.jsonl; do
    "$PYTHON" -m draftsmith.eval.bench --target gemma3-270m --threads 2 --prompt-format text \
      --method hf --method plain --method pld --method hf-pld --prompts "${set#*:}" \
      --num-prompts 20 --max-new-tokens 128 --temperature 0 --out "reports/gemma3_${set%%:*}_t0.json"
  done
  ;;
gemma-regenerate)  # data/train/gemma3_answers.jsonl.gz: Gemma-3 270M's greedy continuations of the
  # first 1200 prompts of the 9k set as plain text, 128 tokens, through two llama-servers (f32
  # GGUF, one thread and 32 slots each): 17 min (about 70 answers, 9,000 tokens a minute)
  TARGET=gemma3-270m MAX_NEW=128 MAX_PROMPTS=1200 OUT=data/train/gemma3_answers.jsonl \
    scripts/regenerate_9k.sh || true  # an empty continuation fails its prompt: merge the rest
  "$PYTHON" -m draftsmith.train.data merge --out data/train/gemma3_answers.jsonl --partial
  gzip -9 -n data/train/gemma3_answers.jsonl
  ;;
gemma-eagle3)  # artifacts/gemma3-270m/eagle3 (configs/eagle/gemma3-270m.yaml): about 6 min of
  # target features (1.0 GB bf16 cache, ~600 tokens/s) then 18 min of training (300 steps of
  # 1024-token batches, 1.3 epochs of the 1189 rows, ~240 tokens/s)
  "$PYTHON" train/eagle.py --config configs/eagle/gemma3-270m.yaml --resume latest --report_to none
  "$PYTHON" -m draftsmith.heads.artifact cast runs/eagle3-gemma3-270m/artifact \
    artifacts/gemma3-270m/eagle3 --dtype bf16 --overwrite
  ;;
gemma-dflash)  # artifacts/gemma3-270m/dflash (configs/dflash/gemma3-270m.yaml): 8 min of
  # target features (its own cache; slowed by other work) then 11 min of training (888 steps,
  # 6 epochs, ~2000 block tokens/s)
  "$PYTHON" train/dflash.py --config configs/dflash/gemma3-270m.yaml --resume latest --report_to none
  "$PYTHON" -m draftsmith.heads.artifact cast runs/dflash-gemma3-270m/artifact \
    artifacts/gemma3-270m/dflash --dtype bf16 --overwrite
  ;;
gemma-drafts-bench)  # the Gemma-3 drafts beside generate and both prompt lookups, in our engine: the
  # 20 HumanEval prompts and 20 MT-bench first turns of gemma-bench, plain text, 128 tokens, greedy.
  # HumanEval with --compile auto (max here: 4 engine methods x 2560 tokens), 33 min with 8 min of
  # compiling; MT-bench with --compile off, BENCH_MT_TIME
  common=(--target gemma3-270m --threads 2 --prompt-format text --method hf --method hf-pld
          --method pld --method eagle:artifacts/gemma3-270m/eagle3
          --method dflash:artifacts/gemma3-270m/dflash --tree auto --draft-dtype bf16
          --num-prompts 20 --max-new-tokens 128 --temperature 0)
  "$PYTHON" -m draftsmith.eval.bench "${common[@]}" --prompts data/eval/humaneval.jsonl.gz \
    --out reports/gemma3_drafts_humaneval_t0.json
  "$PYTHON" -m draftsmith.eval.bench "${common[@]}" --compile off \
    --prompts data/eval/mt_bench_question.jsonl --out reports/gemma3_drafts_mt_bench_t0.json
  ;;
*)
  echo "usage: $0 prompts|regenerate|eagle|medusa|distill|bench|distill-fixed|shipped-eagle3|shipped-eagle3-bench|shipped-medusa|shipped-medusa-bench|shipped-distill|shipped-distill-tune|shipped-distill-bench|shipped-bench|shipped-heads-t1|shipped-dflash|block-bench|llama-costs|llama-bench|llama-cross-check|llama-regenerate|llama-bench-eagle3|peer-speculators|sweep-eagle3-axes|shipped-eagle3-trees|shipped-eagle3-tree10|sweep-eagle3-shipped|sweep-medusa-more|sweep-eagle3-offline|engine-costs|engine-bench|engine-chain|memory-probe|gemma-bench|gemma-regenerate|gemma-eagle3|gemma-dflash|gemma-drafts-bench|shipped-dspark|dspark-bench" >&2
  exit 2
  ;;
esac
