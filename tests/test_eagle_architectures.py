"""The EAGLE head is a Llama layer whatever the target: its rotary tables equal the target's, it
trains on Qwen3, Qwen2 and Mistral targets, exports to every EAGLE format and reloads with
identical draft logits; artifacts written when the head copied the target's (Llama) layer class
still load and give identical logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from draftsmith.heads.eagle import EagleHead, build_draft_vocab, load_eagle, save_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.eagle_loss import EagleLoss
from draftsmith.layouts.eagle import load_eagle_head
from draftsmith.layouts.export import export
from draftsmith.layouts.table import all_formats
from draftsmith.targets.features import target_features
from draftsmith.targets.target import wrap_target

VOCAB, DRAFT_VOCAB, AUX = 80, 32, (1, 2, 3)
FORMAT1 = Path(__file__).resolve().parent / "data" / "eagle_format1"
SHAPES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
# name -> (config class, model class, settings beyond the shapes): head_dim other than
# hidden / heads (Qwen3), q/k/v biases (Qwen2), a sliding window (Mistral), several rope settings
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM,
              dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64},
                   max_position_embeddings=512, rms_norm_eps=1e-5)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM,
              dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                   max_position_embeddings=512, rms_norm_eps=1e-6)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM,
              dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                    "original_max_position_embeddings": 128},
                   max_position_embeddings=512, rms_norm_eps=1e-6)),
    "mistral": (MistralConfig, MistralForCausalLM,
                dict(sliding_window=64, max_position_embeddings=512, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def make_target(kind: str, dtype=torch.float32, seed=0):
    config_class, model_class, settings = ARCHITECTURES[kind]
    config = config_class(**SHAPES, **settings)
    config.architectures = [model_class.__name__]  # as a hub checkpoint's config says
    torch.manual_seed(seed)
    model = model_class(config).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return wrap_target(model, name=f"tiny-{kind}")


def maps():
    return build_draft_vocab(torch.arange(VOCAB).flip(0) % 7, DRAFT_VOCAB)


def make_head(target, version, seed=1):
    torch.manual_seed(seed)
    if version == 1:
        return EagleHead(EagleConfig.from_target(target, 1), target)
    cfg = EagleConfig.from_target(target, 3, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB)
    d2t, t2d = maps()
    return EagleHead(cfg, target, d2t=d2t, t2d=t2d)


def batch_for(target, head, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 24), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, 18:] = 0
    attention[2, 11:] = 0
    loss_mask = attention.clone()
    loss_mask[:, :4] = 0
    batch = {"input_ids": ids * attention, "attention_mask": attention, "loss_mask": loss_mask}
    batch.update(target_features(target, batch["input_ids"], attention, head.config))
    return batch


def draft_logits(head, target):
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8, 61, 2, 50]])
    feats = head.fuse(target_features(target, ids, None, head.config)["features"])
    with torch.no_grad():
        return head(ids, feats, torch.arange(ids.shape[1])[None])


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_rotary_tables_equal_the_targets(kind):
    target = make_target(kind)
    head = make_head(target, 3)
    x = torch.zeros(1, 1, dtype=torch.float32)
    for positions in (torch.arange(300)[None], torch.tensor([[0, 7, 63, 64, 65, 127, 128, 511]])):
        ours = head.frozen.rotary(x, positions)
        theirs = target.decoder.rotary_emb(x, positions)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    layer = head.decoder_layer
    assert type(layer) is LlamaDecoderLayer
    assert head.layer_config.model_type == "llama"
    tc = target.config
    assert head.layer_config.head_dim == (getattr(tc, "head_dim", None)
                                           or tc.hidden_size // tc.num_attention_heads)
    assert head.layer_config.rms_norm_eps == target.config.rms_norm_eps
    assert head.config.layer_config["architectures"] == target.config.architectures
    assert not any("q_norm" in n or "k_norm" in n or n.endswith(".bias")
                   for n in head.state_dict())


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "mistral"])
def test_train_export_reload_gives_identical_draft_logits(tmp_path, kind, version):
    target = make_target(kind)
    head = make_head(target, version)
    batch = batch_for(target, head)
    step = EagleLoss(head, steps=3, chunk_size=16)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    start = {k: v.clone() for k, v in head.state_dict().items()}
    losses = []
    for _ in range(4):
        loss, metrics = step(batch, reduction="sum")
        optimizer.zero_grad()
        (loss / metrics["tokens"]).backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert not torch.equal(start["fc.weight"], head.state_dict()["fc.weight"])
    artifact = save_eagle(head, tmp_path / "artifact", target)
    expected = draft_logits(head, target)
    for a, b in zip(draft_logits(load_eagle(artifact, target), target), expected):
        assert torch.equal(a, b)
    # gguf is llama.cpp's converter's work, served in tests/test_llama_cpp.py
    for fmt in [f for f in all_formats()[head.config.method] if f != "gguf"]:
        # speculators names its verifier by hub id and ships the target's embedding
        extra = {"verifier": "org/tiny", "target": target} if fmt == "speculators" else {}
        out = export(artifact, fmt, tmp_path / fmt, **extra)
        loaded = load_eagle_head(out, target)
        for a, b in zip(draft_logits(loaded, target), expected):
            assert torch.equal(a, b), fmt
        config = json.loads((out / "config.json").read_text())
        llama = config.get("transformer_layer_config", config)
        assert llama["model_type"] == "llama" and llama["head_dim"] == head.config.head_dim
        assert llama["rms_norm_eps"] == target.config.rms_norm_eps


def fixed_target():
    """The target the format-1 fixture was written against: seeded weights, no init dependence."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_theta=500.0, rms_norm_eps=1e-5, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).to(torch.float64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3
                    + (1.0 if p.dim() == 1 else 0.0))
    return wrap_target(model, name="tiny-format1")


@pytest.mark.parametrize("version", [1, 3])
def test_artifacts_from_the_target_layer_class_era_load_with_identical_logits(version):
    """tests/data/eagle_format1: written by the previous code (see SOURCES.md there)."""
    target = fixed_target()
    expected = load_file(str(FORMAT1 / "expected.safetensors"))
    head = load_eagle(FORMAT1 / f"eagle{version}", target)
    ids, features = expected["input_ids"], expected[f"features{version}"]
    # the same computation up to summation order (threads, CPU): float64 leaves 1e-12 for that
    close = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(target_features(target, ids, None, head.config)["features"],
                               features, **close)
    with torch.no_grad():
        hidden, logits = head(ids, head.fuse(features), torch.arange(ids.shape[1])[None])
    torch.testing.assert_close(hidden, expected[f"hidden{version}"], **close)
    torch.testing.assert_close(logits, expected[f"logits{version}"], **close)


def test_an_artifact_of_another_layer_class_is_refused_with_what_to_do(tmp_path):
    target = make_target("qwen3")
    head = make_head(target, 1)
    artifact = save_eagle(head, tmp_path / "a", target)
    meta = json.loads((artifact / "config.json").read_text())
    meta["layer_config"] = {**target.config.to_dict(), "num_hidden_layers": 1}  # the old layout
    (artifact / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="'qwen3' decoder layer.*retrain"):
        load_eagle(artifact, target)
