"""draftsmith.files.output_dir: atomic, marked, readable by others, never replacing or deleting what it must
not (write_dir; stage_dir + commit_dir for several writers; remove_dir; check_writable_dir)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from draftsmith.files.output_dir import (
    MARKER,
    check_destination,
    check_writable_dir,
    commit_dir,
    read_marker,
    remove_dir,
    stage_dir,
    write_dir,
)


def fill_with(text: str):
    def fill(tmp):
        (tmp / "a.txt").write_text(text)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text(text)
    return fill


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_new_directory_is_marked_and_readable_by_others(tmp_path):
    out = write_dir(tmp_path / "deep" / "out", fill_with("one"), kind="export",
                    marker={"format": "vllm"})
    assert (out / "a.txt").read_text() == "one"
    assert read_marker(out) == {"written_by": "draftsmith", "kind": "export", "format": "vllm"}
    assert mode(out) == 0o755 and mode(out / "sub") == 0o755
    assert mode(out / "a.txt") == 0o644 and mode(out / "sub" / "b.txt") == 0o644
    assert mode(out / MARKER) == 0o644
    assert [p.name for p in out.parent.iterdir()] == ["out"]  # no staging left behind


def test_replaces_only_its_own_kind_or_with_overwrite(tmp_path):
    out = tmp_path / "out"
    write_dir(out, fill_with("one"), kind="export")
    write_dir(out, fill_with("two"), kind="export")  # an earlier export: replaced
    assert (out / "a.txt").read_text() == "two"
    with pytest.raises(ValueError, match="holds a draftsmith 'export', not an earlier artifact"):
        write_dir(out, fill_with("three"), kind="artifact")
    assert (out / "a.txt").read_text() == "two"
    write_dir(out, fill_with("three"), kind="artifact", overwrite=True)
    assert read_marker(out)["kind"] == "artifact"

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")  # looks like a model directory: not ours
    with pytest.raises(ValueError, match=r"did not write \(config.json\).*--overwrite"):
        write_dir(mine, fill_with("x"), kind="export")
    assert (mine / "config.json").read_text() == "{}"
    (mine / MARKER).write_text("not json")  # a garbled marker is no marker
    with pytest.raises(ValueError, match="did not write"):
        write_dir(mine, fill_with("x"), kind="export")

    empty = tmp_path / "empty"
    empty.mkdir()
    write_dir(empty, fill_with("x"), kind="export")  # an empty directory is fine
    assert (empty / "a.txt").is_file()


def test_source_is_never_replaced_even_with_overwrite(tmp_path):
    source = tmp_path / "runs" / "artifact"
    write_dir(source, fill_with("weights"), kind="artifact")
    for dest in (source, tmp_path / "runs", tmp_path):
        with pytest.raises(ValueError, match="source of this operation.*not even with --overwrite"):
            write_dir(dest, fill_with("x"), kind="artifact", overwrite=True, protect=[source])
    assert (source / "a.txt").read_text() == "weights"
    # a new directory inside the source is allowed (nothing of it is replaced)
    write_dir(source / "vllm", fill_with("x"), kind="export", protect=[source])
    assert (source / "a.txt").read_text() == "weights"


def test_a_failing_fill_keeps_the_previous_directory(tmp_path):
    out = tmp_path / "out"
    write_dir(out, fill_with("old"), kind="export")

    def broken(tmp):
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_dir(out, broken, kind="export")
    assert (out / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_bad_destinations(tmp_path):
    target = tmp_path / "file.txt"
    target.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        check_destination(target, kind="export")
    real = tmp_path / "real"
    write_dir(real, fill_with("x"), kind="export")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="symbolic link"):
        check_destination(link, kind="export")
    assert json.loads((real / MARKER).read_text())["written_by"] == "draftsmith"


def test_remove_dir_deletes_only_its_own_kind_or_an_empty_directory(tmp_path):
    marked = write_dir(tmp_path / "ckpt", fill_with("x"), kind="checkpoint")
    with pytest.raises(ValueError, match=r"not a export directory draftsmith wrote"):
        remove_dir(marked, kind="export")
    remove_dir(marked, kind="checkpoint")
    assert not marked.exists()
    (tmp_path / "empty").mkdir()
    remove_dir(tmp_path / "empty", kind="checkpoint")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (tmp_path / "link").symlink_to(mine)
    (tmp_path / "file").write_text("keep")
    for path in (mine, tmp_path / "link", tmp_path / "file"):
        with pytest.raises(ValueError, match="left as it is|not a directory draftsmith wrote"):
            remove_dir(path, kind="checkpoint")
    assert (mine / "notes.txt").read_text() == "keep" and (tmp_path / "file").is_file()


def test_staging_under_a_fixed_name_for_several_writers(tmp_path):
    dest = tmp_path / "step_3"
    tmp = stage_dir(dest, kind="checkpoint", name=".step_3.tmp-save", marker={"step": 3})
    assert read_marker(tmp) == {"written_by": "draftsmith", "kind": "checkpoint", "step": 3}
    (tmp / "half").write_text("left by a killed writer")
    again = stage_dir(dest, kind="checkpoint", name=".step_3.tmp-save")  # a marked leftover: reused
    assert again == tmp and not (tmp / "half").exists()
    (again / "part0").write_text("a")  # every writer adds its part
    (again / "part1").write_text("b")
    assert commit_dir(again, dest, kind="checkpoint") == dest
    assert sorted(p.name for p in dest.iterdir()) == [MARKER, "part0", "part1"]
    assert mode(dest / "part0") == 0o644 and sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]
    foreign = tmp_path / ".step_4.tmp-save"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="left as it is"):
        stage_dir(tmp_path / "step_4", kind="checkpoint", name=".step_4.tmp-save")
    assert (foreign / "notes.txt").read_text() == "keep"


def test_output_paths_are_checked_without_writing(tmp_path, monkeypatch):
    deep = tmp_path / "a" / "b" / "c"
    assert check_writable_dir(deep) == deep and not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"output directory .*file/run cannot be created: .*file "
                                         r"is a file"):
        check_writable_dir(tmp_path / "file" / "run")
    # a directory without write permission (os.access says so; root ignores the mode bits)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(ValueError, match=r"output_dir .*/new cannot be created in .* \(no write "
                                         r"permission, or a read-only file system\)"):
        check_writable_dir(tmp_path / "new", what="output_dir")
    with pytest.raises(ValueError, match=r"is not writable"):
        check_writable_dir(tmp_path, what="output_dir")


def test_cast_artifact_halves_the_weights_and_keeps_integer_maps(tmp_path):
    import torch

    from draftsmith.heads.artifact import cast_artifact, load_artifact, main, save_artifact

    weights = {"fc.weight": torch.randn(8, 4), "d2t": torch.arange(5, dtype=torch.int64)}
    source = save_artifact(tmp_path / "fp32", "eagle3", {"hidden_size": 4}, weights,
                           {"name": "tiny"}, extra_files={"README.md": "how it was trained"})
    out = cast_artifact(source, tmp_path / "bf16", torch.bfloat16)
    config, tensors = load_artifact(out, "eagle3")
    assert config["hidden_size"] == 4 and config["target"] == {"name": "tiny"}
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["fc.weight"], weights["fc.weight"].to(torch.bfloat16))
    assert torch.equal(tensors["d2t"], weights["d2t"])  # int64 unchanged
    assert (out / "README.md").read_text() == "how it was trained"
    assert (out / "model.safetensors").stat().st_size < (source / "model.safetensors").stat().st_size
    assert main(["cast", str(source), str(source), "--dtype", "bf16"]) == 2  # never in place
    assert load_artifact(source)[1]["fc.weight"].dtype == torch.float32


def test_leftovers_of_a_killed_writer_go_and_a_running_ones_stay(tmp_path):
    import subprocess
    import sys

    from draftsmith.files.output_dir import _host, remove_leftovers

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    dest = tmp_path / "export"
    write_dir(dest, fill_with("old"), kind="export")

    def leftover(name: str, pid: int, kind: str = "export") -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / MARKER).write_text(json.dumps({"written_by": "draftsmith", "kind": kind,
                                               "staged_by": {"host": _host(), "pid": pid}}))
        return path

    stale = leftover(f".export.tmp-{_host()}-{dead_pid}-a", dead_pid)
    running = leftover(f".export.tmp-{_host()}-{os.getpid()}-b", os.getpid())
    other_kind = leftover(f".export.tmp-{_host()}-{dead_pid}-c", dead_pid, kind="artifact")
    empty = tmp_path / f".export.tmp-{_host()}-{dead_pid}-d"
    empty.mkdir()
    assert sorted(remove_leftovers(dest, kind="export")) == sorted([stale, empty])
    assert running.exists() and other_kind.exists()
    # killed between moving the previous directory aside and renaming the new one in: put back
    holder = leftover(f".export.old-{_host()}-{dead_pid}-e", dead_pid)
    os.replace(dest, holder / "export")
    assert remove_leftovers(dest, kind="export") == [holder]
    assert (dest / "a.txt").read_text() == "old" and not holder.exists()
