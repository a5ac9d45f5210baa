"""The features a draft reads from the frozen target: hidden states at chosen layers.

EAGLE heads read them online (in every training step, :func:`target_features`) or from the
feature cache (``train/features.py``), which stores exactly what :func:`target_features` returns.
Any config with ``aux_layer_ids`` (target layer indices, the last one meaning the final hidden
state) and ``version`` (1: the last hidden state only; 3: the aux layers concatenated) describes
them (:class:`FeatureSpec` for a draft that is not an EAGLE head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.targets.target import Target


@dataclass(frozen=True)
class FeatureSpec:
    """What a cache stores, for a draft that is not an EAGLE head (a block draft): the
    hidden-state indices concatenated as ``features`` (``aux_layer_ids``) and, with ``version``
    3, the last hidden state at the scored positions. An EAGLE head's config (``EagleConfig``) has the same fields and
    is used the same way."""

    aux_layer_ids: tuple[int, ...]
    target_hidden_size: int
    target_num_layers: int
    version: int = 3

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (*self.aux_layer_ids, self.target_num_layers)


@torch.no_grad()
def target_features(
    target: Target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    config: FeatureSpec,
    position_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Online mode: run the frozen target on a batch and take what the loss needs.

    -> {"features": (B, S, F), "last_hidden": (B, S, h)}: F = h (EAGLE-1, index L) or 3h (EAGLE-3,
    the aux indices concatenated in ascending order); last_hidden is index L (the target's
    distribution is lm_head(last_hidden)). The LM head itself is not run here.

    Only the hidden states the head reads are kept (:meth:`draftsmith.targets.target.Target.hidden_states`).
    Packed rows give ``position_ids`` (restarting at 0 for each document) and no attention mask:
    the target then attends within each document.
    """
    wanted = [i for i in config.aux_layer_ids if i < target.num_layers]
    if position_ids is not None:  # packed: transformers tells the documents apart without it
        attention_mask = None
    captured, last = target.hidden_states(input_ids, wanted, attention_mask,
                                          position_ids=position_ids)
    if config.version == 1:
        return {"features": last, "last_hidden": last}
    captured[target.num_layers] = last
    return {
        "features": torch.cat([captured[i] for i in config.aux_layer_ids], dim=-1),
        "last_hidden": last,
    }
