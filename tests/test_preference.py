"""finetune.data.preference: pairs token by token, the forms, truncation, bad pairs, the cached pipeline, collator.

Expected ids are written out as text segments (prompt as rendered at inference, then the completion) encoded on
their own; the completion's labels are also held to the SFT masks of prompt + completion (prepare.tokenize_record).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from finetune.config import DataConfig, ModelConfig
from finetune.data import prepare as P
from finetune.data import preference as PR
from finetune.data.prepare import IGNORE_INDEX, DataError
from finetune.models.load import load_tokenizer

X = IGNORE_INDEX
CHATML_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
STRINGS = {"prompt": "copy: red cat", "chosen": "red cat", "rejected": "cat red"}
CONVERSATIONAL = {"prompt": [{"role": "user", "content": "copy: red cat"}],
                  "chosen": [{"role": "assistant", "content": "red cat"}],
                  "rejected": {"role": "assistant", "content": "cat red"}}
FULL = {"prompt": "copy: red cat",  # UltraFeedback-binarized: the prompt string repeats the first user turn
        "chosen": [{"role": "user", "content": "copy: red cat"}, {"role": "assistant", "content": "red cat"}],
        "rejected": [{"role": "user", "content": "copy: red cat"}, {"role": "assistant", "content": "cat red"}]}


def tok(folder):
    return load_tokenizer(ModelConfig(model_name_or_path=str(folder)))


def enc(t, text: str) -> list[int]:
    return t(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("record", [STRINGS, CONVERSATIONAL, FULL], ids=["strings", "conversational", "full"])
def test_chatml_pair_exact(tiny_chatml, record):
    t = tok(tiny_chatml)
    prompt, c, cl, r, rl = PR.tokenize_pair(t, record, "x.jsonl:1")
    expected_prompt = enc(t, CHATML_SYSTEM + "<|im_start|>user\ncopy: red cat<|im_end|>\n<|im_start|>assistant\n")
    assert prompt == expected_prompt and len(prompt) == 63
    assert prompt[-3:] == [1, 313, 201]  # <|im_start|> assistant \n
    # The answer and <|im_end|> are scored; the newline the template puts after it is not.
    assert c == enc(t, "red cat") + [t.convert_tokens_to_ids("<|im_end|>")] + enc(t, "\n") == [459, 381, 2, 201]
    assert cl == [459, 381, 2, X]
    assert r == [456, 389, 2, 201] and rl == [456, 389, 2, X]


def test_llama3_and_plain_pairs_exact(tiny_llama3, tiny_plain):
    t = tok(tiny_llama3)
    prompt, c, cl, r, rl = PR.tokenize_pair(t, CONVERSATIONAL, "x.jsonl:1")
    assert prompt == [t.bos_token_id] + enc(t, "<|start_header_id|>user<|end_header_id|>\n\ncopy: red cat<|eot_id|>"
                                                 "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert prompt == [0, 2, 313, 3, 203, 203, 441, 30, 391, 383, 4, 2, 315, 3, 203, 203]
    assert (c, cl, r, rl) == ([461, 383, 4], [461, 383, 4], [458, 391, 4], [458, 391, 4])
    # No chat template: plain text, BOS before the prompt, EOS after each completion (as alpaca records).
    t = tok(tiny_plain)
    assert PR.tokenize_pair(t, STRINGS, "x.jsonl:1") == (
        [0, 439, 28, 389, 381], [459, 381, 1], [459, 381, 1], [456, 389, 1], [456, 389, 1])
    with pytest.raises(DataError, match="x.jsonl:1: 'preference' records are rendered with the tokenizer's chat"):
        PR.tokenize_pair(t, CONVERSATIONAL, "x.jsonl:1")


def test_completion_masks_are_the_sft_masks(tiny_chatml, tiny_llama3, qwen3_dir):
    """prompt + chosen is the SFT example of the conversation prompt + chosen (its last turn, for Qwen3)."""
    record = {"prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add"},
                         {"role": "user", "content": "3+3?"}],
              "chosen": [{"role": "assistant", "content": "6", "reasoning_content": "add them"}], "rejected": "7"}
    for folder in (tiny_chatml, tiny_llama3, qwen3_dir):
        t = tok(folder)
        prompt, c, cl, r, rl = PR.tokenize_pair(t, record, "x.jsonl:1")
        for side, labels in ((c, cl), (r, rl)):
            answer = record["chosen"] if side is c else [{"role": "assistant", "content": "7"}]
            examples = P.tokenize_examples(t, {"messages": record["prompt"] + answer}, "messages", True, "x")
            ids, sft = examples[-1]
            assert ids == prompt + side
            # SFT also trains the earlier turn "4" where one example holds the conversation; the pair scores its
            # completion only.
            assert sft[len(prompt):] == labels
    t = tok(qwen3_dir)
    prompt, c, cl, r, rl = PR.tokenize_pair(t, record, "x.jsonl:1")
    # Qwen3 drops the earlier turn's reasoning in the prompt and renders the empty think block of "7".
    assert t.decode(prompt).endswith("assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n")
    assert c == [151667, 198, 718, 1105, 198, 151668, 271, 21, 151645, 198]
    assert cl == [151667, 198, 718, 1105, 198, 151668, 271, 21, 151645, X]
    assert r == [151667, 271, 151668, 271, 22, 151645, 198] and rl == r[:-1] + [X]


def test_multi_message_completion(tiny_chatml):
    """A completion that calls a tool and answers after its result: the tool turn is context, not scored."""
    t = tok(tiny_chatml)
    record = {"prompt": [{"role": "user", "content": "hi"}],
              "chosen": [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"},
                         {"role": "assistant", "content": "c"}],
              "rejected": [{"role": "assistant", "content": "d"}]}
    prompt, c, cl, r, rl = PR.tokenize_pair(t, record, "x.jsonl:1")
    text = "a<|im_end|>\n<|im_start|>tool\nb<|im_end|>\n<|im_start|>assistant\nc<|im_end|>\n"
    assert c == enc(t, text)
    assert t.decode([x for x in cl if x != X]) == "a<|im_end|>c<|im_end|>"


@pytest.mark.parametrize("record, message", [
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "x.jsonl:3: 'chosen' and 'rejected' are identical"),
    ({"prompt": [{"role": "user", "content": "p"}], "chosen": {"role": "assistant", "content": "a"},
      "rejected": [{"role": "assistant", "content": "a"}]}, "x.jsonl:3: 'chosen' and 'rejected' are identical"),
    ({"prompt": "p", "chosen": "a", "rejected": "  "}, "x.jsonl:3: field 'rejected' is empty: an empty completion"),
    ({"prompt": "p", "chosen": [], "rejected": "b"}, "x.jsonl:3: field 'chosen' is empty: an empty completion"),
    ({"prompt": "p", "chosen": {"role": "assistant", "content": ""}, "rejected": "b"},
     "x.jsonl:3: 'chosen' has an empty completion"),
    ({"prompt": "p", "chosen": "a"}, r"x.jsonl:3: missing field 'rejected' \(format preference"),
    ({"chosen": "a", "rejected": "b"}, "x.jsonl:3: missing field 'prompt'"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "x.jsonl:3: field 'prompt' is empty"),
    ({"messages": [{"role": "user", "content": "p"}]}, r"missing field 'chosen' .*an SFT record"),
    ({"chosen": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]},
     "x.jsonl:3: 'chosen' and 'rejected' are whole conversations, so they must share"),
    ({"prompt": "p", "chosen": {"role": "asistant", "content": "a"}, "rejected": "b"}, "did you mean 'assistant'"),
])
def test_bad_pairs(tiny_chatml, record, message):
    with pytest.raises(DataError, match=message):
        PR.tokenize_pair(tok(tiny_chatml), record, "x.jsonl:3")


def test_truncation_keeps_prompt_end_and_completion_start():
    prompt, sides = list(range(10)), [([100, 101, 102, 103], [100, 101, 102, X]), ([200, 201], [200, 201])]
    # Fits: nothing cut.
    assert PR.truncate_pair(prompt, sides, 14)[2] == PR.Truncation(0, 0)
    # The prompt loses its start first.
    p, out, cut = PR.truncate_pair(prompt, sides, 12)
    assert p == list(range(2, 10)) and out == sides and cut == PR.Truncation(2, 0)
    # A prompt longer than half: it keeps max_len // 2 of its end, the completions lose their ends.
    p, out, cut = PR.truncate_pair(prompt, sides, 8)
    assert p == [6, 7, 8, 9] and out == [([100, 101, 102, 103], [100, 101, 102, X]), ([200, 201], [200, 201])]
    p, out, cut = PR.truncate_pair(prompt, sides, 6)
    assert p == [7, 8, 9] and out == [([100, 101, 102], [100, 101, 102]), ([200, 201], [200, 201])]
    assert cut == PR.Truncation(7, 1)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def data_cfg(path, cache_dir, **kw):
    return DataConfig(dataset=str(path), dataset_cache_dir=str(cache_dir), dataset_num_proc=1, **kw)


def test_pipeline_jsonl_parquet_and_saved(tiny_chatml, tmp_path, cache_dir):
    import datasets

    t = tok(tiny_chatml)
    records = [STRINGS, CONVERSATIONAL, FULL, {"prompt": "copy: blue dog " * 8, "chosen": "blue dog", "rejected": "dog"}]
    path = _write_jsonl(tmp_path / "pairs.jsonl", records)
    ds, stats, key = PR.prepare_pairs(data_cfg(path, cache_dir, max_seq_length=80), t, log=lambda *a: None)
    assert key.startswith("pairs1-") and len(ds) == 4
    assert ds[0] == ds[1] == ds[2]  # the three forms of one pair give the same tokens
    assert ds[0]["chosen_labels"] == [459, 381, 2, X] and len(ds[0]["prompt_ids"]) == 63
    # The long prompt (99 tokens, completions of 4 and 3) keeps its last 80 - 4 = 76 tokens, ending with the
    # generation prompt.
    assert len(ds[3]["prompt_ids"]) == 76 and ds[3]["prompt_ids"][-3:] == [1, 313, 201]
    assert ds[3]["chosen_labels"] == [448, 400, 2, X] and ds[3]["rejected_labels"] == [464, 2, X]
    assert (stats.records, stats.pairs, stats.truncated, stats.prompt_cut, stats.completion_cut) == (4, 4, 1, 1, 0)
    assert stats.chosen_tokens == 3 * 3 + 3 and stats.rejected_tokens == 3 * 3 + 2
    assert stats.tokens == 3 * (2 * 63 + 8) + 2 * 76 + 7
    assert "1 longer than max_seq_length=80 truncated (1 prompts lost their start" in stats.summary()
    # Cached: a second call reads the same rows; a different max_seq_length is another entry.
    again, _, key2 = PR.prepare_pairs(data_cfg(path, cache_dir, max_seq_length=80), t, log=lambda *a: None)
    assert key2 == key and again[3] == ds[3]
    # Parquet (Arrow fills absent message keys with null) and a save_to_disk folder give the same pairs.
    rows = [{"prompt": [{"role": "user", "content": "copy: red cat", "tool_calls": None}],
             "chosen": [{"role": "assistant", "content": "red cat", "tool_calls": None}],
             "rejected": [{"role": "assistant", "content": "cat red", "tool_calls": None}]}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pairs.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "pairs.csv").write_text("prompt,chosen,rejected\ncopy: red cat,red cat,cat red\n")  # strings only
    for name in ("pairs.parquet", "saved", "pairs.csv"):
        got, s, _ = PR.prepare_pairs(data_cfg(tmp_path / name, cache_dir, max_seq_length=80), t, log=lambda *a: None)
        assert got[0] == ds[0] and s.pairs == 1


def test_pipeline_bad_pair_names_file_and_line(tiny_chatml, tmp_path, cache_dir):
    path = _write_jsonl(tmp_path / "bad.jsonl", [STRINGS, STRINGS, {"prompt": "p", "chosen": "x", "rejected": "x"}])
    with pytest.raises(DataError, match=f"{path}:3: 'chosen' and 'rejected' are identical"):
        PR.prepare_pairs(data_cfg(path, cache_dir), tok(tiny_chatml), log=lambda *a: None)


def test_drop_long_and_no_pairs_left(tiny_chatml, tmp_path, cache_dir):
    path = _write_jsonl(tmp_path / "p.jsonl", [STRINGS, {"prompt": "copy: blue dog " * 8, "chosen": "b", "rejected": "c"}])
    ds, stats, _ = PR.prepare_pairs(data_cfg(path, cache_dir, max_seq_length=70, drop_long_sequences=True),
                                    tok(tiny_chatml), log=lambda *a: None)
    assert len(ds) == 1 and (stats.dropped, stats.truncated) == (1, 1)


def test_collator_two_rows_per_pair():
    features = [{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "chosen_labels": [3, X], "rejected_ids": [5],
                 "rejected_labels": [5]},
                {"prompt_ids": [6], "chosen_ids": [7], "chosen_labels": [7], "rejected_ids": [8, 9, 10],
                 "rejected_labels": [8, 9, 10], "pair_index": 7}]
    features[0]["pair_index"] = 3
    batch = PR.PairCollator(pad_token_id=0)(features)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [6, 7, 0, 0], [1, 2, 5, 0], [6, 8, 9, 10]]
    assert batch["labels"].tolist() == [[X, X, 3, X], [X, 7, X, X], [X, X, 5, X], [X, 8, 9, 10]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["pair_index"].tolist() == [3, 7]
