"""The training runtime (train/loop.py and the modules it runs on) and TrainConfig: exact resume,
atomic saves, pruning, refusals, stopping, DDP, the batch plan.

Most tests drive tests/fixtures/toy_train.py, a complete small trainer built from the runtime's
helpers (a linear head with dropout and noise on a frozen tiny random Llama), in-process; the
SIGTERM and two-process tests run it as a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from accelerate.utils.launch import prepare_multi_gpu_env
from safetensors.torch import load_file
from torch import nn

from draftsmith.files.output_dir import MARKER, read_marker
from draftsmith.train.accelerator import (
    cpu_has_bf16,
    launched_on_cpu,
    make_accelerator,
    resolve_mixed_precision,
)
from draftsmith.train.batches import BatchPlan, loss_scale, make_batches, padded_tokens
from draftsmith.train.checkpoints import (
    STATE_FILE,
    Checkpointer,
    latest_checkpoint,
    list_checkpoints,
    read_checkpoint_state,
)
from draftsmith.train.config import (
    TrainConfig,
    config_from_dict,
    may_change_on_resume,
    parse_config,
)
from draftsmith.train.loop import NonFiniteLoss
from draftsmith.train.optimizer import learning_rate, make_optimizer
from draftsmith.train.signals import GracefulStop, follow_launcher, is_accelerate_launch

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "tests" / "fixtures" / "toy_train.py"
ACCELERATE_CONFIGS = REPO / "configs" / "accelerate"

# 20 rows and a global batch of 8 (4 rows x 2 micro-batches): 2 optimizer steps per epoch, so a
# 6-step run crosses two epoch boundaries and a stop at step 3 falls mid-epoch.
BASE = dict(target="tiny-llama", mixed_precision="no", max_steps=6, per_device_batch_size=4, gradient_accumulation_steps=2, num_rows=20,
            warmup_steps=2, lr_schedule="cosine", learning_rate=1e-2, save_every=2,
            keep_checkpoints=None, log_every=1, eval_every=0, head_dropout=0.1, head_noise=0.05)


def _subprocess_env() -> dict:
    # one thread per process: the CPU is shared, and oversubscribed threads make torch crawl;
    # this checkout's packages first, whatever copy of draftsmith is installed
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": path}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(toy, out: Path, **overrides) -> dict:
    cfg = config_from_dict(toy.ToyConfig, {**BASE, "output_dir": str(out), **overrides})
    return toy.main(cfg)


def train_records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def steps_of(out: Path) -> list[int]:
    return [int(p.name.split("_")[1]) for p in list_checkpoints(out / "checkpoints")]


# ------------------------------------------------------------------------------------------------
# Exact resume


def test_resume_continues_exactly(toy, tmp_path, capsys):
    """3 steps, a stop, then resume latest for 3 more == 6 uninterrupted steps, bit for bit,
    with shuffling, dropout, noise, gradient accumulation, warmup + cosine and epoch crossings."""
    whole = run(toy, tmp_path / "whole")
    first = run(toy, tmp_path / "split", stop_after=3)
    assert first["stopped"] and first["step"] == 3
    assert "stopped by stop_after 3 after step 3 of 6" in capsys.readouterr().out
    assert steps_of(tmp_path / "split") == [2, 3]
    assert not (tmp_path / "split" / "artifact").exists()  # a stopped run exports nothing
    rest = run(toy, tmp_path / "split", resume="latest")
    assert rest["step"] == 6

    expected = train_records(tmp_path / "whole")
    got = train_records(tmp_path / "split")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # one consistent history
    for a, b in zip(expected, got):
        assert (a["loss"], a["accuracy"], a["lr"]) == (b["loss"], b["accuracy"], b["lr"])
    assert len({r["loss"] for r in expected}) == 6  # the losses do move
    for name, tensor in whole["weights"].items():
        assert torch.equal(tensor, rest["weights"][name]), name

    # a checkpoint path (not 'latest') continues exactly too, here into a new directory
    from_path = run(toy, tmp_path / "branch",
                    resume=str(tmp_path / "split" / "checkpoints" / "step_2"))
    assert [r["loss"] for r in train_records(tmp_path / "branch")] == \
        [r["loss"] for r in expected[2:]]
    for name, tensor in whole["weights"].items():
        assert torch.equal(tensor, from_path["weights"][name]), name


def test_token_budget_batches_resume_exactly_and_split_over_processes(toy, tmp_path):
    """Rows of 6..40 tokens in micro-batches of at most 96 tokens (padding counted): a stop and
    a resume give the uninterrupted run's losses and weights bit for bit, and two processes
    with one accumulation step each train the same steps as one process with two."""
    budget = dict(num_rows=60, seq_len=40, min_seq_len=6, max_tokens_per_batch=96,
                  head_dropout=0.0, head_noise=0.0)
    whole = run(toy, tmp_path / "whole", **budget)
    run(toy, tmp_path / "split", stop_after=3, **budget)
    rest = run(toy, tmp_path / "split", resume="latest", **budget)
    expected, got = train_records(tmp_path / "whole"), train_records(tmp_path / "split")
    assert [(r["loss"], r["samples"], r["tokens"]) for r in expected] == \
        [(r["loss"], r["samples"], r["tokens"]) for r in got]
    assert len({r["samples"] for r in expected}) == 6  # rows per step vary with their length
    assert all(r["padding"] < 0.2 for r in expected)
    for name, tensor in whole["weights"].items():
        assert torch.equal(tensor, rest["weights"][name]), name

    two = tmp_path / "two"
    args = [f"--{k}={v}" for k, v in {**BASE, **budget, "max_steps": 3}.items() if v is not None]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(TOY), *args, "--gradient_accumulation_steps=1",
               f"--output_dir={two}"]
    done = subprocess.run(command, capture_output=True, text=True, env=_subprocess_env(),
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for a, b in zip(expected[:3], train_records(two), strict=True):
        assert (a["samples"], a["tokens"]) == (b["samples"], b["tokens"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_trainer_state_records_position_config_and_target(toy, tmp_path):
    run(toy, tmp_path, max_steps=3, save_every=0)
    recorded = read_checkpoint_state(tmp_path / "checkpoints" / "step_3")
    assert recorded["step"] == 3 and recorded["rows_seen"] == 24
    assert recorded["tokens_seen"] == 24 * 16
    assert recorded["batches"] == {"per_device_batch_size": 4, "max_tokens_per_batch": None,
                                   "num_processes": 1, "accumulation": 2}
    assert recorded["epoch"] == 1.5 and recorded["dataset_rows"] == 20
    assert recorded["config_class"] == "ToyConfig" and recorded["config"]["learning_rate"] == 1e-2
    assert recorded["target"]["hidden_size"] == 64 and recorded["target"]["num_hidden_layers"] == 2
    # the accelerate state: the head's weights only, never the frozen target
    weights = load_file(str(tmp_path / "checkpoints" / "step_3" / "model.safetensors"))
    assert sorted(weights) == ["proj.bias", "proj.weight"]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["max_steps"] == 3


def test_num_epochs_ends_training(toy, tmp_path):
    result = run(toy, tmp_path, max_steps=None, num_epochs=2, save_every=0)
    assert result["step"] == 4  # 2 epochs x 2 steps
    assert train_records(tmp_path)[-1]["epoch"] == 2.0
    assert (tmp_path / "artifact" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------------
# Atomic saves and pruning


def test_a_failing_save_leaves_the_previous_checkpoint_as_latest(toy, tmp_path, monkeypatch):
    from accelerate import Accelerator

    original = Accelerator.save_state
    calls = []

    def save_then_fail(self, output_dir=None, **kwargs):
        calls.append(output_dir)
        if len(calls) == 2:  # the second save dies half-way: one file written, then an error
            Path(output_dir, "model.safetensors").write_bytes(b"half")
            raise OSError("disk full")
        return original(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        run(toy, tmp_path, max_steps=4)
    root = tmp_path / "checkpoints"
    staged = root / ".step_4.tmp-save"
    assert (staged / "model.safetensors").is_file()  # the half-written save, marked as ours
    assert read_marker(staged)["kind"] == "checkpoint"
    assert steps_of(tmp_path) == [2] and latest_checkpoint(root) == root / "step_2"
    # a step directory without trainer_state.json is never "latest" either
    (root / "step_9").mkdir()
    (root / "step_9" / "model.safetensors").write_bytes(b"junk")
    assert latest_checkpoint(root) == root / "step_2"

    monkeypatch.setattr(Accelerator, "save_state", original)
    assert run(toy, tmp_path, max_steps=4, resume="latest")["step"] == 4
    assert steps_of(tmp_path) == [2, 4]
    assert not staged.exists()  # leftovers are cleaned by the next save


@pytest.mark.parametrize("keep, expected", [(2, [5, 6]), (None, [1, 2, 3, 4, 5, 6])])
def test_keep_checkpoints_prunes_the_oldest(toy, tmp_path, keep, expected):
    run(toy, tmp_path, save_every=1, keep_checkpoints=keep)
    assert steps_of(tmp_path) == expected


# ------------------------------------------------------------------------------------------------
# Refusals


def test_resume_refuses_changed_training_keys_and_allows_the_others(toy, tmp_path):
    run(toy, tmp_path, stop_after=2)
    cases = [
        (dict(learning_rate=2e-2), r"'learning_rate' changed \(learning_rate: 0\.01 in the "
                                   r"checkpoint, 0\.02 now\)"),
        (dict(head_dropout=0.2), r"'head_dropout'"),  # a trainer's own key
        (dict(seed=1, lr_schedule="linear"), r"'seed', 'lr_schedule'"),
        (dict(per_device_batch_size=2), r"each optimizer step took 2 micro-batches of 4 rows "
                                        r".*would take 2 micro-batches of 2 rows"),
        (dict(max_tokens_per_batch=64), r"'max_tokens_per_batch' changed"),
        (dict(num_rows=24), r"'num_rows'"),
        (dict(target="another"), r"another target \(name: 'tiny-llama' there, 'another' "
                                 r"here\)"),
    ]
    for change, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            run(toy, tmp_path, resume="latest", **change)
    # the same global batch on another split is fine, as are logging, saving, length of run
    result = run(toy, tmp_path, resume="latest", per_device_batch_size=2,
                 gradient_accumulation_steps=4, log_every=3, save_every=0, max_steps=3,
                 eval_every=0, stop_after=None)
    assert result["step"] == 3


def test_resume_refuses_another_target_or_other_data(toy, tmp_path):
    run(toy, tmp_path, max_steps=2)
    cfg = config_from_dict(toy.ToyConfig, {**BASE, "output_dir": str(tmp_path),
                                           "resume": "latest"})
    accelerator = make_accelerator(cfg)
    rows = toy.synthetic_rows(20, 16)

    def plan(rows):
        return make_batches(rows, cfg, accelerator, list, lengths=[16] * len(rows),
                            weights=[12] * len(rows)).plan

    head = toy.ToyHead(64, 259, 0.0, 0.0)
    optimizer = make_optimizer(head, cfg)
    head, optimizer = accelerator.prepare(head, optimizer)
    identity = toy.tiny_target(cfg.target).identity()
    for other, pattern in [({"hidden_size": 32}, r"hidden_size: 64 there, 32 here"),
                           ({"name": "tiny-b"}, r"name: 'tiny-llama' there, 'tiny-b' here")]:
        checkpointer = Checkpointer(accelerator, cfg, {**identity, **other}, plan(rows))
        with pytest.raises(ValueError, match=f"another target.*{pattern}"):
            checkpointer.resume()
    assert Checkpointer(accelerator, cfg, identity, plan(rows)).resume().step == 2
    # other data under the same config (a data file edited in place) changes the order too
    with pytest.raises(ValueError, match="training data had 20 rows then and 24 now"):
        Checkpointer(accelerator, cfg, identity, plan(toy.synthetic_rows(24, 16))).resume()


def test_resume_specs_and_output_dir_misuse(toy, tmp_path, capsys):
    run(toy, tmp_path / "run", max_steps=4)  # step_2 and step_4
    with pytest.raises(ValueError, match=r"already holds checkpoints \(newest: step_4\).*"
                                         r"--resume latest"):
        run(toy, tmp_path / "run")
    with pytest.raises(ValueError, match=r"newer complete checkpoints \(step_4\)"):
        run(toy, tmp_path / "run", resume=str(tmp_path / "run" / "checkpoints" / "step_2"))
    with pytest.raises(FileNotFoundError, match="not found: .*nowhere"):
        run(toy, tmp_path / "other", resume=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a checkpoint"):
        run(toy, tmp_path / "other", resume=str(tmp_path / "empty"))
    # resuming past the (lowered) end trains nothing and exports what the checkpoint holds
    assert run(toy, tmp_path / "run", resume="latest", max_steps=3)["step"] == 4
    assert (tmp_path / "run" / "artifact" / "model.safetensors").is_file()
    # a run directory means its newest checkpoint
    assert run(toy, tmp_path / "other", resume=str(tmp_path / "run"), max_steps=5)["step"] == 5
    # 'latest' with nothing saved yet starts from scratch (preemptible jobs always pass it)
    assert run(toy, tmp_path / "fresh", resume="latest", max_steps=1)["step"] == 1
    assert "no checkpoint in" in capsys.readouterr().out


@pytest.fixture(scope="module")
def six_steps(toy, tmp_path_factory):
    """An uninterrupted 6-step run, and one stopped after step 4 (checkpoints step_2, step_4)."""
    root = tmp_path_factory.mktemp("six")
    whole = run(toy, root / "whole")
    run(toy, root / "stopped", stop_after=4)
    assert steps_of(root / "stopped") == [2, 4]
    return {"whole": whole, "records": train_records(root / "whole"),
            "stopped": root / "stopped"}


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "weights truncated": ("model.safetensors", _truncate),
    "weights deleted": ("model.safetensors", Path.unlink),
    "optimizer truncated": ("optimizer.bin", _truncate),
    "optimizer deleted": ("optimizer.bin", Path.unlink),
    "trainer state garbled": (STATE_FILE, lambda p: p.write_text('{"step": 4, "format_')),
    "random state deleted": ("random_states_0.pkl", Path.unlink),
    "random state garbage": ("random_states_0.pkl",
                             lambda p: p.write_bytes(b"garbage, not a pickle")),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_resumes_exactly(
        toy, six_steps, tmp_path, damage):
    """Each part of the newest checkpoint damaged in turn: resume names the checkpoint and the
    file and offers --resume previous, which continues exactly; the damaged one is kept aside."""
    out = tmp_path / "run"
    shutil.copytree(six_steps["stopped"], out)
    name, hurt = DAMAGE[damage]
    hurt(out / "checkpoints" / "step_4" / name)
    with pytest.raises(ValueError, match=rf"checkpoint .*step_4 is damaged: .*{re.escape(name)}"
                                         rf".*--resume previous \(.*step_2\)"):
        run(toy, out, resume="latest")
    assert (out / "checkpoints" / "step_4").is_dir()  # a refused resume moves nothing
    result = run(toy, out, resume="previous")
    assert result["step"] == 6
    expected = six_steps["records"]
    got = [r for r in train_records(out) if r["step"] > 2][-4:]
    assert [(r["step"], r["loss"]) for r in got] == [(r["step"], r["loss"]) for r in expected[2:]]
    for key, tensor in six_steps["whole"]["weights"].items():
        assert torch.equal(tensor, result["weights"][key]), key
    assert steps_of(out) == [2, 4, 6] and (out / "checkpoints" / "damaged-step_4").is_dir()


def test_a_non_finite_loss_stops_training_and_saves_nothing(toy, tmp_path):
    # the loss is NaN at step 2, before any save (a learning rate that would overflow the weights
    # is refused at parse: tests/test_hostile.py)
    with pytest.raises(NonFiniteLoss, match=r"non-finite \(NaN or inf\) at optimizer step 2, "
                                             r"micro-batch 0 of process 0 \(training rows \["):
        run(toy, tmp_path / "huge", nan_from_step=2)
    assert not (tmp_path / "huge" / "artifact").exists()
    assert not (tmp_path / "huge" / "checkpoints").exists()
    # a step function whose loss turns NaN at step 4: step_2 stays the last checkpoint, from
    # which the run continues as if nothing had happened
    out = tmp_path / "poisoned"
    with pytest.raises(ValueError, match=r"at optimizer step 4, .*continue from the last "
                                         r"checkpoint \(step 2\) with --resume latest"):
        run(toy, out, nan_from_step=4)
    assert steps_of(out) == [2] and not (out / "artifact").exists()
    assert not list((out / "checkpoints").glob(".step_*"))  # no save was started either
    whole = run(toy, tmp_path / "whole")
    resumed = run(toy, out, resume="latest")
    for key, tensor in whole["weights"].items():
        assert torch.equal(tensor, resumed["weights"][key]), key


@pytest.mark.parametrize("key, value", [("weight_decay", "nan"), ("max_grad_norm", "inf"),
                                        ("eval_temperature", "nan"), ("learning_rate", "-inf")])
def test_float_keys_refuse_nan_and_inf(toy, key, value):
    with pytest.raises(ValueError, match=rf"'{key}' .*give a finite number"):
        parse_config(toy.ToyConfig, [f"--{key}", value])
    with pytest.raises(ValueError, match=rf"'{key}' must be a finite number"):
        toy.ToyConfig(**{key: float(value)})  # built directly, without the parser


def test_results_without_checkpoints_are_never_replaced_unasked(toy, tmp_path):
    run(toy, tmp_path, max_steps=2)
    shutil.rmtree(tmp_path / "checkpoints")  # an artifact and metrics, nothing to continue
    before = {p: p.read_bytes() for p in [tmp_path / "metrics.jsonl",
                                          tmp_path / "artifact" / "model.safetensors"]}
    for resume in (None, "latest"):
        with pytest.raises(ValueError, match=r"holds the results of an earlier run \(artifact, "
                                             r"metrics.jsonl, config.yaml\) but no checkpoint.*--overwrite true"):
            run(toy, tmp_path, resume=resume)
    assert {p: p.read_bytes() for p in before} == before
    assert run(toy, tmp_path, max_steps=3, overwrite=True)["step"] == 3
    assert [r["step"] for r in train_records(tmp_path)] == [1, 2, 3]


def test_a_refused_resume_changes_no_file(toy, tmp_path):
    run(toy, tmp_path, stop_after=2)
    snapshot = {p: (p.read_bytes(), p.stat().st_mtime_ns)
                for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(ValueError, match="'learning_rate' changed"):
        run(toy, tmp_path, resume="latest", learning_rate=0.5)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(tmp_path.rglob("*")) if p.is_file()} == snapshot
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["learning_rate"] == 1e-2


def test_output_paths_are_checked_before_training(toy, tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match=r"output_dir .*a_file/run cannot be created: .*a_file is "
                                         r"a file"):
        run(toy, tmp_path / "a_file" / "run")
    # a run to continue whose artifact/ holds someone else's files: refused at the start
    run(toy, tmp_path / "run", stop_after=2)
    (tmp_path / "run" / "artifact").mkdir()
    (tmp_path / "run" / "artifact" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"artifact exists and holds files draftsmith did not "
                                         r"write \(notes.txt\)"):
        run(toy, tmp_path / "run", resume="latest")
    assert train_records(tmp_path / "run")[-1]["step"] == 2  # nothing trained


def test_saves_and_pruning_delete_only_checkpoint_directories(toy, tmp_path):
    root = tmp_path / "checkpoints"
    run(toy, tmp_path, stop_after=2, save_every=1, keep_checkpoints=1)
    assert steps_of(tmp_path) == [2]
    assert read_marker(root / "step_2") == {"written_by": "draftsmith", "kind": "checkpoint",
                                            "step": 2}
    foreign = root / ".step_3.tmp-mine"  # looks like a leftover, carries no marker
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    leftover = root / ".step_3.tmp-save"  # a marked leftover of a killed save: removed
    leftover.mkdir()
    (leftover / MARKER).write_text(json.dumps({"written_by": "draftsmith", "kind": "checkpoint"}))
    run(toy, tmp_path, resume="latest", save_every=1, keep_checkpoints=1, max_steps=4)
    assert steps_of(tmp_path) == [4] and not leftover.exists()
    assert (foreign / "keep.txt").read_text() == "mine"
    # a step directory someone else made at a step this run will save: refused, kept
    other = tmp_path / "other"
    run(toy, other, stop_after=2)
    (other / "checkpoints" / "step_4").mkdir()
    (other / "checkpoints" / "step_4" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"step_4 exists and holds files draftsmith did not write"):
        run(toy, other, resume="latest", max_steps=4)
    assert (other / "checkpoints" / "step_4" / "notes.txt").read_text() == "mine"
    assert steps_of(other) == [2]


def test_a_moved_target_resumes_and_other_weights_do_not(toy, tmp_path):
    """Where the target lives (path, hub id) may change between runs; its weights may not, and a
    checkpoint written before fingerprints were recorded still resumes."""
    run(toy, tmp_path, max_steps=2)
    cfg = config_from_dict(toy.ToyConfig, {**BASE, "output_dir": str(tmp_path),
                                           "resume": "latest"})
    accelerator = make_accelerator(cfg)
    rows = toy.synthetic_rows(20, 16)
    plan = make_batches(rows, cfg, accelerator, list, lengths=[16] * 20, weights=[12] * 20).plan
    head = toy.ToyHead(64, 259, 0.0, 0.0)
    head, optimizer = accelerator.prepare(head, make_optimizer(head, cfg))
    identity = toy.tiny_target(cfg.target).identity()
    recorded = read_checkpoint_state(tmp_path / "checkpoints" / "step_2")["target"]
    assert recorded == identity and len(recorded["weights_fingerprint"]) == 16
    moved = {**identity, "path": "/new/place/tiny-llama", "hub_id": "org/tiny-llama"}
    assert Checkpointer(accelerator, cfg, moved, plan).resume().step == 2
    other = {**identity, "weights_fingerprint": "0123456789abcdef"}
    with pytest.raises(ValueError, match=r"another target \(weights_fingerprint: "
                                         rf"'{identity['weights_fingerprint']}' there, "
                                         r"'0123456789abcdef' here\)"):
        Checkpointer(accelerator, cfg, other, plan).resume()
    state_file = tmp_path / "checkpoints" / "step_2" / STATE_FILE
    state = json.loads(state_file.read_text())
    for key in ("weights_fingerprint", "hub_id", "path"):
        del state["target"][key]
    state_file.write_text(json.dumps(state))
    assert Checkpointer(accelerator, cfg, other, plan).resume().step == 2


# ------------------------------------------------------------------------------------------------
# Stopping on signals


def test_graceful_stop_turns_signals_into_a_flag_and_a_second_one_aborts():
    before = signal.getsignal(signal.SIGTERM)
    for sig in (signal.SIGTERM, signal.SIGINT):
        with GracefulStop(grace_s=0.3) as stop:
            assert not stop.should_stop()
            os.kill(os.getpid(), sig)
            time.sleep(0.05)  # the handler runs in the main thread between bytecodes
            assert stop.should_stop() and stop.reason == signal.Signals(sig).name
            os.kill(os.getpid(), sig)  # at once: a launcher forwarding the same Ctrl-C
            time.sleep(0.05)
            assert stop.should_stop()
            time.sleep(0.3)
            with pytest.raises(KeyboardInterrupt, match="aborting without saving"):
                os.kill(os.getpid(), sig)  # a deliberate second signal
                time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is before
    with GracefulStop() as stop:
        stop.request("time limit")
        assert stop.should_stop() and stop.reason == "time limit"


def test_sigterm_saves_a_resumable_checkpoint_and_exits_cleanly(toy, tmp_path):
    out = tmp_path / "run"
    settings = {**BASE, "max_steps": 500, "save_every": 0, "step_sleep": 0.2}
    command = [sys.executable, str(TOY), f"--output_dir={out}",
               *(f"--{k}={v}" for k, v in settings.items() if v is not None)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=_subprocess_env(), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    assert "SIGTERM received: finishing this step, saving a checkpoint" in stderr
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert f"stopped by SIGTERM after step {last} of 500" in stdout
    assert steps_of(out) == [last] and 2 <= last < 500
    assert not (out / "artifact").exists()
    result = run(toy, out, resume="latest", save_every=0, max_steps=last + 2)
    assert result["step"] == last + 2


@pytest.mark.parametrize("how", ["launcher", "process group"])
def test_sigterm_to_accelerate_launch_reaches_the_trainer(toy, tmp_path, how):
    """accelerate 1.15's launcher dies of a SIGTERM without passing it on; the trainer follows its
    launcher (draftsmith.train.signals.follow_launcher), so it saves and stops whether the launcher alone or
    the whole process group (kill -TERM -PGID) is signalled."""
    out = tmp_path / "run"
    settings = {**BASE, "max_steps": 500, "save_every": 0, "step_sleep": 0.2}
    launcher = Path(sys.executable).parent / "accelerate"
    command = [str(launcher), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", str(TOY),
               f"--output_dir={out}", *(f"--{k}={v}" for k, v in settings.items()
                                        if v is not None)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=_subprocess_env(), cwd=tmp_path,
                               start_new_session=True)
    trainers = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()
        trainers = psutil.Process(process.pid).children()
        assert [t.cmdline()[1] for t in trainers] == [str(TOY)]
        if how == "launcher":
            process.send_signal(signal.SIGTERM)
        else:
            os.killpg(process.pid, signal.SIGTERM)
        # the trainer holds the launcher's pipes: they close when the trainer has exited
        stdout, stderr = process.communicate(timeout=120)
    finally:
        for trainer in trainers:
            if trainer.is_running():
                trainer.kill()
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGTERM  # the launcher itself just dies
    assert "SIGTERM received" in stderr and "saving a checkpoint" in stderr
    assert "second stop signal" not in stderr
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert f"stopped by SIGTERM after step {last} of 500" in stdout
    assert steps_of(out) == [last] and 2 <= last < 100
    assert not (out / "artifact").exists()
    assert run(toy, out, resume="latest", save_every=0, max_steps=last + 1)["step"] == last + 1


def test_only_accelerate_launch_is_followed():
    assert is_accelerate_launch(["/usr/bin/python3", "/venv/bin/accelerate", "launch", "--cpu",
                                 "train/eagle.py"])
    assert is_accelerate_launch(["python", "-m", "accelerate.commands.launch", "train/eagle.py"])
    assert not is_accelerate_launch(["/venv/bin/accelerate", "config"])
    assert not is_accelerate_launch(["bash"])
    assert not is_accelerate_launch(["python", "-m", "torch.distributed.run", "train/eagle.py"])
    assert not is_accelerate_launch([])
    assert follow_launcher() is None  # pytest was not started by accelerate launch


# ------------------------------------------------------------------------------------------------
# Two processes


def test_two_processes_match_one_with_the_same_global_batch(toy, tmp_path):
    """torchrun, 2 CPU processes (gloo) x 2 rows x 2 micro-batches == 1 process x 4 x 2; only the
    head is wrapped in DDP; a checkpoint of the 2-process run resumes on 1 process."""
    common = dict(max_steps=4, head_dropout=0.0, head_noise=0.0)
    two = tmp_path / "two"
    args = [f"--{k}={v}" for k, v in {**BASE, **common}.items() if v is not None]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(TOY), *args, "--per_device_batch_size=2",
               f"--output_dir={two}", f"--report={tmp_path / 'report.json'}"]
    done = subprocess.run(command, capture_output=True, text=True, env=_subprocess_env(),
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["num_processes"] == 2 and report["step"] == 4
    assert report["prepared_head"] == "DistributedDataParallel"
    assert report["registered_models"] == ["ToyHead"]  # the target was never prepared
    assert report["target_model_type"] == "LlamaForCausalLM"
    assert not report["target_requires_grad"] and not report["target_training"]
    assert report["target_unchanged"]

    one = run(toy, tmp_path / "one", **common, report=str(tmp_path / "report1.json"))
    assert json.loads((tmp_path / "report1.json").read_text())["prepared_head"] == "ToyHead"
    expected = train_records(tmp_path / "one")
    got = train_records(two)
    assert [r["samples"] for r in got] == [r["samples"] for r in expected] == [8, 16, 24, 32]
    for a, b in zip(expected, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["accuracy"] == pytest.approx(a["accuracy"], abs=1e-9)
    # Adam divides by sqrt(v): a weight whose gradient is float noise may move by ~lr either way,
    # so the weights are compared more loosely than the losses
    artifact = load_file(str(two / "artifact" / "model.safetensors"))
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(artifact[name], tensor, rtol=1e-3, atol=1e-4)

    # step_2 of the 2-process run, resumed by 1 process with the same global batch
    resumed = run(toy, tmp_path / "resumed", **common,
                  resume=str(two / "checkpoints" / "step_2"))
    for a, b in zip(expected[2:], train_records(tmp_path / "resumed")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    torch.testing.assert_close(resumed["weights"]["proj.weight"], one["weights"]["proj.weight"],
                               rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# Data order, learning rate, optimizer, accelerator


def test_fixed_row_plan_orders_epochs_and_resumes_mid_epoch():
    plan = BatchPlan([16] * 20, seed=3, per_device_batch_size=4, accumulation=2)
    assert [plan.steps_in_epoch(e) for e in range(3)] == [2, 2, 2]  # 20 rows // 8 per step
    epochs = [[i for step in plan._groups(e) for rows in step for i in rows] for e in range(3)]
    for rows in epochs:
        assert len(set(rows)) == 16 and set(rows) <= set(range(20))
    assert epochs[0] != epochs[1] != epochs[2]
    again = BatchPlan([16] * 20, seed=3, per_device_batch_size=4, accumulation=2)
    first_six = [s for _, (_, s) in zip(range(6), plan.steps(0))]
    assert [s for _, (_, s) in zip(range(6), again.steps(0))] == first_six
    assert BatchPlan([16] * 20, seed=4, per_device_batch_size=4, accumulation=2)._groups(0) \
        != plan._groups(0)
    # resuming after 3 steps: epoch 1's second step, then epoch 2 from its start
    index, step = next(plan.steps(3))
    assert index == 3 and step == first_six[3] and step.micro_batches == plan._groups(1)[1]
    assert plan.locate(3) == (1, 1) and plan.epoch_of(3) == 1.5
    # the same global batch split over processes: the step holds the same rows, process p
    # takes its accumulation slots
    two = BatchPlan([16] * 20, seed=3, per_device_batch_size=2, num_processes=2, accumulation=2)
    for (_, (_, a)), (_, (_, b)) in zip(zip(range(4), plan.steps(0)), zip(range(4), two.steps(0))):
        assert sorted(i for rows in a.micro_batches for i in rows) == \
            sorted(i for rows in b.micro_batches for i in rows)
        assert [i for rows in two.rows_of(b, 0) for i in rows] == list(a.micro_batches[0])
    in_order = BatchPlan([16] * 20, seed=3, shuffle=False, per_device_batch_size=4)
    assert in_order._groups(0)[0] == ((0, 1, 2, 3),)
    with pytest.raises(ValueError, match="fewer micro-batches than one optimizer step"):
        BatchPlan([16] * 20, seed=0, per_device_batch_size=32)


def test_token_budget_plan_groups_lengths_and_counts_padding():
    generator = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(4, 200, (400,), generator=generator)]
    plan = BatchPlan(lengths, seed=1, max_tokens_per_batch=512)
    fixed = BatchPlan(lengths, seed=1, per_device_batch_size=4)
    batches = [rows for step in plan._groups(0) for rows in step]
    assert all(len(rows) * max(lengths[i] for i in rows) <= 512 for rows in batches)
    assert sorted(i for rows in batches for i in rows) == list(range(400))  # every row, once
    real, padded = padded_tokens(lengths, batches)
    fixed_real, fixed_padded = padded_tokens(lengths, [r for s in fixed._groups(0) for r in s])
    assert 1 - real / padded < 0.05 < 1 - fixed_real / fixed_padded  # grouping removes padding
    assert plan._groups(0) != plan._groups(1)  # each epoch regroups and reorders
    weighted = BatchPlan(lengths, seed=1, max_tokens_per_batch=512, weights=[2.0] * 400)
    step = next(weighted.steps(0))[1]
    assert step.weight == 2.0 * step.rows()
    longest = max(lengths)
    with pytest.raises(ValueError, match=rf"max_tokens_per_batch 100 is smaller than the longest "
                                         rf"training row \({longest} tokens\)"):
        BatchPlan(lengths, seed=0, max_tokens_per_batch=100)
    assert loss_scale(50.0, num_processes=2, accumulation=4) == pytest.approx(8 / 50)


def test_learning_rate_schedules():
    cfg = TrainConfig(learning_rate=1.0, warmup_steps=2, min_lr_ratio=0.1, lr_schedule="cosine")
    assert [learning_rate(cfg, s, 12) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert learning_rate(cfg, 7, 12) == pytest.approx(0.55)  # halfway through the decay
    assert learning_rate(cfg, 12, 12) == pytest.approx(0.1)
    assert learning_rate(cfg, 99, 12) == pytest.approx(0.1)
    linear = TrainConfig(learning_rate=1.0, warmup_steps=0, min_lr_ratio=0.0, lr_schedule="linear")
    assert [learning_rate(linear, s, 4) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    constant = TrainConfig(learning_rate=0.3, warmup_steps=0, lr_schedule="constant")
    assert learning_rate(constant, 50, 10) == 0.3
    plan = BatchPlan([8] * 12, seed=0, per_device_batch_size=4)  # 3 steps per epoch
    assert plan.total_steps(100, 2) == 6 and plan.total_steps(5, 2) == 5
    assert plan.total_steps(None, 3) == 9


def test_optimizer_decays_matrices_only_and_needs_trainable_parameters():
    cfg = TrainConfig(weight_decay=0.1)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    groups = make_optimizer(model, cfg).param_groups
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(1, 0.1), (3, 0.0)]
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters.*not the frozen target"):
        make_optimizer(frozen, cfg)


def test_mixed_precision_and_cpu_launch_detection(monkeypatch):
    assert resolve_mixed_precision("bf16") == "bf16" and resolve_mixed_precision("no") == "no"
    cpu_auto = "bf16" if cpu_has_bf16() else "no"
    assert resolve_mixed_precision("auto", cpu=True) == cpu_auto
    if not torch.cuda.is_available():
        assert resolve_mixed_precision("auto") == cpu_auto
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        assert not launched_on_cpu()
        monkeypatch.setenv("LOCAL_RANK", "0")  # what torchrun sets
        assert launched_on_cpu()


# ------------------------------------------------------------------------------------------------
# TrainConfig


def test_train_config_subclass_parses_and_validates(toy, tmp_path):
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump({"learning_rate": 1e-3, "data": ["a.jsonl", "b.json"],
                                    "head_dropout": 0.2, "resume": "latest"}))
    cfg = parse_config(toy.ToyConfig, ["--config", str(path), "--head_dropout", "0.3",
                                       "--max_steps", "none", "--num_epochs", "2"])
    assert (cfg.learning_rate, cfg.data, cfg.head_dropout) == (1e-3, ["a.jsonl", "b.json"], 0.3)
    assert cfg.max_steps is None and cfg.num_epochs == 2 and cfg.resume == "latest"
    with pytest.raises(ValueError, match="unknown config key 'head_dropuot'.*'head_dropout'"):
        parse_config(toy.ToyConfig, ["--head_dropuot", "0.3"])
    assert TrainConfig().data is not TrainConfig().data  # list defaults are not shared
    for bad, pattern in [
        (dict(per_device_batch_size=0), r"'per_device_batch_size' must be >= 1, got 0"),
        (dict(max_steps=None, num_epochs=None), r"'max_steps' and 'num_epochs' are both none"),
        (dict(min_lr_ratio=1.5), r"'min_lr_ratio' must be in \[0, 1\]"),
        (dict(learning_rate=0.0), r"'learning_rate' must be in \(0, 1\], got 0.0$"),
        (dict(keep_checkpoints=0), r"'keep_checkpoints' must be >= 1"),
        (dict(resume=" "), r"'resume' is empty"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            TrainConfig(**bad)
    may_change = may_change_on_resume(toy.ToyConfig)
    # the target may be named by another path; the checkpoint's target identity guards it
    assert {"max_steps", "log_every", "save_every", "eval_every", "report_to", "resume",
            "output_dir", "stop_after", "target"} <= set(may_change)
    assert not {"learning_rate", "seed", "data", "head_dropout"} & set(may_change)


# ------------------------------------------------------------------------------------------------
# accelerate configs


def _launch_args(path: Path):
    parser = launch_command_parser()
    known = {action.dest for action in parser._actions}
    args = parser.parse_args(["--config_file", str(path), "train/eagle.py"])
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults, known


@pytest.mark.parametrize("name, kind", [
    ("cpu_ddp", DistributedType.MULTI_CPU), ("multi_gpu", DistributedType.MULTI_GPU),
    ("fsdp2", DistributedType.FSDP), ("multi_node", DistributedType.FSDP),
])
def test_accelerate_configs_load_and_configure_their_plugins(name, kind, monkeypatch):
    """Each shipped accelerate config loads, names only options accelerate launch has, and the
    environment accelerate's launcher exports from it is read by draftsmith.train.sharding as meant."""
    from types import SimpleNamespace

    from draftsmith.train.sharding import FSDP2, REPLICATED, sharding_plan

    path = ACCELERATE_CONFIGS / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig) and config.distributed_type == kind
    args, defaults, known = _launch_args(path)
    for key in list(defaults.fsdp_config) + list(defaults.deepspeed_config):
        assert key in known, f"{name}.yaml: accelerate launch has no option {key!r}"
    if kind == DistributedType.MULTI_CPU:
        assert config.use_cpu and config.mixed_precision == "no"
        return
    assert args.mixed_precision == "bf16"
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_USE_", "FSDP_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    accelerator = SimpleNamespace(num_processes=config.num_processes, mixed_precision="bf16")
    plan = sharding_plan(SimpleNamespace(target_parallel=2), accelerator)
    assert plan.trained == (REPLICATED if kind == DistributedType.MULTI_GPU else FSDP2)
    assert plan.bf16 and plan.reshard_after_forward and plan.target_parallel == 2
    if name == "multi_node":
        assert config.num_machines == 2 and config.num_processes == 16


def test_sharded_launches_that_cannot_work_are_refused_with_what_to_use(monkeypatch):
    """FSDP1, DeepSpeed, offloaded parameters and a target_parallel that does not divide the
    processes: one line each, naming the config to use instead."""
    from types import SimpleNamespace

    from draftsmith.train.sharding import sharding_plan

    accelerator = SimpleNamespace(num_processes=4, mixed_precision="no")
    cfg = SimpleNamespace(target_parallel=1)
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_USE_", "FSDP_"))]:
        monkeypatch.delenv(key)
    assert sharding_plan(cfg, accelerator).trained == "replicated"
    cases = [({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "fsdp_version: 2"),
             ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"},
              "fsdp_offload_params"),
             ({"ACCELERATE_USE_DEEPSPEED": "true"}, "configs/accelerate/fsdp2.yaml")]
    for env, named in cases:
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            with pytest.raises(ValueError, match=re.escape(named)) as refused:
                sharding_plan(cfg, accelerator)
            assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="target_parallel 3 does not divide the 4 processes"):
        sharding_plan(SimpleNamespace(target_parallel=3), accelerator)
    assert not (ACCELERATE_CONFIGS / "deepspeed_zero2.yaml").exists()


def test_the_sharding_plan_is_computed_once_and_carried(monkeypatch):
    """start_run computes the plan; every later reader of the run gets that same object, and a
    launch environment changed afterwards does not change the run's plan."""
    from types import SimpleNamespace

    from draftsmith.train import sharding

    for key in [k for k in os.environ if k.startswith(("ACCELERATE_USE_", "FSDP_"))]:
        monkeypatch.delenv(key)
    accelerator = SimpleNamespace(num_processes=2, mixed_precision="no")
    cfg = SimpleNamespace(target_parallel=1)
    calls = []
    compute = sharding.sharding_plan
    monkeypatch.setattr(sharding, "sharding_plan", lambda *a: calls.append(a) or compute(*a))
    first = sharding.run_plan(cfg, accelerator)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # would be refused if recomputed
    assert sharding.run_plan(cfg, accelerator) is first and len(calls) == 1
    with pytest.raises(ValueError, match="DeepSpeed"):  # another run computes its own
        sharding.run_plan(cfg, SimpleNamespace(num_processes=2, mixed_precision="no"))


def test_checkpoint_state_file_name_is_the_completion_mark(tmp_path):
    (tmp_path / "step_3").mkdir()
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "step_3" / STATE_FILE).write_text(json.dumps({"step": 3}))
    (tmp_path / "step_10").mkdir()
    (tmp_path / "step_10" / STATE_FILE).write_text(json.dumps({"step": 10}))
    (tmp_path / "step_x").mkdir()
    assert list_checkpoints(tmp_path) == [tmp_path / "step_3", tmp_path / "step_10"]
    (tmp_path / "step_11").mkdir()
    (tmp_path / "step_11" / STATE_FILE).write_text(json.dumps({"step": 11, "format_version": 9}))
    with pytest.raises(ValueError, match="newer draftsmith"):
        read_checkpoint_state(tmp_path / "step_11")

