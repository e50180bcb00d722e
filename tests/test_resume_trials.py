"""bench/resume_trials.py (random-kill resume trials, results in bench/RESULTS.md) on one trial: a random rank killed
at a random moment, `latest` resumes to the uninterrupted run's losses (1e-6). The full table (10 trials per path,
ZeRO-2 and ZeRO-3) is the benchmark's: too long for CI on 2 cores."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import resume_trials as T  # noqa: E402


@pytest.mark.slow
def test_one_random_kill_trial_resumes_exactly(tmp_path):
    T.setup(tmp_path)
    row = T.trial("loop", 1, 0, tmp_path)  # trial 1: zero3 (CPU Adam offload)
    assert row["preset"] == "zero3" and row["logged_at_kill"] >= row["kill_after_step"], row
    assert row["ok"] and row["max_diff"] <= 1e-6, row
    assert row["exit_s"] < 90, row
