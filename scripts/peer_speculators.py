"""The draftsmith side of scripts/peer_speculators.sh: the rows, the hidden states, the settings
and the step budgets it gives speculators' EAGLE-3 trainer and ours.

    python scripts/peer_speculators.py subset DATA N OUT.jsonl
    python scripts/peer_speculators.py rows --ours CONFIG --data DATA --out ROWS.jsonl
    python scripts/peer_speculators.py features --ours CONFIG --rows ROWS.jsonl --layers 2 15 27 30 \
        --out DIR
    python scripts/peer_speculators.py flags --ours CONFIG --variant defaults|ours --rows ROWS.jsonl \
        [--memory-gib G] [--record SETTINGS.json]
    python scripts/peer_speculators.py layers --ours CONFIG --variant defaults|ours
    python scripts/peer_speculators.py plan --kind ours|speculators --metrics FILE --seconds S \
        --budget B [--record PLAN.json]
    python scripts/peer_speculators.py summary --kind ours|speculators --metrics FILE
    python scripts/peer_speculators.py meta --dir OUT --out REPORT.meta.json

``rows``: exactly the rows draftsmith's trainer reads for CONFIG and DATA (draftsmith.train.rows's
tokenisation, chat template and ``max_length`` truncation), as speculators' pre-tokenised format
(``input_ids``, ``loss_mask``: 1 on the tokens of assistant turns, which both projects mean by
it).

``features``: the target's hidden states for those rows in the files speculators' trainer reads
(what vLLM's ``extract_hidden_states`` writes through its file connector and
``speculators generate-offline-data`` moves into place): ``hs_<i>.safetensors`` holding
``token_ids`` (seq,) int64 and ``hidden_states`` (seq, len(layers), h) bf16, for row i and the
validation copy of row 0 (speculators_cpu.py ``dataset`` appends it). Layer ids count as vLLM's
do: id i is the input of decoder layer i (transformers' ``hidden_states[i]``) and id L, the last,
the last layer's output before the final norm (speculators applies the verifier's norm itself).
The target runs in bf16, as vLLM serves it, on a CPU with native bf16 (AMX / AVX-512 BF16; twice
as fast there as fp32 weights under bf16 autocast), in fp32 elsewhere; rows in batches of similar
length, right-padded.

``flags``: speculators' train flags of a variant: ``defaults`` its documented defaults,
``ours`` with every knob it shares with CONFIG set as CONFIG sets it (the mapping, what has no
knob and any memory change go to ``--record`` as JSON). Both variants get the flags a CPU needs
(the header of peer_speculators.sh), and a packing budget halved while its eager losses would not
fit the memory available (or ``--memory-gib``).

``plan``: the optimizer steps that fit a budget, from a short probe run of the same trainer:
the probe's wall time minus its steps is the start-up, the mean of its steps after the first is a
step. Both trainers then plan their learning-rate schedules over the steps they can take.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import save_file

from draftsmith.files.command_line import run_command
from draftsmith.files.output_dir import write_atomic
from draftsmith.heads.eagle_config import default_aux_layer_ids
from draftsmith.targets.resolve import resolve_target
from draftsmith.targets.target import load_target
from draftsmith.train.speed import logged_step_seconds, steps_for_budget

# What speculators' trainer needs on a CPU, whatever the variant: its fused losses are Triton
# kernels (GPU only); torch 2.13 has no flex-attention backward on a CPU ("FlexAttention does not
# support backward on CPU"), SDPA with the same mask has one (and beat eager attention here, 36 s
# against 46 s a step); one data-loader process instead of 12 (each imports torch, ~0.4 GB, and
# competes for the cores)
CPU_FLAGS = ("--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--num-workers", "1")
# speculators' default packing budget (tokens per step) and what its eager losses keep per token
# x draft vocabulary x test-time step, measured on this CPU (5.1 GB peak at 2048 tokens, a 49152
# vocabulary and 3 steps, 2.9 GB at 1024), beside about 1 GB of everything else
SPECULATORS_SEQ_LEN = 8192
LOSS_BYTES = 15
# speculators' EAGLE-3 architecture flags (their defaults are true for eagle3); draftsmith's head
# has none of them, so the ``ours`` variant turns them off
ARCHITECTURE_FLAGS = ("--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output")


def _config(path: str, data: str | None = None):
    from draftsmith.train.config import parse_config
    from draftsmith.train.eagle import EagleTrainConfig

    argv = ["--config", path] + (["--data", data] if data else [])
    cfg = parse_config(EagleTrainConfig, argv)
    if cfg.version != 3:
        raise ValueError(f"{path} trains EAGLE-{cfg.version}; speculators' peer is EAGLE-3: "
                         "give an EAGLE-3 config (version: 3)")
    return cfg


def _num_layers(target: str) -> int:
    return int(json.loads((resolve_target(target) / "config.json").read_text())
               ["num_hidden_layers"])


def _read_rows(path: str) -> list[dict]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"rows file {path} does not exist: run the rows stage first")
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


# ------------------------------------------------------------------------------------------------
# data


def subset(data: str, count: int, out: str) -> None:
    """The first ``count`` usable conversations of ``data`` as a messages JSONL file (for runs
    on part of the data: both trainers then read this file)."""
    from draftsmith.train.rows import read_conversations

    if count < 1:
        raise ValueError(f"--rows must be at least 1, got {count}")
    conversations, _ = read_conversations(data)
    chosen = conversations[:count]
    text = "".join(json.dumps({"messages": c["messages"]}, ensure_ascii=False) + "\n"
                   for c in chosen)
    write_atomic(out, text.encode())
    print(f"[peer] {len(chosen)} conversations of {data} -> {out}")


def rows(config: str, data: str, out: str) -> None:
    """draftsmith's training rows for CONFIG and DATA, one JSON object per line."""
    from transformers import AutoTokenizer

    from draftsmith.train.rows import load_sft_dataset

    cfg = _config(config, data)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_target(cfg.target)))
    dataset, report = load_sft_dataset(cfg.data, tokenizer, cfg.max_length)
    print(report.summary(), file=sys.stderr)
    lines, tokens, scored, longest = [], 0, 0, 0
    for row in dataset:
        ids, mask = list(row["input_ids"]), [int(m) for m in row["loss_mask"]]
        lines.append(json.dumps({"input_ids": ids, "loss_mask": mask}))
        tokens, scored, longest = tokens + len(ids), scored + sum(mask), max(longest, len(ids))
    if not lines:
        raise ValueError(f"{data} gives no training rows for {config}")
    write_atomic(out, ("\n".join(lines) + "\n").encode())
    info = {"rows": len(lines), "tokens": tokens, "scored_tokens": scored, "longest": longest}
    write_atomic(Path(out).with_suffix(".info.json"), json.dumps(info, indent=2).encode())
    print(json.dumps(info))


# ------------------------------------------------------------------------------------------------
# hidden states


def layer_ids(cfg, variant: str) -> list[int]:
    """speculators' hidden-state ids for a variant: its aux layers, then L (the last layer).
    ``defaults``: speculators' own default aux layers, (2, L // 2, L - 3); ``ours``: CONFIG's."""
    L = _num_layers(cfg.target)
    aux = cfg.aux_layer_ids if variant == "ours" and cfg.aux_layer_ids else None
    return [*(aux or default_aux_layer_ids(L)), L]


def features(config: str, rows_path: str, layers: list[int], out: str,
             tokens_per_batch: int = 8192) -> None:
    """``hs_<i>.safetensors`` for every row and the validation copy of row 0, then
    ``done.json`` with the seconds it took (a directory with it is reused as it is)."""
    from draftsmith.train.accelerator import resolve_mixed_precision

    started = time.time()
    directory = Path(out)
    if (directory / "done.json").is_file():
        print(f"[peer] hidden states in {directory} are complete; reused")
        return
    cfg = _config(config)
    data = _read_rows(rows_path)
    bf16 = resolve_mixed_precision("auto", cpu=not torch.cuda.is_available()) == "bf16"
    target = load_target(cfg.target, dtype="bf16" if bf16 else "float32")
    L = target.num_layers
    if layers[-1] != L or any(not 0 <= i < L for i in layers[:-1]):
        raise ValueError(f"layers {layers}: speculators reads aux layers in 0..{L - 1} and then "
                         f"the last layer, {L}, for the target {cfg.target!r}")
    directory.mkdir(parents=True, exist_ok=True)
    last: list[torch.Tensor] = []
    # the final norm's input is the last layer's output before the norm: vLLM's id L
    hook = target.norm.register_forward_pre_hook(lambda module, args: last.append(args[0]))
    order = sorted(range(len(data)), key=lambda i: -len(data[i]["input_ids"]))
    written = 0
    try:
        start = 0
        while start < len(order):
            width = len(data[order[start]]["input_ids"])  # the longest of the batch (sorted)
            chunk = order[start:start + max(1, tokens_per_batch // width)]
            start += len(chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.int64)
            mask = torch.zeros(len(chunk), width, dtype=torch.int64)
            for b, i in enumerate(chunk):
                row = torch.tensor(data[i]["input_ids"], dtype=torch.int64)
                ids[b, :len(row)], mask[b, :len(row)] = row, 1
            last.clear()
            with torch.no_grad():
                captured, _ = target.hidden_states(ids.to(target.device), layers[:-1],
                                                   mask.to(target.device))
            stacked = torch.stack([*(captured[i] for i in layers[:-1]), last[0]], dim=2)
            for b, i in enumerate(chunk):  # (seq, len(layers), h), padding cut off
                n = len(data[i]["input_ids"])
                tensors = {"hidden_states": stacked[b, :n].to(torch.bfloat16).cpu().contiguous(),
                           "token_ids": ids[b, :n].contiguous()}
                save_file(tensors, str(directory / f"hs_{i}.safetensors"))
                if i == 0:  # the validation row speculators_cpu.py appends is row 0 again
                    save_file(tensors, str(directory / f"hs_{len(data)}.safetensors"))
                written += n
            print(f"[peer] hidden states: {start}/{len(order)} rows, "
                  f"{time.time() - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        hook.remove()
    info = {"seconds": round(time.time() - started, 1), "rows": len(data), "tokens": written,
            "layers": layers, "dtype": "bfloat16" if bf16 else "float32"}
    write_atomic(directory / "done.json", json.dumps(info, indent=2).encode())
    print(json.dumps(info))


# ------------------------------------------------------------------------------------------------
# settings


def _tokens_per_step(cfg, info: dict) -> int:
    """Tokens in one of our optimizer steps: the token budget of a micro-batch, or its rows
    times the mean row length; at least the longest row (speculators truncates a longer row to
    its packing budget)."""
    accumulation = cfg.gradient_accumulation_steps
    if cfg.max_tokens_per_batch:
        tokens = cfg.max_tokens_per_batch * accumulation
    else:
        tokens = round(cfg.per_device_batch_size * accumulation * info["tokens"] / info["rows"])
    return max(tokens, info["longest"])


def _record(path: str | None, data: dict) -> None:
    """A stage's record for the report's .meta.json (to stderr when no file is given)."""
    text = json.dumps(data, indent=2)
    if path is None:
        print(text, file=sys.stderr)
    else:
        write_atomic(path, text.encode())


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def seq_len_that_fits(tokens: int, vocab: int, steps: int, available: int | None) -> int:
    """``tokens`` halved (down to 512) until speculators' eager losses fit in 80% of
    ``available`` bytes."""
    if available is None:
        return tokens
    while tokens > 512 and 1e9 + LOSS_BYTES * tokens * vocab * steps > 0.8 * available:
        tokens //= 2
    return tokens


def flags(config: str, variant: str, rows_path: str, cap: int | None = None,
          record: str | None = None) -> list[str]:
    """speculators' ``train`` flags for ``variant`` (data, paths and step budget are the
    caller's); the mapping from CONFIG and the memory changes go to ``record`` (JSON)."""
    if variant not in ("defaults", "ours"):
        raise ValueError(f"--variant must be defaults or ours, got {variant!r}")
    cfg = _config(config)
    info = json.loads(Path(rows_path).with_suffix(".info.json").read_text())
    verifier = resolve_target(cfg.target)
    out = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(verifier), *CPU_FLAGS]
    available = _available_bytes()
    if cap is not None:  # the caller's memory limit, in the same units
        available = min(available or cap, cap)
    if variant == "defaults":  # the whole vocabulary, 3 test-time steps, 8192-token packing
        vocab = int(json.loads((verifier / "config.json").read_text())["vocab_size"])
        fits = seq_len_that_fits(SPECULATORS_SEQ_LEN, vocab, 3, available)
        cpu = {}
        if fits != SPECULATORS_SEQ_LEN:
            out += ["--total-seq-len", str(fits)]
            cpu["--total-seq-len"] = (f"{SPECULATORS_SEQ_LEN} -> {fits}: its eager losses over "
                                      f"{vocab} tokens would not fit "
                                      f"{(available or 0) / 2**30:.1f} GiB")
        _record(record, {"mapped": {}, "memory_changes": cpu})
        return out
    schedule = {"constant": "none", "linear": "linear", "cosine": "cosine"}[cfg.lr_schedule]
    vocab = cfg.draft_vocab_size or int(json.loads((verifier / "config.json").read_text())
                                         ["vocab_size"])
    seq_len = seq_len_that_fits(_tokens_per_step(cfg, info), vocab, cfg.ttt_steps, available)
    cpu = {}
    if seq_len != _tokens_per_step(cfg, info):
        cpu["--total-seq-len"] = (f"{_tokens_per_step(cfg, info)} -> {seq_len}: its eager losses "
                                  f"would not fit {(available or 0) / 2**30:.1f} GiB")
    mapped = {
        "ttt_steps -> --ttt-steps": (cfg.ttt_steps, ["--ttt-steps", str(cfg.ttt_steps)]),
        "ttt_decay -> --ttt-step-loss-decay": (
            cfg.ttt_decay, ["--ttt-step-loss-decay", str(cfg.ttt_decay)]),
        "learning_rate -> --lr": (cfg.learning_rate, ["--lr", str(cfg.learning_rate)]),
        "AdamW -> --optimizer adamw": ("adamw", ["--optimizer", "adamw"]),
        "weight_decay -> --weight-decay": (
            cfg.weight_decay, ["--weight-decay", str(cfg.weight_decay)]),
        "lr_schedule -> --scheduler-type": (cfg.lr_schedule, ["--scheduler-type", schedule]),
        "warmup_steps -> --scheduler-warmup-steps": (
            cfg.warmup_steps, ["--scheduler-warmup-steps", str(cfg.warmup_steps)]),
        "rows x mean length per step -> --total-seq-len": (
            _tokens_per_step(cfg, info), ["--total-seq-len", str(seq_len)]),
        "head without norm_before_residual / norm_before_fc / norm_output": (
            False, list(ARCHITECTURE_FLAGS)),
        # cross-entropy against the target's distribution: KL with the same gradient
        "soft cross-entropy -> --loss-fn kl_div": ("kl_div", ["--loss-fn", "kl_div"]),
    }
    if cfg.draft_vocab_size:
        mapped["draft_vocab_size -> --draft-vocab-size"] = (
            cfg.draft_vocab_size, ["--draft-vocab-size", str(cfg.draft_vocab_size)])
    if cfg.aux_layer_ids:
        mapped["aux_layer_ids -> --target-layer-ids"] = (
            cfg.aux_layer_ids, ["--target-layer-ids", *map(str, cfg.aux_layer_ids)])
    _record(record, {"mapped": {k: v for k, (v, _) in mapped.items()}, "not_in_speculators": {
        "min_lr_ratio": cfg.min_lr_ratio, "adam_beta1/beta2": [cfg.adam_beta1, cfg.adam_beta2],
        "max_grad_norm (speculators clips at 1.0)": cfg.max_grad_norm,
        "feature_noise": cfg.feature_noise, "feature_mode": cfg.feature_mode,
        "init_layer": cfg.init_layer},
        "memory_changes": cpu})
    return out + [flag for _, group in mapped.values() for flag in group]


# ------------------------------------------------------------------------------------------------
# step budgets


def _records(path: str) -> list[dict]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"metrics file {path} does not exist: the probe run wrote none")
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def step_seconds(kind: str, metrics: str) -> list[float]:
    """Seconds of each optimizer step the run logged (logging every step).

    ours: draftsmith.train.speed.logged_step_seconds of its metrics.jsonl; speculators: the times its
    metric records were logged (speculators_cpu.py adds them), one step fewer than it ran."""
    records = _records(metrics)
    if kind == "ours":
        return logged_step_seconds(records)
    times = [r["time"] for r in records if "train" in r]
    return [b - a for a, b in zip(times, times[1:])]


def plan(kind: str, metrics: str, seconds: float, budget: float, record: str | None = None) -> int:
    """Optimizer steps that fit ``budget`` seconds, from a probe of ``seconds`` wall time
    (draftsmith.train.speed.steps_for_budget)."""
    fit = steps_for_budget(step_seconds(kind, metrics), seconds, budget,
                           unlogged_steps=0 if kind == "ours" else 1, what=kind)
    _record(record, {"kind": kind, "budget_seconds": round(budget, 1),
                     "probe_seconds": round(seconds, 1), **fit})
    return fit["steps"]


def summary(kind: str, metrics: str) -> dict:
    """Steps, tokens and the last logged accuracies of a finished run."""
    records = _records(metrics)
    if kind == "ours":
        last = [r for r in records if "tokens" in r][-1]
        acc = {k: v for k, v in last.items() if k.startswith("acc_")}
        return {"steps": last["step"], "tokens": last["tokens"], "last_step_top1": acc}
    train = [r for r in records if "train" in r]
    tokens = sum(r["profile"]["tokens_per_s"] * r["profile"]["step_ms"] / 1000
                 for r in train if r.get("profile"))
    acc = {k: v for k, v in train[-1]["train"].items() if k.startswith("full_acc_")} if train \
        else {}
    return {"steps": (train[-1]["global_step"] + 1) if train else 0, "tokens": round(tokens),
            "last_step_top1": acc}


def meta(directory: str, out: str) -> None:
    """Every stage's record under DIR/timings/ merged into one JSON file beside the report."""
    stages = {}
    for path in sorted((Path(directory) / "timings").glob("*.json")):
        stages[path.stem] = json.loads(path.read_text())
    write_atomic(out, json.dumps(stages, indent=2).encode())
    print(f"[peer] {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/peer_speculators.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("subset")
    p.add_argument("data")
    p.add_argument("count", type=int)
    p.add_argument("out")
    p = sub.add_parser("rows")
    p.add_argument("--ours", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("features")
    p.add_argument("--ours", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--layers", type=int, nargs="+", required=True)
    p.add_argument("--out", required=True)
    for name in ("flags", "layers"):
        p = sub.add_parser(name)
        p.add_argument("--ours", required=True)
        p.add_argument("--variant", required=True, choices=("defaults", "ours"))
        if name == "flags":
            p.add_argument("--rows", required=True)
            p.add_argument("--memory-gib", type=float, default=None,
                           help="size speculators' packing budget for this much memory")
            p.add_argument("--record", default=None, help="write the settings here (JSON)")
    p = sub.add_parser("plan")
    p.add_argument("--kind", required=True, choices=("ours", "speculators"))
    p.add_argument("--metrics", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--record", default=None, help="write the plan here (JSON)")
    p = sub.add_parser("summary")
    p.add_argument("--kind", required=True, choices=("ours", "speculators"))
    p.add_argument("--metrics", required=True)
    p = sub.add_parser("meta")
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "subset":
        subset(args.data, args.count, args.out)
    elif args.command == "rows":
        rows(args.ours, args.data, args.out)
    elif args.command == "features":
        features(args.ours, args.rows, args.layers, args.out)
    elif args.command == "flags":
        cap = None if args.memory_gib is None else int(args.memory_gib * 2**30)
        print("\n".join(flags(args.ours, args.variant, args.rows, cap, args.record)))
    elif args.command == "layers":
        print(" ".join(map(str, layer_ids(_config(args.ours), args.variant))))
    elif args.command == "plan":
        print(plan(args.kind, args.metrics, args.seconds, args.budget, args.record))
    elif args.command == "summary":
        print(json.dumps(summary(args.kind, args.metrics)))
    else:
        meta(args.dir, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main, "scripts/peer_speculators.py"))
