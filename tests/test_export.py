"""Export to serving layouts and import of published heads: round trips for every format, the
d2t/t2d mapping, hub ids, refusals with what to use instead, and the output directory rules.

(Each layout is also checked against rules read from its consumer's source in
tests/test_consumer_layouts.py, and the speculators layout with speculators itself in the slow
tests/test_consumers.py.)
"""

from __future__ import annotations

import json
import re
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.files.output_dir import MARKER
from draftsmith.heads.eagle import EagleHead, attention_bias, build_draft_vocab, save_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.medusa import MedusaHeads, save_medusa
from draftsmith.layouts.eagle import load_eagle_head
from draftsmith.layouts.export import export, main
from draftsmith.layouts.files import recorded_hub_id
from draftsmith.layouts.medusa import load_medusa_export, load_medusa_heads, trtllm_convert_command
from draftsmith.layouts.table import all_formats
from draftsmith.targets.features import target_features
from draftsmith.targets.target import wrap_target

VOCAB, DRAFT_VOCAB, AUX = 80, 24, (1, 2, 3)


def make_target(vocab: int = VOCAB, hidden: int = 64, layers: int = 4):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
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


def _roughen(head):
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return head


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, target, maps):
    """kind -> (head, artifact dir): eagle1, eagle3 (reduced vocabulary), eagle3-full."""
    out = {}
    root = tmp_path_factory.mktemp("artifacts")
    for kind in ("eagle1", "eagle3", "eagle3-full"):
        torch.manual_seed(len(kind))
        if kind == "eagle1":
            head = EagleHead(EagleConfig.from_target(target, 1), target)
        elif kind == "eagle3":
            cfg = EagleConfig.from_target(target, 3, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB)
            head = EagleHead(cfg, target, d2t=maps[0], t2d=maps[1])
        else:
            head = EagleHead(EagleConfig.from_target(target, 3, aux_layer_ids=AUX), target)
        out[kind] = (_roughen(head), save_eagle(head, root / kind, target))
    return out


def draft_logits(head, target):
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
    feats = head.fuse(target_features(target, ids, None, head.config)["features"])
    return head(ids, feats, torch.arange(ids.shape[1])[None])


def exported(artifact, fmt, out, target, **kwargs):
    if fmt == "speculators":
        kwargs.setdefault("verifier", "org/tiny")
        kwargs.setdefault("target", target)
    return export(artifact, fmt, out, **kwargs)


# ------------------------------------------------------------------------------------------------
# EAGLE round trips and layouts


@pytest.mark.parametrize("kind,fmt", [
    ("eagle1", "vllm"), ("eagle1", "sglang"),
    ("eagle3", "vllm"), ("eagle3", "sglang"), ("eagle3", "speculators"),
    ("eagle3-full", "vllm"), ("eagle3-full", "sglang"), ("eagle3-full", "speculators"),
])
def test_round_trip_gives_identical_draft_logits(tmp_path, target, artifacts, kind, fmt):
    head, artifact = artifacts[kind]
    out = exported(artifact, fmt, tmp_path / fmt, target)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.json", "model.safetensors"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    loaded = load_eagle_head(out, target)
    assert loaded.config.aux_layer_ids == head.config.aux_layer_ids
    for a, b in zip(draft_logits(loaded, target), draft_logits(head, target)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_d2t_maps_every_draft_id_to_its_target_id(tmp_path, target, artifacts, maps, fmt):
    head, artifact = artifacts["eagle3"]
    out = exported(artifact, fmt, tmp_path / fmt, target)
    weights = load_file(str(out / "model.safetensors"))
    d2t, t2d = weights["d2t"], weights["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (DRAFT_VOCAB,)
    assert t2d.dtype == torch.bool and t2d.shape == (VOCAB,)
    kept = sorted(torch.nonzero(maps[1]).flatten().tolist())
    for draft_id in range(DRAFT_VOCAB):  # target_id = draft_id + d2t[draft_id]
        assert draft_id + int(d2t[draft_id]) == kept[draft_id]
    assert torch.nonzero(t2d).flatten().tolist() == kept  # exactly the kept ids, nothing else
    # the lm_head row of draft id i is the target's row of its target id (how it was initialised)
    fresh = EagleHead(head.config, target, d2t=maps[0], t2d=maps[1])
    assert torch.equal(fresh.lm_head.weight, target.lm_head.weight[kept])
    # what vLLM's compute_logits does: scatter draft logits to target ids, -inf elsewhere
    _, logits = draft_logits(head, target)
    full = logits.new_full((*logits.shape[:-1], VOCAB), float("-inf"))
    full[..., torch.arange(DRAFT_VOCAB) + d2t] = logits
    assert torch.equal(full.argmax(-1), head.draft_to_target(logits.argmax(-1)))
    assert bool(torch.isinf(full[..., ~t2d]).all())


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_full_vocabulary_head_ships_no_d2t(tmp_path, target, artifacts, fmt):
    """vLLM 0.33 has no draft_id_to_target_id when the vocabularies are equal: a d2t would fail."""
    _, artifact = artifacts["eagle3-full"]
    out = exported(artifact, fmt, tmp_path / fmt, target)
    weights = load_file(str(out / "model.safetensors"))
    assert "d2t" not in weights and "t2d" not in weights
    assert weights["lm_head.weight"].shape == (VOCAB, 64)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == VOCAB


def test_eagle3_configs_carry_each_engines_layer_convention(tmp_path, target, artifacts):
    _, artifact = artifacts["eagle3"]
    vllm = json.loads((export(artifact, "vllm", tmp_path / "v") / "config.json").read_text())
    sglang = json.loads((export(artifact, "sglang", tmp_path / "s") / "config.json").read_text())
    spec = json.loads((exported(artifact, "speculators", tmp_path / "p", target)
                       / "config.json").read_text())
    for config in (vllm, sglang):
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX)  # vLLM: layer inputs
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang
        assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == VOCAB
        assert config["target_hidden_size"] == 64 and config["num_hidden_layers"] == 1
        assert config["norm_before_residual"] is False and config["tie_word_embeddings"] is False
    assert spec["speculators_model_type"] == "eagle3" and spec["speculators_version"] == "0.9.0"
    assert spec["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert spec["norm_before_residual"] is False
    assert spec["speculators_config"]["algorithm"] == "eagle3"
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert spec["transformer_layer_config"]["vocab_size"] == VOCAB
    names = load_file(str(tmp_path / "p" / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in names and not any(n.startswith("midlayer") for n in names)
    # speculators does not fill embed_tokens from the verifier: the file carries the target's
    assert torch.equal(names["embed_tokens.weight"], target.embed.weight.detach())
    names = set(load_file(str(tmp_path / "v" / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight"} <= names
    assert not any("embed_tokens" in n for n in names)


def test_eagle1_layouts_and_no_speculators(tmp_path, target, artifacts):
    _, artifact = artifacts["eagle1"]
    vllm = export(artifact, "vllm", tmp_path / "v")
    sglang = export(artifact, "sglang", tmp_path / "s")
    assert json.loads((vllm / "config.json").read_text())["architectures"] == [
        "EagleLlamaForCausalLM"]
    assert json.loads((sglang / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle"]
    v = load_file(str(vllm / "model.safetensors"))
    assert "fc.bias" not in v and "layers.0.self_attn.q_proj.weight" in v
    assert not any("input_layernorm" in n or "lm_head" in n or "embed" in n for n in v)
    s = load_file(str(sglang / "model.safetensors"))
    assert torch.equal(s["fc.bias"], torch.zeros(64, dtype=s["fc.weight"].dtype))
    with pytest.raises(ValueError, match="speculators has no EAGLE-1 model.*--format vllm"):
        export(artifact, "speculators", tmp_path / "p", verifier="org/tiny", target=target)
    assert not (tmp_path / "p").exists()


def test_speculators_verifier_is_a_hub_id(tmp_path, target, artifacts):
    _, artifact = artifacts["eagle3"]
    with pytest.raises(ValueError, match="has none recorded: pass --verifier"):
        export(artifact, "speculators", tmp_path / "a", target=target)  # tiny-export: no hub id
    with pytest.raises(ValueError, match="not a Hugging Face hub id .it is a path on this machine"):
        export(artifact, "speculators", tmp_path / "b", verifier=str(tmp_path), target=target)
    with pytest.raises(ValueError, match="not a Hugging Face hub id .it is not of the form"):
        export(artifact, "speculators", tmp_path / "c", verifier="smollm2-135m", target=target)
    with pytest.raises(ValueError, match="needs the target's embedding|embed_tokens"):
        export(artifact, "speculators", tmp_path / "d", verifier="org/tiny")
    assert not any((tmp_path / n).exists() for n in "abcd")
    # the hub id recorded or derived from what the artifact records about its target
    assert recorded_hub_id({"target": {"name": "smollm2-135m"}}) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert recorded_hub_id({"target": {"name": "x", "hub_id": "org/model"}}) == "org/model"
    hub_dir = tmp_path / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "abc"
    hub_dir.mkdir(parents=True)
    assert recorded_hub_id({"target": {"name": "abc"}, "base_model": str(hub_dir)}) == (
        "meta-llama/Llama-3.1-8B")
    local = tmp_path / "local-model"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen3-8B"}))
    assert recorded_hub_id({"target": {"name": "local-model", "path": str(local)}}) == (
        "Qwen/Qwen3-8B")
    (local / "config.json").write_text(json.dumps({"_name_or_path": str(local)}))
    assert recorded_hub_id({"target": {"name": "local-model", "path": str(local)}}) is None


def test_export_refuses_layers_a_llama_drafter_cannot_hold(tmp_path, artifacts):
    _, artifact = artifacts["eagle3"]
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text((artifact / "config.json").read_text())
    weights = load_file(str(artifact / "model.safetensors"))
    weights["midlayer.self_attn.q_norm.weight"] = torch.ones(16, dtype=torch.float64)
    save_file(weights, str(odd / "model.safetensors"))
    with pytest.raises(ValueError, match="q_norm"):
        export(odd, "vllm", tmp_path / "out")


# ------------------------------------------------------------------------------------------------
# Importing published EAGLE layouts


def _republish(src, dst, *, config=None, drop=(), add=None, rename=None):
    """A copy of an export with its config edited and weights dropped / added / renamed."""
    dst.mkdir()
    meta = json.loads((src / "config.json").read_text())
    meta.pop("draftsmith", None)
    if config:
        config(meta)
    (dst / "config.json").write_text(json.dumps(meta))
    weights = load_file(str(src / "model.safetensors"))
    weights = {(rename(k) if rename else k): v for k, v in weights.items() if k not in drop}
    weights.update(add or {})
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def _same_logits(a, b, target):
    return all(torch.equal(x, y) for x, y in zip(draft_logits(a, target), draft_logits(b, target)))


def test_imports_published_eagle3_variants(tmp_path, target, artifacts):
    head, artifact = artifacts["eagle3"]
    vllm = export(artifact, "vllm", tmp_path / "vllm")
    embed = target.embed.weight.detach().clone()

    def sglang_only(meta):  # SpecForge-style: aux ids only in eagle_config (layer outputs)
        meta.pop("eagle_aux_hidden_state_layer_ids")

    specforge = _republish(vllm, tmp_path / "specforge", config=sglang_only,
                           add={"embed_tokens.weight": embed},
                           rename=lambda k: k.replace("midlayer.", "layers.0."))
    loaded = load_eagle_head(specforge, target)
    assert loaded.config.aux_layer_ids == AUX and _same_logits(loaded, head, target)

    only_t2d = _republish(vllm, tmp_path / "t2d-only", drop=("d2t",))
    assert _same_logits(load_eagle_head(only_t2d, target), head, target)

    def renamed_arch(meta):
        meta["architectures"] = ["Eagle3LlamaForCausalLM"]

    angelslim = _republish(vllm, tmp_path / "angelslim", config=renamed_arch,
                           rename=lambda k: "model." + k if k.startswith("midlayer") else k)
    assert _same_logits(load_eagle_head(angelslim, target), head, target)

    # full vocabulary, no d2t/t2d, no lm_head of its own: vLLM shares the target's
    full_head, full_artifact = artifacts["eagle3-full"]
    with torch.no_grad():
        full_head.lm_head.weight.copy_(target.lm_head.weight)
    shared = _republish(export(full_artifact, "vllm", tmp_path / "full"), tmp_path / "shared",
                        drop=("lm_head.weight",))
    assert _same_logits(load_eagle_head(shared, target), full_head, target)


def test_imports_what_speculators_trains(tmp_path, target, artifacts):
    """``speculators train`` 0.9.0's defaults: norm_before_fc (input_norm.weight),
    norm_before_residual, norm_output and a sliding window. That the head then computes what
    speculators computes is checked against speculators itself in tests/test_consumers.py (slow);
    here: the flags are read, each changes the drafts, training-time test and inference agree,
    the window is a limit, and such a head is never exported as draftsmith's own."""
    head, artifact = artifacts["eagle3"]
    spec = exported(artifact, "speculators", tmp_path / "spec", target)

    def trained(meta):
        meta.update(norm_before_fc=True, norm_before_residual=True, norm_output=True)
        meta["transformer_layer_config"].update(
            layer_types=["sliding_attention"], sliding_window=32, use_sliding_window=True)

    input_norm = torch.rand(3 * 64, generator=torch.Generator().manual_seed(5),
                            dtype=torch.float64) + 0.5
    loaded = load_eagle_head(_republish(spec, tmp_path / "trained", config=trained,
                                        add={"input_norm.weight": input_norm}), target).eval()
    cfg = loaded.config
    assert (cfg.norm_before_fc, cfg.norm_before_residual, cfg.norm_output) == (True, True, True)
    assert cfg.sliding_window == 32 and "sliding_window" not in cfg.layer_config
    assert torch.equal(loaded.input_norm.weight, input_norm)

    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
    n, positions = ids.shape[1], torch.arange(ids.shape[1])[None]
    features = target_features(target, ids, None, cfg)["features"]
    shifted = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)
    allowed = torch.cat([torch.ones(n, n).tril(), torch.eye(n)], dim=1).bool()
    mask = attention_bias(allowed, torch.float64)[None, None]

    def two_steps(h):  # inference: step 1 reads step 0's output, as a draft of depth 2 does
        cache = h.new_cache()
        with torch.no_grad():
            out, step0 = h(ids, h.fuse(features), positions, cache=cache)
            return out, step0, h(shifted, out, positions + 1, attention_mask=mask,
                                 cache=cache)[1]

    out, step0, step1 = two_steps(loaded)
    with torch.no_grad():  # training-time test, the path the loss takes
        h0, kv0 = loaded.ttt_step(ids, loaded.fuse(features), positions)
        h1, _ = loaded.ttt_step(shifted, h0, positions + 1, past=[kv0])
        torch.testing.assert_close(h0, out)
        torch.testing.assert_close(loaded.lm_head(loaded.logit_states(h0)), step0)
        torch.testing.assert_close(loaded.lm_head(loaded.logit_states(h1)), step1)
    for flag in ("norm_before_fc", "norm_before_residual", "norm_output"):
        setattr(loaded.config, flag, False)
        _, other0, other1 = two_steps(loaded)
        assert not torch.allclose(other1, step1), flag
        assert torch.allclose(other0, step0) == (flag == "norm_output"), flag
        setattr(loaded.config, flag, True)
    with pytest.raises(ValueError, match="last 32 positions only"):
        loaded(ids[:, :1], out[:, :1], torch.tensor([[32]]))

    def residual_default(meta):  # vLLM's speculators bridge reads an absent flag as true
        meta.pop("norm_before_residual")

    redhat = load_eagle_head(_republish(spec, tmp_path / "redhat", config=residual_default),
                             target)
    assert redhat.config.norm_before_residual and not redhat.config.norm_output
    with pytest.raises(ValueError, match="speculators' variants"):
        export(save_eagle(loaded, tmp_path / "variant", target), "vllm", tmp_path / "out")
    # artifacts written before these keys existed still load
    old = {k: v for k, v in head.config.to_dict().items()
           if k not in ("norm_before_fc", "norm_before_residual", "norm_output", "sliding_window")}
    assert EagleConfig.from_dict(old) == head.config


def test_import_refuses_what_does_not_fit_the_target(tmp_path, target, artifacts):
    _, artifact = artifacts["eagle3"]
    ours = export(artifact, "vllm", tmp_path / "ours")
    with pytest.raises(ValueError, match=r"hidden_size: 64 there vs 32 here"):
        load_eagle_head(ours, make_target(hidden=32))  # our export records its target
    vllm = _republish(ours, tmp_path / "vllm")  # as published: no draftsmith record

    with pytest.raises(ValueError, match="config hidden_size is 64, the target 'tiny-export' has 32"):
        load_eagle_head(vllm, make_target(hidden=32))
    with pytest.raises(ValueError, match="vocab_size is 80, the target 'tiny-export' has 88"):
        load_eagle_head(vllm, make_target(vocab=VOCAB + 8))

    def far_layers(meta):
        meta["eagle_aux_hidden_state_layer_ids"] = [1, 2, 7]

    with pytest.raises(ValueError, match=r"\[1, 2, 7\].*1..3 for the target 'tiny-export' with 4"):
        load_eagle_head(_republish(vllm, tmp_path / "far", config=far_layers), target)

    def no_layers(meta):  # the engines' default (2, L // 2, L - 3) = (2, 2, 1): not ascending
        meta.pop("eagle_aux_hidden_state_layer_ids")
        meta.pop("eagle_config")

    with pytest.raises(ValueError, match=r"\[2, 2, 1\]"):
        load_eagle_head(_republish(vllm, tmp_path / "default", config=no_layers), target)

    d2t = load_file(str(vllm / "model.safetensors"))["d2t"].clone()
    d2t[-1] += 10
    with pytest.raises(ValueError, match=r"d2t maps draft ids to target ids 3..84, outside the target.s vocabulary 0..79"):
        load_eagle_head(_republish(vllm, tmp_path / "d2t", drop=("d2t", "t2d"),
                                   add={"d2t": d2t}), target)
    with pytest.raises(ValueError, match=r"d2t has shape \(23,\), draft_vocab_size 24"):
        load_eagle_head(_republish(vllm, tmp_path / "d2t-short", drop=("d2t",),
                                   add={"d2t": d2t[:-1]}), target)
    fc = torch.zeros(64, 2 * 64, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"fc.weight has shape \(64, 128\).*needs \(64, 192\)"):
        load_eagle_head(_republish(vllm, tmp_path / "fc", drop=("fc.weight",),
                                   add={"fc.weight": fc}), target)
    other = torch.randn(VOCAB, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="embed_tokens.weight differs from the target's"):
        load_eagle_head(_republish(vllm, tmp_path / "embed", add={"embed_tokens.weight": other}),
                        target)
    extra = {"layers.1.mlp.down_proj.weight": torch.zeros(64, 128, dtype=torch.float64)}
    with pytest.raises(ValueError, match="more than one layer"):
        load_eagle_head(_republish(vllm, tmp_path / "deep", add=extra), target)
    with pytest.raises(ValueError, match="missing"):
        load_eagle_head(_republish(vllm, tmp_path / "partial", drop=("norm.weight",)), target)


def test_import_refuses_pickles_and_unsupported_variants(tmp_path, target, artifacts):
    _, artifact = artifacts["eagle3"]
    spec = exported(artifact, "speculators", tmp_path / "spec", target)

    def per_layer_norms(meta):  # speculators' fc_norm: a norm per aux feature, not implemented
        meta["fc_norm"] = True

    with pytest.raises(ValueError, match=r"\['fc_norm'\], an EAGLE-3 variant"):
        load_eagle_head(_republish(spec, tmp_path / "fc-norm", config=per_layer_norms), target)

    pickled = tmp_path / "authors"
    pickled.mkdir()
    (pickled / "config.json").write_text((tmp_path / "spec" / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not a pickle at all: it is never opened")
    with pytest.raises(ValueError, match="pytorch_model.bin, a pickle, which draftsmith never "
                                         "loads.*save_file.*weights_only=True"):
        load_eagle_head(pickled, target)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_eagle_head(tmp_path / "nothing", target)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not an EAGLE head"):
        load_eagle_head(plain, target)
    (plain / "config.json").write_text("{garbled")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_eagle_head(plain, target)


# ------------------------------------------------------------------------------------------------
# Medusa


@pytest.fixture(scope="module")
def medusa_artifacts(tmp_path_factory, target):
    """(num_heads, num_layers, share, bias) -> (heads, artifact dir)."""
    root = tmp_path_factory.mktemp("medusa")
    out = {}
    for key in ((3, 1, False, True), (2, 2, False, True), (3, 1, True, True), (3, 1, False, False),
                (5, 1, False, True)):
        k, n, share, bias = key
        heads = MedusaHeads.from_target(target, num_heads=k, num_layers=n, share_lm_head=share,
                                        bias=bias)
        gen = torch.Generator().manual_seed(k + n)
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
        tree = [(0,), (1,), (0, 0)]
        out[key] = (heads.eval(), save_medusa(root / "-".join(map(str, key)), heads, target,
                                              tree=tree))
    return out


@pytest.mark.parametrize("fmt", ["trtllm", "fasterdecoding", "vllm-0.32"])
@pytest.mark.parametrize("key", [(3, 1, False, True), (2, 2, False, True), (3, 1, True, True),
                                 (3, 1, False, False)])
def test_medusa_round_trip(tmp_path, target, medusa_artifacts, fmt, key):
    heads, artifact = medusa_artifacts[key]
    kwargs = {"base_model": "org/tiny", "write_pt": True} if fmt == "fasterdecoding" else {}
    if fmt == "fasterdecoding" and key[1] > 1:
        with pytest.raises(ValueError, match=r"\[ResBlock\(h\)\] \* medusa_num_layers.*trtllm"):
            export(artifact, fmt, tmp_path / fmt, target=target, **kwargs)
        return
    out = export(artifact, fmt, tmp_path / fmt, target=target, **kwargs)
    h = torch.randn(4, 64, dtype=torch.float64)
    assert torch.equal(load_medusa_export(out)(h), heads(h))
    imported = load_medusa_heads(out, target)
    assert imported.tree == [(0,), (1,), (0, 0)]
    assert torch.equal(imported.heads(h), heads(h))
    files = {p.name for p in out.iterdir()}
    meta = json.loads((out / "config.json").read_text())
    if fmt == "vllm-0.32":
        assert files == {MARKER, "config.json", "model.safetensors"}
        assert meta["original_lm_head"] is key[2] and meta["medusa_fc_bias"] is key[3]
    else:
        assert {"config.json", "medusa_lm_head.safetensors"} <= files
        assert (meta["medusa_num_heads"], meta["medusa_num_layers"]) == key[:2]
    if fmt == "fasterdecoding":
        assert meta["base_model_name_or_path"] == "org/tiny" and "model_type" not in meta
        assert stat.S_IMODE((out / "medusa_lm_head.pt").stat().st_mode) == 0o644
        # the only file FasterDecoding reads: plain tensors, loadable without unpickling code
        pt = torch.load(out / "medusa_lm_head.pt", weights_only=True)
        st = load_file(str(out / "medusa_lm_head.safetensors"))
        assert pt.keys() == st.keys() and all(torch.equal(pt[k], st[k]) for k in st)


def test_medusa_refusals_and_notes(tmp_path, target, medusa_artifacts, capsys):
    _, artifact = medusa_artifacts[(3, 1, False, True)]
    with pytest.raises(ValueError, match="current vLLM .0.33. has no Medusa model; vLLM 0.32.0 "
                                         "was the last.*--format vllm-0.32.*trtllm"):
        export(artifact, "vllm", tmp_path / "v")
    with pytest.raises(ValueError, match="reads only medusa_lm_head.pt.*--write-pt"):
        export(artifact, "fasterdecoding", tmp_path / "f", base_model="org/tiny")
    with pytest.raises(ValueError, match="no hub id recorded: pass --base-model"):
        export(artifact, "fasterdecoding", tmp_path / "f", write_pt=True)
    with pytest.raises(ValueError, match="not a Hugging Face hub id"):
        export(artifact, "fasterdecoding", tmp_path / "f", write_pt=True, base_model="tiny")
    assert not any((tmp_path / n).exists() for n in "vf")

    assert main([str(artifact), "--format", "trtllm", "--out", str(tmp_path / "t")]) == 0
    printed = capsys.readouterr().out
    assert "--num_medusa_heads 3 --num_medusa_layers 1" in printed
    assert "--medusa_choices" in printed
    command = trtllm_convert_command(tmp_path / "t", "/models/base", dtype="bfloat16")
    assert command.startswith("python examples/medusa/convert_checkpoint.py --model_dir "
                              "/models/base --medusa_model_dir")
    assert "--max_medusa_token_len 63" in command

    assert main([str(artifact), "--format", "fasterdecoding", "--out", str(tmp_path / "fd"),
                 "--base-model", "org/tiny", "--write-pt"]) == 0
    assert "builds 5 heads whatever config.json says" in capsys.readouterr().out
    five, artifact5 = medusa_artifacts[(5, 1, False, True)]
    assert main([str(artifact5), "--format", "fasterdecoding", "--out", str(tmp_path / "fd5"),
                 "--base-model", "org/tiny", "--write-pt"]) == 0
    assert "builds 5 heads" not in capsys.readouterr().out


def test_medusa_import_of_published_layouts(tmp_path, target, medusa_artifacts):
    heads, artifact = medusa_artifacts[(3, 1, False, True)]
    out = export(artifact, "trtllm", tmp_path / "t")
    # FasterDecoding's published configs sometimes name another head count: the weights decide
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 5, "medusa_num_layers": 1, "base_model_name_or_path": "org/tiny"}))
    (published / "medusa_lm_head.safetensors").write_bytes(
        (out / "medusa_lm_head.safetensors").read_bytes())
    imported = load_medusa_heads(published, target)
    h = torch.randn(2, 64, dtype=torch.float64)
    assert imported.heads.num_heads == 3 and torch.equal(imported.heads(h), heads(h))
    assert imported.tree == [(0,), (0, 0), (0, 0, 0)]  # no medusa_choices: each head's top-1

    with pytest.raises(ValueError, match=r"head 0 has shape \(80, 64\), the target 'tiny-export' "
                                         r"needs \(88, 64\)"):
        load_medusa_heads(published, make_target(vocab=VOCAB + 8))
    with pytest.raises(ValueError, match=r"vocab_size: 80 there vs 88 here"):
        load_medusa_heads(out, make_target(vocab=VOCAB + 8))  # our export records its target
    pt_only = tmp_path / "pt-only"
    pt_only.mkdir()
    (pt_only / "config.json").write_text((published / "config.json").read_text())
    (pt_only / "medusa_lm_head.pt").write_bytes(b"never opened")
    with pytest.raises(ValueError, match="only as medusa_lm_head.pt, a pickle.*save_file"):
        load_medusa_heads(pt_only, target)


# ------------------------------------------------------------------------------------------------
# Output directories, command line, --check


def test_never_loses_a_users_files(tmp_path, target, artifacts, capsys):
    _, artifact = artifacts["eagle3"]
    keep = tmp_path / "model-copy"
    keep.mkdir()
    (keep / "config.json").write_text('{"model_type": "llama"}')  # an HF directory, not ours
    assert main([str(artifact), "--format", "vllm", "--out", str(keep)]) == 2
    assert "did not write (config.json); choose a new directory, or pass --overwrite" in (
        capsys.readouterr().err)
    assert (keep / "config.json").read_text() == '{"model_type": "llama"}'
    assert main([str(artifact), "--format", "vllm", "--out", str(keep), "--overwrite"]) == 0
    assert "draft_vocab_size" in (keep / "config.json").read_text()

    # the artifact itself, or a directory containing it: never, not even with --overwrite
    before = sorted(p.name for p in artifact.iterdir())
    for out in (artifact, artifact.parent):
        assert main([str(artifact), "--format", "vllm", "--out", str(out), "--overwrite"]) == 2
        assert "source of this operation" in capsys.readouterr().err
    assert sorted(p.name for p in artifact.iterdir()) == before

    # another artifact is not an earlier export
    _, other = artifacts["eagle1"]
    assert main([str(artifact), "--format", "vllm", "--out", str(other)]) == 2
    assert "holds a draftsmith 'artifact', not an earlier export" in capsys.readouterr().err
    # an earlier export is replaced
    assert main([str(artifact), "--format", "sglang", "--out", str(keep)]) == 0


def test_cli_and_bad_inputs(tmp_path, artifacts, capsys):
    _, artifact = artifacts["eagle3"]
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
    medusa = tmp_path / "medusa"
    medusa.mkdir()
    (medusa / "config.json").write_text(json.dumps({"method": "medusa"}))
    with pytest.raises(ValueError, match=re.escape("medusa artifact exports to trtllm | "
                                                   "fasterdecoding | vllm-0.32")):
        export(medusa, "sglang", tmp_path / "m")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="expected one of"):
        export(plain, "hf", tmp_path / "p")
    assert all_formats()["draft"] == ("hf", "gguf")


def test_check_reports_what_it_verified(tmp_path, target, artifacts, capsys):
    _, artifact = artifacts["eagle3"]
    target_dir = tmp_path / "target"
    target.model.save_pretrained(target_dir)
    save_word_tokenizer(target_dir, VOCAB)
    assert main([str(artifact), "--format", "vllm", "--out", str(tmp_path / "v"), "--check",
                 "--target", str(target_dir)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"verified: round trip: vllm export read back gives the artifact's draft "
                     r"logits \(max \|diff\| 0 ", printed)
    assert "not verified: loading by the consumer itself: vLLM 0.33.0 needs a GPU build" in printed
    assert main([str(artifact), "--format", "sglang", "--out", str(tmp_path / "s"),
                 "--check"]) == 0
    assert "not verified: round trip and consumer load: the target is needed" in (
        capsys.readouterr().out)


def save_word_tokenizer(directory, vocab: int) -> None:
    """A whitespace word-level tokenizer w0..w{vocab-2} + [UNK], so load_target can read the dir."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab - 1)} | {"[UNK]": vocab - 1},
                                unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(directory)


def test_draft_exports_as_a_clean_hf_directory(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    draft = tmp_path / "draft"
    model = make_target(vocab=16, hidden=32).model
    model.save_pretrained(draft)
    save_word_tokenizer(draft, 16)
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
