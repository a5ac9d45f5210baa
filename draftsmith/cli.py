"""``draftsmith``: one command in front of every tool of the project.

    draftsmith train CONFIG [--processes N] [--trainer NAME] [--accelerate-config FILE]
                            [--dry-run] [key=value | --key value ...]
    draftsmith data | export | bench | report | memory | speed | memory-probe | llama-cpp
               | consumer-check | artifact | draft  [that command's own arguments]

``train`` launches the trainer the config belongs to (its folder under ``configs/``, or
``--trainer``) through accelerate (``accelerate launch -m draftsmith.train.<name> --config CONFIG``, what
``accelerate launch train/<name>.py`` does in a checkout);
``key=value`` words become ``--key value``. Every other command is the ``python -m`` entry point
it names (``draftsmith bench`` is ``python -m draftsmith.eval.bench``), run in this process with the same
arguments, exit statuses and error lines, under the name the user typed.

Exit statuses: 0 done, 1 a command that ran and failed (its message says why), 2 a usage error
(one line on stderr), 128 + N a command stopped by signal N (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import shlex
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from draftsmith.files.command_line import USER_ERRORS, invoked_as

PROG = "draftsmith"


@dataclass(frozen=True)
class Command:
    """A subcommand that is one of the project's ``python -m`` entry points."""

    module: str  # what ``python -m`` runs
    program: str  # the name that entry point's parser gives itself
    summary: str


COMMANDS: dict[str, Command] = {
    "data": Command("draftsmith.train.data", "python -m draftsmith.train.data",
                    "tokenise and inspect training data; regenerate answers with the target; "
                    "merge shards"),
    "export": Command("draftsmith.layouts.export", "python -m draftsmith.layouts.export",
                      "write a trained artifact in a serving layout (vLLM, SGLang, TensorRT-LLM, "
                      "speculators, GGUF for llama.cpp)"),
    "bench": Command("draftsmith.eval.bench", "python -m draftsmith.eval.bench",
                     "measure drafts' acceptance and speed beside plain decoding, exactly"),
    "report": Command("draftsmith.eval.report", "python -m draftsmith.eval.report",
                      "a benchmark report as one HTML page, and in W&B"),
    "memory": Command("draftsmith.train.memory", "python -m draftsmith.train.memory",
                      "a training run's memory per GPU, from config.json alone"),
    "speed": Command("draftsmith.train.speed", "python -m draftsmith.train.speed",
                     "a few training steps timed: tokens/s, the target's share, the peak memory"),
    "memory-probe": Command("draftsmith.train.memory_probe", "python -m draftsmith.train.memory_probe",
                            "the memory plan beside the allocator's peak for a config's steps"),
    "llama-cpp": Command("draftsmith.layouts.llama_cpp", "python -m draftsmith.layouts.llama_cpp",
                         "find or build llama.cpp's server, convert targets to GGUF"),
    "consumer-check": Command("draftsmith.layouts.consumer_check", "python -m draftsmith.layouts.consumer_check",
                              "build the pinned venv of the serving libraries an export's "
                              "--check loads it in"),
    "artifact": Command("draftsmith.heads.artifact", "python -m draftsmith.heads.artifact",
                        "artifact operations: cast an artifact's weights to another precision"),
    "draft": Command("draftsmith.eval.draft", "python -m draftsmith.eval.draft",
                     "record how a distilled draft drafts by default (draftsmith.eval.bench's draft:<dir>)"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train speculative-decoding drafts from a frozen target and measure them "
                    "exactly.",
        epilog="commands:\n  train           " + "train a draft: launch the trainer of a config "
               "through accelerate\n" + "".join(f"  {name:15} {c.summary}\n"
                                                 for name, c in COMMANDS.items())
               + f"\n'{PROG} COMMAND --help' describes each command's arguments.")
    parser.add_argument("command", choices=["train", *COMMANDS], metavar="COMMAND")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} train", allow_abbrev=False, description=(
            "Launch the trainer of CONFIG through accelerate: configs/<trainer>/*.yaml belongs "
            "to train/<trainer>.py (eagle, medusa, dflash, distill). Every further word goes to "
            "the trainer: key=value or --key value overrides a config key."),
        epilog=f"example: {PROG} train configs/eagle/smollm2-135m.yaml max_steps=80 "
               "output_dir=runs/try\nthe keys of a trainer: python -m draftsmith.train.<trainer> --help",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a trainer's YAML config")
    parser.add_argument("--processes", type=int, default=None,
                        help="processes to launch (one per GPU); default 1, or the accelerate "
                             "config's")
    parser.add_argument("--trainer", default=None,
                        help="the trainer, when the config is not under configs/<trainer>/")
    parser.add_argument("--accelerate-config", default=None, metavar="FILE",
                        help="an accelerate config (configs/accelerate/*.yaml: FSDP2, several "
                             "nodes)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads per process (accelerate's "
                             "--num_cpu_threads_per_process)")
    parser.add_argument("--machine-rank", default=None,
                        help="this node's rank in a multi-node launch (accelerate's "
                             "--machine_rank)")
    parser.add_argument("--main-process-ip", default=None,
                        help="the address of node 0 in a multi-node launch")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the launch command and stop")
    return parser


def overrides(words: list[str]) -> list[str]:
    """``key=value`` words -> ``--key value``; ``--key value`` words pass as they are."""
    out = []
    for word in words:
        key, sep, value = word.partition("=")
        if sep and not word.startswith("-") and key.isidentifier():
            out += [f"--{key}", value]
        else:
            out.append(word)
    return out


def trainer_module(name: str) -> str:
    """The module ``accelerate launch -m`` runs for trainer ``name`` (train/<name>.py)."""
    module = f"draftsmith.train.{name}"
    if importlib.util.find_spec(module) is None:
        raise FileNotFoundError(f"{module} is missing from this installation; reinstall draftsmith")
    return module


def launch_command(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """The ``accelerate launch`` command line for ``draftsmith train``."""
    from draftsmith.train.recipes import trainer_of

    config = Path(args.config)
    if not config.is_file():
        raise FileNotFoundError(f"config {args.config} does not exist")
    if args.processes is not None and args.processes < 1:
        raise ValueError(f"--processes must be at least 1, got {args.processes}")
    trainer = trainer_of(str(config), args.trainer)
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    if args.accelerate_config:
        if not Path(args.accelerate_config).is_file():
            raise FileNotFoundError(f"--accelerate-config {args.accelerate_config} does not exist")
        launch += ["--config_file", args.accelerate_config]
        if args.processes is not None:
            launch += ["--num_processes", str(args.processes)]
    else:  # the trainer sets its own precision; say the rest so accelerate warns of nothing
        launch += ["--num_processes", str(args.processes or 1), "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no"]
        if (args.processes or 1) > 1:
            launch.append("--multi_gpu")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        launch += ["--num_cpu_threads_per_process", str(args.threads)]
    if args.machine_rank is not None:
        launch += ["--machine_rank", str(args.machine_rank)]
    if args.main_process_ip is not None:
        launch += ["--main_process_ip", args.main_process_ip]
    return [*launch, "--module", trainer_module(trainer.name), "--config", str(config),
            *overrides(rest)]


def train(argv: list[str]) -> int:
    parser = _train_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        command = launch_command(args, rest)
    except USER_ERRORS as err:
        parser.error(str(err))
    print(f"[draftsmith] {shlex.join(command)}", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    child = subprocess.Popen(command)
    # a SIGTERM or SIGHUP sent to this command goes to the launcher, as if it had been sent to
    # `accelerate launch` itself: the trainers follow their launcher, save and stop
    forwarded = (signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, lambda signum, frame: child.send_signal(signum))
                for s in forwarded}
    try:
        try:
            return _status(child.wait())
        except KeyboardInterrupt:  # the terminal sent SIGINT to the trainer too: it saves, stops
            return _status(child.wait())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _status(code: int) -> int:
    """A child's exit code as a shell reports it (a signal N -> 128 + N)."""
    return 128 - code if code < 0 else code


def run_module(command: Command, name: str, argv: list[str]) -> int:
    """Run ``python -m <module>`` in this process with ``argv`` -> its exit status."""
    invoked_as(command.program, f"{PROG} {name}")
    saved = sys.argv
    sys.argv = [f"{PROG} {name}", *argv]
    try:
        with warnings.catch_warnings():  # the package imported it already; python -m does the
            # same: the module runs afresh as __main__, as that command would run it
            warnings.filterwarnings("ignore", message=".*found in sys.modules after import",
                                    category=RuntimeWarning)
            runpy.run_module(command.module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        sys.argv = saved
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if not argv:
        parser.print_help()
        return 2
    if argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import PackageNotFoundError, version
        try:
            print(f"{PROG} {version('draftsmith')}")
        except PackageNotFoundError:
            print(f"{PROG} (not installed: run from a checkout)")
        return 0
    name, rest = argv[0], argv[1:]
    if name == "train":
        return train(rest)
    if name not in COMMANDS:
        parser.error(f"unknown command {name!r}; choose one of train, {', '.join(COMMANDS)}")
    return run_module(COMMANDS[name], name, rest)


def entry() -> None:
    """The console script."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
