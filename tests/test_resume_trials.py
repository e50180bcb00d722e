"""Random-kill resume trials (bench/resume_trials.py): a random rank killed at a random moment, `latest` resumes to
the uninterrupted run's losses (1e-6), on each path (Trainer, loop, DeepSpeed engine; DPO on the Trainer path, ORPO
on the loop), ZeRO-2 and ZeRO-3 alternating.

Not in CI: FINETUNE_FULL_MATRIX=1 runs one trial each on SFT's loop, DPO (the Trainer), ORPO (the loop) and
KTO. `FINETUNE_RESUME_TRIALS=10` runs ten per path (about an hour on 2 cores);
`FINETUNE_RESUME_TRIALS_ROWS=FILE` appends each trial's row there, and `python bench/resume_trials.py --rows FILE
--write` puts them in bench/RESULTS.md."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import resume_trials as T  # noqa: E402

TRIALS = int(os.environ.get("FINETUNE_RESUME_TRIALS", "1"))
ROWS = os.environ.get("FINETUNE_RESUME_TRIALS_ROWS")
# One trial per path: the loop (ZeRO-2: even indices), DPO (ZeRO-3 with CPU Adam offload, its reference partitioned:
# odd indices), ORPO, a method without a reference model (ZeRO-3 on the loop: odd index), KTO (ZeRO-2 on the loop).
# The Trainer and engine paths' kill-and-resume runs are tests/test_resume.py's; FINETUNE_RESUME_TRIALS=N runs N
# random trials on every path.
ONE_TRIAL = {"loop": 0, "dpo": 1, "orpo": 1, "kto": 0}
ONE_TRIAL_CASES = list(ONE_TRIAL)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    # One folder for the module: each path's reference run per preset is made once and shared by its trials.
    root = tmp_path_factory.mktemp("trials")
    T.setup(root)
    return root


# Not in CI (a kill -9 and resume on 2 processes is tests/test_resume.py's, each method's resume its own test's): one
# trial per path with FINETUNE_FULL_MATRIX=1, or FINETUNE_RESUME_TRIALS=N.
@pytest.mark.slow
@(pytest.mark.full_matrix if TRIALS == 1 else lambda test: test)
@pytest.mark.parametrize("path", list(T.PATHS) if TRIALS > 1 else ONE_TRIAL_CASES)
def test_random_kill_trials_resume_exactly(path, work):
    indices = range(TRIALS) if TRIALS > 1 else [ONE_TRIAL[path]]
    rows = []
    for index in indices:
        row = T.trial(path, index, 0, work)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if ROWS:
            with open(ROWS, "a") as f:
                f.write(json.dumps(row) + "\n")
    for row in rows:
        assert row["logged_at_kill"] >= row["kill_after_step"], row
        assert row["exit_s"] < 90, row
    bad = [row for row in rows if not row["ok"]]
    assert not bad, f"{len(bad)} of {len(rows)} trials on {path} did not resume exactly: {bad}"
