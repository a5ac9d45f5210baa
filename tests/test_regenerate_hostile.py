"""What a hostile or careful user found against ``python -m draftsmith.train.data regenerate`` / ``merge``
and the OpenAI backend: each case is a test that failed before its fix.

Nothing a user wrote is lost, nothing goes silently wrong, and every error is one line with exit
status != 0, never a traceback. The servers are real local HTTP servers (``http.server`` in a
thread) scripted by the prompt each request asks: nothing of ours is mocked.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import free_port
from transformers import AutoTokenizer

from draftsmith.targets.resolve import resolve_target
from draftsmith.train import regenerate as regeneration
from draftsmith.train.regenerate import merge_shards, regenerate, shard_path
from draftsmith.train.regenerate_backends import OpenAIBackend

REPO = Path(__file__).resolve().parents[1]
FAST = dict(max_new_tokens=8, temperature=0.0, progress=False)


class _Scripted(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server answering each prompt as its text asks.

    GET /models answers ``server.models`` (default: models "m" and "m2"). A chat request answers
    with the message content 5 ("number"), a list ("list"), null ("null"), a JSON list as the
    whole body ("listbody"), as model "other" ("impostor"), after ``server.delay`` seconds
    ("slow..."), or properly."""

    def _send(self, code: int, payload) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._send(200, self.server.models)

    def do_POST(self):  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        asked = request["messages"][-1]["content"]
        if asked.startswith("slow"):
            time.sleep(self.server.delay)
        if asked == "listbody":
            return self._send(200, [1, 2, 3])
        content = {"number": 5, "list": [{"type": "text", "text": "hi"}], "null": None}.get(
            asked, f"an answer to {asked}")
        try:
            model = "other" if asked == "impostor" else request["model"]
            self._send(200, {"model": model, "choices": [
                {"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]})
        except OSError:  # the client gave up waiting
            pass

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    httpd.models = {"data": [{"id": "m"}, {"id": "m2"}]}
    httpd.delay = 5.0
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def prompts_file(path: Path, asks: list[str]) -> str:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": a}]}) + "\n"
                            for a in asks))
    return str(path)


def cli(server_url: str, data: str, out, *extra: str) -> list[str]:
    return ["regenerate", "--backend", "openai", "--url", server_url, "--model", "m", "--target",
            "smollm2-135m", "--data", data, "--out", str(out), "--max-new-tokens", "8",
            "--temperature", "0", "--retries", "0", *extra]


def one_line_error(capsys, code, expected: str) -> str:
    """The command ended with exit status 2 and one error line on stderr holding ``expected``
    (besides regenerate's progress bar, argparse's usage and draftsmith's notes)."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.replace("\r", "\n").split("\n") if line.strip() and not
             line.startswith(("regenerating ", "usage: ", " ", "[draftsmith] "))]
    assert len(lines) == 1 and ": error: " in lines[0], err
    assert expected in lines[0], err
    return lines[0]


def run_cli(argv: list[str]):
    """main's exit status, whether it returns it or argparse exits with it."""
    try:
        return regeneration.main(argv)
    except SystemExit as stop:
        return stop.code


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def non_daemon_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads the interpreter would wait for at exit, started since ``before`` was taken (an
    earlier test's leftovers are not this run's: in CI two idle ``ThreadPoolExecutor`` threads
    started before these tests were seen alive here)."""
    return [t for t in threading.enumerate() if t is not threading.main_thread()
            and not t.daemon and t.is_alive() and t not in before]


# ------------------------------------------------------------------------------------------------
# Data lost


def test_a_users_one_record_json_without_a_final_newline_is_never_truncated(server, tokenizer,
                                                                            tmp_path, capsys):
    mine = tmp_path / "mine.json"
    mine.write_bytes(b'{"messages": [{"role": "user", "content": "my own notes"}]}')
    before = mine.read_bytes()
    backend = OpenAIBackend(server.url, "m", tokenizer, retries=0)
    with pytest.raises(ValueError, match=r"mine\.json.*not .*regenerate wrote.*--out"):
        regenerate(backend, [[{"role": "user", "content": "hi"}]], mine, **FAST)
    assert mine.read_bytes() == before
    data = prompts_file(tmp_path / "p.jsonl", ["hi"])
    one_line_error(capsys, run_cli(cli(server.url, data, mine)), "mine.json")
    assert mine.read_bytes() == before


def test_merge_never_replaces_a_users_file_without_a_final_newline(server, tokenizer, tmp_path):
    backend = OpenAIBackend(server.url, "m", tokenizer, retries=0)
    out = tmp_path / "answers.jsonl"
    for i in range(2):
        regenerate(backend, [[{"role": "user", "content": "hi"}]] * 2, out, shard=(i, 2), **FAST)
    out.write_bytes(b'{"messages": [{"role": "user", "content": "my own notes"}]}')
    with pytest.raises(ValueError, match=r"answers\.jsonl.*not .*(regenerate|merge) wrote"):
        merge_shards(out)
    assert out.read_bytes() == b'{"messages": [{"role": "user", "content": "my own notes"}]}'


# ------------------------------------------------------------------------------------------------
# Silently wrong


def test_non_text_message_content_is_a_counted_failure_never_a_row(server, tokenizer, tmp_path,
                                                                    capsys):
    asks = ["fine", "number", "list", "null", "also fine"]
    backend = OpenAIBackend(server.url, "m", tokenizer, concurrency=2, retries=0)
    out = tmp_path / "answers.jsonl"
    with pytest.raises(ValueError, match=r"3 of 5 conversations were not written.* 1, 2, 3"):
        regenerate(backend, [[{"role": "user", "content": a}] for a in asks], out, **FAST)
    assert sorted(r["prompt_index"] for r in rows(out)) == [0, 4]
    assert all(isinstance(r["messages"][-1]["content"], str) for r in rows(out))
    data = prompts_file(tmp_path / "p.jsonl", asks)
    err = one_line_error(capsys, run_cli(cli(server.url, data, tmp_path / "cli.jsonl")),
                         "3 of 5 conversations")
    assert "not text" in err


@pytest.mark.parametrize("flag, first, then", [
    ("--model", "m", "m2"), ("--temperature", "0", "0.5"), ("--max-new-tokens", "8", "16")])
def test_a_resume_with_other_settings_is_refused_naming_the_setting(flag, first, then, server,
                                                                    tmp_path, capsys):
    data = prompts_file(tmp_path / "p.jsonl", ["one", "two", "three"])
    out = tmp_path / "answers.jsonl"

    def argv(value: str, *extra: str) -> list[str]:
        args = cli(server.url, data, out, *extra)
        args[args.index(flag) + 1] = value
        return args

    assert run_cli(argv(first, "--max-prompts", "2")) == 0
    written = rows(out)
    assert [r["settings"]["model"] for r in written] == [first if flag == "--model" else "m"] * 2
    before = out.read_bytes()
    capsys.readouterr()
    one_line_error(capsys, run_cli(argv(then)), flag)
    assert out.read_bytes() == before
    assert run_cli(argv(first)) == 0  # the same settings continue
    assert [r["prompt_index"] for r in rows(out)] == [0, 1, 2]


@pytest.mark.parametrize("count", ["0", "-1"])
def test_merge_refuses_a_non_positive_shard_count(count, tmp_path, capsys):
    out = tmp_path / "answers.jsonl"
    one_line_error(capsys, run_cli(["merge", "--out", str(out), "--shards", count]), "--shards")
    assert not out.exists()
    with pytest.raises(ValueError, match="shards"):
        merge_shards(out, int(count))
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# Tracebacks


def test_a_dead_server_is_one_line(tmp_path, capsys):
    data = prompts_file(tmp_path / "p.jsonl", ["hi"])
    url = f"http://127.0.0.1:{free_port()}/v1"
    one_line_error(capsys, run_cli(cli(url, data, tmp_path / "a.jsonl")), "check that the server")


def test_a_timeout_fails_its_rows_and_leaves_no_thread_to_wait_for(server, tmp_path, capsys):
    data = prompts_file(tmp_path / "p.jsonl", ["fine", "slow one", "also fine", "slow two"])
    out = tmp_path / "answers.jsonl"
    before = set(threading.enumerate())
    start = time.monotonic()
    code = run_cli(cli(server.url, data, out, "--timeout", "0.3", "--concurrency", "4"))
    assert time.monotonic() - start < 4
    one_line_error(capsys, code, "2 of 4 conversations")
    assert sorted(r["prompt_index"] for r in rows(out)) == [0, 2]
    assert non_daemon_threads(before) == []


def test_a_run_stopped_with_requests_in_flight_leaves_no_thread_to_wait_for(server, tokenizer,
                                                                            tmp_path):
    """A server answering as another model stops the run while slow requests are still in
    flight: the interpreter must not then wait for them to end."""
    server.delay = 3.0
    backend = OpenAIBackend(server.url, "m", tokenizer, concurrency=3, retries=0)
    prompts = [[{"role": "user", "content": a}] for a in ("fine", "slow", "slow", "impostor")]
    before = set(threading.enumerate())
    start = time.monotonic()
    with pytest.raises(ValueError, match="answered as 'other'"):
        regenerate(backend, prompts, tmp_path / "a.jsonl", **FAST)
    assert time.monotonic() - start < 2.5
    assert non_daemon_threads(before) == []


@pytest.mark.parametrize("listing", [[], {"data": 5}, {"data": [5]}, "models"])
def test_a_malformed_model_list_is_one_line(listing, server, tmp_path, capsys):
    server.models = listing
    data = prompts_file(tmp_path / "p.jsonl", ["hi"])
    one_line_error(capsys, run_cli(cli(server.url, data, tmp_path / "a.jsonl")), "/models")


def test_a_chat_reply_whose_body_is_a_list_is_a_counted_failure(server, tmp_path, capsys):
    data = prompts_file(tmp_path / "p.jsonl", ["fine", "listbody"])
    out = tmp_path / "a.jsonl"
    one_line_error(capsys, run_cli(cli(server.url, data, out)), "1 of 2 conversations")
    assert [r["prompt_index"] for r in rows(out)] == [0]


def test_an_out_that_is_a_directory_is_one_line(server, tmp_path, capsys):
    data = prompts_file(tmp_path / "p.jsonl", ["hi"])
    folder = tmp_path / "folder"
    folder.mkdir()
    one_line_error(capsys, run_cli(cli(server.url, data, folder)), "directory")
    one_line_error(capsys, run_cli(["merge", "--out", str(folder)]), "directory")
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("timeout", ["inf", "nan", "0", "-1"])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_at_parse(timeout, server,
                                                                             tmp_path, capsys):
    data = prompts_file(tmp_path / "p.jsonl", ["hi"])
    out = tmp_path / "a.jsonl"
    one_line_error(capsys, run_cli(cli(server.url, data, out, "--timeout", timeout)), "--timeout")
    assert not out.exists()
    with pytest.raises(ValueError, match="timeout"):
        OpenAIBackend(server.url, "m", AutoTokenizer.from_pretrained(
            str(resolve_target("smollm2-135m"))), timeout=float(timeout))


def test_sigint_with_requests_in_flight_exits_promptly_keeping_the_rows(server, tmp_path):
    server.delay = 60.0
    asks = ["one", "two", "three", "slow a", "slow b", "slow c"]
    data = prompts_file(tmp_path / "p.jsonl", asks)
    out = tmp_path / "answers.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "draftsmith.train.data", *cli(server.url, data, out, "--concurrency", "6")],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.01)
        time.sleep(0.3)  # the slow requests are in flight
        assert process.poll() is None, process.stderr.read()
        process.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, err = process.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert took < 3, took
    assert process.returncode != 0
    lines = [line for line in err.replace("\r", "\n").split("\n")
             if line.strip() and not line.startswith(("regenerating ", "[draftsmith] "))]
    assert "Traceback" not in err and len(lines) == 1 and "interrupted" in lines[0], err
    assert sorted(r["prompt_index"] for r in rows(out)) == [0, 1, 2]  # every line whole


# ------------------------------------------------------------------------------------------------
# merge: damaged marks and stray files


def finished_shards(server, tokenizer, out: Path, count: int = 2) -> None:
    backend = OpenAIBackend(server.url, "m", tokenizer, retries=0)
    prompts = [[{"role": "user", "content": f"hi {i}"}] for i in range(4)]
    for i in range(count):
        regenerate(backend, prompts, out, shard=(i, count), **FAST)


@pytest.mark.parametrize("mark", ["{}", "garbage", "", "[1, 2]", '{"prompts": "4"}'])
def test_a_damaged_done_file_is_named_with_what_to_do(mark, server, tokenizer, tmp_path, capsys):
    out = tmp_path / "answers.jsonl"
    finished_shards(server, tokenizer, out)
    done = regeneration._done_path(shard_path(out, 1, 2))
    done.write_text(mark)
    err = one_line_error(capsys, run_cli(["merge", "--out", str(out)]), done.name)
    assert "damaged" in err and "rerun" in err
    assert not out.exists()


def test_a_stray_file_named_like_a_shard_is_ignored_with_a_warning(server, tokenizer, tmp_path,
                                                                    capsys):
    out = tmp_path / "answers.jsonl"
    stray = tmp_path / "answers.shard-x-of-y.jsonl"
    stray.write_text("my notes\n")
    one_line_error(capsys, run_cli(["merge", "--out", str(out)]), "no shard files")
    finished_shards(server, tokenizer, out)
    capsys.readouterr()
    assert run_cli(["merge", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "merged 4 conversations" in captured.out
    assert "answers.shard-x-of-y.jsonl" in captured.err and "ignor" in captured.err
    assert stray.read_text() == "my notes\n"


def test_shards_answered_with_other_settings_are_not_merged(server, tokenizer, tmp_path):
    backend = OpenAIBackend(server.url, "m", tokenizer, retries=0)
    prompts = [[{"role": "user", "content": f"hi {i}"}] for i in range(4)]
    out = tmp_path / "answers.jsonl"
    regenerate(backend, prompts, out, shard=(0, 2), **FAST)
    regenerate(backend, prompts, out, shard=(1, 2), **{**FAST, "max_new_tokens": 16})
    with pytest.raises(ValueError, match=r"shard-1-of-2.*other settings.*--max-new-tokens 8"):
        merge_shards(out)
    assert not out.exists()
