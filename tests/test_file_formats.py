"""One error at every file boundary (draftsmith.files.file_formats.FileFormatError): a damaged artifact,
draft or published layout names the file, what is wrong and what to do; a draft directory is
written as a marked artifact and never replaces what draftsmith did not write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from draftsmith.files.file_formats import FileFormatError, load_safetensors, read_json_object
from draftsmith.files.output_dir import read_marker
from draftsmith.heads.artifact import load_artifact, read_artifact_config
from draftsmith.heads.distill import load_draft, read_draft_info, save_draft
from draftsmith.heads.medusa import MedusaHeads, load_medusa, save_medusa
from draftsmith.layouts.medusa import export_medusa, load_medusa_export
from draftsmith.targets.target import wrap_target

VOCAB = 40


def llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tokenizer() -> PreTrainedTokenizerFast:
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1},
                                unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture
def target():
    return wrap_target(llama(), tokenizer(), name="t")


def test_json_and_safetensors_readers(tmp_path):
    path = tmp_path / "config.json"
    cases = {b'{"a": 1,': r"is not valid JSON \(Expecting property name .* at line 1, column 9\)",
             b"": "is empty", b"  \n": "is empty", b"[1, 2]": "holds a JSON list, not an object",
             b'{"a": "\xff"}': r"is not UTF-8 text \(byte 7 is 0xff\)"}
    for content, problem in cases.items():
        path.write_bytes(content)
        with pytest.raises(FileFormatError, match=rf"config.json: {problem}; do this") as info:
            read_json_object(path, fix="do this")
        assert info.value.path == path and info.value.fix == "do this"
    path.write_text('{"a": 1}')
    assert read_json_object(path, fix="x") == {"a": 1}

    weights = tmp_path / "w.safetensors"
    save_file({"x": torch.ones(64, 64)}, str(weights))
    assert torch.equal(load_safetensors(weights, fix="x")["x"], torch.ones(64, 64))
    truncate(weights)
    with pytest.raises(FileFormatError, match=r"w.safetensors: is not a complete safetensors "
                                              r"file .*; write it again"):
        load_safetensors(weights, fix="write it again")
    with pytest.raises(FileNotFoundError, match="missing.safetensors does not exist"):
        load_safetensors(tmp_path / "missing.safetensors", fix="x")
    assert issubclass(FileFormatError, ValueError)  # callers that catch ValueError still do


def test_a_damaged_artifact_names_the_file(tmp_path, target):
    save_medusa(tmp_path / "a", MedusaHeads.from_target(target, num_heads=2), target)
    config = tmp_path / "a" / "config.json"
    good = config.read_text()
    config.write_text(good[: len(good) // 2])
    for read in (lambda: read_artifact_config(tmp_path / "a"), lambda: load_artifact(tmp_path / "a"),
                 lambda: load_medusa(tmp_path / "a", target)):
        with pytest.raises(FileFormatError, match=r"a/config.json: is not valid JSON .*; the "
                                                  r"artifact is damaged: train or export it again"):
            read()
    config.write_text(good)
    truncate(tmp_path / "a" / "model.safetensors")
    with pytest.raises(FileFormatError, match=r"a/model.safetensors: is not a complete "
                                              r"safetensors file"):
        load_medusa(tmp_path / "a", target)


def test_a_damaged_medusa_export_names_the_file(tmp_path, target):
    save_medusa(tmp_path / "a", MedusaHeads.from_target(target, num_heads=2), target)
    out = export_medusa(tmp_path / "a", "trtllm", tmp_path / "export")
    assert load_medusa_export(out).num_heads == 2
    truncate(out / "medusa_lm_head.safetensors")
    with pytest.raises(FileFormatError, match=r"medusa_lm_head.safetensors: is not a complete "
                                              r"safetensors file.*export or download it again"):
        load_medusa_export(out)
    (out / "config.json").write_text("{")
    with pytest.raises(FileFormatError, match=r"export/config.json: is not valid JSON"):
        load_medusa_export(out)


def test_draft_directories_are_marked_artifacts_and_read_with_named_errors(tmp_path, target):
    model = llama(seed=3)
    out = save_draft(model, target.tokenizer, tmp_path / "draft", target.identity())
    assert read_marker(out) == {"written_by": "draftsmith", "kind": "artifact", "method": "draft"}
    assert read_draft_info(out)["target"]["weights_fingerprint"] == \
        target.identity()["weights_fingerprint"]
    save_draft(model, target.tokenizer, out, target.identity())  # an earlier draft: replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match=r"mine exists and holds files draftsmith did not write "
                                         r"\(notes.txt\).*--overwrite"):
        save_draft(model, target.tokenizer, mine, target.identity())
    assert (mine / "notes.txt").read_text() == "keep"
    save_draft(model, target.tokenizer, mine, target.identity(), overwrite=True)
    assert not (mine / "notes.txt").exists() and (mine / "model.safetensors").is_file()

    (out / "config.json").write_text('{"model_type": "llama"')
    with pytest.raises(FileFormatError, match=r"draft/config.json: is not valid JSON"):
        load_draft(str(out), target)
    with pytest.raises(FileFormatError, match=r"draft/config.json: is not valid JSON"):
        read_draft_info(out)
    assert json.loads((mine / "config.json").read_text())["draftsmith"]["method"] == "draft"
