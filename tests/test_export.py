"""EAGLE export: serving layouts, the round trip back into a head, d2t/t2d, and the CLI.

(Medusa's export functions live in heads/medusa.py and are tested with Medusa; here only the
dispatch to them is checked.)
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from heads.eagle import (
    EagleConfig,
    EagleHead,
    build_draft_vocab,
    save_eagle,
    target_features,
)
from heads.export import FORMATS, export, load_exported_eagle, main
from heads.target import wrap_target

VOCAB, DRAFT_VOCAB, AUX = 80, 24, (1, 2, 3)


def make_target(vocab: int = VOCAB, hidden: int = 64):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    return wrap_target(LlamaForCausalLM(config).to(torch.float64), name="tiny-export")


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def maps():
    counts = torch.arange(VOCAB).flip(0) % 7  # an uneven histogram, ties included
    return build_draft_vocab(counts, DRAFT_VOCAB)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, target, maps):
    """version -> (head, artifact dir); heads with non-trivial norms so a swapped name shows."""
    out = {}
    root = tmp_path_factory.mktemp("artifacts")
    for version in (1, 3):
        torch.manual_seed(version)
        if version == 1:
            head = EagleHead(EagleConfig.from_target(target, 1), target)
        else:
            cfg = EagleConfig.from_target(
                target, 3, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB
            )
            head = EagleHead(cfg, target, d2t=maps[0], t2d=maps[1])
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
        out[version] = (head, save_eagle(head, root / f"eagle{version}", target))
    return out


def draft_logits(head, target):
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
    feats = head.fuse(target_features(target, ids, None, head.config)["features"])
    hidden, logits = head(ids, feats, torch.arange(ids.shape[1])[None])
    return hidden, logits


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
@pytest.mark.parametrize("version", [1, 3])
def test_round_trip_gives_identical_draft_logits(tmp_path, target, artifacts, version, fmt):
    head, artifact = artifacts[version]
    out = export(artifact, fmt, tmp_path / fmt)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_exported_eagle(out, target)
    assert loaded.config.aux_layer_ids == head.config.aux_layer_ids
    for a, b in zip(draft_logits(loaded, target), draft_logits(head, target)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_d2t_maps_every_draft_id_to_its_target_id(tmp_path, target, artifacts, maps, fmt):
    head, artifact = artifacts[3]
    out = export(artifact, fmt, tmp_path / fmt)
    weights = load_file(str(out / "model.safetensors"))
    d2t, t2d = weights["d2t"], weights["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (DRAFT_VOCAB,)
    assert t2d.dtype == torch.bool and t2d.shape == (VOCAB,)
    kept = sorted(torch.nonzero(maps[1]).flatten().tolist())
    for draft_id in range(DRAFT_VOCAB):  # target_id = draft_id + d2t[draft_id]
        assert draft_id + int(d2t[draft_id]) == kept[draft_id]
    assert torch.nonzero(t2d).flatten().tolist() == kept  # exactly the kept ids, nothing else
    # the lm_head row of draft id i is the target's row of its target id (how it was initialised)
    assert torch.equal(weights["lm_head.weight"], target.lm_head.weight[kept])
    # what vLLM's compute_logits does: scatter draft logits to target ids, -inf elsewhere
    _, logits = draft_logits(head, target)
    full = logits.new_full((*logits.shape[:-1], VOCAB), float("-inf"))
    full[..., torch.arange(DRAFT_VOCAB) + d2t] = logits
    assert torch.equal(full.argmax(-1), head.draft_to_target(logits.argmax(-1)))
    assert bool(torch.isinf(full[..., ~t2d]).all())


def test_eagle3_configs_carry_each_engines_layer_convention(tmp_path, artifacts):
    _, artifact = artifacts[3]
    vllm = json.loads((export(artifact, "vllm", tmp_path / "v") / "config.json").read_text())
    sglang = json.loads((export(artifact, "sglang", tmp_path / "s") / "config.json").read_text())
    spec = json.loads((export(artifact, "speculators", tmp_path / "p") / "config.json").read_text())
    for config in (vllm, sglang):
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX)  # vLLM: layer inputs
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang
        assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == VOCAB
        assert config["target_hidden_size"] == 64 and config["num_hidden_layers"] == 1
        assert config["norm_before_residual"] is False and config["tie_word_embeddings"] is False
    assert spec["speculators_model_type"] == "eagle3"
    assert spec["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert spec["norm_before_residual"] is False
    assert spec["speculators_config"]["algorithm"] == "eagle3"
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "tiny-export"
    assert spec["transformer_layer_config"]["vocab_size"] == VOCAB
    names = set(load_file(str(tmp_path / "p" / "model.safetensors")))
    assert "layers.0.hidden_norm.weight" in names and not any(
        n.startswith("midlayer") for n in names
    )
    names = set(load_file(str(tmp_path / "v" / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight"} <= names
    assert not any("embed_tokens" in n for n in names)


def test_eagle1_layouts(tmp_path, artifacts):
    _, artifact = artifacts[1]
    vllm = export(artifact, "vllm", tmp_path / "v")
    sglang = export(artifact, "sglang", tmp_path / "s")
    spec = export(artifact, "speculators", tmp_path / "p", verifier="org/tiny")
    assert json.loads((vllm / "config.json").read_text())["architectures"] == [
        "EagleLlamaForCausalLM"
    ]
    assert json.loads((sglang / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle"
    ]
    v = load_file(str(vllm / "model.safetensors"))
    assert "fc.bias" not in v and "layers.0.self_attn.q_proj.weight" in v
    assert not any("input_layernorm" in n or "lm_head" in n or "embed" in n for n in v)
    s = load_file(str(sglang / "model.safetensors"))
    assert torch.equal(
        s["fc.bias"], torch.zeros(64, dtype=s["fc.weight"].dtype)
    )  # SGLang's fc has one
    p = load_file(str(spec / "model.safetensors"))
    assert "fusion_fc.weight" in p and "transformer.mlp.down_proj.weight" in p
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle" and config["fusion_bias"] is False
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"


def test_export_refuses_layers_a_llama_drafter_cannot_hold(tmp_path, artifacts):
    _, artifact = artifacts[3]
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text((artifact / "config.json").read_text())
    weights = load_file(str(artifact / "model.safetensors"))
    weights["midlayer.self_attn.q_norm.weight"] = torch.ones(16, dtype=torch.float64)
    save_file(weights, str(odd / "model.safetensors"))
    with pytest.raises(ValueError, match="q_norm"):
        export(odd, "vllm", tmp_path / "out")


def test_load_exported_refuses_other_target(tmp_path, artifacts):
    _, artifact = artifacts[3]
    out = export(artifact, "vllm", tmp_path / "v")
    with pytest.raises(ValueError, match="vocab"):
        load_exported_eagle(out, make_target(vocab=VOCAB + 8))
    with pytest.raises(FileNotFoundError):
        load_exported_eagle(tmp_path / "nothing", make_target())


def test_cli_and_bad_inputs(tmp_path, artifacts, capsys):
    _, artifact = artifacts[3]
    assert main([str(artifact), "--format", "speculators", "--out", str(tmp_path / "ok")]) == 0
    assert (tmp_path / "ok" / "model.safetensors").is_file()
    # exporting again over an earlier export replaces it
    assert main([str(artifact), "--format", "vllm", "--out", str(tmp_path / "ok")]) == 0

    assert main([str(artifact), "--format", "trtllm", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "eagle3 artifact exports to vllm | sglang | speculators" in err and "trtllm" in err
    assert not (tmp_path / "x").exists()

    assert main([str(tmp_path / "missing"), "--format", "vllm", "--out", str(tmp_path / "y")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --out is required
        main([str(artifact), "--format", "vllm"])
    with pytest.raises(SystemExit):  # not a format of any method
        main([str(artifact), "--format", "onnx", "--out", str(tmp_path / "z")])

    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("do not delete")
    with pytest.raises(ValueError, match="not an earlier export"):
        export(artifact, "vllm", keep)
    assert (keep / "notes.txt").read_text() == "do not delete"

    medusa = tmp_path / "medusa"
    medusa.mkdir()
    (medusa / "config.json").write_text(json.dumps({"method": "medusa"}))
    with pytest.raises(ValueError, match=re.escape("medusa artifact exports to vllm | trtllm")):
        export(medusa, "sglang", tmp_path / "m")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="expected one of"):
        export(plain, "hf", tmp_path / "p")
    assert FORMATS["draft"] == ("hf",)


def test_draft_exports_as_a_clean_hf_directory(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    draft = tmp_path / "draft"
    model = make_target(vocab=16, hidden=32).model
    model.save_pretrained(draft)
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(15)} | {"[UNK]": 15}, unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(draft)
    config = json.loads((draft / "config.json").read_text())
    config["draftsmith"] = {"method": "draft", "loss": "jsd", "target": {"name": "t"}}
    (draft / "config.json").write_text(json.dumps(config))

    out = export(draft, "hf", tmp_path / "hf")
    assert "draftsmith" not in json.loads((out / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(reloaded(ids).logits, model(ids).logits)
    assert AutoTokenizer.from_pretrained(out)("w1 w2")["input_ids"] == [1, 2]
    with pytest.raises(ValueError, match="exports to hf"):
        export(draft, "vllm", tmp_path / "nope")
