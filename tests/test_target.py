"""targets/target.py: the identity an artifact records (weights fingerprint, hub id, path) and the
refusal of another target's weights; damaged GGUF files; no code shipped with a model is run."""

from __future__ import annotations

import builtins
import copy
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from draftsmith.files.file_formats import FileFormatError
from draftsmith.files.output_dir import read_marker
from draftsmith.heads.distill import load_draft
from draftsmith.heads.eagle import EagleHead, load_eagle, save_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.medusa import MedusaHeads, load_medusa, save_medusa
from draftsmith.targets.resolve import convert_gguf, gguf_problem, resolve_target, target_hub_id
from draftsmith.targets.target import load_target, weights_fingerprint, wrap_target

VOCAB = 40


def llama(seed: int = 0, tied: bool = False, layers: int = 3) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=tied,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def save_model_dir(directory: Path, model: LlamaForCausalLM) -> Path:
    """A Hugging Face model directory with a word-level tokenizer, as load_target reads it."""
    model.save_pretrained(directory)
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1},
                                unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------------------
# The weights fingerprint


def test_fingerprint_follows_the_weights_not_their_dtype_or_tying():
    model = llama()
    base = weights_fingerprint(model)
    assert len(base) == 16
    assert weights_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == base
    # a bfloat16 checkpoint loaded in float32 reads the same values
    rounded = copy.deepcopy(model).to(torch.bfloat16)
    assert weights_fingerprint(copy.deepcopy(rounded).float()) == weights_fingerprint(rounded)
    tied = llama(tied=True)
    untied = llama(tied=False)
    with torch.no_grad():
        untied.lm_head.weight.copy_(tied.lm_head.weight)
    assert weights_fingerprint(tied) == weights_fingerprint(untied)

    assert weights_fingerprint(llama(seed=1)) != base  # same shapes, other weights
    changed = copy.deepcopy(model)
    with torch.no_grad():  # one value of the middle layer's value projection
        changed.model.layers[1].self_attn.v_proj.weight[3, 5] += 0.01
    assert weights_fingerprint(changed) != base
    with torch.device("meta"):
        assert weights_fingerprint(LlamaForCausalLM(model.config)) is None


def test_identity_records_fingerprint_path_and_hub_id(tmp_path):
    directory = save_model_dir(tmp_path / "models--acme--tiny" / "snapshots" / "abc", llama())
    target = load_target(str(directory), device="cpu", dtype="float32")
    identity = target.identity()
    assert identity["weights_fingerprint"] == weights_fingerprint(llama())
    assert identity["path"] == str(directory.resolve())
    assert identity["hub_id"] == "acme/tiny"  # from the hub cache's directory layout
    bf16 = load_target(str(directory), device="cpu", dtype="bfloat16")
    assert bf16.identity()["weights_fingerprint"] == identity["weights_fingerprint"]
    plain = wrap_target(llama(), name="in-memory").identity()
    assert plain["path"] is None and plain["hub_id"] is None


def test_check_identity_refuses_other_weights_unless_allowed():
    mine, other = wrap_target(llama(), name="a"), wrap_target(llama(seed=1), name="b")
    recorded = mine.identity()
    mine.check_identity(recorded)
    theirs, ours = recorded["weights_digest"], other.identity()["weights_digest"]
    with pytest.raises(ValueError, match=rf"trained for target 'a' with weights digest "
                                         rf"{theirs[:16]}, but 'b' has the same shapes and other "
                                         rf"weights \(digest {ours[:16]}\).*"
                                         r"allow_other_weights=True"):
        other.check_identity(recorded, what="artifact x")
    other.check_identity(recorded, allow_other_weights=True)
    # recorded before digests existed: compared by the sampled fingerprint
    older = {k: v for k, v in recorded.items() if k != "weights_digest"}
    theirs, ours = recorded["weights_fingerprint"], other.identity()["weights_fingerprint"]
    with pytest.raises(ValueError, match=rf"weights fingerprint {theirs}, .*\(fingerprint "
                                         rf"{ours}\)"):
        other.check_identity(older)
    mine.check_identity(older)
    # recorded before fingerprints existed: nothing to compare
    other.check_identity({k: v for k, v in older.items() if k != "weights_fingerprint"})
    smaller = wrap_target(llama(layers=2), name="c")
    with pytest.raises(ValueError, match="num_hidden_layers: 3 there vs 2 here"):
        smaller.check_identity(recorded, allow_other_weights=True)  # shapes are never waived


def test_artifacts_are_refused_by_a_target_with_other_weights(tmp_path):
    mine, other = wrap_target(llama(), name="a"), wrap_target(llama(seed=1), name="a")
    heads = MedusaHeads.from_target(mine, num_heads=2)
    save_medusa(tmp_path / "medusa", heads, mine)
    with pytest.raises(ValueError, match="other weights"):
        load_medusa(tmp_path / "medusa", other)
    assert load_medusa(tmp_path / "medusa", other, allow_other_weights=True).heads.num_heads == 2
    save_eagle(EagleHead(EagleConfig.from_target(mine, 1), mine), tmp_path / "eagle", mine)
    load_eagle(tmp_path / "eagle", mine)
    with pytest.raises(ValueError, match="other weights"):
        load_eagle(tmp_path / "eagle", other)
    # an artifact written before fingerprints were recorded still loads
    config_path = tmp_path / "medusa" / "config.json"
    config = json.loads(config_path.read_text())
    del config["target"]["weights_fingerprint"], config["target"]["weights_digest"]
    config_path.write_text(json.dumps(config))
    assert load_medusa(tmp_path / "medusa", other).heads.num_heads == 2


# ------------------------------------------------------------------------------------------------
# GGUF files and the conversion cache


@pytest.fixture(scope="module")
def gguf_file():
    from draftsmith.targets.resolve import embedded_gguf_path

    try:
        return embedded_gguf_path("smollm2-135m")
    except FileNotFoundError as err:
        pytest.skip(str(err))


def tiny_gguf(path: Path) -> Path:
    """A small, well-formed GGUF file (no tokenizer: transformers cannot convert it)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_tensor("token_embd.weight", np.arange(256, dtype=np.float32).reshape(32, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_damaged_gguf_is_named_and_nothing_is_left_behind(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    whole = tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cases = {"cut.gguf": whole[:-200], "header.gguf": gguf_file.read_bytes()[:100],
             "zeros.gguf": bytes(1000)}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(FileFormatError, match=rf"{name}: is not a readable GGUF file .*; the "
                                                  r"file is damaged or incomplete: download it "
                                                  r"again") as info:
            resolve_target(str(path))
        assert info.value.path == path.resolve()
    assert gguf_problem(tmp_path / "whole.gguf") is None
    # a whole file that transformers cannot convert keeps transformers' own error
    with pytest.raises(ValueError, match="Cannot build a tokenizer") as info:
        resolve_target(str(tmp_path / "whole.gguf"))
    assert not isinstance(info.value, FileFormatError)
    targets = tmp_path / "cache" / "targets"
    assert not targets.exists() or not list(targets.iterdir())  # nothing half-converted


def test_the_conversion_never_replaces_a_directory_it_did_not_write(gguf_file, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match=r"cannot convert .*into .*mine: .*did not write "
                                         r"\(notes.txt\).*DRAFTSMITH_CACHE"):
        convert_gguf(gguf_file, mine)
    assert (mine / "notes.txt").read_text() == "keep"


@pytest.mark.slow
def test_the_converted_target_is_a_marked_directory(trainer_env):
    directory = resolve_target("smollm2-135m")
    assert read_marker(directory)["kind"] == "converted-target"
    assert resolve_target("smollm2-135m") == directory  # converted once
    identity = load_target("smollm2-135m", device="cpu").identity()
    assert identity["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert identity["path"] == str(directory.resolve()) and identity["weights_fingerprint"]


# ------------------------------------------------------------------------------------------------
# Code shipped with a model is never run


def _with_custom_code(directory: Path, model_type: str) -> Path:
    """config.json names its own modeling code (auto_map), which leaves a file when imported."""
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "custom.AcmeConfig",
                          "AutoModelForCausalLM": "custom.AcmeForCausalLM"}
    (directory / "config.json").write_text(json.dumps(config))
    ran = directory / "code-ran"
    (directory / "custom.py").write_text(f"open({str(ran)!r}, 'w').close()\n"
                                         "from transformers import LlamaConfig as AcmeConfig\n"
                                         "from transformers import LlamaForCausalLM as "
                                         "AcmeForCausalLM\n")
    return ran


def test_model_directories_that_need_their_own_code_are_refused(tmp_path, monkeypatch):
    def no_prompt(*args):
        raise AssertionError("transformers asked whether to run the model's code")

    monkeypatch.setattr(builtins, "input", no_prompt)
    target = wrap_target(llama(), name="t")
    draft = save_model_dir(tmp_path / "draft", llama(seed=2))
    ran = _with_custom_code(draft, "acme-llm")
    with pytest.raises(ValueError, match=r"draft .*draft is a 'acme-llm' model that loads only by "
                                         r"running the Python code it ships.*never runs code"):
        load_draft(str(draft), target)
    with pytest.raises(ValueError, match=r"target .*draft is a 'acme-llm' model"):
        load_target(str(draft), device="cpu")
    # a known architecture with an auto_map loads as that architecture; the code is not run
    known = save_model_dir(tmp_path / "known", llama(seed=2))
    ran_known = _with_custom_code(known, "llama")
    loaded = load_draft(str(known), target)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert not ran.exists() and not ran_known.exists()


def test_a_damaged_target_config_names_the_file(tmp_path):
    directory = save_model_dir(tmp_path / "t", llama())
    (directory / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(FileFormatError, match=r"t/config.json: is not valid JSON .*line 1.*; the "
                                              r"target directory is damaged"):
        load_target(str(directory), device="cpu")
    shutil.rmtree(directory)


def test_a_hub_id_resolves_to_the_local_cache_and_is_never_downloaded(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-lm" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--acme--tiny-lm" / "refs").mkdir()
    (cache / "models--acme--tiny-lm" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert resolve_target("acme/tiny-lm") == snapshot
    assert target_hub_id(snapshot) == "acme/tiny-lm"
    with pytest.raises(FileNotFoundError, match=r"'acme/absent' is not in the local Hugging Face "
                                                r"cache .*huggingface-cli download acme/absent"):
        resolve_target("acme/absent")
