"""What the export commands say: ExportError (a user mistake or a failed verification, one clear message) and their
progress lines on stderr. Every export type (finetune.convert.writers) uses them."""

from __future__ import annotations

import sys


class ExportError(Exception):
    """A user mistake or a failed verification: one clear message."""


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)
