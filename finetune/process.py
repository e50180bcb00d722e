"""How a finetune process ends.

A user's mistake found by every rank (exit_with, exit_with_problems in finetune.config.parser): one message, exit 2
on every rank, the other ranks giving the printing one time first. A finished run (run_rank): without the
interpreter shutdown, where that shutdown can abort or hang (below).
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

# How long a launched rank that does not print an error every rank shares waits before it exits: a rank that exits
# at once makes its launcher SIGTERM the rest, the printing rank included, possibly before that one has printed.
PEER_REPORT_GRACE_S = 10.0


def give_the_reporting_rank_time() -> None:
    """Wait PEER_REPORT_GRACE_S under a launcher (the printing rank's exit ends the wait: the launcher stops us)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(PEER_REPORT_GRACE_S)


def exit_with(message: str) -> NoReturn:
    # Every rank reaches the same error (data errors reach the waiting ranks through the cache), so all exit. One
    # line per node (its local rank 0): each node's launcher output says why its ranks stopped. The others give it
    # time to print before their exit makes the launcher stop it.
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # A message passed on from another finetune process (a rank, the quickstart's worker) has its prefix already.
        print(f"finetune: {message.removeprefix('finetune: ')}", file=sys.stderr, flush=True)
    else:
        give_the_reporting_rank_time()
    raise SystemExit(2)


# ----------------------------------------------------------------------------------------------
# torch 2.13 / DeepSpeed 0.19.8 on CPU (gloo): a launched rank whose run has finished, saved and torn its process
# group down can still abort in the interpreter's shutdown, a C++ thread destroyed while joinable ("terminate called
# without an active exception", SIGABRT, the launcher then exits non-zero). Seen on the engine and Trainer paths,
# about 1 run in 4 of tests/test_resume.py's mid-epoch engine case, never in 14 runs of its command outside pytest;
# which library's thread it is was not found; also a rank that raised SystemExit(0) with nothing to do (a finished
# run resumed with `latest`, CI 2026-11-26). And a one-process run, not launched (`python finetune/loop.py --config
# zero3_nvme`), printed "saved to" and had not ended 600 s later (CI 2026-11-27; not seen in 29 runs of its command
# here). A training process whose work is done therefore ends without the shutdown, however its main ends
# (run_rank): a launched rank, and the process of a training entry point (own_process).


def end_finished_process(code: int = 0, own_process: bool = False) -> None:
    """End the process, its work done: flush, then os._exit. Only a rank its launcher started (LOCAL_RANK set at
    start) or an entry point's own process (own_process, and the process started with the arguments in sys.argv)
    ends; any other caller returns. A test running an entry point in-process sets LOCAL_RANK and sys.argv itself, so
    what counts is the environment and command line the process started with."""
    if not ((own_process and started_with_sys_argv()) or launched_by_launcher()):
        return
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


RESUME_HINT = ("resume with the same command and --resume_from_checkpoint latest (the checkpoints saved so far "
               "are kept)")


def end_interrupted(resume_hint: bool = False, own_process: bool = False) -> NoReturn:
    """Ctrl-C: one line, exit 130. The `finally` blocks that remove staged files ran while the interrupt unwound."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"finetune: interrupted{'; ' + RESUME_HINT if resume_hint else ''}", file=sys.stderr, flush=True)
    end_finished_process(130, own_process)
    raise SystemExit(130)


def run_rank(main, *args, own_process: bool = False, resume_hint: bool = False) -> None:
    """Run an entry point's main(*args); a launched rank, or the entry point's own process (own_process: the
    training scripts' `__main__`, `finetune train|loop|engine`), that succeeded then ends by end_finished_process, whether
    main returned or raised SystemExit(0) (a finished run resumed with `latest`: nothing to do). A failing process
    keeps the usual way out: ending at once would let its launcher stop local rank 0 before that rank printed the
    error."""
    try:
        main(*args)
    except KeyboardInterrupt:
        end_interrupted(resume_hint, own_process)
    except SystemExit as e:
        if e.code in (None, 0):
            end_finished_process(0, own_process)
        raise
    end_finished_process(0, own_process)


def started_with_sys_argv() -> bool:
    """The command line this process started with (/proc/self/cmdline) ends with sys.argv[1:], so the entry point
    reading sys.argv is the program (`python finetune/train.py ARGS`, `finetune train ARGS`, `python -m
    finetune.cli train ARGS`); False where that cannot be read."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            started = f.read().split(b"\0")[:-1]
    except OSError:
        return False
    args = [os.fsencode(a) for a in sys.argv[1:]]
    return len(started) > len(args) and started[len(started) - len(args):] == args


def launched_by_launcher() -> bool:
    """LOCAL_RANK was in the environment this process started with (/proc/self/environ: os.environ changes since
    do not show there); False where that cannot be read."""
    try:
        with open("/proc/self/environ", "rb") as f:
            return any(item.startswith(b"LOCAL_RANK=") for item in f.read().split(b"\0"))
    except OSError:
        return False
