"""The frozen target model: loading it and what drafts need of it.

A target is named by a Hugging Face model directory, a ``.gguf`` file or an embedded name
(``smollm2-135m``); :mod:`draftsmith.targets.resolve` turns the name into a model directory
(converting a GGUF file once). Nothing here touches the network, and no code shipped with a
model is ever run (``trust_remote_code=False`` on every load).

:meth:`Target.identity` is what an artifact, a checkpoint or a feature cache records about the
target it was made for: its name, shapes, where it was loaded from and a fingerprint of its
weights (:func:`weights_digest`, every weight; older records hold the sampled
:func:`weights_fingerprint` only, still compared by it); :meth:`Target.check_identity` refuses
another target.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

import torch
from torch import nn

from draftsmith.files.output_dir import write_atomic
from draftsmith.targets.resolve import EMBEDDED_TARGETS, cache_root, resolve_target, target_hub_id

# what weights_fingerprint reads: the first rows of the embedding, the leading elements of the
# middle decoder layer's tensors (this many in all), the final norm
FINGERPRINT_ROWS = 64
FINGERPRINT_ELEMENTS = 1 << 18


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


class FrozenParts:
    """The target's embedding and LM head, and a head's rotary tables, used by reference (an
    EAGLE head, a block draft).

    Not a Module, so they are never saved with the head, never handed to its optimizer, never
    wrapped for gradient sync and never cast with the head (the rotary tables stay float32, as
    in the target); a deepcopy of the head (e.g. for an EMA) shares them.
    """

    def __init__(self, embed: nn.Module, lm_head: nn.Module, rotary: nn.Module):
        self.embed, self.lm_head, self.rotary = embed, lm_head, rotary

    def __deepcopy__(self, memo):
        return self


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (..., q, k) -> additive float mask: 0 where allowed, the dtype's minimum elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def weights_fingerprint(model: nn.Module,
                        read: Callable[[str, int], torch.Tensor] | None = None) -> str | None:
    """A short hash of a few of a causal LM's weights, to tell targets of the same shapes apart.

    Reads the first :data:`FINGERPRINT_ROWS` rows of the input embedding, the leading elements
    of every tensor of the middle decoder layer (:data:`FINGERPRINT_ELEMENTS` shared between
    them; the middle parameter for a model without ``layers``) and the final norm, in a fixed
    order, each with its name and full shape. Values are copied to the CPU and rounded to
    bfloat16 first, so one checkpoint gives one fingerprint whether it is loaded in float32 on a
    CPU or in bfloat16 on a GPU; the LM head is not read, so tying does not matter. A weight not
    materialised (a meta tensor) is read with ``read(parameter name, count)`` (its leading
    ``count`` values, from the checkpoint), or the result is None. Cheap: a few hundred thousand
    values for any model.
    """
    embed = model.get_input_embeddings().weight
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    names = {id(p): n for n, p in model.named_parameters()}
    if layers is not None and len(layers):
        middle = len(layers) // 2
        group = [(f"layers.{middle}.{name}", p) for name, p in layers[middle].named_parameters()]
    else:
        skip = {id(embed), id(model.get_output_embeddings().weight)}
        params = [(n, p) for n, p in model.named_parameters() if id(p) not in skip]
        group = [params[len(params) // 2]] if params else []
    norm = getattr(decoder, "norm", None)
    finals = [] if norm is None else [(f"norm.{name}", p) for name, p in norm.named_parameters()]
    each = max(256, FINGERPRINT_ELEMENTS // max(1, len(group)))
    parts = [("embed", embed, FINGERPRINT_ROWS * embed.shape[-1])]
    parts += [(name, p, each) for name, p in sorted(group, key=itemgetter(0))]
    parts += [(name, p, p.numel()) for name, p in sorted(finals, key=itemgetter(0))]
    digest = hashlib.sha256()
    for name, whole, count in parts:
        if not whole.is_meta:
            values = whole.detach().reshape(-1)[:count]
        elif read is not None:
            values = read(names[id(whole)], count)
        else:
            return None
        _hash_rounded(digest, name, whole.shape, values)
    return digest.hexdigest()[:16]


def _hash_rounded(digest, name: str, shape, values: torch.Tensor) -> None:
    """Add a tensor to ``digest``: its name, full shape and values rounded to bfloat16 (through
    float32, as a float32 load of the same checkpoint would hold them)."""
    values = values.detach().to("cpu").float().to(torch.bfloat16).contiguous()
    digest.update(f"{name}:{tuple(shape)};".encode())
    digest.update(values.view(torch.int16).numpy().tobytes())


def weights_digest(model: nn.Module,
                   read: Callable[[str, int], torch.Tensor] | None = None) -> str | None:
    """sha256 of every weight (name, shape, values rounded to bfloat16: one digest in any
    precision), in name order; a tied LM head is read once. A meta parameter is read whole with
    ``read(name, numel)``, else None. Any changed value of any layer changes it; about a second
    per 100 M parameters on a CPU, so :func:`cached_weights_digest` keeps it per directory."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=itemgetter(0)):
        if not param.is_meta:
            values = param.detach()
        elif read is not None:
            values = read(name, param.numel())
        else:
            return None
        _hash_rounded(digest, name, param.shape, values)
    return digest.hexdigest()


def cached_weights_digest(path: Path, compute: Callable[[], str | None]) -> str | None:
    """:func:`weights_digest` of the target directory ``path``, computed (``compute()``) once and
    kept in ``<cache>/weights-digests/`` under the directory's resolved path with the size and
    modification time of each weight file: a changed file is digested again."""
    path = Path(path).resolve()
    files = sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
    stats = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    record = cache_root() / "weights-digests" / \
        f"{hashlib.sha256(str(path).encode()).hexdigest()[:20]}.json"
    try:
        kept = json.loads(record.read_text())
        if kept.get("path") == str(path) and kept.get("files") == stats and kept.get("digest"):
            return kept["digest"]
    except (OSError, ValueError, AttributeError):
        pass  # none yet, or damaged: computed again
    digest = compute()
    try:
        if digest is not None and stats:
            record.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(record, json.dumps({"path": str(path), "files": stats, "digest": digest}))
    except OSError:
        pass  # a read-only cache: computed again next time
    return digest


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
    # weights_fingerprint and weights_digest, when the loader computed them from the checkpoint
    # (a model loaded in parts cannot compute them from its own weights)
    fingerprint: str | None = None
    digest: str | None = None

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
        """What an artifact records about the target it was trained for; checked on load.

        Shapes and ``weights_digest`` (every weight; ``weights_fingerprint``, the sampled one
        older records hold, beside it) are checked (:meth:`check_identity`); ``name``, ``hub_id``
        (when known) and ``path`` (the resolved model directory, when known) say where to find
        the target again. A loaded target's digest is computed once (cached per directory).
        """
        if self.digest is None and self.path is not None and Path(self.path).is_dir():
            self.digest = cached_weights_digest(self.path, lambda: weights_digest(self.model))
        return {
            "name": self.name,
            "model_type": self.config.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "weights_fingerprint": self.fingerprint or weights_fingerprint(self.model),
            "weights_digest": self.digest or weights_digest(self.model),
            "hub_id": target_hub_id(self.path if self.path is not None else self.name),
            "path": str(Path(self.path).resolve()) if self.path is not None else None,
        }

    def check_identity(self, recorded: dict, what: str = "artifact", *,
                       allow_other_weights: bool = False) -> None:
        """Refuse an artifact trained for a different target.

        Shapes must agree. So must the weights: by ``weights_digest`` (every weight) when the
        record has one, else by the sampled ``weights_fingerprint`` of older records (records
        written before fingerprints existed have neither: nothing to compare), unless
        ``allow_other_weights``: a draft trained for other weights of the same shapes loads and
        stays exact, but its guesses are rejected (acceptance near 0). Names are advisory.
        """
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
        key = "weights_digest" if recorded.get("weights_digest") else "weights_fingerprint"
        theirs, ours = recorded.get(key), mine[key]
        if allow_other_weights or not theirs or not ours or theirs == ours:
            return
        where = recorded.get("hub_id") or recorded.get("path")
        kind = "digest" if key == "weights_digest" else "fingerprint"
        raise ValueError(
            f"the {what} was trained for target {recorded.get('name')!r} with weights "
            f"{kind} {theirs[:16]}, but {self.name!r} has the same shapes and other weights "
            f"({kind} {ours[:16]}): its guesses would be rejected. Load it with the target it was "
            f"trained for{f' ({where})' if where else ''}, or pass allow_other_weights=True "
            f"(--allow-other-weights on the command line) to use it anyway"
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

    def hidden_states(self, input_ids: torch.Tensor, indices, attention_mask=None,
                      position_ids=None) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The hidden states ``indices`` (transformers' ``output_hidden_states`` numbering: index
        i is the input of decoder layer i) and the final-normed last hidden state, without the
        LM head -> ({index: (B, S, H)}, (B, S, H)).

        Captured at the inputs of their decoder layers, so only these are kept, not all L + 1
        (on an 8B target 4 instead of 33 (B, S, H) tensors alive while a head trains). Index L
        (the final-normed state) is the second result. Packed rows: ``position_ids`` (B, S)
        restarting at 0 per document and no ``attention_mask`` (transformers then attends within
        each document).
        """
        captured: dict[int, torch.Tensor] = {}
        hooks = []

        def capture(index: int):
            def hook(module, args, kwargs):
                captured[index] = args[0] if args else kwargs["hidden_states"]
            return hook

        for i in indices:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"hidden state {i} is not the input of one of the target's "
                                 f"{self.num_layers} decoder layers")
            hooks.append(self.layers[i].register_forward_pre_hook(capture(i), with_kwargs=True))
        try:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False)
        finally:
            for handle in hooks:
                handle.remove()
        return captured, out.last_hidden_state

    def prompt_ids(self, text: str, prompt_format: str = "chat") -> list[int]:
        """Token ids of a prompt: ``chat`` applies the chat template (:meth:`chat_ids`);
        ``text`` takes the text as it is, to be continued (a base model's completion prompt,
        HumanEval's code), with the tokenizer's own special tokens (a BOS where it adds one)."""
        if prompt_format == "chat":
            return self.chat_ids(text)
        if prompt_format != "text":
            raise ValueError(f"prompt format must be 'chat' or 'text', got {prompt_format!r}")
        if self.tokenizer is None:
            raise ValueError(f"target {self.name!r} has no tokenizer; pass token ids instead")
        return [int(t) for t in self.tokenizer(text)["input_ids"]]

    def chat_ids(self, prompt: str | list[dict], system: str | None = None) -> list[int]:
        """Token ids of a user prompt (or a list of messages) with the chat template applied."""
        if self.tokenizer is None:
            raise ValueError(f"target {self.name!r} has no tokenizer; pass token ids instead")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        # a tokenizer built without a template (load_target_tokenizer gives every loaded target
        # one) renders as a base model's: the completion template
        template = getattr(self.tokenizer, "chat_template", None) or completion_template(
            self.tokenizer)
        ids = self.tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=True,
            return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]


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


def wrap_target(model: nn.Module, tokenizer=None, name: str = "model", path=None,
                fingerprint: str | None = None, digest: str | None = None) -> Target:
    """Freeze an already-built causal LM and wrap it (tests use this with tiny random models)."""
    freeze(model)
    return Target(model=model, tokenizer=tokenizer, name=name, path=path,
                  eos_token_ids=eos_ids_of(model, tokenizer), fingerprint=fingerprint,
                  digest=digest)


# A base model's conversations (Gemma-3 270M base has no chat template): every turn's text right
# after the one before, nothing between them, after the special tokens the tokenizer starts any
# text with. A prompt then gets the ids ``prompt_ids(text, "text")`` gives it, and an answer is
# the continuation the model wrote, so regeneration, training rows and the benchmark's prompts
# all see the same tokens.
COMPLETION_TEMPLATE = "{{ PREFIX }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def completion_template(tokenizer) -> str:
    """:data:`COMPLETION_TEMPLATE` for ``tokenizer``: its leading special tokens (a BOS where it
    adds one) written out as text."""
    prefix = tokenizer.decode(tokenizer("")["input_ids"])
    return COMPLETION_TEMPLATE.replace("{{ PREFIX }}", prefix.replace("{", "{{ '{' }}"))


def load_target_tokenizer(path: str | os.PathLike):
    """A target directory's tokenizer; one without a chat template (a base model) gets
    :func:`completion_template`, said once on stderr."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = completion_template(tokenizer)
        if str(path) not in _TOLD_BASE:
            _TOLD_BASE.add(str(path))
            print(f"[draftsmith] {Path(path).name} has no chat template (a base model): prompts "
                  "are its text and answers continue it, nothing between the turns",
                  file=sys.stderr)
    return tokenizer


_TOLD_BASE: set[str] = set()  # the directories load_target_tokenizer has said it of


def load_target(
    spec: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
) -> Target:
    """Load a frozen target: bf16 on GPU and fp32 on CPU by default, eval mode, no gradients."""
    from transformers import AutoModelForCausalLM

    path = resolve_target(spec)
    dev, dt = default_device_dtype(device, dtype)
    kwargs = {"dtype": dt, "trust_remote_code": False}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).to(dev)
    tokenizer = load_target_tokenizer(path)
    name = str(spec) if str(spec) in EMBEDDED_TARGETS else Path(spec).name
    return wrap_target(model, tokenizer, name=name, path=path)


def _read_checkpoint_tensors(path: Path, names: list[str],
                             leading: int | None = None) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors model directory (one file or an index of shards),
    read without touching the others; with ``leading``, only the rows holding each tensor's
    first ``leading`` values (flattened)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (path / "model.safetensors").is_file():
        weight_map = dict.fromkeys(names, "model.safetensors")
    else:
        raise FileNotFoundError(f"target directory {path} has no model.safetensors or "
                                f"model.safetensors.index.json")
    tensors = {}
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name in weight_map:
            by_file.setdefault(weight_map[name], []).append(name)
    for file, wanted in by_file.items():
        target = (path / file).resolve()
        if target.parent != path.resolve():
            raise ValueError(f"{index} names {file!r}, outside {path}")
        with safe_open(str(target), framework="pt") as handle:
            present = set(handle.keys())
            for n in wanted:
                if n not in present:
                    continue
                if leading is None:
                    tensors[n] = handle.get_tensor(n)
                    continue
                part = handle.get_slice(n)
                shape = part.get_shape()
                row = max(1, math.prod(shape[1:]))
                rows = part[: -(-leading // row)] if shape else part[:]
                tensors[n] = rows.reshape(-1)[:leading]
    return tensors


def load_target_parts(
    spec: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
) -> Target:
    """The parts of a target that training from an offline feature cache reads, and no more.

    Loads the input embedding, the final norm and the LM head (plus the rotary tables, which
    are computed, not stored) from the checkpoint; the decoder layers exist only on the meta
    device, so they take no memory and the model cannot run forward (``features``, ``generate``
    fail). Everything an EAGLE head takes from its target works: ``embed``, ``norm``,
    ``lm_head``, ``layers[0]``'s class, ``decoder.rotary_emb``, ``identity()``, the tokenizer.
    For an 8B Llama in bf16 that is about 2 GB instead of 16. Safetensors directories only
    (GGUF targets are converted to one first, as :func:`load_target` does).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = resolve_target(spec)
    dev, dt = default_device_dtype(device, dtype)
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dt, trust_remote_code=False)
    decoder = model.get_decoder()
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    norm, rotary = getattr(decoder, "norm", None), getattr(decoder, "rotary_emb", None)
    if norm is None or rotary is None:
        raise ValueError(f"{type(decoder).__name__} has no norm or rotary_emb; load the whole "
                         f"target with load_target")
    module_names = {id(module): name for name, module in model.named_modules()}
    tied = lm_head.weight is embed.weight
    parts = [embed, norm] + ([] if tied else [lm_head])
    names = [f"{module_names[id(m)]}.{p}" for m in parts for p, _ in m.named_parameters()]
    tensors = _read_checkpoint_tensors(path, names)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{path}: the checkpoint has no {missing} (other weight names than "
                         f"{type(model).__name__} uses); load the whole target with load_target")
    for module in parts:
        module.to_empty(device=dev)
        for name, param in module.named_parameters():
            param.data.copy_(tensors[f"{module_names[id(module)]}.{name}"].to(dt))
    if tied:  # the meta parameter the LM head still holds is replaced by the loaded one
        lm_head.weight = embed.weight
    with torch.device(dev):
        decoder.rotary_emb = type(rotary)(config=model.config)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    if next(model.parameters()).device.type == "meta":  # what Target.device reads
        raise ValueError(f"{type(model).__name__} registers a decoder weight before its "
                         f"embedding; load the whole target with load_target")
    tokenizer = load_target_tokenizer(path)
    name = str(spec) if str(spec) in EMBEDDED_TARGETS else Path(spec).name

    def read(parameter: str, count: int) -> torch.Tensor:  # the layers' leading values, on disk
        found = _read_checkpoint_tensors(path, [parameter], leading=count)
        if parameter not in found:
            raise ValueError(f"{path}: the checkpoint has no {parameter!r}; load the whole "
                             f"target with load_target")
        return found[parameter]

    return wrap_target(model, tokenizer, name=name, path=path,
                       fingerprint=weights_fingerprint(model, read),
                       digest=cached_weights_digest(path, lambda: weights_digest(model, read)))
