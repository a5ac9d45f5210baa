"""Peak memory of one EAGLE training step on a 128256-token vocabulary at T = 2048.

A tiny target (hidden 64, 2 heads, 4 layers) with Llama-3's vocabulary size: the head's own work
is small, so what a step allocates is dominated by its vocabulary projections. Unchunked, one
(1, 2048, 128256) float32 tensor is 1.05 GB and the previous losses held several per
training-time-test step (the target's distribution, each step's logits, log-softmax and shifted
target); chunked, the step must stay under the bound derived below.

How it is measured: the steps run in a fresh Python process (no memory freed by earlier tests
for a step to reuse unseen), with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc serves every
allocation over 64 kB by its own mmap and returns it when freed (by default it raises that
threshold up to 32 MB and keeps freed blocks below it, which RSS would still count). Once the
target, head, batch and features exist, the process resets its peak resident set size
(``5`` into ``/proc/self/clear_refs`` sets VmHWM to the current RSS, Linux >= 4.0), runs forward
+ backward of the loss, and reports VmHWM minus the RSS before the step: an upper bound on the
extra memory the step held at any one time.

The bound (float32, V = 128256, h = 64, T = 2048, chunk c = 64, 3 steps; MiB = 2^20 B):

* the chunked loss's (c, V) float32 buffers, reused by every chunk: at most 8 (the teacher's
  logits, log-probs and probs, the student's logits and log-probs, their gradient, a spare):
  8 x 64 x 128256 x 4 B = 250.5 MiB;
* weight gradients of (V, h) float32, 31.3 MiB each: EAGLE-3's buffer of ``lm_head``'s
  gradient, the gradient autograd hands back and the parameter's ``.grad``: 94 MiB (EAGLE-1
  projects with the frozen target LM head: none);
* the head's activations and masks: per step about 30 (T, h) float32 tensors (0.5 MiB each) and
  a (T, T + i) bool mask (4 MiB): under 64 MiB for 3 steps.

Total 408.5 MiB for EAGLE-3 and 314.5 MiB for EAGLE-1, against 1002 MiB (1.05 GB) for a single
unchunked (1, T, V) float32 tensor. (Measured when written: EAGLE-3 281 MiB, EAGLE-1 183 MiB;
the previous code peaked at 2.6 GB and 1.3 GB already at T = 512.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VOCAB, T, CHUNK, STEPS = 128256, 2048, 64, 3
MB = 2**20
BOUND = {3: (8 * CHUNK * VOCAB * 4 + 3 * VOCAB * 64 * 4 + 64 * MB),
         1: (8 * CHUNK * VOCAB * 4 + 64 * MB)}
ONE_FULL_TENSOR = T * VOCAB * 4

STEPS_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, {repo!r})
from transformers import LlamaConfig, LlamaForCausalLM
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.eagle_loss import eagle_loss
from draftsmith.targets.features import target_features
from draftsmith.targets.target import wrap_target

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

torch.set_num_threads(2)
config = LlamaConfig(vocab_size={vocab}, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                     max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                     pad_token_id=None, tie_word_embeddings=False)
torch.manual_seed(0)
target = wrap_target(LlamaForCausalLM(config), name="tiny-128k")
ids = torch.randint(0, {vocab}, (1, {T}))
loss_mask = torch.zeros_like(ids)
loss_mask[:, {T} - {scored}:] = 1  # a prompt, then the answer the draft is trained on
results = {{}}
for version in (3, 1):
    extra = {{}} if version == 1 else {{"aux_layer_ids": (1, 2, 3)}}
    head = EagleHead(EagleConfig.from_target(target, version, **extra), target)
    batch = {{"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}}
    batch.update(target_features(target, ids, batch["attention_mask"], head.config))
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    loss, metrics = eagle_loss(head, batch, steps={steps}, chunk_size={chunk}, reduction="sum")
    loss.backward()
    results[version] = {{"peak": status("VmHWM") - before, "tokens": int(metrics["tokens"]),
                        "finite": bool(torch.isfinite(loss))}}
    del head, batch, loss, metrics
print(json.dumps(results))
"""


def peaks_of_steps(scored: int) -> dict[int, dict]:
    """{version: {peak, tokens, finite}} of one EAGLE-3 and one EAGLE-1 step, in a new process."""
    code = STEPS_SCRIPT.format(repo=str(REPO), vocab=VOCAB, T=T, steps=STEPS, chunk=CHUNK,
                               scored=scored)
    # every allocation over 64 kB is its own mmap, returned when freed (glibc otherwise raises
    # this threshold up to 32 MB and keeps freed blocks below it, which RSS would still count)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {int(k): v for k, v in out.items()}


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def check_peaks(scored: int) -> None:
    for version, out in peaks_of_steps(scored).items():
        assert out["finite"] and out["tokens"] == min(scored, T - 2)
        assert BOUND[version] < ONE_FULL_TENSOR / 2
        assert out["peak"] < BOUND[version], (
            f"EAGLE-{version} step peaked at {out['peak'] / MB:.0f} MB over its start, bound "
            f"{BOUND[version] / MB:.0f} MB (one unchunked (1, T, V) float32 tensor: "
            f"{ONE_FULL_TENSOR / MB:.0f} MB)")


needs_proc = pytest.mark.skipif(not _can_reset_peak(), reason="needs Linux's /proc/self/clear_refs")


@needs_proc
def test_a_training_step_on_a_128k_vocabulary_stays_under_the_bound():
    """T = 2048 tokens, the last 256 scored (a chat row: a prompt, then the answer)."""
    check_peaks(scored=256)


@needs_proc
@pytest.mark.slow
def test_a_fully_scored_step_on_a_128k_vocabulary_stays_under_the_bound():
    """All 2048 positions scored: eight times the chunks, the same bound."""
    check_peaks(scored=T)
