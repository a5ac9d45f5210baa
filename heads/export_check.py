"""``python -m heads.export ... --check``: verify an export, and say what could not be verified.

1. Round trip: the export read back by :mod:`heads.public_heads` gives the artifact's own draft
   logits (EAGLE: on the target's features for random tokens; Medusa: on random hidden states;
   distilled draft: the model's logits).
2. Consumer: speculators exports are loaded with speculators 0.9.0's own ``from_pretrained`` in
   its pinned venv when that venv has been built (``python -m heads.consumer_check install``):
   no missing, unexpected or uninitialised weights, and the same logits. vLLM, SGLang and
   TensorRT-LLM need GPU builds and FasterDecoding's loader a CUDA base model, so those are
   reported as not verified on this machine (the test suite checks each layout against rules
   read from the pinned consumer's source: tests/fixtures/consumers/).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from heads.artifact import read_artifact_config
from heads.target import Target

# what cannot be run here, per format
_ELSEWHERE = {
    "vllm": "vLLM 0.33.0 needs a GPU build",
    "sglang": "SGLang 0.5.23 needs a GPU build",
    "trtllm": "TensorRT-LLM needs a GPU build (convert with the printed convert_checkpoint.py "
              "command there)",
    "fasterdecoding": "FasterDecoding/Medusa loads its base model on a GPU and reads "
                      "medusa_lm_head.pt, which draftsmith does not load back",
    "vllm-0.32": "vLLM 0.32.0 needs a GPU build",
    "hf": None,
}


def _say(kind: str, text: str) -> None:
    print(f"{kind:>13}: {text}", flush=True)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _eagle_inputs(target: Target, version: int, aux, seed: int = 0):
    from heads.eagle import EagleConfig

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (1, 12), generator=gen).to(target.device)
    cfg = EagleConfig.from_target(target, version, aux_layer_ids=aux if version == 3 else None)
    from heads.eagle import target_features

    return ids, target_features(target, ids, None, cfg)["features"]


def _eagle_logits(head, ids, features):
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    return head(ids, head.fuse(features), positions)[1]


def check_export(artifact_dir: str | os.PathLike, fmt: str, out_dir: str | os.PathLike,
                 target: Target | str | os.PathLike | None = None) -> bool:
    """Print what was verified and what was not; False when a check failed."""
    from heads.export import artifact_method, find_target

    artifact_dir, out_dir = Path(artifact_dir), Path(out_dir)
    method = artifact_method(artifact_dir)
    meta = read_artifact_config(artifact_dir) if method != "draft" else {}
    ok = True
    if method in ("eagle1", "eagle3"):
        ok = _check_eagle(artifact_dir, fmt, out_dir, meta, find_target(meta, target))
    elif method == "medusa":
        ok = _check_medusa(artifact_dir, fmt, out_dir, meta, target)
    else:
        ok = _check_draft(artifact_dir, out_dir)
    if _ELSEWHERE.get(fmt):
        _say("not verified", f"loading by the consumer itself: {_ELSEWHERE[fmt]}; names, shapes "
             "and config keys follow its pinned loader (draftsmith's tests check them against "
             "rules read from its source)")
    return ok


def _check_eagle(artifact_dir, fmt, out_dir, meta, target) -> bool:
    from heads.eagle import load_eagle
    from heads.public_heads import load_eagle_head

    if target is None:
        _say("not verified", "round trip and consumer load: the target is needed (pass --target)")
        return True
    head = load_eagle(artifact_dir, target).eval()
    back = load_eagle_head(out_dir, target).eval()
    ids, features = _eagle_inputs(target, head.version, head.config.aux_layer_ids)
    with torch.no_grad():
        ours = _eagle_logits(head, ids, features)
        theirs = _eagle_logits(back, ids, features)
    ok = torch.equal(ours, theirs)
    _say("verified" if ok else "FAILED",
         f"round trip: {fmt} export read back gives the artifact's draft logits "
         f"(max |diff| {_max_diff(ours, theirs):.3g} over {ids.shape[1]} positions)")
    if fmt != "speculators":
        return ok
    from heads.consumer_check import run_speculators_check, speculators_python

    python = speculators_python()
    if python is None:
        _say("not verified", "speculators' own from_pretrained: its venv is not built here "
             "(python -m heads.consumer_check install, about 1 GB, CPU torch)")
        return ok
    if target.path is None:
        _say("not verified", "speculators load: the target has no local directory to serve as "
             "the verifier")
        return ok
    report = run_speculators_check(python, out_dir, target.path, features.float().cpu(),
                                   ids.cpu())
    problems = {k: report[k] for k in ("missing", "unexpected", "uninitialised", "mismatched")
                if report[k]}
    diff = _max_diff(report["logits"], ours.float().cpu())
    tol = 1e-3 if head.dtype == torch.float32 else 3e-2
    scale = float(ours.abs().max())
    good = not problems and diff <= tol * max(1.0, scale)
    _say("verified" if good else "FAILED",
         f"speculators 0.9.0 SpeculatorModel.from_pretrained: {report['class']}, "
         + (f"problems {problems}, " if problems else "no missing, unexpected or uninitialised "
            "weights, ")
         + f"logits max |diff| {diff:.3g} from draftsmith's head")
    return ok and good


def _check_medusa(artifact_dir, fmt, out_dir, meta, target) -> bool:
    from heads.export import find_target
    from heads.medusa import MedusaConfig, load_medusa, load_medusa_export

    if MedusaConfig.from_dict(meta).reads_target_lm_head and not isinstance(target, Target):
        target = find_target(meta, target)
        if target is None:
            _say("not verified", "round trip: heads sharing the target's LM head need the target "
                 "(pass --target)")
            return True
    art = load_medusa(artifact_dir, target=target if isinstance(target, Target) else None,
                      device="cpu")
    back = load_medusa_export(out_dir)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, art.heads.config.hidden_size, generator=gen)
    with torch.no_grad():
        ours = art.heads(hidden.to(art.heads.lm_head_weight(0).dtype))
        theirs = back(hidden.to(back.lm_head_weight(0).dtype))
    ok = ours.shape == theirs.shape and torch.equal(ours, theirs.to(ours.dtype))
    # the same draft ids must name the same target ids (a wrong token_map keeps the logits)
    ids = torch.arange(art.heads.config.head_vocab_size)
    ok = ok and art.heads.config.head_vocab_size == back.config.head_vocab_size and torch.equal(
        art.heads.draft_to_target(ids), back.draft_to_target(ids))
    _say("verified" if ok else "FAILED",
         f"round trip: {fmt} export read back gives the artifact's {art.heads.num_heads} heads' "
         f"logits (max |diff| {_max_diff(ours, theirs):.3g})")
    if fmt == "fasterdecoding":
        _say("not verified", "medusa_lm_head.pt is not read back (draftsmith never loads "
             "pickles); it was written from the same tensors as medusa_lm_head.safetensors")
    return ok


def _check_draft(artifact_dir, out_dir) -> bool:
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(artifact_dir, trust_remote_code=False).eval()
    b = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=False).eval()
    ids = torch.randint(0, a.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ok = torch.equal(a(ids).logits, b(ids).logits)
    _say("verified" if ok else "FAILED",
         "round trip: transformers loads the export with the artifact's logits")
    return ok
