"""Draft language models that share the target's tokenizer.

* ``truncate:N``: the target's first N decoder layers with its embedding, final norm and LM head.
  Shared (no copy) when the draft is only used for inference, copied when it is to be trained.
* a Hugging Face model directory (an existing small model, or a distilled draft exported by
  ``train/distill.py``), checked against the target's vocabulary and tokenizer.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from heads.target import Target, freeze

TRUNCATE_PREFIX = "truncate:"


def truncate_model(model: nn.Module, num_layers: int, share: bool = True) -> nn.Module:
    """A causal LM of the same class made of ``model``'s first ``num_layers`` decoder layers.

    Embedding, rotary tables, final norm and LM head come from ``model``: shared when ``share``,
    deep-copied otherwise (so training the draft never touches the target).
    """
    decoder = model.get_decoder()
    total = len(decoder.layers)
    if not 1 <= num_layers <= total:
        raise ValueError(f"truncate:N needs 1 <= N <= {total} (the target's layer count), got {num_layers}")
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
    leftover = [n for n, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if leftover:
        raise ValueError(
            f"cannot truncate {type(model).__name__}: parts outside the decoder ({leftover[:3]}) "
            "are not understood; use a draft model directory instead"
        )
    if getattr(model, "generation_config", None) is not None:
        draft.generation_config = copy.deepcopy(model.generation_config)
    if not share:
        draft = copy.deepcopy(draft)
    return draft


def check_same_vocab(target: Target, draft_model: nn.Module, draft_tokenizer=None,
                     draft_name: str = "draft") -> None:
    """Refuse a draft whose vocabulary or tokenizer differs from the target's, naming both."""
    target_vocab = target.vocab_size
    draft_vocab = int(draft_model.get_output_embeddings().weight.shape[0])
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


def load_draft(spec: str, target: Target, trainable: bool = False) -> nn.Module:
    """``truncate:N`` or a model directory -> a draft on the target's device and dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.startswith(TRUNCATE_PREFIX):
        text = spec[len(TRUNCATE_PREFIX):]
        if not text.isdigit():
            raise ValueError(f"expected truncate:N with N a layer count, got {spec!r}")
        draft = truncate_model(target.model, int(text), share=not trainable)
    else:
        path = Path(spec).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"draft {spec!r} is neither truncate:N nor a model directory with config.json"
            )
        draft = AutoModelForCausalLM.from_pretrained(str(path), dtype=target.dtype).to(target.device)
        tokenizer = None
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        check_same_vocab(target, draft, tokenizer, draft_name=str(path))
    return draft if trainable else freeze(draft)
