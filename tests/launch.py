"""The tests' name for finetune.testing (real multi-process jobs on loopback, every wait bounded)."""

from finetune.testing import (  # noqa: F401
    ALLOWED_WARNINGS, BIN, ENGINE, LOOP, REPO, TRAIN, Launched, Killed, Result, deepspeed_launcher, env, eval_entries,
    eval_losses, finish, free_port, launcher, losses, node_launcher, rank_pids, run, run_and_kill_rank, run_nodes,
    run_nodes_and_kill_rank, side_by_side, slurm_stubs, tiny_job, unexpected_warnings, write_hostfile,
)

import os

# CI runs a cover of each test matrix that uses `matrix` (every path, launcher, signal and preset at least once);
# FINETUNE_FULL_MATRIX=1 runs every combination (about 12 more minutes on 2 cores).
FULL_MATRIX = os.environ.get("FINETUNE_FULL_MATRIX") == "1"


def matrix(every: list, cover: list) -> list:
    """`every` combination under FINETUNE_FULL_MATRIX=1, else `cover`, a subset of it."""
    assert all(c in every for c in cover), [c for c in cover if c not in every]
    return list(every) if FULL_MATRIX else list(cover)
