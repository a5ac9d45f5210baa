"""The house: one-way floors with no import circle, files of a readable size, one table per floor
with a row for every method, and a toy method that enters through those four rows alone."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.eval.methods import BENCH_METHODS
from draftsmith.heads.methods import HEAD_METHODS
from draftsmith.layouts.table import LAYOUTS
from draftsmith.train.recipes import TRAINERS

REPO = Path(__file__).resolve().parents[1]


def _fixture(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "fixtures" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


toy_method = _fixture("toy_method")
byte_tokenizer = _fixture("toy_train").byte_tokenizer
# lowest first: a module imports from its own floor or the ones below, never above
FLOORS = ("files", "targets", "heads", "layouts", "eval", "train", "draftsmith")
MAX_LINES = 700


def project_modules() -> dict[str, Path]:
    modules = {}
    for floor in FLOORS:
        package = "draftsmith" if floor == "draftsmith" else f"draftsmith.{floor}"
        for path in sorted((REPO / floor).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def floor_of(module: str) -> int:
    """A module's floor, lowest 0: ``draftsmith.heads.eagle`` -> heads; ``draftsmith.cli`` ->
    the top."""
    parts = module.split(".")
    return FLOORS.index(parts[1] if len(parts) > 1 and parts[1] in FLOORS[:-1] else "draftsmith")


def _is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":`` -- code that runs only when the module is the program."""
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__"
                    for c in test.comparators))


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, wherever the import stands: at the top, inside
    functions, and under its ``__main__`` guard (the program ``python -m`` starts is part of
    the house too: a guard that imports from above is an upward arrow)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_anywhere():
    assert cycles(graph()) == []


def test_the_reader_finds_a_circle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_point_down_the_floors_only():
    upward = []
    for module, imported in graph().items():
        mine = floor_of(module)
        upward += [f"{module} -> {other}" for other in imported if floor_of(other) > mine]
    assert upward == []


def test_the_reader_counts_guarded_and_function_level_imports(tmp_path):
    """An import under ``if __name__ == "__main__":`` or inside a function is an arrow."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from draftsmith.train.loop import run_training\n\n"
                      "if __name__ == '__main__':\n    import draftsmith.eval.bench\n")
    assert imports_of(source, {"draftsmith.train.loop": source, "draftsmith.eval.bench": source}) == \
        {"draftsmith.train.loop", "draftsmith.eval.bench"}


def test_train_data_is_only_the_commands_name():
    """python -m draftsmith.train.data stays for users: train/data.py holds a docstring and the guard that
    runs the command (train/regenerate.py); nothing imports it."""
    tree = ast.parse((REPO / "train" / "data.py").read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr)
                                         and isinstance(n.value, ast.Constant))]
    assert len(body) == 1 and _is_main_guard(body[0])
    assert not any("draftsmith.train.data" in imported for imported in
                   set().union(*graph().values()))


def test_no_source_file_over_700_lines():
    long = {str(p.relative_to(REPO)): n for p in [*project_modules().values(),
                                                  *(REPO / "scripts").glob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_floor_has_a_row_for_every_method():
    columns = set(HEAD_METHODS)
    assert columns >= {"eagle", "medusa", "draft"}
    assert set(LAYOUTS) == columns
    assert {row.column for row in BENCH_METHODS.values() if row.column} == columns
    assert {row.column for row in TRAINERS.values()} == columns
    # each artifact method a head row owns has formats on the layouts floor
    for name, row in HEAD_METHODS.items():
        assert set(row.artifact_methods) == set(LAYOUTS[name].formats), name
    # a draft llama.cpp serves says how it drafts a chain there, for the acceptance cross-check
    for spec, row in BENCH_METHODS.items():
        if row.column and row.serve:
            assert row.chain is not None and row.chain(3), spec


# ------------------------------------------------------------------------------------------------
# a new method: new files plus one row per floor


@pytest.fixture
def skip_rows(monkeypatch):
    monkeypatch.setitem(HEAD_METHODS, toy_method.METHOD, toy_method.HEAD_ROW)
    monkeypatch.setitem(LAYOUTS, toy_method.METHOD, toy_method.LAYOUT_ROW)
    monkeypatch.setitem(BENCH_METHODS, toy_method.METHOD, toy_method.BENCH_ROW)
    monkeypatch.setitem(TRAINERS, toy_method.METHOD, toy_method.TRAIN_ROW)


@pytest.fixture
def skip_files(tmp_path, trainer_env):
    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, initializer_range=0.2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    rows = [{"messages": [{"role": "user", "content": f"count from {i}"},
                          {"role": "assistant", "content": " ".join(str(i + k) for k in range(8))}]}
            for i in range(12)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"count from {i}"]}) + "\n"
                               for i in range(2)))
    config_file = toy_method.write_config(
        tmp_path / "skip.yaml", target=str(tmp_path / "target"), data=[str(data)],
        output_dir=str(tmp_path / "run"), max_length=64, per_device_batch_size=4, max_steps=3,
        learning_rate=1e-2, eval_every=0, save_every=0, log_every=1, report_to="none",
        mixed_precision="no", head_init=0.02)
    return {"target": tmp_path / "target", "prompts": prompts, "config": config_file,
            "run": tmp_path / "run"}


def test_a_new_method_needs_only_a_row_in_each_floors_table(skip_rows, skip_files, tmp_path,
                                                            capsys):
    from draftsmith.eval import bench
    from draftsmith.layouts import export
    from draftsmith.train import memory, speed
    from draftsmith.train.config import parse_config

    config = str(skip_files["config"])
    # train: the memory estimate and the speed tool find the trainer in the table
    est = memory.main(["--config", config, "--trainer", "skip", "--device", "cpu"])
    assert "trained head (AdamW)" in est.parts and est.total > 0
    timed = speed.main(["--config", config, "--trainer", "skip", "--steps", "1", "--warmup", "0"])
    assert timed["trainer"] == "skip" and timed["train_tokens_per_s"] > 0
    trained = TRAINERS["skip"].main(parse_config(toy_method.SkipTrainConfig, ["--config", config]))
    artifact = trained["artifact"]
    assert trained["step"] == 3 and (artifact / "model.safetensors").is_file()

    # layouts: draftsmith export dispatches to the row's writer and check
    out = tmp_path / "export"
    assert export.main([str(artifact), "--format", "skip-safetensors", "--out", str(out),
                        "--check"]) == 0
    assert "verified: round trip" in capsys.readouterr().out.replace("    ", "")
    assert export.main([str(artifact), "--format", "vllm", "--out", str(tmp_path / "x")]) == 2
    assert "skip artifact exports to skip-safetensors" in capsys.readouterr().err

    # eval: the benchmark builds skip:<artifact> from the row and verifies it exactly
    records = bench.main(["--target", str(skip_files["target"]), "--method", "plain",
                          "--method", f"skip:{artifact}", "--prompts", str(skip_files["prompts"]),
                          "--max-new-tokens", "12", "--warmup", "0", "--no-progress"])
    by_name = {r["method"]: r for r in records}
    assert by_name[f"skip:{artifact}"]["greedy_identical"] is True
    assert by_name[f"skip:{artifact}"]["target_passes"] <= by_name["plain"]["target_passes"]


def test_every_cpu_results_stage_named_anywhere_has_a_case():
    """The stages scripts/cpu_results.sh names in its usage line, and the ones the README and the
    docs quote (`cpu_results.sh <stage>`), each have a case of their own: a report must keep the
    command that made it."""
    repo = Path(__file__).resolve().parents[1]
    script = (repo / "scripts" / "cpu_results.sh").read_text()
    cases = set(re.findall(r"^([a-z0-9][a-z0-9-]*)\)", script, re.M))
    usage = re.search(r'echo "usage: \$0 ([^"]+)"', script).group(1)
    named = {("usage", stage) for stage in usage.split("|")}
    for page in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        for stage in re.findall(r"cpu_results\.sh\s+`?([a-z0-9][a-z0-9-]*)", page.read_text()):
            named.add((page.name, stage))
    missing = sorted((where, stage) for where, stage in named if stage not in cases)
    assert not missing, f"stages named without a case in scripts/cpu_results.sh: {missing}"
    assert set(usage.split("|")) == cases, "the usage line and the cases differ"
