"""draftsmith.train.rows (what python -m draftsmith.train.data reads): every source format, exact assistant loss masks, skip reports, the tokenisation cache
(shared by concurrent processes), prompts. Regeneration is tested in tests/test_regenerate.py."""

from __future__ import annotations

import copy
import gzip
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from tokenizers import processors

from draftsmith.files.file_formats import FileFormatError
from draftsmith.targets.target import completion_template, load_target
from draftsmith.train import regenerate as regeneration
from draftsmith.train import rows as data
from draftsmith.train.regenerate import load_prompts, user_turns
from draftsmith.train.rows import (
    RowError,
    collate_causal_lm,
    load_sft_dataset,
    read_conversations,
    tokenize_conversation,
)

# Rows copied from ../shared/data/train (see its SOURCES.md), one list per file.
CODEGEN = [  # gpteacher_codegen_instruct.json rows 3154, 2449
    {"instruction": "How do I declare an integer array of size 10 in Java?", "input": "",
     "response": "int[] myArray = new int[10];"},
    {"instruction": "What is the output of the following Python code snippet?",
     "input": "x = 9\ny = 2\nz = x % y\nprint(z)", "response": "1"},
]
ROLEPLAY = [  # gpteacher_roleplay_instruct.json row 52
    {"instruction": "You are Chewbacca from Star Wars, and you've been captured by an enemy crew. "
                    "They're interrogating you about the Rebel Alliance's plans. Respond as "
                    "Chewbacca.",
     "input": "Enemy: Tell us everything you know about the Rebel Alliance's plans.",
     "response": "*Grrrrowwwrrr wrrhwrwwhw wraaargh*"},
]
GSM8K = [  # gsm8k_train.jsonl rows 2348, 6469
    {"question": "What is fifteen more than a quarter of 48?",
     "answer": "A quarter of 48 is 48/4=<<48/4=12>>12.\nThe number is "
               "12+15=<<12+15=27>>27.\n#### 27"},
    {"question": "Twice Angie's age, plus 4, is 20. How old is Angie?",
     "answer": "Twice Angie's age is 20-4=<<20-4=16>>16.\nAngie is 16/2=<<16/2=8>>8.\n#### 8"},
]
MBPP = [  # mbpp_train.jsonl rows 213, 234
    {"text": "Write a function to find the area of a rombus.",
     "code": "def rombus_area(p,q):\r\n  area=(p*q)/2\r\n  return area", "task_id": 814,
     "test_setup_code": "", "test_list": ["assert rombus_area(10,20)==100",
                                          "assert rombus_area(10,5)==25",
                                          "assert rombus_area(4,2)==4"],
     "challenge_test_list": []},
    {"text": "Write a python function to find the slope of a line.",
     "code": "def slope(x1,y1,x2,y2): \r\n    return (float)(y2-y1)/(x2-x1)  ", "task_id": 835,
     "test_setup_code": "", "test_list": ["assert slope(4,2,2,5) == -1.5",
                                          "assert slope(2,4,4,6) == 1",
                                          "assert slope(1,2,4,2) == 0"],
     "challenge_test_list": []},
]
SELF_INSTRUCT = [  # self_instruct_seed_tasks_175.jsonl rows 25, 58
    {"id": "seed_task_25", "name": "perfect_numbers",
     "instruction": "Find the four smallest perfect numbers.",
     "instances": [{"input": "", "output": "6, 28, 496, and 8128"}], "is_classification": False},
    {"id": "seed_task_58", "name": "measurement_conversion",
     "instruction": "Convert the following measurement.",
     "instances": [{"input": "3 ft = _____ in.", "output": "3 ft = 36 in."}],
     "is_classification": False},
]
SHAREGPT_FIRST_TURNS = [  # sharegpt_first_turns.json rows 2544, 2819
    {"id": "FApKSLw", "conversations": [{"from": "human",
                                         "value": "What is packet scanning and sniffing"}]},
    {"id": "9ue6qMi", "conversations": [{"from": "human", "value": "How are you?"}]},
]
# Multi-turn conversations built from the rows above, in the two chat formats.
SHAREGPT_MULTI_TURN = [
    {"id": "mt", "conversations": [
        {"from": "system", "value": "You answer in one line."},
        {"from": "human", "value": GSM8K[0]["question"]},
        {"from": "gpt", "value": GSM8K[0]["answer"]},
        {"from": "user", "value": GSM8K[1]["question"]},
        {"from": "assistant", "value": GSM8K[1]["answer"]},
    ]},
]
MESSAGES = [
    {"messages": [
        {"role": "user", "content": CODEGEN[0]["instruction"]},
        {"role": "assistant", "content": CODEGEN[0]["response"]},
        {"role": "user", "content": "And in Python?"},
        {"role": "assistant", "content": "my_array = [0] * 10  # 十個 😀, ¿sí?"},
    ]},
]
ALPACA_OUTPUT = [{"instruction": ROLEPLAY[0]["instruction"], "output": ROLEPLAY[0]["response"]}]

END = "<|im_end|>"  # SmolLM2's end-of-turn token, part of every assistant span


def write(directory: Path, name: str, rows: list) -> str:
    """A JSON array for .json names, one object per line for .jsonl names."""
    path = directory / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path.write_text(json.dumps(rows, indent=1))
    return str(path)


@pytest.fixture
def every_format(tmp_path) -> dict[str, str]:
    """Format name -> a small file in that format."""
    return {
        "alpaca": write(tmp_path, "codegen.json", CODEGEN),
        "alpaca-output": write(tmp_path, "roleplay_output.jsonl", ALPACA_OUTPUT),
        "question-answer": write(tmp_path, "gsm8k.jsonl", GSM8K),
        "mbpp": write(tmp_path, "mbpp.jsonl", MBPP),
        "self-instruct": write(tmp_path, "self_instruct.jsonl", SELF_INSTRUCT),
        "sharegpt": write(tmp_path, "sharegpt_multi_turn.json", SHAREGPT_MULTI_TURN),
        "messages": write(tmp_path, "messages.jsonl", MESSAGES),
    }


def masked_runs(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The maximal runs of consecutive tokens whose loss_mask is 1."""
    runs: list[list[int]] = []
    for t, (token, masked) in enumerate(zip(input_ids, loss_mask, strict=True)):
        if masked:
            if t == 0 or not loss_mask[t - 1]:
                runs.append([])
            runs[-1].append(token)
    return runs


def test_every_format_becomes_chat_messages(every_format):
    conversations, report = read_conversations(list(every_format.values()))
    assert {name: report.sources[path].format for name, path in every_format.items()} == {
        "alpaca": "alpaca", "alpaca-output": "alpaca", "question-answer": "question-answer",
        "mbpp": "mbpp", "self-instruct": "self-instruct", "sharegpt": "sharegpt",
        "messages": "messages",
    }
    assert report.totals()["skipped"] == 0
    by_source = {}
    for conversation in conversations:
        by_source.setdefault(conversation["source"], []).append(conversation["messages"])

    assert by_source[every_format["alpaca"]][1] == [
        {"role": "user", "content": CODEGEN[1]["instruction"] + "\n\n" + CODEGEN[1]["input"]},
        {"role": "assistant", "content": "1"},
    ]
    assert by_source[every_format["alpaca"]][0][0]["content"] == CODEGEN[0]["instruction"]
    assert by_source[every_format["alpaca-output"]][0][1]["content"] == ROLEPLAY[0]["response"]
    assert by_source[every_format["question-answer"]][0] == [
        {"role": "user", "content": GSM8K[0]["question"]},
        {"role": "assistant", "content": GSM8K[0]["answer"]},
    ]
    mbpp_prompt = by_source[every_format["mbpp"]][0][0]["content"]
    assert mbpp_prompt.startswith(MBPP[0]["text"]) and MBPP[0]["test_list"][2] in mbpp_prompt
    assert by_source[every_format["mbpp"]][0][1]["content"] == MBPP[0]["code"]
    assert by_source[every_format["self-instruct"]][1] == [
        {"role": "user", "content": "Convert the following measurement.\n\n3 ft = _____ in."},
        {"role": "assistant", "content": "3 ft = 36 in."},
    ]
    roles = [m["role"] for m in by_source[every_format["sharegpt"]][0]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in by_source[every_format["messages"]][0]] == roles[1:]


def test_masked_tokens_decode_to_exactly_the_assistant_text(tokenizer, every_format, tmp_path):
    sources = list(every_format.values())
    dataset, report = load_sft_dataset(sources, tokenizer, max_length=None, cache_dir=tmp_path)
    conversations, _ = read_conversations(sources)
    assert len(dataset) == len(conversations) == report.totals()["used"] == 11
    for row, conversation in zip(dataset, conversations, strict=True):
        assert (row["source"], row["row"]) == (conversation["source"], conversation["row"])
        # the dataset row is exactly what the chat template renders
        rendered = tokenizer.apply_chat_template(conversation["messages"], tokenize=False)
        assert tokenizer.decode(row["input_ids"]) == rendered
        decoded = [tokenizer.decode(run) for run in masked_runs(row["input_ids"], row["loss_mask"])]
        answers = [m["content"] for m in conversation["messages"] if m["role"] == "assistant"]
        expected = [answer + END for answer in answers]
        assert decoded == expected
        assert row["length"] == len(row["input_ids"])


def test_multi_turn_masks_only_assistant_turns(tokenizer):
    messages = SHAREGPT_MULTI_TURN[0]["conversations"]
    messages = [{"role": data.ROLES[m["from"]], "content": m["value"]} for m in messages]
    out = tokenize_conversation(messages, tokenizer)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert len(ids) == len(mask) == out["num_tokens"] == out["length"]
    assert mask[0] == 0 and out["assistant_tokens"] == sum(mask)
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    for message in messages:
        assert (message["content"] in unmasked) == (message["role"] != "assistant")
    assert [tokenizer.decode(run) for run in masked_runs(ids, mask)] == [
        GSM8K[0]["answer"] + END, GSM8K[1]["answer"] + END,
    ]


def test_mask_needs_no_knowledge_of_the_template_markers(tokenizer):
    other = copy.deepcopy(tokenizer)
    # A made-up template: plain-text headers, <|endoftext|> closes assistant turns only.
    other.chat_template = (
        "{% for m in messages %}### {{ m['role'] | upper }}:\n{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}\n\n{% endfor %}"
        "{% if add_generation_prompt %}### ASSISTANT:\n{% endif %}"
    )
    messages = MESSAGES[0]["messages"]
    out = tokenize_conversation(messages, other)
    assert [other.decode(run) for run in masked_runs(out["input_ids"], out["loss_mask"])] == [
        messages[1]["content"] + "<|endoftext|>", messages[3]["content"] + "<|endoftext|>",
    ]


def test_a_base_model_s_conversation_is_its_text_continued(tokenizer):
    """A target without a chat template gets the completion template: the rows' ids are the
    plain text's, and the loss covers exactly the answer, as the model continued the prompt."""
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    base.chat_template = completion_template(base)
    prompt, answer = "The capital of France is", " Paris, a city of two million people."
    out = tokenize_conversation([{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": answer}], base)
    assert out["input_ids"] == base(prompt + answer)["input_ids"]
    assert [base.decode(run) for run in masked_runs(out["input_ids"], out["loss_mask"])] == [
        answer]
    # a tokenizer that starts every text with a special token keeps it, written as text
    bos = copy.deepcopy(base)
    bos.chat_template = None
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos.convert_tokens_to_ids(
            "<|im_start|>"))])
    bos.chat_template = completion_template(bos)
    ids = bos.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                  return_dict=False)
    assert ids == bos(prompt)["input_ids"] and ids[0] == bos.convert_tokens_to_ids("<|im_start|>")


def test_a_target_without_a_chat_template_loads_with_the_completion_template(tokenizer,
                                                                            tmp_path):
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    model = tiny_llama(vocab=len(tokenizer))
    model.save_pretrained(tmp_path / "base")
    base.save_pretrained(tmp_path / "base")
    target = load_target(tmp_path / "base")
    assert target.tokenizer.chat_template == completion_template(base)
    prompt = "def add(a, b):"
    assert target.chat_ids(prompt) == target.prompt_ids(prompt, "text") == base(prompt)[
        "input_ids"]


def test_a_template_that_is_not_prefix_stable_is_refused(tokenizer):
    other = copy.deepcopy(tokenizer)
    other.chat_template = (  # the turn count up front changes as the conversation grows
        "{{ messages | length }}{% for m in messages %}\n{{ m['role'] }}: {{ m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}\nassistant: {% endif %}"
    )
    with pytest.raises(RowError, match="not prefix-stable"):
        tokenize_conversation(MESSAGES[0]["messages"], other)


def test_truncation_is_counted_and_reported(tokenizer, tmp_path):
    rows = [
        {"question": "hi", "answer": "hello"},  # fits
        {"question": "Tell me a story.", "answer": ROLEPLAY[0]["instruction"] * 3},  # truncated
        {"question": ROLEPLAY[0]["instruction"] * 3, "answer": "ok"},  # answer beyond the limit
    ]
    path = write(tmp_path, "qa.jsonl", rows)
    max_length = 64
    lengths = [tokenize_conversation(
        [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}],
        tokenizer)["num_tokens"] for r in rows]
    assert lengths[0] <= max_length < lengths[1]

    dataset, report = load_sft_dataset(path, tokenizer, max_length=max_length,
                                       cache_dir=tmp_path / "cache")
    counts = report.sources[path]
    assert counts.truncated == [1]
    assert counts.skipped == {f"no assistant tokens within max_length {max_length}": [2]}
    assert dataset["row"] == [0, 1] and dataset["length"] == [lengths[0], max_length]
    assert all(len(ids) <= max_length for ids in dataset["input_ids"])
    assert counts.tokens == lengths[0] + max_length
    summary = report.summary()
    assert f"truncated 1 rows of {path} to max_length 64 (rows 1)" in summary
    assert "1 with no assistant tokens within max_length 64 (rows 2)" in summary


def test_unusable_rows_are_reported_with_row_numbers(tokenizer, tmp_path):
    def turns(*pairs):
        return {"conversations": [{"from": who, "value": text} for who, text in pairs]}

    rows = [
        turns(("human", "hi"), ("gpt", "hello")),  # 0: usable
        turns(("human", "a prompt and nothing else")),  # 1
        turns(("human", "hi"), ("bot", "beep")),  # 2
        turns(("human", "   "), ("gpt", "hello")),  # 3
        {"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "5"}]},  # 4
        ["not", "an", "object"],  # 5
        {"id": "no conversations"},  # 6
        turns(("gpt", "I speak first"), ("human", "hi")),  # 7
        turns(("human", "hi"), ("bot", "boop")),  # 8
        turns(("human", "another prompt")),  # 9
    ]
    path = write(tmp_path, "mixed.json", rows)
    _, report = read_conversations(path)
    expected = {
        "unknown role 'bot'": [2, 8],
        "empty content": [3],
        "wrong type: 'value' is int, expected str": [4],
        "wrong type: row is list, expected an object": [5],
        "missing key 'conversations'": [6],
        "an assistant turn before any user turn": [7],
    }
    assert report.sources[path].skipped == expected

    dataset, report = load_sft_dataset(path, tokenizer, cache_dir=tmp_path / "cache")
    counts = report.sources[path]
    assert counts.skipped == {**expected, "no assistant turn": [1, 9]}
    assert (counts.rows, counts.used, counts.num_skipped) == (10, 1, 9)
    assert dataset["row"] == [0]
    summary = report.summary()
    assert f"skipped 9 rows of {path}: " in summary
    assert "2 with unknown role 'bot' (rows 2, 8)" in summary
    assert "2 with no assistant turn (rows 1, 9)" in summary
    assert report.totals() == {"rows": 10, "used": 1, "skipped": 9, "truncated": 0,
                               "tokens": counts.tokens, "assistant_tokens": counts.assistant_tokens}

    prompts, prompt_report = load_prompts(path)  # rows without answers are prompts
    assert [p[-1][-1]["content"] for p in prompts] == ["hi", "a prompt and nothing else",
                                                       "another prompt"]
    assert prompt_report.sources[path].skipped == expected


def test_hub_dataset_ids_go_through_load_dataset(tokenizer, tmp_path, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_list(MESSAGES)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dataset, report = load_sft_dataset(["org/chats", "org/chats:main:test"], tokenizer,
                                       cache_dir=tmp_path)
    assert calls[:2] == [("org/chats", None, "train"), ("org/chats", "main", "test")]
    assert report.sources["org/chats"].format == "messages" and len(dataset) == 2
    with pytest.raises(ValueError, match="org/name:config:split"):
        read_conversations("org/chats:a:b:c")


def test_bad_sources_are_clear_errors(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        read_conversations(str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(ValueError, match="is a directory"):
        read_conversations(str(tmp_path))
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text(json.dumps(GSM8K[0]) + "\n{\"question\": oops}\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2 is not valid JSON"):
        read_conversations(str(bad_line))
    bad_array = tmp_path / "bad.json"
    bad_array.write_text("[\n" + json.dumps(GSM8K[0]) + ",\n{oops}\n]")
    with pytest.raises(ValueError, match=r"bad.json: is not valid JSON at line 3"):
        read_conversations(str(bad_array))
    unknown = write(tmp_path, "unknown.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match=r"keys \['completion', 'prompt'\].*accepted formats: "
                                         r"messages .*sharegpt .*alpaca"):
        read_conversations(unknown)
    with pytest.raises(ValueError, match="no rows"):
        read_conversations(write(tmp_path, "empty.json", []))
    qa = write(tmp_path, "qa.jsonl", GSM8K)
    with pytest.raises(ValueError, match="more than once"):
        read_conversations([qa, qa])
    no_template = copy.deepcopy(tokenizer)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        load_sft_dataset(qa, no_template, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="no usable conversations"):
        load_sft_dataset(write(tmp_path, "prompts.json", SHAREGPT_FIRST_TURNS), tokenizer,
                         cache_dir=tmp_path)


def test_second_load_comes_from_the_cache(tokenizer, tmp_path, monkeypatch):
    source = write(tmp_path, "gsm8k.jsonl", GSM8K)
    cache = tmp_path / "cache"
    first, report = load_sft_dataset(source, tokenizer, max_length=128, cache_dir=cache)
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]  # and its lock file
    assert (entry / "report.json").is_file() and (entry / "dataset").is_dir()

    def must_not_tokenise(*args, **kwargs):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(data, "tokenize_conversation", must_not_tokenise)
    again, cached_report = load_sft_dataset(source, tokenizer, max_length=128, cache_dir=cache)
    assert again["input_ids"] == first["input_ids"] and again["loss_mask"] == first["loss_mask"]
    assert cached_report == report
    # a different max_length or changed data make a new cache entry
    with pytest.raises(AssertionError, match="tokenised again"):
        load_sft_dataset(source, tokenizer, max_length=64, cache_dir=cache)
    write(tmp_path, "gsm8k.jsonl", GSM8K[:1])
    with pytest.raises(AssertionError, match="tokenised again"):
        load_sft_dataset(source, tokenizer, max_length=128, cache_dir=cache)


def test_collate_pads_right_and_masks_labels():
    rows = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
            {"input_ids": [9, 10], "loss_mask": [0, 1]}]
    batch = collate_causal_lm(rows, pad_token_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 8], [-100, 10, -100, -100]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_load_prompts_keeps_every_user_turn_and_drops_the_answers(every_format, tmp_path):
    first_turns = write(tmp_path, "first_turns.json", SHAREGPT_FIRST_TURNS)
    prompts, report = load_prompts([every_format["sharegpt"], every_format["alpaca"], first_turns])
    assert prompts[0] == [  # system + user, then the second user turn; the answers are gone
        [{"role": "system", "content": "You answer in one line."},
         {"role": "user", "content": GSM8K[0]["question"]}],
        [{"role": "user", "content": GSM8K[1]["question"]}],
    ]
    assert prompts[1] == [[{"role": "user", "content": CODEGEN[0]["instruction"]}]]
    assert prompts[3:] == [[[{"role": "user", "content": r["conversations"][0]["value"]}]]
                           for r in SHAREGPT_FIRST_TURNS]
    assert report.totals()["used"] == 5 and report.totals()["skipped"] == 0


def test_user_turns_split_at_answers():
    u = [{"role": "user", "content": f"u{i}"} for i in range(3)]
    a = {"role": "assistant", "content": "a"}
    s = {"role": "system", "content": "s"}
    assert user_turns([s, u[0], a, u[1], a]) == [[s, u[0]], [u[1]]]
    assert user_turns([u[0], u[1], a, a, u[2]]) == [[u[0], u[1]], [u[2]]]  # two asks, one answer
    assert user_turns([s, a, u[0], a, s]) == [[s, u[0]]]  # nothing to answer without a user
    assert user_turns([a]) == []


def test_inspect_command_line(tokenizer, tmp_path, capsys):
    qa = write(tmp_path, "gsm8k.jsonl", GSM8K)
    regeneration.main(["inspect", "--target", "smollm2-135m", "--data", qa, "--cache-dir",
               str(tmp_path / "cache"), "--num-proc", "1"])
    out = capsys.readouterr().out
    assert f"{qa} (question-answer): 2 rows, 2 used" in out and "2 sequences, longest" in out


def test_tokenising_in_worker_processes_gives_the_same_rows(tokenizer, every_format, tmp_path):
    sources = [every_format["sharegpt"], every_format["messages"], every_format["mbpp"],
               every_format["alpaca"]]
    one, report_one = load_sft_dataset(sources, tokenizer, cache_dir=tmp_path / "one", num_proc=1)
    two, report_two = load_sft_dataset(sources, tokenizer, cache_dir=tmp_path / "two", num_proc=2)
    assert one.to_list() == two.to_list() and report_one == report_two


def test_concurrent_loaders_tokenise_once(tokenizer, every_format, tmp_path, monkeypatch):
    """Loaders that ask at the same time (the ranks of a run): one tokenises, the others wait on
    the cache's file lock (separate opens conflict as separate processes do) and read its copy."""
    sources = [every_format["sharegpt"], every_format["messages"]]
    calls = []
    real = data._tokenize_into

    def counted(*args, **kwargs):
        calls.append(1)
        time.sleep(0.5)  # the others arrive while it works
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "_tokenize_into", counted)
    with ThreadPoolExecutor(3) as pool:
        loaded = list(pool.map(lambda _: load_sft_dataset(sources, tokenizer, num_proc=1,
                                                          cache_dir=tmp_path / "cache"),
                               range(3)))
    assert len(calls) == 1
    assert all(ds.to_list() == loaded[0][0].to_list() for ds, _ in loaded)


SHARED_TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "train"


@pytest.mark.skipif(not SHARED_TRAIN.is_dir(), reason="../shared/data/train is not checked out")
def test_every_shared_training_file_reads_without_skips():
    rows = {"gpteacher_codegen_instruct.json": ("alpaca", 4535),
            "gpteacher_roleplay_instruct.json": ("alpaca", 1923),
            "gsm8k_train.jsonl": ("question-answer", 7473),
            "mbpp_train.jsonl": ("mbpp", 374),
            "self_instruct_seed_tasks_175.jsonl": ("self-instruct", 175),
            "sharegpt_first_turns.json": ("sharegpt", 2867)}
    prompts, report = load_prompts([str(SHARED_TRAIN / name) for name in rows])
    found = {Path(s.name).name: (s.format, s.rows) for s in report.sources.values()}
    assert found == rows
    assert report.totals()["skipped"] == 0 and len(prompts) == sum(n for _, n in rows.values())


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028 raw; it must not end a JSONL line."""
    path = tmp_path / "odd.jsonl"
    row = {"messages": [{"role": "user", "content": "a\u2028b\x85c"},
                        {"role": "assistant", "content": "d\u2029e"}]}
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    conversations, report = read_conversations([str(path)])
    assert [m["content"] for m in conversations[0]["messages"]] == ["a\u2028b\x85c", "d\u2029e"]


def test_a_data_file_with_a_non_utf8_byte_is_named(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"question": "caf\xe9?", "answer": "yes"}\n')
    with pytest.raises(FileFormatError, match=r"latin1.jsonl: is not UTF-8 text \(byte 17, "
                                              r"line 1, is 0xe9\); save it as UTF-8"):
        read_conversations([str(bad)])
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "b"}\n{"question": \n')
    with pytest.raises(FileFormatError, match=r"broken.jsonl: line 2 is not valid JSON"):
        read_conversations([str(broken)])


def test_gzip_compressed_data_files_read_as_their_contents(every_format, tmp_path):
    plain = [every_format["messages"], every_format["alpaca"]]
    packed = []
    for path in plain:
        target = tmp_path / (Path(path).name + ".gz")
        target.write_bytes(gzip.compress(Path(path).read_bytes()))
        packed.append(str(target))
    unpacked, _ = read_conversations(plain)
    read, report = read_conversations(packed)
    assert [c["messages"] for c in read] == [c["messages"] for c in unpacked]
    assert report.totals() == read_conversations(plain)[1].totals()

    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(Path(packed[0]).read_bytes()[:-12])
    with pytest.raises(FileFormatError, match=r"cut.jsonl.gz: is not a whole gzip file"):
        read_conversations([str(cut)])
