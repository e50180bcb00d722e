"""What more than one layer uses to report a mistake: the error types raised below the layer that explains them,
and the one "did you mean" hint of every misspelt name (docs/layout.md, "Layers": this module imports nothing of
finetune, so any layer may)."""

from __future__ import annotations

import difflib


class ResumeError(Exception):
    """The checkpoint asked for cannot be resumed here; the message says why and what to do."""


def did_you_mean(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""
