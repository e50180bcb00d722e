"""The record formats, one module each; this registry is the one place that lists them.

A new format is a module with a `Format` subclass (formats/base.py), its line in FORMATS (the order users see) and
its place in DETECTION (most specific keys first: the first format whose keys a record has names its format).
"""

from __future__ import annotations

from finetune.data.formats import shapes
from finetune.data.errors import DataError
from finetune.data.formats.alpaca import Alpaca
from finetune.data.formats.base import Format
from finetune.data.formats.messages import Messages
from finetune.data.formats.sharegpt import ShareGPT
from finetune.data.formats.text import Text
from finetune.data.formats.vision import Vision

FORMATS: dict[str, Format] = {f.name: f for f in (Text(), Alpaca(), Messages(), ShareGPT(), Vision())}
DETECTION = ("vision", "messages", "sharegpt", "alpaca", "text")


def names() -> tuple[str, ...]:
    return tuple(FORMATS)


def get(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise DataError(f"unknown dataset format {name!r} (known: {', '.join(FORMATS)})") from None


# Keys only preference data has (pairs: chosen/rejected; unpaired: completion with a label).
PREFERENCE_KEYS = {"chosen", "rejected", "label"}


def detect(record: dict, where: str) -> Format:
    for name in DETECTION:
        if FORMATS[name].detects(record):
            return FORMATS[name]
    keys = [f.keys for f in FORMATS.values() if f.keys]
    keys = f"{', '.join(keys[:-1])} or {keys[-1]}"
    if PREFERENCE_KEYS & set(record):
        # Preference data given to supervised fine-tuning: the fix is the method, not --dataset_format.
        shape = shapes.shape_of(record)
        named = f": {shapes.SHAPES[shape][0]}: {shapes.methods_phrase(shape)}" if shape in ("pairs", "unpaired") else \
            " (finetune train --help lists them)"
        raise DataError(f"{where}: the keys ({', '.join(record)}) are preference data, which supervised "
                        f"fine-tuning does not read; choose a preference method with --method{named}")
    raise DataError(f"{where}: cannot tell the record format from its keys ({', '.join(record) or 'none'}); "
                    f"expected {keys}; or pass --dataset_format")
