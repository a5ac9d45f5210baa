"""How a training step's memory grows with tokens, test-time steps, width and precision.

    python scripts/memory_growth.py [--out reports/memory_growth.json] [--only KIND ...] [--width W ...]

Each measurement runs in a fresh process: it builds the model (random weights, the real shapes)
and a batch, resets the resident set's high-water mark (``/proc/self/clear_refs``), runs one
forward and backward of the trainer's own loss, and reports how far the high-water mark rose
above where it stood (the weights, gradients' buffers and the batch are already there). glibc
returns large frees to the system (``MALLOC_MMAP_THRESHOLD_``), so the mark follows live tensors.

Shapes: SmolLM2-135M (hidden 576, intermediate 1536, 9 heads / 3 kv, vocabulary 49152),
the tests' width ``tiny`` (hidden 128, 4 heads / 2 kv: EAGLE-3 with padded and packed rows, where
the test-time attention's own tensors and masks show) and Llama-3.1-8B (hidden 4096,
intermediate 14336, 32 heads / 8 kv, vocabulary 128256), the latter
with only the layers a measurement needs (an EAGLE head reads three hidden states and the
embedding and LM head; a decoder layer's cost is per layer). Every figure is a difference between
two runs of the same shapes (more tokens, one more test-time step, one more layer), so the
per-token and per-step growth is measured, not assumed. ``train/memory.py`` turns them into the
estimates the trainers check before loading a target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WIDTHS = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, head_dim=64),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, head_dim=128),
    # the tests' width, where attention's own memory is a visible share of a step
    "tiny": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, head_dim=32),
}
# packed measurements: documents of this many tokens laid end to end
DOCUMENT = 256


def measurements() -> list[dict]:
    specs = []
    for width, tokens, draft in (("smollm2-135m", (512, 1024), 8192),
                                 ("llama-3.1-8b", (128, 256), 32000)):
        for t in tokens:
            for steps in (1, 2):
                specs.append(dict(kind="eagle3", width=width, tokens=t, steps=steps,
                                  draft_vocab=draft, checkpointing=False))
            specs.append(dict(kind="eagle3", width=width, tokens=t, steps=2, draft_vocab=draft,
                              checkpointing=True))
            specs.append(dict(kind="eagle1", width=width, tokens=t))
            specs.append(dict(kind="medusa1", width=width, tokens=t, heads=4))
            for layers in (1, 2):
                specs.append(dict(kind="target_forward", width=width, tokens=t, layers=layers))
                specs.append(dict(kind="decoder_backward", width=width, tokens=t, layers=layers))
    # precision: the same head under bf16 autocast (what a GPU runs), at the small width
    for t in (512, 1024):
        specs.append(dict(kind="eagle3", width="smollm2-135m", tokens=t, steps=2,
                          draft_vocab=8192, checkpointing=False, autocast="bf16"))
    specs += tiny_measurements()
    return specs


def tiny_measurements() -> list[dict]:
    """EAGLE-3 at the tests' width, three test-time steps, rows padded or packed (documents of
    DOCUMENT tokens: the CPU's attention then needs a mask per step)."""
    return [dict(kind="eagle3", width="tiny", tokens=t, steps=3, draft_vocab=512,
                 checkpointing=False, packed=packed)
            for packed in (False, True) for t in (1024, 2048)]


def name_of(spec: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in spec.items())


# ------------------------------------------------------------------------------------------------
# One measurement (the child process)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _model(width: str, layers: int, vocab: int | None = None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shapes = dict(WIDTHS[width])
    if vocab is not None:
        shapes["vocab_size"] = vocab
    config = LlamaConfig(**shapes, num_hidden_layers=layers, max_position_embeddings=8192,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def child(spec: dict) -> dict:
    import torch

    from draftsmith.targets.target import wrap_target

    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t, kind = spec["tokens"], spec["kind"]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if spec.get("autocast") == "bf16" \
        else torch.autocast("cpu", enabled=False)
    shapes = WIDTHS[spec["width"]]
    h, vocab = shapes["hidden_size"], shapes["vocab_size"]
    ids = torch.randint(0, vocab, (1, t))
    mask = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids)
    if kind in ("eagle3", "eagle1"):
        from draftsmith.heads.eagle import EagleHead, build_draft_vocab
        from draftsmith.heads.eagle_config import EagleConfig
        from draftsmith.heads.eagle_loss import EagleLoss

        target = wrap_target(_model(spec["width"], layers=4), name=spec["width"])
        version = 3 if kind == "eagle3" else 1
        draft = spec.get("draft_vocab") if version == 3 else None
        config = EagleConfig.from_target(target, version, draft_vocab_size=draft,
                                         aux_layer_ids=[1, 2, 3] if version == 3 else None)
        maps = {}
        if draft:
            maps = dict(zip(("d2t", "t2d"), build_draft_vocab(torch.arange(vocab) % 97, draft),
                            strict=True))
        head = EagleHead(config, target, dtype=torch.float32, **maps)
        model = EagleLoss(head, steps=spec.get("steps", 1), feature_noise=0.0,
                          gradient_checkpointing=spec.get("checkpointing", False))
        batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask,
                 "features": torch.randn(1, t, 3 * h if version == 3 else h),
                 "last_hidden": torch.randn(1, t, h)}
        if spec.get("packed"):  # documents end to end, positions restarting at each
            batch["position_ids"] = (torch.arange(t) % DOCUMENT)[None]

        def step():
            with autocast:
                loss, _ = model(batch, reduction="sum")
            loss.backward()
    elif kind == "medusa1":
        from draftsmith.heads.medusa import MedusaHeads
        from draftsmith.heads.medusa_loss import MedusaObjective
        from draftsmith.train.medusa import MedusaTrainConfig, loss_options

        target = wrap_target(_model(spec["width"], layers=1), name=spec["width"])
        heads = MedusaHeads.from_target(target, num_heads=spec["heads"], share_lm_head=True)
        model = MedusaObjective(heads, target, **loss_options(
            MedusaTrainConfig(num_heads=spec["heads"], share_lm_head=True)))
        teacher = torch.randn(1, t, h)

        def step():
            with autocast:
                loss, _ = model(ids, mask, loss_mask, teacher, reduction="sum")
            loss.backward()
    elif kind == "target_forward":
        target = wrap_target(_model(spec["width"], layers=spec["layers"], vocab=1024),
                             name=spec["width"])

        def step():
            with torch.no_grad(), autocast:
                target.decoder(input_ids=ids % 1024, attention_mask=mask, use_cache=False)
    elif kind == "decoder_backward":
        model = _model(spec["width"], layers=spec["layers"], vocab=1024).train()
        for p in model.model.layers.parameters():
            p.requires_grad_(True)

        def step():
            with autocast:
                out = model.model(input_ids=ids % 1024, attention_mask=mask, use_cache=False)
            out.last_hidden_state.float().square().mean().backward()
    else:
        raise ValueError(f"unknown measurement {kind!r}")

    step()  # warm-up: lazily built buffers; the gradients now exist, as after a real step
    trained = [] if kind == "target_forward" else list(model.parameters())
    for p in trained:
        if p.grad is not None:
            p.grad.zero_()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kb("VmHWM")
    started = time.perf_counter()
    step()
    seconds = time.perf_counter() - started
    peak = _status_kb("VmHWM")
    return {"step_mib": round((peak - before) / 1024, 1), "seconds": round(seconds, 1)}


# ------------------------------------------------------------------------------------------------
# The parent: every measurement in its own process


def _spec_of(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("step_mib", "seconds")}


def measure(spec: dict) -> dict:
    """One measurement in a fresh process: the spec with ``step_mib`` and ``seconds``."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{name_of(spec)} failed:\n{done.stderr[-2000:]}")
    return {**spec, **json.loads(done.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "reports" / "memory_growth.json"))
    parser.add_argument("--only", nargs="*", default=None, help="measurement kinds to run")
    parser.add_argument("--width", nargs="*", default=None, choices=sorted(WIDTHS),
                        help="widths to measure (the report keeps the others' earlier rows)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return {}
    results = []
    for spec in measurements():
        if args.only and spec["kind"] not in args.only:
            continue
        if args.width and spec["width"] not in args.width:
            continue
        result = measure(spec)
        print(json.dumps(result), flush=True)
        results.append(result)
    measured = {name_of(r) for r in (_spec_of(r) for r in results)}
    if Path(args.out).is_file():  # the rows not measured again are kept, in their place
        earlier = json.loads(Path(args.out).read_text()).get("measurements", [])
        kept = [r for r in earlier if name_of(_spec_of(r)) not in measured]
        results = kept + results
    report = {"machine": os.uname().machine, "what": __doc__.split("\n")[0],
              "measurements": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
