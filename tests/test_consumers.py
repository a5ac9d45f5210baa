"""Slow: our EAGLE-3 speculators export loaded by speculators 0.9.0 itself, and a head built as
speculators' trainer builds one read by draftsmith, on the real target.

The first run builds an isolated venv (CPU torch 2.13.0 + speculators 0.9.0 from PyPI, about
1 GB) under ``<draftsmith cache>/consumer-venvs/``; later runs reuse it. The verifier is the
embedded SmolLM2 target, recorded by its hub id HuggingFaceTB/SmolLM2-135M-Instruct and served to
speculators from an offline Hugging Face cache built from the local converted directory.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.heads.eagle import EagleHead, build_draft_vocab, save_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.layouts.consumer_check import install_speculators, run_speculators_check
from draftsmith.layouts.eagle import load_eagle_head
from draftsmith.layouts.export import export
from draftsmith.targets.features import target_features


@pytest.fixture(scope="module")
def smollm2():
    from draftsmith.targets.target import load_target

    return load_target("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def speculators_python():
    return install_speculators()


@pytest.mark.slow
@pytest.mark.parametrize("draft_vocab,dtype", [(8192, torch.float32), (None, torch.float32),
                                               (8192, torch.bfloat16)])
def test_speculators_loads_our_eagle3_export(tmp_path, smollm2, speculators_python, draft_vocab,
                                             dtype):
    target = smollm2
    torch.manual_seed(0)
    cfg = EagleConfig.from_target(target, 3, draft_vocab_size=draft_vocab)
    maps = {}
    if draft_vocab:
        counts = torch.randint(0, 1000, (target.vocab_size,), generator=torch.Generator()
                               .manual_seed(1))
        maps = dict(zip(("d2t", "t2d"), build_draft_vocab(counts, draft_vocab)))
    head = EagleHead(cfg, target, dtype=dtype, **maps).eval()
    with torch.no_grad():  # a trained-looking head: no norm left at exactly one
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    artifact = save_eagle(head, tmp_path / "artifact", target)
    # no --verifier, no --target: both come from what the artifact records (smollm2-135m)
    out = export(artifact, "speculators", tmp_path / "speculators")

    ids = torch.randint(0, target.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    features = target_features(target, ids, None, cfg)["features"]  # (1, 16, 3h)
    report = run_speculators_check(speculators_python, out, target.path, features, ids)
    assert report["class"] == "Eagle3DraftModel"
    assert report["missing"] == [] and report["unexpected"] == []
    assert report["uninitialised"] == [] and report["mismatched"] == []
    with torch.no_grad():
        _, ours = head(ids, head.fuse(features), torch.arange(16)[None])
    theirs = report["logits"]
    assert theirs.shape == ours.shape == (1, 16, draft_vocab or target.vocab_size)
    if dtype == torch.float32:
        torch.testing.assert_close(theirs, ours.float(), rtol=1e-4, atol=1e-4)
    else:  # bf16 both sides; the kernels may round differently
        torch.testing.assert_close(theirs, ours.float(), rtol=0.05, atol=0.1)
        agree = (theirs.argmax(-1) == ours.float().argmax(-1)).float().mean()
        assert agree >= 0.9


@pytest.mark.slow
def test_export_check_runs_speculators_when_its_venv_exists(tmp_path, smollm2, speculators_python,
                                                            capsys):
    from draftsmith.layouts.export import main

    cfg = EagleConfig.from_target(smollm2, 3, draft_vocab_size=8192)
    d2t, t2d = build_draft_vocab(torch.arange(smollm2.vocab_size) % 97, 8192)
    artifact = save_eagle(EagleHead(cfg, smollm2, d2t=d2t, t2d=t2d), tmp_path / "a", smollm2)
    assert main([str(artifact), "--format", "speculators", "--out", str(tmp_path / "s"),
                 "--check"]) == 0
    printed = capsys.readouterr().out
    assert "verified: round trip: speculators export read back" in printed
    assert ("verified: speculators 0.9.0 SpeculatorModel.from_pretrained: Eagle3DraftModel, no "
            "missing, unexpected or uninitialised weights") in printed


@pytest.mark.slow
@pytest.mark.parametrize("draft_vocab", ["full", "8192"])
def test_we_compute_what_speculators_trains(tmp_path, smollm2, speculators_python, draft_vocab):
    """speculators' own EAGLE-3 draft with its trainer's defaults (norm_before_fc,
    norm_before_residual, norm_output, a sliding window), read by draftsmith: the same logits at
    the first two training-time-test steps, the second reading the first's (normed) output."""
    target = smollm2
    ids = torch.randint(0, target.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    config = EagleConfig.from_target(target, 3)
    features = target_features(target, ids, None, config)["features"]  # (1, 16, 3h)
    save_file({"features": features.contiguous(), "input_ids": ids.contiguous()},
              str(tmp_path / "inputs.st"))
    script = Path(__file__).parent / "fixtures" / "speculators_trained_head.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([str(speculators_python), str(script), str(target.path),
                           str(tmp_path / "inputs.st"), str(tmp_path), draft_vocab],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = load_file(str(tmp_path / "logits.st"))

    head = load_eagle_head(tmp_path / "head", target).eval()
    cfg = head.config
    assert (cfg.norm_before_fc, cfg.norm_before_residual, cfg.norm_output) == (True, True, True)
    assert cfg.sliding_window == 2048 and "input_norm.weight" in head.state_dict()
    n = ids.shape[1]
    positions = torch.arange(n)[None]
    cache = head.new_cache()
    with torch.no_grad():
        out, step0 = head(ids, head.fuse(features), positions, cache=cache)
        # step 1: each position's second entry, attending to step 0's keys up to it and itself
        shifted = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)
        allowed = torch.cat([torch.ones(n, n).tril(), torch.eye(n)], dim=1).bool()
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
        _, step1 = head(shifted, out, positions + 1, attention_mask=mask, cache=cache)
    torch.testing.assert_close(step0, theirs["step0"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step1, theirs["step1"], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="last 2048 positions"):
        head(ids[:, :1], out[:, :1], torch.tensor([[2048]]))
