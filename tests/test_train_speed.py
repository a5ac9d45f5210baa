"""draftsmith.train.speed times the target's forward as a training step calls it."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from draftsmith.train import speed


def test_the_forward_timed_is_the_steps_own_after_a_warm_up():
    seen = []

    def batch(i, packed):
        ids = torch.full((1, 6), i)
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if packed:
            out["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 2]])
        return out

    class Batches:
        def steps(self, start, device):
            for step in range(start, 10):  # two micro-batches a step, the second packed
                yield step, None, [batch(2 * step, False), batch(2 * step + 1, True)]

    def target_forward(micro):  # what the trainer's step runs on the target
        seen.append((int(micro["input_ids"][0, 0]), "position_ids" in micro))
        return micro["input_ids"].float()

    recipe = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu"),
                                                         autocast=contextlib.nullcontext),
                             target=None, batches=Batches(), target_forward=target_forward)
    rate, tokens = speed.target_forward_tokens_per_s(recipe, 2)
    warm = speed.FORWARD_WARMUP
    # the warm-up micro-batches first, then every micro-batch of the first two steps, packed
    # rows with their position ids; only the timed ones are counted
    assert seen[:warm] == [(0, False), (1, True), (2, False)][:warm]
    assert seen[warm:] == [(0, False), (1, True), (2, False), (3, True)]
    assert tokens == 4 * 6 and rate > 0
