"""The offline EAGLE feature cache: rows read back as the online features, the same loss, files
of bounded size that any number of processes write identically (torchrun, 2 CPU processes), a
kill mid-write that resumes, the refusals that keep a user's directories intact, and the partial
target offline training loads.

The target is a random 4-layer float64 Llama (EAGLE-3 fuses hidden states 1, 2, 3), saved as a
Hugging Face directory for the loaders and the subprocesses.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import draftsmith.train.features as features_module
from draftsmith.heads.eagle import EagleHead, build_draft_vocab, count_tokens
from draftsmith.heads.eagle_config import EagleConfig
from draftsmith.heads.eagle_loss import eagle_loss
from draftsmith.targets.features import target_features as online_features
from draftsmith.targets.resolve import resolve_target
from draftsmith.targets.target import load_target, load_target_parts
from draftsmith.train.features import (
    FeatureCache,
    collate_features,
    row_bytes,
    write_feature_cache,
)
from draftsmith.train.rows import collate_causal_lm

REPO = Path(__file__).resolve().parents[1]
WRITER = REPO / "tests" / "fixtures" / "write_features.py"
VOCAB, DRAFT_VOCAB, HIDDEN = 96, 48, 64
AUX = (1, 2, 3)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_target(path: Path, seed: int = 0, tie: bool = False, scale: float = 30.0) -> Path:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=tie,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float64)
    with torch.no_grad():  # a peaked next-token distribution, like a trained LM's
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(str(path))
    # any fast tokenizer will do: the rows are token ids already
    AutoTokenizer.from_pretrained(str(resolve_target("smollm2-135m"))).save_pretrained(str(path))
    return path


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows of 4..40 random ids: a prompt (mask 0), an answer (mask 1), sometimes a second
    exchange, like tokenised multi-turn conversations."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        mask = []
        for _turn in range(rng.choice((1, 1, 2))):
            mask += [0] * rng.randint(2, 8) + [1] * rng.randint(1, 12)
        rows.append({"input_ids": [rng.randrange(VOCAB) for _ in mask], "loss_mask": mask})
    return rows


Files = namedtuple("Files", "target_dir other_dir tied_dir")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    root = tmp_path_factory.mktemp("features")
    return Files(save_target(root / "target"), save_target(root / "other", seed=1),
                 save_target(root / "tied", tie=True, scale=1.0))


@pytest.fixture(scope="module")
def target(files):
    return load_target(files.target_dir, dtype=torch.float64)


@pytest.fixture(scope="module")
def rows():
    return make_rows(40)


def config_of(target, version: int) -> EagleConfig:
    if version == 1:
        return EagleConfig.from_target(target, 1)
    return EagleConfig.from_target(target, 3, aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB)


def make_head(target, config: EagleConfig, rows, seed: int = 1) -> EagleHead:
    torch.manual_seed(seed)
    if config.version == 1:
        return EagleHead(config, target)
    counts = count_tokens([r["input_ids"] for r in rows], VOCAB, [r["loss_mask"] for r in rows])
    d2t, t2d = build_draft_vocab(counts, DRAFT_VOCAB)
    return EagleHead(config, target, d2t=d2t, t2d=t2d)


def cache_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ------------------------------------------------------------------------------------------------
# What is read back


@pytest.mark.parametrize("version", [1, 3])
def test_rows_read_back_as_the_online_features_and_give_the_same_loss(target, rows, tmp_path,
                                                                      version):
    config = config_of(target, version)
    directory = write_feature_cache(target, rows, tmp_path / "cache", config, batch_size=3,
                                    max_file_bytes=20_000)
    cache = FeatureCache(directory, config, target)
    assert len(cache) == len(rows) and cache.lengths == [len(r["input_ids"]) for r in rows]
    assert len(cache.files) > 2  # the rows spread over several files
    for i, row in enumerate(rows):
        got = cache[i]
        ids = torch.tensor([row["input_ids"]])
        want = online_features(target, ids, torch.ones_like(ids), config)
        assert got["input_ids"].tolist() == row["input_ids"]
        assert got["loss_mask"].tolist() == row["loss_mask"]
        torch.testing.assert_close(got["features"], want["features"][0], rtol=0, atol=1e-12)
        if version == 3:  # the last layer where the loss reads it, zeros elsewhere
            scored = torch.tensor(row["loss_mask"][1:] + [0]).bool()
            torch.testing.assert_close(got["last_hidden"][scored], want["last_hidden"][0][scored],
                                       rtol=0, atol=1e-12)
            assert not got["last_hidden"][~scored].any()
        else:
            assert "last_hidden" not in got

    head = make_head(target, config, rows)
    online = collate_causal_lm(rows[:8], pad_token_id=0)
    online.update(online_features(target, online["input_ids"], online["attention_mask"], config))
    offline = collate_features([cache[i] for i in range(8)], pad_token_id=0)
    assert set(offline) == set(online)
    for key in ("input_ids", "attention_mask", "loss_mask", "labels"):
        assert torch.equal(offline[key], online[key]), key
    loss_on, parts_on = eagle_loss(head, online, feature_noise=0.0, steps=3)
    loss_off, parts_off = eagle_loss(head, offline, feature_noise=0.0, steps=3)
    torch.testing.assert_close(loss_off, loss_on, rtol=1e-10, atol=0)
    for key, value in parts_on.items():
        torch.testing.assert_close(parts_off[key], value, rtol=1e-10, atol=1e-12, msg=key)

    # DataLoader workers (each maps the files itself) prefetch the same rows
    cache[0]
    cache = pickle.loads(pickle.dumps(cache))
    loader = DataLoader(cache, batch_size=5, num_workers=2, collate_fn=lambda b: b)
    loaded = [row for batch in loader for row in batch]
    for i, row in enumerate(loaded):
        for key, value in cache[i].items():
            assert torch.equal(row[key], value), (i, key)


def test_files_are_bounded_valid_safetensors_and_sized_as_planned(target, rows, tmp_path,
                                                                  capsys):
    config = config_of(target, 3)
    bound = 16_000
    directory = write_feature_cache(target, rows, tmp_path / "cache", config,
                                    dtype=torch.bfloat16, max_file_bytes=bound, progress=True)
    index = json.loads((directory / "index.json").read_text())
    assert index["format"] == "draftsmith-feature-cache" and index["dtype"] == "bfloat16"
    scored = [sum(r["loss_mask"][1:]) for r in rows]
    expected = sum(row_bytes(config, torch.bfloat16, len(r["input_ids"]), s)
                   for r, s in zip(rows, scored))
    sizes = [(directory / f["file"]).stat().st_size for f in index["files"]]
    assert index["bytes"] == sum(sizes) and 0 < sum(sizes) - expected < 1024 * len(sizes)
    header = 1024  # a file may pass the bound by its header alone
    assert all(size <= bound + header or f["rows"] == 1
               for size, f in zip(sizes, index["files"]))
    assert f"{index['bytes'] / 1e9:.3f} GB in {len(sizes)} files" in capsys.readouterr().out
    first = index["files"][0]
    with safe_open(str(directory / first["file"]), framework="pt") as handle:  # the real reader
        assert handle.get_tensor("features").shape == (first["tokens"], 3 * HIDDEN)
        assert handle.get_tensor("last_hidden").shape == (first["scored"], HIDDEN)
        assert handle.get_tensor("features").dtype == torch.bfloat16
        assert handle.get_tensor("input_ids").tolist() == [
            t for r in rows[:first["rows"]] for t in r["input_ids"]]


def test_two_writers_write_what_one_writes(target, rows, tmp_path):
    config = config_of(target, 3)
    one = write_feature_cache(target, rows, tmp_path / "one", config, max_file_bytes=12_000)
    for rank in (1, 0):
        write_feature_cache(target, rows, tmp_path / "two", config, max_file_bytes=12_000,
                            process_index=rank, num_processes=2, batch_size=5)
    assert cache_bytes(tmp_path / "two") == cache_bytes(one)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), children first."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def test_torchrun_two_processes_killed_mid_write_resume_to_the_one_process_cache(files,
                                                                                 tmp_path):
    rows = make_rows(120, seed=3)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", str(WRITER), "--target", str(files.target_dir), "--rows",
               str(tmp_path / "rows.json"), "--cache", str(cache), "--max-file-bytes", "1",
               "--aux", *map(str, AUX)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # a file per row; killed (every process at once) when a few are complete
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if cache.is_dir() and len(list(cache.glob("features-*.safetensors"))) >= 4:
            break
        time.sleep(0.01)
    assert process.poll() is None, process.stderr.read().decode()[-3000:]  # still writing
    # every process at once: the launcher and its workers, which torchrun may start in process
    # groups of their own (a killpg of the launcher's group alone leaves them writing)
    for pid in [process.pid, *descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()
    time.sleep(0.5)  # the workers' exits
    done = len(list(cache.glob("features-*.safetensors")))
    assert 4 <= done < 120, process.stderr.read().decode()[-2000:]
    target = load_target(files.target_dir, dtype=torch.float64)
    config = config_of(target, 3)
    with pytest.raises(FileNotFoundError, match="incomplete"):
        FeatureCache(cache, config)
    before = {p.name: p.stat().st_mtime_ns for p in cache.glob("features-*.safetensors")}

    finished = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("features-*.safetensors")
            if p.name in before} == before  # complete files were kept, not rewritten
    reference = write_feature_cache(target, rows, tmp_path / "reference", config,
                                    dtype=torch.float32, max_file_bytes=1, batch_size=4)
    assert cache_bytes(cache) == cache_bytes(reference)  # no temporary file left either
    assert len(FeatureCache(cache, config, target)) == 120


# ------------------------------------------------------------------------------------------------
# Refusals: nothing of the user's is lost or overwritten


def test_another_target_layer_set_data_or_dtype_is_refused_and_nothing_changes(files, target,
                                                                               rows, tmp_path):
    config = config_of(target, 3)
    directory = write_feature_cache(target, rows, tmp_path / "cache", config, max_file_bytes=8000)
    before = cache_bytes(directory)
    stamps = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    assert write_feature_cache(target, rows, directory, config, max_file_bytes=8000) == directory
    other_target = load_target(files.other_dir, dtype=torch.float64)  # same shapes, other weights
    attempts = {
        "weights_fingerprint": (other_target, rows, config, {}),
        # a 4-layer target has one EAGLE-3 layer set (1, 2, 3): another set is EAGLE-1's (4,)
        "aux_layer_ids": (target, rows, EagleConfig.from_target(target, 1), {}),
        "dataset": (target, rows[:-1] + [rows[0]], config, {}),
        "dtype": (target, rows, config, {"dtype": torch.float32}),
        "max_file_bytes": (target, rows, config, {"max_file_bytes": 9000}),
    }
    for what, (t, r, c, kwargs) in attempts.items():
        kwargs = {"max_file_bytes": 8000, **kwargs}
        with pytest.raises(ValueError, match=f"written for something else.*{what}"):
            write_feature_cache(t, r, directory, c, **kwargs)
    assert cache_bytes(directory) == before
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == stamps

    with pytest.raises(ValueError, match="same shapes and other weights"):
        FeatureCache(directory, config, other_target)
    with pytest.raises(ValueError, match="does not fit this head"):
        FeatureCache(directory, EagleConfig.from_target(target, 1))
    victim = directory / json.loads((directory / "index.json").read_text())["files"][1]["file"]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        FeatureCache(directory, config)
    write_feature_cache(target, rows, directory, config, max_file_bytes=8000)  # resumes
    assert cache_bytes(directory) == before


def test_a_directory_the_cache_did_not_create_is_never_touched(target, rows, tmp_path):
    """A foreign index.json (issue: it used to be wiped), other files, an older cache, and index
    paths that lead outside the cache directory."""
    config = config_of(target, 1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "index.json").write_text(json.dumps({"shards": [{"file": "a.safetensors"}]}))
    (foreign / "a.safetensors").write_bytes(b"the user's")
    older = tmp_path / "older"  # what version 1 of this cache wrote
    older.mkdir()
    (older / "index.json").write_text(json.dumps({"cache_version": 1, "shards": []}))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("keep me")
    for directory, message in ((foreign, "did not write"), (older, "did not write"),
                               (notes, "not empty and not a feature cache")):
        before = cache_bytes(directory)
        with pytest.raises(ValueError, match=message):
            write_feature_cache(target, rows, directory, config)
        assert cache_bytes(directory) == before

    outside = tmp_path / "outside"
    outside.mkdir()
    directory = write_feature_cache(target, rows, tmp_path / "cache", config)
    index = json.loads((directory / "index.json").read_text())
    (outside / "x.safetensors").write_bytes((directory / index["files"][0]["file"]).read_bytes())
    for name in ("../outside/x.safetensors", str(outside / "x.safetensors"), "index.json"):
        index["files"][0]["file"] = name
        (directory / "index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match="outside the pattern"):
            FeatureCache(directory, config)
        with pytest.raises(ValueError, match="outside the pattern"):
            write_feature_cache(target, rows, directory, config)
    with pytest.raises(FileNotFoundError, match="not a feature cache"):
        FeatureCache(tmp_path / "nowhere", config)


def test_the_disk_is_checked_before_anything_is_written(target, rows, tmp_path, monkeypatch):
    config = config_of(target, 3)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(features_module.shutil, "disk_usage", lambda _: usage(10**6, 0, 1000))
    with pytest.raises(ValueError, match="GB more but the disk has 0.000 GB free; nothing was"):
        write_feature_cache(target, rows, tmp_path / "cache", config)
    assert not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------------------------
# Offline training loads only what the loss reads


@pytest.mark.parametrize("tied", [False, True])
def test_offline_training_needs_only_the_embedding_norm_and_lm_head(files, rows, tmp_path, tied):
    path = files.tied_dir if tied else files.target_dir
    full = load_target(path, dtype=torch.float64)
    parts = load_target_parts(path, dtype=torch.float64)
    assert parts.identity() == full.identity()
    assert {p.device.type for p in parts.layers.parameters()} == {"meta"}
    loaded = sum(p.numel() for p in parts.model.parameters() if p.device.type != "meta")
    assert loaded == (1 if tied else 2) * VOCAB * HIDDEN + HIDDEN  # embedding (+ head), norm
    assert (parts.lm_head.weight is parts.embed.weight) == tied
    config = config_of(full, 3)
    directory = write_feature_cache(full, rows, tmp_path / "cache", config)
    cache = FeatureCache(directory, config, parts)  # the partial target passes the checks
    batch = collate_features([cache[i] for i in range(6)], pad_token_id=0)
    losses = [eagle_loss(make_head(t, config, rows), batch, feature_noise=0.0, steps=2)[0]
              for t in (full, parts)]
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        parts.features(batch["input_ids"], [1])  # no decoder layers to run
