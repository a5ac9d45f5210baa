"""The distilled draft's training rows: prompts and answers tokenised with the target's chat
template and cut to the configured length (or, on policy, the prompts alone), and their
collation into right-padded batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jinja2.exceptions import TemplateError

from draftsmith.targets.target import Target
from draftsmith.train.rows import collate_causal_lm, load_sft_dataset, read_conversations


def _prompt_of(messages: list[dict]) -> list[dict]:
    """The conversation up to (excluding) its first assistant turn."""
    roles = [m["role"] for m in messages]
    return messages[: roles.index("assistant")] if "assistant" in roles else list(messages)


def load_distill_rows(sources: Sequence[str], target: Target, max_length: int,
                      keep_prompt_only: bool = True) -> tuple[list[dict], str]:
    """Training rows and a report of what was used, skipped or dropped.

    Each row holds ``prompt_ids`` (the conversation up to its first assistant turn, with the
    target's chat template and generation prompt, as decoding will see it) and ``answered``; an
    answered row also holds the whole conversation's ``input_ids`` and ``loss_mask`` (from
    :func:`draftsmith.train.rows.load_sft_dataset`), a prompt-only row its prompt as ``input_ids`` and an
    all-zero ``loss_mask``. Prompt-only rows are dropped when ``keep_prompt_only`` is False, and
    rows whose prompt leaves no room for a continuation within ``max_length`` always are.
    """
    tokenizer = target.tokenizer
    conversations, read_report = read_conversations(sources)
    prompts = {(c["source"], c["row"]): _prompt_of(c["messages"]) for c in conversations}
    answered_any = any(m["role"] == "assistant" for c in conversations for m in c["messages"])
    lines: list[str] = []
    rows: list[dict] = []
    if answered_any:
        dataset, report = load_sft_dataset(sources, tokenizer, max_length)
        lines.append(report.summary())
        for ids, mask, source, row in zip(dataset["input_ids"], dataset["loss_mask"],
                                          dataset["source"], dataset["row"], strict=True):
            rows.append({"input_ids": torch.tensor(ids, dtype=torch.int32),
                         "loss_mask": torch.tensor(mask, dtype=torch.int8),
                         "prompt": prompts[(source, row)], "answered": True})
    prompt_only = [c for c in conversations
                   if not any(m["role"] == "assistant" for m in c["messages"])]
    no_user = 0
    if keep_prompt_only:
        for c in prompt_only:
            if any(m["role"] == "user" for m in c["messages"]):
                rows.append({"prompt": c["messages"], "answered": False})
            else:
                no_user += 1
    answered_rows = sum(r["answered"] for r in rows)
    if not rows:  # nothing answered and no prompt to sample from: say why, row by row
        for c in prompt_only:
            has_user = any(m["role"] == "user" for m in c["messages"])
            read_report.sources[c["source"]].skip(
                c["row"], "no assistant turn" if has_user else "no user or assistant turn")
        hint = ("\nprompt-only rows are trained on the draft's own samples when on_policy_ratio "
                "is above 0" if prompt_only and not keep_prompt_only else "")
        raise ValueError(f"no usable conversations in {list(sources)}:\n"
                         f"{read_report.summary()}{hint}")

    texts, template_errors = [], 0
    for row in rows:
        try:
            texts.append(tokenizer.apply_chat_template(row["prompt"], tokenize=False,
                                                       add_generation_prompt=True))
        except TemplateError:
            texts.append(None)
            template_errors += 1
    encoded = tokenizer([t or "" for t in texts], add_special_tokens=False)["input_ids"]
    kept, too_long = [], 0
    for row, text, ids in zip(rows, texts, encoded, strict=True):
        if text is None:
            continue
        if len(ids) >= max_length:  # not even one sampled token would fit
            too_long += 1
            continue
        row["prompt_ids"] = torch.tensor(ids, dtype=torch.int32)
        del row["prompt"]
        if not row["answered"]:
            row["input_ids"] = row["prompt_ids"]
            row["loss_mask"] = torch.zeros(len(ids), dtype=torch.int8)
        kept.append(row)

    lines.append(f"distillation rows: {answered_rows} with a response (off- and on-policy), "
                 f"{len(rows) - answered_rows} prompt-only (always on the draft's samples)")
    if prompt_only and not keep_prompt_only:
        lines.append(f"  dropped {len(prompt_only)} prompt-only rows: on_policy_ratio is 0, so "
                     f"nothing would be trained on them; let the target answer them first "
                     f"(python -m draftsmith.train.data regenerate --help) or raise on_policy_ratio")
    elif prompt_only:
        lines.append("  (rows counted above as skipped for 'no assistant turn' are these "
                     "prompt-only rows)")
    if no_user:
        lines.append(f"  dropped {no_user} prompt-only rows without a user turn")
    if template_errors:
        lines.append(f"  dropped {template_errors} rows whose prompt the chat template refused")
    if too_long:
        lines.append(f"  dropped {too_long} rows whose prompt has max_length {max_length} tokens "
                     f"or more (no room for a continuation)")
    if not kept:
        raise ValueError(f"no usable distillation rows in {list(sources)}:\n" + "\n".join(lines))
    return kept, "\n".join(lines)


def collate_distill(rows: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """:func:`draftsmith.train.rows.collate_causal_lm`'s batch plus the rows' prompts.

    Adds ``prompt_ids`` (batch, longest prompt) right-padded, ``prompt_length`` (batch,) and
    ``answered`` (batch,) bool.
    """
    batch = collate_causal_lm(rows, pad_token_id)
    width = max(len(r["prompt_ids"]) for r in rows)
    prompt_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    for b, row in enumerate(rows):
        prompt_ids[b, : len(row["prompt_ids"])] = torch.as_tensor(row["prompt_ids"])
    batch["prompt_ids"] = prompt_ids
    batch["prompt_length"] = torch.tensor([len(r["prompt_ids"]) for r in rows])
    batch["answered"] = torch.tensor([bool(r["answered"]) for r in rows])
    return batch
