"""The engine at temperature 0: token-for-token equality with plain greedy, cache hygiene, bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import noisy_copy, tiny_llama

from draftsmith.eval.draft import DraftModelProposer
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.proposers import NgramProposer, Proposer
from draftsmith.eval.sampling import SamplingParams
from draftsmith.eval.tree import DraftTree, build_trie
from draftsmith.heads.distill import check_same_vocab, load_draft, truncate_model
from draftsmith.targets.target import wrap_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [10, 20, 30, 10, 20, 30, 10, 20], [42]]


@pytest.fixture(scope="module")
def engine(tiny_target):
    return SpeculativeEngine(tiny_target)


@pytest.fixture(scope="module")
def references(tiny_target):
    """transformers' own greedy continuation of every prompt: the ground truth."""
    return [hf_greedy(tiny_target.model, p, 32) for p in PROMPTS]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


class FixedTree(Proposer):
    """Replays a given tree shape with random tokens: exercises arbitrary tree layouts."""

    def __init__(self, parents, vocab, seed=0):
        self.parents, self.vocab = parents, vocab
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, seq, max_depth):
        tokens = torch.randint(self.vocab, (len(self.parents),), generator=self.gen).tolist()
        tree = DraftTree(tokens, self.parents)
        keep = [i for i, d in enumerate(tree.depths[1:]) if d <= max_depth]
        if len(keep) < len(tokens):  # drop nodes deeper than the budget (parents precede children)
            remap = {0: 0}
            for new, old in enumerate(keep, start=1):
                remap[old + 1] = new
            return DraftTree([tokens[i] for i in keep], [remap[self.parents[i]] for i in keep])
        return tree


def proposers(target, draft):
    vocab = target.vocab_size
    return {
        "chain": DraftModelProposer(draft, max_depth=4, min_confidence=0.0),
        "chain-confidence": DraftModelProposer(draft, max_depth=6, min_confidence=0.3),
        "tree-topk": DraftModelProposer(draft, branching=[3, 2, 1]),
        "tree-wide": DraftModelProposer(draft, branching=[4, 1, 1, 1]),
        "ngram": NgramProposer(max_ngram=2, max_depth=5),
        "ngram-trie": NgramProposer(max_ngram=2, max_depth=5, max_branches=3, tree_nodes=12),
        "fixed-tree": FixedTree([0, 0, 1, 1, 2, 3, 5, 0], vocab),
    }


@pytest.mark.parametrize("kind", ["chain", "chain-confidence", "tree-topk", "tree-wide", "ngram",
                                  "ngram-trie", "fixed-tree"])
def test_greedy_equals_plain_greedy(engine, references, tiny_target, tiny_draft, kind):
    proposer = proposers(tiny_target, tiny_draft)[kind]
    accepted = 0
    for prompt, reference in zip(PROMPTS, references):
        out = engine.generate(prompt, 32, proposer=proposer)
        assert out.tokens == reference
        assert len(out.tokens) == 32
        accepted += sum(out.acceptance.accepted_per_depth)
    if kind != "fixed-tree":
        assert accepted > 0, "the test draft never got a token accepted: it proves nothing"


def test_plain_engine_equals_transformers_greedy(engine, references):
    for prompt, reference in zip(PROMPTS, references):
        out = engine.generate(prompt, 32)
        assert out.tokens == reference
        assert out.target_passes == 31 and out.tau == 1.0 and out.alpha is None


def fresh_next_logits(model, seq):
    return model(torch.tensor([seq])).logits[0, -1]


@pytest.mark.parametrize("kind", ["chain", "tree-topk", "fixed-tree", "ngram-trie"])
def test_caches_hold_only_the_accepted_sequence(engine, tiny_target, tiny_draft, kind):
    """After rounds with rejections, cached decoding equals a fresh forward over the sequence."""
    proposer = proposers(tiny_target, tiny_draft)[kind]
    state = engine.begin(PROMPTS[2], 60, proposer=proposer)
    rejected_rounds = 0
    for _ in range(6):
        proposed = state.gen.proposed
        before = len(state.seq)
        engine.step(state)
        emitted = len(state.seq) - before
        rejected_rounds += (state.gen.proposed - proposed) > emitted - 1
        seq = state.seq
        assert state.cache.get_seq_length() == len(seq) - 1
        cache = copy.deepcopy(state.cache)
        cached = tiny_target.model(torch.tensor([seq[-1:]]), cache=cache, use_cache=True).logits[0, -1]
        torch.testing.assert_close(cached, fresh_next_logits(tiny_target.model, seq),
                                   rtol=1e-9, atol=1e-9)
        if isinstance(proposer, DraftModelProposer):
            # the draft cache holds a prefix of the sequence and nothing of rejected branches
            held = proposer.cached
            assert held == seq[: len(held)]
            assert proposer.cache.get_seq_length() == len(held)
            pending = seq[len(held):]
            dcache = copy.deepcopy(proposer.cache)
            got = proposer.model(torch.tensor([pending]), cache=dcache, use_cache=True).logits[0, -1]
            torch.testing.assert_close(got, fresh_next_logits(proposer.model, seq),
                                       rtol=1e-9, atol=1e-9)
    assert rejected_rounds > 0, "no round rejected anything: the test proves nothing"


def test_stops_at_eos_and_exact_length():
    model = tiny_llama(seed=0)
    reference = hf_greedy(model, PROMPTS[0], 30)
    eos = reference[7]
    target = wrap_target(copy.deepcopy(model), name="eos-target")
    target.eos_token_ids = (eos,)
    engine = SpeculativeEngine(target)
    for proposer in (None, DraftModelProposer(noisy_copy(model, 0.08), max_depth=5),
                     NgramProposer()):
        out = engine.generate(PROMPTS[0], 30, proposer=proposer)
        assert out.tokens == reference[: reference.index(eos) + 1]
        assert out.stop_reason == "eos"
        for n in (1, 2, 3, 9):
            assert engine.generate(PROMPTS[0], n, proposer=proposer, stop_at_eos=False).tokens == \
                reference[:n]


def test_truncated_draft_shares_weights_and_generates(tiny_target):
    draft = truncate_model(tiny_target.model, 1)
    assert draft.config.num_hidden_layers == 1
    assert draft.lm_head.weight is tiny_target.model.lm_head.weight
    assert draft.model.layers[0] is tiny_target.model.model.layers[0]
    engine = SpeculativeEngine(tiny_target)
    ref = engine.generate(PROMPTS[0], 25).tokens
    assert engine.generate(PROMPTS[0], 25, proposer=DraftModelProposer(draft)).tokens == ref
    with pytest.raises(ValueError, match="1 <= N <= 2"):
        truncate_model(tiny_target.model, 3)


def test_trie_merges_prefixes_within_budget():
    tree = build_trie([[1, 2, 3], [1, 2, 4], [5, 6]], tree_nodes=5)
    assert tree.tokens == [1, 2, 3, 4, 5]
    assert tree.parents == [0, 1, 2, 2, 0]
    assert not tree.is_chain and tree.depths == [0, 1, 2, 3, 3, 1]


def test_ngram_proposes_latest_continuation():
    ngram = NgramProposer(max_ngram=2, max_depth=3)
    tree = ngram.propose([5, 6, 7, 8, 1, 5, 6, 9, 9, 5, 6], max_depth=3)
    assert tree.tokens == [9, 9, 5]  # the most recent "5 6" is followed by 9 9 5
    assert ngram.propose([1, 2, 3], max_depth=3) is None


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_generation_requests(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], 5)
    for n in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
            engine.generate([1, 2], n)
    with pytest.raises(ValueError, match="context is 256: shorten the prompt"):
        engine.generate([1] * 300, 5)
    with pytest.raises(ValueError, match="use max_new_tokens <= 56"):
        engine.generate([1] * 200, 100)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([1, 500], 5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)


def test_vocabulary_mismatch_is_refused(tiny_target):
    other = tiny_llama(vocab=100, seed=3)
    with pytest.raises(ValueError, match=r"draft 'small' has 100 output tokens, target 'tiny-target' has 96"):
        check_same_vocab(tiny_target, other, draft_name="small")


def test_draft_spec_errors(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="truncate:N"):
        load_draft("truncate:x", tiny_target)
    with pytest.raises(FileNotFoundError, match="neither truncate:N nor a model directory"):
        load_draft(str(tmp_path / "missing"), tiny_target)
    saved = tmp_path / "draft"
    tiny_llama(vocab=100, seed=3).save_pretrained(saved)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        load_draft(str(saved), tiny_target)


def test_draft_in_another_precision_keeps_greedy_exact(engine, references, tiny_target):
    """The draft's dtype is free: the float64 target verifies a float32 / bf16 copy of its layer."""
    for dtype in (torch.float32, torch.bfloat16):
        draft = load_draft("truncate:1", tiny_target, dtype=dtype)
        assert next(draft.parameters()).dtype == dtype
        assert draft.lm_head.weight is not tiny_target.model.lm_head.weight  # a copy, not shared
        proposer = DraftModelProposer(draft, max_depth=3)
        for prompt, reference in zip(PROMPTS, references):
            assert engine.generate(prompt, 32, proposer=proposer).tokens == reference
