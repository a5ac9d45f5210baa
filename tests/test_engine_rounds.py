"""A round of the engine as a serving engine runs it: at most two reads of device values on the
host per round, for every method, greedy and sampling, counted independently of the engine's own
choke point (draftsmith.eval.host) by patching every way a tensor's value reaches Python.

On a GPU each such read waits for the device to finish the work queued before it; on this CPU
nothing waits, so the count is what the test checks: the same code path runs on both.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import noisy_copy, tiny_llama

from draftsmith.eval.dflash import BlockProposer
from draftsmith.eval.draft import DraftModelProposer
from draftsmith.eval.eagle import EagleProposer
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.host import host_reads
from draftsmith.eval.medusa import MedusaProposer
from draftsmith.eval.proposers import NgramProposer, Proposer
from draftsmith.eval.sampling import SamplingParams
from draftsmith.heads.dflash import DFlashConfig, DFlashDraft
from draftsmith.heads.eagle import EagleHead, build_draft_vocab
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads
from draftsmith.targets.target import wrap_target

# every way a tensor's value becomes a Python value (each a device-to-host copy on a GPU)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")
# and the operations whose output's size depends on values (the device must be read first)
SIZED_BY_VALUES = ("nonzero", "masked_select", "unique", "argwhere")
PROMPT = [5, 17, 3, 9, 17, 3, 9, 40, 2, 5, 17]
GREEDY = SamplingParams()
SAMPLING = SamplingParams(temperature=0.8, top_p=0.9)


@contextlib.contextmanager
def counting_reads():
    """Counts (by name) every host read of a tensor value while the block runs."""
    seen: list[str] = []
    saved = {}

    def counted(name, original):
        def method(self, *args, **kwargs):
            seen.append(name)
            return original(self, *args, **kwargs)
        return method

    def boolean_index(original):
        def method(self, index):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and p.ndim for p in parts):
                seen.append("boolean index")
            return original(self, index)
        return method

    for name in READS + SIZED_BY_VALUES:
        saved[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, counted(name, saved[name]))
    saved["__getitem__"] = torch.Tensor.__getitem__
    torch.Tensor.__getitem__ = boolean_index(saved["__getitem__"])
    functions = {name: getattr(torch, name) for name in SIZED_BY_VALUES if hasattr(torch, name)}
    for name, original in functions.items():
        setattr(torch, name, counted(f"torch.{name}", original))
    try:
        yield seen
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        for name, original in functions.items():
            setattr(torch, name, original)


@pytest.fixture(scope="module")
def target():
    return wrap_target(tiny_llama(layers=4, seed=3), name="tiny4")


def eagle_head(target, version):
    torch.manual_seed(7)
    if version == 1:
        head = EagleHead(EagleConfig.from_target(target, 1), target)
    else:
        counts = torch.arange(target.vocab_size, 0, -1).double()
        d2t, t2d = build_draft_vocab(counts, 48)
        cfg = EagleConfig.from_target(target, 3, aux_layer_ids=(1, 2, 3), draft_vocab_size=48)
        head = EagleHead(cfg, target, d2t=d2t, t2d=t2d)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return head.eval()


def block_draft(target, method):
    cfg = DFlashConfig.from_target(target, method, num_layers=1, block_size=4,
                                   target_layer_ids=(0, 2),
                                   markov_rank=8 if method == "dspark" else None)
    torch.manual_seed(4)
    draft = DFlashDraft(cfg, target, dtype=torch.float64)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return draft.eval()


def proposers(target):
    draft = noisy_copy(target.model, 0.1)
    torch.manual_seed(5)
    heads = MedusaHeads(MedusaConfig(target.hidden_size, target.vocab_size, num_heads=3),
                        lm_head=target.lm_head, dtype=torch.float64)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    spark = block_draft(target, "dspark")
    return {
        "plain": Proposer(),
        "pld": NgramProposer(max_ngram=2, max_depth=5),
        "pld-trie": NgramProposer(max_ngram=2, max_depth=5, max_branches=3, tree_nodes=8),
        "draft-chain": DraftModelProposer(draft, max_depth=4, min_confidence=0.0),
        # cutting a chain at its first unconfident token is the one extra read
        "draft-chain-confidence": DraftModelProposer(draft, max_depth=4, min_confidence=0.3),
        "draft-tree": DraftModelProposer(draft, branching=[3, 2]),
        "draft-tree-sample": DraftModelProposer(draft, branching=[3, 2], children="sample"),
        "eagle1": EagleProposer(eagle_head(target, 1), depth=4, topk=3, tree_nodes=10),
        "eagle3": EagleProposer(eagle_head(target, 3), depth=4, topk=3, tree_nodes=10),
        "eagle3-chain": EagleProposer(eagle_head(target, 3), depth=4, topk=1, tree_nodes=4),
        "medusa": MedusaProposer(target, heads, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
        "dflash": BlockProposer(block_draft(target, "dflash")),
        "dspark": BlockProposer(spark),
        "dspark-confidence": BlockProposer(block_draft(target, "dspark"), min_confidence=0.2)
        if spark.config.confidence_head else BlockProposer(spark),
    }


NAMES = list(proposers(wrap_target(tiny_llama(layers=4, seed=3), name="tiny4")))


@pytest.mark.parametrize("params", [GREEDY, SAMPLING], ids=["greedy", "sampling"])
@pytest.mark.parametrize("name", NAMES)
def test_a_round_reads_the_device_at_most_twice(target, name, params):
    proposer = proposers(target)[name]
    engine = SpeculativeEngine(target)
    state = engine.begin(PROMPT, 40, params, proposer, seed=0, stop_at_eos=False)
    rounds, drafted = 0, 0
    while not state.done:
        before = host_reads()
        with counting_reads() as seen:
            engine.step(state)
        rounds += 1
        drafted = state.gen.proposed
        assert len(seen) <= 2, f"{name}: one round read the device {len(seen)} times: {seen}"
        # the engine's own count of its reads agrees with what the patches saw
        assert host_reads() - before == len(seen), (name, seen)
    assert rounds > 3
    if name != "plain":
        assert drafted > 0, f"{name} proposed nothing: the test proves nothing"
    assert sum(n for n, _, _ in state.gen.rounds) == state.gen.proposed


def test_the_count_sees_a_read_hidden_in_a_proposer(target):
    """The control: a proposer that reads one value per round pushes the count to 2, and one
    that gathers with a boolean mask is seen too."""

    class Nosy(NgramProposer):
        def observe(self, seq, tree, path, hidden):
            float(hidden[0].sum()) if hidden else None

        @property
        def hidden_layers(self):
            return (target.num_layers,)

    engine = SpeculativeEngine(target)
    state = engine.begin(PROMPT, 12, GREEDY, Nosy(max_ngram=2), stop_at_eos=False)
    with counting_reads() as seen:
        engine.step(state)
    assert seen.count("__float__") == 1 and len(seen) == 2
    row = torch.arange(4.0)
    with counting_reads() as seen:
        row[row > 1]
    assert seen == ["boolean index"]
