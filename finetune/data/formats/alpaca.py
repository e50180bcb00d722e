"""`alpaca`: {"instruction", "input"?, "output"}: one user turn and one assistant turn through the chat template
where the tokenizer has one, else the Alpaca prompt."""

from __future__ import annotations

from finetune.constants import IGNORE_INDEX
from finetune.data.formats.base import Format, need_str

ALPACA_PROMPT = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


class Alpaca(Format):
    name = "alpaca"
    keys = "'instruction'+'output' (alpaca)"

    def detects(self, record: dict) -> bool:
        return "instruction" in record and "output" in record

    def validate(self, record: dict, where: str) -> None:
        need_str(record, "instruction", self.name, where)
        need_str(record, "input", self.name, where, optional=True)
        need_str(record, "output", self.name, where)

    def uses_template(self, tokenizer) -> bool:
        return bool(tokenizer.chat_template)

    def conversation(self, record: dict, where: str) -> tuple[list[dict], None]:
        prompt = record["instruction"]
        if record.get("input"):
            prompt = f"{prompt}\n\n{record['input']}"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}], None

    def examples(self, tokenizer, record: dict, completion_only: bool) -> list[tuple[list[int], list[int]]]:
        eos = tokenizer.eos_token_id
        template = ALPACA_PROMPT_INPUT if record.get("input") else ALPACA_PROMPT
        prompt = tokenizer(template.format(**{"input": "", **record}), add_special_tokens=True)["input_ids"]
        # Tokenize the completion on its own so the prompt/completion boundary is a token boundary.
        completion = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        labels = ([IGNORE_INDEX] * len(prompt) if completion_only else list(prompt)) + completion
        return [(prompt + completion, labels)]
