"""The memory estimate the trainers check before loading a target (train/memory.py).

Its per-token figures must cover what scripts/memory_growth.py measured on this kind of machine
(reports/memory_growth.json), without being so loose that a run which fits is refused; a run that
cannot fit is refused before the target is loaded, naming the estimate and the keys to change.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.train.eagle import EagleTrainConfig
from draftsmith.train.estimate import DoesNotFit, Shape
from draftsmith.train.memory import estimate

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "reports" / "memory_growth.json"
WIDTHS = {
    "smollm2-135m": Shape(576, 1536, 30, 9, 3, 64, 49152, True),
    "llama-3.1-8b": Shape(4096, 14336, 32, 32, 8, 128, 128256, False),
    "tiny": Shape(128, 256, 4, 4, 2, 32, 2048, False),
}
MIB = 1024 ** 2


def measured_growth() -> list[tuple[dict, int, float]]:
    """(spec, first token count, MiB added) for every pair of measurements that differ only in
    tokens."""
    rows = json.loads(REPORT.read_text())["measurements"]
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        key = json.dumps({k: v for k, v in row.items() if k not in ("tokens", "step_mib",
                                                                      "seconds")}, sort_keys=True)
        by_key.setdefault(key, []).append(row)
    out = []
    for group in by_key.values():
        group.sort(key=lambda r: r["tokens"])
        for a, b in zip(group, group[1:], strict=False):
            out.append((b, a["tokens"], b["step_mib"] - a["step_mib"]))
    return out


def estimated_growth(spec: dict, first: int) -> float:
    """What the estimate adds (MiB) from ``first`` tokens to the measurement's: the trained
    module's activations and the loss chunk (256 positions, as the measurement's losses)."""
    shape = WIDTHS[spec["width"]]
    cfg = SimpleNamespace(
        version=3 if spec["kind"] == "eagle3" else 1, draft_vocab_size=spec.get("draft_vocab"),
        ttt_steps=spec.get("steps", 1), gradient_checkpointing=spec.get("checkpointing", False),
        num_heads=spec.get("heads", 4), num_layers=1, share_lm_head=True, medusa2=False, lora_r=16,
        soft_labels=False,
        loss_chunk_size=256, per_device_batch_size=1, max_tokens_per_batch=None,
        mixed_precision="bf16" if spec.get("autocast") == "bf16" else "no",
        packing=bool(spec.get("packed")), attention="auto", target_parallel=1,
        gradient_accumulation_steps=1)
    trainer = "eagle" if spec["kind"].startswith("eagle") else "medusa"

    def growing(tokens: int) -> float:
        cfg.max_length = tokens
        parts = estimate(trainer, cfg, shape).parts
        return sum(v for k, v in parts.items() if "activations" in k or "loss chunk" in k)

    return (growing(spec["tokens"]) - growing(first)) / MIB


def test_the_estimate_covers_the_measured_growth():
    pairs = [p for p in measured_growth() if p[0]["kind"] in ("eagle3", "eagle1", "medusa1")
             and "autocast" not in p[0]]  # bf16 autocast on a CPU without bf16: not a GPU's
    assert len(pairs) >= 8, "reports/memory_growth.json lacks the head measurements"
    for spec, first, measured in pairs:
        est = estimated_growth(spec, first)
        assert est >= measured - 8, (spec, est, measured)  # 8 MiB: the allocator's granularity
        if spec["width"] == "smollm2-135m":  # and not absurdly loose where activations set the
            # peak; at the 8B width and a few hundred tokens the peak is the ~1 GB of gradients
            # arriving in the backward pass, by when most activations are freed
            assert est <= 3 * measured + 16, (spec, est, measured)


def test_the_estimate_covers_eagle_packing_and_its_attention_at_the_tests_width():
    """At hidden 128 the test-time attention's own tensors and the packed rows' masks (the
    CPU's SDPA kernel needs one per step to tell documents apart) are a visible share of a
    step: the estimate covers the measured growth with and without packing, within 1.5x."""
    pairs = [p for p in measured_growth() if p[0]["width"] == "tiny"]
    assert {bool(spec.get("packed")) for spec, _, _ in pairs} == {False, True}
    for spec, first, measured in pairs:
        est = estimated_growth(spec, first)
        assert measured - 8 <= est <= 1.5 * measured, (spec, est, measured)


def test_a_decoder_layer_matches_its_shape_count():
    from draftsmith.train.estimate import LAYER_FACTOR

    layers = {}
    for row in json.loads(REPORT.read_text())["measurements"]:
        if row["kind"] == "decoder_backward" and "autocast" not in row:
            layers[(row["width"], row["tokens"], row["layers"])] = row["step_mib"]
    checked = 0
    for (width, tokens, n), mib in layers.items():
        if n == 2 and (width, tokens, 1) in layers:
            per_layer = (mib - layers[(width, tokens, 1)]) * MIB / tokens
            counted = WIDTHS[width].layer_saved_per_token() * 4
            assert counted <= per_layer * 1.2 and per_layer <= counted * LAYER_FACTOR, \
                (width, tokens, per_layer, counted)
            checked += 1
    assert checked >= 2


def test_the_8b_recipes_fit_an_80gb_gpu_and_the_full_vocabulary_does_not_at_a_huge_budget():
    from draftsmith.train.config import parse_config

    root = Path(__file__).resolve().parents[1]
    llama = WIDTHS["llama-3.1-8b"]
    cfg = parse_config(EagleTrainConfig, ["--config", str(root / "configs/eagle/llama-3.1-8b-"
                                                               "instruct.yaml")])
    fits = estimate("eagle", cfg, llama, device="cuda", processes=8)
    assert fits.total < 70 * 1024 ** 3, fits.table()
    cfg.draft_vocab_size, cfg.max_tokens_per_batch, cfg.gradient_checkpointing = None, 65536, False
    assert estimate("eagle", cfg, llama, device="cuda", processes=8).total > 141 * 1024 ** 3



def test_the_8b_block_drafts_fit_and_their_blocks_are_counted_honestly():
    from draftsmith.train.config import parse_config
    from draftsmith.train.dflash import DFlashTrainConfig

    root = Path(__file__).resolve().parents[1]
    llama = WIDTHS["llama-3.1-8b"]
    cfg = parse_config(DFlashTrainConfig, ["--config", str(root / "configs/dflash/llama-3.1-8b-"
                                                               "instruct.yaml")])
    fits = estimate("dflash", cfg, llama, device="cuda", processes=8)
    assert fits.total < 70 * 1024 ** 3, fits.table()

    def blocks(**keys) -> float:
        for k, v in keys.items():
            setattr(cfg, k, v)
        return next(v for k, v in estimate("dflash", cfg, llama, device="cuda").parts.items()
                    if k.startswith("block activations"))

    kept = blocks(gradient_checkpointing=False)
    assert blocks(gradient_checkpointing=True) < kept / 3  # each layer recomputed in backward
    # rows by count: at most `anchors` blocks per row, so fewer anchors, fewer blocks
    assert blocks(gradient_checkpointing=False, anchors=cfg.anchors // 2) < 0.6 * kept
    # a token budget's rows may be as short as a prompt: every position may start a block
    budget = blocks(anchors=512, max_tokens_per_batch=cfg.per_device_batch_size * cfg.max_length)
    assert budget > 4 * kept


def test_a_run_that_cannot_fit_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    import draftsmith.train.eagle as trainer

    target = tmp_path / "target"
    target.mkdir()  # config.json alone: the estimate needs no weights
    (target / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 128256, "tie_word_embeddings": False}))
    monkeypatch.delenv("DRAFTSMITH_SKIP_MEMORY_CHECK", raising=False)

    def never(*args, **kwargs):
        raise AssertionError("the target was loaded before the memory check")

    import draftsmith.train.features as features

    monkeypatch.setattr(features, "load_feature_target", never)
    monkeypatch.setattr(trainer, "load_feature_target", never)
    cfg = EagleTrainConfig(target=str(target), data=["unused.jsonl"], output_dir=str(tmp_path / "o"),
                           max_tokens_per_batch=2 ** 34, max_length=2048, version=3,
                           mixed_precision="no")  # the process's accelerator state is fp32
    with pytest.raises(DoesNotFit) as refused:
        trainer.build(cfg)
    message = str(refused.value)
    assert "GiB" in message and "max_tokens_per_batch" in message
    assert "draft_vocab_size" in message and "loss_chunk_size" in message
    assert "17179869184 tokens" in message  # the budget it was given


@pytest.mark.parametrize("hub_id, billions", [
    ("meta-llama/Llama-3.1-8B-Instruct", 8.030), ("meta-llama/Llama-3.2-1B-Instruct", 1.236),
    ("Qwen/Qwen3-8B", 8.191), ("Qwen/Qwen3-0.6B", 0.596),
    ("meta-llama/Llama-3.3-70B-Instruct", 70.554)])
def test_shipped_shapes_count_the_published_parameters(hub_id, billions):
    """data/target_configs/ stands in for a model not downloaded: its shapes give the parameter
    count each model card states (embedding, layers, final norm and an untied LM head)."""
    from draftsmith.train.estimate import model_shape

    shape = model_shape(hub_id)
    params = (shape.vocab * shape.hidden * (1 if shape.tied else 2)
              + shape.layers * shape.layer_params() + shape.hidden)
    assert params / 1e9 == pytest.approx(billions, rel=2e-3)


@pytest.mark.parametrize("config", sorted(
    str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*/*.yaml")
    if "8b" in p.name or "70b" in p.name))
def test_every_shipped_large_recipe_is_estimated_before_any_download(config, capsys):
    """python -m draftsmith.train.memory prints each 8B / 70B recipe's estimate from the shipped shapes
    alone, and the recipe fits one 80 GB GPU of eight as the README's table says."""
    from draftsmith.train.memory import main

    extra = ["--fsdp2"] if "dflash/llama-3.3-70b" in config else []
    est = main(["--config", str(REPO / config), "--processes", "8", *extra])
    assert est.total < 80 * 2**30
    assert "peak:" in capsys.readouterr().out
