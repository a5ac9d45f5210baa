"""Self-distillation: the target's own answers to the prompts, written as training rows.

:func:`regenerate` lets the target answer every user turn of the prompts itself, through
``transformers`` in this process (``--backend hf``) or any OpenAI-compatible server
(``--backend openai``), sharded over processes and resumable, and writes the conversations as
JSONL (``messages`` format) that :func:`draftsmith.train.rows.load_sft_dataset` reads
back. ``python -m draftsmith.train.data`` is this module's command line::

    python -m draftsmith.train.data regenerate --target smollm2-135m --data a.json b.jsonl \\
        --out answers.jsonl --max-new-tokens 512 --temperature 0.7 --batch-size 16
    python -m draftsmith.train.data regenerate --backend openai --url http://127.0.0.1:8000/v1 \\
        --model NAME --target TARGET --data a.json --out answers.jsonl --concurrency 64
    torchrun --nproc_per_node 8 -m draftsmith.train.data regenerate --target TARGET --data a.json \\
        --out answers.jsonl          # one shard per process, merged when the last one ends
    python -m draftsmith.train.data regenerate ... --shard 3/8   # shard 3 of 8 (counting from 0)
    python -m draftsmith.train.data merge --out answers.jsonl    # join answers.shard-I-of-N.jsonl
    python -m draftsmith.train.data inspect --target smollm2-135m --data answers.jsonl
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from draftsmith.files.command_line import program, run_command
from draftsmith.files.output_dir import named_paths, refuse_inputs
from draftsmith.targets.target import Target
from draftsmith.train.regenerate_backends import (
    Answer,
    BadAnswer,
    HFBackend,
    OpenAIBackend,
    answer_problem,
    check_server_tokens,
)
from draftsmith.train.regenerate_files import (
    Writer,
    answered,
    done_path,
    merge_shards,
    refuse_directory,
    shard_path,
    write_done,
)
from draftsmith.train.rows import (
    DataReport,
    default_cache_dir,
    examples,
    load_sft_dataset,
    read_conversations,
)

_done_path = done_path  # (the name tests and older callers use; merge_shards and shard_path are
# imported from here too)

Prompt = list[list[dict]]  # the user turns of one conversation, each turn a list of messages


def user_turns(messages: Sequence[Mapping]) -> Prompt:
    """What a conversation gives its assistant to answer: one list of messages per turn.

    Assistant messages close a turn and are dropped (regeneration answers in their place); the
    system and user messages before an answer form the turn it answers, so ``[system, user,
    assistant, user]`` has two turns. Trailing messages with no user message are dropped.
    """
    turns: Prompt = []
    pending: list[dict] = []
    for message in messages:
        if message["role"] != "assistant":
            pending.append(dict(message))
        elif any(m["role"] == "user" for m in pending):
            turns.append(pending)
            pending = []
    if any(m["role"] == "user" for m in pending):
        turns.append(pending)
    return turns


def load_prompts(
    sources: str | os.PathLike | Iterable[str | os.PathLike],
) -> tuple[list[Prompt], DataReport]:
    """Each usable row's user turns (:func:`user_turns`; its answers dropped), and the report.

    Rows without an assistant turn (such as ShareGPT first turns) are one-turn prompts.
    """
    conversations, report = read_conversations(sources)
    prompts = []
    for conversation in conversations:
        turns = user_turns(conversation["messages"])
        counts = report.sources[conversation["source"]]
        if not turns:
            counts.skip(conversation["row"], "no user turn")
            continue
        prompts.append(turns)
        counts.used += 1
    return prompts, report


def parse_shard(spec: str | Sequence[int]) -> tuple[int, int]:
    """``"I/N"`` (or ``(I, N)``) -> (I, N): shard I of N, counting from 0."""
    try:
        index, count = (int(x) for x in (spec.split("/") if isinstance(spec, str) else spec))
    except (ValueError, TypeError):
        raise ValueError(f"a shard is I/N with whole numbers, such as 0/4, got {spec!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: I/N needs 0 <= I < N (shards count from 0), "
                         f"got {spec!r}")
    return index, count


@dataclass
class _Conversation:
    """A conversation being regenerated: its user turns and the history answered so far."""

    index: int
    turns: Prompt
    messages: list[dict] = field(default_factory=list)
    answered: int = 0
    finished: bool = True
    cut: bool = False
    next_ids: list[int] | None = None
    failure: str | None = None  # why a turn's answer could not be a training row

    def next_input(self) -> list[dict]:
        return [*self.messages, *self.turns[self.answered]]

    def add(self, prompt: list[dict], answer: Answer) -> None:
        self.messages = [*prompt, {"role": "assistant", "content": answer.text}]
        self.answered += 1
        self.finished = self.finished and answer.finished

    def record(self, settings: Mapping) -> dict:
        return {"messages": self.messages, "prompt_index": self.index, "turns": self.answered,
                "finished": self.finished, "cut": self.cut, "settings": dict(settings)}


def _prepare(conversation: _Conversation, backend, limit: int, max_new_tokens: int) -> str:
    """"more" (the next turn fits; its ids are set), "done" (every turn answered, or the next no
    longer fits: cut at this turn boundary) or "skip" (not even the first turn fits)."""
    if conversation.answered == len(conversation.turns):
        return "done"
    ids = backend.prompt_ids(conversation.next_input())
    if len(ids) + max_new_tokens <= limit:
        conversation.next_ids = ids
        return "more"
    if conversation.answered == 0:
        return "skip"
    conversation.cut = True
    return "done"


def _request_seed(seed: int, index: int, turn: int) -> int:
    """A per-request seed: reproducible whatever order the requests are answered in."""
    return ((seed * 1_000_003 + index) * 1009 + turn) % (1 << 31)


def regenerate(
    backend: Target | HFBackend | OpenAIBackend,
    prompts_or_files: Sequence[list[dict]] | str | os.PathLike | Iterable[str | os.PathLike],
    out_path: str | os.PathLike,
    *,
    max_new_tokens: int = 512,
    temperature: float = 0.7,
    top_p: float = 0.95,
    batch_size: int = 8,
    max_prompts: int | None = None,
    max_turns: int | None = None,
    max_length: int | None = None,
    seed: int = 0,
    shard: tuple[int, int] | str = (0, 1),
    progress: bool = True,
) -> int:
    """Let the target answer every user turn of the prompts itself; write them as JSONL.

    ``backend`` is a loaded :class:`Target` (run as ``HFBackend(target, batch_size=batch_size)``),
    an :class:`HFBackend` or an :class:`OpenAIBackend`. ``prompts_or_files`` are conversations
    (lists of messages; their assistant turns are dropped) or data sources read with
    :func:`load_prompts`; only the first ``max_prompts`` count. Turn 1 is answered, the answer
    appended, turn 2 answered given that history, and so on, at most ``max_turns`` turns. A
    conversation whose next turn plus ``max_new_tokens`` no longer fits in ``max_length`` (default:
    the target's context) is cut at that turn boundary and counted; one whose first turn does
    not fit is skipped and counted.

    Sharding: ``shard=(I, N)`` (or ``"I/N"``) answers prompts ``I, I + N, ...`` into
    :func:`shard_path` (``answers.shard-I-of-N.jsonl``), so N processes (``torchrun``, ``accelerate
    launch``, several machines) share the work; :func:`merge_shards` then joins them in input
    order. With N = 1, ``out_path`` itself is written.

    Each line is ``{"messages", "prompt_index", "turns", "finished", "cut", "settings"}``
    (``finished``: every answer ended by itself rather than at ``max_new_tokens``; ``cut``: turns
    were left unanswered because the history no longer fit; ``settings``: the backend, model and
    generation settings it was answered with), written and flushed when its conversation is
    complete. Rerunning with the same prompts, shard and settings continues where the file stops
    (other settings are refused, naming them); a process killed at any moment loses only the
    conversations in flight. ``temperature`` 0 is greedy. Returns the number of conversations
    answered by this call.

    A turn whose answer cannot be a training row (:class:`~draftsmith.train.regenerate_backends.BadAnswer`:
    empty, not text, cut short by the server, ended abnormally, not given within the timeout, a
    request the server kept failing) is asked
    once more; if it fails again its conversation is not written, the others go on, and at the
    end a ValueError names the failed prompts and why (a shard with failures is not marked
    finished, so it is not merged; rerunning asks for them again).
    """
    if isinstance(backend, Target):
        backend = HFBackend(backend, batch_size=batch_size)
    for name, value in (("max_new_tokens", max_new_tokens), ("max_prompts", max_prompts),
                        ("max_turns", max_turns), ("max_length", max_length)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not (math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1):
        raise ValueError(f"need a finite temperature >= 0 and 0 < top_p <= 1, got {temperature}, "
                         f"{top_p}")
    index, count = parse_shard(shard)
    if _is_prompt_list(prompts_or_files):
        prompts = [user_turns(p) for p in prompts_or_files]
        empty = [i for i, turns in enumerate(prompts) if not turns]
        if empty:
            raise ValueError(f"prompts {examples(empty)} have no user message")
    else:
        prompts, report = load_prompts(prompts_or_files)
        if progress:
            print(report.summary(), flush=True)
    prompts = prompts[:max_prompts]
    refuse_directory(Path(out_path))
    out = Path(out_path) if count == 1 else shard_path(out_path, index, count)
    refuse_directory(out)
    if not _is_prompt_list(prompts_or_files):  # the answers never go into the prompts' file
        sources = [prompts_or_files] if isinstance(prompts_or_files, (str, os.PathLike)) \
            else list(prompts_or_files)
        refuse_inputs([out], named_paths(*sources))
    out.parent.mkdir(parents=True, exist_ok=True)
    recorded = _recorded_settings(backend, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_p=top_p, seed=seed,
                                  max_turns=max_turns, max_length=max_length)
    done = answered(out, prompts, (index, count), recorded)
    todo = [_Conversation(i, prompts[i][:max_turns]) for i in range(index, len(prompts), count)
            if i not in done]
    limit = min(backend.max_context, max_length or backend.max_context)
    finished_mark = done_path(out)
    if todo and finished_mark.exists():
        finished_mark.unlink()
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    skipped: list[int] = []
    cut: list[int] = []
    failed: dict[int, str] = {}
    writer = Writer(out)

    def finish(conversation: _Conversation) -> None:
        if conversation.failure is not None:
            failed[conversation.index] = conversation.failure
            return
        writer.write(conversation.record(recorded))
        if conversation.cut:
            cut.append(conversation.index)

    try:
        with tqdm(total=len(todo), desc=f"regenerating {out.name}", unit="conv",
                  disable=not progress) as bar:
            if isinstance(backend, OpenAIBackend):
                if todo:
                    backend.check()
                _converse_concurrently(backend, todo, limit, seed, settings, finish,
                                       skipped, bar)
            else:
                _converse_batched(backend, todo, limit, seed, settings, finish, skipped, bar)
    finally:
        writer.close()
    written = len(todo) - len(skipped) - len(failed)
    if progress:
        where = f"shard {index}/{count} " if count > 1 else ""
        print(f"[draftsmith] {where}answered {written} conversations into {out}" + (
            f"; {len(cut)} cut at a turn boundary (history + max_new_tokens > {limit} tokens; "
            f"prompt indices {examples(cut)})" if cut else "") + (
            f"; {len(skipped)} skipped, their first turn + max_new_tokens > {limit} tokens "
            f"(prompt indices {examples(skipped)})" if skipped else ""), flush=True)
    if failed:
        shown = sorted(failed)[:5]
        reasons = "; ".join(f"prompt {i}: {failed[i]}" for i in shown)
        raise ValueError(
            f"{len(failed)} of {len(todo)} conversations were not written to {out}, their answers "
            f"being unusable as training rows (prompt indices {examples(sorted(failed))}): "
            f"{reasons}{' ...' if len(failed) > len(shown) else ''}. The other {written} are "
            f"written; rerun the same command to ask for the failed ones again")
    if count > 1:
        write_done(out, index, count, len(prompts), skipped)
    return written


def _recorded_settings(backend, **settings) -> dict:
    """What every row records it was answered with (a resume must ask the same)."""
    if isinstance(backend, OpenAIBackend):
        kind, model = "openai", backend.model
    else:
        kind, model = "hf", getattr(getattr(backend, "target", None), "name", None)
    for key in ("temperature", "top_p"):
        settings[key] = float(settings[key])
    return {"backend": kind, "model": model, **settings}


def _converse_batched(backend: HFBackend, todo, limit, seed, settings, finish, skipped, bar):
    """A pool of ``batch_size`` conversations; each call answers the next turn of all of them,
    finished conversations leave and new ones take their place."""
    ready = {c.index: _prepare(c, backend, limit, settings["max_new_tokens"]) for c in todo}
    # longest first: similar lengths share a batch, and memory errors come early
    waiting = deque(sorted(todo, key=lambda c: (-len(c.next_ids or ()), c.index)))
    rng_devices = [backend.target.device] if backend.target.device.type == "cuda" else []
    active: list[_Conversation] = []
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        while waiting or active:
            while waiting and len(active) < backend.batch_size:
                conversation = waiting.popleft()
                if ready[conversation.index] == "skip":
                    skipped.append(conversation.index)
                    bar.update(1)
                else:
                    active.append(conversation)
            if not active:
                break
            inputs = [c.next_input() for c in active]
            answers = backend.answer_batch([c.next_ids for c in active], **settings)
            still = []
            for conversation, prompt, answer in zip(active, inputs, answers, strict=True):
                problem = answer_problem(answer, settings["max_new_tokens"],
                                         "stop" if answer.finished else "length")
                if problem:  # greedy or seeded: asking again would give the same answer
                    conversation.failure = problem
                    finish(conversation)
                    bar.update(1)
                    continue
                conversation.add(prompt, answer)
                if _prepare(conversation, backend, limit, settings["max_new_tokens"]) == "more":
                    still.append(conversation)
                else:
                    finish(conversation)
                    bar.update(1)
            active = still


def _converse_concurrently(backend: OpenAIBackend, todo, limit, seed, settings, finish,
                           skipped, bar):
    """Each conversation is one task answering its turns in order; ``concurrency`` tasks run at
    once (:func:`_in_daemon_threads`). The first turn of the first conversation is asked alone
    and checked first."""
    stop = threading.Event()  # set when the run ends early: no task asks anything more

    def ask(conversation: _Conversation, prompt: list[dict]) -> Answer:
        request_seed = _request_seed(seed, conversation.index, conversation.answered)
        try:
            return backend.answer(prompt, seed=request_seed, **settings)
        except BadAnswer:  # once more: a server that failed or cut short may answer now
            return backend.answer(prompt, seed=request_seed, **settings)

    def converse(conversation: _Conversation, check: bool = False) -> tuple[_Conversation, str]:
        limit_tokens = settings["max_new_tokens"]
        while (status := _prepare(conversation, backend, limit, limit_tokens)) == "more":
            if stop.is_set():
                return conversation, "stopped"
            prompt = conversation.next_input()
            try:
                answer = ask(conversation, prompt)
            except BadAnswer as err:
                conversation.failure = str(err)
                return conversation, "failed"
            if check and conversation.answered == 0:
                check_server_tokens(backend.tokenizer, prompt, answer)
            conversation.add(prompt, answer)
            if check:
                return conversation, "more"
        return conversation, status

    rest = list(todo)
    while rest:  # the check: the first conversation whose first turn fits and is answered
        conversation, status = converse(rest.pop(0), check=True)
        if status in ("skip", "failed"):
            if status == "skip":
                skipped.append(conversation.index)
            else:
                finish(conversation)
            bar.update(1)
            continue
        rest.insert(0, conversation)
        break
    try:
        for conversation, status in _in_daemon_threads(converse, rest, backend.concurrency, stop):
            if status == "skip":
                skipped.append(conversation.index)
            else:
                finish(conversation)
            bar.update(1)
    finally:
        stop.set()


def _in_daemon_threads(task: Callable, items: list, workers: int,
                       stop: threading.Event) -> Iterator:
    """``task(item)`` of every item on ``workers`` daemon threads, yielded here as each ends (an
    exception it raised is raised here); no thread takes another item once ``stop`` is set (the
    caller sets it when it stops early: an error, Ctrl-C). The results are handled (written) by
    the caller's thread only. Daemon threads never keep the process alive: a request still
    waiting on a slow server when the caller stops is left behind rather than waited for."""
    pending: queue.SimpleQueue = queue.SimpleQueue()
    for item in items:
        pending.put(item)
    results: queue.SimpleQueue = queue.SimpleQueue()

    def work() -> None:
        while not stop.is_set():
            try:
                item = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results.put((True, task(item)))
            except BaseException as err:  # handed to the caller's thread, raised there
                results.put((False, err))

    for _ in range(min(workers, len(items))):
        threading.Thread(target=work, name="regenerate-request", daemon=True).start()
    for _ in items:
        while True:
            try:
                ok, value = results.get(timeout=0.5)  # (Ctrl-C is seen at once either way)
                break
            except queue.Empty:
                continue
        if not ok:
            raise value
        yield value


def _is_prompt_list(value: Any) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0
            and all(isinstance(p, list) and all(isinstance(m, dict) for m in p) for p in value))


# ------------------------------------------------------------------------------------------------
# Command line


def _launcher_shard() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as torchrun and accelerate launch set them; (0, 1) otherwise."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m draftsmith.train.data regenerate|inspect|merge``; a user's mistake (a ValueError or
    FileNotFoundError) is one line on stderr and exit status 2."""
    parser = argparse.ArgumentParser(prog=program("python -m draftsmith.train.data"),
                                     description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    regen_parser = commands.add_parser(
        "regenerate", help="let the target answer every turn of the prompts itself")
    inspect_parser = commands.add_parser("inspect", help="tokenise the data and print the report")
    merge_parser = commands.add_parser(
        "merge", help="join the shard files of regenerate --shard into one file, in input order")
    for command in (regen_parser, inspect_parser):
        command.add_argument("--target", required=True,
                             help="target: embedded name, Hugging Face directory or .gguf file "
                                  "(--backend openai: its tokenizer and template count and check "
                                  "tokens; the model runs in the server)")
        command.add_argument("--data", nargs="+", required=True,
                             help="JSON/JSONL files or Hub dataset ids")
    regen_parser.add_argument("--out", required=True,
                              help="JSONL file to append to (resumable); with shards, "
                                   "OUT.shard-I-of-N.jsonl beside it")
    regen_parser.add_argument("--backend", choices=("hf", "openai"), default="hf",
                              help="hf: transformers generate in this process; openai: an "
                                   "OpenAI-compatible server (vLLM, SGLang, TGI, "
                                   "transformers serve)")
    regen_parser.add_argument("--url", nargs="+",
                              help="openai: the server's address, e.g. http://127.0.0.1:8000/v1; "
                                   "several servers (one per node): their addresses, the "
                                   "conversations spread over them in turn")
    regen_parser.add_argument("--model", help="openai: the model name the server serves")
    regen_parser.add_argument("--concurrency", type=_whole(1), default=8,
                              help="openai: conversations in flight")
    regen_parser.add_argument("--timeout", type=_seconds, default=600.0,
                              help="openai: seconds to wait for one answer; a request without "
                                   "an answer by then fails its conversation (asked once more)")
    regen_parser.add_argument("--retries", type=_whole(0), default=5,
                              help="openai: retries of a request after a connection error, "
                                   "429 or 5xx (exponential backoff)")
    regen_parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                              help="openai: bearer token, if the server wants one (default: "
                                   "$OPENAI_API_KEY)")
    regen_parser.add_argument("--shard", default=None,
                              help="I/N: answer prompts I, I+N, ... into OUT.shard-I-of-N.jsonl "
                                   "(default: RANK/WORLD_SIZE under torchrun or accelerate "
                                   "launch, else 0/1)")
    regen_parser.add_argument("--max-new-tokens", type=int, default=512)
    regen_parser.add_argument("--max-turns", type=int, default=None,
                              help="answer at most this many user turns per conversation")
    regen_parser.add_argument("--max-length", type=int, default=None,
                              help="longest conversation in tokens (default: the target's "
                                   "context); later turns are cut at a turn boundary")
    regen_parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    regen_parser.add_argument("--top-p", type=float, default=0.95)
    regen_parser.add_argument("--batch-size", type=int, default=8,
                              help="hf: conversations per generate call")
    regen_parser.add_argument("--max-prompts", type=int, default=None)
    regen_parser.add_argument("--seed", type=int, default=0)
    regen_parser.add_argument("--device", default=None,
                              help="hf: default cuda (cuda:LOCAL_RANK under a launcher) when "
                                   "available, else cpu")
    regen_parser.add_argument("--dtype", default=None, help="hf: default bf16 on GPU, fp32 on CPU")
    inspect_parser.add_argument("--max-length", type=int, default=2048)
    inspect_parser.add_argument("--num-proc", type=int, default=None,
                                help="tokenising processes (default: one per core, for large data)")
    inspect_parser.add_argument("--cache-dir", default=None, help=f"default: {default_cache_dir()}")
    merge_parser.add_argument("--out", required=True,
                              help="the --out given to regenerate; its shard files are joined")
    merge_parser.add_argument("--shards", type=_whole(1), default=None,
                              help="N (default: the N of the shard files found)")
    merge_parser.add_argument("--partial", action="store_true",
                              help="merge shards that have not finished too")
    args = parser.parse_args(argv)
    try:
        return run_command(lambda: _errors_in_one_line(_run, args, parser), "python -m draftsmith.train.data")
    except KeyboardInterrupt:
        print("python -m draftsmith.train.data: interrupted; what was written so far is kept whole (run "
              "the same command again to continue where it stopped)", file=sys.stderr, flush=True)
        return 130


def _whole(least: int) -> Callable[[str], int]:
    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value

    return whole


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def _errors_in_one_line(run: Callable, *args) -> object:
    """A server that cannot be reached, or a file that cannot be read or written, is the user's
    to fix, not a bug: one line (as a ValueError) rather than a traceback."""
    try:
        return run(*args)
    except FileNotFoundError:
        raise
    except OSError as err:  # ConnectionError included
        raise ValueError(" ".join(str(err).split()) or type(err).__name__) from None


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.command == "merge":
        rows = merge_shards(args.out, args.shards, partial=args.partial)
        print(f"merged {rows} conversations into {args.out}")
    elif args.command == "regenerate":
        shard = parse_shard(args.shard if args.shard is not None else _launcher_shard())
        if args.backend == "openai":
            backend = _openai_backend(args, parser)
        else:
            from draftsmith.targets.target import load_target

            device = args.device
            if device is None and torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
                device = f"cuda:{os.environ['LOCAL_RANK']}"
            target = load_target(args.target, device=device, dtype=args.dtype)
            backend = HFBackend(target, batch_size=args.batch_size)
        written = regenerate(
            backend, args.data, args.out, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, batch_size=args.batch_size,
            max_prompts=args.max_prompts, max_turns=args.max_turns, max_length=args.max_length,
            seed=args.seed, shard=shard,
        )
        print(f"answered {written} prompts")
        if shard[1] > 1:
            marks = [done_path(shard_path(args.out, i, shard[1])) for i in range(shard[1])]
            if all(m.is_file() for m in marks):  # the last shard to finish joins them
                rows = merge_shards(args.out, shard[1])
                print(f"every shard has finished: merged {rows} conversations into {args.out}")
    else:
        from draftsmith.targets.resolve import resolve_target
        from draftsmith.targets.target import load_target_tokenizer

        tokenizer = load_target_tokenizer(resolve_target(args.target))
        dataset, report = load_sft_dataset(args.data, tokenizer, max_length=args.max_length,
                                           cache_dir=args.cache_dir, num_proc=args.num_proc)
        print(report.summary())
        if len(dataset):
            print(f"{len(dataset)} sequences, longest {max(dataset['length'])} tokens")


def _openai_backend(args, parser) -> OpenAIBackend:
    from transformers import AutoConfig

    from draftsmith.targets.resolve import resolve_target
    from draftsmith.targets.target import load_target_tokenizer

    if not args.url or not args.model:
        parser.error("--backend openai needs --url (e.g. http://127.0.0.1:8000/v1) and --model")
    path = resolve_target(args.target)
    tokenizer = load_target_tokenizer(path)
    context = getattr(AutoConfig.from_pretrained(str(path), trust_remote_code=False),
                      "max_position_embeddings", None)
    return OpenAIBackend(args.url, args.model, tokenizer, concurrency=args.concurrency,
                         max_context=context, timeout=args.timeout, retries=args.retries,
                         api_key=args.api_key)


if __name__ == "__main__":
    raise SystemExit(main())
