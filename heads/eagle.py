"""EAGLE heads: one decoder layer that autoregresses in the target's feature space.

The layer is always a Llama decoder layer (transformers' ``LlamaDecoderLayer``, q/k/v/o,
gate/up/down, RMS norms), whatever the target's architecture, shaped like one of the target's
layers (hidden size, heads, kv heads, head_dim, intermediate size, norm epsilon) with the target's
rope settings, so that its rotary tables equal the target's and every serving engine's
Llama-style EAGLE drafter can load it (as the peers train it: EAGLE, SpecForge, speculators).

EAGLE-1 (``version=1``)
    ``fc`` maps cat(token embedding, feature) (2h) to h, then the decoder layer without its input
    norm; the target's frozen LM head turns the output into logits. The output is also the next
    feature: it is trained to regress the target's next final-normed hidden state (SmoothL1) plus
    0.1 x soft cross-entropy against the target's distribution.
EAGLE-3 (``version=3``)
    ``fc`` fuses three target hidden states (3h -> h). The layer's attention reads
    cat(input_layernorm(embedding), hidden_norm(feature)) (2h, so q/k/v take 2h inputs); its
    residual stream starts from the un-normed feature. ``norm`` + an own ``lm_head`` over a reduced
    draft vocabulary give logits; the un-normed output is the next feature. Trained by
    training-time test: k unrolled steps on its own features, loss weights 0.8^i, soft
    cross-entropy only.

speculators' EAGLE-3 variants (the defaults of its trainer since 0.9; read from its layout by
layouts/eagle.py, never chosen by draftsmith's trainer), three flags of :class:`EagleConfig`:
``norm_before_fc`` (one RMSNorm, ``input_norm``, over the concatenated 3h features before ``fc``),
``norm_before_residual`` (the residual stream starts from the normed feature) and ``norm_output``
(the next feature is ``norm(out)``, the state ``lm_head`` reads, instead of ``out``). A head
trained with a sliding window (``sliding_window``) computes as with full attention while every
position is below the window; a longer context is refused.

Index convention (the one vLLM uses for ``eagle_aux_hidden_state_layer_ids``): feature index i is
transformers' ``output_hidden_states[i]``, i.e. the input of decoder layer i (the output of layer
i - 1); index L (= num_hidden_layers) is the final-normed last layer. EAGLE-1 reads index L;
EAGLE-3 reads three indices in 1..L-1, ascending (default 2, L//2, L-3), concatenated in that
order before ``fc`` (vLLM collects them in layer order, so the order is part of the format).

Draft vocabulary (EAGLE-3): the N most frequent target tokens of the training data. ``d2t``
(int64, [N]) holds offsets: target_id = draft_id + d2t[draft_id]; ``t2d`` (bool, [V]) marks the
target ids that have a draft id. Draft ids follow ascending target ids. The maps and their
construction live in heads/draft_vocab.py (Medusa heads use them too); ``count_tokens`` and
``build_draft_vocab`` are importable from here as well.

Weight names are those of the serving layouts (vLLM / SGLang): EAGLE-1 ``fc.weight``,
``layers.0.*`` (no ``input_layernorm``); EAGLE-3 ``fc.weight``, ``midlayer.*`` (with
``midlayer.hidden_norm.weight``), ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``. The
target's embedding (and EAGLE-1's LM head) are used by reference and never saved.

Alignment used everywhere (training and inference): the head's entry at position t reads the
target feature f_t (which predicted token x_{t+1}) and the embedding of x_{t+1}; its logits
predict x_{t+2}. At training-time-test step i the entry of anchor t sits at position t + i,
reads the embedding of x_{t+1+i} and the head's own step i-1 feature, and predicts x_{t+2+i}.

Training-time test without a dense mask: at step i, anchor t attends to the step-0 entries
0..t of its document and to its own entries of steps 1..i only -- the diagonal of each earlier
step, as in the EAGLE reference (heads/ttt_attention.py: fused SDPA with the diagonal as extra
keys, or flex attention with a block mask; packed rows attend within their document).

The losses (EAGLE-1's feature regression and cross-entropy, EAGLE-3's training-time test) and
the target features they read are heads/eagle_loss.py, beside this module.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from draftsmith.heads.artifact import load_artifact, save_artifact
from draftsmith.heads.draft_vocab import build_draft_vocab as build_draft_vocab
from draftsmith.heads.draft_vocab import check_vocab_maps
from draftsmith.heads.draft_vocab import count_tokens as count_tokens
from draftsmith.heads.eagle_config import EagleConfig, _check_aux_ids
from draftsmith.heads.ttt_attention import ttt_attention
from draftsmith.targets.target import FrozenParts, Target, attention_bias


def causal_mask(
    q_len: int, past: int, dtype: torch.dtype, device, key_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """(1 or B, 1, q_len, past + q_len) float mask: query j sees keys 0..past + j (if valid)."""
    k = torch.arange(past + q_len, device=device)
    q = torch.arange(q_len, device=device) + past
    allowed = (k[None, :] <= q[:, None])[None, None]  # (1, 1, q, k)
    if key_valid is not None:
        allowed = allowed & key_valid.bool()[:, None, None, :]
    return attention_bias(allowed, dtype)


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head: a Llama decoder layer on top of the target.

    ``EagleHead(config, target, d2t=None, t2d=None, dtype=None)``: EAGLE-3 with a reduced draft
    vocabulary needs the ``d2t``/``t2d`` maps of :func:`build_draft_vocab`; its ``lm_head`` rows and
    ``norm`` start from the target's. ``dtype`` defaults to the target's (use float32 master
    weights for mixed-precision training).

    Inference: ``head(input_ids, hidden, position_ids, attention_mask, cache)`` (a KV cache from
    :meth:`new_cache`, float masks for trees). Training: :meth:`ttt_step` per training-time-test
    step, then :meth:`logit_states` / :attr:`logit_weight` for the chunked loss.
    """

    def __init__(
        self,
        config: EagleConfig,
        target: Target,
        d2t: torch.Tensor | None = None,
        t2d: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self._check_target(config, target)
        self.config = config
        h = config.hidden_size
        self.layer_config = config.transformers_config(
            getattr(target.config, "_attn_implementation", None)
        )
        layer = LlamaDecoderLayer(self.layer_config, layer_idx=0)
        if config.version == 1:
            self.fc = nn.Linear(2 * h, h, bias=False)
            # EAGLE-1 feeds fc's output to attention directly (the reference code drops this norm)
            layer.input_layernorm = nn.Identity()
            self.layers = nn.ModuleList([layer])
        else:
            self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
            layer.hidden_norm = copy.deepcopy(layer.input_layernorm)
            self.midlayer = layer
            self.norm = LlamaRMSNorm(h, eps=self.layer_config.rms_norm_eps)
            if config.norm_before_fc:  # speculators' name for it
                self.input_norm = LlamaRMSNorm(3 * config.target_hidden_size,
                                               eps=self.layer_config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            d2t, t2d = self._vocab_maps(config, d2t, t2d)
            self.register_buffer("d2t", d2t.to(torch.int64).to(target.device))
            self.register_buffer("t2d", t2d.to(torch.bool).to(target.device))
        # The head's own rotary tables, from the target's rope settings and head_dim: the same
        # cos/sin as the target's for every position (tested for Llama, Qwen2, Qwen3, Mistral).
        rotary = LlamaRotaryEmbedding(self.layer_config).to(target.device)
        self.frozen = FrozenParts(embed=target.embed, lm_head=target.lm_head, rotary=rotary)
        self.to(device=target.device, dtype=dtype or target.dtype)
        if config.version == 3:
            with torch.no_grad():  # the target's final norm and its draft vocabulary's LM rows
                target_norm = getattr(target.norm, "weight", None)
                if target_norm is not None and target_norm.shape == self.norm.weight.shape:
                    self.norm.weight.copy_(target_norm)
                kept = torch.arange(config.draft_vocab_size, device=target.device) + self.d2t
                self.lm_head.weight.copy_(target.lm_head.weight[kept])
        for p in self.parameters():
            p.requires_grad_(True)

    # the tensors of a Llama-style decoder layer the head's layer has, by the layer's own names
    LAYER_WEIGHTS = tuple(f"self_attn.{n}_proj.weight" for n in "qkvo") + tuple(
        f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")) + (
        "input_layernorm.weight", "post_attention_layernorm.weight")

    def start_as_target_layer(self, weights: dict[str, torch.Tensor], layer: int) -> None:
        """EAGLE-3: start as the target's decoder layer ``layer`` applied to its input, which must
        be one of the fused features (``aux_layer_ids``).

        ``weights``: that layer's tensors by its own names (:attr:`LAYER_WEIGHTS`). ``fc`` then
        passes that feature through unchanged, the feature half of q/k/v, the output projection,
        the MLP and the norms are the layer's, and the embedding half of q/k/v is zero: at
        training-time-test step 0 the untrained head computes exactly the target's layer, so it
        starts from the target's own state ``L - layer - 1`` layers before the last, read through
        the final norm and the draft LM rows, instead of from noise. A layer with other tensors
        (Qwen3's q/k norms, biases) or shapes is refused.
        """
        if self.version != 3:
            raise ValueError("starting from a target layer is for EAGLE-3 heads (EAGLE-1 reads "
                             "the last layer's output, whose layer is already the target's)")
        aux = self.config.aux_layer_ids
        if layer not in aux:
            raise ValueError(f"init_layer {layer} is not one of the fused features {list(aux)}: "
                             f"the head starts as a layer applied to a feature it reads; choose "
                             f"one of them (the last, {aux[-1]}, starts nearest the output)")
        extra = sorted(set(weights) - set(self.LAYER_WEIGHTS))
        missing = sorted(set(self.LAYER_WEIGHTS) - set(weights))
        if extra or missing:
            raise ValueError(f"target layer {layer} is not a Llama layer the head can start as "
                             f"(tensors it has beyond one: {extra}; lacking: {missing}); train "
                             f"from a random start (init_layer: none)")
        h = self.config.hidden_size
        if self.config.target_hidden_size != h:
            raise ValueError(f"the head's width {h} is not the target's "
                             f"{self.config.target_hidden_size}: no target layer fits it")
        own = self.decoder_layer
        attn = own.self_attn
        with torch.no_grad():
            for name in self.LAYER_WEIGHTS:
                source = weights[name].to(self.fc.weight.device, self.fc.weight.dtype)
                if name.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                    param = getattr(attn, name.split(".")[1]).weight  # (out, 2h): embeds | feature
                    expected = (param.shape[0], h)
                else:
                    param = own.get_parameter(name)
                    expected = tuple(param.shape)
                if tuple(source.shape) != expected:
                    raise ValueError(f"target layer {layer}'s {name} is {tuple(source.shape)}, "
                                     f"the head's needs {expected}; train from a random start "
                                     f"(init_layer: none)")
                if param.shape != source.shape:
                    param.zero_()
                    param[:, h:].copy_(source)
                else:
                    param.copy_(source)
            own.hidden_norm.weight.copy_(own.input_layernorm.weight)
            self.fc.weight.zero_()  # (h, 3 x h): the chosen feature passes through
            j = aux.index(layer)
            self.fc.weight[:, j * h:(j + 1) * h].copy_(torch.eye(h))

    @staticmethod
    def _check_target(config: EagleConfig, target: Target) -> None:
        if (
            config.vocab_size != target.vocab_size
            or config.target_hidden_size != target.hidden_size
        ):
            raise ValueError(
                f"EAGLE config is for a target with vocab {config.vocab_size} / hidden "
                f"{config.target_hidden_size}, but {target.name!r} has {target.vocab_size} / "
                f"{target.hidden_size}"
            )
        L = target.num_layers
        if config.version == 1 and config.aux_layer_ids != (L,):
            raise ValueError(f"EAGLE-1 reads hidden state {L}, config says {config.aux_layer_ids}")
        if config.version == 3:
            _check_aux_ids(config.aux_layer_ids, L)

    @staticmethod
    def _vocab_maps(config: EagleConfig, d2t, t2d) -> tuple[torch.Tensor, torch.Tensor]:
        if d2t is None and t2d is None:
            if config.draft_vocab_size != config.vocab_size:
                raise ValueError(
                    f"a draft vocabulary of {config.draft_vocab_size} < {config.vocab_size} needs "
                    "d2t and t2d: build them with build_draft_vocab(token_counts, n)"
                )
            return (
                torch.zeros(config.vocab_size, dtype=torch.int64),
                torch.ones(config.vocab_size, dtype=torch.bool),
            )
        if d2t is None or t2d is None:
            raise ValueError("give both d2t and t2d (from build_draft_vocab), or neither")
        check_vocab_maps(d2t, t2d, config.vocab_size)
        if d2t.numel() != config.draft_vocab_size:
            raise ValueError(
                f"d2t has {d2t.numel()} entries, config.draft_vocab_size is "
                f"{config.draft_vocab_size}"
            )
        return d2t, t2d

    @property
    def version(self) -> int:
        return self.config.version

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for the head's single layer."""
        return DynamicCache(config=self.layer_config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, S) target ids -> (B, S, h) through the target's frozen embedding."""
        with torch.no_grad():
            return self.frozen.embed(input_ids).to(self.dtype)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features -> the head's input feature (B, S, h).

        EAGLE-1: the final-normed feature itself. EAGLE-3: ``fc`` over the aux features
        concatenated in ascending layer order, (B, S, 3 * target_hidden).
        """
        features = features.to(self.dtype)
        if self.version == 1:
            return features
        return self.fc(self.input_norm(features) if self.config.norm_before_fc else features)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (identity for EAGLE-1)."""
        return draft_ids if self.version == 1 else draft_ids + self.d2t[draft_ids]

    @property
    def decoder_layer(self) -> LlamaDecoderLayer:
        """The head's one decoder layer (``layers[0]`` in EAGLE-1, ``midlayer`` in EAGLE-3)."""
        return self.layers[0] if self.version == 1 else self.midlayer

    @property
    def logit_weight(self) -> torch.Tensor:
        """(draft_vocab, h): logits = logit_states(out) @ logit_weight.T (EAGLE-1: the target's)."""
        return self.frozen.lm_head.weight if self.version == 1 else self.lm_head.weight

    def logit_states(self, out: torch.Tensor) -> torch.Tensor:
        """The head's output (..., h) -> what its vocabulary projection reads (EAGLE-3: normed;
        with ``norm_output`` the output is normed already)."""
        return out if self.version == 1 or self.config.norm_output else self.norm(out)

    def _decoder(self, embeds: torch.Tensor, hidden: torch.Tensor, attend) -> torch.Tensor:
        """The layer around its attention: ``attend`` maps the attention input to its output."""
        layer = self.decoder_layer
        if self.version == 1:
            x = self.fc(torch.cat([embeds, hidden], dim=-1))  # (B, S, h)
            residual, attn_in = x, layer.input_layernorm(x)  # no input norm in EAGLE-1
        else:
            attn_in = torch.cat(
                [layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1
            )  # (B, S, 2h)
            # the residual stream starts from the un-normed feature (speculators' variant: normed)
            residual = layer.hidden_norm(hidden) if self.config.norm_before_residual else hidden
        out = residual + attend(attn_in)
        return out + layer.mlp(layer.post_attention_layernorm(out))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the head over S entries.

        input_ids (B, S) target ids; hidden (B, S, h): the fused target feature or the head's own
        previous output; position_ids (B or 1, S); attention_mask: additive float mask
        (B or 1, 1, S, past + S), default causal over ``cache``; entries are appended to ``cache``.
        Returns (next feature (B, S, h), logits (B, S', draft_vocab)), S' = logits_to_keep or S.
        """
        hidden = hidden.to(self.dtype)
        window = self.config.sliding_window
        if window is not None and int(position_ids.max()) >= window:
            raise ValueError(f"this head attended to the last {window} positions only when it "
                             f"was trained; at position {int(position_ids.max())} full attention "
                             "would compute something else: keep prompt and answer shorter")
        if attention_mask is None:
            past = cache.get_seq_length() if cache is not None else 0
            attention_mask = causal_mask(input_ids.shape[1], past, self.dtype, self.device)
        position_embeddings = self.frozen.rotary(hidden, position_ids)

        def attend(x):
            return self.decoder_layer.self_attn(
                hidden_states=x,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=position_embeddings,
            )[0]

        out = self._decoder(self.embed(input_ids), hidden, attend)
        if self.version == 3 and self.config.norm_output:
            out = self.norm(out)  # the next feature is the normed state lm_head reads
        kept = out[:, -logits_to_keep:] if logits_to_keep else out
        if self.version == 1:
            lm_head = self.frozen.lm_head
            return out, lm_head(kept.to(lm_head.weight.dtype))
        return out, self.lm_head(self.logit_states(kept))

    def ttt_step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        key_valid: torch.Tensor | None = None,
        *,
        documents: torch.Tensor | None = None,
        attention: str = "sdpa",
        gradient_checkpointing: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One training-time-test step over all n anchors at once (no logits).

        input_ids (B, n) the tokens of this step; hidden (B, n, h) the fused target features
        (step 0) or the head's previous output; position_ids (1 or B, n) = anchor + step; past:
        the (keys, values) this method returned at the earlier steps, step 0 first, each
        (B, kv_heads, n, head_dim); key_valid (B, n) bool: the anchors that are real tokens
        (padding excluded from the step-0 keys), None for right-padded rows (nothing to
        exclude); documents (B, n): each anchor's document in packed rows, None for one per row.
        Step 0 attends causally; step i > 0 to the step-0 keys up to each anchor plus the
        anchor's own entries of steps 1..i (:func:`draftsmith.heads.ttt_attention.ttt_attention`, kernel
        ``attention``: sdpa or flex).

        ``gradient_checkpointing``: keep only the step's inputs and recompute the layer in
        backward (``torch.utils.checkpoint``, non-reentrant).
        Returns (next feature (B, n, h), this step's (keys, values)).
        """
        hidden = hidden.to(self.dtype)
        embeds = self.embed(input_ids)  # no gradient: the target's frozen embedding
        cos, sin = self.frozen.rotary(hidden, position_ids)
        flat = [t for kv in past for t in kv]
        layer = partial(self._ttt_layer, attention=attention)
        if gradient_checkpointing and torch.is_grad_enabled():
            return checkpoint(
                layer, embeds, hidden, cos, sin, key_valid, documents, *flat, use_reentrant=False
            )
        return layer(embeds, hidden, cos, sin, key_valid, documents, *flat)

    def _ttt_layer(self, embeds, hidden, cos, sin, key_valid, documents, *past_flat, attention):
        attn = self.decoder_layer.self_attn
        step_kv = []

        def attend(x):  # (B, n, 2h or h) -> (B, n, h)
            B, n, _ = x.shape
            shape = (B, n, -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)  # (B, H, n, d)
            k = attn.k_proj(x).view(shape).transpose(1, 2)  # (B, H_kv, n, d)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            step_kv.extend((k, v))
            out = ttt_attention(
                q,
                [*past_flat[0::2], k],
                [*past_flat[1::2], v],
                scaling=attn.scaling,
                key_valid=key_valid,
                documents=documents,
                backend=attention,
            )  # (B, H, n, d)
            return attn.o_proj(out.transpose(1, 2).reshape(B, n, -1))

        out = self._decoder(embeds, hidden, attend)
        if self.version == 3 and self.config.norm_output:
            out = self.norm(out)
        return out, (step_kv[0], step_kv[1])


# ------------------------------------------------------------------------------------------------
# Artifact


def save_eagle(head: EagleHead, directory: str | os.PathLike, target: Target) -> Path:
    """Write the head as a draftsmith artifact (method eagle1/eagle3); the target is not saved."""
    return save_artifact(
        directory, head.config.method, head.config.to_dict(), head.state_dict(), target.identity()
    )


def load_eagle(
    directory: str | os.PathLike,
    target: Target,
    dtype: torch.dtype | None = None,
    *,
    allow_other_weights: bool = False,
) -> EagleHead:
    """Rebuild a saved head on ``target``; refuses an artifact trained for another target (other
    shapes; or other weights of the same shapes unless ``allow_other_weights``)."""
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"EAGLE artifact {directory} does not exist")
    meta, state = load_artifact(directory, ("eagle1", "eagle3"), device=target.device)
    target.check_identity(meta.get("target", {}), what=f"EAGLE artifact {directory}",
                          allow_other_weights=allow_other_weights)
    config = EagleConfig.from_dict(meta)
    if meta["method"] != config.method:
        raise ValueError(f"{directory}: method {meta['method']!r} but version {config.version}")
    maps = {}
    if config.version == 3:
        maps = {"d2t": state.get("d2t"), "t2d": state.get("t2d")}
        if maps["d2t"] is None or maps["t2d"] is None:
            raise ValueError(f"{directory} is an EAGLE-3 artifact without d2t/t2d")
    head = EagleHead(config, target, dtype=dtype, **maps)
    head.load_state_dict(state, strict=True)
    return head
