"""Token-budget batches change which rows share a micro-batch and how much padding it carries;
they must not change a single per-token loss.

For every trainer's loss, summed over scored tokens (``reduction="sum"``, what the loop normalises
over the whole optimizer step): a micro-batch of rows padded to its longest row, the same rows
padded much wider, and each row alone without any padding give the same sums (and the same
gradients), so grouping rows by length and filling micro-batches up to a token budget trains
exactly what fixed padded batches train.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_llama

from draftsmith.heads.chunked_loss import next_token_mask
from draftsmith.heads.eagle import EagleHead, build_draft_vocab
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.eagle_loss import EagleLoss
from draftsmith.heads.medusa import MedusaHeads
from draftsmith.heads.medusa_loss import MedusaObjective, target_hidden
from draftsmith.targets.features import target_features
from draftsmith.targets.target import wrap_target
from draftsmith.train.medusa import MedusaTrainConfig, loss_options
from draftsmith.train.rows import collate_causal_lm

VOCAB = 96


def rows(seed: int = 0) -> list[dict]:
    """Three rows of 9, 14 and 5 tokens with prompts (unscored) and answers (scored)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length, prompt in ((9, 3), (14, 5), (5, 2)):
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return out


def padded(batch: dict, extra: int, pad: int = 0) -> dict:
    """The batch with ``extra`` more padding columns on the right."""
    out = {}
    for key, value in batch.items():
        fill = pad if key == "input_ids" else (-100 if key == "labels" else 0)
        out[key] = torch.cat([value, value.new_full((value.shape[0], extra), fill)], dim=1)
    return out


def sums(loss_of, batches) -> tuple[torch.Tensor, dict]:
    """(summed loss over the batches, summed gradients) of a differentiable ``loss_of``."""
    total, grads = torch.zeros((), dtype=torch.float64), {}
    for batch in batches:
        loss, parameters = loss_of(batch)
        loss.backward()
        total = total + loss.detach().double()
        for name, p in parameters:
            if p.grad is not None:
                grads[name] = grads.get(name, 0) + p.grad.detach().clone()
                p.grad = None
    return total, grads


def check_the_three_layouts(loss_of) -> None:
    data = rows()
    together = collate_causal_lm(data, pad_token_id=0)
    layouts = {
        "together": [together],
        "wider": [padded(together, 11)],
        "alone": [collate_causal_lm([row], pad_token_id=0) for row in data],
    }
    results = {name: sums(loss_of, batches) for name, batches in layouts.items()}
    expected, expected_grads = results["together"]
    assert expected > 0 and expected_grads
    for name, (value, grads) in results.items():
        torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-9, msg=name)
        assert grads.keys() == expected_grads.keys()
        for key, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[key], rtol=1e-7, atol=1e-9,
                                       msg=f"{name}: {key}")


@pytest.fixture(scope="module")
def deep_target():
    """A 5-layer float64 tiny Llama: EAGLE-3 fuses hidden states 1, 2 and 3."""
    return wrap_target(tiny_llama(vocab=VOCAB, layers=5, seed=2), name="tiny-5")


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_losses_per_token_do_not_depend_on_padding_or_batching(deep_target, version):
    target = deep_target
    vocab = 48 if version == 3 else None
    config = EagleConfig.from_target(target, version, draft_vocab_size=vocab,
                                     aux_layer_ids=[1, 2, 3] if version == 3 else None)
    maps = {}
    if version == 3:
        counts = torch.arange(VOCAB, dtype=torch.int64) % 7  # some tokens outside the draft
        maps = dict(zip(("d2t", "t2d"), build_draft_vocab(counts, vocab), strict=True))
    torch.manual_seed(0)
    head = EagleHead(config, target, dtype=torch.float64, **maps)
    model = EagleLoss(head, steps=3, feature_noise=0.0, chunk_size=4)

    def loss_of(batch):
        batch = {**batch, **target_features(target, batch["input_ids"],
                                            batch["attention_mask"], config)}
        loss, _ = model(batch, reduction="sum")
        return loss, model.named_parameters()

    check_the_three_layouts(loss_of)


@pytest.mark.parametrize("soft", [False, True])
def test_medusa_losses_per_token_do_not_depend_on_padding_or_batching(tiny_target, soft):
    target = tiny_target
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target, num_heads=3, share_lm_head=False)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    cfg = MedusaTrainConfig(num_heads=3, soft_labels=soft, loss_chunk_size=4)
    objective = MedusaObjective(heads, target, **loss_options(cfg))

    def loss_of(batch):
        teacher = target_hidden(target, batch["input_ids"], batch["attention_mask"])
        loss, _ = objective(batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                            teacher, reduction="sum")
        return loss, objective.named_parameters()

    check_the_three_layouts(loss_of)


def test_distillation_losses_per_token_do_not_depend_on_padding_or_batching(tiny_target,
                                                                           tiny_draft):
    from draftsmith.train.distill import DistillConfig, distill_loss

    target = tiny_target
    draft = copy.deepcopy(tiny_draft).requires_grad_(True)
    cfg = DistillConfig(divergence="jsd", loss_chunk_size=3)

    def loss_of(batch):
        loss = distill_loss(draft, target, batch, cfg, reduction="sum").loss
        return loss, draft.named_parameters()

    check_the_three_layouts(loss_of)
    assert int(next_token_mask(collate_causal_lm(rows(), 0)["loss_mask"]).sum()) == 6 + 9 + 3
