"""bench/data.py's report: ratios taken within a repeat, medians and ranges over the repeats."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import data as D  # noqa: E402


def _row(kind, n, p, repeat, cpu, wall):
    return {"kind": kind, "records": n, "num_proc": p, "repeat": repeat, "tokens": 94 * n, "examples": n,
            "cpu_in_process_s": cpu, "wall_s": wall, "peak_rss_mb": 400.0 + repeat, "peak_rss_anon_mb": 300.0}


def test_ratios_within_repeats_then_median_and_range():
    rows = []
    # finetune/plain CPU per repeat: 1.2, 1.3, 1.25 (a slow repeat moves both runs, not the ratio alone)
    for r, (f, q) in enumerate(((12.0, 10.0), (26.0, 20.0), (12.5, 10.0))):
        rows += [_row("finetune", 1000, 1, r, f, f), _row("plain", 1000, 1, r, q, q),
                 _row("finetune", 1000, 2, r, f * 1.1, f / 1.8), _row("plain", 1000, 2, r, q, q / 1.9)]
    text = D.ratios(rows)
    assert "1,000 records, 1 process(es): finetune CPU / plain CPU = 1.25 (1.20-1.30 over 3)" in text
    assert "1,000 records, finetune: wall 1 process / 2 processes = 1.80 (1.80-1.80 over 3)x" in text
    table = D.table(rows)
    # medians: finetune 1 process CPU 12.5 s, spread (26 - 12) / 12.5 = 112% -> ±56%; peak RSS the highest
    assert "| 1,000 | 94,000 | finetune | 1 | 3 | 12.5 | 12.5 ±56% | 80 | 7,520 | 402 | 300 | 0 |" in table
    # Rows of a run without --repeats are one repeat.
    old = [{k: v for k, v in r.items() if k != "repeat"} for r in rows if r["repeat"] == 0]
    assert "finetune CPU / plain CPU = 1.20\n" in D.ratios(old) + "\n"


def test_pair_starts_the_kinds_together(monkeypatch):
    """--pair: the one-process runs of both kinds overlap in time (their CPU ratio is taken over the same seconds)."""
    import time

    spans = {}

    def fake(kind, n, num_proc, work):
        t0 = time.monotonic()
        time.sleep(0.3)
        spans[kind] = (t0, time.monotonic())
        return {"kind": kind}

    monkeypatch.setattr(D, "measure", fake)
    rows = D.measure_together(["finetune", "plain"], 10, 1, None)
    assert [r["kind"] for r in rows] == ["finetune", "plain"]
    (a0, a1), (b0, b1) = spans["finetune"], spans["plain"]
    assert a0 < b1 and b0 < a1  # they overlapped
