"""The optimizer and the learning rate of every step (a pure function of the step: no state)."""

from __future__ import annotations

import math

import torch
from torch import nn


def make_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices only (not biases, norms)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError(f"{type(model).__name__} has no trainable parameters: the module given to "
                         f"make_optimizer must be the draft being trained, not the frozen target")
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.learning_rate,
                             betas=(cfg.adam_beta1, cfg.adam_beta2))


def learning_rate(cfg, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) out of ``total_steps``.

    Linear warmup from ``learning_rate / warmup_steps`` to ``learning_rate`` over the first
    ``warmup_steps`` steps, then constant, or a linear or cosine decay that reaches
    ``min_lr_ratio * learning_rate`` at ``total_steps``. Being a function of the step alone, the
    schedule needs no saved state and does not depend on the number of processes.
    """
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.learning_rate * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape)


def apply_learning_rate(optimizer, cfg, step: int, total_steps: int) -> float:
    """Set the learning rate of the optimizer step being taken (``step`` done so far)."""
    lr = learning_rate(cfg, step, total_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
