"""The export types: one module each (a Writer: its flags, checks, write and verification, finetune.convert.writers.base);
this is their one registry, which `finetune export --to` reads.

A new export type is a module here and one line in WRITERS (docs/layout.md, "a new export type").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.convert.writers.base import Writer
from finetune.convert.writers.gguf import GGUF
from finetune.convert.writers.hf import HF

WRITERS: dict[str, Writer] = {w.name: w for w in (HF(), GGUF())}
DEFAULT = HF.name


@dataclass
class ExportType:
    """The export type"""

    to: str = field(default=DEFAULT, metadata={
        "help": "Output format: " + "; ".join(f"{w.name}: {w.summary}" for w in WRITERS.values()) + "."})


def get(name: str) -> Writer | None:
    return WRITERS.get(name)


def names() -> list[str]:
    return list(WRITERS)
