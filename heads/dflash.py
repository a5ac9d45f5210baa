"""Block drafts: DFlash, and DSpark (DFlash with a Markov head and a confidence head).

A block draft proposes a whole block of tokens in one forward pass. It reads the target's hidden
states at a few layers (``target_layer_ids``, counted as z-lab's DFlash does: id k is the output
of decoder layer k, transformers' ``hidden_states[k + 1]``), concatenates them per position and
fuses them (``fc``, then ``hidden_norm``) into one context vector per committed position. Its N
Qwen3-style decoder layers (per-head q/k RMS norms, SwiGLU, rotary positions) run over the block
only: the block is ``[anchor, MASK, ..., MASK]`` (B tokens, embedded with the target's frozen
embedding) at positions p .. p + B - 1, where the anchor is the last token the target emitted
(it has not processed it yet). Every layer projects the fused context with its own k/v
projections ("KV injection": the context does not run through the layers), and the block's
queries attend to the context positions before the anchor and to the whole block, both ways.
The last norm and an LM head (the target's, shared and frozen; or, with a draft vocabulary, a
(N, H) head of its own and the ``d2t``/``t2d`` maps of heads/draft_vocab.py) give the logits.

* **DFlash** (z-lab's layout, what llama.cpp's ``draft-dflash`` and vLLM's ``dflash`` read):
  slot j >= 1 predicts the token at position p + j ("in place"); slot 0 (the anchor) predicts
  nothing, so a block of B gives B - 1 draft tokens.
* **DSpark** (``sample_from_anchor``): slot j >= 0 predicts the token at p + j + 1, so B slots
  give B drafts, and a low-rank **Markov head** adds ``markov_w2 @ markov_w1[previous token]`` to
  slot j's logits (the previous token: the anchor for slot 0, else slot j - 1's token), so the
  block's distribution is sampled left to right; a **confidence head** ``sigmoid(proj([h_j;
  markov_w1[previous]]))`` estimates whether slot j's token will be accepted given the ones
  before it were, and drafting stops at the first slot below a threshold.

The draft's own precision never touches exactness: the engine verifies every block against the
target (eval/dflash.py). The loss is heads/dflash_loss.py; the layouts vLLM, SGLang, speculators
and llama.cpp load are layouts/dflash.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from draftsmith.heads.artifact import load_artifact, save_artifact
from draftsmith.heads.draft_vocab import check_vocab_maps
from draftsmith.targets.target import FrozenParts, Target

METHODS = ("dflash", "dspark")
DEFAULT_BLOCK_SIZE = 8
DEFAULT_LAYERS = 2
DEFAULT_MARKOV_RANK = 64
# the most tokens a block may hold: published DFlash drafts use 16, acceptance never reaches this
# far, and each round's tensors grow with the block (a hand-edited 10**9 would allocate gigabytes)
MAX_BLOCK_SIZE = 64


class ConfigValueError(ValueError):
    """A block draft's config value of the wrong type or out of range; whoever read it from a
    file says which (:meth:`DFlashConfig.from_dict`, ``draftsmith.eval.dflash.BlockProposer``)."""


def _check_integer(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or \
            (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise ConfigValueError(f"{name} must be an integer {span}, got {value!r}")


def default_target_layer_ids(target_layers: int, count: int) -> tuple[int, ...]:
    """z-lab's choice: ``count`` ids spread evenly from 1 to L - 3 (the middle one for a single
    tap); never the last layer (llama.cpp cannot read it, transformers' is post-norm)."""
    top = max(0, target_layers - 3)
    if count == 1:
        return (target_layers // 2,)
    low = min(1, top)
    ids = sorted({int(round(low + i * (top - low) / (count - 1))) for i in range(count)})
    return tuple(ids)


def check_target_layer_ids(ids, target_layers: int) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or any(
            isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ConfigValueError(f"target_layer_ids must be a list of integer layer ids, got "
                               f"{ids!r}")
    ids = tuple(ids)
    if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] > target_layers - 2:
        raise ConfigValueError(
            f"target_layer_ids {list(ids)} must be ascending layer ids in 0..{target_layers - 2} "
            f"(the output of decoder layer k, not the last layer) for a target with "
            f"{target_layers} layers")
    return ids


@dataclass
class DFlashConfig:
    """Shapes and settings of a block draft (what its artifact's config.json records)."""

    method: str  # "dflash" or "dspark"
    vocab_size: int  # the target's
    hidden_size: int  # the target's (llama.cpp reads the fused context at the target's width)
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    target_num_layers: int
    mask_token_id: int
    block_size: int = DEFAULT_BLOCK_SIZE
    draft_vocab_size: int | None = None  # None: the target's LM head, shared and frozen
    markov_rank: int = 0  # DSpark: the Markov head's rank (0 for DFlash)
    confidence_head: bool = False  # DSpark: a confidence head
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigValueError(f"block draft method {self.method!r}: choose one of {METHODS}")
        _check_integer("target_num_layers", self.target_num_layers, 1)
        self.target_layer_ids = check_target_layer_ids(self.target_layer_ids,
                                                       self.target_num_layers)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            _check_integer(f"DFlashConfig.{name}", getattr(self, name), 1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigValueError(f"num_key_value_heads {self.num_key_value_heads} must "
                                   f"divide num_attention_heads {self.num_attention_heads}")
        _check_integer("max_position_embeddings", self.max_position_embeddings, 2)
        # a block never holds more tokens than positions exist, nor more than MAX_BLOCK_SIZE
        _check_integer("block_size", self.block_size, 2,
                       min(MAX_BLOCK_SIZE, self.max_position_embeddings))
        _check_integer("mask_token_id", self.mask_token_id, 0)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigValueError(f"mask_token_id {self.mask_token_id} is outside the "
                                   f"vocabulary 0..{self.vocab_size - 1}")
        n = self.draft_vocab_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)
                              or not 1 <= n <= self.vocab_size):
            raise ConfigValueError(f"draft_vocab_size must be None or in 1..{self.vocab_size}, "
                                   f"got {n!r}")
        _check_integer("markov_rank", self.markov_rank, 0)
        if not isinstance(self.confidence_head, bool):
            raise ConfigValueError(f"confidence_head must be true or false, got "
                                   f"{self.confidence_head!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or value <= 0:
                raise ConfigValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.hidden_act, str):
            raise ConfigValueError(f"hidden_act must be an activation's name, got "
                                   f"{self.hidden_act!r}")
        if self.method == "dspark" and self.markov_rank < 1:
            raise ConfigValueError("a DSpark draft has a Markov head: markov_rank must be >= 1")
        if self.method == "dflash" and (self.markov_rank or self.confidence_head):
            raise ConfigValueError("a DFlash draft has no Markov or confidence head (that is "
                                   "DSpark: method dspark)")

    @property
    def sample_from_anchor(self) -> bool:
        """DSpark's layout: slot j predicts p + j + 1 (DFlash's: slot j >= 1 predicts p + j)."""
        return self.method == "dspark"

    @property
    def drafts_per_block(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def head_vocab_size(self) -> int:
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def hidden_states_read(self) -> tuple[int, ...]:
        """transformers' ``hidden_states`` indices of the target the draft reads."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict, source: str | os.PathLike | None = None) -> DFlashConfig:
        """The config a ``config.json`` records; a missing or wrong value is a ValueError naming
        ``source`` (the file) and the key, raised before anything is built from it."""
        names = {f.name for f in fields(cls)}
        where = source or "the block draft's config.json"
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as err:  # a key missing
            missing = sorted(f.name for f in fields(cls) if f.name not in data)
            raise ValueError(f"{where}: no {', '.join(missing) or 'valid keys'} ({err}); the file "
                             "is damaged or hand-edited: write it again by training") from err
        except ConfigValueError as err:
            raise ValueError(f"{where}: {err} (the file is damaged or hand-edited: write it "
                             "again by training, or fix that key)") from err

    @classmethod
    def from_target(cls, target: Target, method: str = "dflash", *,
                    num_layers: int = DEFAULT_LAYERS, block_size: int = DEFAULT_BLOCK_SIZE,
                    target_layer_ids=None, mask_token_id: int | None = None,
                    draft_vocab_size: int | None = None, markov_rank: int | None = None,
                    confidence_head: bool | None = None,
                    intermediate_size: int | None = None) -> DFlashConfig:
        """A draft shaped like the target's layers (its width, heads, head_dim, rope theta)."""
        tc = target.config
        heads = int(tc.num_attention_heads)
        head_dim = int(getattr(tc, "head_dim", None) or target.hidden_size // heads)
        ids = (default_target_layer_ids(target.num_layers, max(num_layers, 2))
               if target_layer_ids is None else tuple(target_layer_ids))
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = float(theta or getattr(tc, "rope_theta", None) or 10000.0)
        dspark = method == "dspark"
        return cls(
            method=method, vocab_size=target.vocab_size, hidden_size=target.hidden_size,
            intermediate_size=int(intermediate_size or tc.intermediate_size),
            num_hidden_layers=num_layers, num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=head_dim, target_layer_ids=ids, target_num_layers=target.num_layers,
            mask_token_id=default_mask_token(target) if mask_token_id is None else mask_token_id,
            block_size=block_size, draft_vocab_size=draft_vocab_size,
            markov_rank=(DEFAULT_MARKOV_RANK if markov_rank is None else markov_rank)
            if dspark else 0,
            confidence_head=(True if confidence_head is None else confidence_head)
            if dspark else False,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", None) or 1e-6), rope_theta=theta,
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", None) or 4096),
            hidden_act=getattr(tc, "hidden_act", None) or "silu")

    def layer_config(self) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            hidden_act=self.hidden_act, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            attention_bias=False, tie_word_embeddings=False, use_sliding_window=False)


def default_mask_token(target: Target) -> int:
    """The mask token: the tokenizer's own mask or unknown token, else its highest special id
    that is none of BOS, EOS and padding (a rarely seen row of the frozen embedding), else the
    last id of the vocabulary."""
    tok = target.tokenizer
    for name in ("mask_token_id", "unk_token_id"):
        value = getattr(tok, name, None) if tok is not None else None
        if value is not None and 0 <= int(value) < target.vocab_size:
            return int(value)
    reserved = {getattr(tok, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id")}
    reserved |= set(target.eos_token_ids)
    special = sorted(int(i) for i in (getattr(tok, "all_special_ids", None) or [])
                     if i not in reserved and 0 <= int(i) < target.vocab_size)
    return special[-1] if special else target.vocab_size - 1


class MarkovHead(nn.Module):
    """DSpark's low-rank transition: a bias over the draft vocabulary from the previous token."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # a fresh DSpark draft drafts as DFlash does

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(previous))  # (..., draft_vocab)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1)

    def forward(self, hidden: torch.Tensor, previous_code: torch.Tensor) -> torch.Tensor:
        """The logit of acceptance (apply a sigmoid for the probability), (...,)."""
        return self.proj(torch.cat([hidden, previous_code.to(hidden.dtype)], dim=-1))[..., 0]


class DFlashDraft(nn.Module):
    """A DFlash or DSpark draft on top of a target; see the module docstring.

    ``DFlashDraft(config, target, d2t=None, t2d=None, dtype=None)``. Inference: :meth:`context`
    turns the target's hidden states at committed positions into each layer's keys and values
    (kept between rounds), :meth:`block` runs a block over them. Training: the same two calls
    over whole sequences with the mask of :func:`block_mask`.
    """

    def __init__(self, config: DFlashConfig, target: Target, d2t: torch.Tensor | None = None,
                 t2d: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if (config.vocab_size, config.target_num_layers) != (target.vocab_size,
                                                             target.num_layers) or \
                config.hidden_size != target.hidden_size:
            raise ValueError(
                f"this {config.method} draft is for a target of {config.target_num_layers} layers, "
                f"hidden {config.hidden_size}, vocabulary {config.vocab_size}; {target.name!r} "
                f"has {target.num_layers}, {target.hidden_size}, {target.vocab_size}")
        self.config = config
        layer_config = config.layer_config()
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(layer_config, layer_idx=i)
                                    for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        n = config.head_vocab_size
        if config.draft_vocab_size is not None:
            check_vocab_maps(d2t, t2d, config.vocab_size)
            if d2t.numel() != n:
                raise ValueError(f"d2t has {d2t.numel()} entries for draft_vocab_size {n}")
            self.lm_head = nn.Linear(h, n, bias=False)
            self.register_buffer("d2t", d2t.to(torch.int64).clone())
            self.register_buffer("t2d", t2d.to(torch.bool).clone())
            with torch.no_grad():
                rows = torch.arange(n) + self.d2t.cpu()
                self.lm_head.weight.copy_(target.lm_head.weight.detach()[rows.to(
                    target.lm_head.weight.device)].to(self.lm_head.weight))
        if config.markov_rank:
            self.markov_head = MarkovHead(config.vocab_size, n, config.markov_rank)
        if config.confidence_head:
            self.confidence_head = ConfidenceHead(h, config.markov_rank)
        self.frozen = FrozenParts(embed=target.embed, lm_head=target.lm_head,
                                  rotary=Qwen3RotaryEmbedding(layer_config))
        if dtype is not None or target.dtype is not None:
            self.to(device=target.device, dtype=dtype or target.dtype)
        self.frozen.rotary.to(target.device)

    # -- shapes and maps

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def logit_weight(self) -> torch.Tensor:
        """(N, H): the rows the draft's logits are taken over."""
        if self.config.draft_vocab_size is None:
            return self.frozen.lm_head.weight
        return self.lm_head.weight

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        if self.config.draft_vocab_size is None:
            return ids
        return ids + self.d2t[ids]

    def draft_columns(self) -> torch.Tensor | None:
        """The target id of every draft row (None: the whole vocabulary)."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.config.head_vocab_size, device=self.d2t.device) + self.d2t

    # -- the forward pass

    def _rope(self, x: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.frozen.rotary(x, positions)
        return cos.to(x.dtype), sin.to(x.dtype)

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
        """Each layer's (keys, values) of committed positions: features (B, S, L * H) the target's
        hidden states at ``target_layer_ids`` concatenated, positions (B, S) ->
        [(k, v) (B, kv_heads, S, head_dim) per layer]."""
        fused = self.hidden_norm(self.fc(features.to(self.dtype)))  # (B, S, H)
        cos, sin = self._rope(fused, positions)
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            shape = (*fused.shape[:-1], -1, attn.head_dim)
            k = attn.k_norm(attn.k_proj(fused).view(shape)).transpose(1, 2)
            v = attn.v_proj(fused).view(shape).transpose(1, 2)
            k = (k * cos[:, None]) + (_rotate_half(k) * sin[:, None])
            out.append((k, v))
        return out

    def block(self, block_ids: torch.Tensor, positions: torch.Tensor, context: list[tuple],
              allowed: torch.Tensor, *, gradient_checkpointing: bool = False) -> torch.Tensor:
        """The final-normed hidden states of block tokens.

        block_ids, positions (B, M): the blocks' tokens (anchors and mask tokens) and positions;
        context: :meth:`context` over S positions; allowed (B or 1, M, S + M) bool: which context
        and block keys each block query sees. ``gradient_checkpointing``: keep each layer's
        input only and recompute the layer in backward. -> (B, M, H).
        """
        x = self.frozen.embed(block_ids).to(self.dtype)  # (B, M, H)
        cos, sin = self._rope(x, positions)
        mask = allowed[:, None]  # (B, 1, M, S + M)
        recompute = gradient_checkpointing and torch.is_grad_enabled()
        for layer, (ctx_k, ctx_v) in zip(self.layers, context, strict=True):
            if recompute:
                x = checkpoint(_block_layer, layer, x, cos, sin, ctx_k, ctx_v, mask,
                               use_reentrant=False)
            else:
                x = _block_layer(layer, x, cos, sin, ctx_k, ctx_v, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the draft rows of final-normed states; DSpark adds the Markov bias of
        ``previous`` (the token before each slot's, same leading shape)."""
        out = hidden @ self.logit_weight.T.to(hidden.dtype)
        if self.config.markov_rank:
            if previous is None:
                raise ValueError("a DSpark draft's logits need the previous tokens")
            out = out + self.markov_head(previous).to(out.dtype)
        return out

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """DSpark: the probability that each slot's token is accepted given the earlier ones."""
        code = self.markov_head.markov_w1(previous)
        return torch.sigmoid(self.confidence_head(hidden, code).float())


def _block_layer(layer, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
    """One decoder layer over block tokens: queries from the block, keys and values from the
    context's (injected) entries followed by the block's own."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    shape = (*h.shape[:-1], -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(h).view(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(h).view(shape)).transpose(1, 2)
    v = attn.v_proj(h).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys = torch.cat([ctx_k.to(k.dtype), k], dim=2)
    values = torch.cat([ctx_v.to(v.dtype), v], dim=2)
    groups = q.shape[1] // keys.shape[1]
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=attn.scaling,
        **({"enable_gqa": True} if groups > 1 else {}))  # (B, heads, M, hd)
    out = out.transpose(1, 2).reshape(*x.shape[:-1], -1)
    x = x + attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def block_mask(context_valid: torch.Tensor, anchors: torch.Tensor,
               block_size: int) -> torch.Tensor:
    """Which keys each block query sees when blocks are trained in parallel.

    context_valid (B, S) bool: the real positions; anchors (B, A): each block's anchor position
    (-1: no block). Query (a, j) sees context positions t < anchors[a] that are real, and every
    slot of its own block. -> (B, A * block_size, S + A * block_size) bool.
    """
    B, S = context_valid.shape
    A = anchors.shape[1]
    t = torch.arange(S, device=anchors.device)
    ctx = (t[None, None, :] < anchors[:, :, None]) & context_valid[:, None, :]  # (B, A, S)
    ctx = ctx[:, :, None, :].expand(B, A, block_size, S).reshape(B, A * block_size, S)
    same = torch.eye(A, dtype=torch.bool, device=anchors.device)
    own = same[:, None, :, None].expand(A, block_size, A, block_size).reshape(
        A * block_size, A * block_size)
    blocks = own[None].expand(B, -1, -1) & (anchors >= 0).repeat_interleave(
        block_size, dim=1)[:, :, None]
    allowed = torch.cat([ctx, blocks], dim=-1)
    # a block with no anchor sees itself only, so its (unused) outputs stay finite
    return allowed | torch.cat([torch.zeros_like(ctx), own[None].expand(B, -1, -1)], dim=-1)


# ------------------------------------------------------------------------------------------------
# the artifact


def save_dflash(draft: DFlashDraft, directory: str | os.PathLike, target: Target,
                extra: dict | None = None) -> Path:
    """Write the draft as a draftsmith artifact (method dflash/dspark); the target is not saved."""
    return save_artifact(directory, draft.method, {**draft.config.to_dict(), **(extra or {})},
                         draft.state_dict(), target.identity())


def load_dflash(directory: str | os.PathLike, target: Target, dtype: torch.dtype | None = None,
                *, method: str | None = None, allow_other_weights: bool = False) -> DFlashDraft:
    """Rebuild a saved block draft on ``target``; ``method`` asks for dflash or dspark (a DSpark
    artifact asked for as DFlash is refused: its Markov head is part of what it predicts)."""
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"block draft artifact {directory} does not exist")
    meta, state = load_artifact(directory, METHODS, device=target.device)
    if method is not None and meta["method"] != method:
        raise ValueError(f"{directory} holds a {meta['method']} draft, not {method}: use "
                         f"--method {meta['method']}:{directory}")
    target.check_identity(meta.get("target", {}), what=f"{meta['method']} artifact {directory}",
                          allow_other_weights=allow_other_weights)
    config = DFlashConfig.from_dict(meta, directory / "config.json")
    maps = {"d2t": state.get("d2t"), "t2d": state.get("t2d")}
    if config.draft_vocab_size is not None and (maps["d2t"] is None or maps["t2d"] is None):
        raise ValueError(f"{directory}: draft_vocab_size {config.draft_vocab_size} but no d2t/t2d")
    draft = DFlashDraft(config, target, dtype=dtype, **maps)
    draft.load_state_dict(state, strict=True)
    return draft.eval()
