"""`vision`: TRL's conversational vision format, {"messages": [...], "images": [...]}: a message's content is a string
or a list of parts, {"type": "image"} and {"type": "text", "text": ...}, and `images` holds one image per image part,
in order (paths relative to the data file, or a data set's image column; `image`, one image, is read as a list of
one). Rendered with the processor of a vision-language model (finetune.data.vision); a record without images is a
plain conversation, so text-only records can sit in the same set."""

from __future__ import annotations

from typing import Any

from finetune.data.errors import DataError
from finetune.data.formats.base import need_turns, record_tools
from finetune.data.formats.messages import Messages, check_turn

PART_TYPES = ("text", "image")


def image_refs(record: dict) -> list:
    """The record's images as given: `images` (a list; null or absent: none) or `image` (one)."""
    images = record.get("images")
    if images is None and record.get("image") is not None:
        return [record["image"]]
    return list(images) if isinstance(images, (list, tuple)) else [] if images is None else images


def image_count(record: dict) -> int:
    """The images a record of any method's format holds: its `images` (or `image`), or image parts in its turns."""
    parts = 0
    for key in ("messages", "prompt", "chosen", "rejected", "completion"):
        turns = record.get(key)
        for m in turns if isinstance(turns, list) else [turns] if isinstance(turns, dict) else []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                parts += sum(isinstance(p, dict) and p.get("type") == "image" for p in content)
    refs = image_refs(record) if isinstance(record.get("images", []), (list, tuple, type(None))) else [record["images"]]
    return max(len(refs), parts)


def refuse_images(record: dict, where: str, what: str, instead: str = "sft") -> None:
    """DataError for a record with images given to a method that does not train on them (SFT and DPO do); `instead`:
    the method that reads such records."""
    n = image_count(record) if isinstance(record, dict) else 0
    if n:
        raise DataError(f"{where}: the record has {n} image{'s' if n != 1 else ''}, and {what} does not train on "
                        f"images yet (SFT and DPO do: docs/vision.md); leave the images out, or train with --method "
                        f"{instead}")


def _parts(content: Any, where: str) -> int:
    """The number of image parts of a list content; DataError naming the part that is not text or image."""
    count = 0
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise DataError(f"{where}[{k}] must be {{\"type\": \"text\", \"text\": ...}} or {{\"type\": \"image\"}}, "
                            f"got {part!r:.80}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise DataError(f"{where}[{k}].text must be a string, got {type(part.get('text')).__name__}")
        count += kind == "image"
    return count


class Vision(Messages):
    name = "vision"
    keys = ""  # its records are `messages` ones (with images): the "cannot tell the format" message lists those
    images = True  # rendered by the model's processor (finetune.data.vision), images and all

    def detects(self, record: dict) -> bool:
        if "messages" not in record:
            return False
        if "images" in record or "image" in record:
            return True
        msgs = record["messages"]
        return isinstance(msgs, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in msgs)

    def validate(self, record: dict, where: str) -> None:
        msgs = need_turns(record, "messages", "vision", where, ("role", "content"))
        parts = 0
        for j, m in enumerate(msgs):
            calls = check_turn(m, j, where)
            content = m.get("content")
            if isinstance(content, list):
                parts += _parts(content, f"{where}: messages[{j}].content")
            elif not isinstance(content, str) and not (content is None and calls):
                raise DataError(f"{where}: messages[{j}].content must be a string or a list of parts "
                                f"({{\"type\": \"text\", \"text\": ...}}, {{\"type\": \"image\"}}), got {type(content).__name__}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant message; nothing to train on")
        images = record.get("images")
        if images is not None and not isinstance(images, (list, tuple)):
            raise DataError(f"{where}: field 'images' must be a list (one image per {{\"type\": \"image\"}} part), "
                            f"got {type(images).__name__}")
        n = len(image_refs(record))
        if n != parts:
            raise DataError(f"{where}: {parts} image part{'s' if parts != 1 else ''} ({{\"type\": \"image\"}}) in "
                            f"'messages' but {n} image{'s' if n != 1 else ''} in '{'image' if 'images' not in record else 'images'}'; "
                            "give one image per image part, in the order the parts appear")
        record_tools(record, where)

    def conversation(self, record: dict, where: str) -> tuple[list[dict], list[dict] | None]:
        """As `messages`, and each part without the keys holding null (an Arrow column gives every part every key)."""
        messages, tools = super().conversation(record, where)
        for m in messages:
            if isinstance(m.get("content"), list):
                m["content"] = [{k: v for k, v in part.items() if v is not None} for part in m["content"]]
        return messages, tools
