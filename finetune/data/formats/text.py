"""`text`: {"text": ...}, trained on every token, EOS appended."""

from __future__ import annotations

from finetune.data.errors import DataError
from finetune.data.formats.base import Format, need_str


class Text(Format):
    name = "text"
    keys = "'text'"
    prompted = False  # one text, no prompt/answer split

    def detects(self, record: dict) -> bool:
        return "text" in record

    def validate(self, record: dict, where: str) -> None:
        need_str(record, "text", self.name, where)
        if not record["text"].strip():
            raise DataError(f"{where}: field 'text' is empty")

    def examples(self, tokenizer, record: dict, completion_only: bool) -> list[tuple[list[int], list[int]]]:
        eos = tokenizer.eos_token_id
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
        if eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        return [(ids, list(ids))]
