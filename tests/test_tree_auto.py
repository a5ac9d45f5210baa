"""--tree auto: acceptance measured as the proposer drafts, the choice, the stored calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_eagle
import torch
from test_eagle import NEW_TOKENS, PROMPTS, fresh

from draftsmith.eval import tree_auto
from draftsmith.eval.eagle import EagleProposer
from draftsmith.eval.engine import SpeculativeEngine
from draftsmith.eval.kv import crop
from draftsmith.heads.eagle import save_eagle

# test_eagle's module fixtures: its tiny float64 target and the heads fitted to its continuations
one_thread, target, engine, greedy = (test_eagle.one_thread, test_eagle.target,
                                      test_eagle.engine, test_eagle.greedy)
batch, maps, heads = test_eagle.batch, test_eagle.maps, test_eagle.heads

RANKS = 6


@torch.no_grad()
def sequential_rank_accuracies(target, head, prompts, depth, ranks):
    """The same statistic, one anchor and one depth at a time, through the head's forward."""
    plain = SpeculativeEngine(target)
    hits = torch.zeros(depth, ranks, dtype=torch.float64)
    totals = torch.zeros(depth, dtype=torch.float64)
    for prompt in prompts:
        seq = prompt + plain.generate(prompt, NEW_TOKENS).tokens
        for p in range(len(prompt), len(seq) - 1):  # the engine's root: seq[:p + 1] is known
            cache, hidden, logits = fresh(target, head, seq[:p + 1])
            base = p
            for d in range(depth):
                if p + 1 + d >= len(seq):
                    break
                truth = seq[p + 1 + d]
                if head.version == 3:
                    draft = torch.cumsum(head.t2d.long(), 0)[truth] - 1
                    own = logits[draft] if head.t2d[truth] else None
                else:
                    own = logits[truth]
                totals[d] += 1
                if own is None:
                    break
                rank = int((logits > own).sum())
                if rank >= ranks:
                    break
                hits[d, rank] += 1
                hidden, out = head(torch.tensor([[truth]]), hidden,
                                   torch.tensor([[base + d]]), None, cache)
                logits = out[0, -1]
            crop(cache, base)
    kept = int((totals > 0).sum())
    return (hits / totals.clamp_min(1)[:, None])[:kept], totals[:kept]


@pytest.mark.parametrize("version", [1, 3])
def test_rank_accuracies_equal_drafting_along_the_true_continuation(target, heads, version):
    head = heads[version]["trained"]
    got = tree_auto.eagle_rank_accuracies(head, target, PROMPTS, max_new_tokens=NEW_TOKENS,
                                          depth=4, ranks=RANKS)
    want, totals = sequential_rank_accuracies(target, head, PROMPTS, 4, RANKS)
    assert got["positions"] == totals.int().tolist()
    torch.testing.assert_close(torch.tensor(got["rank_accuracies"], dtype=torch.float64), want,
                               rtol=0, atol=1e-9)
    acc = got["rank_accuracies"]
    assert acc[0][0] > 0.5  # a trained head: the statistic is not trivially zero
    assert got["tokens"] == sum(len(SpeculativeEngine(target).generate(p, NEW_TOKENS).tokens)
                                for p in PROMPTS)


def test_choice_follows_the_cost_of_verification():
    acc = [[0.7, 0.2, 0.05], [0.6, 0.2, 0.1], [0.5, 0.2, 0.1]]
    draft = {(d, k): 0.0 for d in (1, 2, 3) for k in (1, 2, 3)}
    # verification as cheap for 16 tokens as for 1: the biggest tree wins
    flat = {n: 1.0 for n in (1, 2, 4, 8, 16)}
    big = tree_auto.choose_eagle_tree(acc, flat, draft)
    assert (big.depth, big.topk) == (3, 3) and big.tree_nodes == 15
    # every extra token doubles the cost: no tree beats plain decoding, the smallest is kept
    steep = {n: float(2 ** (n - 1)) for n in (1, 2, 4, 8, 16)}
    small = tree_auto.choose_eagle_tree(acc, steep, draft)
    assert (small.depth, small.topk, small.tree_nodes) == (1, 1, 1)
    assert small.expected_tau == pytest.approx(1.7)
    assert small.predicted_speedup == pytest.approx(1.7 / 2)
    # the draft's own cost counts: one step of depth 1 is cheap, every deeper one dear
    linear = {n: 1.0 + 0.1 * (n - 1) for n in (1, 2, 4, 8, 16)}
    dear = {(d, k): 0.5 * (d - 1) for d, k in draft}
    chosen = tree_auto.choose_eagle_tree(acc, linear, dear)
    assert chosen.depth == 1
    best = max(chosen.table, key=lambda r: r["predicted_speedup"])
    assert best["predicted_speedup"] == pytest.approx(chosen.predicted_speedup)
    with pytest.raises(ValueError, match="plain decoding"):
        tree_auto.choose_eagle_tree(acc, {2: 1.0, 4: 1.0}, draft)
    with pytest.raises(ValueError, match="no \\(depth, topk\\)"):
        tree_auto.choose_eagle_tree(acc, flat, {(5, 5): 0.0})


def test_calibration_is_stored_reused_and_redone_on_another_machine(tmp_path, target, heads,
                                                                    monkeypatch, capsys):
    path = save_eagle(heads[3]["trained"], tmp_path / "head", target)
    proposer = EagleProposer.from_artifact(path, target)
    first = tree_auto.auto_eagle_tree(proposer, path, target, calibration_prompts=PROMPTS)
    assert first["measured_now"]
    assert "no acceptance statistics" in capsys.readouterr().err
    stored = json.loads((path / tree_auto.CALIBRATION_FILE).read_text())
    assert len(stored["acceptance"]) == 1 and len(stored["machines"]) == 1
    assert (proposer.depth, proposer.topk, proposer.tree_nodes) == (
        first["depth"], first["topk"], first["tree_nodes"])
    assert first["expected_tokens_per_s"] > 0

    again = tree_auto.auto_eagle_tree(EagleProposer.from_artifact(path, target), path, target,
                                      calibration_prompts=PROMPTS)
    assert not again["measured_now"] and again["tree_nodes"] == first["tree_nodes"]
    assert "measuring" not in capsys.readouterr().err

    # another machine: its costs are measured and stored beside, not instead of, the first
    real = tree_auto.machine_description
    monkeypatch.setattr(tree_auto, "machine_description",
                        lambda *a: {**real(*a), "device_name": "another CPU"})
    other = tree_auto.auto_eagle_tree(EagleProposer.from_artifact(path, target), path, target,
                                      calibration_prompts=PROMPTS)
    assert other["measured_now"] and other["machine_key"] != first["machine_key"]
    err = capsys.readouterr().err
    assert "measuring this machine's costs (1 calibration(s) from other machines" in err
    assert "acceptance" not in err  # the weights did not change
    stored = json.loads((path / tree_auto.CALIBRATION_FILE).read_text())
    assert set(stored["machines"]) == {first["machine_key"], other["machine_key"]}

    # retrained weights: their acceptance is measured again
    save_eagle(heads[3]["random"], path, target)
    tree_auto.auto_eagle_tree(EagleProposer.from_artifact(path, target), path, target,
                              calibration_prompts=PROMPTS)
    assert "no acceptance statistics" in capsys.readouterr().err


def _calibration(acceptance=None, machines=None) -> str:
    return json.dumps({"format": tree_auto.CALIBRATION_FORMAT,
                       "version": tree_auto.CALIBRATION_VERSION,
                       "acceptance": acceptance or {}, "machines": machines or {}})


@pytest.mark.parametrize("damage, said", [
    (lambda path, key: b"{not json", "is damaged (not JSON"),
    (lambda path, key: b'{"format": "draftsmith-tree-calibration", \xff}', "is damaged (byte 42 "
     "is not UTF-8 text)"),
    (lambda path, key: b"[1, 2]", "is damaged (not a draftsmith-tree-calibration file)"),
    (lambda path, key: _calibration(machines={key: {"verify_seconds": {"1": "fast", "2": 0.1},
                                                    "draft_seconds": {"1,1": 0.1}}}).encode(),
     "its machines entry {key} is damaged (verify_seconds is not a mapping"),
    (lambda path, key: _calibration(acceptance={tree_auto.artifact_weights_digest(path): {
        "rank_accuracies": [[0.5, "x"]]}}).encode(),
     "its acceptance entry {digest} is damaged (rank_accuracies is not a table"),
])
def test_a_damaged_calibration_is_named_and_measured_again(tmp_path, target, heads, capsys,
                                                           damage, said):
    path = save_eagle(heads[1]["trained"], tmp_path / "head", target)
    key = tree_auto.machine_key(tree_auto.machine_description(target, None))
    file = path / tree_auto.CALIBRATION_FILE
    file.write_bytes(damage(path, key))
    chosen = tree_auto.auto_eagle_tree(EagleProposer.from_artifact(path, target), path, target,
                                       calibration_prompts=PROMPTS)
    assert chosen["measured_now"] and chosen["tree_nodes"] >= 1
    digest = tree_auto.artifact_weights_digest(path)
    assert f"{file}{':' if 'entry' in said else ''} {said.format(key=key, digest=digest)}" in \
        capsys.readouterr().err
    stored = json.loads(file.read_text())
    assert stored["acceptance"][digest]["rank_accuracies"] and key in stored["machines"]


def test_a_damaged_medusa_calibration_is_measured_again(tmp_path, target, capsys):
    from draftsmith.heads.medusa import MedusaHeads, save_medusa

    path = save_medusa(tmp_path / "medusa", MedusaHeads.from_target(target, num_heads=2), target)
    (path / tree_auto.CALIBRATION_FILE).write_bytes(b"\x80\x81")
    from draftsmith.eval.medusa import MedusaProposer

    proposer = MedusaProposer.from_artifact(path, target)
    tree, record = tree_auto.auto_medusa_tree(path, target, proposer.heads, proposer.tree_info,
                                              calibration_prompts=PROMPTS)
    assert record["measured_now"] and tree
    assert "is damaged (byte 0 is not UTF-8 text)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the calibration's budget


def test_the_calibration_says_how_long_it_takes_and_fits_its_budget(tmp_path, target, heads,
                                                                    monkeypatch, capsys):
    from draftsmith.eval import tree_cost

    path = save_eagle(heads[3]["trained"], tmp_path / "head", target)
    # one decoding step "takes" 0.1 s: 8 prompts x 64 tokens and every timing would not fit
    monkeypatch.setattr(tree_cost, "measure_verify_cost", lambda *a, **k: {1: 0.1})
    chosen = tree_auto.auto_eagle_tree(EagleProposer.from_artifact(path, target), path, target,
                                       calibration_prompts=PROMPTS, budget_seconds=30)
    err = capsys.readouterr().err
    said = err.index("calibrating the tree before the run (about ")
    seconds = float(err[said:].split("(about ")[1].split(" s")[0])
    assert seconds <= 30 and "reduced to fit the 30 s budget" in err
    assert "--tree fixed or --tree-calibration-seconds 0 skips it" in err
    assert said < err.index("no acceptance statistics") < err.index("measuring this machine")
    stored = json.loads((path / tree_auto.CALIBRATION_FILE).read_text())
    (acceptance,) = stored["acceptance"].values()
    assert acceptance["num_prompts"] * acceptance["max_new_tokens"] < 8 * 64
    assert chosen["measured_now"]
    plan = tree_cost.plan_calibration(target, acceptance=True, costs=True, eagle=True,
                                      num_prompts=8, max_new_tokens=64, budget_seconds=None)
    assert not plan.reduced and plan.seconds > 30  # no bound: what was asked
    assert tree_cost.plan_calibration(target, acceptance=True, costs=True, eagle=True,
                                      num_prompts=8, max_new_tokens=64, budget_seconds=1) is None


def test_a_budget_of_zero_skips_the_calibration(tmp_path, target, heads, monkeypatch, capsys):
    path = save_eagle(heads[3]["trained"], tmp_path / "head", target)
    proposer = EagleProposer.from_artifact(path, target)
    fixed = (proposer.depth, proposer.topk, proposer.tree_nodes)
    monkeypatch.setattr(tree_auto, "measure_verify_cost", lambda *a, **k: pytest.fail("measured"))
    assert tree_auto.auto_eagle_tree(proposer, path, target, calibration_prompts=PROMPTS,
                                     budget_seconds=0) is None
    assert (proposer.depth, proposer.topk, proposer.tree_nodes) == fixed
    assert "the calibration budget is 0; using the fixed tree" in capsys.readouterr().err
    assert not (path / tree_auto.CALIBRATION_FILE).exists()
    monkeypatch.undo()
    tree_auto.auto_eagle_tree(EagleProposer.from_artifact(path, target), path, target,
                              calibration_prompts=PROMPTS)  # stored now
    again = tree_auto.auto_eagle_tree(EagleProposer.from_artifact(path, target), path, target,
                                      calibration_prompts=PROMPTS, budget_seconds=0)
    assert again["mode"] == "auto" and not again["measured_now"]  # a stored one is still used


def test_bench_takes_the_calibration_budget():
    import draftsmith.eval.bench as bench

    args = bench.build_parser().parse_args(["--target", "t", "--method", "plain", "--prompts", "p",
                                            "--tree-calibration-seconds", "0"])
    assert args.tree_calibration_seconds == 0


def test_bench_chooses_trees_by_default_and_reports_expected_beside_measured(tmp_path, capsys):
    """draftsmith.eval.bench's default --tree auto on a tiny target with a tokenizer: an EAGLE-1 head and
    Medusa heads saved without held-out accuracies (so both acceptances are measured first)."""
    import test_bench

    import draftsmith.eval.bench as bench
    from draftsmith.heads.eagle import EagleHead
    from draftsmith.heads.eagle_config import EagleConfig
    from draftsmith.heads.medusa import MedusaHeads, save_medusa
    from draftsmith.targets.target import load_target

    model = test_bench.tiny_model()
    model.save_pretrained(str(tmp_path / "target"))
    test_bench.word_tokenizer().save_pretrained(str(tmp_path / "target"))
    tiny = load_target(str(tmp_path / "target"))
    torch.manual_seed(0)
    eagle = save_eagle(EagleHead(EagleConfig.from_target(tiny, 1), tiny), tmp_path / "e", tiny)
    medusa = save_medusa(tmp_path / "m", MedusaHeads.from_target(tiny, num_heads=2), tiny)
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(r) + "\n" for r in test_bench.spec_bench_rows()))
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in test_bench.spec_bench_rows(seed=1)))
    argv = ["--target", str(tmp_path / "target"), "--method", "plain",
            "--method", f"eagle:{eagle}", "--method", f"medusa:{medusa}",
            "--prompts", str(questions), "--max-new-tokens", "12", "--warmup", "0",
            "--no-progress", "--tree-calibration-prompts", str(held_out),
            "--tree-calibration-num-prompts", "3", "--tree-nodes", "6",
            "--out", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html")]
    bench.main(argv)
    err = capsys.readouterr()
    assert "no acceptance statistics for these weights; measuring them on 3 prompts" in err.err
    assert "stores no held-out accuracies; measuring them" in err.err
    assert "trees chosen by --tree auto" in err.out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["tree"] == "auto"
    by_name = {r["method"]: r for r in report["methods"]}
    for name in (f"eagle:{eagle}", f"medusa:{medusa}"):
        record = by_name[name]
        assert record["greedy_identical"] is True
        tree = record["tree"]
        assert tree["mode"] == "auto" and 1 <= tree["tree_nodes"] <= 6  # --tree-nodes caps it
        assert tree["expected_tokens_per_s"] > 0 and tree["expected_tau"] >= 1
        assert tree["measured_now"] and Path(tree["calibration"]).exists()
    assert "tree" not in by_name["plain"]
    page = (tmp_path / "r.html").read_text()
    assert "Trees chosen by <code>--tree auto</code>" in page and f"eagle:{eagle}" in page
    # the second run finds both calibrations and measures nothing
    bench.main(argv)
    err = capsys.readouterr().err
    assert "measuring" not in err
    # the same prompts for calibration and benchmark: said, not silently done
    bench.main([*argv, "--tree-calibration-prompts", str(questions)])
    assert "tuned on the test set" in capsys.readouterr().err
    # --tree fixed keeps the flags as given (a Medusa tree stored without accuracies cannot be
    # rebuilt for --tree-nodes, as before)
    at = argv.index(f"medusa:{medusa}")
    fixed = argv[:at - 1] + argv[at + 1:]
    bench.main([*fixed, "--tree", "fixed"])
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["method"] for r in report["methods"]] == ["hf", "plain", f"eagle:{eagle}"]
    assert all("tree" not in r for r in report["methods"])
