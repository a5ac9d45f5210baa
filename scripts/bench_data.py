"""Throughput of the data pipeline on this machine: regeneration and the EAGLE feature cache.

Each run prints one JSON line (and appends it to --report). The figures in the README came from::

    python scripts/bench_data.py regen --backend hf --prompts 16 --batch-size 8
    python -m transformers.cli.transformers serve "$(python -c 'from draftsmith.targets.target import \
        resolve_target; print(resolve_target("smollm2-135m"))')" --host 127.0.0.1 --port 8123 \
        --device cpu --dtype float32 [--continuous-batching] &
    python scripts/bench_data.py regen --backend openai --url http://127.0.0.1:8123/v1 \
        --prompts 16 --concurrency 1     # and 8
    python scripts/bench_data.py write --rows 256 --cache runs/bench/cache1
    torchrun --standalone --nproc_per_node 2 scripts/bench_data.py write --rows 256 \
        --cache runs/bench/cache2
    python scripts/bench_data.py read --cache runs/bench/cache1 --workers 0   # and 2

Prompts are GSM8K questions (short), answered greedily with 64 new tokens; the cache is EAGLE-3
(smollm2-135m's default aux layers 2, 15, 27 plus the last over scored positions) in bf16 over
GSM8K question-answer rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from draftsmith.train.accelerator import close_process_group

REPO = Path(__file__).resolve().parents[1]
GSM8K = str(REPO / "data" / "train" / "gsm8k_train.jsonl")


class PeakRSS:
    """Samples this process's resident memory every 20 ms while the block runs."""

    def __enter__(self):
        self.peak, self.running = self.now(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.02)


def emit(record: dict, report: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if report:
        with open(report, "a") as f:
            f.write(line + "\n")


def regen(args) -> None:
    from transformers import AutoTokenizer

    from draftsmith.targets.resolve import resolve_target
    from draftsmith.targets.target import load_target
    from draftsmith.train.regenerate import regenerate
    from draftsmith.train.regenerate_backends import HFBackend, OpenAIBackend

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_target("smollm2-135m")))
    out = Path(args.out)
    out.unlink(missing_ok=True)
    if args.backend == "hf":
        backend = HFBackend(load_target("smollm2-135m"), batch_size=args.batch_size)
    else:
        backend = OpenAIBackend(args.url, args.model or str(resolve_target("smollm2-135m")),
                                tokenizer, concurrency=args.concurrency, max_context=8192)
    start = time.perf_counter()
    regenerate(backend, GSM8K, out, max_new_tokens=args.max_new_tokens, temperature=0.0,
               max_prompts=args.prompts, batch_size=args.batch_size, progress=False)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = sum(len(tokenizer(r["messages"][-1]["content"], add_special_tokens=False)
                     ["input_ids"]) + r["finished"] for r in rows)
    emit({"bench": "regenerate", "backend": args.backend, "prompts": len(rows),
          "concurrency": args.concurrency if args.backend == "openai" else None,
          "batch_size": args.batch_size if args.backend == "hf" else None,
          "threads": args.threads, "max_new_tokens": args.max_new_tokens,
          "new_tokens": tokens, "seconds": round(wall, 2),
          "tokens_per_s": round(tokens / wall, 2)}, args.report)


def write(args) -> None:
    import torch.distributed as dist

    from draftsmith.heads.eagle_config import EagleConfig
    from draftsmith.targets.target import load_target
    from draftsmith.train.features import write_feature_cache
    from draftsmith.train.rows import load_sft_dataset

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(args.threads)
    if world > 1:
        dist.init_process_group("gloo")
    target = load_target("smollm2-135m")
    dataset, _ = load_sft_dataset(GSM8K, target.tokenizer, max_length=2048)
    dataset = dataset.select(range(args.rows))
    config = EagleConfig.from_target(target, 3)
    before = PeakRSS.now()
    with PeakRSS() as rss:
        start = time.perf_counter()
        write_feature_cache(target, dataset, args.cache, config, process_index=rank,
                            num_processes=world, batch_size=args.batch_size,
                            dtype=torch.bfloat16, max_file_bytes=args.max_file_bytes)
        wall = time.perf_counter() - start
    index = json.loads((Path(args.cache) / "index.json").read_text())
    mine = [f for k, f in enumerate(index["files"]) if k % world == rank]
    record = {"bench": "write", "rank": rank, "processes": world, "threads": args.threads,
              "rows": len(dataset), "tokens": sum(f["tokens"] for f in mine),
              "bytes": sum(f["bytes"] for f in mine), "seconds": round(wall, 2),
              "rss_before_gb": round(before / 1e9, 3), "peak_rss_gb": round(rss.peak / 1e9, 3)}
    record["tokens_per_s"] = round(record["tokens"] / wall, 1)
    record["mb_per_s"] = round(record["bytes"] / wall / 1e6, 2)
    if world > 1:
        records = [None] * world
        dist.all_gather_object(records, record)
        close_process_group()
        if rank == 0:
            wall = max(r["seconds"] for r in records)
            emit({"bench": "write", "processes": world, "threads": args.threads,
                  "rows": len(dataset), "tokens": index["tokens"], "bytes": index["bytes"],
                  "seconds": wall, "tokens_per_s": round(index["tokens"] / wall, 1),
                  "mb_per_s": round(index["bytes"] / wall / 1e6, 2),
                  "peak_rss_gb_per_process": [r["peak_rss_gb"] for r in records],
                  "rss_before_gb_per_process": [r["rss_before_gb"] for r in records]},
                 args.report)
    else:
        emit(record, args.report)


def read(args) -> None:
    from functools import partial

    from torch.utils.data import DataLoader

    from draftsmith.heads.eagle_config import EagleConfig
    from draftsmith.targets.target import load_target_parts
    from draftsmith.train.features import FeatureCache, collate_features

    torch.set_num_threads(args.threads)
    target = load_target_parts("smollm2-135m")
    config = EagleConfig.from_target(target, 3)
    cache = FeatureCache(args.cache, config, target)
    loader = DataLoader(cache, batch_size=args.batch_size, num_workers=args.workers,
                        shuffle=True, collate_fn=partial(collate_features, pad_token_id=0))
    start = time.perf_counter()
    tokens = sum(int(batch["attention_mask"].sum()) for batch in loader)
    wall = time.perf_counter() - start
    emit({"bench": "read", "workers": args.workers, "rows": len(cache), "tokens": tokens,
          "bytes": cache.index["bytes"], "seconds": round(wall, 2),
          "tokens_per_s": round(tokens / wall, 1),
          "mb_per_s": round(cache.index["bytes"] / wall / 1e6, 2)}, args.report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    r = commands.add_parser("regen")
    r.add_argument("--backend", choices=("hf", "openai"), required=True)
    r.add_argument("--url")
    r.add_argument("--model", help="default: the embedded target's directory")
    r.add_argument("--concurrency", type=int, default=1)
    r.add_argument("--prompts", type=int, default=16)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--out", default="runs/bench/regen.jsonl")
    w = commands.add_parser("write")
    w.add_argument("--rows", type=int, default=256)
    w.add_argument("--cache", required=True)
    w.add_argument("--batch-size", type=int, default=8)
    w.add_argument("--max-file-bytes", type=int, default=256 << 20)
    d = commands.add_parser("read")
    d.add_argument("--cache", required=True)
    d.add_argument("--workers", type=int, default=0)
    d.add_argument("--batch-size", type=int, default=8)
    for command in (r, w, d):
        command.add_argument("--threads", type=int, default=1, help="torch threads per process")
        command.add_argument("--report", default=None, help="JSONL file to append the figures to")
    args = parser.parse_args()
    Path("runs/bench").mkdir(parents=True, exist_ok=True)
    {"regen": regen, "write": write, "read": read}[args.command](args)


if __name__ == "__main__":
    main()
