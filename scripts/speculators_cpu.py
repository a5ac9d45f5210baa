"""Run inside speculators' own venv by scripts/peer_speculators.sh: its training data and its
trainer, on a CPU.

    python speculators_cpu.py dataset ROWS.jsonl DATA_DIR
    python speculators_cpu.py train METRICS.jsonl STEPS -- <speculators train flags>

Imports nothing from draftsmith (the venv holds speculators 0.9.0 with its own torch and
transformers).

``dataset`` writes what ``speculators prepare-data`` writes for rows that are already in its
speculator format (``input_ids`` + ``loss_mask``, which it passes through untouched): a
``datasets`` directory with ``input_ids``, ``loss_mask``, ``seq_len`` in torch format, and the
``token_freq.pt`` its trainer builds a reduced draft vocabulary from (counted by speculators' own
``save_token_frequency_distribution``). Two differences, both so that its trainer sees exactly the
rows draftsmith's trainer sees: the rows keep their order (prepare-data shuffles them; both
trainers shuffle every epoch anyway), and one extra row, a copy of the first, is appended as the
validation split (its trainer refuses a train/validation ratio of 1 and would otherwise hold out
10% of the rows). The hidden states come from scripts/peer_speculators.py ``features``.

``train`` runs ``speculators train`` (``speculators.train.cli.main`` on its own config resolution)
after the changes a CPU needs, the same ones listed in peer_speculators.sh's header:

1. its trainer moves the draft and every batch to ``get_local_rank()``, the integer 0, which torch
   reads as ``cuda:0``: here it is ``"cpu"``;
2. its autocast names the device ``"cuda"`` when no accelerator exists, which disables autocast
   on a CPU (the draft would then run in fp32 on bf16 hidden states and fail): here ``"cpu"``, so
   it trains in bf16 autocast as on a GPU (this CPU has AMX bf16);
3. its step timer calls ``torch.accelerator.synchronize()`` on every logged step, which raises
   without an accelerator: a CPU has nothing to wait for, so it returns at once.

Its metrics (the dicts it logs to ``speculators.metrics``) are also written, one JSON object per
line, to METRICS.jsonl, each with the wall-clock time: added beside its own loggers, nothing of
its own is changed.

STEPS is the run's length in optimizer steps, passed as ``--max-steps`` (its learning-rate schedule
then spans them) with ``--epochs`` just large enough to hold them, counted with its own packing
sampler over the epochs' shuffles: its loop checks ``max_steps`` only inside an epoch, so every
further epoch would still run one step, save a checkpoint and validate.
"""

import json
import logging
import sys
import time
from pathlib import Path


def write_dataset(rows_path: str, out_dir: str) -> None:
    """speculators' training dataset from draftsmith's rows (one JSON object per line with
    ``input_ids`` and ``loss_mask``), the first row repeated once as the validation split."""
    import torch
    from datasets import Dataset
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    rows = [json.loads(line) for line in Path(rows_path).read_text().splitlines() if line]
    if not rows:
        raise ValueError(f"{rows_path} holds no rows")
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for row in [*rows, rows[0]]:
        if len(row["input_ids"]) != len(row["loss_mask"]):
            raise ValueError(f"{rows_path}: a row with {len(row['input_ids'])} token ids and "
                             f"{len(row['loss_mask'])} loss-mask entries")
        columns["input_ids"].append(row["input_ids"])
        columns["loss_mask"].append(row["loss_mask"])
        columns["seq_len"].append(len(row["input_ids"]))
    dataset = Dataset.from_dict(columns)
    dataset.set_format(type="torch")
    dataset.save_to_disk(out_dir)
    # counted over the training rows only, as prepare-data counts its output
    train = dataset.select(range(len(rows)))
    save_token_frequency_distribution(train, Path(out_dir) / "token_freq.pt")
    print(json.dumps({"rows": len(rows), "tokens": int(sum(columns["seq_len"][:-1])),
                      "scored": int(sum(torch.tensor(r["loss_mask"]).sum() for r in rows))}))


class _JsonLines(logging.Handler):
    """speculators' metric records (dicts) as JSON lines with the time they were logged."""

    def __init__(self, path: str):
        super().__init__()
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (open for the whole run)

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            self.file.write(json.dumps({"time": record.created, **record.msg}, default=str) + "\n")


def _on_cpu() -> None:
    """The three changes of the module docstring, applied before training starts."""
    import torch
    from speculators.train import trainer

    if torch.accelerator.is_available():
        return  # a GPU machine: speculators runs as shipped
    trainer.get_local_rank = lambda: "cpu"  # 1: .to("cpu"), not .to(0) = cuda:0
    init = trainer.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"  # 2: torch.autocast("cpu", bf16), not the disabled "cuda"

    trainer.Trainer.__init__ = cpu_init
    synchronize = torch.accelerator.synchronize

    def cpu_synchronize(device=None):  # 3: CPU work is done when the call returns
        if torch.accelerator.is_available():
            synchronize(device)

    torch.accelerator.synchronize = cpu_synchronize


def epochs_for(argv: list[str], steps: int) -> int:
    """The fewest epochs whose packed batches number at least ``steps``."""
    from datasets import load_from_disk
    from speculators.train.config import TrainConfig
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    flat = TrainConfig.resolve(argv).flatten()
    lengths = load_from_disk(flat["data_path"]).with_format(None)["seq_len"]
    train_rows = int(len(lengths) * flat["train_data_ratio"])  # as its ArrowDataset splits
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=flat["total_seq_len"], lengths=lengths[:train_rows], num_replicas=1,
        rank=0, seed=flat["seed"])
    epochs, total = 0, 0
    while total < steps:
        sampler.set_epoch(epochs)
        total += len(sampler)
        epochs += 1
    return epochs


def train(metrics_path: str, steps: int, argv: list[str]) -> None:
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    argv = [*argv, "--max-steps", str(steps), "--epochs", str(epochs_for(argv, steps))]
    _on_cpu()
    setup = cli.setup_metric_logger

    def with_json_lines(*args, **kwargs):
        setup(*args, **kwargs)  # speculators' own loggers first; dictConfig resets handlers
        logging.getLogger("speculators.metrics").addHandler(_JsonLines(metrics_path))

    cli.setup_metric_logger = with_json_lines
    started = time.time()
    cli.main(TrainConfig.resolve(argv))
    print(json.dumps({"speculators_train_seconds": round(time.time() - started, 1)}))


if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["dataset"] and len(sys.argv) == 4:
        write_dataset(sys.argv[2], sys.argv[3])
    elif command == ["train"] and len(sys.argv) >= 5 and sys.argv[4] == "--":
        train(sys.argv[2], int(sys.argv[3]), sys.argv[5:])
    else:
        sys.exit("usage: speculators_cpu.py dataset ROWS.jsonl DATA_DIR | "
                 "train METRICS.jsonl STEPS -- <speculators train flags>")
