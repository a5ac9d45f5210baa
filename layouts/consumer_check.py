"""Check an export with its consumer's own code: speculators, in an isolated virtual environment.

    draftsmith consumer-check install     # build the pinned venv once (CPU torch, ~1 GB)

speculators pins its own transformers, so it runs in a venv of its own under
``<draftsmith cache>/consumer-venvs/`` keyed by the pinned versions; a complete venv is reused by
every later check (``--check`` of ``draftsmith export``, the slow test). torchvision and
torchaudio, which speculators lists but never imports on the loading path, are left out so pip
does not swap the CPU torch wheel for a CUDA build.

:func:`run_speculators_check` loads an EAGLE-3 speculators export with
``speculators.SpeculatorModel.from_pretrained`` (:mod:`draftsmith.layouts.speculators_probe` runs inside the
venv) with the verifier served from a temporary, offline Hugging Face cache built from the target's
local directory, and reports missing, unexpected, uninitialised and mismatched weights and the
draft logits speculators computes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.files.command_line import program
from draftsmith.files.output_dir import remove_dir, stage_dir
from draftsmith.targets.resolve import cache_root

SPECULATORS_VERSION = "0.9.0"
TORCH_VERSION = "2.13.0"
_LEFT_OUT = ("torch", "torchvision", "torchaudio")
_COMPLETE = "draftsmith-venv-complete"
_VENV_KIND = "consumer-venv"  # the draftsmith.files.output_dir marker kind of the venv


def speculators_venv() -> Path:
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return cache_root() / "consumer-venvs" / (
        f"speculators-{SPECULATORS_VERSION}-torch-{TORCH_VERSION}-{py}")


def speculators_python() -> Path | None:
    """The venv's python when the venv is complete, else None."""
    venv = speculators_venv()
    python = venv / "bin" / "python"
    return python if (venv / _COMPLETE).is_file() and python.exists() else None


def _run(cmd: list[str], log) -> None:
    print("$ " + " ".join(cmd), file=log, flush=True)
    done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {done.returncode}")


def install_speculators(log=sys.stderr) -> Path:
    """Build the pinned speculators venv (if not already complete); -> its python."""
    found = speculators_python()
    if found is not None:
        return found
    venv = speculators_venv()
    # marked when made, so that a broken venv left at this path is known to be draftsmith's
    partial = stage_dir(venv, kind=_VENV_KIND)
    try:
        _run([sys.executable, "-m", "venv", str(partial)], log)
        python = str(partial / "bin" / "python")
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        _run(pip + [f"torch=={TORCH_VERSION}"], log)
        _run(pip + ["--no-deps", f"speculators=={SPECULATORS_VERSION}"], log)
        listed = subprocess.run(
            [python, "-c", "import json, importlib.metadata as m; "
             "print(json.dumps(m.requires('speculators') or []))"],
            capture_output=True, text=True, check=True).stdout
        wanted = [r for r in json.loads(listed) if "extra ==" not in r
                  and r.split(";")[0].replace(" ", "").split("<")[0].split(">")[0]
                  .split("=")[0].split("!")[0].split("~")[0].lower() not in _LEFT_OUT]
        constraints = partial / "constraints.txt"
        constraints.write_text(f"torch=={TORCH_VERSION}\n")
        _run(pip + ["-c", str(constraints), *wanted], log)
        _run([python, "-c", "import speculators.models.eagle3"], log)
        (partial / _COMPLETE).write_text(json.dumps(
            {"speculators": SPECULATORS_VERSION, "torch": TORCH_VERSION}) + "\n")
        if venv.exists() or venv.is_symlink():
            if (venv / _COMPLETE).is_file() and not venv.is_symlink():
                shutil.rmtree(venv)  # an earlier complete venv of other pinned versions
            else:
                remove_dir(venv, kind=_VENV_KIND)  # refuses a directory draftsmith did not make
        os.replace(partial, venv)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return venv / "bin" / "python"


def _hub_cache(root: Path, hub_id: str, model_dir: Path) -> Path:
    """An offline HF hub cache holding ``model_dir``'s files under ``hub_id`` (symlinks)."""
    repo = root / "hub" / ("models--" + hub_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "draftsmith-local"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("draftsmith-local")
    for path in model_dir.iterdir():
        if path.is_file() and (path.suffix in (".json", ".safetensors", ".txt", ".model")):
            (snapshot / path.name).symlink_to(path.resolve())
    return root


def run_speculators_check(python: str | os.PathLike, export_dir: str | os.PathLike,
                          verifier_dir: str | os.PathLike, features: torch.Tensor,
                          input_ids: torch.Tensor, timeout: float = 900) -> dict:
    """Load ``export_dir`` with speculators in the venv; -> the probe's report.

    ``verifier_dir``: the target's HF directory, served offline under the export's verifier hub
    id. features (1, S, 3h) fp32, input_ids (1, S). The report has ``missing``, ``unexpected``,
    ``uninitialised``, ``mismatched`` (lists of names), ``verifier_mismatched``, ``dtype`` (what
    speculators computed in: the export's) and ``logits`` (1, S, draft_vocab) as it computes them.
    """
    config = json.loads((Path(export_dir) / "config.json").read_text())
    hub_id = config["speculators_config"]["verifier"]["name_or_path"]
    with tempfile.TemporaryDirectory(prefix="draftsmith-speculators-") as tmp:
        tmp = Path(tmp)
        home = _hub_cache(tmp / "hf", hub_id, Path(verifier_dir))
        save_file({"features": features.contiguous().to(torch.float32),
                   "input_ids": input_ids.contiguous().to(torch.int64)}, str(tmp / "inputs.st"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON"))}
        env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        probe = Path(__file__).with_name("speculators_probe.py")
        done = subprocess.run(
            [str(python), str(probe), str(export_dir), str(tmp / "inputs.st"), str(tmp)],
            env=env, capture_output=True, text=True, timeout=timeout, cwd=str(tmp))
        if done.returncode != 0:
            raise RuntimeError(f"speculators could not load {export_dir}:\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        report = json.loads((tmp / "report.json").read_text())
        report["logits"] = load_file(str(tmp / "logits.st"))["logits"]
        report["log"] = done.stderr[-4000:]
    return report


def main(argv: list[str] | None = None) -> int:
    """``draftsmith consumer-check install``: build the pinned speculators venv."""
    argv = sys.argv[1:] if argv is None else argv
    usage = (f"usage: {program('python -m draftsmith.layouts.consumer_check')} install\n\nbuild the pinned "
             f"venv of speculators (CPU torch, about 1 GB) that an export's --check loads in")
    if argv in (["-h"], ["--help"]):
        print(usage)
        return 0
    if argv != ["install"]:
        print(usage, file=sys.stderr)
        return 2
    print(install_speculators())
    return 0


if __name__ == "__main__":
    sys.exit(main())
