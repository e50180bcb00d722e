"""The shapes of training records and the methods that read each: what a refusal of another method's data names.

A method given records of another method's shape says which --method reads them (DPO given KTO's unpaired examples:
--method kto; KTO given pairs: dpo, simpo, orpo, cpo or reward; SFT or GRPO given either: theirs). This is the one
place the data layer names methods; tests/test_fail_fast.py holds it to the registry (finetune.methods), method by
method and shape by shape."""

from __future__ import annotations

# shape -> (what the records are, the methods that train on them)
SHAPES = {
    "pairs": ("a preference pair (prompt, chosen, rejected)", ("dpo", "simpo", "orpo", "cpo", "reward")),
    "unpaired": ("an unpaired example (prompt, completion, label)", ("kto",)),
    "chat": ("an SFT record (messages, sharegpt or alpaca)", ("sft", "grpo", "rloo")),
    "text": ("a plain text record (text)", ("sft",)),
}


def shape_of(record) -> str | None:
    """The shape a record's keys say it has, None when they say none."""
    if not isinstance(record, dict):
        return None
    keys = set(record)
    if keys & {"chosen", "rejected"}:
        return "pairs"
    if "completion" in keys and "label" in keys:
        return "unpaired"
    if keys & {"messages", "conversations", "instruction"}:
        return "chat"
    if "text" in keys:
        return "text"
    return None


def methods_phrase(shape: str) -> str:
    names = SHAPES[shape][1]
    return "--method " + (names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}")


def hint(record, method: str) -> str:
    """' (an unpaired example (prompt, completion, label): --method kto)' when `record` is of a shape `method` does not
    train on, else ''."""
    shape = shape_of(record)
    if shape is None or method in SHAPES[shape][1]:
        return ""
    return f" ({SHAPES[shape][0]}: {methods_phrase(shape)})"


def first_record_problem(path: str, method: str, dataset_format: str | None = None) -> str | None:
    """A local JSONL file whose first record is of a shape `method` does not train on: the problem in one line,
    found with the other flag problems (reading one line), before the model and the data load. None when the first
    record says nothing against it, the file is not JSONL, or --dataset_format says how to read it."""
    from pathlib import Path
    import json

    if dataset_format not in (None, "", "auto") or not str(path).endswith(".jsonl") or not Path(path).is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    record = json.loads(line)
                    break
            else:
                return None
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # reading the data reports it, naming the line
    shape = shape_of(record)
    if shape is None or method in SHAPES[shape][1]:
        return None
    return (f"dataset: {path}:{number}: {SHAPES[shape][0]}, which --method {method} does not train on; "
            f"{methods_phrase(shape)} does")
