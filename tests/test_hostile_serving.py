"""A hostile user against the serving side (GGUF exports, the llama.cpp benchmark): no file of
theirs replaced, no process or temporary file left behind by a signal, one line for a mistake.

The tests that run llama.cpp's converter or a llama-server need llama.cpp (``make llama-cpp``):
skipped without it, failed without it under ``DRAFTSMITH_REQUIRE_LLAMA_CPP=1`` (as in
tests/test_llama_cpp.py). The others run anywhere, fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest

import draftsmith.eval.bench as bench
from draftsmith.layouts.export import main as export_main
from draftsmith.layouts.gguf import remove_stale_scratch, written_by_draftsmith
from draftsmith.layouts.llama_cpp import (
    BUILD_COMMAND,
    WRITER,
    WRITER_KEY,
    LlamaServer,
    converter,
    find_llama_server,
    host_name,
    remove_stale_conversions,
)
from draftsmith.layouts.processes import Stopped, signals_held, stop_on_signals

REPO = Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": path,
            **extra}


def _missing(err) -> None:
    if os.environ.get("DRAFTSMITH_REQUIRE_LLAMA_CPP") == "1":
        pytest.fail(f"llama.cpp is required here (DRAFTSMITH_REQUIRE_LLAMA_CPP=1): {err}")
    pytest.skip(f"no llama.cpp ({err}); build it with `{BUILD_COMMAND}`")


@pytest.fixture(scope="module")
def llama_server():
    try:
        return find_llama_server(("ngram-simple",))
    except (FileNotFoundError, ValueError) as err:
        _missing(err)


@pytest.fixture(scope="module")
def the_converter():
    try:
        converter()
    except FileNotFoundError as err:
        _missing(err)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = text[text.rindex(")") + 2:].split()[:2]
    return state, int(ppid)


def _alive(pid: int) -> bool:
    found = _stat(pid)
    return found is not None and found[0] != "Z"


def _children(pid: int, name: str) -> list[int]:
    """The running children of ``pid`` whose command line mentions ``name``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is None or stat[1] != pid or stat[0] == "Z":
            continue
        with contextlib.suppress(OSError):
            if name in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
    return found


def _wait_for(condition, what: str, process: subprocess.Popen, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the command ended before {what}: {err[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no {what} within {timeout:.0f} s")


def _dead_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert not _alive(done.pid)
    return done.pid


def _gguf(path: Path, *, ours: bool) -> Path:
    """A small valid GGUF file (gguf-py's own writer), with or without draftsmith's key."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "someone's model")
    if ours:
        writer.add_string(WRITER_KEY, WRITER)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_uint32("llama.context_length", 128)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bogus_draft(path: Path) -> Path:
    """A directory that names itself a distilled draft (never converted: refused before)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                  "draftsmith": {"target": {"name": "t"}}}))
    return path


# ------------------------------------------------------------------------------------------------
# data lost


def test_only_a_gguf_draftsmith_wrote_is_replaced_and_never_an_input(tmp_path, capsys):
    foreign = _gguf(tmp_path / "foreign.gguf", ours=False)
    ours = _gguf(tmp_path / "ours.gguf", ours=True)
    (tmp_path / "magic.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    (tmp_path / "notes.gguf").write_text("my notes")
    assert written_by_draftsmith(ours)
    for other in (foreign, tmp_path / "magic.gguf", tmp_path / "notes.gguf", tmp_path / "none"):
        assert not written_by_draftsmith(other)
    draft = _bogus_draft(tmp_path / "draft")
    before = {p: p.read_bytes() for p in tmp_path.glob("*.gguf")}
    # a GGUF file someone else wrote (it starts with the magic, as every GGUF does): refused
    for out in (foreign, tmp_path / "magic.gguf"):
        assert export_main([str(draft), "--format", "gguf", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "not an earlier GGUF file draftsmith wrote" in err and "--overwrite" in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # the --target it reads, even a GGUF draftsmith wrote, even with --overwrite
    for extra in ([], ["--overwrite"]):
        assert export_main([str(draft), "--format", "gguf", "--target", str(ours), "--out",
                            str(ours), *extra]) == 2
        err = capsys.readouterr().err
        assert "is an input of this operation" in err and "Traceback" not in err, err
    # a --target directory (the Hugging Face target), for a directory layout too
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    assert export_main([str(draft), "--format", "hf", "--target", str(model), "--out",
                        str(model), "--overwrite"]) == 2
    assert "is an input of this operation" in capsys.readouterr().err
    assert [p.name for p in model.iterdir()] == ["config.json"]
    assert {p: p.read_bytes() for p in tmp_path.glob("*.gguf")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(p.name for p in before), "draft", "model"])  # nothing else written


def test_the_reports_and_the_work_dir_never_share_a_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "load_target", lambda *a, **k: pytest.fail("benchmark started"))
    monkeypatch.chdir(tmp_path)
    base = ["--method", "plain", "--prompts", "x"]
    for pair in (["--out", "r", "--html", "r"],
                 ["--out", "r.json", "--html", str(tmp_path / "r.json")],
                 ["--out", "w", "--llama-work-dir", "w"],
                 ["--html", "w.html", "--llama-work-dir", str(tmp_path / "w.html")]):
        with pytest.raises(SystemExit) as info:
            bench.main([*base, *pair])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "name the same path" in err and "Traceback" not in err, err
    (tmp_path / "r.json").write_text('{"format": "draftsmith-bench"}')  # an earlier report
    with pytest.raises(SystemExit):
        bench.main([*base, "--out", "r.json", "--html", "./r.json"])
    assert "name the same path" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


# ------------------------------------------------------------------------------------------------
# tracebacks


def test_a_work_dir_that_is_a_file_or_inside_an_input_is_one_line(tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.setattr(bench, "load_target", lambda *a, **k: pytest.fail("benchmark started"))
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    draft = tmp_path / "draft"
    draft.mkdir()
    base = ["--engine", "llama.cpp", "--method", "plain", "--prompts", str(tmp_path / "q.jsonl")]
    for work, said in ((notes, "exists and is not a directory"),
                       (draft / "work", "is inside an input of this run")):
        with pytest.raises(SystemExit) as info:
            bench.main([*base, "--method", f"draft:{draft}", "--llama-work-dir", str(work)])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"--llama-work-dir: {work}" in err and said in err and "Traceback" not in err
    assert notes.read_text() == "mine" and list(draft.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# what an interrupted export leaves


def test_leftovers_of_dead_exports_are_removed_and_live_or_foreign_ones_kept(tmp_path):
    dead, me, host = _dead_pid(), os.getpid(), host_name()
    out = tmp_path / "d.gguf"
    out.write_text("the user's file")
    stale_files = [f".d.gguf.{host}-{dead}.tmp", f".d.gguf.{dead}.tmp"]
    kept_files = [f".d.gguf.{host}-{me}.tmp", f".d.gguf.elsewhere-{dead}.tmp",
                  f".other.gguf.{host}-{dead}.tmp", f"d.gguf.{host}-{dead}.tmp"]
    for name in stale_files + kept_files:
        (tmp_path / name).write_bytes(b"GGUF partial")
    stale_dir = tmp_path / f".d.gguf.gguf-{host}-{dead}-k2x_9abc"
    (stale_dir / "layout").mkdir(parents=True)
    (stale_dir / "layout" / "config.json").write_text("{}")
    (stale_dir / ".layout.tmp-x").mkdir()
    live_dir = tmp_path / f".d.gguf.gguf-{host}-{me}-abcdefgh"
    (live_dir / "layout").mkdir(parents=True)
    foreign_dir = tmp_path / f".d.gguf.gguf-{host}-{dead}-zzzzzzzz"
    foreign_dir.mkdir()
    (foreign_dir / "notes.txt").write_text("not ours")
    assert sorted(p.name for p in remove_stale_conversions(out)) == sorted(stale_files)
    assert remove_stale_scratch(out) == [stale_dir]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["d.gguf", *kept_files, live_dir.name, foreign_dir.name])
    assert out.read_text() == "the user's file"


def test_a_signal_unwinds_the_command_but_never_cuts_a_held_section_in_two(capsys):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    steps = []
    with pytest.raises(Stopped) as info, stop_on_signals("prog"):
        with signals_held():  # a process started and recorded, say
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            steps.append("the section finished")
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal: the stop is under way
        steps.append("never reached")
    assert steps == ["the section finished"]
    assert info.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.startswith("prog: stopped by SIGTERM")
    assert {sig: signal.getsignal(sig) for sig in before} == before  # put back
    with stop_on_signals("prog"):  # and a later command starts afresh
        with signals_held():
            pass


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, the_converter):
    from test_llama_cpp import tiny_llama_dir
    from transformers import AutoTokenizer

    from draftsmith.targets.resolve import resolve_target

    root = tmp_path_factory.mktemp("draft")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_target("smollm2-135m")))
    tiny_llama_dir(root / "draft", tokenizer, layers=1)
    config = json.loads((root / "draft" / "config.json").read_text())
    config["draftsmith"] = {"target": {"name": "tiny"}}
    (root / "draft" / "config.json").write_text(json.dumps(config))
    return root / "draft"


def test_sigterm_to_a_gguf_export_ends_the_converter_and_the_next_export_cleans_up(
        draft_dir, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "d.gguf"
    command = [sys.executable, "-m", "draftsmith", "export", str(draft_dir), "--format", "gguf",
               "--out", str(out), "--gguf-type", "f32"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=_env(), cwd=tmp_path)
    converters = []
    try:
        # running: the layout is written into the scratch directory, the converter started
        converters = _wait_for(lambda: _children(process.pid, "convert_hf_to_gguf"),
                               "converter", process)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        for pid in converters:  # never left behind by the test, whatever it found
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM" in err and "Traceback" not in err, err[-3000:]
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in converters), "the converter was left running"
    assert list(out_dir.iterdir()) == [], "a partial GGUF or the scratch directory was left"
    # what a SIGKILL would leave (nothing can run then): the next export removes it once its
    # process is gone, and writes a GGUF that names draftsmith as its writer
    dead, host = _dead_pid(), host_name()
    (out_dir / f".d.gguf.{host}-{dead}.tmp").write_bytes(b"GGUF partial")
    (out_dir / f".d.gguf.gguf-{host}-{dead}-abcd1234" / "layout").mkdir(parents=True)
    assert export_main([str(draft_dir), "--format", "gguf", "--out", str(out),
                        "--gguf-type", "f32"]) == 0
    assert [p.name for p in out_dir.iterdir()] == ["d.gguf"]
    assert written_by_draftsmith(out)
    # an earlier export of ours is replaced without --overwrite
    first = out.stat().st_mtime_ns
    assert export_main([str(draft_dir), "--format", "gguf", "--out", str(out),
                        "--gguf-type", "f32"]) == 0
    assert out.stat().st_mtime_ns != first and [p.name for p in out_dir.iterdir()] == ["d.gguf"]


# ------------------------------------------------------------------------------------------------
# the llama.cpp benchmark: servers and work directory


@pytest.mark.parametrize("sig,keep", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_a_signal_to_the_llama_benchmark_stops_every_server(llama_server, tmp_path, sig, keep):
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"turns": [f"Count from one to {n}, in words."]})
                                 + "\n" for n in (50, 60, 70, 80)))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    work = tmp_path / "work"
    command = [sys.executable, "-m", "draftsmith.eval.bench", "--engine", "llama.cpp", "--target",
               "smollm2-135m", "--method", "plain", "--method", "ngram:ngram-simple",
               "--prompts", str(questions), "--max-new-tokens", "400", "--warmup", "0",
               "--threads", "1", "--no-progress", "--out", str(tmp_path / "r.json")]
    if keep:
        command += ["--llama-work-dir", str(work)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=_env(TMPDIR=str(scratch), LLAMA_SERVER=str(
                                   llama_server)), cwd=tmp_path)
    servers = []
    try:
        servers = _wait_for(lambda: (lambda found: found if len(found) == 2 else None)(
            _children(process.pid, "llama-server")), "two llama-servers", process)
        time.sleep(1.0)  # loading, or already answering the first prompts
        process.send_signal(sig)
        _, err = process.communicate(timeout=120)
    finally:
        for pid in servers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + sig, err[-3000:]
    assert f"stopped by {signal.Signals(sig).name}" in err and "Traceback" not in err, err[-3000:]
    time.sleep(0.2)
    assert [pid for pid in servers if _alive(pid)] == [], "llama-servers were left running"
    assert list(scratch.glob("draftsmith-llama-*")) == []  # the run's own work dir is removed
    if keep:  # the user's is kept, with the servers' logs
        assert len(list((work / "logs").glob("llama-server-*.log"))) == 2


def test_ctrl_c_while_a_server_loads_leaves_no_server(llama_server, tmp_path, monkeypatch):
    from draftsmith.eval.llama_bench import ServeContext, serve_methods
    from draftsmith.targets.resolve import embedded_gguf_path

    started = []
    real_start = LlamaServer.start

    def start(self):
        started.append(self)
        real_start(self)

    def interrupted(self, path):  # Ctrl-C arrives while start() waits for /health
        raise KeyboardInterrupt

    monkeypatch.setattr(LlamaServer, "start", start)
    monkeypatch.setattr(LlamaServer, "_get", interrupted)
    monkeypatch.setenv("LLAMA_SERVER", str(llama_server))
    ctx = ServeContext(SimpleNamespace(vocab_size=49152), embedded_gguf_path("smollm2-135m"),
                       tmp_path)
    try:
        with pytest.raises(KeyboardInterrupt), contextlib.ExitStack() as stack:
            serve_methods(["plain"], ctx, threads=1, ctx_size=256, stack=stack)
        assert started and started[0].process is not None
        assert started[0].process.poll() is not None, "the loading server was left running"
    finally:
        for server in started:
            if server.process is not None and server.process.poll() is None:
                os.killpg(server.process.pid, signal.SIGKILL)
                server.process.wait()
