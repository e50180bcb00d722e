"""finetune.data.prepare: loss masks token by token, file formats, truncation, bad input, caching, ranks.

Expected token ids and labels are built independently of finetune/data/prepare.py's span logic: each conversation is
written out by hand as (text, trained?) segments following the chat template, every segment is encoded
on its own with the tokenizer, and the concatenation must equal both the tokenization of the whole text
and what prepare.py returns.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.data import pipeline
from finetune.config import DataConfig
from finetune.data.pipeline import prepare_dataset
from finetune.data.prepare import IGNORE_INDEX, Collator, DataError, tokenize_record
from finetune.models.load import load_tokenizer

CHATML_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# The classic Alpaca prompts, written out here rather than imported from finetune/data/prepare.py.
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)

# Multi-turn conversations: without / with a system message, 2 and 3 assistant turns, a tool turn, a
# conversation that ends with a user turn, contents with inner newlines, leading/trailing spaces (Llama-3
# trims them), digits, punctuation and non-ASCII characters (byte-level pieces).
CONVERSATIONS = {
    "no_system_2_turns": [
        {"role": "user", "content": "copy: red cat"},
        {"role": "assistant", "content": "red cat"},
        {"role": "user", "content": "again, reversed"},
        {"role": "assistant", "content": " cat red "},
    ],
    "system_3_turns": [
        {"role": "system", "content": "You follow word instructions."},
        {"role": "user", "content": "count: one two three"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "list them\none per line"},
        {"role": "assistant", "content": "one\ntwo\nthree"},
        {"role": "tool", "content": "{\"ok\": true}"},
        {"role": "user", "content": "now in French, café ✓"},
        {"role": "assistant", "content": "un deux trois — café ✓!"},
        {"role": "user", "content": "thanks"},
    ],
}
# Opens with an assistant turn (a greeting): nothing before it may be trained, not even the default system
# prompt ChatML injects or the assistant header.
ASSISTANT_FIRST = [
    {"role": "assistant", "content": "hello, what should I count?"},
    {"role": "user", "content": "count: red cat"},
    {"role": "assistant", "content": "2"},
]
ALPACA_RECORDS = {
    "with_input": {"instruction": "reverse the words", "input": "red blue green", "output": "green blue red"},
    "no_input": {"instruction": "count: the quick dog", "output": "3"},
}


# ----------------------------------------------------------------------------------------------
# Helpers and fixtures.


def _tok(folder: Path):
    # The app's own loader (right padding, pad token ensured), as train.py uses it.
    return load_tokenizer(SimpleNamespace(model_name_or_path=str(folder), trust_remote_code=False))


@pytest.fixture(scope="module")
def tok_chatml(tiny_chatml):
    return _tok(tiny_chatml)


@pytest.fixture(scope="module")
def tok_llama3(tiny_llama3):
    return _tok(tiny_llama3)


@pytest.fixture(scope="module")
def tok_plain(tiny_plain):
    return _tok(tiny_plain)


@pytest.fixture
def toks(tok_chatml, tok_llama3, tok_plain):
    return {"chatml": tok_chatml, "llama3": tok_llama3, "plain": tok_plain}


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def tid(tok, token: str) -> int:
    i = tok.convert_tokens_to_ids(token)
    assert isinstance(i, int) and tok.convert_ids_to_tokens(i) == token
    return i


def chatml_segments(messages: list[dict]) -> list[tuple[str, bool]]:
    segs = []
    if messages[0]["role"] != "system":
        segs.append((f"<|im_start|>system\n{CHATML_DEFAULT_SYSTEM}<|im_end|>\n", False))
    for m in messages:
        if m["role"] == "assistant":
            segs += [("<|im_start|>assistant\n", False), (m["content"] + "<|im_end|>", True), ("\n", False)]
        else:
            segs.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False))
    return segs


def llama3_segments(messages: list[dict]) -> list[tuple[str, bool]]:
    segs = [("<|begin_of_text|>", False)]
    for m in messages:
        if m["role"] == "assistant":
            segs += [("<|start_header_id|>assistant<|end_header_id|>\n\n", False), (m["content"].strip() + "<|eot_id|>", True)]
        else:
            segs.append((f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>", False))
    return segs


STYLE = {
    # style: (segments, generation prompt text, end-of-turn token, what the template does to content)
    "chatml": (chatml_segments, "<|im_start|>assistant\n", "<|im_end|>", lambda s: s),
    "llama3": (llama3_segments, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", str.strip),
}


def expected_from_segments(tok, segs) -> tuple[list[int], list[int]]:
    ids, labels = [], []
    for text, trained in segs:
        piece = enc(tok, text)
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    # Segment-wise encoding must equal encoding the whole text (byte-level BPE, each segment starts a
    # pre-token), otherwise this oracle would not be valid.
    assert ids == enc(tok, "".join(t for t, _ in segs))
    return ids, labels


def trained_runs(labels: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, label in enumerate(labels + [IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            runs.append((start, i))
            start = None
    return runs


def find_sub(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    raise AssertionError(f"{sub} not found in {seq}")


def check_chat_masking(tok, style: str, messages: list[dict], ids: list[int], labels: list[int]) -> None:
    segments, gen_prompt, eot, as_rendered = STYLE[style]
    eot_id = tid(tok, eot)
    assert tok.eos_token_id == eot_id
    assert len(ids) == len(labels)

    # The whole example, token by token, equals the hand-written rendering and mask.
    exp_ids, exp_labels = expected_from_segments(tok, segments(messages))
    assert ids == exp_ids
    assert labels == exp_labels

    # (a) trained (position, label) pairs == concatenation of encode(content) + [end-of-turn] per assistant turn.
    assistant = [m for m in messages if m["role"] == "assistant"]
    per_turn = [enc(tok, as_rendered(m["content"])) + [eot_id] for m in assistant]
    trained = [(p, label) for p, label in enumerate(labels) if label != IGNORE_INDEX]
    assert [label for _, label in trained] == [t for turn in per_turn for t in turn]
    assert all(ids[p] == label for p, label in trained)

    # (b) one contiguous run per assistant turn, right after the generation prompt tokens.
    runs = trained_runs(labels)
    assert [e - s for s, e in runs] == [len(t) for t in per_turn]
    gen = enc(tok, gen_prompt)
    for (s, e), turn, m in zip(runs, per_turn, assistant):
        assert ids[s - len(gen) : s] == gen
        assert labels[s:e] == turn
        # Decoding the run gives back the content and the end-of-turn string (a second, text-level check).
        assert tok.decode(ids[s:e]) == as_rendered(m["content"]) + eot
        # (c) the end-of-turn token closing the turn is trained; what follows is not.
        assert ids[e - 1] == eot_id and labels[e - 1] == eot_id
        if e < len(ids):
            assert labels[e] == IGNORE_INDEX
            if style == "chatml":
                assert ids[e] == enc(tok, "\n")[0]  # the newline after <|im_end|>
            else:
                assert ids[e] == tid(tok, "<|start_header_id|>")

    # (d) no system / user / tool token is trained (nor the default system prompt ChatML injects).
    others = [m for m in messages if m["role"] != "assistant"]
    if style == "chatml" and messages[0]["role"] != "system":
        others = [{"role": "system", "content": CHATML_DEFAULT_SYSTEM}] + others
    for m in others:
        if style == "chatml":
            block = enc(tok, f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>")
        else:
            block = enc(tok, f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>")
        at = find_sub(ids, block)
        assert all(label == IGNORE_INDEX for label in labels[at : at + len(block)])
    if style == "llama3":
        assert ids[0] == tok.bos_token_id and labels[0] == IGNORE_INDEX


def cfg_for(path, cache_dir, **kw) -> DataConfig:
    return DataConfig(dataset=str(path), dataset_cache_dir=str(cache_dir), **kw)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def quiet(*_a, **_k):
    pass


# ----------------------------------------------------------------------------------------------
# 1. Masking with chat templates.


@pytest.mark.parametrize("style", ["chatml", "llama3"])
@pytest.mark.parametrize("name", [*CONVERSATIONS, "assistant_first"])
def test_messages_masking_token_by_token(toks, style, name):
    tok, messages = toks[style], {**CONVERSATIONS, "assistant_first": ASSISTANT_FIRST}[name]
    ids, labels = tokenize_record(tok, {"messages": messages}, "messages", completion_only=True, where="x.jsonl:1")
    check_chat_masking(tok, style, messages, ids, labels)


@pytest.mark.parametrize("style", ["chatml", "llama3"])
@pytest.mark.parametrize("name", list(ALPACA_RECORDS))
def test_alpaca_with_chat_template_masking(toks, style, name):
    tok, record = toks[style], ALPACA_RECORDS[name]
    prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    ids, labels = tokenize_record(tok, record, "alpaca", completion_only=True, where="x.jsonl:1")
    check_chat_masking(tok, style, messages, ids, labels)
    if record.get("input"):
        find_sub(ids, enc(tok, record["input"]))  # the input is in the prompt


def test_messages_masking_through_prepare_dataset(tok_chatml, tmp_path, cache_dir):
    """The same masks come out of the full pipeline (file -> cache -> datasets.Dataset)."""
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS.values()])
    ds, stats = prepare_dataset(cfg_for(path, cache_dir), tok_chatml, log=quiet)
    assert len(ds) == stats.examples == len(CONVERSATIONS)
    for row, messages in zip(ds, CONVERSATIONS.values()):
        check_chat_masking(tok_chatml, "chatml", messages, row["input_ids"], row["labels"])
    assert stats.trained_tokens == sum(sum(1 for x in r["labels"][1:] if x != IGNORE_INDEX) for r in ds)
    assert stats.tokens == sum(len(r["input_ids"]) for r in ds)


# ----------------------------------------------------------------------------------------------
# 2-4. Alpaca without a chat template, text, completion_only_loss=False.


@pytest.mark.parametrize("name", list(ALPACA_RECORDS))
def test_alpaca_plain_prompt_masked_output_and_eos_trained(tok_plain, name):
    tok, record = tok_plain, ALPACA_RECORDS[name]
    assert tok.chat_template is None
    template = ALPACA_WITH_INPUT if record.get("input") else ALPACA_NO_INPUT
    prompt = [tok.bos_token_id] + enc(tok, template.format(input=record.get("input"), instruction=record["instruction"]))
    completion = enc(tok, record["output"]) + [tok.eos_token_id]
    ids, labels = tokenize_record(tok, record, "alpaca", completion_only=True, where="x.jsonl:1")
    assert ids == prompt + completion
    assert labels == [IGNORE_INDEX] * len(prompt) + completion
    assert trained_runs(labels) == [(len(prompt), len(ids))]
    assert ids[-1] == labels[-1] == tok.eos_token_id
    assert tok.decode(ids[len(prompt) :], skip_special_tokens=True) == record["output"]
    if record.get("input"):
        assert "### Input:" in tok.decode(ids)


@pytest.mark.parametrize("style", ["plain", "chatml", "llama3"])
def test_text_format_trains_every_token_and_appends_eos(toks, style):
    tok = toks[style]
    text = "copy: red cat => red cat"
    bos = [tok.bos_token_id] if style == "plain" else []  # only the plain tokenizer adds BOS itself
    expected = bos + enc(tok, text) + [tok.eos_token_id]
    for completion_only in (True, False):
        ids, labels = tokenize_record(tok, {"text": text}, "text", completion_only=completion_only)
        assert ids == labels == expected
    # A text that already ends with EOS does not get a second one.
    eos = tok.eos_token
    ids, labels = tokenize_record(tok, {"text": text + eos}, "text", completion_only=True)
    assert ids == labels == expected


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_completion_only_false_trains_every_token_messages(toks, style):
    tok = toks[style]
    for messages in CONVERSATIONS.values():
        exp_ids, _ = expected_from_segments(tok, STYLE[style][0](messages))
        ids, labels = tokenize_record(tok, {"messages": messages}, "messages", completion_only=False)
        assert ids == labels == exp_ids
    for record in ALPACA_RECORDS.values():
        ids_t, _ = tokenize_record(tok, record, "alpaca", completion_only=True)
        ids, labels = tokenize_record(tok, record, "alpaca", completion_only=False)
        assert ids == labels == ids_t


def test_completion_only_false_trains_every_token_alpaca_plain(tok_plain, tmp_path, cache_dir):
    path = write_jsonl(tmp_path / "a.jsonl", list(ALPACA_RECORDS.values()))
    ds, stats = prepare_dataset(cfg_for(path, cache_dir, completion_only_loss=False), tok_plain, log=quiet)
    for row, record in zip(ds, ALPACA_RECORDS.values()):
        ids_t, labels_t = tokenize_record(tok_plain, record, "alpaca", completion_only=True)
        assert row["input_ids"] == row["labels"] == ids_t
        assert any(x == IGNORE_INDEX for x in labels_t)  # the completion-only version did mask something
    assert stats.trained_tokens == stats.tokens - stats.examples  # all but position 0 of each example


CUSTOM_TEMPLATE_NO_EOT = (
    "{% for m in messages %}{{ m['role'] + ':\n' + m['content'] + '\n\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
)


@pytest.mark.parametrize("completion_only", [True, False])
def test_template_without_end_of_turn_token_gets_eos(tok_chatml, completion_only):
    """A template that closes turns with no special token: EOS is appended after the last assistant turn,
    whether or not the loss is completion-only (the model must learn to stop either way)."""
    tok = copy.deepcopy(tok_chatml)
    tok.chat_template = CUSTOM_TEMPLATE_NO_EOT
    messages = CONVERSATIONS["no_system_2_turns"]
    full = "".join(f"{m['role']}:\n{m['content']}\n\n" for m in messages)
    ids, labels = tokenize_record(tok, {"messages": messages}, "messages", completion_only=completion_only)
    assert ids == enc(tok, full) + [tok.eos_token_id]
    if not completion_only:
        assert labels == ids
        return
    a1, a2 = messages[1]["content"], messages[3]["content"]
    expected = enc(tok, a1 + "\n\n") + enc(tok, a2 + "\n\n") + [tok.eos_token_id]
    assert [x for x in labels if x != IGNORE_INDEX] == expected
    assert len(trained_runs(labels)) == 2


# ----------------------------------------------------------------------------------------------
# 5. Padding.


def test_pad_tokens(tok_chatml, tok_llama3, tok_plain):
    # Llama-3 style: no pad, no unk -> pad reuses EOS. ChatML: unk. Plain: unk.
    assert tok_llama3.unk_token_id is None
    assert tok_llama3.pad_token_id == tok_llama3.eos_token_id == tid(tok_llama3, "<|eot_id|>")
    assert tok_chatml.pad_token_id == tok_chatml.unk_token_id == tid(tok_chatml, "<|endoftext|>") != tok_chatml.eos_token_id
    assert tok_plain.pad_token_id == tok_plain.unk_token_id != tok_plain.eos_token_id


@pytest.mark.parametrize("multiple", [None, 8])
def test_collator_keeps_eos_labels_when_pad_is_eos(tok_llama3, multiple):
    tok = tok_llama3
    eos = tok.eos_token_id
    feats = []
    for messages in CONVERSATIONS.values():
        ids, labels = tokenize_record(tok, {"messages": messages}, "messages", completion_only=True)
        feats.append({"input_ids": ids, "labels": labels})
    feats.append({"input_ids": [1, 2, eos], "labels": [IGNORE_INDEX, 2, eos]})  # a short one: lots of padding
    batch = Collator(tok.pad_token_id, pad_to_multiple_of=multiple)(feats)
    longest = max(len(f["input_ids"]) for f in feats)
    length = longest if multiple is None else -(-longest // multiple) * multiple
    assert tuple(batch["input_ids"].shape) == tuple(batch["labels"].shape) == tuple(batch["attention_mask"].shape) == (len(feats), length)
    n_eos_trained = 0
    for i, f in enumerate(feats):
        n = len(f["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == f["input_ids"]
        assert batch["labels"][i, :n].tolist() == f["labels"]
        assert batch["attention_mask"][i, :n].tolist() == [1] * n
        # Padding: pad id (== EOS here), never trained, not attended.
        assert batch["input_ids"][i, n:].tolist() == [eos] * (length - n)
        assert batch["labels"][i, n:].tolist() == [IGNORE_INDEX] * (length - n)
        assert batch["attention_mask"][i, n:].tolist() == [0] * (length - n)
        n_eos_trained += batch["labels"][i].tolist().count(eos)
    # Every assistant turn's EOS is still trained although it equals the pad id.
    assistant_turns = sum(1 for c in CONVERSATIONS.values() for m in c if m["role"] == "assistant")
    assert n_eos_trained == assistant_turns + 1
    assert (batch["input_ids"] == eos).sum().item() > n_eos_trained  # pad positions hold EOS ids too


# ----------------------------------------------------------------------------------------------
# 6. File formats give identical examples.


def _write_all_formats(tmp_path: Path, records: list[dict], kind: str) -> list[Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = [write_jsonl(tmp_path / "d.jsonl", records)]
    p = tmp_path / "d.json"
    p.write_text(json.dumps(records, indent=2, ensure_ascii=False), encoding="utf-8")
    out.append(p)
    p = tmp_path / "d.csv"
    cols = {"messages": ["messages"], "alpaca": ["instruction", "input", "output"], "text": ["text"]}[kind]
    with p.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in records:
            w.writerow({k: (json.dumps(r[k], ensure_ascii=False) if k == "messages" else r.get(k, "")) for k in cols})
    out.append(p)
    # The first record has every column (pyarrow and datasets take the columns from it); the others'
    # missing `input` becomes null.
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(records), p)
    out.append(p)
    p = tmp_path / "saved"
    datasets.Dataset.from_list(records).save_to_disk(str(p))
    out.append(p)
    p = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(p))
    out.append(p)
    return out


FORMAT_CASES = {
    "messages": ("chatml", [{"messages": m} for m in CONVERSATIONS.values()] + [{"messages": [
        {"role": "user", "content": "say \"hi\", then a comma"}, {"role": "assistant", "content": "\"hi\","}]}]),
    "alpaca": ("plain", [ALPACA_RECORDS["with_input"], ALPACA_RECORDS["no_input"],
                         {"instruction": "copy, with a comma", "input": "", "output": "a, b"}]),
    "alpaca_chat": ("llama3", [ALPACA_RECORDS["with_input"], ALPACA_RECORDS["no_input"]]),
    "text": ("plain", [{"text": "one two, three"}, {"text": "line one\nline two \"quoted\""}]),
}


@pytest.mark.parametrize("case", list(FORMAT_CASES))
def test_file_formats_give_identical_examples(toks, tmp_path, cache_dir, case):
    style, records = FORMAT_CASES[case]
    tok = toks[style]
    kind = case.split("_")[0]
    fmt = {"messages": "messages", "alpaca": "alpaca", "text": "text"}[kind]
    expected = [tokenize_record(tok, r, fmt, completion_only=True) for r in records]
    paths = _write_all_formats(tmp_path, records, kind)
    seen_stats = []
    for path in paths:
        ds, stats = prepare_dataset(cfg_for(path, cache_dir), tok, log=quiet)
        got = [(row["input_ids"], row["labels"]) for row in ds]
        assert got == [(list(i), list(l)) for i, l in expected], path.name
        assert stats.format == fmt and stats.records == stats.examples == len(records)
        seen_stats.append({k: v for k, v in vars(stats).items() if k != "path"})
    assert all(s == seen_stats[0] for s in seen_stats)
    # Each file got its own cache entry.
    assert len([p for p in cache_dir.iterdir() if p.is_dir()]) == len(paths)


# ----------------------------------------------------------------------------------------------
# 7. Truncation and dropping.


def test_truncation_and_dropping(tok_chatml, tmp_path, cache_dir):
    tok = tok_chatml
    short = {"messages": [{"role": "user", "content": "copy: red cat"}, {"role": "assistant", "content": "red cat"}]}
    long_answer = {"messages": [{"role": "user", "content": "copy: red"},
                                {"role": "assistant", "content": " ".join(["red blue green"] * 20)}]}
    long_prompt = {"messages": [{"role": "user", "content": " ".join(["the quick dog"] * 30)},
                                {"role": "assistant", "content": "ok"}]}
    records = [short, long_answer, long_prompt]
    full = [tokenize_record(tok, r, "messages", completion_only=True) for r in records]
    max_len = len(full[0][0]) + 4
    first_trained = [min(i for i, x in enumerate(lab) if x != IGNORE_INDEX) for _, lab in full]
    # The setup: short fits; long_answer is cut inside its answer; long_prompt's answer is entirely cut.
    assert len(full[0][0]) <= max_len < len(full[1][0]) and len(full[2][0]) > max_len
    assert 1 <= first_trained[1] < max_len - 1 and first_trained[2] >= max_len

    path = write_jsonl(tmp_path / "long.jsonl", records)
    ds, stats = prepare_dataset(cfg_for(path, cache_dir, max_seq_length=max_len), tok, log=quiet)
    assert (stats.records, stats.truncated, stats.dropped_long, stats.dropped_no_labels, stats.examples) == (3, 2, 0, 1, 2)
    assert [row["input_ids"] for row in ds] == [full[0][0], full[1][0][:max_len]]
    assert [row["labels"] for row in ds] == [full[0][1], full[1][1][:max_len]]
    assert all(len(row["input_ids"]) == len(row["labels"]) <= max_len for row in ds)
    assert ds[1]["labels"][-1] != IGNORE_INDEX  # truncated inside the answer, which stays trained
    assert stats.tokens == len(full[0][0]) + max_len
    assert stats.trained_tokens == sum(sum(1 for x in row["labels"][1:] if x != IGNORE_INDEX) for row in ds)
    assert "2 longer than max_seq_length" in stats.summary() and "1 with no trained tokens" in stats.summary()

    ds, stats = prepare_dataset(cfg_for(path, cache_dir, max_seq_length=max_len, drop_long_sequences=True), tok, log=quiet)
    assert (stats.records, stats.truncated, stats.dropped_long, stats.dropped_no_labels, stats.examples) == (3, 0, 2, 0, 1)
    assert [row["input_ids"] for row in ds] == [full[0][0]]
    assert [row["labels"] for row in ds] == [full[0][1]]
    assert "2 longer than max_seq_length" in stats.summary() and "dropped" in stats.summary()


def test_truncation_plain_alpaca_keeps_bos_and_prompt(tok_plain, tmp_path, cache_dir):
    record = {"instruction": "copy", "output": " ".join(["red cat"] * 30)}
    ids, labels = tokenize_record(tok_plain, record, "alpaca", completion_only=True)
    n_prompt = labels.index(next(x for x in labels if x != IGNORE_INDEX))
    max_len = n_prompt + 5
    path = write_jsonl(tmp_path / "a.jsonl", [record])
    ds, stats = prepare_dataset(cfg_for(path, cache_dir, max_seq_length=max_len), tok_plain, log=quiet)
    assert stats.truncated == 1 and stats.examples == 1
    assert ds[0]["input_ids"] == ids[:max_len] and ds[0]["input_ids"][0] == tok_plain.bos_token_id
    assert ds[0]["labels"] == [IGNORE_INDEX] * n_prompt + ids[n_prompt:max_len]
    assert stats.trained_tokens == 5


# ----------------------------------------------------------------------------------------------
# 8. Bad input: DataError naming the file, the line or row, and what is wrong.

GOOD_MSG = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _jsonl_lines(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


BAD_CASES = {
    # name: (file name, file text, expected message parts; "{p}" is the file path)
    "malformed_json_line_3": ("d.jsonl", _jsonl_lines(json.dumps(GOOD_MSG), "", '{"messages": [}', json.dumps(GOOD_MSG)),
                              ["{p}:3: invalid JSON"]),
    "malformed_json_array_line_3": ("d.json", "[\n" + json.dumps(GOOD_MSG) + ",\n{\"messages\": oops}\n]\n",
                                    ["{p}:3: invalid JSON"]),
    "not_an_object": ("d.jsonl", _jsonl_lines(json.dumps(GOOD_MSG), "[1, 2]"), ["{p}:2: expected a JSON object"]),
    "alpaca_missing_output": ("d.jsonl", _jsonl_lines(json.dumps(ALPACA_RECORDS["no_input"]), json.dumps({"instruction": "x"})),
                              ["{p}:2: missing field 'output'"]),
    "alpaca_output_not_string": ("d.jsonl", _jsonl_lines(json.dumps({"instruction": "x", "output": 3})),
                                 ["{p}:1: field 'output' must be a string, got int"]),
    "content_is_number": ("d.jsonl", _jsonl_lines(json.dumps(GOOD_MSG), json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 42}]})),
        ["{p}:2: messages[1].content must be a string, got int"]),
    "messages_not_a_list": ("d.jsonl", _jsonl_lines(json.dumps(GOOD_MSG), json.dumps({"messages": "hi there"})),
                            ["{p}:2: field 'messages' must be a non-empty list", "got str"]),
    "messages_empty": ("d.jsonl", _jsonl_lines(json.dumps({"messages": []})), ["{p}:1: field 'messages' must be a non-empty list"]),
    "message_not_object": ("d.jsonl", _jsonl_lines(json.dumps({"messages": ["hi"]})), ["{p}:1: messages[0] must be an object"]),
    "unknown_role": ("d.jsonl", _jsonl_lines(json.dumps(GOOD_MSG), json.dumps(GOOD_MSG), json.dumps(
        {"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]})),
        ["{p}:3: messages[0].role is 'bot'", "expected one of system, user, assistant, tool"]),
    "no_assistant": ("d.jsonl", _jsonl_lines(json.dumps({"messages": [{"role": "user", "content": "hi"}]})),
                     ["{p}:1: no assistant message"]),
    "unknown_format": ("d.jsonl", _jsonl_lines(json.dumps({"prompt": "a", "response": "b"})),
                       ["{p}:1: cannot tell the record format", "prompt, response"]),
    "empty_text": ("d.jsonl", _jsonl_lines(json.dumps({"text": "  "})), ["{p}:1: field 'text' is empty"]),
    "empty_jsonl": ("d.jsonl", "", ["{p}: the file holds no records"]),
    "blank_lines_only": ("d.jsonl", "\n\n  \n", ["{p}: the file holds no records"]),
    "empty_json_array": ("d.json", "[]", ["{p}: the file holds no records"]),
    "empty_csv": ("d.csv", "instruction,input,output\n", ["{p}: the file holds no records"]),
    "csv_messages_not_json": ("d.csv", 'messages\n"' + json.dumps(GOOD_MSG["messages"]).replace('"', '""') + '"\nnot json\n',
                              ["{p} row 2: field 'messages' must be a non-empty list", "got str"]),
    "csv_alpaca_missing_column": ("d.csv", "instruction,output\nx,y\n", None),  # valid: input is optional
    "unsupported_extension": ("d.txt", "hello\n", ["{p}: unsupported file type '.txt'"]),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_raises_data_error(tok_chatml, tmp_path, cache_dir, case):
    name, text, parts = BAD_CASES[case]
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    cfg = cfg_for(p, cache_dir)
    if parts is None:
        ds, _ = prepare_dataset(cfg, tok_chatml, log=quiet)
        assert len(ds) == 1
        return
    with pytest.raises(DataError) as e:
        prepare_dataset(cfg, tok_chatml, log=quiet)
    msg = str(e.value)
    for part in parts:
        assert part.format(p=p) in msg
    # Rank 0 leaves the error for the other ranks, and no cache entry.
    errors = list(cache_dir.glob("*.error"))
    assert len(errors) == 1 and errors[0].read_text() == msg
    assert not [d for d in cache_dir.iterdir() if d.is_dir()]


def test_bad_parquet_and_saved_rows_are_located(tok_chatml, tmp_path, cache_dir):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": None}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet row 1: missing field 'output'"):
        prepare_dataset(cfg_for(tmp_path / "d.parquet", cache_dir), tok_chatml, log=quiet)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"saved row 1: missing field 'output'"):
        prepare_dataset(cfg_for(tmp_path / "saved", cache_dir), tok_chatml, log=quiet)
    datasets.DatasetDict({"test": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(DataError, match=r"nosplit: a DatasetDict without a 'train' split \(splits: test\)"):
        prepare_dataset(cfg_for(tmp_path / "nosplit", cache_dir), tok_chatml, log=quiet)
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(DataError, match=r"empty_folder: not a folder written by datasets.save_to_disk"):
        prepare_dataset(cfg_for(tmp_path / "empty_folder", cache_dir), tok_chatml, log=quiet)


def test_byte_order_mark_is_accepted(tok_plain, tmp_path, cache_dir):
    """Excel and some Windows editors start UTF-8 files with a byte order mark."""
    records = [ALPACA_RECORDS["with_input"], ALPACA_RECORDS["no_input"]]
    expected = [tokenize_record(tok_plain, r, "alpaca", completion_only=True) for r in records]
    for path in _write_all_formats(tmp_path, records, "alpaca")[:3]:  # .jsonl, .json, .csv
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
        ds, stats = prepare_dataset(cfg_for(path, cache_dir), tok_plain, log=quiet)
        assert stats.format == "alpaca"
        assert [(r["input_ids"], r["labels"]) for r in ds] == expected, path.name


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.csv"])
def test_not_utf8_is_a_data_error(tok_plain, tmp_path, cache_dir, name):
    p = tmp_path / name
    lines = [b'{"text": "one"}', b'{"text": "two"}', b'{"text": "caf\xe9"}']  # Latin-1 e-acute on line 3
    if name == "d.json":
        lines = [b"[" + lines[0] + b",", lines[1] + b",", lines[2] + b"]"]
    elif name == "d.csv":
        lines = [b"text", b"one", b"caf\xe9"]  # line 3 (the header is line 1)
    p.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=r"d\.\w+:3: not UTF-8 text"):
        prepare_dataset(cfg_for(p, cache_dir), tok_plain, log=quiet)


def test_corrupt_parquet_is_a_data_error(tok_plain, tmp_path, cache_dir):
    p = tmp_path / "d.parquet"
    p.write_text("text\nnot parquet\n")
    with pytest.raises(DataError, match=r"d\.parquet: cannot read as Parquet"):
        prepare_dataset(cfg_for(p, cache_dir), tok_plain, log=quiet)


def test_explicit_format_mismatch(tok_chatml, tmp_path, cache_dir):
    p = write_jsonl(tmp_path / "d.jsonl", [GOOD_MSG])
    with pytest.raises(DataError, match=r"d\.jsonl:1: missing field 'text' \(format text\)"):
        prepare_dataset(cfg_for(p, cache_dir, dataset_format="text"), tok_chatml, log=quiet)


def test_messages_need_a_chat_template(tok_plain, tmp_path, cache_dir):
    p = write_jsonl(tmp_path / "d.jsonl", [GOOD_MSG])
    # Refused once for the data set, before any record is tokenized; tokenize_record names the record.
    with pytest.raises(DataError, match=r"d\.jsonl: 'messages' records are rendered with the tokenizer's chat template, "
                                        r"and this tokenizer has none \(a base model\); pass --chat_template FILE\.jinja"):
        prepare_dataset(cfg_for(p, cache_dir), tok_plain, log=quiet)
    with pytest.raises(DataError, match=r"d\.jsonl:1: 'messages' records are rendered with the tokenizer's chat template"):
        tokenize_record(tok_plain, GOOD_MSG, "messages", True, where="d.jsonl:1")


def test_template_exception_is_a_data_error(tok_chatml, tmp_path, cache_dir):
    """A chat template that rejects a conversation (Llama-2/Mistral style raise_exception) is bad input."""
    tok = copy.deepcopy(tok_chatml)
    tok.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}
    p = write_jsonl(tmp_path / "d.jsonl", [GOOD_MSG, bad])
    with pytest.raises(DataError, match=r"d\.jsonl:2: .*Conversation roles must alternate"):
        prepare_dataset(cfg_for(p, cache_dir), tok, log=quiet)
    assert len(list(cache_dir.glob("*.error"))) == 1


def test_empty_after_filtering(tok_chatml, tmp_path, cache_dir):
    p = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS.values()])
    with pytest.raises(DataError, match=r"d\.jsonl: no examples left after filtering .*2 longer than max_seq_length=8 dropped"):
        prepare_dataset(cfg_for(p, cache_dir, max_seq_length=8, drop_long_sequences=True), tok_chatml, log=quiet)
    with pytest.raises(DataError, match=r"d\.jsonl: no examples left after filtering .*2 with no trained tokens left dropped"):
        prepare_dataset(cfg_for(p, cache_dir, max_seq_length=8), tok_chatml, log=quiet)


# ----------------------------------------------------------------------------------------------
# 9. Caching and ranks.


def _entries(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.iterdir() if p.is_dir())


def _snapshot(folder: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in [folder, *folder.rglob("*")]}


def _rows(ds):
    return [(r["input_ids"], r["labels"]) for r in ds]


def _boom(*_a, **_k):
    raise AssertionError("re-tokenized although the cache should have been used")


def test_cache_is_reused_and_keyed_on_inputs(tok_chatml, tmp_path, cache_dir, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS.values()])
    cfg = cfg_for(path, cache_dir, max_seq_length=512)
    ds1, st1 = prepare_dataset(cfg, tok_chatml, log=quiet)
    [entry] = _entries(cache_dir)
    assert (entry / "stats.json").is_file()
    assert not list(cache_dir.glob("*.tmp*")) and not list(cache_dir.glob("*.error"))
    before = _snapshot(entry)
    time.sleep(0.05)

    with monkeypatch.context() as m:
        m.setattr(pipeline, "tokenize_source", _boom)
        m.setattr(pipeline, "source_dataset", _boom)
        ds2, st2 = prepare_dataset(cfg, tok_chatml, log=quiet)
    assert _rows(ds2) == _rows(ds1) and st2 == st1
    assert _snapshot(entry) == before  # not rewritten
    assert _entries(cache_dir) == [entry]

    # Anything that changes the tokens gets its own entry.
    tok2 = copy.deepcopy(tok_chatml)
    tok2.chat_template = CUSTOM_TEMPLATE_NO_EOT
    changes = [
        (replace(cfg, max_seq_length=400), tok_chatml),
        (replace(cfg, completion_only_loss=False), tok_chatml),
        (replace(cfg, drop_long_sequences=True), tok_chatml),
        (replace(cfg, dataset_format="messages"), tok_chatml),
        (cfg, tok2),
    ]
    for i, (c, t) in enumerate(changes, start=2):
        prepare_dataset(c, t, log=quiet)
        assert len(_entries(cache_dir)) == i
    ds3, st3 = prepare_dataset(replace(cfg, max_seq_length=400), tok_chatml, log=quiet)
    assert st3.max_seq_length == 400 and _rows(ds3) == _rows(ds1)  # nothing is that long
    assert len(_entries(cache_dir)) == len(changes) + 1
    # Editing the data file changes the key too.
    write_jsonl(path, [{"messages": CONVERSATIONS["system_3_turns"]}])
    ds4, st4 = prepare_dataset(cfg, tok_chatml, log=quiet)
    assert st4.examples == 1 and _rows(ds4) == [_rows(ds1)[1]]
    assert len(_entries(cache_dir)) == len(changes) + 2


def _run_in_thread(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e
        box["at"] = time.monotonic()

    t = threading.Thread(target=target, daemon=True)  # daemon: a hang fails the test instead of pytest
    t.start()
    return t, box


def test_rank1_reads_the_cache_rank0_wrote(tok_chatml, tmp_path, cache_dir, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS.values()])
    cfg = cfg_for(path, cache_dir)
    ds0, st0 = prepare_dataset(cfg, tok_chatml, local_rank=0, log=quiet)
    monkeypatch.setattr(pipeline, "tokenize_source", _boom)
    monkeypatch.setattr(pipeline, "source_dataset", _boom)
    ds1, st1 = prepare_dataset(cfg, tok_chatml, local_rank=1, log=quiet)
    assert _rows(ds1) == _rows(ds0) and st1 == st0


def test_rank1_waits_for_rank0(tok_chatml, tmp_path, cache_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS.values()])
    cfg = cfg_for(path, cache_dir)
    cache_dir.mkdir(parents=True)
    # A stale error file from an earlier run (old mtime) must be ignored by the waiting rank.
    key = pipeline._fingerprint(cfg, tok_chatml)
    stale = cache_dir / f"{key}.error"
    stale.write_text("old failure")
    old = time.time() - 3600
    os.utime(stale, (old, old))

    waiter, box = _run_in_thread(lambda: prepare_dataset(cfg, tok_chatml, local_rank=1, log=quiet))
    time.sleep(0.6)
    assert waiter.is_alive() and not box  # still waiting: no cache yet, and the old error does not count
    ds0, st0 = prepare_dataset(cfg, tok_chatml, local_rank=0, log=quiet)
    done = time.monotonic()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and "error" not in box, box.get("error")
    ds1, st1 = box["value"]
    assert _rows(ds1) == _rows(ds0) and st1 == st0
    assert box["at"] - done < 2
    assert not stale.exists()  # rank 0 cleared it


def test_rank1_raises_promptly_on_error_file(tok_chatml, tmp_path, cache_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD_MSG])
    cfg = cfg_for(path, cache_dir)
    cache_dir.mkdir(parents=True)
    key = pipeline._fingerprint(cfg, tok_chatml)
    waiter, box = _run_in_thread(lambda: prepare_dataset(cfg, tok_chatml, local_rank=1, log=quiet))

    written = {}

    def write_error():
        time.sleep(0.5)
        written["at"] = time.monotonic()
        (cache_dir / f"{key}.error").write_text("d.jsonl:7: something is wrong")

    writer = threading.Thread(target=write_error, daemon=True)
    writer.start()
    waiter.join(timeout=10)
    writer.join(timeout=10)
    assert not waiter.is_alive()
    assert isinstance(box.get("error"), DataError) and str(box["error"]) == "d.jsonl:7: something is wrong"
    assert 0 <= box["at"] - written["at"] < 2


def test_rank1_gets_rank0_data_error(tok_chatml, tmp_path, cache_dir):
    bad = {"messages": [{"role": "user", "content": "hi"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD_MSG, bad])
    cfg = cfg_for(path, cache_dir)
    waiter, box = _run_in_thread(lambda: prepare_dataset(cfg, tok_chatml, local_rank=1, log=quiet))
    time.sleep(0.3)
    with pytest.raises(DataError) as e0:
        prepare_dataset(cfg, tok_chatml, local_rank=0, log=quiet)
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert isinstance(box.get("error"), DataError)
    assert str(box["error"]) == str(e0.value) == f"{path}:2: no assistant message; nothing to train on"
