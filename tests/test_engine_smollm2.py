"""The engine on the real embedded target (slow: minutes on a CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.eval.draft import DraftModelProposer
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.proposers import NgramProposer
from draftsmith.eval.sampling import SamplingParams
from draftsmith.heads.distill import load_draft

pytestmark = pytest.mark.slow
PROMPTS = Path(__file__).resolve().parents[1] / "data" / "eval" / "mt_bench_question.jsonl"


@pytest.fixture(scope="module")
def smollm2():
    from draftsmith.targets.target import load_target

    torch.set_num_threads(2)
    target = load_target("smollm2-135m")
    yield target
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:2]]
    return [smollm2.chat_ids(r["turns"][0]) for r in rows]


def test_greedy_matches_transformers_generate(smollm2, prompt_ids):
    engine = SpeculativeEngine(smollm2)
    draft = load_draft("truncate:27", smollm2)
    for ids in prompt_ids:
        out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        reference = out[0, len(ids):].tolist()
        for proposer in (None, NgramProposer(), NgramProposer(max_branches=3, tree_nodes=16),
                         DraftModelProposer(draft, max_depth=4),
                         DraftModelProposer(draft, branching=[2, 2, 1])):
            got = engine.generate(ids, 48, proposer=proposer)
            assert got.tokens == reference, type(proposer).__name__


def test_sampling_runs_and_is_reproducible(smollm2, prompt_ids):
    engine = SpeculativeEngine(smollm2)
    draft = load_draft("truncate:27", smollm2)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    a = engine.generate(prompt_ids[0], 24, params, DraftModelProposer(draft, max_depth=4), seed=3)
    b = engine.generate(prompt_ids[0], 24, params, DraftModelProposer(draft, max_depth=4), seed=3)
    assert a.tokens == b.tokens and len(a.tokens) == 24 and a.alpha is not None


def test_the_shipped_eagle_head_loads_for_the_embedded_target_and_stays_exact(smollm2, prompt_ids):
    from draftsmith.eval.eagle import EagleProposer

    shipped = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m" / "eagle3"
    proposer = EagleProposer.from_artifact(shipped, smollm2, depth=2, topk=3, tree_nodes=4,
                                           dtype=torch.bfloat16)  # its fingerprint is checked
    ids = prompt_ids[0]
    engine = SpeculativeEngine(smollm2)
    plain = engine.generate(ids, 32)
    drafted = engine.generate(ids, 32, proposer=proposer)
    assert drafted.tokens == plain.tokens
    assert drafted.tau > 1.1  # a trained head (an untrained one stays near 1.0)


def test_the_shipped_distilled_draft_takes_the_targets_embedding_and_stays_exact(smollm2,
                                                                                  prompt_ids):
    from draftsmith.files.file_formats import read_json_object

    shipped = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m" / "draft"
    info = read_json_object(shipped / "config.json", fix="")["draftsmith"]
    assert info["embedding"] == "target" and info["draft_vocab_size"] == 4096
    draft = load_draft(str(shipped), smollm2, dtype=torch.bfloat16)  # its digest is checked
    assert torch.equal(draft.get_input_embeddings().weight,
                       smollm2.model.get_input_embeddings().weight.to(torch.bfloat16))
    ids = prompt_ids[0]
    engine = SpeculativeEngine(smollm2)
    plain = engine.generate(ids, 48)
    for proposer in (DraftModelProposer(draft, max_depth=4), DraftModelProposer(draft, branching=[3])):
        drafted = engine.generate(ids, 48, proposer=proposer)
        assert drafted.tokens == plain.tokens
    assert drafted.tau > 1.1  # 3 guesses of a trained draft (untrained truncate:2: about 1.05)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_shipped_block_drafts_load_for_the_embedded_target_and_stay_exact(smollm2, prompt_ids,
                                                                              method):
    """Both shipped block drafts (DSpark ships beside DFlash) give plain decoding's greedy tokens
    in bf16, with whole blocks and with a chain of 3 (what --tree auto picks), accepting guesses."""
    from draftsmith.eval.dflash import BlockProposer

    shipped = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-135m" / method
    ids = prompt_ids[0]
    engine = SpeculativeEngine(smollm2)
    plain = engine.generate(ids, 32)
    for size in (None, 3):
        options = {} if size is None else {"block_size": size}
        proposer = BlockProposer.from_artifact(str(shipped), smollm2, dtype=torch.bfloat16,
                                               method=method, name=method, **options)
        drafted = engine.generate(ids, 32, proposer=proposer)
        assert drafted.tokens == plain.tokens, (method, size)
        assert drafted.tau > 1.1, (method, size)  # trained drafts (held out: tau 1.39 / 1.43)
