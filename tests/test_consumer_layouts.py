"""Every exported tensor and config key against the pinned consumers' own loading rules.

The rules live in tests/fixtures/consumers/*.json, written from each consumer's source at a named
version (vLLM 0.33.0 and 0.32.0, SGLang 0.5.23, speculators 0.9.0, TensorRT-LLM's Medusa
converter, FasterDecoding/Medusa): which names its ``load_weights`` can place, with which shapes
and dtypes, which are required, which config keys it reads and what they must hold. Shapes are
computed from the artifact's own config, not from the export. These engines need GPU builds that
this machine cannot install; speculators is also run for real in the slow tests/test_consumers.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_export import VOCAB, make_target

from draftsmith.files.output_dir import MARKER
from draftsmith.heads.eagle import EagleHead, build_draft_vocab, save_eagle
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.medusa import MedusaConfig, MedusaHeads, save_medusa
from draftsmith.layouts.export import export
from draftsmith.layouts.medusa import trtllm_convert_command

FIXTURES = Path(__file__).parent / "fixtures" / "consumers"
RULES = {path.stem: json.loads(path.read_text()) for path in sorted(FIXTURES.glob("*.json"))}
LAYOUTS = [(name, layout) for name, rules in RULES.items() for layout in rules.get("layouts", {})]


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def sources(tmp_path_factory, target):
    """method variant -> (variables for the rules, artifact dir)."""
    root = tmp_path_factory.mktemp("sources")
    out = {}
    d2t, t2d = build_draft_vocab(torch.arange(VOCAB).flip(0) % 5, 24)
    eagle = {
        "eagle1": EagleConfig.from_target(target, 1),
        "eagle3-reduced": EagleConfig.from_target(target, 3, aux_layer_ids=(1, 2, 3),
                                                  draft_vocab_size=24),
        "eagle3-full": EagleConfig.from_target(target, 3, aux_layer_ids=(1, 2, 3)),
    }
    for name, cfg in eagle.items():
        maps = {"d2t": d2t, "t2d": t2d} if name == "eagle3-reduced" else {}
        head = EagleHead(cfg, target, **maps)
        out[name] = (eagle_vars(cfg), save_eagle(head, root / name, target))
    for k, n, share, bias in ((3, 1, False, True), (2, 2, False, True), (3, 1, True, True),
                              (3, 1, False, False)):
        name = f"medusa-{k}-{n}-{share}-{bias}"
        heads = MedusaHeads.from_target(target, num_heads=k, num_layers=n, share_lm_head=share,
                                        bias=bias)
        out[name] = (medusa_vars(heads.config), save_medusa(root / name, heads, target))
    for share in (False, True):  # over a draft vocabulary: vllm-0.32 only (token_map)
        name = f"medusa-draft-{share}"
        heads = MedusaHeads.from_target(target, num_heads=3, share_lm_head=share, d2t=d2t, t2d=t2d)
        out[name] = (medusa_vars(heads.config), save_medusa(root / name, heads, target))
    return out


def eagle_vars(cfg: EagleConfig) -> dict:
    return {
        "hidden": cfg.hidden_size, "target_hidden": cfg.target_hidden_size,
        "vocab": cfg.vocab_size, "draft_vocab": cfg.draft_vocab_size,
        "num_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "inter": cfg.intermediate_size,
        "aux": list(cfg.aux_layer_ids), "aux_minus_one": [i - 1 for i in cfg.aux_layer_ids],
        "reduced_vocab": cfg.draft_vocab_size < cfg.vocab_size,
        "full_vocab": cfg.draft_vocab_size == cfg.vocab_size,
    }


def medusa_vars(cfg: MedusaConfig) -> dict:
    return {
        "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "K": cfg.num_heads,
        "n": cfg.num_layers, "bias": cfg.bias, "shared_lm_head": cfg.share_lm_head,
        "own_lm_head": not cfg.share_lm_head, "draft_vocab": cfg.head_vocab_size,
        "reduced_vocab": cfg.draft_vocab_size is not None,
    }


def value(expr, env: dict):
    """An int, a variable, or a product of them ("3*target_hidden")."""
    if isinstance(expr, str) and "*" in expr:
        result = 1
        for factor in expr.split("*"):
            result *= value(factor.strip(), env)
        return result
    if isinstance(expr, str) and expr in env:
        return env[expr]
    return int(expr) if isinstance(expr, str) and expr.isdigit() else expr


def lookup(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(dotted)
    return node


def check_layout(rules: dict, out: Path, env: dict) -> None:
    """Assert an export directory satisfies one layout's rules."""
    assert {p.name for p in out.iterdir()} - {MARKER} == set(rules["files"])
    config = json.loads((out / "config.json").read_text())
    for key, spec in rules["config"].items():
        try:
            got = lookup(config, key)
        except KeyError:
            pytest.fail(f"config.json lacks {key!r}, which the consumer reads")
        if "equals" in spec:
            assert got == value(spec["equals"], env), key
        kind = spec.get("type")
        if kind == "int":
            assert isinstance(got, int) and not isinstance(got, bool), key
        elif kind == "number":
            assert isinstance(got, (int, float)), key
        elif kind == "dict":
            assert isinstance(got, dict), key
        elif kind == "hub_id":
            from huggingface_hub.utils import validate_repo_id

            validate_repo_id(got)
            assert "/" in got and not Path(got).exists(), key
    for key in rules.get("config_absent", []):
        assert key not in config, f"{key} would change how the consumer builds the draft"
    key_rule = rules.get("config_key_rule")
    if key_rule:
        hits = [k for k in config if re.search(key_rule["pattern"], k)]
        assert bool(hits) == key_rule["must_match"], hits

    path = out / rules["weights_file"]
    if path.suffix == ".pt":  # our own file, read as plain tensors (no code is unpickled)
        weights = torch.load(path, weights_only=True)
    else:
        weights = load_file(str(path))
    active = [r for r in rules["weights"] if env.get(r.get("when", ""), True)]
    inactive = [r for r in rules["weights"] if r not in active]
    patterns = [(re.compile(r["pattern"].replace("N", str(env.get("n", "N")))), r)
                for r in active]
    matched = {id(r): 0 for r in active}
    for name, tensor in weights.items():
        hits = [r for p, r in patterns if p.fullmatch(name)]
        if not hits:
            dead = [r["pattern"] for r in inactive if re.fullmatch(r["pattern"], name)]
            pytest.fail(f"{name}: the consumer has no place for it"
                        + (f" in this configuration ({dead})" if dead else ""))
        rule = hits[0]
        matched[id(rule)] += 1
        shape = tuple(value(d, env) for d in rule["shape"])
        assert tuple(tensor.shape) == shape, (name, tuple(tensor.shape), shape)
        if rule["dtype"] == "float":
            assert tensor.is_floating_point(), name
        else:
            assert tensor.dtype == getattr(torch, rule["dtype"]), name
    for rule in active:
        count = matched[id(rule)]
        if "count" in rule:
            want = value(rule["count"], env)
            assert count in ((0, want) if rule.get("required") is False else (want,)), (
                rule["pattern"], count, want)
        elif rule.get("required", True):
            assert count >= 1, f"{rule['pattern']} is required by the consumer and missing"


CASES = {
    "eagle3": ["eagle3-reduced", "eagle3-full"],
    "eagle1": ["eagle1"],
    "medusa": ["medusa-3-1-False-True", "medusa-2-2-False-True", "medusa-3-1-True-True",
               "medusa-3-1-False-False", "medusa-draft-False", "medusa-draft-True"],
}


@pytest.mark.parametrize("fixture,layout", LAYOUTS)
def test_export_follows_the_consumers_loader(tmp_path, target, sources, fixture, layout):
    rules = RULES[fixture]["layouts"][layout]
    fmt, method = layout.split("/")
    checked = 0
    for variant in CASES[method]:
        env, artifact = sources[variant]
        kwargs = {"target": target}  # heads sharing the target's LM head need it
        if fmt == "speculators":
            kwargs["verifier"] = "org/tiny"
        if method == "medusa" and env["reduced_vocab"] and fmt != "vllm-0.32":
            continue  # refused: no token map in that layout (tests/test_medusa.py)
        if fmt == "fasterdecoding":
            if env["n"] > 1:
                continue  # refused: FasterDecoding shares one block object (tests/test_export.py)
            kwargs.update(base_model="org/tiny", write_pt=True)
        out = export(artifact, fmt, tmp_path / variant, **kwargs)
        check_layout(rules, out, env)
        checked += 1
    assert checked


@pytest.mark.parametrize("fixture", [n for n, r in RULES.items() if r.get("refused")])
def test_formats_the_consumer_cannot_load_are_refused(tmp_path, target, sources, fixture):
    for layout in RULES[fixture]["refused"]:
        method, fmt = layout.split("/")
        variant = CASES[method][0]
        with pytest.raises(ValueError, match="instead|--format"):
            export(sources[variant][1], fmt, tmp_path / variant, verifier="org/tiny",
                   target=target)


def test_trtllm_command_passes_what_the_converter_does_not_read(tmp_path, sources):
    _, artifact = sources["medusa-2-2-False-True"]
    out = export(artifact, "trtllm", tmp_path / "t")
    command = trtllm_convert_command(out)
    for flag in RULES["tensorrt-llm-medusa"]["command_flags"]:
        assert f"{flag} " in command, flag
    assert "--num_medusa_heads 2" in command and "--num_medusa_layers 2" in command


def test_every_fixture_names_its_consumer_version():
    assert set(RULES) == {"vllm-0.33.0", "vllm-0.32.0-medusa", "sglang-0.5.23",
                          "speculators-0.9.0", "tensorrt-llm-medusa", "fasterdecoding-medusa"}
    for rules in RULES.values():
        assert rules["version"] and rules["commit"] and rules["read_from"]
