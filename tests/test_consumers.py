"""Slow: our EAGLE-3 speculators export loaded by speculators 0.9.0 itself, on the real target.

The first run builds an isolated venv (CPU torch 2.13.0 + speculators 0.9.0 from PyPI, about
1 GB) under ``<draftsmith cache>/consumer-venvs/``; later runs reuse it. The verifier is the
embedded SmolLM2 target, recorded by its hub id HuggingFaceTB/SmolLM2-135M-Instruct and served to
speculators from an offline Hugging Face cache built from the local converted directory.
"""

from __future__ import annotations

import pytest
import torch

from heads.eagle import EagleConfig, EagleHead, build_draft_vocab, save_eagle
from heads.eagle_loss import target_features
from layouts.consumer_check import install_speculators, run_speculators_check
from layouts.export import export


@pytest.fixture(scope="module")
def smollm2():
    from heads.target import load_target

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
    from layouts.export import main

    cfg = EagleConfig.from_target(smollm2, 3, draft_vocab_size=8192)
    d2t, t2d = build_draft_vocab(torch.arange(smollm2.vocab_size) % 97, 8192)
    artifact = save_eagle(EagleHead(cfg, smollm2, d2t=d2t, t2d=t2d), tmp_path / "a", smollm2)
    assert main([str(artifact), "--format", "speculators", "--out", str(tmp_path / "s"),
                 "--check"]) == 0
    printed = capsys.readouterr().out
    assert "verified: round trip: speculators export read back" in printed
    assert ("verified: speculators 0.9.0 SpeculatorModel.from_pretrained: Eagle3DraftModel, no "
            "missing, unexpected or uninitialised weights") in printed
