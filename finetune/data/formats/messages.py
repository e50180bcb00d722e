"""`messages`: {"messages": [{"role", "content", "tool_calls"?, "reasoning_content"?}, ...], "tools"?}, the
OpenAI chat layout, rendered with the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from finetune.data.errors import DataError
from finetune.data.formats.base import Format, did_you_mean, need_turns, record_tools, text_only

ROLES = ("system", "user", "assistant", "tool")
# Other data sets' names for the roles (ShareGPT's human/gpt, Gemma's model), offered as the fix.
ROLE_SYNONYMS = {"human": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant", "ai": "assistant"}


def check_role(role: Any, where: str) -> None:
    """`where` names the message, e.g. "data.jsonl:3: messages[0]"."""
    if role not in ROLES:
        hint = (f" (did you mean '{ROLE_SYNONYMS[role]}'? '{role}' is another data set layout's name for it)"
                if role in ROLE_SYNONYMS else did_you_mean(role, ROLES))
        raise DataError(f"{where}.role is {role!r}; expected one of {', '.join(ROLES)}{hint}")


def check_turn(m: dict, j: int, where: str) -> Any:
    """messages[j]'s role, and its tool calls (returned) made by an assistant turn only."""
    role = m.get("role")
    check_role(role, f"{where}: messages[{j}]")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise DataError(f"{where}: messages[{j}] has tool_calls but its role is {role!r}; only an assistant turn calls tools")
        validate_tool_calls(calls, f"{where}: messages[{j}].tool_calls")
    return calls


def validate_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{where} must be a non-empty list of {{\"type\": \"function\", \"function\": {{name, arguments}}}}")
    for k, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DataError(f"{where}[{k}] must name its function: {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}")
        if not isinstance(fn.get("arguments"), (str, dict)):
            raise DataError(f"{where}[{k}].arguments must be a JSON object or a JSON string, got {type(fn.get('arguments')).__name__}")


class Messages(Format):
    name = "messages"
    keys = "'messages'"
    chat = True
    with_images = "vision"

    def detects(self, record: dict) -> bool:
        return "messages" in record

    def validate(self, record: dict, where: str) -> None:
        msgs = need_turns(record, "messages", "messages", where, ("role", "content"))
        # This format reads records for a text-only model (a vision-language model reads them as `vision`).
        images = record.get("images") or ([record["image"]] if record.get("image") is not None else [])
        parts = sum(isinstance(p, dict) and p.get("type") == "image" for m in msgs if isinstance(m, dict)
                    and isinstance(m.get("content"), list) for p in m["content"])
        if images or parts:
            raise text_only(where, max(len(images) if isinstance(images, list) else 1, parts))
        for j, m in enumerate(msgs):
            calls = check_turn(m, j, where)
            content = m.get("content")
            # An assistant turn that only calls tools may have no content (OpenAI writes null).
            if not isinstance(content, str) and not (content is None and calls):
                raise DataError(f"{where}: messages[{j}].content must be a string, got {type(content).__name__}")
            reasoning = m.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise DataError(f"{where}: messages[{j}].reasoning_content must be a string, got {type(reasoning).__name__}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant message; nothing to train on")
        record_tools(record, where)

    def conversation(self, record: dict, where: str) -> tuple[list[dict], list[dict] | None]:
        """Keys holding null are left out (Arrow and Parquet give every message every key, null where absent, and
        templates test `is defined`); a null content becomes ''."""
        out = []
        for m in record["messages"]:
            m = {k: v for k, v in m.items() if v is not None}
            m.setdefault("content", "")
            out.append(m)
        return out, record_tools(record, where)
