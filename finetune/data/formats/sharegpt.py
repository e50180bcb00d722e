"""`sharegpt`: {"conversations": [{"from", "value"}, ...], "system"?, "tools"?}, rendered with the chat template."""

from __future__ import annotations

from finetune.data.errors import DataError
from finetune.data.formats.base import Format, did_you_mean, need_turns, record_tools

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}


class ShareGPT(Format):
    name = "sharegpt"
    keys = "'conversations' (sharegpt)"
    chat = True

    def detects(self, record: dict) -> bool:
        return "conversations" in record

    def validate(self, record: dict, where: str) -> None:
        turns = need_turns(record, "conversations", "sharegpt", where, ("from", "value"))
        names = ", ".join(SHAREGPT_ROLES)
        for j, t in enumerate(turns):
            speaker = t.get("from")
            if speaker not in SHAREGPT_ROLES:
                raise DataError(f"{where}: conversations[{j}].from is {speaker!r}; expected one of {names}"
                                f"{did_you_mean(speaker, SHAREGPT_ROLES)}")
            if not isinstance(t.get("value"), str):
                raise DataError(f"{where}: conversations[{j}].value must be a string, got {type(t.get('value')).__name__}")
        if not any(t["from"] == "gpt" for t in turns):
            raise DataError(f"{where}: no 'gpt' turn; nothing to train on")
        if record.get("system") is not None and not isinstance(record["system"], str):
            raise DataError(f"{where}: field 'system' must be a string, got {type(record['system']).__name__}")
        record_tools(record, where)

    def conversation(self, record: dict, where: str) -> tuple[list[dict], list[dict] | None]:
        messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        turns = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in record["conversations"]]
        return messages + turns, record_tools(record, where)
