"""The ``draftsmith`` command: every subcommand's help, the one error style, exit statuses, and a
real training run launched through accelerate by ``draftsmith train``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.cli import COMMANDS, main, overrides

REPO = Path(__file__).resolve().parents[1]


def test_the_top_level_help_names_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ["train", *COMMANDS]:
        assert f"  {name} " in out, name
    assert main([]) == 2  # nothing asked: the help, and a usage error's status


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_help_under_the_name_the_user_typed(name, capsys):
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: draftsmith {name}"), out[:200]


def test_a_user_error_is_one_line_named_after_the_command(capsys, tmp_path):
    missing = tmp_path / "nowhere.yaml"
    assert main(["memory", "--config", str(missing), "--processes", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("draftsmith memory: error:"), err
    assert main(["memory", "--config", "configs/eagle/qwen3-8b.yaml", "--processes", "0"]) == 2
    assert "draftsmith memory: error: --processes must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["no-such-command"])
    assert done.value.code == 2
    assert "draftsmith: error: unknown command 'no-such-command'" in capsys.readouterr().err


def test_a_command_reports_its_status(capsys):
    """draftsmith memory returns what python -m draftsmith.train.memory returns: 0 with the estimate."""
    assert main(["memory", "--config", "configs/eagle/llama-3.1-8b-instruct.yaml",
                 "--processes", "8"]) == 0
    assert "peak:" in capsys.readouterr().out


def test_key_value_words_become_the_trainers_options():
    assert overrides(["max_steps=3", "--lr", "1e-3", "output_dir=runs/a=b", "--x=1"]) == \
        ["--max_steps", "3", "--lr", "1e-3", "--output_dir", "runs/a=b", "--x=1"]


def test_train_launches_the_configs_trainer_through_accelerate(capsys):
    assert main(["train", "configs/medusa/smollm2-135m.yaml", "--dry-run", "max_steps=2"]) == 0
    line = capsys.readouterr().err.strip()
    assert "-m accelerate.commands.launch --num_processes 1" in line
    assert "--module draftsmith.train.medusa --config configs/medusa/smollm2-135m.yaml " \
           "--max_steps 2" in line
    assert main(["train", "configs/eagle/llama-3.3-70b-instruct.yaml", "--dry-run",
                 "--processes", "8", "--accelerate-config", "configs/accelerate/fsdp2.yaml"]) == 0
    line = capsys.readouterr().err
    assert "--config_file configs/accelerate/fsdp2.yaml --num_processes 8" in line
    assert "--module draftsmith.train.eagle" in line
    assert main(["train", "configs/eagle/llama-3.3-70b-instruct.yaml", "--dry-run",
                 "--accelerate-config", "configs/accelerate/multi_node.yaml", "--machine-rank",
                 "1", "--main-process-ip", "10.0.0.1"]) == 0
    assert "--machine_rank 1 --main_process_ip 10.0.0.1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["train", "configs/nowhere.yaml"], "config configs/nowhere.yaml does not exist"),
    (["train", "pyproject.toml"], "cannot tell which trainer"),
    (["train", "configs/eagle/tiny.yaml", "--processes", "0"], "--processes must be at least 1"),
    (["train", "configs/eagle/tiny.yaml", "--accelerate-config", "nope.yaml"],
     "--accelerate-config nope.yaml does not exist"),
])
def test_train_refuses_what_cannot_launch_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"draftsmith train: error: {message}" in err, err


def test_the_console_script_runs_from_the_environment():
    """`make install` puts `draftsmith` beside this Python; `python -m draftsmith` is the same."""
    script = Path(sys.executable).parent / "draftsmith"
    commands = [[sys.executable, "-m", "draftsmith", "--help"]]
    if script.exists():
        commands.append([str(script), "--help"])
    else:  # the stamp of `make install` says it ran: then the script must be there
        assert not (REPO / ".install.stamp").exists(), f"{script} missing after make install"
    for command in commands:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "memory-probe" in done.stdout


@pytest.fixture
def tiny_eagle_run(tmp_path):
    """The words and environment of `draftsmith train` on the tiny EAGLE config with a tiny
    random target and 8 rows; -> (argv after `train`, env, output directory)."""
    import random

    from test_train_eagle import conversation, save_tiny_target, write_jsonl

    from draftsmith.targets.target import load_target

    tokenizer = load_target("smollm2-135m").tokenizer
    rng = random.Random(0)
    rows = [conversation(rng, 4, 8) for _ in range(8)]
    used = {t for row in rows for t in tokenizer.apply_chat_template(
        row["messages"], tokenize=True, return_dict=False)}
    target = save_tiny_target(tmp_path / "target", tokenizer, used)
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "run"
    env = {**os.environ, "DRAFTSMITH_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled",
           "OMP_NUM_THREADS": "1"}
    argv = ["configs/eagle/tiny.yaml", f"target={target}", f"data={data}", f"output_dir={out}",
            "aux_layer_ids=1,2,3", "draft_vocab_size=512", "max_length=64", "eval_every=0",
            "report_to=none", "per_device_batch_size=4"]
    return argv, env, out


def test_draftsmith_train_runs_a_real_trainer(tiny_eagle_run):
    """Two optimizer steps of the EAGLE trainer on a tiny random target, launched as a user
    would: draftsmith train CONFIG key=value ...; the artifact is written, exit status 0."""
    argv, env, out = tiny_eagle_run
    done = subprocess.run(
        [sys.executable, "-m", "draftsmith", "train", *argv, "max_steps=2", "save_every=0"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "accelerate.commands.launch" in done.stderr
    assert (out / "artifact" / "model.safetensors").is_file()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in steps) == 2


def test_sigterm_to_draftsmith_train_saves_and_stops_the_trainer(tiny_eagle_run):
    """`kill <pid of draftsmith train>` reaches the trainer (through its launcher): it finishes
    its step, saves a checkpoint and exits; nothing is left running."""
    import psutil

    argv, env, out = tiny_eagle_run
    process = subprocess.Popen(
        [sys.executable, "-m", "draftsmith", "train", *argv, "max_steps=100000", "save_every=0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and process.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()
        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "draftsmith train started no launcher"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
        gone, alive = psutil.wait_procs(children, timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert alive == [], [p.cmdline() for p in alive]
    assert "SIGTERM received" in stderr, stderr[-3000:]
    assert list((out / "checkpoints").glob("step_*")), stderr[-3000:]
