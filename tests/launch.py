"""The tests' name for finetune.testing (real multi-process jobs on loopback, every wait bounded)."""

from finetune.testing import (  # noqa: F401
    BIN, LOOP, REPO, SFT, TRAIN, Job, Killed, Result, deepspeed_launcher, env, free_port, launcher, losses,
    rank_pids, run, run_and_kill_rank, tiny_job,
)
