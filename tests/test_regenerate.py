"""draftsmith.train.data regenerate: every turn answered given the target's own history, cut at a turn
boundary when it no longer fits, shards that merge into the unsharded file, resume after a
SIGKILL, and the clear errors. The OpenAI backend against a real server is in
tests/test_regenerate_server.py.

The target is a random 2-layer Llama over the SmolLM2 tokenizer (greedy, float64: no near-ties).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from draftsmith.targets.resolve import resolve_target
from draftsmith.targets.target import load_target, wrap_target
from draftsmith.train import regenerate as regeneration
from draftsmith.train.regenerate import (
    load_prompts,
    merge_shards,
    parse_shard,
    regenerate,
    shard_path,
)
from draftsmith.train.regenerate_backends import HFBackend, OpenAIBackend
from draftsmith.train.rows import read_conversations

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is fifteen more than a quarter of 48?", "How are you?",
             "Twice Angie's age, plus 4, is 20. How old is Angie?", "Name a red fruit.",
             "Write a function to find the area of a rombus.", "What is packet sniffing?"]
GREEDY = dict(max_new_tokens=6, temperature=0.0, batch_size=1, progress=False)


def chat(*turns: str, system: str | None = None) -> list[dict]:
    """A conversation with the user turns given and a dataset answer after each."""
    messages = [{"role": "system", "content": system}] if system else []
    for turn in turns:
        messages += [{"role": "user", "content": turn},
                     {"role": "assistant", "content": "an answer the target never wrote"}]
    return messages


def conversations(n: int) -> list[dict]:
    """n rows in messages format, one to three turns each."""
    return [{"messages": chat(*(QUESTIONS[(i + k) % len(QUESTIONS)] for k in range(1 + i % 3)),
                              system="Be brief." if i % 4 == 0 else None)} for i in range(n)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def by_index(path: Path) -> dict[int, dict]:
    return {r["prompt_index"]: r for r in read_jsonl(path)}


@pytest.fixture(scope="module")
def target_dir(tokenizer, tmp_path_factory) -> Path:
    """A random Llama over the SmolLM2 vocabulary, saved as a Hugging Face directory (float64)."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float64)
    path = tmp_path_factory.mktemp("regen") / "tiny"
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir, dtype=torch.float64)


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    return {"multi": write_jsonl(tmp_path / "multi.jsonl", conversations(9)),
            "single": write_jsonl(tmp_path / "single.jsonl",
                                  [{"question": q} for q in QUESTIONS[:4]])}


def greedy_answer(target, messages: list[dict], max_new_tokens: int) -> tuple[str, bool]:
    """What plain greedy generate answers after ``messages`` (no padding, no batching)."""
    ids = torch.tensor([target.chat_ids(messages)])
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=list(target.eos_token_ids), pad_token_id=2)
    new = out[0, ids.shape[1]:].tolist()
    end = next((k for k, t in enumerate(new) if t in target.eos_token_ids), None)
    return target.tokenizer.decode(new[:end], skip_special_tokens=True), end is not None


# ------------------------------------------------------------------------------------------------
# Every turn


def test_every_turn_is_answered_given_the_targets_own_history(target, files, tmp_path):
    out = tmp_path / "answers.jsonl"
    assert regenerate(target, files["multi"], out, **GREEDY) == 9
    prompts, _ = load_prompts(files["multi"])
    records = by_index(out)
    assert sorted(records) == list(range(9))
    for i, record in records.items():
        messages = record["messages"]
        assert record["turns"] == len(prompts[i]) == 1 + i % 3 and not record["cut"]
        assert [m for m in messages if m["role"] != "assistant"] == [
            m for turn in prompts[i] for m in turn]
        assert "an answer the target never wrote" not in json.dumps(messages)
        # answer k is plain greedy decoding after everything before it, earlier answers included
        finished = True
        for k, message in enumerate(messages):
            if message["role"] == "assistant":
                text, ended = greedy_answer(target, messages[:k], GREEDY["max_new_tokens"])
                assert message["content"] == text, (i, k)
                finished = finished and ended
        assert record["finished"] == finished


def test_max_turns_and_a_history_that_no_longer_fits(target, files, tmp_path, capsys):
    out = tmp_path / "one_turn.jsonl"
    regenerate(target, files["multi"], out, max_turns=1, **GREEDY)
    assert {r["turns"] for r in read_jsonl(out)} == {1}

    # a context where the first turn fits and the second does not: cut at the turn boundary
    prompts, _ = load_prompts(files["multi"])
    first = by_index(out)[2]["messages"]  # prompt 2 has three turns
    length = len(target.chat_ids([*first, *prompts[2][1]])) + GREEDY["max_new_tokens"] - 1
    short = tmp_path / "short.jsonl"
    regenerate(target, [conversations(9)[2]["messages"]], short, max_length=length,
               **{**GREEDY, "progress": True})
    (record,) = read_jsonl(short)
    assert record["turns"] == 1 and record["cut"] and record["messages"] == first
    assert "1 cut at a turn boundary" in capsys.readouterr().out
    # a first turn that does not fit is skipped and counted
    assert regenerate(target, [[{"role": "user", "content": "word " * 300}]],
                      tmp_path / "long.jsonl", **{**GREEDY, "progress": True}) == 0
    assert "1 skipped, their first turn" in capsys.readouterr().out


def test_resume_after_an_interruption(target, files, tmp_path):
    out = tmp_path / "regen" / "answers.jsonl"
    sampled = dict(max_new_tokens=4, temperature=1.0, batch_size=2, seed=0, progress=False)
    sources = [files["multi"], files["single"]]
    assert regenerate(target, sources, out, max_prompts=5, **sampled) == 5
    with open(out, "a") as f:  # killed while writing the next line
        f.write('{"messages": [{"role": "user", "con')
    assert regenerate(target, sources, out, **sampled) == 8
    records = read_jsonl(out)  # the half-written line is gone: every line parses
    assert sorted(r["prompt_index"] for r in records) == list(range(13))
    assert regenerate(target, sources, out, **sampled) == 0  # nothing left to answer
    conversations_read, report = read_conversations(str(out))  # the loader reads them back
    assert report.sources[str(out)].format == "messages" and report.sources[str(out)].rows == 13
    with pytest.raises(ValueError, match="answers another prompt"):
        regenerate(target, [[{"role": "user", "content": "other"}]] * 13, out, **sampled)
    (tmp_path / "junk.jsonl").write_text('{"some": "row"}\n')
    with pytest.raises(ValueError, match="not a row regenerate wrote"):
        regenerate(target, sources, tmp_path / "junk.jsonl", **sampled)


# ------------------------------------------------------------------------------------------------
# Shards


def test_shards_merge_into_the_unsharded_file(target, files, tmp_path):
    whole = tmp_path / "whole.jsonl"
    regenerate(target, files["multi"], whole, **GREEDY)
    out = tmp_path / "sharded" / "answers.jsonl"
    regenerate(target, files["multi"], out, shard=(1, 3), **GREEDY)
    assert sorted(by_index(shard_path(out, 1, 3))) == [1, 4, 7]
    assert shard_path(out, 1, 3).name == "answers.shard-1-of-3.jsonl"
    with pytest.raises(FileNotFoundError, match="shard-0-of-3"):
        merge_shards(out)
    regenerate(target, files["multi"], out, shard="0/3", max_prompts=4, **GREEDY)
    regenerate(target, files["multi"], out, shard="2/3", **GREEDY)
    with pytest.raises(ValueError, match="different numbers of prompts"):
        merge_shards(out)
    assert merge_shards(out, partial=True) == 8  # shard 0 answered prompts 0 and 3 only
    # a shard that has stopped early continues; the merge joins them in input order
    regenerate(target, files["multi"], out, shard="0/3", **GREEDY)
    assert merge_shards(out, 3) == 9
    assert out.read_text() == "".join(
        json.dumps(r, ensure_ascii=False) + "\n" for r in sorted(
            read_jsonl(whole), key=lambda r: r["prompt_index"]))
    assert merge_shards(out) == 9  # again: the same rows, nothing lost

    other = tmp_path / "sharded" / "edited.jsonl"  # an output holding rows the shards lack
    other.write_text(out.read_text().replace("Be brief.", "Be long."))
    for i in range(3):
        os.link(shard_path(out, i, 3), shard_path(other, i, 3))
        os.link(regeneration._done_path(shard_path(out, i, 3)), regeneration._done_path(shard_path(other, i, 3)))
    before = other.read_text()
    with pytest.raises(ValueError, match="would lose it"):
        merge_shards(other)
    assert other.read_text() == before


def test_an_unfinished_shard_is_not_merged_by_default(target, files, tmp_path):
    out = tmp_path / "answers.jsonl"
    for i in range(2):
        regenerate(target, files["single"], out, shard=(i, 2), **GREEDY)
    regeneration._done_path(shard_path(out, 1, 2)).unlink()  # as if shard 1 were still running
    with pytest.raises(ValueError, match="shards not finished"):
        merge_shards(out)
    assert not out.exists()


@pytest.mark.parametrize("spec", ["3/2", "2/2", "-1/2", "0/0", "a/b", "1", "1/2/3"])
def test_bad_shard_specs_are_refused(spec, target, files, tmp_path):
    with pytest.raises(ValueError, match="I/N"):
        parse_shard(spec)
    with pytest.raises(ValueError, match="I/N"):
        regenerate(target, files["single"], tmp_path / "a.jsonl", shard=spec, **GREEDY)
    assert not list(tmp_path.glob("a*"))  # refused before anything was written


def test_command_line_shards_under_a_launcher_and_merges_at_the_end(target_dir, files, tmp_path,
                                                                    monkeypatch, capsys):
    out = tmp_path / "answers.jsonl"
    args = ["regenerate", "--target", str(target_dir), "--dtype", "float64", "--data",
            files["multi"], "--out", str(out), "--max-new-tokens", "6", "--temperature", "0",
            "--batch-size", "1", "--max-turns", "2"]
    for rank in (1, 0):  # what torchrun / accelerate launch set for each process
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        regeneration.main(args)
    printed = capsys.readouterr().out
    assert "every shard has finished: merged 9 conversations" in printed
    assert [r["prompt_index"] for r in read_jsonl(out)] == list(range(9))
    assert max(r["turns"] for r in read_jsonl(out)) == 2
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    regeneration.main(["merge", "--out", str(out)])
    assert "merged 9 conversations" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        regeneration.main([*args, "--backend", "openai"])  # needs --url and --model
    assert "--url" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Killed at any moment


def test_sigkill_at_any_moment_loses_only_the_conversations_in_flight(target, target_dir, files,
                                                                      tmp_path):
    rows = conversations(24)
    source = write_jsonl(tmp_path / "many.jsonl", rows)
    out = tmp_path / "answers.jsonl"
    command = [sys.executable, "-m", "draftsmith.train.data", "regenerate", "--target", str(target_dir),
               "--dtype", "float64", "--data", source, "--out", str(out), "--max-new-tokens",
               "6", "--temperature", "0", "--batch-size", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 5:  # mid-run, between batches
            break
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert 5 <= out.read_bytes().count(b"\n") < 24
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = tmp_path / "expected.jsonl"
    regenerate(target, source, expected, max_new_tokens=6, temperature=0.0, batch_size=3,
               progress=False)
    assert by_index(out) == by_index(expected)
    assert len(read_jsonl(out)) == 24  # every conversation once


# ------------------------------------------------------------------------------------------------
# OpenAI backend: what needs no server


def test_an_unreachable_server_is_a_clear_error_before_any_work(tokenizer, files, tmp_path):
    backend = OpenAIBackend("http://127.0.0.1:9/v1", "m", tokenizer, retries=1, backoff=0.0)
    out = tmp_path / "answers.jsonl"
    with pytest.raises(ConnectionError, match=r"failed 2 times.*127\.0\.0\.1:9/v1"):
        regenerate(backend, files["single"], out, progress=False)
    assert out.read_text() == ""
    with pytest.raises(ValueError, match="http"):
        OpenAIBackend("127.0.0.1:8000/v1", "m", tokenizer)
    tokenizer_without_template = AutoTokenizer.from_pretrained(
        str(resolve_target("smollm2-135m")), chat_template=None)
    tokenizer_without_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        OpenAIBackend("http://127.0.0.1:9/v1", "m", tokenizer_without_template)


def test_a_loaded_target_is_run_by_the_hf_backend(tokenizer):
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    backend = HFBackend(wrap_target(model, tokenizer), batch_size=3)
    assert backend.batch_size == 3 and backend.max_context == 2048
    with pytest.raises(ValueError, match="batch_size"):
        HFBackend(wrap_target(model, tokenizer), batch_size=0)
