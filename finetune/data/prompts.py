"""Prompts for the methods that generate while they train (GRPO, RLOO): the prompt part of a record of any SFT format.

A record's conversation (messages, sharegpt, alpaca through the chat template) loses its last assistant turn(s); what
is left is rendered as the model sees it at inference (with the generation prompt) and tokenized. Without a chat
template an alpaca record's prompt is the Alpaca prompt and a text record is refused (it has no prompt part). The
answer the record gives (the last assistant turn, alpaca's output) is the column `reference`; every other top-level
key of the record is kept as a column too, and both go to the reward functions (finetune.methods.rewards).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from finetune.data import formats
from finetune.data import prepare as P
from finetune.data.formats import shapes
from finetune.data.errors import DataError
from finetune.data.formats.alpaca import ALPACA_PROMPT, ALPACA_PROMPT_INPUT
from finetune.data.formats.base import record_tools
from finetune.data.formats.vision import refuse_images

# The record keys that make up the conversation, not columns of their own (the format's fields).
FORMAT_KEYS = {"messages", "conversations", "tools", "instruction", "input", "output", "text"}


@dataclass
class PromptStats:
    records: int = 0
    kept: int = 0
    dropped_long: int = 0
    longest: int = 0
    tokens: int = 0  # prompt tokens, all prompts

    @property
    def examples(self) -> int:  # what describe_run counts: one example per prompt
        return self.kept

    def summary(self) -> str:
        return (f"data: {self.kept} prompts from {self.records} records (longest {self.longest} tokens"
                f"{f'; {self.dropped_long} longer than --max_seq_length dropped' if self.dropped_long else ''})")


def prompt_of(tokenizer, record: dict, fmt: str, where: str, renderer=None) -> tuple[str, str | None]:
    """(the prompt as the model gets it, the record's own answer or None)."""
    f = formats.get(fmt)
    refuse_images(record, where, "generating methods (GRPO, RLOO)")
    f.validate(record, where)
    if not f.prompted:
        raise DataError(f"{where}: a '{fmt}' record has no prompt to generate from; give messages, sharegpt or alpaca "
                        "records (the prompt is the conversation before its last assistant turn)"
                        f"{shapes.hint(record, 'grpo')}")
    if not f.uses_template(tokenizer):  # alpaca without a chat template: the Alpaca prompt, as SFT trains it
        template = ALPACA_PROMPT_INPUT if record.get("input") else ALPACA_PROMPT
        return template.format(**{"input": "", **record}), record.get("output")
    P.require_chat_template(tokenizer, fmt, where)
    messages, tools = f.conversation(record, where)
    n = len(messages)
    while n and messages[n - 1]["role"] == "assistant":
        n -= 1
    if n == 0:
        raise DataError(f"{where}: the conversation has no turn before its assistant turn(s), so no prompt")
    answer = messages[n]["content"] if n < len(messages) and isinstance(messages[n].get("content"), str) else None
    renderer = renderer or P.ChatRenderer(tokenizer)
    return renderer(messages[:n], add_generation_prompt=True, where=where, tools=tools or record_tools(record, where)), answer


def columns_of(record: dict, answer: str | None) -> dict:
    """The record's columns for the reward functions: its non-format keys, and `reference` (its own answer) unless
    the record has a column of that name."""
    out = {k: v for k, v in record.items() if k not in FORMAT_KEYS}
    if answer is not None:
        out.setdefault("reference", answer)
    return out


def prompt_rows(tokenizer, records: list[dict], where: list[str], fmt: str | None, max_len: int) -> tuple[list[dict], PromptStats]:
    """One row per record: {prompt (text), prompt_ids, columns (JSON text), where (file:line)}; a prompt longer than
    `max_len` tokens is dropped (counted). A bad record raises DataError naming its file and line."""
    renderer = P.ChatRenderer(tokenizer) if tokenizer.chat_template else None
    stats, rows = PromptStats(records=len(records)), []
    for record, loc in zip(records, where):
        if not isinstance(record, dict):
            raise DataError(f"{loc}: expected a JSON object")
        kind = fmt or P.detect_format(record, loc)
        text, answer = prompt_of(tokenizer, record, kind, loc, renderer)
        chat = renderer is not None and formats.get(kind).uses_template(tokenizer)
        ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
        if len(ids) > max_len:
            stats.dropped_long += 1
            continue
        stats.longest = max(stats.longest, len(ids))
        stats.tokens += len(ids)
        try:
            columns = json.dumps(columns_of(record, answer))
        except TypeError as e:
            raise DataError(f"{loc}: a column is not JSON ({e})") from None
        rows.append({"prompt": text, "prompt_ids": ids, "columns": columns, "where": loc})  # where: a reward's error
    stats.kept = len(rows)
    if not rows:
        raise DataError(f"{where[0] if where else 'data'}: no prompt is left (every one longer than --max_seq_length)")
    return rows, stats


def prepare_prompts(cfg, tokenizer):
    """(datasets.Dataset of prompts, PromptStats) of --dataset (a DataConfig): a file, a save_to_disk folder or a
    Hub data set, in any SFT format (--dataset_format, else detected per record)."""
    import datasets

    if isinstance(cfg.dataset, list):
        raise DataError("a method that generates takes one --dataset (mixing data sets is not supported yet)")
    hub = P.load_hub(cfg)
    records, where = P.read_hub_records(hub) if hub is not None else P.read_records(cfg.dataset)
    fmt = cfg.dataset_format if cfg.dataset_format not in (None, "", "auto") else None
    rows, stats = prompt_rows(tokenizer, records, where, fmt, cfg.max_seq_length)
    return datasets.Dataset.from_list(rows), stats
