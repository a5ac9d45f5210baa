"""The memory planner against what a step really allocates (train/memory_probe.py), and the
distillation loss scored from hidden states a chunk at a time (heads/distill_projected.py).

The planner's terms are checked against the tensors a real training step holds: the frozen
target's weights byte for byte, the trained parameters one for one, and the peak within 10% on
every trainer's tiny config with the embedded target (slow), where micro-batches are as full as
the planner plans for; on the tiny random targets of the default tests the plan must never be
short of the peak by more than 10%.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from draftsmith.heads.distill import DraftVocabHead
from draftsmith.heads.distill_loss import DIVERGENCES, argmax_agreement, divergence, tvd
from draftsmith.heads.distill_projected import projected_divergence
from draftsmith.train.memory_probe import allocation_peak, cpu_allocation_peak

REPO = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3


# ---------------------------------------------------------------------------------------------
# The measurement


def test_the_peak_is_the_running_total_and_the_optimizer_windows_are_told_apart():
    events = [(10, 100), (20, 50), (30, -100), (40, 400), (50, -400), (60, 30)]
    assert cpu_allocation_peak(events) == (450, 0)
    # 400 allocated inside the window (35..45): that peak, 450, is the optimizer step's
    assert cpu_allocation_peak(events, [(35, 45)]) == (150, 450)
    assert cpu_allocation_peak(list(reversed(events)), [(35, 45)]) == (150, 450)  # time order


def test_the_allocator_peak_sees_a_temporary_that_is_already_freed():
    device = torch.device("cpu")
    with allocation_peak(device) as peak:
        kept = torch.ones(1 << 20)  # 4 MiB, still held at the end
        gone = torch.ones(2 << 20)  # 8 MiB, freed before the end
        del gone
    assert 12 << 20 <= peak["bytes"] < (12 << 20) + (1 << 20), peak
    assert peak["optimizer"] == 0 and peak["forward_backward"] == peak["bytes"]
    del kept


# ---------------------------------------------------------------------------------------------
# The distillation loss from hidden states


def _heads(vocab: int, hidden: int, kept: torch.Tensor | None, seed: int = 0):
    torch.manual_seed(seed)
    target = nn.Linear(hidden, vocab, bias=False).double().requires_grad_(False)
    if kept is None:
        draft = nn.Linear(hidden, vocab, bias=False).double()
    else:
        draft = DraftVocabHead(torch.randn(kept.numel(), hidden, dtype=torch.float64), kept,
                               vocab)
    return draft, target


# KL(target || draft) is infinite where a draft vocabulary lacks a token the target gives
# probability, so that pair is not a case (the config refuses it)
CASES = [(name, kept) for name in DIVERGENCES for kept in (False, True)
         if not (kept and name == "forward_kl")]


@pytest.mark.parametrize(("name", "kept"), CASES)
def test_projected_divergence_equals_the_divergence_of_the_whole_logits(name, kept):
    """Value, argmax agreement, TVD and the gradients of the states and the head's weight, in
    float64, through chunks that do not divide the rows, at a temperature other than 1; with the
    whole vocabulary and with a draft vocabulary (its other logits -inf)."""
    vocab, hidden, n = 40, 8, 11
    ids = torch.tensor([0, 3, 4, 9, 17, 20, 33, 39]) if kept else None
    draft_head, target_head = _heads(vocab, hidden, ids)
    torch.manual_seed(1)
    states = torch.randn(n, hidden, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(n, hidden, dtype=torch.float64)
    got = projected_divergence(name, states, draft_head, teacher, target_head, temperature=0.7,
                               beta=0.3, chunk_size=4, with_tvd=True)
    got.loss.backward()
    grads = (states.grad.clone(), draft_head.weight.grad.clone())
    states.grad, draft_head.weight.grad = None, None

    logits = draft_head(states)
    with torch.no_grad():
        target_logits = target_head(teacher)
    ones = torch.ones(n, dtype=torch.float64)
    expected = divergence(name, logits, target_logits, ones, temperature=0.7, beta=0.3,
                          chunk_size=None)
    expected.backward()
    torch.testing.assert_close(got.loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0], states.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grads[1], draft_head.weight.grad, rtol=1e-9, atol=1e-12)
    assert got.count == n
    assert float(got.agree) == float(argmax_agreement(logits, target_logits, ones)) * n
    torch.testing.assert_close(got.rejected, tvd(logits, target_logits, ones, temperature=0.7,
                                                 reduction="sum").double())


@pytest.mark.parametrize("kept", [False, True])
def test_projected_divergence_under_bf16_autocast_matches_the_logits_path(kept):
    """A bf16 run (the trainer's autocast): the draft's products run in bf16 as its LM head
    would, the rest in float32; value and gradients agree with the whole logits computed the
    same way (bf16 LM head, float32 divergence), and the weight's gradient stays float32."""
    vocab, hidden, n = 64, 16, 13
    ids = torch.tensor([0, 2, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]) if kept else None
    draft_head, target_head = _heads(vocab, hidden, ids)
    draft_head.float()
    target_head.float()
    torch.manual_seed(2)
    states = torch.randn(n, hidden, requires_grad=True)
    teacher = torch.randn(n, hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = projected_divergence("forward_kl" if not kept else "reverse_kl", states,
                                   draft_head, teacher, target_head, chunk_size=5)
    got.loss.backward()
    grads = (states.grad.clone(), draft_head.weight.grad.clone())
    assert got.loss.dtype == torch.float32 and grads[1].dtype == torch.float32
    states.grad, draft_head.weight.grad = None, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = draft_head(states).float()
    with torch.no_grad():
        target_logits = target_head(teacher)
    expected = divergence("forward_kl" if not kept else "reverse_kl", logits, target_logits,
                          torch.ones(n), chunk_size=None)
    expected.backward()
    torch.testing.assert_close(got.loss, expected, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(grads[0], states.grad, rtol=5e-2, atol=2e-3)
    torch.testing.assert_close(grads[1], draft_head.weight.grad, rtol=5e-2, atol=2e-3)


def test_a_wrong_gradient_would_be_caught():
    """The comparison above can fail: scoring the draft at another temperature than the
    reference moves the value and the gradients."""
    draft_head, target_head = _heads(30, 6, None)
    states = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(7, 6, dtype=torch.float64)
    got = projected_divergence("jsd", states, draft_head, teacher, target_head, temperature=0.9)
    got.loss.backward()
    expected = divergence("jsd", draft_head(states.detach().requires_grad_()),
                          target_head(teacher).detach(), torch.ones(7, dtype=torch.float64))
    assert not torch.allclose(got.loss, expected)


def test_projected_divergence_never_holds_the_whole_logits():
    """(1024, 32768) float32 logits are 128 MiB each and the whole-logit loss holds several;
    scored from states a chunk at a time the step holds 9 chunks and the head's gradient."""
    vocab, hidden, n, chunk = 32768, 32, 1024, 64
    torch.manual_seed(0)
    draft_head = nn.Linear(hidden, vocab, bias=False)
    target_head = nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
    states = torch.randn(n, hidden, requires_grad=True)
    teacher = torch.randn(n, hidden)
    one_logits = n * vocab * 4
    with allocation_peak(torch.device("cpu")) as peak:
        projected_divergence("jsd", states, draft_head, teacher, target_head,
                             chunk_size=chunk).loss.backward()
    bound = 9 * chunk * vocab * 4 + 2 * vocab * hidden * 4 + n * hidden * 8 + (1 << 20)
    assert peak["bytes"] <= bound, (peak, bound)
    assert peak["bytes"] < one_logits / 1.5
    draft_head.zero_grad()
    with allocation_peak(torch.device("cpu")) as whole:
        logits = draft_head(states)
        divergence("jsd", logits, target_head(teacher).detach(), torch.ones(n),
                   chunk_size=chunk).backward()
    assert whole["bytes"] > 2 * one_logits  # what the hidden-state path avoids


# ---------------------------------------------------------------------------------------------
# Every trainer's plan against a real step


def _tiny_run_files(root: Path) -> dict:
    from test_train_eagle import conversation, save_tiny_target, write_jsonl

    from draftsmith.targets.target import load_target

    tokenizer = load_target("smollm2-135m").tokenizer
    rng = random.Random(0)
    rows = [conversation(rng, 4, 60) for _ in range(16)]
    used = set()
    for row in rows:
        used.update(tokenizer.apply_chat_template(row["messages"], tokenize=True,
                                                  return_dict=False))
    target = save_tiny_target(root / "target", tokenizer, used, hidden=64)
    return {"target": str(target), "data": write_jsonl(root / "rows.jsonl", rows)}


TINY_OVERRIDES = {"eagle": ["--draft_vocab_size", "512", "--aux_layer_ids", "1,2,3"], "medusa": [],
                  "dflash": ["--draft_vocab_size", "512", "--target_layer_ids", "0,2"],
                  "distill": ["--on_policy_ratio", "0", "--max_length", "64"]}


@pytest.mark.usefixtures("trainer_env")
@pytest.mark.parametrize("trainer", ["eagle", "medusa", "dflash", "distill"])
def test_each_planned_term_matches_the_step_on_a_tiny_target(trainer, tmp_path):
    """One step of each trainer on a tiny random target, measured by the allocator: the plan's
    frozen target is its bytes, its trained parameters the module's, and its peak is never
    short of the measured one by more than 10%."""
    from draftsmith.train.memory_probe import probe

    files = _tiny_run_files(tmp_path)
    argv = ["--config", str(REPO / "configs" / trainer / "tiny.yaml"), "--target",
            files["target"], "--data", files["data"], "--max_length", "64",
            *TINY_OVERRIDES[trainer]]
    result = probe(trainer, argv, steps=2)
    parts = result["planned_parts_bytes"]
    # its buffers (the rotary inverse frequencies) are the 64 bytes a weight count leaves out
    assert 0 <= result["frozen_target_bytes"] - parts["frozen target weights"] <= 4096
    trained = next(v for k, v in parts.items() if k.startswith("trained"))
    assert trained / 12 == pytest.approx(result["trained_parameters"], rel=1e-3)
    assert result["planned_over_measured"] >= 0.9, result


@pytest.mark.slow
def test_the_plan_is_within_ten_percent_of_the_allocator_on_the_tiny_configs(tmp_path):
    """configs/<method>/tiny.yaml on the embedded target with micro-batches as full as the plan
    assumes (scripts/memory_probe_tiny.py): planned within 10% of the allocator's peak."""
    sys.path.insert(0, str(REPO / "scripts"))
    from memory_probe_tiny import TRAINERS, run_probe, write_full_rows

    full = write_full_rows(tmp_path / "full.jsonl")
    for trainer in TRAINERS:
        result = run_probe(trainer, full, 2, tmp_path)
        assert 0.9 <= result["planned_over_measured"] <= 1.1, json.dumps(result, indent=1)
        parts = result["planned_parts_bytes"]
        assert 0 <= result["frozen_target_bytes"] - parts["frozen target weights"] <= 4096
        trained = next(v for k, v in parts.items() if k.startswith("trained"))
        assert trained / 12 == pytest.approx(result["trained_parameters"], rel=1e-3)


def test_the_probe_command_prints_its_measurements(tmp_path):
    done = subprocess.run([sys.executable, "-m", "draftsmith.train.memory_probe", "--config",
                           str(REPO / "configs/eagle/tiny.yaml"), "--steps", "0"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "--steps must be >= 1" in done.stderr
