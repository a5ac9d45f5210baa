"""Every trainer on a tiny random Gemma-3 (sliding window 8, 2 global layers of 6, tied and
scaled embeddings, one key/value head) over SmolLM2's vocabulary: a short run trains, measures
acceptance through the engine (windowed masks) and exports every layout draftsmith writes for the
method, which loads back with the same logits."""

from __future__ import annotations

import random

import pytest
import test_train_distill as distill_test
import test_train_eagle as eagle_test
import test_train_medusa as medusa_test
import torch
from conftest import records, tiny_gemma3, write_jsonl
from test_train_dflash import config as dflash_config
from test_train_eagle import chat_token_ids, conversation

from draftsmith.eval.bench import build_methods
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.sampling import SamplingParams
from draftsmith.heads.dflash import load_dflash
from draftsmith.heads.eagle import load_eagle
from draftsmith.heads.methods import artifact_method
from draftsmith.layouts.dflash import load_block_draft
from draftsmith.layouts.eagle import load_eagle_head
from draftsmith.layouts.export import all_formats, check_export, export
from draftsmith.targets.target import load_target
from draftsmith.train.dflash import main as dflash_main
from draftsmith.train.distill import main as distill_main
from draftsmith.train.eagle import main as eagle_main
from draftsmith.train.medusa import main as medusa_main

pytestmark = pytest.mark.usefixtures("trainer_env")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Gemma-3 target over SmolLM2's tokenizer (rows of unused tokens zeroed, as in the
    EAGLE tests: a random target spread over 49152 tokens leaves nothing to learn), data whose
    rows run past the window, evaluation prompts."""
    root = tmp_path_factory.mktemp("gemma")
    tokenizer = load_target("smollm2-135m").tokenizer
    rng = random.Random(0)
    rows = [conversation(rng, rng.randint(6, 10), rng.randint(12, 20)) for _ in range(16)]
    prompts = [" ".join(eagle_test.WORDS[i:i + 6]) for i in (0, 7)]
    eval_prompts = root / "eval.jsonl"
    eval_prompts.write_text("".join(f'{{"turns": ["{p}"]}}\n' for p in prompts))
    used = chat_token_ids(tokenizer, rows, prompts)
    model = tiny_gemma3(vocab=len(tokenizer), layers=6, dtype=torch.float32, init=0.3)
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    unused = torch.ones(len(tokenizer), dtype=torch.bool)
    unused[sorted(used)] = False
    with torch.no_grad():
        model.get_input_embeddings().weight[unused] = 0
    target = root / "target"
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    data = write_jsonl(root / "rows.jsonl", rows)
    return {"root": root, "target": str(target), "varied": data, "data": data,
            "eval": str(eval_prompts)}


def measured(out) -> None:
    """The run measured acceptance through the engine at its evaluation steps."""
    taus = [r["eval/tau"] for r in records(out) if "eval/tau" in r]
    assert taus and all(t >= 1 for t in taus)


def _greedy_equal(target, proposer, prompts) -> int:
    """Greedy through the engine with ``proposer`` equals plain decoding past the window; ->
    the draft tokens accepted."""
    engine, accepted = SpeculativeEngine(target), 0
    for prompt in prompts:
        plain = engine.generate(prompt, 24, SamplingParams(), stop_at_eos=False).tokens
        out = engine.generate(prompt, 24, SamplingParams(), proposer, stop_at_eos=False)
        assert out.tokens == plain
        accepted += sum(out.acceptance.accepted_per_depth)
    return accepted


PROMPTS = [list(range(1000, 1012)), [1200, 1201, 1202]]


def exported_everywhere(artifact, target_dir: str, tmp_path,
                        refused: dict[str, str] | None = None) -> list[str]:
    """Every layout draftsmith writes for the artifact's method (gguf, which needs llama.cpp,
    is served in tests/test_llama_cpp.py), each read back by the consumer checks (--check);
    ``refused``: format -> the message of a consumer that does not serve the family."""
    method = artifact_method(artifact)
    done = []
    for fmt in all_formats()[method]:
        if fmt == "gguf":
            continue
        extra = {"speculators": dict(verifier="org/tiny", target=target_dir),
                 "fasterdecoding": dict(write_pt=True)}.get(fmt, {})
        if fmt in (refused or {}):
            with pytest.raises(ValueError, match=refused[fmt]):
                export(artifact, fmt, tmp_path / f"{method}-{fmt}", **extra)
            continue
        out = export(artifact, fmt, tmp_path / f"{method}-{fmt}", **extra)
        assert check_export(artifact, fmt, out, target=target_dir), (method, fmt)
        done.append(fmt)
    return done


def test_eagle3_trains_measures_and_exports(files, tmp_path):
    out = tmp_path / "eagle"
    result = eagle_main(eagle_test.config(files, out, aux_layer_ids="1,3,5", max_steps=2,
                                          eval_every=2, save_every=2))
    measured(out)
    target = load_target(files["target"])
    assert target.model.config.layer_types.count("full_attention") == 2
    head = load_eagle(result["artifact"], target).eval()
    ids = torch.randint(0, 400, (1, 10), generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 10, 3 * 64, dtype=head.dtype)
    with torch.no_grad():
        _, expected = head(ids, head.fuse(features), torch.arange(10)[None])
    assert exported_everywhere(result["artifact"], files["target"], tmp_path) == [
        "vllm", "sglang", "speculators"]
    for fmt in ("vllm", "sglang"):
        back = load_eagle_head(tmp_path / f"eagle3-{fmt}", target).eval()
        with torch.no_grad():
            _, logits = back(ids, back.fuse(features), torch.arange(10)[None])
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=fmt)
    proposer = build_methods([f"eagle:{result['artifact']}"], target)[0].proposer
    _greedy_equal(target, proposer, PROMPTS)


def test_medusa_trains_measures_and_exports(files, tmp_path):
    out = tmp_path / "medusa"
    cfg = medusa_test.base_config(files, out, data=[files["data"]], max_steps=2, eval_every=2,
                                  save_every=2, heldout_every=2)
    result = medusa_main(cfg)
    measured(out)
    target = load_target(files["target"])
    # FasterDecoding's Medusa wraps Llama and Mistral models only
    assert exported_everywhere(result["artifact"], files["target"], tmp_path, refused={
        "fasterdecoding": "serves only llama and mistral base models, and these heads are for "
                          "a 'gemma3_text' target"}) == ["trtllm", "vllm-0.32"]
    proposer = build_methods([f"medusa:{result['artifact']}"], target)[0].proposer
    _greedy_equal(target, proposer, PROMPTS)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_drafts_train_measure_and_export(files, tmp_path, method):
    out = tmp_path / method
    result = dflash_main(dflash_config(files, out, method=method, target_layer_ids="0,2,4",
                                       max_steps=2, eval_every=2, save_every=2))
    measured(out)
    target = load_target(files["target"])
    draft = load_dflash(result["artifact"], target)
    assert exported_everywhere(result["artifact"], files["target"], tmp_path) == [
        "vllm", "sglang", "speculators"]
    back = load_block_draft(tmp_path / f"{method}-vllm", target)
    for name, value in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    proposer = build_methods([f"{method}:{result['artifact']}"], target)[0].proposer
    _greedy_equal(target, proposer, PROMPTS)


def test_distilled_draft_keeps_the_window_and_trains(files, tmp_path):
    out = tmp_path / "draft"
    cfg = distill_test.base_config(files, out, data=[files["data"]], draft="truncate:2",
                                   max_steps=2, eval_every=2, save_every=2, heldout_every=2,
                                   on_policy_ratio=0.0)
    result = distill_main(cfg)
    measured(out)
    target = load_target(files["target"])
    assert exported_everywhere(result["artifact"], files["target"], tmp_path) == ["hf"]
    method = build_methods([f"draft:{result['artifact']}"], target)[0]
    draft_config = method.proposer.model.config
    assert draft_config.sliding_window == 8 and "sliding_attention" in draft_config.layer_types
    _greedy_equal(target, method.proposer, PROMPTS)
