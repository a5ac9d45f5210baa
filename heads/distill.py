"""Draft language models that share the target's tokenizer.

Three ways to get one:

* ``truncate:N`` (:func:`truncate_model`): the target's first N decoder layers with its embedding,
  final norm and LM head. Shared (no copy) when the draft is only used for inference, copied when
  it is to be trained, so it starts as a sensible model.
* :func:`fresh_draft`: a new, randomly initialised model of the target's class with fewer or
  narrower layers, the target's vocabulary, and optionally its embedding and LM head.
* a Hugging Face model directory (an existing small model, or a distilled draft written by
  :func:`save_draft`), checked against the target's vocabulary and tokenizer by :func:`load_draft`.

:func:`restrict_vocabulary` gives a draft a reduced vocabulary (:class:`DraftVocabHead`: the
``draft_vocab_size`` most frequent answer tokens): its LM head computes those rows only and the
other tokens' logits are -inf, so its distribution is exactly zero there and every exact
acceptance rule applies unchanged, while a draft token costs the rows it keeps (on SmolLM2 the
49152-row head is most of a small draft's work). Such a draft runs in draftsmith's engine; its
directory is refused by Hugging Face's loader (the head has fewer rows than the vocabulary) rather
than silently read as another model.

:func:`add_lora` / :func:`merge_lora` train a draft through low-rank adapters (peft) and fold them
back into plain weights before :func:`save_draft` writes the directory.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch import nn

from draftsmith.files.file_formats import read_json_object
from draftsmith.files.output_dir import write_dir
from draftsmith.heads.artifact import DRAFT_INFO_KEY, FORMAT_VERSION, check_finite
from draftsmith.targets.resolve import check_model_directory, is_hub_id, resolve_target
from draftsmith.targets.target import Target, freeze

TRUNCATE_PREFIX = "truncate:"


def truncate_model(model: nn.Module, num_layers: int, share: bool = True) -> nn.Module:
    """A causal LM of the same class made of ``model``'s first ``num_layers`` decoder layers.

    Embedding, rotary tables, final norm and LM head come from ``model``: shared when ``share``,
    deep-copied otherwise (so training the draft never touches the target).
    """
    decoder = model.get_decoder()
    total = len(decoder.layers)
    if not 1 <= num_layers <= total:
        raise ValueError(
            f"truncate:N needs 1 <= N <= {total} (the target's layer count), got {num_layers}"
        )
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        draft = type(model)(config)
    draft_decoder = draft.get_decoder()
    for name, child in decoder.named_children():
        if name == "layers":
            draft_decoder.layers = nn.ModuleList(list(decoder.layers[:num_layers]))
        else:
            setattr(draft_decoder, name, child)
    draft.set_output_embeddings(model.get_output_embeddings())
    leftover = [n for n, t in list(draft.named_parameters()) + list(draft.named_buffers())
                if t.is_meta]
    if leftover:
        raise ValueError(
            f"cannot truncate {type(model).__name__}: parts outside the decoder ({leftover[:3]}) "
            "are not understood; use a draft model directory instead"
        )
    if getattr(model, "generation_config", None) is not None:
        draft.generation_config = copy.deepcopy(model.generation_config)
    if not share:
        draft = copy.deepcopy(draft)
    else:
        # peft would inject adapters into the target's own layers: add_lora refuses such a draft
        draft._draftsmith_shares_target = True
    return draft


class DraftVocabHead(nn.Module):
    """A draft's LM head over part of the target's vocabulary: ``weight`` (kept, h) holds the rows
    of the ``kept`` target ids (ascending); the logits of every other token are -inf."""

    def __init__(self, weight: torch.Tensor, kept: torch.Tensor, vocab_size: int):
        super().__init__()
        kept = torch.as_tensor(kept, dtype=torch.int64).reshape(-1)
        if weight.shape[0] != kept.numel() or not 0 < kept.numel() <= vocab_size:
            raise ValueError(f"a draft vocabulary of {kept.numel()} ids needs that many weight "
                             f"rows (got {weight.shape[0]}) and at most {vocab_size} ids")
        if bool((kept[1:] <= kept[:-1]).any()) or int(kept[0]) < 0 or int(kept[-1]) >= vocab_size:
            raise ValueError(f"draft vocabulary ids must be ascending, distinct and in "
                             f"0..{vocab_size - 1}")
        self.weight = nn.Parameter(weight.detach().clone())
        # its own copy: a checkpoint loaded into the buffer must not rewrite the caller's ids
        self.register_buffer("kept", kept.to(weight.device).clone())
        self.vocab_size = int(vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.linear(hidden, self.weight)  # (..., kept)
        logits = rows.new_full((*rows.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy(-1, self.kept, rows)  # (..., vocab)


def output_vocab_size(model: nn.Module) -> int:
    """The vocabulary a causal LM's logits span (a :class:`DraftVocabHead`'s whole vocabulary)."""
    head = model.get_output_embeddings()
    return head.vocab_size if isinstance(head, DraftVocabHead) else int(head.weight.shape[0])


def restrict_vocabulary(model: nn.Module, kept: torch.Tensor) -> nn.Module:
    """Give ``model`` a :class:`DraftVocabHead` over the ascending target ids ``kept``, its rows
    copied from the current LM head (untied from the input embedding, which keeps every token)."""
    head = model.get_output_embeddings()
    if isinstance(head, DraftVocabHead):
        raise ValueError("this draft has a reduced vocabulary already")
    kept = torch.as_tensor(kept, dtype=torch.int64, device=head.weight.device)
    vocab = int(head.weight.shape[0])
    if int(kept.max()) >= vocab:
        raise ValueError(f"draft vocabulary ids reach {int(kept.max())}, the LM head has {vocab}")
    with torch.no_grad():
        restricted = DraftVocabHead(head.weight[kept], kept, vocab)
    model.set_output_embeddings(restricted)
    model.config.tie_word_embeddings = False  # the rows are the head's own now
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = {} if isinstance(model._tied_weights_keys, dict) else []
    model.config.draft_vocab_size = int(kept.numel())
    return model


def check_same_vocab(target: Target, draft_model: nn.Module, draft_tokenizer=None,
                     draft_name: str = "draft") -> None:
    """Refuse a draft whose vocabulary or tokenizer differs from the target's, naming both."""
    target_vocab = target.vocab_size
    draft_vocab = output_vocab_size(draft_model)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"vocabulary mismatch: draft {draft_name!r} has {draft_vocab} output tokens, target "
            f"{target.name!r} has {target_vocab}; a draft must share the target's tokenizer"
        )
    if draft_tokenizer is not None and target.tokenizer is not None:
        a, b = draft_tokenizer.get_vocab(), target.tokenizer.get_vocab()
        if a != b:
            differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
            raise ValueError(
                f"tokenizer mismatch: draft {draft_name!r} ({type(draft_tokenizer).__name__}, "
                f"{len(a)} entries) and target {target.name!r} ({type(target.tokenizer).__name__}, "
                f"{len(b)} entries) map tokens differently, e.g. {differ}"
            )


def load_draft(spec: str, target: Target, trainable: bool = False,
               dtype: torch.dtype | None = None) -> nn.Module:
    """``truncate:N``, a model directory or a hub id in the local Hugging Face cache -> a draft
    on the target's device and dtype.

    ``trainable=False``: frozen, eval mode, truncated layers shared with the target.
    ``trainable=True``: an independent copy in train mode with every parameter trainable.
    ``dtype``: run the draft in another precision than the target (e.g. bf16 beside an fp32
    target on a CPU: half the bytes per draft token). The draft's numerics never touch
    exactness, which only depends on the target; a truncated draft is then a copy.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.startswith(TRUNCATE_PREFIX):
        text = spec[len(TRUNCATE_PREFIX):]
        if not text.isdigit():
            raise ValueError(f"expected truncate:N with N a layer count, got {spec!r}")
        same = dtype is None or dtype == target.dtype
        draft = truncate_model(target.model, int(text), share=not trainable and same)
        if not same:
            draft = draft.to(dtype)
    else:
        path = Path(spec).expanduser()
        if not path.exists() and is_hub_id(spec):  # a draft in the local Hugging Face cache
            path = resolve_target(spec)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"draft {spec!r} is neither truncate:N nor a model directory with config.json"
            )
        check_model_directory(path, what="draft")
        # never the directory's own code (config.json's auto_map): an architecture transformers
        # lacks is refused with its error
        info = read_draft_info(path) or {}
        if info.get("embedding") == "target" and not info.get("draft_vocab_size"):
            raise ValueError(f"{path} leaves its input embedding to the target but has no reduced "
                             f"vocabulary (draft_vocab_size); the directory is damaged: write "
                             f"the draft again")
        if info.get("draft_vocab_size"):
            draft = _load_restricted(path, dtype or target.dtype,
                                     target if info.get("embedding") == "target" else None, info)
        else:
            draft = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or target.dtype,
                                                         trust_remote_code=False)
        draft = draft.to(target.device)
        tokenizer = None
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        check_same_vocab(target, draft, tokenizer, draft_name=str(path))
    if not trainable:
        return freeze(draft)
    # a truncated copy inherits the frozen target's requires_grad=False; a draft to train needs
    # every parameter trainable and dropout on
    draft.train()
    for p in draft.parameters():
        p.requires_grad_(True)
    return draft


def _load_restricted(path: Path, dtype: torch.dtype, target: Target | None = None,
                     info: dict | None = None) -> nn.Module:
    """A draft directory whose LM head is a :class:`DraftVocabHead` (``lm_head.weight`` with the
    kept rows, ``lm_head.kept`` their ids), which transformers' loader refuses by design.

    ``target``: the directory leaves the input embedding out (``"embedding": "target"``); it is
    the target's, which must be the one the directory records (same shapes and weights)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    weights = sorted(path.glob("*.safetensors"))
    if len(weights) != 1:
        raise FileNotFoundError(f"{path}: a draft with a reduced vocabulary is one "
                                f"model.safetensors, found {[w.name for w in weights]}")
    state = load_file(str(weights[0]))
    kept = state.get("lm_head.kept")
    if kept is None or "lm_head.weight" not in state:
        raise ValueError(f"{path} says it has a reduced vocabulary but holds no lm_head.kept / "
                         f"lm_head.weight; write the draft again")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    restrict_vocabulary(model, kept)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight", "model.embed_tokens.weight"} if config.tie_word_embeddings else set()
    if target is not None:  # the embedding the directory leaves out: the target's own
        target.check_identity((info or {}).get("target") or {}, what=f"draft {path}")
        embedding = model.get_input_embeddings().weight
        source = target.model.get_input_embeddings().weight
        if embedding.shape != source.shape:
            raise ValueError(f"{path}: the draft's input embedding is {tuple(embedding.shape)}, "
                             f"the target's {tuple(source.shape)}; it cannot take the target's")
        with torch.no_grad():
            embedding.copy_(source.to(embedding.dtype))
        tied |= {n for n, p in model.named_parameters() if p is embedding}
    if [m for m in missing if m not in tied] or unexpected:
        raise ValueError(f"{path}: weights do not fit the draft's config (missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(dtype)


# ---------------------------------------------------------------------------------------------
# (b) a fresh small model of the target's architecture
# ---------------------------------------------------------------------------------------------


def _resized_heads(config, hidden_size: int, num_attention_heads: int | None,
                   num_key_value_heads: int | None) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) for a draft of ``hidden_size``, defaulting to the target's.

    Unchanged width keeps the target's heads and head_dim. A new width keeps the target's head_dim
    (heads = hidden / head_dim) and its query-per-key-value grouping where that divides.
    """
    base_hidden = int(config.hidden_size)
    base_heads = int(config.num_attention_heads)
    base_kv = int(getattr(config, "num_key_value_heads", None) or base_heads)
    base_head_dim = int(getattr(config, "head_dim", None) or base_hidden // base_heads)
    if num_attention_heads is None:
        if hidden_size == base_hidden:
            num_attention_heads = base_heads
        elif hidden_size % base_head_dim == 0:
            num_attention_heads = hidden_size // base_head_dim
        else:
            raise ValueError(
                f"hidden_size {hidden_size} is not a multiple of the target's head_dim "
                f"{base_head_dim}; pass num_attention_heads explicitly"
            )
    if num_attention_heads < 1:
        raise ValueError(f"num_attention_heads must be >= 1, got {num_attention_heads}")
    if num_key_value_heads is None:
        group = base_heads // base_kv
        if num_attention_heads == base_heads:
            num_key_value_heads = base_kv
        elif num_attention_heads % group == 0:
            num_key_value_heads = num_attention_heads // group
        else:
            num_key_value_heads = num_attention_heads
    if num_key_value_heads < 1 or num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_key_value_heads ({num_key_value_heads}) must divide num_attention_heads "
            f"({num_attention_heads})"
        )
    if hidden_size == base_hidden and num_attention_heads == base_heads:
        head_dim = base_head_dim
    elif hidden_size % num_attention_heads == 0:
        head_dim = hidden_size // num_attention_heads
    else:
        raise ValueError(
            f"hidden_size {hidden_size} is not divisible by num_attention_heads "
            f"{num_attention_heads}; choose sizes with hidden_size = heads * head_dim"
        )
    return num_attention_heads, num_key_value_heads, head_dim


def fresh_draft(
    target: Target | nn.Module,
    num_layers: int,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    seed: int = 0,
    init_from_target: bool = True,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A new model of the target's class and config, resized, with the target's vocabulary.

    Sizes left as None follow the target (a new ``hidden_size`` scales ``intermediate_size`` with
    it and keeps the target's head_dim). Embeddings are tied exactly when the target's are. With
    ``init_from_target`` and an unchanged hidden size, the embedding, final norm and LM head start
    as copies of the target's (the decoder layers are random either way). Initialisation depends
    only on ``seed``; the global RNG is left as it was. The draft is trainable, in ``dtype``
    (float32 master weights by default), on the target's device.
    """
    model = target.model if isinstance(target, Target) else target
    base = model.config
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    hidden = int(base.hidden_size) if hidden_size is None else int(hidden_size)
    if hidden < 1:
        raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
    heads, kv_heads, head_dim = _resized_heads(base, hidden, num_attention_heads,
                                               num_key_value_heads)
    config = copy.deepcopy(base)
    config.num_hidden_layers = num_layers
    config.hidden_size = hidden
    config.num_attention_heads = heads
    if hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = kv_heads
    if hasattr(config, "head_dim"):
        config.head_dim = head_dim
    if hasattr(config, "intermediate_size"):
        if intermediate_size is None:
            intermediate_size = round(int(base.intermediate_size) * hidden / int(base.hidden_size))
        config.intermediate_size = int(intermediate_size)
    elif intermediate_size is not None:
        raise ValueError(f"{type(base).__name__} has no intermediate_size to set")
    if isinstance(getattr(config, "layer_types", None), list) and config.layer_types:
        # keep the target's pattern (e.g. sliding/full attention), repeated to the new depth
        config.layer_types = [base.layer_types[i % len(base.layer_types)]
                              for i in range(num_layers)]
    # the exact row count of the target's LM head, which may be padded past the tokenizer
    vocab = int(model.get_output_embeddings().weight.shape[0])
    config.vocab_size = vocab

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # built on the CPU so the weights depend on the seed alone, not on the device's RNG
        draft = type(model)(config)
    draft.to(device=next(model.parameters()).device, dtype=dtype)

    if init_from_target and hidden == int(base.hidden_size):
        with torch.no_grad():
            pairs = [(draft.get_input_embeddings(), model.get_input_embeddings()),
                     (draft.get_output_embeddings(), model.get_output_embeddings()),
                     (getattr(draft.get_decoder(), "norm", None),
                      getattr(model.get_decoder(), "norm", None))]
            for mine, theirs in pairs:
                if mine is None or theirs is None:
                    continue
                for name, param in mine.named_parameters(recurse=False):
                    source = getattr(theirs, name, None)
                    if source is not None and source.shape == param.shape:
                        param.copy_(source)  # a copy: training the draft never moves the target
    if getattr(model, "generation_config", None) is not None:
        draft.generation_config = copy.deepcopy(model.generation_config)
    draft.train()
    for p in draft.parameters():
        p.requires_grad_(True)
    return draft


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------


def add_lora(model: nn.Module, r: int = 16, alpha: float = 32.0, dropout: float = 0.0,
             target_modules: str | list[str] = "all-linear") -> nn.Module:
    """Wrap ``model`` in a peft LoRA model: base weights frozen, adapters trainable.

    ``target_modules`` is peft's: "all-linear" (every linear layer but the LM head) or module
    names such as ["q_proj", "v_proj"]. peft edits ``model`` in place, so a draft that shares
    layers with the target (``truncate_model(share=True)``) is refused.
    """
    from peft import LoraConfig, get_peft_model

    if getattr(model, "_draftsmith_shares_target", False):
        raise ValueError(
            "this draft shares its layers with the target (truncate_model(share=True) or "
            "load_draft(trainable=False)); adding LoRA would change the target. Build it with "
            "share=False / load_draft(spec, target, trainable=True)"
        )
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA rank r must be a positive int, got {r!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold the adapters into the base weights (W + B @ A * alpha / r) -> the plain model."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise ValueError(f"merge_lora expects a model from add_lora (a peft PeftModel), got "
                         f"{type(model).__name__}")
    return model.merge_and_unload()


# ---------------------------------------------------------------------------------------------
# (c) the saved directory
# ---------------------------------------------------------------------------------------------


def save_draft(model: nn.Module, tokenizer, out_dir: str | os.PathLike, target_identity: dict,
               extra: dict | None = None, overwrite: bool = False,
               embedding_from_target: bool = False) -> Path:
    """Write a plain Hugging Face model directory for the draft, atomically.

    Written by :func:`draftsmith.files.output_dir.write_dir` (marked as an ``artifact``): an existing
    ``out_dir`` is replaced when it is an earlier artifact (or empty), anything else only with
    ``overwrite=True``.

    ``out_dir`` gets config.json (the model's config plus a ``"draftsmith"`` block: method "draft",
    format_version, the target identity and ``extra``, e.g. how the draft was built and trained),
    model.safetensors, generation_config.json and the target's tokenizer files with its chat
    template: loadable by ``AutoModelForCausalLM.from_pretrained``, usable as ``assistant_model``
    and by ``load_draft(out_dir, target)``. Pass the unwrapped model (no peft, no DDP wrapper).

    ``embedding_from_target``: the draft's input embedding is the target's, unchanged (a draft
    trained with it frozen, with a reduced vocabulary so the LM head is its own); the directory
    leaves it out and records ``"embedding": "target"``, and :func:`load_draft` takes it from the
    target the directory names (refusing other weights).
    """
    from peft import PeftModel

    if isinstance(model, PeftModel):
        raise ValueError("save_draft got a peft model with unmerged adapters; call "
                         "merge_lora(model) first so the directory holds plain weights")
    if not hasattr(model, "save_pretrained"):
        raise ValueError(f"save_draft needs a Hugging Face model (with save_pretrained), got "
                         f"{type(model).__name__}; pass accelerator.unwrap_model(model)")
    if tokenizer is None:
        raise ValueError("save_draft needs the target's tokenizer: a draft directory must carry it")
    rows = output_vocab_size(model)
    recorded = target_identity.get("vocab_size")
    if recorded is not None and int(recorded) != rows:
        raise ValueError(
            f"vocabulary mismatch: the draft has {rows} output tokens, target "
            f"{target_identity.get('name')!r} has {recorded}; a draft must share the target's "
            "vocabulary"
        )
    if len(tokenizer) > rows:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the draft only {rows} "
                         "output rows; save the target's tokenizer with a draft of its vocabulary")
    extra = dict(extra or {})
    reserved = {"method", "format_version", "target"} & set(extra)
    if reserved:
        raise ValueError(f"extra may not set {sorted(reserved)}: save_draft writes those itself")
    info = {"method": "draft", "format_version": FORMAT_VERSION, "target": dict(target_identity),
            **extra}
    head = model.get_output_embeddings()
    if isinstance(head, DraftVocabHead):  # what load_draft reads back through its own path
        info["draft_vocab_size"] = int(head.kept.numel())
    state = None
    if embedding_from_target:
        if not isinstance(head, DraftVocabHead):
            raise ValueError("embedding_from_target needs a draft with a reduced vocabulary (its "
                             "LM head its own, not tied to the embedding it leaves out)")
        embedding = model.get_input_embeddings().weight
        names = [n for n, p in model.named_parameters() if p is embedding]
        if len(names) != 1:
            raise ValueError(f"cannot name the draft's input embedding among its parameters "
                             f"(found {names})")
        info["embedding"] = "target"
        state = {k: v for k, v in model.state_dict().items() if k != names[0]}
    try:
        json.dumps(info)
    except TypeError as err:
        raise ValueError(f"extra must be JSON-serialisable (plain str/int/float/list/dict): {err}"
                         ) from err
    check_finite(model.state_dict(), f"the draft {out_dir} was not written")

    def fill(tmp: Path) -> None:
        model.save_pretrained(str(tmp), state_dict=state)
        tokenizer.save_pretrained(str(tmp))
        if not (tmp / "generation_config.json").is_file() and getattr(
                model, "generation_config", None) is not None:
            model.generation_config.to_json_file(str(tmp / "generation_config.json"))
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text())
        config[DRAFT_INFO_KEY] = info
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return write_dir(out_dir, fill, kind="artifact", overwrite=overwrite,
                     marker={"method": "draft"})


def read_draft_info(directory: str | os.PathLike) -> dict | None:
    """The ``"draftsmith"`` block of a draft directory's config.json, or None for other models."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a model directory (no config.json)")
    return read_json_object(path, fix="the model directory is damaged: write or download it "
                                      "again").get(DRAFT_INFO_KEY)
