"""The engine on sliding-window attention: a tiny random Gemma-3 (window 8, 2 global layers of 6)
and a Mistral whose every layer slides, token for token equal to transformers' greedy
``generate`` (whose caches drop what leaves the window) on prompts and generations well past the
window; caches that hold only the accepted sequence; a mask without the window is caught."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import noisy_copy, tiny_gemma3
from test_engine import FixedTree, fresh_next_logits, hf_greedy
from transformers import MistralConfig, MistralForCausalLM

import draftsmith.eval.forward as forward_module
from draftsmith.eval.draft import DraftModelProposer
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.kv import StaticCache, attention_windows
from draftsmith.eval.proposers import NgramProposer
from draftsmith.targets.target import wrap_target

WINDOW = 8
# prompts shorter and longer than the window; every generation runs 40 tokens past it
PROMPTS = [list(range(1, 13)), [7, 7, 7], [10, 20, 30, 10, 20, 30, 10, 20, 30, 10, 20], [42]]
NEW = 40


@pytest.fixture(scope="module")
def gemma():
    return wrap_target(tiny_gemma3(window=WINDOW), name="tiny-gemma3")


@pytest.fixture(scope="module")
def gemma_draft(gemma):
    """A Gemma-3 draft of the same shape: its own tree nodes are windowed in its own cache."""
    return noisy_copy(gemma.model, 0.3)


@pytest.fixture(scope="module")
def gemma_references(gemma):
    return [hf_greedy(gemma.model, p, NEW) for p in PROMPTS]


def gemma_proposers(target, draft):
    return {
        "chain": DraftModelProposer(draft, max_depth=4, min_confidence=0.0),
        "tree-topk": DraftModelProposer(draft, branching=[3, 2, 1]),
        "ngram-trie": NgramProposer(max_ngram=2, max_depth=5, max_branches=3, tree_nodes=12),
        "fixed-tree": FixedTree([0, 0, 1, 1, 2, 3, 5, 0], target.vocab_size),
    }


def test_the_window_matters(gemma, gemma_references):
    """Without its window the same weights continue otherwise: the tests below can fail."""
    config = copy.deepcopy(gemma.model.config)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    unwindowed = type(gemma.model)(config).to(torch.float64).eval()
    unwindowed.load_state_dict(gemma.model.state_dict())
    differ = sum(a != b for a, b in zip(hf_greedy(unwindowed, PROMPTS[0], NEW),
                                        gemma_references[0], strict=True))
    assert differ > NEW // 2
    assert attention_windows(gemma.model.config) == [8, 8, None, 8, 8, None]


def test_plain_decoding_equals_generate_past_the_window(gemma, gemma_references):
    engine = SpeculativeEngine(gemma)
    for prompt, reference in zip(PROMPTS, gemma_references, strict=True):
        out = engine.generate(prompt, NEW)
        assert out.tokens == reference
        assert out.target_passes == NEW - 1


@pytest.mark.parametrize("kind", ["chain", "tree-topk", "ngram-trie", "fixed-tree"])
def test_speculation_equals_generate_past_the_window(gemma, gemma_draft, gemma_references, kind):
    engine = SpeculativeEngine(gemma)
    proposer = gemma_proposers(gemma, gemma_draft)[kind]
    accepted = 0
    for prompt, reference in zip(PROMPTS, gemma_references, strict=True):
        out = engine.generate(prompt, NEW, proposer=proposer)
        assert out.tokens == reference
        accepted += sum(out.acceptance.accepted_per_depth)
    if kind != "fixed-tree":
        assert accepted > 0, "the test draft never got a token accepted: it proves nothing"


def test_a_mask_without_the_window_is_caught(gemma, gemma_draft, gemma_references, monkeypatch):
    """The broken rule: the sliding layers read the full-attention mask. It must fail."""
    monkeypatch.setattr(forward_module, "layer_masks", lambda cache, mask, positions: mask)
    engine = SpeculativeEngine(gemma)
    outs = [engine.generate(p, NEW, proposer=DraftModelProposer(gemma_draft, branching=[3, 2, 1]))
            for p in PROMPTS]
    assert [o.tokens for o in outs] != gemma_references


@pytest.mark.parametrize("kind", ["chain", "tree-topk", "fixed-tree"])
def test_caches_hold_only_the_accepted_sequence(gemma, gemma_draft, kind):
    """After rounds with rejections past the window, the target's cache (entries and their
    positions) and the draft's give what a fresh forward over the sequence gives."""
    engine = SpeculativeEngine(gemma)
    proposer = gemma_proposers(gemma, gemma_draft)[kind]
    state = engine.begin(PROMPTS[2], 60, proposer=proposer)
    rejected = 0
    for _ in range(16):
        proposed, before = state.gen.proposed, len(state.seq)
        engine.step(state)
        rejected += (state.gen.proposed - proposed) > len(state.seq) - before - 1
        seq = state.seq
        assert state.cache.get_seq_length() == len(seq) - 1
        assert state.cache.positions[: len(seq) - 1].tolist() == list(range(len(seq) - 1))
        cached = gemma.model(torch.tensor([seq[-1:]]), cache=copy.deepcopy(state.cache),
                             use_cache=True).logits[0, -1]
        torch.testing.assert_close(cached, fresh_next_logits(gemma.model, seq), rtol=1e-9,
                                   atol=1e-9)
    assert len(state.seq) > len(PROMPTS[2]) + WINDOW
    assert rejected > 0, "no round rejected anything: the test proves nothing"


def tiny_mistral(window: int = 6) -> MistralForCausalLM:
    torch.manual_seed(3)
    config = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           sliding_window=window, max_position_embeddings=256,
                           initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                           pad_token_id=None, tie_word_embeddings=False)
    return MistralForCausalLM(config).to(torch.float64).eval()


def test_every_layer_sliding_equals_generate():
    """Mistral: every layer slides, so the model reads one (windowed) mask, not a dict."""
    target = wrap_target(tiny_mistral(), name="tiny-mistral")
    assert StaticCache(target.model.config).layer_types == ["sliding_attention"]
    engine = SpeculativeEngine(target)
    draft = noisy_copy(target.model, 0.1)
    for prompt in PROMPTS[:3]:
        reference = hf_greedy(target.model, prompt, 30)
        assert engine.generate(prompt, 30).tokens == reference
        assert engine.generate(prompt, 30, proposer=DraftModelProposer(
            draft, branching=[2, 2, 1])).tokens == reference


def test_other_cache_layers_are_refused():
    config = tiny_gemma3(layers=3).config
    config.layer_types = ["sliding_attention", "chunked_attention", "full_attention"]
    config.attention_chunk_size = 4
    with pytest.raises(ValueError, match="cannot verify into: full-attention and sliding-window"):
        StaticCache(config)
