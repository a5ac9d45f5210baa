"""Sharding through torch's engines (train/sharding.py, targets/shards.py): what is refused
before the target loads, the shared-directory check, the memory estimate of a sharded 70B run,
and the helpers the trainers' multi-process tests launch with (test_train_*.py: a target sharded
over 2 processes and the trained module under FSDP2 train the steps 1 process trains, and their
checkpoints resume at another number of processes).

A launch "with configs/accelerate/fsdp2.yaml" is emulated exactly: the environment accelerate's
own launcher (``prepare_multi_gpu_env``) exports from that file, given to torchrun (accelerate
1.15 starts several CPU processes only through mpirun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import debug_launcher
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env

from draftsmith.train.config import config_to_dict

REPO = Path(__file__).resolve().parents[1]
FSDP_KEYS = ("ACCELERATE_USE_FSDP", "FSDP_")


def fsdp2_env() -> dict[str, str]:
    """The FSDP variables ``accelerate launch --config_file configs/accelerate/fsdp2.yaml``
    exports to its processes (computed by accelerate's launcher itself)."""
    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(REPO / "configs/accelerate/fsdp2.yaml"),
                              "train/eagle.py"])
    args, _, _ = _validate_launch_command(args)
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(FSDP_KEYS)}


def without_fsdp() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(FSDP_KEYS)}


def torchrun(script: str, cfg, *, fsdp2: bool, processes: int = 2) -> None:
    """``cfg`` run by ``processes`` CPU processes (gloo), as a subprocess with a time limit."""
    argv = [f"--{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in config_to_dict(cfg).items() if v is not None and v != []]
    env = {**without_fsdp(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
           **(fsdp2_env() if fsdp2 else {})}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(processes), str(REPO / script), *argv], cwd=REPO, capture_output=True, text=True,
        timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture
def fsdp2_launch(monkeypatch):
    """This process launched as accelerate launch with configs/accelerate/fsdp2.yaml would be
    (one process: the module stays whole, its checkpoints are FSDP2's)."""
    for key in without_fsdp().keys() ^ os.environ.keys():
        monkeypatch.delenv(key)
    for key, value in fsdp2_env().items():
        monkeypatch.setenv(key, value)


def losses(out: Path, *keys: str) -> list[tuple]:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [tuple(r.get(k) for k in ("step", "loss", *keys)) for r in rows if "loss" in r]


def assert_same_steps(expected: list[tuple], got: list[tuple], rel: float = 1e-5) -> None:
    """Step by step, every logged figure equal to ``rel``."""
    assert [r[0] for r in got] == [r[0] for r in expected]
    for a, b in zip(expected, got, strict=True):
        assert b == pytest.approx(a, rel=rel, abs=1e-6), (a, b)


# ------------------------------------------------------------------------------------------------
# refused before the target loads


def test_a_shard_count_the_target_cannot_split_into_is_refused():
    from draftsmith.targets.shards import check_shards

    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    check_shards(config, 32)  # kv heads x head_dim = 2 x 16 rows: every process holds some
    with pytest.raises(ValueError, match="target_parallel 64 is more than the 32 rows"):
        check_shards(config, 64)


def _probe(directories: list[str]) -> None:
    """Run by each of 2 processes: the shared-directory check on its own directory."""
    from accelerate.state import AcceleratorState

    from draftsmith.train.accelerator import make_accelerator
    from draftsmith.train.config import TrainConfig
    from draftsmith.train.sharding import check_shared_directory

    # a forked child inherits the state of an Accelerator this test process made before
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = make_accelerator(TrainConfig(output_dir=directories[0]))
    mine = Path(directories[accelerator.process_index])
    try:
        check_shared_directory(accelerator, mine, "output_dir")
        outcome = "accepted"
    except ValueError as err:
        outcome = str(err)
    (mine / f"outcome-{accelerator.process_index}.txt").write_text(outcome)


def test_sharding_refuses_a_checkpoint_directory_not_shared_by_every_process(tmp_path):
    """Two processes (gloo) that see different directories under one name (node-local disks,
    emulated by a directory per process) are refused on every process, with one line; a
    shared one passes, and the check leaves nothing behind."""
    shared, left, right = tmp_path / "shared", tmp_path / "node0", tmp_path / "node1"
    for directory in (shared, left, right):
        directory.mkdir()
    debug_launcher(_probe, args=([str(shared), str(shared)],), num_processes=2)
    assert {p.read_text() for p in shared.glob("outcome-*.txt")} == {"accepted"}
    assert sorted(p.name for p in shared.iterdir()) == ["outcome-0.txt", "outcome-1.txt"]
    debug_launcher(_probe, args=([str(left), str(right)],), num_processes=2)
    outcomes = [(left / "outcome-0.txt").read_text(), (right / "outcome-1.txt").read_text()]
    for outcome in outcomes:
        assert "is not shared by every process (process(es) [1]" in outcome
        assert "\n" not in outcome
    assert sorted(p.name for p in right.iterdir()) == ["outcome-1.txt"]


# ------------------------------------------------------------------------------------------------
# the memory estimate of a sharded target


@pytest.mark.parametrize("trainer, launch", [("eagle", []), ("eagle", ["--fsdp2"]),
                                             ("dflash", ["--fsdp2"])])
def test_the_70b_recipes_fit_80gb_gpus_with_the_target_sharded(trainer, launch, capsys):
    """python -m draftsmith.train.memory --config configs/<trainer>/llama-3.3-70b-instruct.yaml
    --processes 8: the target's layers split over 8 GPUs, one GPU's peak under 80 GB (the block
    draft's 4.6 B parameters need FSDP2 as well); the same run with a whole target per GPU does
    not fit, and the estimate says so. The shapes come from the shipped config.json copy."""
    from draftsmith.train.memory import main

    config = str(REPO / f"configs/{trainer}/llama-3.3-70b-instruct.yaml")
    sharded = main(["--config", config, "--processes", "8", *launch])
    printed = capsys.readouterr().out
    assert "the target sharded over 8" in printed and "layers 1/8" in printed
    assert sharded.total < 80e9, sharded.table()
    whole = main(["--config", config, "--processes", "8", "--target_parallel", "1", *launch])
    assert whole.total > 141e9
    with pytest.raises(ValueError, match="does not divide --processes 4"):
        main(["--config", config, "--processes", "4", "--target_parallel", "8"])


def test_the_estimate_counts_a_sharded_target_and_only_the_parts_a_run_loads(tmp_path):
    """A run from a finished feature cache loads the embedding, norm and LM head alone: the
    estimate counts those, not the whole target."""
    from draftsmith.train.eagle import MEMORY, EagleTrainConfig
    from draftsmith.train.estimate import Shape

    shape = Shape(8192, 28672, 80, 64, 8, 128, 128256, False)
    cfg = EagleTrainConfig(data=["unused.jsonl"], output_dir=str(tmp_path), eval_every=0)
    whole = MEMORY.estimate(cfg, shape, device="cuda", processes=8)
    parts = MEMORY.estimate(cfg, shape, device="cuda", processes=8, parts_only=True)
    assert whole.parts["frozen target weights"] == pytest.approx(shape.params() * 2)
    assert parts.parts["frozen target: embedding, norm, LM head"] == \
        pytest.approx((2 * 128256 * 8192 + 8192) * 2)
    cfg.target_parallel = 8
    sharded = MEMORY.estimate(cfg, shape, device="cuda", processes=8)
    layer = shape.layer_params()
    assert sharded.parts["frozen target (layers 1/8, 2 gathered)"] == pytest.approx(
        2 * (shape.params(layers=0) + 80 * layer / 8 + 2 * layer))


class _Planted:
    """Unpickling this creates a file: what a crafted dcp/.metadata could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_dcp_directory_is_verified_before_torch_unpickles_it(tmp_path):
    """dcp/.metadata is a pickle torch's reader unpickles: draftsmith reads only the one it
    wrote (its SHA-256 and every shard's recorded in trainer_state.json at save time), so a
    planted .metadata runs nothing, a checkpoint without digests is refused unread, and a zeroed
    region inside a shard of the right size is caught."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from draftsmith.train.sharding import DCP_DIR, dcp_digests, dcp_problems, load_sharded

    ckpt = tmp_path / "step_2"
    dcp.save({"model": {"w": torch.arange(64.0)}}, checkpoint_id=str(ckpt / DCP_DIR),
             no_dist=True)
    recorded = {"sharding": "fsdp2", "dcp": dcp_digests(ckpt)}
    assert ".metadata" in recorded["dcp"] and dcp_problems(ckpt, recorded) == []

    shard = next(p for p in (ckpt / DCP_DIR).iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-64:] = bytes(64)  # a zeroed region, the size unchanged
    shard.write_bytes(bytes(data))
    assert any(shard.name in p and "SHA-256" in p for p in dcp_problems(ckpt, recorded))

    marker = tmp_path / "code-ran"
    (ckpt / DCP_DIR / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    assert any(".metadata" in p for p in dcp_problems(ckpt, recorded))
    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not the one draftsmith wrote.*nothing was read"):
        load_sharded(module, optimizer, ckpt, recorded)
    unrecorded = dcp_problems(ckpt, {"sharding": "fsdp2"})
    assert len(unrecorded) == 1 and "no recorded digests" in unrecorded[0]
    escaping = dcp_problems(ckpt, {"dcp": {".metadata": recorded["dcp"][".metadata"],
                                           "../../outside": {"bytes": 1, "sha256": "0"}}})
    assert any("malformed" in p for p in escaping)
    assert not marker.exists(), "a planted .metadata was unpickled"
