"""Answers per minute of `draftsmith.train.data regenerate` in this process against llama-server's slots.

    python scripts/regenerate_speed.py --prompts data/train/selfdistill_prompts.jsonl.gz \
        --num-prompts 64 --max-new-tokens 128 --out reports/regenerate_speed.json

The same prompts (first turns only), greedy, the same token limit, for each backend in turn on
the otherwise idle machine:

* ``hf``: transformers' batched generate on the fp32 target (``--batch-size``, 2 threads);
* ``llama-server f32`` / ``llama-server q4_1``: ``--backend openai`` against a llama-server with
  ``--parallel`` slots (continuous batching) serving an f32 GGUF of the same weights, or the
  embedded Q4_1 file, 2 threads.

Reports wall seconds, answers and generated tokens per minute, and how many answers equal the
in-process ones token for token (the f32 server computes the same function in another order;
Q4_1 is another model: its activations are quantised to 8 bits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.layouts.llama_cpp import LlamaServer, gguf_for_target  # noqa: E402


def regenerate(args: list[str], out: Path, threads: int) -> float:
    """Run one regeneration to ``out``; its wall seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "draftsmith.train.data", "regenerate", *args, "--out", str(out)],
                   check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return time.perf_counter() - start


def answers(path: Path, tokenizer) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda row: row["prompt_index"])  # concurrent requests finish out of order
    return [tokenizer.encode(row["messages"][-1]["content"], add_special_tokens=False)
            for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", default="data/train/selfdistill_prompts.jsonl.gz")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="hf: prompts per generate")
    parser.add_argument("--parallel", type=int, nargs="+", default=[4, 8],
                        help="llama-server slots (and requests in flight) to try")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="reports/regenerate_speed.json")
    args = parser.parse_args()
    from draftsmith.targets.target import load_target

    tokenizer = load_target("smollm2-135m", device="cpu", dtype="float32").tokenizer
    common = ["--target", "smollm2-135m", "--data", args.prompts, "--max-prompts",
              str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
              "--temperature", "0", "--max-turns", "1"]
    report = {"prompts": args.prompts, "num_prompts": args.num_prompts,
              "max_new_tokens": args.max_new_tokens, "threads": args.threads, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        reference = tmp / "hf.jsonl"
        seconds = regenerate([*common, "--backend", "hf", "--batch-size", str(args.batch_size)],
                             reference, args.threads)
        runs = {f"hf batch {args.batch_size}": (seconds, reference)}
        for kind in ("f32", None):
            model, _ = gguf_for_target("smollm2-135m", kind)
            for slots in args.parallel:
                name = f"llama-server {kind or 'q4_1'} parallel {slots}"
                out = tmp / f"{kind or 'q4_1'}-{slots}.jsonl"
                with LlamaServer(["-m", str(model), "-c", str(slots * 2048), "-np", str(slots),
                                  "--alias", "smollm2"], name=name, threads=args.threads,
                                 log_dir=tmp) as server:
                    seconds = regenerate([*common, "--backend", "openai", "--url",
                                          f"{server.url}/v1", "--model", "smollm2",
                                          "--concurrency", str(slots)], out, args.threads)
                runs[name] = (seconds, out)
        expected = answers(reference, tokenizer)
        for name, (seconds, path) in runs.items():
            got = answers(path, tokenizer)
            tokens = sum(len(a) for a in got)
            report["runs"][name] = {
                "seconds": round(seconds, 1), "answers": len(got),
                "answers_per_minute": round(60 * len(got) / seconds, 1),
                "tokens_per_second": round(tokens / seconds, 1),
                "identical_to_hf": sum(a == b for a, b in zip(got, expected, strict=False)),
            }
            print(name, report["runs"][name], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
