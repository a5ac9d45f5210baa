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
:func:`load_medusa`, method ``"medusa"``, the tree stored in its config). The serving layouts
(vLLM <= 0.32, TensorRT-LLM, FasterDecoding) are layouts/medusa.py, the loss is
heads/medusa_loss.py, the tree's form and construction heads/medusa_tree.py.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.files.file_formats import read_json_object
from draftsmith.heads.artifact import check_integers, load_artifact, save_artifact
from draftsmith.heads.draft_vocab import (
    check_vocab_maps,
    draft_token_ids,
    target_to_draft,
)
from draftsmith.heads.medusa_tree import RankPath, check_tree, default_chain
from draftsmith.targets.target import Target

METHOD = "medusa"

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
        check_integers(self, ("hidden_size", "vocab_size", "num_heads"), "MedusaConfig")
        check_integers(self, ("num_layers",), "MedusaConfig", low=0)  # residual blocks per head
        for name in ("share_lm_head", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MedusaConfig.{name} must be true or false, got "
                                 f"{getattr(self, name)!r}")
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
    ``t2d`` (:func:`draftsmith.heads.draft_vocab.build_draft_vocab`) to build such heads; ``lm_head``, the
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
                "pass d2t and t2d (draftsmith.heads.draft_vocab.build_draft_vocab(token_counts, n))"
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

        ``d2t`` / ``t2d`` (:func:`draftsmith.heads.draft_vocab.build_draft_vocab`): heads over that draft
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
        return target_to_draft(self.t2d, target_ids, self.d2t)

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
            f"(python -m draftsmith.eval.bench --target {expected} ...), not with {target.name!r}"
        )


def load_medusa(directory: str | os.PathLike, target: Target | None = None,
                device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, *,
                allow_other_weights: bool = False) -> MedusaArtifact:
    """Read a Medusa artifact; with ``target``, check it was trained for it and bind a shared head.

    Heads land on ``device`` / in ``dtype`` (default: the target's, else CPU and stored dtype).
    ``allow_other_weights``: accept a target of the same shapes whose weights differ from the
    ones the heads were trained on (see :meth:`draftsmith.targets.target.Target.check_identity`).
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
