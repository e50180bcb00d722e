"""The tests' name for finetune.testing (real multi-process jobs on loopback, every wait bounded)."""

from finetune.testing import (  # noqa: F401
    ALLOWED_WARNINGS, BIN, LOOP, REPO, SFT, TRAIN, Job, Killed, Result, deepspeed_launcher, env, eval_entries,
    eval_losses, free_port, launcher, losses, node_launcher, rank_pids, run, run_and_kill_rank, run_nodes,
    run_nodes_and_kill_rank, tiny_job, unexpected_warnings, write_hostfile,
)
