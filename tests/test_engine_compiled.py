"""The compiled engine (draftsmith.eval.forward) on a tiny model: the same tokens as the eager engine and
as transformers, two graphs for every tree size and context, compile time counted apart."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_llama

from draftsmith.eval.draft import DraftModelProposer
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.proposers import NgramProposer
from draftsmith.eval.sampling import SamplingParams
from draftsmith.targets.target import wrap_target

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7], [10, 20, 30, 10, 20, 30, 10, 20]]


@pytest.mark.parametrize("mode", ["on"])
def test_compiled_rounds_emit_what_eager_rounds_and_transformers_do(mode):
    target = wrap_target(tiny_llama(seed=11, dtype=torch.float32), name="tiny-compiled")
    draft = noisy_copy(target.model, 0.1, seed=3)
    eager = SpeculativeEngine(target)
    references = {}
    for prompt in PROMPTS:
        out = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    pad_token_id=0)
        references[tuple(prompt)] = out[0, len(prompt):].tolist()
    compiled = SpeculativeEngine(target, compile=mode)
    for make in (lambda: None, lambda: NgramProposer(max_ngram=2, max_depth=4),
                 lambda: DraftModelProposer(draft, branching=[2, 2], compile=mode)):
        for prompt in PROMPTS:
            want = references[tuple(prompt)]
            got = compiled.generate(prompt, 24, proposer=make(), stop_at_eos=False).tokens
            assert got == want == eager.generate(prompt, 24, proposer=make(),
                                                 stop_at_eos=False).tokens
    # sampling goes through the same compiled graphs
    sampled = compiled.generate(PROMPTS[0], 16, SamplingParams(temperature=0.9),
                                NgramProposer(max_ngram=2), seed=5, stop_at_eos=False)
    assert len(sampled.tokens) == 16
    # one query, several queries: two graphs for every tree size and context length, timed
    assert compiled.forward.graphs == 2 and compiled.compile_seconds > 0
    assert compiled.forward.compile == mode


@pytest.mark.parametrize("topk,nodes", [(1, 3), (2, 5)])
def test_compiled_eagle_head_keeps_two_graphs(topk, nodes):
    """An EAGLE head is fed slices of longer buffers (its pending features, the last row of a
    wider output) and masks whose key length may equal some other length by chance: none of that
    may compile a graph of its own (a chain once recompiled every few rounds and ran at a third of
    plain decoding's speed), and the tokens stay the eager engine's."""
    from test_engine_rounds import eagle_head

    from draftsmith.eval.eagle import EagleProposer

    target = wrap_target(tiny_llama(layers=4, seed=5, dtype=torch.float32), name="tiny-eagle-c")
    head = eagle_head(target, 3)
    eager = SpeculativeEngine(target)
    compiled = SpeculativeEngine(target, compile="on")
    proposer = EagleProposer(head, depth=3, topk=topk, tree_nodes=nodes, compile="on")
    first = compiled.generate(PROMPTS[0], 20, proposer=proposer, stop_at_eos=False)
    # the graphs compiled inside this generation are left out of its seconds and its rounds'
    assert first.compile_seconds > 0
    assert sum(r[2] for r in first.rounds) <= first.seconds < first.compile_seconds
    for prompt in PROMPTS + [list(range(3, 40)), [5] * 17]:
        want = eager.generate(prompt, 20, proposer=EagleProposer(head, depth=3, topk=topk,
                                                                  tree_nodes=nodes),
                              stop_at_eos=False).tokens
        assert compiled.generate(prompt, 20, proposer=proposer, stop_at_eos=False).tokens == want
    assert proposer.forward.graphs == 2, "the head recompiled"
    assert compiled.forward.graphs == 2
