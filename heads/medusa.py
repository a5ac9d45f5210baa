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

Also here: the held-out accuracies the static token tree is built from (:func:`rank_accuracy`,
:func:`topk_accuracy`, :func:`accuracy_metrics`), the artifact (:func:`save_medusa` /
:func:`load_medusa`, method ``"medusa"``, the tree stored in its config) and the serving layouts
(:func:`export_medusa`, :func:`load_medusa_export`):

* vLLM ``MedusaModel``: ``config.json`` (``num_heads``, ``num_hidden_layers``, ``hidden_size``,
  ``vocab_size``, ``medusa_fc_bias``, ...) and ``model.safetensors`` with
  ``blocks.{h}.layers.{j}.weight`` / ``.bias`` and ``lm_heads.{h}.weight``;
* FasterDecoding / TensorRT-LLM: ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
  ``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` with ``{h}.{j}.linear.weight``,
  ``{h}.{j}.linear.bias`` and ``{h}.{n}.weight`` (n = number of blocks: the vocabulary projection).

The tree itself (its form, how it is built and sized) is heads/medusa_tree.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from heads.artifact import load_artifact, read_artifact_config, save_artifact
from heads.medusa_tree import RankPath, check_tree, default_chain
from heads.target import Target

METHOD = "medusa"
EXPORT_FORMATS = ("vllm", "trtllm")
_TRTLLM_WEIGHTS = "medusa_lm_head.safetensors"
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
    share_lm_head: bool = False  # True: every head projects with the target's own LM head
    bias: bool = True  # the blocks' linear layers have a bias (FasterDecoding and TensorRT-LLM do)

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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MedusaConfig:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def medusa_param_counts(config: MedusaConfig) -> dict[str, int]:
    """Parameter counts without building anything.

    ``trainable``: what the heads add, train and store in the artifact; ``blocks``: the residual
    blocks; ``lm_head_copies``: a projection per head (trainable unless shared);
    ``shared_lm_head``: the target's one matrix that shared heads read instead.
    """
    h, v, k, n = config.hidden_size, config.vocab_size, config.num_heads, config.num_layers
    blocks = k * n * (h * h + (h if config.bias else 0))
    copies = k * v * h
    own = 0 if config.share_lm_head else copies
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
    """

    def __init__(self, config: MedusaConfig, lm_head: nn.Module | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            ResidualStack(config.hidden_size, config.num_layers, config.bias)
            for _ in range(config.num_heads)
        )
        self._shared: tuple[nn.Module, ...] = ()
        if config.share_lm_head:
            if lm_head is None:
                raise ValueError(
                    "these Medusa heads share the target's LM head (share_lm_head=True): pass the "
                    "target's LM head (target.lm_head), e.g. load_medusa(dir, target=target)"
                )
            self.bind_lm_head(lm_head)
        else:
            self.lm_heads = nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                for _ in range(config.num_heads)
            )
            if lm_head is not None:
                weight = self._checked_lm_weight(lm_head)
                with torch.no_grad():
                    for head in self.lm_heads:
                        head.weight.copy_(weight)
        self.to(device=device, dtype=dtype)

    @classmethod
    def from_target(cls, target: Target, num_heads: int = 4, num_layers: int = 1,
                    share_lm_head: bool = False, bias: bool = True,
                    dtype: torch.dtype | None = None) -> MedusaHeads:
        """Fresh heads for ``target``: identity blocks, projections from its LM head.

        ``dtype`` defaults to float32 for a half-precision target (master weights for training;
        accelerate autocasts the matmuls) and to the target's dtype otherwise.
        """
        if dtype is None:
            dtype = torch.float32 if target.dtype in (torch.float16, torch.bfloat16) else target.dtype
        config = MedusaConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                              num_heads=num_heads, num_layers=num_layers,
                              share_lm_head=share_lm_head, bias=bias)
        return cls(config, lm_head=target.lm_head, dtype=dtype, device=target.device)

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
        if not self.config.share_lm_head:
            raise ValueError("these heads have their own projections (share_lm_head=False)")
        self._checked_lm_weight(lm_head)
        self._shared = (lm_head,)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def lm_head_weight(self, k: int) -> torch.Tensor:
        """(V, H) projection of head k (0-based)."""
        if self.config.share_lm_head:
            return self._shared[0].weight
        return self.lm_heads[k].weight

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
        info = json.loads((Path(target.path) / "config.json").read_text()).get(
            ADAPTED_TARGET_INFO_KEY)
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
                dtype: torch.dtype | None = None) -> MedusaArtifact:
    """Read a Medusa artifact; with ``target``, check it was trained for it and bind a shared head.

    Heads land on ``device`` / in ``dtype`` (default: the target's, else CPU and stored dtype).
    """
    config, state = load_artifact(directory, METHOD)
    if target is not None:
        target.check_identity(config.get("target", {}), what=f"Medusa artifact {directory}")
        check_adapted_target(directory, config, target)
    cfg = MedusaConfig.from_dict(config)
    if cfg.share_lm_head and target is None:
        raise ValueError(
            f"the Medusa artifact {directory} shares the target's LM head (not stored in it): "
            "pass target=... to load it"
        )
    if device is None and target is not None:
        device = target.device
    stored = next(iter(state.values())).dtype if state else torch.float32
    if dtype is None:
        dtype = target.dtype if target is not None else stored
    # built in the stored dtype, so loading the weights rounds nothing
    heads = MedusaHeads(cfg, lm_head=target.lm_head if cfg.share_lm_head else None, dtype=stored)
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
    with safe_open(str(weights), framework="pt") as f:
        keys = sorted(f.keys())
        return f.get_slice(keys[0])[:1].dtype if keys else torch.float32


def _vllm_state(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    for h in range(heads.num_heads):
        for j, layer in enumerate(heads.blocks[h].layers):
            state[f"blocks.{h}.layers.{j}.weight"] = layer.weight
            if layer.bias is not None:
                state[f"blocks.{h}.layers.{j}.bias"] = layer.bias
        state[f"lm_heads.{h}.weight"] = heads.lm_head_weight(h)
    return {k: v.to(dtype) for k, v in state.items()}


def _trtllm_state(heads: MedusaHeads, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    n = heads.config.num_layers
    state = {}
    for h in range(heads.num_heads):
        for j, layer in enumerate(heads.blocks[h].layers):
            state[f"{h}.{j}.linear.weight"] = layer.weight
            # TensorRT-LLM's converter reads a bias for every block: an absent one is zero
            state[f"{h}.{j}.linear.bias"] = (
                layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features)
            )
        state[f"{h}.{n}.weight"] = heads.lm_head_weight(h)
    return {k: v.to(dtype) for k, v in state.items()}


def _write_dir(out_dir: Path, files: dict[str, dict | dict[str, torch.Tensor]]) -> Path:
    """Write config JSONs and safetensors into a temporary sibling, then rename it into place.

    An existing ``out_dir`` is replaced only when it holds nothing but files of this layout.
    """
    if out_dir.exists():
        foreign = [p.name for p in out_dir.iterdir() if p.name not in files]
        if not out_dir.is_dir() or foreign:
            raise ValueError(f"{out_dir} exists and holds other files ({foreign[:3]}); "
                             "export into a new or empty directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        for name, content in files.items():
            if name.endswith(".json"):
                (tmp / name).write_text(json.dumps(content, indent=2, sort_keys=True))
            else:
                # a shared LM head fills several slots: safetensors needs a copy in each
                tensors, seen = {}, set()
                for key, value in content.items():
                    value = value.detach().contiguous().cpu()
                    if value.data_ptr() in seen:
                        value = value.clone()
                    seen.add(value.data_ptr())
                    tensors[key] = value
                save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def export_medusa(artifact_dir: str | os.PathLike, fmt: str, out_dir: str | os.PathLike,
                  target: Target | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write the artifact in a serving layout: ``fmt`` is "vllm" or "trtllm".

    Both layouts carry one vocabulary projection per head; for heads that share the target's LM
    head, its weight is written into every slot (and vLLM is told ``original_lm_head`` so it keeps
    one copy in memory). That needs the target: pass it, or it is loaded from the artifact's
    ``base_model`` on the CPU. Weights are written in ``dtype``, by default the artifact's.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown Medusa export format {fmt!r}; use one of {EXPORT_FORMATS}")
    config = read_artifact_config(artifact_dir, METHOD)
    if target is None and config.get("share_lm_head"):
        from heads.target import load_target

        spec = config.get("base_model")
        if not spec:
            raise ValueError(f"{artifact_dir} shares the target's LM head but does not say which "
                             "target it is: pass target=...")
        target = load_target(spec, device="cpu", dtype="float32")
    if dtype is None:
        dtype = _stored_dtype(Path(artifact_dir) / "model.safetensors")
    art = load_medusa(artifact_dir, target=target, device="cpu", dtype=dtype)
    heads, cfg = art.heads, art.heads.config
    base = config.get("base_model") or config.get("target", {}).get("name")
    topk = max(max(p) for p in art.tree) + 1
    if fmt == "vllm":
        meta = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "num_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "truncated_vocab_size": cfg.vocab_size,
            "medusa_fc_bias": cfg.bias,
            "original_lm_head": cfg.share_lm_head,
            "max_paths": len(art.tree),
            "topk": topk,
            "base_model_name_or_path": base,
            "medusa_choices": [list(p) for p in art.tree],
        }
        files = {"config.json": meta, _VLLM_WEIGHTS: _vllm_state(heads, dtype)}
    else:
        meta = {
            "medusa_num_heads": cfg.num_heads,
            "medusa_num_layers": cfg.num_layers,
            "base_model_name_or_path": base,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "medusa_choices": [list(p) for p in art.tree],
        }
        files = {"config.json": meta, _TRTLLM_WEIGHTS: _trtllm_state(heads, dtype)}
    return _write_dir(Path(out_dir), files)


def _field(meta: dict, key: str, directory: Path) -> int:
    if key not in meta:
        raise ValueError(f"{directory}/config.json has no {key!r}: not a complete Medusa export")
    return int(meta[key])


def _tensor(state: dict, key: str, directory: Path) -> torch.Tensor:
    if key not in state:
        raise ValueError(f"{directory}: weight {key!r} is missing; the export is incomplete")
    return state[key]


def load_medusa_export(directory: str | os.PathLike) -> MedusaHeads:
    """Read either serving layout back into MedusaHeads (a projection per head), on the CPU."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: not an exported Medusa model")
    meta = json.loads(cfg_path.read_text())
    if (directory / _TRTLLM_WEIGHTS).is_file():
        state = load_file(str(directory / _TRTLLM_WEIGHTS))
        k = _field(meta, "medusa_num_heads", directory)
        n = _field(meta, "medusa_num_layers", directory)
        weight = _tensor(state, f"0.{n}.weight", directory)  # (V, H)
        cfg = MedusaConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0], num_heads=k,
                           num_layers=n, bias=True)
        mine = {}
        for h in range(k):
            for j in range(n):
                for part in ("weight", "bias"):
                    mine[f"blocks.{h}.layers.{j}.{part}"] = _tensor(
                        state, f"{h}.{j}.linear.{part}", directory)
            mine[f"lm_heads.{h}.weight"] = _tensor(state, f"{h}.{n}.weight", directory)
    elif (directory / _VLLM_WEIGHTS).is_file() and "method" not in meta:
        mine = load_file(str(directory / _VLLM_WEIGHTS))
        cfg = MedusaConfig(hidden_size=_field(meta, "hidden_size", directory),
                           vocab_size=_field(meta, "vocab_size", directory),
                           num_heads=_field(meta, "num_heads", directory),
                           num_layers=_field(meta, "num_hidden_layers", directory),
                           bias=any(key.endswith(".bias") for key in mine))
    else:
        raise FileNotFoundError(
            f"{directory} is neither a vLLM Medusa export ({_VLLM_WEIGHTS} with num_heads) nor a "
            f"FasterDecoding / TensorRT-LLM one ({_TRTLLM_WEIGHTS}); a draftsmith artifact is "
            "read with load_medusa"
        )
    heads = MedusaHeads(cfg, dtype=next(iter(mine.values())).dtype)
    missing, unexpected = heads.load_state_dict(mine, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match config.json (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    return heads.eval()
