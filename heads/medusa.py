"""Medusa heads: K extra heads on the target's final-normed last hidden state.

Where the target's LM head reads the hidden state ``h_t`` of position t and predicts token t+1,
head k (k = 1..K) reads the same ``h_t`` and predicts token t+1+k. Each head is

    x -> n residual blocks  x + SiLU(W_j x + b_j)   (every block its own parameters)
      -> a vocabulary projection

with the blocks zero-initialised (a fresh head is the identity on ``h_t``) and the projection
initialised from the target's LM head, as in the Medusa paper. The projection is either a copy
per head (trainable, K x vocab x hidden parameters) or the target's own LM head shared by
reference (frozen, not stored in the artifact; ``share_lm_head``). :func:`medusa_param_counts`
gives both sizes.

Draft vocabulary (``draft_vocab_size`` N, as EAGLE-3 does): the heads guess among the N most
frequent target tokens of the training data only, so every head projects onto N rows instead of
the whole vocabulary (on a 49k vocabulary that projection is most of a head's cost). The
projections are then always the heads' own and trained, initialised from the target's LM-head
rows of those tokens: with ``share_lm_head`` one (N, hidden) ``lm_head`` that every head shares,
otherwise a copy per head (``lm_heads.{k}``, (N, hidden) each). The ``d2t`` / ``t2d`` buffers of
heads/draft_vocab.py map draft ids to target ids; the heads' logits are over draft ids, and
:meth:`MedusaHeads.top_tokens` turns them into target ids. ``draft_vocab_size`` None (the
default, and every artifact written before it existed) is the whole vocabulary.

Also here: the held-out accuracies the static token tree is built from (:func:`rank_accuracy`,
:func:`topk_accuracy`, :func:`accuracy_metrics`), the artifact (:func:`save_medusa` /
:func:`load_medusa`, method ``"medusa"``, the tree stored in its config) and the serving layouts
(:func:`export_medusa`, :func:`load_medusa_export`):

* ``vllm-0.32``: vLLM <= 0.32.0 ``MedusaModel`` (vLLM 0.33 has none): ``config.json``
  (``num_heads``, ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``medusa_fc_bias``,
  ``original_lm_head``, ...) and ``model.safetensors`` with ``blocks.{h}.layers.{j}.weight`` /
  ``.bias`` and ``lm_heads.{h}.weight``;
* ``trtllm`` / ``fasterdecoding``: ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
  ``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` with ``{h}.{j}.linear.weight``,
  ``{h}.{j}.linear.bias`` and ``{h}.{n}.weight`` (n = number of blocks: the vocabulary
  projection); ``fasterdecoding`` adds ``medusa_lm_head.pt`` when asked (its loader's only file).

Heads over a draft vocabulary export to ``vllm-0.32`` only, exactly: vLLM's ``MedusaModel`` reads
``truncated_vocab_size`` (= N) and a ``token_map`` tensor (int64 [N], the target id of every
draft id) and scatters each head's N logits into the full vocabulary with -inf elsewhere.
TensorRT-LLM and FasterDecoding project onto the full vocabulary with a bias-free matrix and
have no token map, and rows for the other tokens cannot keep them out of every head's top k for
every hidden state: a zero row scores 0, above any negative draft logit, and a row inside the
draft rows' convex hull stays below the best draft logit but not below the k-th. Those exports
are refused (train with ``draft_vocab_size: null`` for them).

The tree itself (its form, how it is built and sized) is heads/medusa_tree.py.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from heads.artifact import load_artifact, read_artifact_config, save_artifact
from heads.draft_vocab import (
    check_vocab_maps,
    draft_token_ids,
    maps_from_token_ids,
    target_to_draft,
)
from heads.file_formats import load_safetensors, read_json_object
from heads.medusa_tree import RankPath, check_tree, default_chain
from heads.output_dir import check_destination
from heads.target import Target

METHOD = "medusa"
_TRTLLM_WEIGHTS = "medusa_lm_head.safetensors"
_PT_WEIGHTS = "medusa_lm_head.pt"  # FasterDecoding's loader reads only this pickle
_VLLM_WEIGHTS = "model.safetensors"

# config.json block of a Medusa-2 adapted target directory (written by train/medusa.py)
ADAPTED_TARGET_INFO_KEY = "draftsmith"


@dataclass
class MedusaConfig:
    """Shapes of a set of Medusa heads (what the artifact's config.json records)."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    # True: the heads share one projection, the target's own LM head (frozen, not stored) or,
    # with draft_vocab_size, one trained (draft_vocab_size, hidden) lm_head of their own
    share_lm_head: bool = False
    bias: bool = True  # the blocks' linear layers have a bias (FasterDecoding and TensorRT-LLM do)
    draft_vocab_size: int | None = None  # guess among this many target tokens (None: all)

    def __post_init__(self):
        for name in ("hidden_size", "vocab_size", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MedusaConfig.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ValueError(
                f"MedusaConfig.num_layers (residual blocks per head) must be an integer >= 0, "
                f"got {self.num_layers!r}"
            )
        n = self.draft_vocab_size
        if n is not None and (not isinstance(n, int) or isinstance(n, bool)
                              or not 1 <= n <= self.vocab_size):
            raise ValueError(
                f"MedusaConfig.draft_vocab_size must be None (the whole vocabulary) or an integer "
                f"in 1..{self.vocab_size} (the target's vocabulary), got {n!r}"
            )

    @property
    def head_vocab_size(self) -> int:
        """How many tokens the heads' logits range over: draft_vocab_size, else vocab_size."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def reads_target_lm_head(self) -> bool:
        """The heads project with the target's LM head (not stored: loading needs the target)."""
        return self.share_lm_head and self.draft_vocab_size is None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MedusaConfig:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def medusa_param_counts(config: MedusaConfig) -> dict[str, int]:
    """Parameter counts without building anything.

    ``trainable``: what the heads add, train and store in the artifact; ``blocks``: the residual
    blocks; ``lm_head_copies``: a projection per head over the heads' vocabulary (trainable
    unless shared); ``shared_lm_head``: the one matrix shared heads read instead (the target's,
    frozen; with a draft vocabulary their own, trained).
    """
    h, v, k, n = config.hidden_size, config.head_vocab_size, config.num_heads, config.num_layers
    blocks = k * n * (h * h + (h if config.bias else 0))
    copies = k * v * h
    if not config.share_lm_head:
        own = copies
    else:
        own = 0 if config.reads_target_lm_head else v * h
    return {"blocks": blocks, "lm_head_copies": copies, "shared_lm_head": v * h,
            "trainable": blocks + own}


class ResidualStack(nn.Module):
    """n blocks x <- x + SiLU(linear_j(x)); zero-initialised, so the stack starts as the identity."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers)
        )
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K Medusa heads. ``forward(hidden (..., H)) -> logits (K, ..., V)``.

    State dict (trainable parameters only): ``blocks.{h}.layers.{j}.weight`` / ``.bias`` and,
    unless the LM head is shared, ``lm_heads.{h}.weight`` (vLLM's names). A shared LM head is held
    by reference outside the module's parameters, so it is neither trained, nor saved, nor
    wrapped for gradient sync; gradients still flow through it into the blocks.

    With a draft vocabulary (``config.draft_vocab_size`` N) V is N, the logits are over draft
    ids, and the state dict adds the ``d2t`` / ``t2d`` buffers plus the heads' own projection:
    ``lm_head.weight`` (N, H), shared, or ``lm_heads.{h}.weight`` (N, H) each. Pass ``d2t`` and
    ``t2d`` (:func:`heads.draft_vocab.build_draft_vocab`) to build such heads; ``lm_head``, the
    target's, then initialises their rows.
    """

    def __init__(self, config: MedusaConfig, lm_head: nn.Module | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None, *,
                 d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            ResidualStack(config.hidden_size, config.num_layers, config.bias)
            for _ in range(config.num_heads)
        )
        self._shared: tuple[nn.Module, ...] = ()
        draft = config.draft_vocab_size is not None
        if draft:
            d2t, t2d = self._vocab_maps(config, d2t, t2d)
            self.register_buffer("d2t", d2t.to(torch.int64).cpu().clone())
            self.register_buffer("t2d", t2d.to(torch.bool).cpu().clone())
        elif d2t is not None or t2d is not None:
            raise ValueError("d2t/t2d map a draft vocabulary: set MedusaConfig.draft_vocab_size "
                             "to its size, or pass neither")
        if config.reads_target_lm_head:
            if lm_head is None:
                raise ValueError(
                    "these Medusa heads share the target's LM head (share_lm_head=True): pass the "
                    "target's LM head (target.lm_head), e.g. load_medusa(dir, target=target)"
                )
            self.bind_lm_head(lm_head)
        else:
            size = config.head_vocab_size
            if config.share_lm_head:  # draft vocabulary: one projection of their own, shared
                self.lm_head = nn.Linear(config.hidden_size, size, bias=False)
                own = [self.lm_head]
            else:
                self.lm_heads = nn.ModuleList(
                    nn.Linear(config.hidden_size, size, bias=False)
                    for _ in range(config.num_heads)
                )
                own = list(self.lm_heads)
            if lm_head is not None:
                weight = self._checked_lm_weight(lm_head)  # (V, H)
                if draft:
                    weight = weight[draft_token_ids(self.d2t).to(weight.device)]  # (N, H)
                with torch.no_grad():
                    for head in own:
                        head.weight.copy_(weight)
        self.to(device=device, dtype=dtype)

    @staticmethod
    def _vocab_maps(config: MedusaConfig, d2t, t2d) -> tuple[torch.Tensor, torch.Tensor]:
        if d2t is None or t2d is None:
            raise ValueError(
                f"heads over a draft vocabulary of {config.draft_vocab_size} tokens need its maps: "
                "pass d2t and t2d (heads.draft_vocab.build_draft_vocab(token_counts, n))"
            )
        check_vocab_maps(d2t, t2d, config.vocab_size)
        if d2t.numel() != config.draft_vocab_size:
            raise ValueError(f"d2t has {d2t.numel()} entries, MedusaConfig.draft_vocab_size is "
                             f"{config.draft_vocab_size}")
        return d2t, t2d

    @classmethod
    def from_target(cls, target: Target, num_heads: int = 4, num_layers: int = 1,
                    share_lm_head: bool = False, bias: bool = True,
                    dtype: torch.dtype | None = None, *, d2t: torch.Tensor | None = None,
                    t2d: torch.Tensor | None = None) -> MedusaHeads:
        """Fresh heads for ``target``: identity blocks, projections from its LM head.

        ``d2t`` / ``t2d`` (:func:`heads.draft_vocab.build_draft_vocab`): heads over that draft
        vocabulary, their projection the target's rows of its tokens. ``dtype`` defaults to
        float32 for a half-precision target (master weights for training; accelerate autocasts
        the matmuls) and to the target's dtype otherwise.
        """
        if dtype is None:
            dtype = torch.float32 if target.dtype in (torch.float16, torch.bfloat16) else target.dtype
        config = MedusaConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                              num_heads=num_heads, num_layers=num_layers,
                              share_lm_head=share_lm_head, bias=bias,
                              draft_vocab_size=None if d2t is None else int(d2t.numel()))
        return cls(config, lm_head=target.lm_head, dtype=dtype, device=target.device,
                   d2t=d2t, t2d=t2d)

    def _checked_lm_weight(self, lm_head: nn.Module) -> torch.Tensor:
        weight = getattr(lm_head, "weight", None)
        want = (self.config.vocab_size, self.config.hidden_size)
        if weight is None or tuple(weight.shape) != want:
            got = None if weight is None else tuple(weight.shape)
            raise ValueError(f"the LM head's weight has shape {got}, the Medusa heads need {want}: "
                             "use the LM head of the target these heads were built for")
        return weight.detach()

    def bind_lm_head(self, lm_head: nn.Module) -> None:
        """Point a shared-projection set of heads at the target's LM head (after loading)."""
        if not self.config.reads_target_lm_head:
            raise ValueError("these heads have their own projections (share_lm_head=False, or a "
                             "draft vocabulary)")
        self._checked_lm_weight(lm_head)
        self._shared = (lm_head,)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def lm_head_weight(self, k: int) -> torch.Tensor:
        """(V, H) projection of head k (0-based); V is the draft vocabulary's size if it has one."""
        if self.config.reads_target_lm_head:
            return self._shared[0].weight
        if self.config.share_lm_head:
            return self.lm_head.weight
        return self.lm_heads[k].weight

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids of the heads' logits (draft ids with a draft vocabulary) -> target ids."""
        if self.config.draft_vocab_size is None:
            return ids
        return ids + self.d2t[ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> ids of the heads' logits; -1 where a target id has no draft id."""
        if self.config.draft_vocab_size is None:
            return target_ids
        return target_to_draft(self.t2d, target_ids)

    def draft_columns(self) -> torch.Tensor | None:
        """(N,) the target id of every draft id (None without a draft vocabulary)."""
        return None if self.config.draft_vocab_size is None else draft_token_ids(self.d2t)

    def head_states(self, hidden: torch.Tensor, num: int | None = None) -> list[torch.Tensor]:
        """hidden (..., H) -> [(..., H)] * num: the residual blocks' output of the first num heads."""
        num = self.num_heads if num is None else num
        if not 1 <= num <= self.num_heads:
            raise ValueError(f"asked for {num} heads' outputs, there are {self.num_heads}")
        dtype = self.blocks[0].layers[0].weight.dtype if self.config.num_layers else None
        x = hidden if dtype is None else hidden.to(dtype)
        return [self.blocks[k](x) for k in range(num)]

    def project(self, state: torch.Tensor, k: int) -> torch.Tensor:
        """state (..., H) -> logits (..., V) of head k (0-based)."""
        weight = self.lm_head_weight(k)
        return F.linear(state.to(weight.dtype), weight)

    def forward(self, hidden: torch.Tensor, num: int | None = None) -> torch.Tensor:
        """hidden (..., H) -> logits (num, ..., V) of the first ``num`` heads (default all K)."""
        states = self.head_states(hidden, num)
        if self.config.share_lm_head:  # one pass over the shared weight, not one per head
            weight = self.lm_head_weight(0)
            return F.linear(torch.stack(states).to(weight.dtype), weight)
        return torch.stack([self.project(s, k) for k, s in enumerate(states)])

    def top_tokens(self, hidden: torch.Tensor, k: int, num: int | None = None) -> torch.Tensor:
        """hidden (..., H) -> (num, ..., k) target ids: each head's k likeliest guesses, in order.

        With a draft vocabulary the top k is taken over the draft ids and mapped to target ids.
        """
        if not 1 <= k <= self.config.head_vocab_size:
            raise ValueError(f"asked for the top {k} guesses; the heads guess among "
                             f"{self.config.head_vocab_size} tokens")
        return self.draft_to_target(self(hidden, num).topk(k, dim=-1).indices)


# ---------------------------------------------------------------------------------------------
# held-out accuracies


def rank_accuracy(hits: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """(K, topk) probability that the true token is exactly head k's rank-r guess."""
    return hits.double() / totals.double().clamp_min(1).unsqueeze(-1)


def topk_accuracy(hits: torch.Tensor, totals: torch.Tensor, k: int) -> torch.Tensor:
    """(K,) probability that the true token is among head k's top-k guesses."""
    if not 1 <= k <= hits.shape[-1]:
        raise ValueError(f"k must be in 1..{hits.shape[-1]} (the topk the hits were counted with)")
    return hits[:, :k].sum(-1).double() / totals.double().clamp_min(1)


def accuracy_metrics(hits: torch.Tensor, totals: torch.Tensor, ks=(1, 5),
                     prefix: str = "medusa") -> dict[str, float]:
    """Flat logging dict: ``{prefix}/head{k}_top{n}`` for every head and every n in ks."""
    out = {}
    for n in ks:
        if n > hits.shape[-1]:
            continue
        for k, acc in enumerate(topk_accuracy(hits, totals, n).tolist(), start=1):
            out[f"{prefix}/head{k}_top{n}"] = acc
    return out


# ---------------------------------------------------------------------------------------------
# artifact


@dataclass
class MedusaArtifact:
    heads: MedusaHeads
    tree: list[RankPath]
    tree_info: dict  # how the tree was chosen: rank_accuracies, tree_nodes, expected_tau, ...
    config: dict  # the artifact's whole config.json


def _target_spec(target: Target) -> str:
    """What to pass to load_target to get this target back (a path, else its name)."""
    return str(target.path) if target.path is not None else target.name


def save_medusa(directory: str | os.PathLike, heads: MedusaHeads, target: Target,
                tree=None, tree_info: dict | None = None, extra: dict | None = None) -> Path:
    """Write a Medusa artifact: heads' weights, shapes, target identity, tree (``medusa_choices``).

    ``tree`` defaults to each head's top-1 chain; ``tree_info`` records how it was chosen (keep
    ``rank_accuracies`` there so the evaluator can rebuild it for another size, ``tree_nodes``).
    """
    cfg = heads.config
    if (cfg.hidden_size, cfg.vocab_size) != (target.hidden_size, target.vocab_size):
        raise ValueError(
            f"heads of hidden {cfg.hidden_size} / vocab {cfg.vocab_size} do not fit target "
            f"{target.name!r} (hidden {target.hidden_size}, vocab {target.vocab_size})"
        )
    paths = check_tree(default_chain(cfg.num_heads) if tree is None else tree, cfg.num_heads)
    config = {
        **cfg.to_dict(),
        "tree": [list(p) for p in paths],
        "tree_info": dict(tree_info or {}),
        "base_model": _target_spec(target),
        **(extra or {}),
    }
    return save_artifact(directory, METHOD, config, heads.state_dict(), target.identity())


def check_adapted_target(directory: str | os.PathLike, config: dict, target: Target) -> None:
    """Refuse to load a Medusa-2 artifact against anything but the target it was trained with.

    Medusa-2 trains the heads together with LoRA adapters on the target; the merged, adapted
    target is saved inside the artifact (config key ``adapted_target``: its ``path`` relative to
    the artifact and the ``digest`` of its weights, which its own config.json repeats under
    ``ADAPTED_TARGET_INFO_KEY``). The heads predict that model, so it is the one to verify with.
    """
    adapted = config.get("adapted_target")
    if not adapted:
        return
    expected = Path(directory) / adapted.get("path", "target")
    recorded = None
    if target.path is not None and (Path(target.path) / "config.json").is_file():
        info = read_json_object(Path(target.path) / "config.json",
                                fix="the target directory is damaged").get(ADAPTED_TARGET_INFO_KEY)
        recorded = info.get("digest") if isinstance(info, dict) else None
    if recorded is None or recorded != adapted.get("digest"):
        raise ValueError(
            f"the Medusa artifact {directory} comes from Medusa-2 training: its heads were trained "
            f"together with LoRA adapters on the target, merged into the adapted target "
            f"{expected}, and are verified against that model (decoding is then exact with "
            f"respect to the adapted model, not the original). Load it with that target "
            f"(python -m eval.bench --target {expected} ...), not with {target.name!r}"
        )


def load_medusa(directory: str | os.PathLike, target: Target | None = None,
                device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, *,
                allow_other_weights: bool = False) -> MedusaArtifact:
    """Read a Medusa artifact; with ``target``, check it was trained for it and bind a shared head.

    Heads land on ``device`` / in ``dtype`` (default: the target's, else CPU and stored dtype).
    ``allow_other_weights``: accept a target of the same shapes whose weights differ from the
    ones the heads were trained on (see :meth:`heads.target.Target.check_identity`).
    """
    config, state = load_artifact(directory, METHOD)
    if target is not None:
        # a Medusa-2 artifact records the original target and is checked against its adapted
        # copy by the digest of every weight (check_adapted_target), not by the fingerprint
        adapted = bool(config.get("adapted_target"))
        target.check_identity(config.get("target", {}), what=f"Medusa artifact {directory}",
                              allow_other_weights=allow_other_weights or adapted)
        check_adapted_target(directory, config, target)
    cfg = MedusaConfig.from_dict(config)
    if cfg.reads_target_lm_head and target is None:
        raise ValueError(
            f"the Medusa artifact {directory} shares the target's LM head (not stored in it): "
            "pass target=... to load it"
        )
    maps = {}
    if cfg.draft_vocab_size is not None:
        maps = {"d2t": state.get("d2t"), "t2d": state.get("t2d")}
        if maps["d2t"] is None or maps["t2d"] is None:
            raise ValueError(f"{directory}: its config has draft_vocab_size "
                             f"{cfg.draft_vocab_size} but its weights lack d2t/t2d; the artifact "
                             "is damaged, write it again")
    if device is None and target is not None:
        device = target.device
    floats = [v for v in state.values() if v.is_floating_point()]
    stored = floats[0].dtype if floats else torch.float32
    if dtype is None:
        dtype = target.dtype if target is not None else stored
    # built in the stored dtype, so loading the weights rounds nothing
    heads = MedusaHeads(cfg, lm_head=target.lm_head if cfg.reads_target_lm_head else None,
                        dtype=stored, **maps)
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match its config (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}); the artifact is damaged, re-export it")
    heads.to(device=device, dtype=dtype)
    paths = check_tree(config.get("tree") or default_chain(cfg.num_heads), cfg.num_heads)
    return MedusaArtifact(heads.eval(), paths, dict(config.get("tree_info") or {}), config)


# ---------------------------------------------------------------------------------------------
# serving layouts


def _stored_dtype(weights: Path) -> torch.dtype:
    """The dtype of the first floating-point tensor (d2t / t2d are integers and booleans)."""
    with safe_open(str(weights), framework="pt") as f:
        for key in sorted(f.keys()):
            dtype = f.get_slice(key)[:1].dtype
            if dtype.is_floating_point:
                return dtype
    return torch.float32


def _vllm_state(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """vLLM <= 0.32 MedusaModel names; a shared projection is loaded from lm_heads.0 only.

    A draft vocabulary adds ``token_map`` (int64 (N,), the target id of every draft id), which
    vLLM reads when ``truncated_vocab_size`` < ``vocab_size``.
    """
    state = {}
    for h in range(heads.num_heads):
        for j, layer in enumerate(heads.blocks[h].layers):
            state[f"blocks.{h}.layers.{j}.weight"] = layer.weight
            if layer.bias is not None:
                state[f"blocks.{h}.layers.{j}.bias"] = layer.bias
        if h == 0 or not heads.config.share_lm_head:
            state[f"lm_heads.{h}.weight"] = heads.lm_head_weight(h)
    state = {k: v.to(dtype) for k, v in state.items()}
    columns = heads.draft_columns()
    if columns is not None:
        state["token_map"] = columns.to(torch.int64)
    return state


def _trtllm_state(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """FasterDecoding / TensorRT-LLM names: {h}.{j}.linear.weight|bias, {h}.{n}.weight."""
    n = heads.config.num_layers
    state = {}
    for h in range(heads.num_heads):
        for j, layer in enumerate(heads.blocks[h].layers):
            state[f"{h}.{j}.linear.weight"] = layer.weight
            # both loaders read a bias for every block (nn.Linear's default): an absent one is 0
            state[f"{h}.{j}.linear.bias"] = (
                layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features)
            )
        state[f"{h}.{n}.weight"] = heads.lm_head_weight(h)
    return {k: v.to(dtype) for k, v in state.items()}


# FasterDecoding/Medusa (main, commit e2a5d20) builds this many heads whatever config.json says
FASTERDECODING_HEADS = 5
FASTERDECODING_BASE_TYPES = ("llama", "mistral")


def _check_fasterdecoding(cfg: MedusaConfig, target_type: str | None, write_pt: bool) -> None:
    if cfg.num_layers > 1:
        raise ValueError(
            f"these heads have {cfg.num_layers} distinct residual blocks, but FasterDecoding's "
            "MedusaModel builds a head as [ResBlock(h)] * medusa_num_layers, one block object "
            "repeated, so its blocks share one weight: it cannot hold these heads. Use "
            "--format trtllm (TensorRT-LLM loads every block) or --format vllm-0.32"
        )
    if target_type is not None and target_type not in FASTERDECODING_BASE_TYPES:
        raise ValueError(
            f"FasterDecoding/Medusa serves only {' and '.join(FASTERDECODING_BASE_TYPES)} base "
            f"models, and these heads are for a {target_type!r} target: use --format trtllm"
        )
    if not write_pt:
        raise ValueError(
            "FasterDecoding's MedusaModel.from_pretrained reads only medusa_lm_head.pt, a pickle "
            "(torch.load); draftsmith writes one only when asked: add --write-pt. It holds a "
            "plain dict of tensors (loadable with torch.load(weights_only=True)); "
            "medusa_lm_head.safetensors beside it carries the same weights"
        )


def export_medusa(artifact_dir: str | os.PathLike, fmt: str, out_dir: str | os.PathLike,
                  target: Target | None = None, dtype: torch.dtype | None = None, *,
                  base_model: str | None = None, write_pt: bool = False,
                  overwrite: bool = False) -> Path:
    """Write the artifact in a serving layout: ``fmt`` is "trtllm", "fasterdecoding" or "vllm-0.32".

    * trtllm: config.json (medusa_num_heads, medusa_num_layers, base_model_name_or_path,
      medusa_choices) + medusa_lm_head.safetensors; TensorRT-LLM's converter takes the head count
      as a flag (:func:`trtllm_convert_command`).
    * fasterdecoding: the same files plus, with ``write_pt``, medusa_lm_head.pt (torch.save of a
      plain dict of tensors), the only file FasterDecoding's loader reads. One residual block per
      head at most; ``base_model_name_or_path`` must be a hub id (``base_model`` or recorded).
    * vllm-0.32: vLLM <= 0.32.0's MedusaModel (config.json with num_heads, num_hidden_layers,
      medusa_fc_bias, original_lm_head; model.safetensors). vLLM 0.33 has no Medusa model.

    Heads that share the target's LM head get its weight in every slot (vllm-0.32: in lm_heads.0,
    with original_lm_head). That needs the target: pass it, or it is loaded from the artifact's
    ``base_model``. Weights are written in ``dtype``, by default the artifact's.

    Heads over a draft vocabulary (``draft_vocab_size``) export to vllm-0.32 only: their (N, H)
    projections, ``truncated_vocab_size`` N and ``token_map`` (int64 (N,) target ids), which
    vLLM scatters back into the full vocabulary with -inf elsewhere, so the export proposes
    exactly the artifact's tokens. trtllm and fasterdecoding are refused (see the module
    docstring).
    """
    from heads.export import check_format, resolve_hub_id, write_export

    check_format(METHOD, fmt)
    config = read_artifact_config(artifact_dir, METHOD)
    check_destination(out_dir, kind="export", overwrite=overwrite, protect=[artifact_dir])
    hub_id = resolve_hub_id(config, base_model, "--base-model")
    cfg = MedusaConfig.from_dict(config)
    if cfg.draft_vocab_size is not None and fmt != "vllm-0.32":
        raise ValueError(
            f"these heads guess over a draft vocabulary (draft_vocab_size {cfg.draft_vocab_size} "
            f"of the target's {cfg.vocab_size} tokens), and {fmt} projects every head onto the "
            "full vocabulary with no bias and no token map, so no export to it can rank the "
            "tokens as these heads do. Export with --format vllm-0.32 (vLLM's MedusaModel maps "
            "the draft vocabulary through token_map, exactly), or train with draft_vocab_size: "
            "null for TensorRT-LLM and FasterDecoding"
        )
    if fmt == "fasterdecoding":
        _check_fasterdecoding(cfg, (config.get("target") or {}).get("model_type"), write_pt)
        if hub_id is None:
            raise ValueError(
                "FasterDecoding loads the base model named by base_model_name_or_path, and this "
                f"artifact's target {(config.get('target') or {}).get('name')!r} has no hub id "
                "recorded: pass --base-model ORG/NAME"
            )
    if target is None and cfg.reads_target_lm_head:
        from heads.target import load_target

        spec = config.get("base_model")
        if not spec:
            raise ValueError(f"{artifact_dir} shares the target's LM head but does not say which "
                             "target it is: pass target=...")
        target = load_target(spec, device="cpu", dtype="float32")
    if dtype is None:
        dtype = _stored_dtype(Path(artifact_dir) / "model.safetensors")
    art = load_medusa(artifact_dir, target=target, device="cpu", dtype=dtype)
    heads = art.heads
    choices = [list(p) for p in art.tree]
    if fmt == "vllm-0.32":
        meta = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "num_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "truncated_vocab_size": cfg.head_vocab_size,  # < vocab_size: token_map is read
            "medusa_fc_bias": cfg.bias,
            "original_lm_head": cfg.share_lm_head,
            "max_paths": len(art.tree),
            "topk": max(max(p) for p in art.tree) + 1,
            "medusa_choices": choices,
        }
        files = {"config.json": meta, _VLLM_WEIGHTS: _vllm_state(heads, dtype)}
    else:
        meta = {
            "medusa_num_heads": cfg.num_heads,
            "medusa_num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "medusa_choices": choices,
        }
        files = {"config.json": meta, _TRTLLM_WEIGHTS: _trtllm_state(heads, dtype)}
    if hub_id is not None:
        meta["base_model_name_or_path"] = hub_id
    meta["draftsmith"] = {"method": METHOD, "target": config.get("target") or {},
                          "format_version": config.get("format_version")}
    out = write_export(out_dir, files, source=artifact_dir, fmt=fmt, overwrite=overwrite)
    if fmt == "fasterdecoding":
        _add_pickle(out, files[_TRTLLM_WEIGHTS])
    return out


def _add_pickle(out: Path, state: dict[str, torch.Tensor]) -> None:
    """medusa_lm_head.pt beside the safetensors file: torch.save of plain CPU tensors, 0644."""
    tmp = out / (_PT_WEIGHTS + ".tmp")
    torch.save({k: v.detach().contiguous().cpu().clone() for k, v in state.items()}, tmp)
    os.chmod(tmp, 0o644)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out / _PT_WEIGHTS)


def trtllm_convert_command(export_dir: str | os.PathLike, base_model_dir: str | None = None,
                           dtype: str = "float16") -> str:
    """TensorRT-LLM's examples/medusa/convert_checkpoint.py command for an export.

    Its converter takes ``--num_medusa_heads`` (default 4) from the command line, not from
    config.json, and writes ``--num_medusa_layers`` into the engine config before reading the
    export's config, so both are passed; ``--max_medusa_token_len`` (default 63) must cover the
    tree's nodes, and a Qwen2 or Mixtral base needs ``--model_type``.
    """
    directory = Path(export_dir)
    meta = json.loads((directory / "config.json").read_text())
    target_type = (meta.get("draftsmith") or {}).get("target", {}).get("model_type")
    base = base_model_dir or "<the target's Hugging Face directory>"
    parts = [
        "python examples/medusa/convert_checkpoint.py",
        f"--model_dir {base}",
        f"--medusa_model_dir {directory}",
        f"--output_dir {directory}-trtllm-ckpt",
        f"--dtype {dtype}",
        f"--num_medusa_heads {int(meta['medusa_num_heads'])}",
        f"--num_medusa_layers {int(meta['medusa_num_layers'])}",
        f"--max_medusa_token_len {max(63, len(meta.get('medusa_choices') or []))}",
    ]
    if target_type in ("qwen2", "mixtral"):
        parts.append(f"--model_type {target_type}")
    return " ".join(parts)


def medusa_export_notes(export_dir: str | os.PathLike, fmt: str) -> list[str]:
    """What a user must know to serve a Medusa export (printed by ``python -m heads.export``)."""
    directory = Path(export_dir)
    meta = json.loads((directory / "config.json").read_text())
    notes = []
    if fmt == "trtllm":
        notes.append("TensorRT-LLM ignores medusa_num_heads in config.json; convert with:")
        notes.append("  " + trtllm_convert_command(directory))
        notes.append(f"  and run with --medusa_choices \"{meta.get('medusa_choices')}\"")
    if fmt == "fasterdecoding":
        k = int(meta["medusa_num_heads"])
        if k != FASTERDECODING_HEADS:
            notes.append(
                f"FasterDecoding's MedusaModel.from_pretrained builds {FASTERDECODING_HEADS} heads "
                f"whatever config.json says and loads medusa_lm_head.pt with strict=False: "
                + (f"heads {k}..{FASTERDECODING_HEADS - 1} stay untrained, so pass "
                   f"medusa_choices no deeper than {k}" if k < FASTERDECODING_HEADS
                   else f"heads {FASTERDECODING_HEADS}..{k - 1} are dropped")
                + " (this export's tree: medusa_choices in config.json)"
            )
    if fmt == "vllm-0.32":
        notes.append("vLLM 0.32.0 was the last release with MedusaModel; vLLM 0.33 cannot load it")
    return notes


def _field(meta: dict, key: str, directory: Path, default: int | None = None) -> int:
    if key not in meta:
        if default is not None:
            return default
        raise ValueError(f"{directory}/config.json has no {key!r}: not a complete Medusa export")
    return int(meta[key])


def _tensor(state: dict, key: str, directory: Path) -> torch.Tensor:
    if key not in state:
        raise ValueError(f"{directory}: weight {key!r} is missing; the export is incomplete")
    return state[key]


_NUMBERED = re.compile(r"(\d+)\.(\d+)\.(linear\.)?(weight|bias)")


def _from_numbered(state: dict[str, torch.Tensor], num_layers: int, directory: Path):
    """FasterDecoding / TensorRT-LLM names -> (num_heads, our state dict with lm_heads.{h})."""
    odd = [k for k in state if not _NUMBERED.fullmatch(k.removeprefix("medusa_heads."))]
    if odd:
        raise ValueError(f"{directory}: weights {odd[:4]} are not Medusa head weights "
                         "({h}.{j}.linear.weight|bias, {h}.{n}.weight)")
    state = {k.removeprefix("medusa_heads."): v for k, v in state.items()}
    heads = sorted({int(k.split(".")[0]) for k in state if k.endswith(f".{num_layers}.weight")})
    if heads != list(range(len(heads))) or not heads:
        raise ValueError(f"{directory}: vocabulary projections {{h}}.{num_layers}.weight found "
                         f"for heads {heads}; expected 0..K-1 (medusa_num_layers {num_layers})")
    mine = {}
    for h in heads:
        for j in range(num_layers):
            mine[f"blocks.{h}.layers.{j}.weight"] = _tensor(state, f"{h}.{j}.linear.weight",
                                                            directory)
            if f"{h}.{j}.linear.bias" in state:
                mine[f"blocks.{h}.layers.{j}.bias"] = state[f"{h}.{j}.linear.bias"]
        mine[f"lm_heads.{h}.weight"] = state[f"{h}.{num_layers}.weight"]
    return len(heads), mine


def _vllm_draft_vocabulary(meta: dict, token_map: torch.Tensor | None,
                           mine: dict[str, torch.Tensor], directory: Path):
    """vLLM's truncated vocabulary -> (d2t, t2d), the projections cut and ordered to match.

    vLLM uses ``token_map`` (the target id of every draft row) only when
    ``truncated_vocab_size`` < ``vocab_size``, and then cuts projections of the full vocabulary
    to its rows; draftsmith's draft ids follow ascending target ids, so the rows are sorted by
    target id (the same tokens, the same logits). Returns None for a full-vocabulary export.
    """
    vocab = meta.get("vocab_size")
    truncated = meta.get("truncated_vocab_size", vocab)
    if vocab is None or truncated is None or int(truncated) >= int(vocab):
        return None
    if token_map is None:
        raise ValueError(f"{directory}: truncated_vocab_size {truncated} < vocab_size {vocab} "
                         "but the weights have no token_map, so the draft rows cannot be mapped "
                         "to target ids; the export is incomplete")
    token_map = token_map.to(torch.int64).reshape(-1)
    if token_map.numel() != int(truncated):
        raise ValueError(f"{directory}: token_map has {token_map.numel()} entries, "
                         f"truncated_vocab_size is {truncated}")
    order = torch.argsort(token_map)
    for key in [key for key in mine if key.startswith("lm_heads.")]:
        rows = mine[key]
        if rows.shape[0] > token_map.numel():  # the full vocabulary: vLLM keeps the mapped rows
            rows = rows[token_map]
        mine[key] = rows[order]
    return maps_from_token_ids(token_map[order], int(vocab))


def load_medusa_export(directory: str | os.PathLike) -> MedusaHeads:
    """Read a Medusa serving layout back into MedusaHeads (a projection per head), on the CPU.

    trtllm / fasterdecoding (medusa_lm_head.safetensors) and vllm-0.32 (model.safetensors with
    num_heads). The head count is taken from the weights (FasterDecoding's published configs
    sometimes name another). A vLLM export with a truncated vocabulary (``token_map``) gives
    heads over that draft vocabulary. A directory with only medusa_lm_head.pt is refused:
    draftsmith never loads pickles; the message gives the one-line conversion.
    """
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not an exported Medusa model")
    fix = "the export is damaged or incomplete: export or download it again"
    meta = read_json_object(cfg_path, fix=fix)
    if "method" in meta:
        raise FileNotFoundError(f"{directory} is a draftsmith artifact, read with load_medusa")
    shared, draft = False, None
    if (directory / _TRTLLM_WEIGHTS).is_file():
        state = load_safetensors(directory / _TRTLLM_WEIGHTS, fix=fix)
        n = _field(meta, "medusa_num_layers", directory, default=1)
        k, mine = _from_numbered(state, n, directory)
    elif (directory / _VLLM_WEIGHTS).is_file() and any(
            key in meta for key in ("num_heads", "medusa_num_heads")):
        state = load_safetensors(directory / _VLLM_WEIGHTS, fix=fix)
        token_map = state.pop("token_map", None)
        n = _field(meta, "num_hidden_layers" if "num_hidden_layers" in meta
                   else "medusa_num_layers", directory, default=1)
        if any(_NUMBERED.fullmatch(key.removeprefix("medusa_heads.")) for key in state):
            k, mine = _from_numbered(state, n, directory)  # vLLM also reads FasterDecoding names
        else:
            mine = dict(state)
            k = _field(meta, "num_heads" if "num_heads" in meta else "medusa_num_heads",
                       directory)
            shared = bool(meta.get("original_lm_head"))  # one projection shared by every head
        draft = _vllm_draft_vocabulary(meta, token_map, mine, directory)
    elif (directory / _PT_WEIGHTS).is_file():
        raise ValueError(
            f"{directory} holds its heads only as {_PT_WEIGHTS}, a pickle, which draftsmith never "
            "loads. Convert it once where you trust the file: python -c \"import torch; "
            "from safetensors.torch import save_file; save_file({k: v.contiguous() for k, v in "
            f"torch.load('{directory / _PT_WEIGHTS}', weights_only=True).items()}}, "
            f"'{directory / _TRTLLM_WEIGHTS}')\""
        )
    else:
        raise FileNotFoundError(
            f"{directory} is neither a vLLM Medusa export ({_VLLM_WEIGHTS} with num_heads) nor a "
            f"FasterDecoding / TensorRT-LLM one ({_TRTLLM_WEIGHTS}); a draftsmith artifact is "
            "read with load_medusa"
        )
    weight = _tensor(mine, "lm_heads.0.weight", directory)  # (V, H), or (N, H) over a draft
    maps, vocab = {}, int(weight.shape[0])
    if draft is not None:
        maps = dict(zip(("d2t", "t2d"), draft, strict=True))
        vocab = int(draft[1].numel())
    if shared and draft is not None:  # the heads' own projection, shared: lm_head.weight
        mine["lm_head.weight"] = weight
        for key in [key for key in mine if key.startswith("lm_heads.")]:
            del mine[key]  # vLLM reads lm_heads.0 alone when original_lm_head
    elif shared:  # the target's LM head in one slot: a copy for every head
        mine.update({f"lm_heads.{h}.weight": weight for h in range(k)})
    cfg = MedusaConfig(hidden_size=int(weight.shape[1]), vocab_size=vocab, num_heads=k,
                       num_layers=n, bias=any(key.endswith(".bias") for key in mine),
                       share_lm_head=shared and draft is not None,
                       draft_vocab_size=None if draft is None else int(weight.shape[0]))
    heads = MedusaHeads(cfg, dtype=weight.dtype, **maps)
    mine.update(maps)
    expected = heads.state_dict()
    for key, value in mine.items():
        if key in expected and tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(f"{directory}: {key} has shape {tuple(value.shape)}, heads of hidden "
                             f"{cfg.hidden_size} / vocab {cfg.vocab_size} need "
                             f"{tuple(expected[key].shape)}")
    missing, unexpected = heads.load_state_dict(mine, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match config.json (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    return heads.eval()


def export_tree(directory: str | os.PathLike, num_heads: int) -> list[RankPath]:
    """An export's tree: its ``medusa_choices`` (cut to the heads it has), else each head's top-1."""
    meta = read_json_object(Path(directory) / "config.json",
                            fix="the export is damaged: export or download it again")
    choices = meta.get("medusa_choices")
    if not choices:
        return default_chain(num_heads)
    kept = [p for p in choices if isinstance(p, (list, tuple)) and 0 < len(p) <= num_heads]
    return check_tree(kept or default_chain(num_heads), num_heads)
