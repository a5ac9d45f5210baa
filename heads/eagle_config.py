"""An EAGLE head's configuration (EAGLE-1 and EAGLE-3): which target layers it reads, its draft
vocabulary, its decoder layer's shapes and its training defaults; the module is
``draftsmith.heads.eagle``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields

from transformers import LlamaConfig

from draftsmith.heads.artifact import check_integers
from draftsmith.targets.target import Target

VERSIONS = (1, 3)


METHOD_OF_VERSION = {1: "eagle1", 3: "eagle3"}


# defaults of the two training recipes (EAGLE-1 paper; EAGLE-3 paper and its reference code)
DEFAULT_NOISE = {1: 0.2, 3: 0.0}


DEFAULT_TTT_STEPS = 7


DEFAULT_STEP_DECAY = 0.8


DEFAULT_CE_WEIGHT = 0.1


REDUCTIONS = ("mean", "sum")


# keys of a transformers config dict that describe a checkpoint, not the layer
_CONFIG_NOISE = (
    "_name_or_path",
    "_model_name_or_path",
    "transformers_version",
    "id2label",
    "label2id",
    "dtype",
    "torch_dtype",
)


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high layers (vLLM's default): (2, L // 2, L - 3)."""
    return (2, num_layers // 2, num_layers - 3)


def _check_aux_ids(aux: Sequence[int], num_layers: int) -> tuple[int, ...]:
    aux = tuple(int(i) for i in aux)
    if (
        len(aux) != 3
        or not all(1 <= i <= num_layers - 1 for i in aux)
        or list(aux) != sorted(set(aux))
    ):
        raise ValueError(
            f"EAGLE-3 needs three distinct ascending hidden-state indices in 1..{num_layers - 1} "
            f"(inputs of decoder layers, vLLM's convention), got {list(aux)}; for a target with "
            f"{num_layers} layers pass aux_layer_ids explicitly"
        )
    return aux


@dataclass
class EagleConfig:
    """Everything needed to rebuild an EAGLE head on top of its target (saved in config.json)."""

    version: int  # 1 or 3
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # = vocab_size for EAGLE-1
    hidden_size: int  # the head's width (= the target's embedding width)
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # hidden-state indices the head reads: (L,) for EAGLE-1
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_num_layers: int  # L: index L of the hidden states is the target's final-normed feature
    # the head's one-layer Llama config (LlamaConfig.to_dict()): the shapes above, the target's
    # activation, norm epsilon, rope settings and context length; ``architectures`` names the
    # target's (the verifier of exports). Artifacts from before heads were Llama layers hold the
    # target's own config here, which loads for a Llama target.
    layer_config: dict = field(default_factory=dict)
    # speculators' variants (module docstring); draftsmith's trainer leaves them off
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    sliding_window: int | None = None  # attention reaches this many positions back, or all

    def __post_init__(self):
        if self.version not in VERSIONS or isinstance(self.version, bool):
            raise ValueError(f"EAGLE version must be 1 or 3, got {self.version!r}")
        check_integers(self, ("vocab_size", "draft_vocab_size", "hidden_size",
                              "target_hidden_size", "num_attention_heads", "num_key_value_heads",
                              "head_dim", "intermediate_size", "target_num_layers"), "EagleConfig")
        if not isinstance(self.aux_layer_ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0
                for i in self.aux_layer_ids):
            raise ValueError(f"EagleConfig.aux_layer_ids must be a list of hidden-state indices "
                             f"(integers >= 0), got {self.aux_layer_ids!r}")
        if not isinstance(self.layer_config, dict):
            raise ValueError(f"EagleConfig.layer_config must be a mapping (a Llama config), got "
                             f"{type(self.layer_config).__name__}")
        self.aux_layer_ids = tuple(self.aux_layer_ids)
        if self.version == 1 and self.draft_vocab_size != self.vocab_size:
            raise ValueError(
                "EAGLE-1 uses the target's LM head: draft_vocab_size must equal vocab_size"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in 1..{self.vocab_size} (the target's vocabulary), "
                f"got {self.draft_vocab_size}"
            )
        variant = [k for k in ("norm_before_fc", "norm_before_residual", "norm_output")
                   if not isinstance(getattr(self, k), bool)]
        if variant:
            raise ValueError(f"EagleConfig.{variant[0]} must be true or false, got "
                             f"{getattr(self, variant[0])!r}")
        if self.version == 1 and (self.norm_before_fc or self.norm_before_residual
                                  or self.norm_output):
            raise ValueError("norm_before_fc, norm_before_residual and norm_output are EAGLE-3 "
                             "variants; an EAGLE-1 head has none of them")
        if self.sliding_window is not None and (
                isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                or self.sliding_window < 1):
            raise ValueError(f"EagleConfig.sliding_window must be a positive number of positions "
                             f"or none, got {self.sliding_window!r}")
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"the head reuses the target's embedding, so hidden_size ({self.hidden_size}) must "
                f"equal target_hidden_size ({self.target_hidden_size})"
            )

    @property
    def method(self) -> str:
        return METHOD_OF_VERSION[self.version]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Hidden-state indices training needs: the inputs, plus L for the target's distribution."""
        if self.version == 1:
            return self.aux_layer_ids
        return (*self.aux_layer_ids, self.target_num_layers)

    @classmethod
    def from_target(
        cls,
        target: Target,
        version: int,
        *,
        draft_vocab_size: int | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        intermediate_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
    ) -> EagleConfig:
        """A head shaped like one of the target's layers (sizes may be overridden)."""
        if version not in VERSIONS:
            raise ValueError(f"EAGLE version must be 1 or 3, got {version!r}")
        tc = target.config
        L = target.num_layers
        if version == 1:
            if aux_layer_ids not in (None, (L,), [L]):
                raise ValueError(
                    f"EAGLE-1 reads the final-normed feature (index {L}) only; "
                    f"got aux_layer_ids={aux_layer_ids}"
                )
            aux = (L,)
            if draft_vocab_size not in (None, target.vocab_size):
                raise ValueError(
                    "EAGLE-1 has no reduced draft vocabulary; leave draft_vocab_size unset"
                )
        else:
            aux = _check_aux_ids(
                default_aux_layer_ids(L) if aux_layer_ids is None else aux_layer_ids, L
            )
        heads = int(num_attention_heads or tc.num_attention_heads)
        kv_heads = int(num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads)
        head_dim = getattr(tc, "head_dim", None) or target.hidden_size // tc.num_attention_heads
        layer = _llama_layer_config(
            tc,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            intermediate_size=int(intermediate_size or tc.intermediate_size),
            vocab_size=target.vocab_size,
        )
        return cls(
            version=version,
            vocab_size=target.vocab_size,
            draft_vocab_size=int(draft_vocab_size or target.vocab_size),
            hidden_size=target.hidden_size,
            target_hidden_size=target.hidden_size,
            aux_layer_ids=aux,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            intermediate_size=int(layer["intermediate_size"]),
            target_num_layers=L,
            layer_config=layer,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> EagleConfig:
        """From an artifact's config.json (keys such as ``method`` and ``target`` are ignored)."""
        names = {f.name for f in fields(cls)}
        # keys added since (the speculators variants) have defaults: older artifacts lack them
        required = {f.name for f in fields(cls) if f.default is MISSING
                    and f.default_factory is MISSING}
        missing = sorted(n for n in required if n not in d)
        if missing:
            raise ValueError(f"EAGLE config is missing {missing}; was it written by draftsmith?")
        return cls(**{k: v for k, v in d.items() if k in names})

    def transformers_config(self, attn_implementation: str | None = None) -> LlamaConfig:
        """The one-layer Llama config the decoder layer and its rotary tables are built from.

        Artifacts written before heads were always Llama layers hold the target's own config
        here; a Llama target's loads unchanged, another architecture's is refused.
        """
        model_type = self.layer_config.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(
                f"this EAGLE config describes a {model_type!r} decoder layer (an artifact written "
                "when heads copied the target's layer class); EAGLE heads are Llama layers now: "
                "retrain the head"
            )
        cfg = LlamaConfig.from_dict(copy.deepcopy(self.layer_config))
        if attn_implementation is not None:
            cfg._attn_implementation = attn_implementation
        return cfg


def _rope_parameters(tc) -> dict:
    """The target's rope settings as one flat ``rope_parameters`` dict (transformers 5)."""
    rope = copy.deepcopy(getattr(tc, "rope_parameters", None) or {})
    if rope and "rope_type" not in rope and all(isinstance(v, dict) for v in rope.values()):
        # one dict per layer type: the full-attention layers' (the others slide a window)
        rope = rope.get("full_attention") or next(iter(rope.values()))
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(getattr(tc, "rope_theta", None) or 10000.0)
    rope.setdefault("rope_type", "default")
    return rope


def _llama_layer_config(
    tc,
    *,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
) -> dict:
    """The head's one-layer Llama config (as a dict) for a target whose transformers config is tc.

    Shapes as given; the target's hidden size, activation, norm epsilon, rope settings and context
    length; no biases, never tied. ``architectures`` keeps the target's (what exports name as the
    verifier).
    """
    eps = getattr(tc, "rms_norm_eps", None) or getattr(tc, "layer_norm_eps", None) or 1e-6
    cfg = LlamaConfig(
        vocab_size=int(vocab_size),
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(intermediate_size),
        num_hidden_layers=1,
        num_attention_heads=int(num_attention_heads),
        num_key_value_heads=int(num_key_value_heads),
        head_dim=int(head_dim),
        hidden_act=getattr(tc, "hidden_act", None) or "silu",
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", None) or 4096),
        rms_norm_eps=float(eps),
        rope_parameters=_rope_parameters(tc),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=getattr(tc, "eos_token_id", None),
        pad_token_id=getattr(tc, "pad_token_id", None),
        architectures=list(getattr(tc, "architectures", None) or []) or None,
    )
    return {k: v for k, v in cfg.to_dict().items() if k not in _CONFIG_NOISE}
