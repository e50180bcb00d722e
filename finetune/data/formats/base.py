"""What a record format is: how it is recognised, checked and turned into a conversation or a training example."""

from __future__ import annotations

import difflib
import json
from typing import Any

from finetune.data.errors import DataError


def did_you_mean(value: Any, valid) -> str:
    close = difflib.get_close_matches(str(value), list(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def need_str(record: dict, key: str, fmt: str, where: str, optional: bool = False) -> None:
    if key not in record or record[key] is None:
        if optional:
            return
        raise DataError(f"{where}: missing field '{key}' (format {fmt})")
    if not isinstance(record[key], str):
        raise DataError(f"{where}: field '{key}' must be a string, got {type(record[key]).__name__}")


def need_turns(record: dict, key: str, fmt: str, where: str, fields: tuple[str, str]) -> list[dict]:
    """A chat format's turns: field `key` present, a non-empty list, each turn an object (with `fields`, which the
    format checks)."""
    turns = record.get(key)
    if turns is None:
        raise DataError(f"{where}: missing field '{key}' (format {fmt})")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: field '{key}' must be a non-empty list of {{{', '.join(fields)}}}, "
                        f"got {type(turns).__name__}")
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: {key}[{j}] must be an object with '{fields[0]}' and '{fields[1]}'")
    return turns


def record_tools(record: dict, where: str) -> list[dict] | None:
    """The record's `tools` (function schemas the template renders into the prompt): a list, or JSON text of one."""
    tools = record.get("tools")
    if tools is None or tools == "":
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field 'tools' is not valid JSON: {e.msg}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: field 'tools' must be a list of function schemas (objects), got {type(tools).__name__}")
    return tools or None


def text_only(where: str, images: int, model: str = "") -> DataError:
    """Images given to a model without an image processor."""
    model = f" ({model})" if model else ""
    return DataError(f"{where}: the record has {images} image{'s' if images != 1 else ''}, and the model{model} is "
                     "text-only: it has no image processor. Use a vision-language model (docs/vision.md lists the "
                     "families) whose folder holds its processor files (processor_config.json or "
                     "preprocessor_config.json), or leave the images out of the data")


class Format:
    """One record format. `where` in every message is the record's file:line (or data set:row)."""

    name: str = ""
    keys: str = ""  # the keys that identify it, as the "cannot tell the format" message lists them
    chat: bool = False  # always rendered with the tokenizer's chat template
    prompted: bool = True  # a record splits into a prompt and its answer (what GRPO generates from)
    images: bool = False  # its records may hold images, rendered by a vision-language model's processor
    # The format that reads this one's records for a vision-language model (messages -> vision), so a data set whose
    # first record has no image still goes through the processor.
    with_images: str | None = None

    def detects(self, record: dict) -> bool:
        raise NotImplementedError

    def validate(self, record: dict, where: str) -> None:
        raise NotImplementedError

    def uses_template(self, tokenizer) -> bool:
        """Whether this tokenizer renders the record through its chat template (conversation) or not (examples)."""
        return self.chat

    def conversation(self, record: dict, where: str) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) as the chat template gets them."""
        raise NotImplementedError(f"format {self.name} is not rendered with a chat template")

    def examples(self, tokenizer, record: dict, completion_only: bool) -> list[tuple[list[int], list[int]]]:
        """(input_ids, labels) without a chat template."""
        raise NotImplementedError(f"format {self.name} is rendered with a chat template")
