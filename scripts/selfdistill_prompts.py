"""The prompts the embedded target answers for the shipped self-distillation data.

    python scripts/selfdistill_prompts.py          # -> data/train/selfdistill_prompts.jsonl.gz
    python scripts/selfdistill_prompts.py 9k       # -> data/train/selfdistill9k_prompts.jsonl.gz

A seeded, shuffled mix of the training files in data/train (never MT-bench or Vicuna-bench),
prompts of at most 320 chat tokens, so that any prefix of the file is a mix of every source:
ShareGPT first turns (general chat, writing, extraction, STEM, humanities), GPTeacher role-play,
GSM8K (math), GPTeacher code generation and MBPP (coding), self-instruct seed tasks. Answers are
then written by ``python -m draftsmith.train.data regenerate`` (scripts/cpu_results.sh stage ``regenerate``
for the first set, scripts/regenerate_9k.sh for the ``9k`` set). The ``9k`` set takes every
short ShareGPT, role-play, MBPP and self-instruct prompt and more GSM8K and code prompts: 5.3
times the 1728 conversations of the first set's answers.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftsmith.targets.target import load_target  # noqa: E402
from draftsmith.train.regenerate import load_prompts  # noqa: E402

SETS = {  # name -> (the file written, {source file: at most this many prompts})
    "shipped": ("data/train/selfdistill_prompts.jsonl.gz", {
        "data/train/sharegpt_first_turns.json.gz": 2600,
        "data/train/gpteacher_roleplay_instruct.json.gz": 900,
        "data/train/gsm8k_train.jsonl.gz": 700,
        "data/train/gpteacher_codegen_instruct.json.gz": 700,
        "data/train/mbpp_train.jsonl.gz": 300,
        "data/train/self_instruct_seed_tasks_175.jsonl.gz": 175,
    }),
    "9k": ("data/train/selfdistill9k_prompts.jsonl.gz", {
        "data/train/sharegpt_first_turns.json.gz": 2600,
        "data/train/gpteacher_roleplay_instruct.json.gz": 1923,
        "data/train/gsm8k_train.jsonl.gz": 2000,
        "data/train/gpteacher_codegen_instruct.json.gz": 2200,
        "data/train/mbpp_train.jsonl.gz": 374,
        "data/train/self_instruct_seed_tasks_175.jsonl.gz": 175,
    }),
}
MAX_PROMPT_TOKENS = 320


def main(name: str = "shipped") -> None:
    if name not in SETS:
        raise SystemExit(f"unknown prompt set {name!r}: choose one of {sorted(SETS)}")
    out, sources = SETS[name]
    out_path = REPO / out
    target = load_target("smollm2-135m")
    rng = random.Random(0)
    rows = []
    for path, count in sources.items():
        prompts, _ = load_prompts([str(REPO / path)])
        short = [p for p in prompts if len(target.chat_ids(p[0])) <= MAX_PROMPT_TOKENS]
        chosen = rng.sample(short, min(count, len(short)))
        rows += [{"messages": [m for turn in p for m in turn],
                  "source": Path(path).name.removesuffix(".gz")} for p in chosen]
        print(f"{path}: {len(chosen)} of {len(prompts)} prompts ({len(short)} short enough)")
    rng.shuffle(rows)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with open(out_path, "wb") as f:  # gzip, no name or time in the header: the same bytes each run
        with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9, filename="", mtime=0) as z:
            z.write(text.encode("utf-8"))
    print(f"{len(rows)} prompts -> {out_path.relative_to(REPO)}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
