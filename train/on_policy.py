"""On-policy batches for distillation: which micro-batches train on the draft's own samples,
and those samples, seeded so that a resumed run draws the same ones (train/distill.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from draftsmith.train.rows import collate_causal_lm


def seed_from(*parts: int) -> int:
    """A 32-bit seed mixing ``parts`` (numpy's SeedSequence: nearby inputs, unrelated seeds)."""
    return int(np.random.SeedSequence([p & 0xFFFFFFFFFFFFFFFF for p in parts])
               .generate_state(1)[0])


def is_on_policy(seed: int, micro_batch: int, ratio: float) -> bool:
    """Whether global micro-batch ``micro_batch`` (step x accumulation + index) is on-policy.

    A Bernoulli(ratio) draw from (seed, micro_batch) alone: the same on every process, in every
    rerun and after a resume.
    """
    if ratio <= 0.0:
        return False
    if ratio >= 1.0:
        return True
    return bool(np.random.default_rng(seed_from(seed, 0, micro_batch)).random() < ratio)


@torch.no_grad()
def sample_continuations(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         temperature: float, eos_token_ids: Sequence[int], pad_token_id: int,
                         seed: int, autocast=None) -> list[list[int]]:
    """The model's continuation of each prompt, up to and including its first end-of-sequence
    token, or ``max_new_tokens`` long. One left-padded batched ``generate`` in eval mode.

    Sampling is from softmax(logits / temperature) with no top-k / top-p (0: greedy), seeded by
    ``seed`` alone; the global random state is left as it was.
    """
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    # left padding: every row's next token is generated at the same column
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)  # (rows, width)
    attention_mask = torch.zeros_like(input_ids)
    for b, prompt in enumerate(prompts):
        input_ids[b, width - len(prompt):] = torch.as_tensor(list(prompt))
        attention_mask[b, width - len(prompt):] = 1
    eos = [int(i) for i in eos_token_ids]
    sampling = ({"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}
                if temperature > 0 else {"do_sample": False})
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=pad_token_id, use_cache=True, **sampling)
    was_training = model.training
    model.eval()
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices), (autocast or contextlib.nullcontext()):
            torch.manual_seed(seed)
            output = model.generate(input_ids=input_ids.to(device),
                                    attention_mask=attention_mask.to(device),
                                    generation_config=config)  # (rows, width + new)
    finally:
        model.train(was_training)
    continuations = []
    for tokens in output[:, width:].tolist():
        end = next((k for k, t in enumerate(tokens) if t in eos), None)
        continuations.append(tokens if end is None else tokens[: end + 1])
    return continuations


def draft_sampled_batch(batch: dict, draft: nn.Module, on_policy: bool, *, max_new_tokens: int,
                        temperature: float, eos_token_ids: Sequence[int], pad_token_id: int,
                        max_length: int, seed: int, autocast=None) -> tuple[dict, int, int]:
    """The micro-batch to train on, and (rows sampled, tokens sampled).

    Rows to sample (every row when ``on_policy``, else the prompt-only ones) become prompt + the
    draft's continuation (cut to ``max_length``), with ``loss_mask`` 1 exactly on the sampled
    tokens; the other rows keep their data. Returned right-padded as
    :func:`draftsmith.train.rows.collate_causal_lm` pads, on the batch's device. ``draft`` is the unwrapped
    model (``generate`` under no_grad).
    """
    answered = batch["answered"].tolist()
    chosen = [b for b, has_response in enumerate(answered) if on_policy or not has_response]
    if not chosen:
        return batch, 0, 0
    lengths = batch["prompt_length"].tolist()
    prompts = [batch["prompt_ids"][b, : lengths[b]].tolist() for b in chosen]
    budget = min(max_new_tokens, max_length - min(len(p) for p in prompts))
    continuations = sample_continuations(draft, prompts, budget, temperature, eos_token_ids,
                                         pad_token_id, seed, autocast)
    sampled = dict(zip(chosen, zip(prompts, continuations, strict=True), strict=True))
    sizes = batch["attention_mask"].sum(-1).tolist()
    rows, new_tokens = [], 0
    for b in range(len(answered)):
        if b in sampled:
            prompt, new = sampled[b]
            new = new[: max_length - len(prompt)]
            new_tokens += len(new)
            rows.append({"input_ids": prompt + new, "loss_mask": [0] * len(prompt) + [1] * len(new)})
        else:
            rows.append({"input_ids": batch["input_ids"][b, : sizes[b]].cpu(),
                         "loss_mask": batch["loss_mask"][b, : sizes[b]].cpu()})
    device = batch["input_ids"].device
    out = {k: v.to(device) for k, v in collate_causal_lm(rows, pad_token_id).items()}
    return out, len(chosen), new_tokens
