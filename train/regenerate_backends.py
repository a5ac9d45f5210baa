"""The two ways regeneration gets the target's answers: transformers in this process, or an
OpenAI-compatible server (vLLM, SGLang, llama-server, transformers serve).

* :class:`HFBackend`: ``generate`` in batches, left-padded, on the loaded target;
* :class:`OpenAIBackend`: ``/chat/completions`` over HTTP with retries and exponential backoff;
  :func:`check_server_tokens` checks once that the server tokenises and templates as the target
  does, so the answers train the head on the tokens the target would see.

An answer that cannot be a training row (empty, not text, cut short by the server, ended
abnormally, not given within the timeout, or a request the server keeps failing) is a
:class:`BadAnswer`: its conversation is counted and left unwritten while the run goes on. A
server that cannot be reached, or that answers as another model, stops the run.
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import torch

from draftsmith.targets.target import Target
from draftsmith.train.rows import (
    RowError,
    tokenize_conversation,
)


@dataclass
class Answer:
    """One generated assistant turn."""

    text: str
    finished: bool  # ended with an end-of-sequence token; false when it hit max_new_tokens
    prompt_tokens: int | None = None  # the server's own counts (OpenAI backend), when it says
    completion_tokens: int | None = None


class BadAnswer(ValueError):
    """This request's answer cannot be a training row; the conversation is reported, not
    written, and the next run asks for it again."""


class ServerFailed(ConnectionError):
    """The server answered this request with 429 / 5xx through every retry, or not within the
    timeout (it is reachable: the failure belongs to the request)."""


def _timed_out(err: BaseException) -> bool:
    return isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError)


def _kind(value) -> str:
    """A JSON value's kind, as a user reads it in a message."""
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _count(value) -> int | None:
    """A token count a server reports, or None when it reports none (or not a whole number)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# finish reasons that end an answer normally: by itself ("stop"; "eos" in some servers) or at
# max_tokens ("length", checked against the token count the server reports)
_NORMAL_ENDS = ("stop", "eos", "length")


def answer_problem(answer: Answer, max_new_tokens: int, reason: str | None = "stop") -> str | None:
    """Why ``answer`` cannot be a training row, or None: empty, an abnormal finish reason, or
    ``length`` before ``max_new_tokens`` tokens (the server ran out of context for its slot)."""
    if not answer.text:  # (whitespace is text: a model may well answer with line breaks)
        return "the answer is empty"
    if reason not in _NORMAL_ENDS:
        return f"the answer ended with finish_reason {reason!r}"
    if (reason == "length" and answer.completion_tokens is not None
            and answer.completion_tokens < max_new_tokens):
        return (f"the server cut the answer after {answer.completion_tokens} of {max_new_tokens} "
                f"tokens (finish_reason 'length': its context per slot is full; give the server "
                f"a larger context per parallel slot)")
    return None


def same_model(asked: str, served: str | None) -> bool:
    """Whether a reply's ``model`` names the model asked for: equal, or one of them is the other
    with a revision (``org/model`` and ``org/model@main``); a reply without one is believed."""
    if served is None or served == asked:
        return True
    return served.startswith(asked + "@") or asked.startswith(served + "@")


class HFBackend:
    """Answers with ``generate`` on a loaded target: one turn of ``batch_size`` conversations per
    call, left-padded."""

    def __init__(self, target: Target, *, batch_size: int = 8):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.target = target
        self.batch_size = batch_size
        self.tokenizer = target.tokenizer
        self.max_context = target.max_context

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.target.chat_ids(messages)

    def answer_batch(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                     top_p: float) -> list[Answer]:
        pad_id = self.tokenizer.pad_token_id
        pad_id = self.target.eos_token_ids[0] if pad_id is None else pad_id
        answers = generate_batch(self.target, prompts, pad_id, max_new_tokens, temperature, top_p)
        return [Answer(text, finished) for text, finished in answers]  # checked by the caller


class OpenAIBackend:
    """Answers through an OpenAI-compatible server's ``/chat/completions`` (vLLM, SGLang, TGI,
    ``transformers serve``), ``concurrency`` requests in flight.

    ``url`` ends in ``/v1``; a list of them spreads the conversations over several servers (one
    per node, say), taken in turn. The server applies its own chat template; ``tokenizer`` is the
    target's, which counts what fits in ``max_context`` and checks on the first answer that the
    server's template and tokenizer give the tokens training will see
    (:func:`check_server_tokens`). Connection errors, HTTP 429 and 5xx are retried ``retries``
    times, waiting ``backoff`` x 2^attempt seconds (at most a minute); any other 4xx is a
    ValueError with the server's message. ``api_key`` is sent as a bearer token when given.
    """

    def __init__(self, url: str | list[str], model: str, tokenizer, *, concurrency: int = 8,
                 max_context: int | None = None, timeout: float = 600.0, retries: int = 5,
                 backoff: float = 1.0, api_key: str | None = None):
        urls = [url] if isinstance(url, str) else list(url)
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if not urls or bad:
            raise ValueError(f"--url must be http(s) addresses such as http://127.0.0.1:8000/v1, "
                             f"got {bad or urls!r}")
        if (concurrency < 1 or retries < 0 or not (math.isfinite(timeout) and timeout > 0)
                or not backoff >= 0):
            raise ValueError(f"need concurrency >= 1, retries >= 0, a finite timeout > 0 and "
                             f"backoff >= 0, "
                             f"got {concurrency}, {retries}, {timeout}, {backoff}")
        check_chat_tokenizer(tokenizer)
        self.urls = [u.rstrip("/") for u in urls]
        self.url = self.urls[0]
        self._turn = itertools.count()  # which server the next conversation goes to
        self.model = model
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.max_context = max_context or 1 << 30
        self.timeout, self.retries, self.backoff, self.api_key = timeout, retries, backoff, api_key
        self._tokenizer_lock = threading.Lock()  # a Rust tokenizer is not safe across threads

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        with self._tokenizer_lock:
            return _template_ids(self.tokenizer, messages)

    def request(self, method: str, path: str, body: dict | None = None,
                retries: int | None = None, server: str | None = None) -> dict:
        """One JSON request (to ``server``, default the first), retried on connection errors,
        429 and 5xx; a 4xx is a ValueError. No answer within ``timeout`` is a
        :class:`ServerFailed` at once: asking a server too slow for it again only adds to its
        queue."""
        server = server or self.url
        url = server + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                request = urllib.request.Request(url, data=data, headers=headers, method=method)
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    payload = response.read()
                break
            except urllib.error.HTTPError as err:
                detail = " ".join(err.read().decode("utf-8", "replace")[:800].split())
                if err.code != 429 and err.code < 500:
                    hint = " (does --url end in /v1?)" if err.code == 404 else ""
                    raise ValueError(f"{method} {url} was refused with HTTP {err.code}{hint}: "
                                     f"{detail}") from None
                problem, failure = f"HTTP {err.code}: {detail}", ServerFailed
            except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
                if _timed_out(err):
                    raise ServerFailed(f"{method} {url} got no answer within the timeout of "
                                       f"{self.timeout:g} s (--timeout)") from None
                problem = str(getattr(err, "reason", None) or err) or type(err).__name__
                failure = ConnectionError
            if attempt == retries:
                raise failure(f"{method} {url} failed {attempt + 1} times, last with {problem}; "
                              f"check that the server runs at {server}")
            time.sleep(min(self.backoff * 2**attempt, 60.0))
        try:
            return json.loads(payload)
        except json.JSONDecodeError:
            raise ValueError(f"{url} answered with something other than JSON: "
                             f"{payload[:200]!r}") from None

    def check(self) -> None:
        """The server answers and serves ``model``: a clear error before any work."""
        for server in self.urls:
            listed = self.request("GET", "/models", retries=min(self.retries, 2), server=server)
            models = listed.get("data") if isinstance(listed, dict) else None
            served = [m.get("id") for m in models if isinstance(m, dict)] \
                if isinstance(models, list) else []
            if not served:
                raise ValueError(f"the server at {server} answered GET /models with "
                                 f"{json.dumps(listed)[:200]}, not a list of the models it "
                                 f"serves ({{\"data\": [{{\"id\": NAME}}]}}); is --url the "
                                 f"address of an OpenAI-compatible server, ending in /v1?")
            if self.model not in served:
                raise ValueError(f"the server at {server} serves {served}, not "
                                 f"{self.model!r}; pass --model with one of those names")

    def answer(self, messages: list[dict], *, max_new_tokens: int, temperature: float,
               top_p: float, seed: int) -> Answer:
        body = {"model": self.model, "messages": messages, "max_tokens": max_new_tokens,
                "temperature": temperature, "seed": seed, "stream": False}
        if temperature > 0:
            body["top_p"] = top_p
        server = self.urls[next(self._turn) % len(self.urls)]
        try:
            reply = self.request("POST", "/chat/completions", body, server=server)
        except ServerFailed as err:
            raise BadAnswer(str(err)) from None
        if not isinstance(reply, dict):
            raise BadAnswer(f"{server}/chat/completions answered with a JSON {_kind(reply)}, not "
                            f"a completion object: {json.dumps(reply)[:300]}")
        served = reply.get("model")
        if not same_model(self.model, None if served is None else str(served)):
            raise ValueError(f"asked {server} for model {self.model!r}, it answered as "
                             f"{served!r}: another model would write these rows; "
                             f"serve the target alone, or pass the name it serves as --model")
        try:
            choice = reply["choices"][0]
            text = choice["message"]["content"]
            reason = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise BadAnswer(f"{server}/chat/completions answered without a message: "
                            f"{json.dumps(reply)[:300]}") from None
        if text is None:  # (how some servers send an empty answer)
            text = ""
        if not isinstance(text, str):
            raise BadAnswer(f"{server}/chat/completions answered with message content that is "
                            f"not text but a JSON {_kind(text)}: {json.dumps(text)[:200]}")
        usage = reply.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        answer = Answer(text, reason in ("stop", "eos"), _count(usage.get("prompt_tokens")),
                        _count(usage.get("completion_tokens")))
        problem = answer_problem(answer, max_new_tokens, reason)
        if problem:
            raise BadAnswer(problem)
        return answer


def _template_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def check_server_tokens(tokenizer, prompt: list[dict], answer: Answer) -> None:
    """On one first-turn answer: the server saw and wrote the tokens training will see.

    The server's ``usage.prompt_tokens`` must be the length of the prompt under the target's
    template, and re-tokenising the conversation with it must mask as many tokens as the server
    generated (the answer's tokens, plus the end-of-turn token when it stopped by itself and
    counts it). Raises ValueError otherwise; says so when the server reports no usage.
    """
    if answer.prompt_tokens is None or answer.completion_tokens is None:
        print("[draftsmith] the server reports no token usage: cannot check that its chat "
              "template and tokenizer are the target's", flush=True)
        return
    expected = len(_template_ids(tokenizer, prompt))
    if answer.prompt_tokens != expected:
        raise ValueError(
            f"the server counted {answer.prompt_tokens} prompt tokens where the target's chat "
            f"template and tokenizer ({tokenizer.name_or_path}) give {expected}: it serves "
            f"another template or tokenizer, so its answers would not be the tokens training "
            f"masks; serve the target itself, or name the model the server runs as --target")
    conversation = [*prompt, {"role": "assistant", "content": answer.text}]
    try:
        masked = sum(tokenize_conversation(conversation, tokenizer)["loss_mask"])
    except RowError as err:
        raise ValueError(f"the server's first answer cannot be tokenised for training ({err}): "
                         f"{answer.text[:200]!r}") from None
    content = masked - 1  # the loss also masks the end-of-turn token that closes the answer
    if answer.completion_tokens not in (content, content + 1):
        raise ValueError(
            f"the server generated {answer.completion_tokens} tokens, but re-tokenising its "
            f"answer with the target's template gives {content} (+1 end-of-turn): it uses "
            f"another tokenizer than {tokenizer.name_or_path}, so training would not see the "
            f"tokens it wrote; serve the target itself. Answer: {answer.text[:200]!r}")


@torch.no_grad()
def generate_batch(target, batch: list[list[int]], pad_id: int, max_new_tokens: int,
              temperature: float, top_p: float) -> list[tuple[str, bool]]:
    """(answer text, whether it ended with an end-of-sequence token) for each prompt."""
    width = max(map(len, batch))
    # Left padding, so that every row's next token is generated at the same position.
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # (batch, width)
    attention_mask = torch.zeros_like(input_ids)
    for b, ids in enumerate(batch):
        input_ids[b, width - len(ids):] = torch.tensor(ids)
        attention_mask[b, width - len(ids):] = 1
    sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p}
                if temperature > 0 else {"do_sample": False})
    output = target.model.generate(
        input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
        max_new_tokens=max_new_tokens, eos_token_id=list(target.eos_token_ids),
        pad_token_id=pad_id, **sampling,
    )  # (batch, width + new)
    answers = []
    for tokens in output[:, width:].tolist():
        end = next((k for k, t in enumerate(tokens) if t in target.eos_token_ids), None)
        text = target.tokenizer.decode(tokens[:end], skip_special_tokens=True)
        answers.append((text, end is not None))
    return answers


def check_chat_tokenizer(tokenizer) -> None:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", None)
        raise ValueError(f"tokenizer {name!r} has no chat template; regenerating through a "
                         f"server needs the target's template to count and check tokens")
