"""Reduced draft vocabularies: the N most frequent target tokens of the training data.

A draft that guesses over N of the target's V tokens (EAGLE-3's head, Medusa heads with
``draft_vocab_size``) projects onto N rows instead of V, which is what makes it cheap on a large
vocabulary. Two maps tie the vocabularies together, the ones vLLM and SGLang read for EAGLE-3:

* ``d2t`` (int64, [N]) holds offsets: target_id = draft_id + d2t[draft_id];
* ``t2d`` (bool, [V]) is True exactly at the target ids that have a draft id.

Draft ids follow ascending target ids, so a target id's draft id is the number of kept ids below
it (:func:`target_to_draft`). Verification always runs on the target's full distribution, so a
draft vocabulary never changes what is emitted, only how often a guess can be right: the
``coverage`` of :func:`draft_vocabulary` is the fraction of the data's assistant tokens a draft
can guess at all.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch


def count_tokens(
    token_ids: Iterable[Sequence[int]],
    vocab_size: int,
    loss_masks: Iterable[Sequence[int]] | None = None,
) -> torch.Tensor:
    """(vocab,) int64 counts of the tokens the draft must predict (loss_mask == 1 when given)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    masks = iter(loss_masks) if loss_masks is not None else None
    for ids in token_ids:
        ids_t = torch.as_tensor(ids, dtype=torch.int64)
        if masks is not None:
            ids_t = ids_t[torch.as_tensor(next(masks), dtype=torch.bool)]
        if ids_t.numel() and (int(ids_t.min()) < 0 or int(ids_t.max()) >= vocab_size):
            raise ValueError(
                f"token ids outside 0..{vocab_size - 1}: wrong tokenizer for this target?"
            )
        counts += torch.bincount(ids_t, minlength=vocab_size)
    return counts


def build_draft_vocab(token_counts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most frequent target tokens as a draft vocabulary -> (d2t, t2d).

    Ties (and tokens never seen, when fewer than n were) are broken by lower id. Draft ids follow
    ascending target ids: d2t (int64, [n]) with target_id = draft_id + d2t[draft_id]; t2d (bool,
    [vocab]) True exactly at the kept target ids.
    """
    token_counts = torch.as_tensor(token_counts).reshape(-1)
    vocab = token_counts.numel()
    if not 1 <= n <= vocab:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab}, got {n}")
    order = torch.sort(-token_counts.to(torch.int64), stable=True).indices  # most frequent first
    kept = torch.sort(order[:n]).values
    d2t = kept - torch.arange(n)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """Refuse inconsistent maps (a wrong d2t silently destroys acceptance in vLLM)."""
    if d2t.dim() != 1 or t2d.dim() != 1 or t2d.numel() != vocab_size:
        raise ValueError(
            f"d2t must be 1-D and t2d 1-D over the {vocab_size}-token target vocabulary"
        )
    target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t.to(torch.int64)
    if d2t.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size):
        raise ValueError("d2t maps draft ids outside the target vocabulary")
    if not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise ValueError("d2t must map draft ids to distinct, ascending target ids")
    marked = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    marked[target_ids] = True
    if not torch.equal(marked, t2d.to(torch.bool).to(d2t.device)):
        raise ValueError("t2d does not mark exactly the target ids d2t maps to")


def draft_token_ids(d2t: torch.Tensor) -> torch.Tensor:
    """(n,) int64 target id of every draft id (the rows of the target's LM head a draft keeps)."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t.to(torch.int64)


def target_to_draft(t2d: torch.Tensor, target_ids: torch.Tensor,
                    d2t: torch.Tensor | None = None) -> torch.Tensor:
    """Target ids (any shape) -> their draft ids, -1 where a target id has no draft id.

    With ``d2t`` the draft ids come from a search over the n kept ids, so a training step
    allocates nothing of the target vocabulary's size (a V-long int64 running count otherwise).
    """
    target_ids = target_ids.to(torch.int64)
    if d2t is not None:
        kept = draft_token_ids(d2t)  # (n,) ascending
        draft_ids = torch.searchsorted(kept, target_ids).clamp_max(max(kept.numel() - 1, 0))
    else:
        draft_ids = (torch.cumsum(t2d.to(torch.int64), 0) - 1)[target_ids]  # kept ids below
    return torch.where(t2d[target_ids], draft_ids, -1)


def maps_from_token_ids(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """Ascending, distinct target ids (a draft vocabulary's rows) -> (d2t, t2d), checked."""
    target_ids = torch.as_tensor(target_ids, dtype=torch.int64).reshape(-1)
    d2t = target_ids - torch.arange(target_ids.numel(), device=target_ids.device)
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=target_ids.device)
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size):
        raise ValueError(f"token ids outside the {vocab_size}-token target vocabulary")
    t2d[target_ids] = True
    check_vocab_maps(d2t, t2d, vocab_size)
    return d2t, t2d


def draft_vocabulary(token_ids: Iterable[Sequence[int]], loss_masks: Iterable[Sequence[int]],
                     vocab_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(d2t, t2d, coverage): the ``size`` most frequent assistant tokens of training data.

    ``token_ids`` / ``loss_masks``: the training rows' columns (the tokens with loss_mask 1 are
    the ones a draft is asked to guess). A pure function of the data, so every process computes
    the same maps and a resumed run recomputes them (check them against the checkpoint's with
    :func:`check_same_vocabulary`). ``coverage`` is the fraction of assistant tokens whose target
    id has a draft id.
    """
    counts = count_tokens(token_ids, vocab_size, loss_masks)
    d2t, t2d = build_draft_vocab(counts, size)
    coverage = float(counts[t2d].sum()) / max(1, int(counts.sum()))
    return d2t, t2d, coverage


def check_same_vocabulary(saved: tuple[torch.Tensor, torch.Tensor],
                          expected: tuple[torch.Tensor, torch.Tensor],
                          resumed_from: str | os.PathLike) -> None:
    """A resumed checkpoint's maps (d2t, t2d) must be the ones the run's data gives now."""
    (saved_d2t, saved_t2d), (d2t, t2d) = [(a.cpu(), b.cpu()) for a, b in (saved, expected)]
    if torch.equal(saved_d2t, d2t) and torch.equal(saved_t2d, t2d):
        return
    differ = int((saved_t2d != t2d).sum()) if saved_t2d.shape == t2d.shape else "all"
    raise ValueError(
        f"cannot resume from {resumed_from}: its draft vocabulary (d2t/t2d) differs from the "
        f"one the training data gives now ({differ} target ids differ), so the data changed; "
        f"resume with the data the run started with, or start a new run in another --output_dir")
