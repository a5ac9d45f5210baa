"""GGUF layouts served by a real llama-server: a tiny random Llama target (f32), a tiny EAGLE-3
head and a tiny draft model, exported through llama.cpp's own converter.

These need llama.cpp (``make llama-cpp``). A user's ``make test`` skips them when it is missing and
says how to build it; CI sets ``DRAFTSMITH_REQUIRE_LLAMA_CPP=1``, and there a missing server fails.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest
import torch
from conftest import noisy_copy
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.llama_bench import chain_rounds
from draftsmith.eval.sampling import SamplingParams
from draftsmith.heads.dflash import DFlashConfig, DFlashDraft, save_dflash
from draftsmith.heads.dflash_loss import dflash_loss, sample_anchors
from draftsmith.heads.eagle import EagleHead, build_draft_vocab, count_tokens, save_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.eagle_loss import eagle_loss
from draftsmith.layouts.export import main as export_main
from draftsmith.layouts.llama_cpp import (
    BUILD_COMMAND,
    LlamaServer,
    check_server,
    describe_exit,
    find_llama_server,
    gguf_for_target,
    install_dir,
    isa_options,
    smoke_test,
)
from draftsmith.targets.features import target_features
from draftsmith.targets.resolve import resolve_target
from draftsmith.targets.target import load_target

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["Name three red fruits.", "What is the capital of France?", "Count from one to ten."]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def server_path(tmp_path_factory):
    """The llama-server to test, found in the user's cache; the tests then run with a cache of
    their own (converted GGUF files go there), pointed at that llama.cpp."""
    try:
        server = find_llama_server(("draft-eagle3", "draft-simple"))
    except (FileNotFoundError, ValueError) as err:
        if os.environ.get("DRAFTSMITH_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(f"llama.cpp is required here (DRAFTSMITH_REQUIRE_LLAMA_CPP=1): {err}")
        pytest.skip(f"no llama-server ({err}); build it with `{BUILD_COMMAND}`")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_target("smollm2-135m")))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTSMITH_LLAMA_CPP", str(install_dir()))
        patch.setenv("LLAMA_SERVER", str(server))
        patch.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield server, tokenizer


def tiny_llama_dir(path, tokenizer, seed: int = 0, layers: int = 4):
    """A random f32 Llama over SmolLM2's tokenizer (llama.cpp's converter knows it)."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.3, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         rope_theta=10000.0)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return model


def padded(rows):
    """Token rows right-padded into (ids, attention mask)."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return ids, mask


def fit_eagle(head, target, rows, cfg, steps: int = 60):
    """A few AdamW steps of the EAGLE-3 loss on these rows (every position scored)."""
    ids, mask = padded(rows)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.clone()}
    batch.update(target_features(target, ids, mask, cfg))
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    head.train()
    for _ in range(steps):
        loss, _ = eagle_loss(head, batch, steps=3, feature_noise=0.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    head.eval()


def fit_block(draft, target, rows, steps: int = 80):
    """A few AdamW steps of the block loss on these rows (every position scored)."""
    ids, mask = padded(rows)
    _, states = target.features(ids, [*draft.config.hidden_states_read, target.num_layers], mask)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.clone(),
             "features": torch.cat(states[:-1], -1), "last_hidden": states[-1]}
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    draft.train()
    for step in range(steps):
        anchors = sample_anchors(batch["loss_mask"], 16, torch.Generator().manual_seed(step))
        loss, _ = dflash_loss(draft, batch, anchors)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    draft.eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory, server_path):
    root = tmp_path_factory.mktemp("llama")
    _, tokenizer = server_path
    model = tiny_llama_dir(root / "target", tokenizer)
    target = load_target(str(root / "target"), device="cpu", dtype="float32")
    # a draft that agrees often but not always: the target with noise on every weight
    draft = noisy_copy(model.float(), 0.02).to(torch.float32)
    draft.config.torch_dtype = "float32"
    draft.save_pretrained(str(root / "draft"))
    tokenizer.save_pretrained(str(root / "draft"))
    (root / "draft" / "config.json").write_text(json.dumps(
        {**json.loads((root / "draft" / "config.json").read_text()),
         "draftsmith": {"target": target.identity()}}))
    # an EAGLE-3 head with a draft vocabulary, fitted for a few steps to the target's own greedy
    # continuations, so that llama.cpp and our engine both accept some of its tokens
    prompts = [target.chat_ids(p) for p in PROMPTS]
    engine = SpeculativeEngine(target)
    rows = [p + engine.generate(p, 48, GREEDY).tokens for p in prompts]
    counts = count_tokens(rows, target.vocab_size)
    cfg = EagleConfig.from_target(target, 3, draft_vocab_size=2048, aux_layer_ids=(1, 2, 3))
    d2t, t2d = build_draft_vocab(counts, cfg.draft_vocab_size)
    torch.manual_seed(1)
    head = EagleHead(cfg, target, d2t=d2t, t2d=t2d, dtype=torch.float32)
    fit_eagle(head, target, rows, cfg)
    save_eagle(head, root / "eagle3", target)
    # a DFlash block draft (in-place slots, z-lab's layout), fitted the same way
    block_cfg = DFlashConfig.from_target(target, "dflash", num_layers=1, block_size=4,
                                         target_layer_ids=(0, 2))
    torch.manual_seed(2)
    block = DFlashDraft(block_cfg, target, dtype=torch.float32)
    fit_block(block, target, rows)
    save_dflash(block, root / "dflash", target)
    # the same with a draft vocabulary: llama.cpp's DFlash converter cannot map d2t, so the export
    # goes through its DSpark class (layouts/dflash.py); the server must still read a DFlash draft
    vocab_cfg = DFlashConfig.from_target(target, "dflash", num_layers=1, block_size=4,
                                         target_layer_ids=(0, 2), draft_vocab_size=2048)
    torch.manual_seed(4)
    vocab_block = DFlashDraft(vocab_cfg, target, d2t=d2t, t2d=t2d, dtype=torch.float32)
    fit_block(vocab_block, target, rows)
    save_dflash(vocab_block, root / "dflash-vocab", target)
    spark_cfg = DFlashConfig.from_target(target, "dspark", num_layers=1, block_size=4,
                                         target_layer_ids=(0, 2), markov_rank=16)
    torch.manual_seed(3)
    spark = DFlashDraft(spark_cfg, target, dtype=torch.float32)
    fit_block(spark, target, rows)
    save_dflash(spark, root / "dspark", target)
    target_gguf, _ = gguf_for_target(str(root / "target"), "f32")
    return {"root": root, "target": target, "target_gguf": target_gguf, "prompts": prompts}


def served(files, *args, name):
    return LlamaServer(["-m", str(files["target_gguf"]), "-c", "512", "-np", "1", *args],
                       name=name, threads=1, log_dir=files["root"] / "logs")


def test_gguf_exports_of_a_head_and_a_draft_through_llamas_converter(files, capsys):
    root = files["root"]
    assert export_main([str(root / "eagle3"), "--format", "gguf", "--out", str(root / "e3.gguf"),
                        "--gguf-type", "f32", "--target", str(root / "target"), "--check"]) == 0
    assert export_main([str(root / "draft"), "--format", "gguf", "--out",
                        str(root / "draft.gguf"), "--gguf-type", "f32", "--check"]) == 0
    checked = capsys.readouterr().out
    assert checked.count("verified: llama-server") == 2, checked
    for name in ("e3.gguf", "draft.gguf"):
        assert (root / name).read_bytes()[:4] == b"GGUF"
    # llama.cpp loads neither: refused with what to use instead, nothing written
    eagle1 = root / "eagle1"
    save_eagle(EagleHead(EagleConfig.from_target(files["target"], 1), files["target"],
                         dtype=torch.float32), eagle1, files["target"])
    assert export_main([str(eagle1), "--format", "gguf", "--out", str(root / "e1.gguf")]) == 2
    assert "llama.cpp serves EAGLE-3 heads only" in capsys.readouterr().err
    assert not (root / "e1.gguf").exists()
    # an existing file that is not a GGUF is not replaced
    (root / "notes.gguf").write_text("my notes")
    assert export_main([str(root / "draft"), "--format", "gguf", "--out",
                        str(root / "notes.gguf")]) == 2
    assert "not an earlier GGUF file" in capsys.readouterr().err
    assert (root / "notes.gguf").read_text() == "my notes"


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dflash-vocab", "dspark", "draft"])
def test_llama_server_decodes_greedily_as_plain_and_accepts_as_our_engine(files, kind):
    root, target = files["root"], files["target"]
    if kind == "eagle3":
        draft = root / "e3.gguf"
        if not draft.exists():
            export_main([str(root / "eagle3"), "--format", "gguf", "--out", str(draft),
                         "--gguf-type", "f32", "--target", str(root / "target")])
        from draftsmith.eval.eagle import EagleProposer

        ours = EagleProposer.from_artifact(str(root / "eagle3"), target, depth=3, topk=1,
                                           tree_nodes=3)
        spec = "draft-eagle3"
    elif kind in ("dflash", "dflash-vocab", "dspark"):
        draft = root / f"{kind}.gguf"
        if not draft.exists():
            export_main([str(root / kind), "--format", "gguf", "--out", str(draft),
                         "--gguf-type", "f32", "--target", str(root / "target")])
        from draftsmith.eval.dflash import BlockProposer

        ours = BlockProposer.from_artifact(str(root / kind), target, block_size=3)
        spec = "draft-dspark" if kind == "dspark" else "draft-dflash"
    else:
        draft = root / "draft.gguf"
        if not draft.exists():
            export_main([str(root / "draft"), "--format", "gguf", "--out", str(draft),
                         "--gguf-type", "f32"])
        from draftsmith.eval.draft import DraftModelProposer
        from draftsmith.heads.distill import load_draft

        ours = DraftModelProposer(load_draft(str(root / "draft"), target), max_depth=3,
                                  min_confidence=0.0)
        spec = "draft-simple"
    engine, accepted = SpeculativeEngine(target), 0
    with served(files, name="plain") as plain, served(
            files, "-md", str(draft), "--spec-type", spec, "--spec-draft-n-max", "3",
            name=kind) as speculative:
        for prompt in files["prompts"]:
            expected = plain.complete(prompt, NEW_TOKENS)["tokens"]
            assert engine.generate(prompt, NEW_TOKENS, GREEDY).tokens == expected
            speculative.rounds()
            out = speculative.complete(prompt, NEW_TOKENS)
            assert out["tokens"] == expected  # exact: the draft changes nothing but the speed
            theirs, lengths = chain_rounds(speculative.rounds())
            ours_run = engine.generate(prompt, NEW_TOKENS, GREEDY, ours)
            assert ours_run.tokens == expected
            if kind != "draft":  # the same head, the same features: round by round
                assert ours_run.accepted_lengths == lengths, (kind, prompt)
                assert ours_run.acceptance.accepted_per_depth == theirs.accepted_per_depth
                assert ours_run.acceptance.tried_per_depth == theirs.tried_per_depth
            else:
                # a random draft LM over 49152 tokens has near-ties of its own top two, which
                # llama.cpp's f32 kernels and torch's may break apart (seen: 1 round in 18):
                # the drafts agree up to that, and exactness never depends on them
                same = sum(a == b for a, b in zip(ours_run.accepted_lengths, lengths))
                assert same >= 0.7 * max(len(lengths), len(ours_run.accepted_lengths)), prompt
                assert abs(sum(ours_run.accepted_lengths) - sum(lengths)) <= 2, prompt
            accepted += sum(lengths)
    assert accepted > 0, "neither engine accepted a token: the comparison proves nothing"


def test_a_server_without_the_spec_type_or_that_dies_is_one_clear_line(files, tmp_path,
                                                                        monkeypatch):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho '--spec-type none,draft-simple,ngram-simple'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    real = os.environ["LLAMA_SERVER"]
    monkeypatch.setenv("LLAMA_SERVER", str(fake))
    with pytest.raises(ValueError, match="offers no --spec-type draft-eagle3"):
        find_llama_server(("draft-eagle3",))
    monkeypatch.setenv("LLAMA_SERVER", real)
    # not a model: the server exits while starting, and says why
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ValueError, match="exited with code"):
        with LlamaServer(["-m", str(bogus)], name="bogus", threads=1, log_dir=tmp_path):
            pass
    # a server killed mid-run: the request fails naming it
    with served(files, name="victim") as victim:
        victim.process.kill()
        victim.process.wait()
        with pytest.raises(ValueError, match="victim"):
            victim.complete(files["prompts"][0], 4)


def test_the_benchmark_in_llama_cpp_stops_every_server(files, tmp_path, capsys):
    from draftsmith.eval import bench

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in PROMPTS))
    root = files["root"]
    argv = ["--engine", "llama.cpp", "--target", str(root / "target"), "--gguf-target-type",
            "f32", "--gguf-type", "f32", "--method", "plain", "--method", "ngram:ngram-simple",
            "--method", f"eagle:{root / 'eagle3'}", "--method", f"draft:{root / 'draft'}",
            "--prompts", str(questions), "--max-new-tokens", "16", "--warmup", "0", "--threads",
            "1", "--no-progress", "--cross-check", "--out", str(tmp_path / "r.json")]
    records = {r["method"]: r for r in bench.main(argv)}
    assert all(r["greedy_identical"] for name, r in records.items() if name != "plain")
    eagle = records[f"eagle:{root / 'eagle3'}"]
    check = eagle["cross_check"]
    assert check["llama.cpp"]["accepted_per_depth"] == check["draftsmith"]["accepted_per_depth"]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["engine"] == "llama.cpp" and report["config"]["reference"] == "plain"
    # every server was stopped
    left = subprocess.run(["pgrep", "-f", str(files["target_gguf"])], capture_output=True,
                          text=True).stdout.split()
    assert left == [] or all(not os.path.exists(f"/proc/{pid}") for pid in left)
    # a method llama.cpp has no counterpart for: refused before any server starts, no report
    with pytest.raises(SystemExit):
        bench.main([*argv[:-2], "--method", "hf", "--out", str(tmp_path / "bad.json")])
    assert "no llama.cpp counterpart" in capsys.readouterr().err
    assert not (tmp_path / "bad.json").exists()
    # a cross-check beside a p-min stop would differ by rule: refused the same way
    with pytest.raises(SystemExit):
        bench.main([*argv[:-2], "--llama-draft-p-min", "0.5", "--out", str(tmp_path / "bad.json")])
    assert "--cross-check compares" in capsys.readouterr().err
    assert not (tmp_path / "bad.json").exists()


# a Xeon with AMX (the machine whose -march=native build died with SIGILL) and an AVX2-only EPYC
XEON_AMX = ("flags\t\t: fpu sse2 avx f16c fma bmi2 avx2 avx512f avx512dq avx512cd avx512bw "
            "avx512vl avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8\n")
EPYC_AVX2 = "flags\t\t: fpu sse2 avx f16c fma bmi2 avx2 avx512f\n"  # AVX512 only in part


def test_the_build_is_portable_and_never_uses_amx():
    from draftsmith.layouts.llama_cpp import cpu_flags

    xeon = dict(o[2:].split("=") for o in isa_options("x86_64", cpu_flags(XEON_AMX)))
    assert xeon["GGML_NATIVE"] == "OFF"  # no -march=native: nothing this CPU lacks, no AMX
    assert all(xeon[k] == "OFF" for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    assert all(xeon[k] == "ON" for k in ("GGML_AVX2", "GGML_FMA", "GGML_AVX512", "GGML_AVX512_BF16",
                                         "GGML_AVX_VNNI"))
    epyc = dict(o[2:].split("=") for o in isa_options("x86_64", cpu_flags(EPYC_AVX2)))
    assert epyc["GGML_AVX2"] == "ON" and epyc["GGML_AVX512"] == "OFF"  # avx512bw/vl/dq missing
    assert epyc["GGML_AVX_VNNI"] == "OFF"
    assert isa_options("aarch64", set()) == []  # llama.cpp's own default where AMX does not exist


def test_a_signal_is_named_with_what_to_try():
    assert describe_exit(1) == "exited with code 1"
    message = describe_exit(-4)
    assert "SIGILL" in message and BUILD_COMMAND in message and "AMX" in message
    assert "out-of-memory" in describe_exit(-9)


def test_a_crash_keeps_ggmls_failed_assertion_above_its_backtrace(tmp_path):
    """A server that aborts (gemma3 targets beside an EAGLE-3 or DFlash draft in 0c1e570) prints
    ggml's assertion and then a backtrace longer than the tail an error message quotes."""
    from types import SimpleNamespace

    log = tmp_path / "server.log"
    assert_line = ('llama-graph.cpp:1384: GGML_ASSERT(t_layer_inp[il] != nullptr && "layer input '
                   'tensor is null") failed')
    log.write_text("main: loading model\n" + assert_line + "\n"
                   + "".join(f"#{i} 0x0 in frame_{i} ()\n" for i in range(30)))
    tail = LlamaServer.log_tail(SimpleNamespace(log_path=log)).splitlines()
    assert tail[0] == assert_line
    assert tail[-1] == "#29 0x0 in frame_29 ()" and len(tail) == 13
    log.write_text("".join(f"line {i}\n" for i in range(5)))  # a short log: all of it, once
    assert LlamaServer.log_tail(SimpleNamespace(log_path=log)).splitlines() == [
        f"line {i}" for i in range(5)]


def fake_server(tmp_path, body: str):
    """A llama-server stand-in: its --help lists the spec types, any other call runs ``body``."""
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --help ]; then echo '--spec-type "
                    "none,draft-simple,draft-eagle3'; exit 0; fi\n" + body + "\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def test_the_built_server_passes_its_smoke_test_and_a_crashing_one_fails_it(server_path, tmp_path,
                                                                          monkeypatch):
    server, _ = server_path
    record = json.loads((install_dir() / "build.json").read_text())
    assert record["smoke_test"]["tokens"] == 4 and "-DGGML_AMX_TILE=OFF" in record["cmake_options"]
    assert smoke_test(server)["tokens"] == 4
    # a server that dies by SIGILL on its first forward, as the native AMX build did
    crashing = fake_server(tmp_path, "kill -ILL $$")
    with pytest.raises(ValueError, match="(?s)smoke test.*SIGILL.*make llama-cpp"):
        check_server(crashing)
    # pointed to by the user: refused before any benchmark starts, saying what to do
    monkeypatch.setenv("LLAMA_SERVER", str(crashing))
    with pytest.raises(ValueError, match="(?s)SIGILL.*point LLAMA_SERVER at another build"):
        find_llama_server(("draft-eagle3",))
    # a passing server is smoke-tested once, then remembered by path, size and time
    monkeypatch.setenv("LLAMA_SERVER", str(server))
    assert find_llama_server(("draft-eagle3",)) == server
    calls = []
    monkeypatch.setattr("draftsmith.layouts.llama_cpp.smoke_test", lambda s: calls.append(s))
    assert find_llama_server(("draft-eagle3",)) == server and calls == []
