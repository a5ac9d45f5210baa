"""regenerate --backend openai against a real OpenAI-compatible server: ``transformers serve``
(the ``serve`` extra) started on 127.0.0.1 with the embedded target's safetensors directory,
offline. Greedy answers through the server equal the hf backend's, turn by turn; a wrong model
name, another chat template and a refused request are clear errors before anything is written.

The server takes ~15-30 s to start on a shared 2-core CPU, hence slow. Retrying after HTTP 503
is shown against a scripted local HTTP server (a real server cannot be made to fail on demand).
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import free_port
from transformers import AutoTokenizer

from draftsmith.targets.resolve import resolve_target
from draftsmith.targets.target import load_target
from draftsmith.train import regenerate as regeneration
from draftsmith.train.regenerate import regenerate
from draftsmith.train.regenerate_backends import (
    Answer,
    BadAnswer,
    OpenAIBackend,
    check_server_tokens,
)

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="needs the serve extra: pip install -e '.[serve]'")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "dataset answer"},
     {"role": "user", "content": "And of Italy?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Name a red fruit."}],
    [{"role": "user", "content": "How many legs has a spider?"},
     {"role": "assistant", "content": "dataset answer"},
     {"role": "user", "content": "And an ant?"},
     {"role": "assistant", "content": "dataset answer"},
     {"role": "user", "content": "Which of the two is an insect?"}],
]
GREEDY = dict(max_new_tokens=12, temperature=0.0, progress=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``transformers serve`` pinned to the embedded target, on a free local port."""
    path = str(resolve_target("smollm2-135m"))
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "transformers.cli.transformers", "serve", path, "--host",
             "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"],
            stdout=sink, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"transformers serve did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield {"url": f"{url}/v1", "model": path, "target": "smollm2-135m"}
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def by_index(path: Path) -> dict[int, dict]:
    return {r["prompt_index"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_greedy_answers_through_the_server_equal_the_hf_backend_turn_by_turn(server, tokenizer,
                                                                              tmp_path):
    backend = OpenAIBackend(server["url"], server["model"], tokenizer, concurrency=3,
                            max_context=8192)
    through_server = tmp_path / "server.jsonl"
    assert regenerate(backend, CONVERSATIONS, through_server, **GREEDY) == 3
    torch.set_num_threads(2)
    target = load_target("smollm2-135m", dtype=torch.float32)
    in_process = tmp_path / "hf.jsonl"
    regenerate(target, CONVERSATIONS, in_process, batch_size=1, **GREEDY)
    def answers(path: Path) -> dict[int, dict]:  # (each row records its backend and model)
        return {i: {k: v for k, v in r.items() if k != "settings"} for i, r in by_index(path).items()}

    assert answers(through_server) == answers(in_process)
    assert {r["settings"]["backend"] for r in by_index(through_server).values()} == {"openai"}
    records = by_index(through_server)
    assert [records[i]["turns"] for i in range(3)] == [2, 1, 3]
    assert "dataset answer" not in through_server.read_text()

    # the first-answer check, on an answer that stopped by itself and one cut at max_tokens
    for max_new_tokens in (64, 3):
        prompt = [{"role": "user", "content": "Say hello."}]
        answer = backend.answer(prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                                top_p=1.0, seed=0)
        assert answer.finished == (max_new_tokens == 64)
        check_server_tokens(tokenizer, prompt, answer)
        # another tokenizer's text: as many characters, other tokens
        wrong = Answer(answer.text + " zzqx", answer.finished, answer.prompt_tokens,
                       answer.completion_tokens)
        with pytest.raises(ValueError, match="re-tokenising its answer"):
            check_server_tokens(tokenizer, prompt, wrong)


@pytest.mark.slow
def test_a_wrong_model_name_another_template_and_a_refused_request(server, tokenizer, tmp_path):
    out = tmp_path / "answers.jsonl"
    wrong_name = OpenAIBackend(server["url"], "not-the-model", tokenizer)
    with pytest.raises(ValueError, match="not 'not-the-model'; pass --model"):
        regenerate(wrong_name, CONVERSATIONS, out, **GREEDY)
    assert out.read_text() == ""

    # a target whose chat template differs from the one the server applies
    other = AutoTokenizer.from_pretrained(str(resolve_target("smollm2-135m")))
    other.chat_template = other.chat_template.replace("You are a helpful AI assistant",
                                                      "You are a terse AI assistant")
    assert other.chat_template != tokenizer.chat_template
    elsewhere = OpenAIBackend(server["url"], server["model"], other)
    with pytest.raises(ValueError, match="another template or tokenizer"):
        regenerate(elsewhere, CONVERSATIONS, out, **GREEDY)
    assert out.read_text() == ""

    backend = OpenAIBackend(server["url"], server["model"], tokenizer)
    hello = [{"role": "user", "content": "hello"}]
    with pytest.raises(ValueError, match="refused with HTTP 400: .*pinned"):
        backend.request("POST", "/chat/completions", {"model": "other", "messages": hello})
    with pytest.raises(ValueError, match=r"refused with HTTP 404 \(does --url end in /v1\?\)"):
        backend.request("POST", "/chat/complete", {"model": server["model"], "messages": hello})


@pytest.mark.slow
def test_the_command_line_against_the_server(server, tmp_path, capsys):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    out = tmp_path / "answers.jsonl"
    regeneration.main(["regenerate", "--backend", "openai", "--url", server["url"], "--model",
               server["model"], "--target", server["target"], "--data", str(source), "--out",
               str(out), "--max-new-tokens", "8", "--temperature", "0", "--concurrency", "2",
               "--max-turns", "2"])
    assert "answered 3 prompts" in capsys.readouterr().out
    assert sorted(r["turns"] for r in by_index(out).values()) == [1, 2, 2]


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Answers 503 to the first two chat requests, then one fixed completion."""

    calls = 0

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).calls += 1
        if type(self).calls <= 2:
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"busy")
            return
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "hi"},
                                        "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_5xx_answers_are_retried_with_backoff(tokenizer):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        backend = OpenAIBackend(url, "m", tokenizer, retries=3, backoff=0.01)
        answer = backend.answer([{"role": "user", "content": "hello"}], max_new_tokens=4,
                                temperature=0.0, top_p=1.0, seed=0)
        assert (answer.text, answer.finished, _Flaky.calls) == ("hi", True, 3)
        _Flaky.calls = 0
        impatient = OpenAIBackend(url, "m", tokenizer, retries=1, backoff=0.0)
        with pytest.raises(BadAnswer, match="failed 2 times, last with HTTP 503"):
            impatient.answer([{"role": "user", "content": "hello"}], max_new_tokens=4,
                             temperature=0.0, top_p=1.0, seed=0)
    finally:
        httpd.shutdown()


class _Unreliable(http.server.BaseHTTPRequestHandler):
    """Serves model "m"; answers each prompt as its text asks: "empty" with nothing, "cut" cut
    short by the server (finish_reason length after 2 of the tokens asked), "boom" with HTTP 500,
    "abort" with finish_reason "abort", "impostor" as another model, anything else properly.
    ``healed`` prompts are answered properly from now on."""

    healed: set[str] = set()

    def _send(self, code: int, payload: dict | bytes) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._send(200, {"data": [{"id": "m"}]})

    def do_POST(self):  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        asked = request["messages"][-1]["content"]
        text, reason, model = f"an answer to {asked}", "stop", "m"
        if asked not in self.healed:
            if asked == "boom":
                return self._send(500, b"internal error")
            text = {"empty": "", "cut": "half an"}.get(asked, text)
            reason = {"cut": "length", "abort": "abort"}.get(asked, reason)
            model = "other" if asked == "impostor" else model
        self._send(200, {"model": model, "choices": [{"message": {"role": "assistant",
                                                                  "content": text},
                                                      "finish_reason": reason}],
                         "usage": {"completion_tokens": 2 if reason == "length" else None}})

    def log_message(self, *args):
        pass


@pytest.fixture()
def unreliable():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unreliable)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Unreliable.healed = set()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()


def test_unusable_answers_are_retried_reported_per_row_and_never_written(unreliable, tokenizer,
                                                                          tmp_path):
    asks = ["fine", "empty", "cut", "boom", "abort", "also fine"]
    prompts = [[{"role": "user", "content": ask}] for ask in asks]
    backend = OpenAIBackend(unreliable, "m", tokenizer, concurrency=3, retries=1, backoff=0.0)
    out = tmp_path / "answers.jsonl"
    with pytest.raises(ValueError, match=r"4 of 6 conversations were not written .*prompt "
                                         r"indices 1, 2, 3, 4.*rerun the same command") as err:
        regenerate(backend, prompts, out, max_new_tokens=8, temperature=0.0, progress=False,
                   shard=(0, 1))
    for why in ("empty", "after 2 of 8 tokens", "HTTP 500", "finish_reason 'abort'"):
        assert why in str(err.value)
    assert sorted(by_index(out)) == [0, 5]  # the usable rows are kept, the others not written

    # sharded: the shard with failures is not marked finished, so it is not merged
    with pytest.raises(ValueError, match="2 of 3 conversations were not written"):
        regenerate(backend, prompts, tmp_path / "sharded.jsonl", max_new_tokens=8,
                   temperature=0.0, progress=False, shard=(1, 2))
    assert not (tmp_path / "sharded.shard-1-of-2.jsonl.done").exists()

    # a rerun asks for the failed ones only, and writes them once they are usable
    _Unreliable.healed = {"empty", "cut", "boom", "abort"}
    assert regenerate(backend, prompts, out, max_new_tokens=8, temperature=0.0,
                      progress=False) == 4
    rows = by_index(out)
    assert sorted(rows) == list(range(6))
    assert rows[1]["messages"][-1]["content"] == "an answer to empty"


def test_a_server_answering_as_another_model_stops_the_run(unreliable, tokenizer, tmp_path):
    prompts = [[{"role": "user", "content": "fine"}], [{"role": "user", "content": "impostor"}]]
    backend = OpenAIBackend(unreliable, "m", tokenizer, concurrency=1, retries=0)
    out = tmp_path / "answers.jsonl"
    with pytest.raises(ValueError, match="answered as 'other': another model would write"):
        regenerate(backend, prompts, out, max_new_tokens=8, temperature=0.0, progress=False)
    assert sorted(by_index(out)) == [0]


def _named_server(name: str) -> type[http.server.BaseHTTPRequestHandler]:
    class Named(http.server.BaseHTTPRequestHandler):
        """Lists model "m" and answers every chat request with its own name."""

        def _json(self, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 (http.server's name)
            self._json({"data": [{"id": "m"}]})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self._json({"choices": [{"message": {"role": "assistant", "content": name},
                                     "finish_reason": "stop"}]})

        def log_message(self, *args):
            pass

    return Named


def test_several_server_urls_share_the_conversations_in_turn(tokenizer):
    """--url A B (one server per node, or vLLM's data-parallel replicas behind several ports):
    each is checked for the model, and conversations go to them in turn."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _named_server(name))
               for name in ("first", "second")]
    for httpd in servers:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        urls = [f"http://127.0.0.1:{httpd.server_address[1]}/v1" for httpd in servers]
        backend = OpenAIBackend(urls, "m", tokenizer)
        backend.check()
        texts = [backend.answer([{"role": "user", "content": "hello"}], max_new_tokens=4,
                                temperature=0.0, top_p=1.0, seed=0).text for _ in range(4)]
        assert texts == ["first", "second", "first", "second"]
        with pytest.raises(ValueError, match="serves \\['m'\\], not 'other'"):
            OpenAIBackend(urls, "other", tokenizer).check()
        with pytest.raises(ValueError, match="http\\(s\\) addresses"):
            OpenAIBackend([urls[0], "localhost:9"], "m", tokenizer)
    finally:
        for httpd in servers:
            httpd.shutdown()
