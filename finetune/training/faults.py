"""Fault injection for the kill tests: FINETUNE_TEST_STOP="RANK:STEP:DELAY" makes rank RANK stop itself (SIGSTOP)
DELAY s after its optimizer step STEP, so a harness can `kill -9` it at a chosen point of the run, however fast the
run is (a harness that polls for a step or a file may see it only after a short run has ended). finetune.testing
sets it (stop_at); unset, stop_point returns at once."""

from __future__ import annotations

import os
import signal
import threading

STOP_VAR = "FINETUNE_TEST_STOP"


def stop_point(step: int) -> None:
    """Called by every path once optimizer step `step` is done, before that step's logging, evaluation and save."""
    spec = os.environ.get(STOP_VAR)
    if not spec:
        return
    who, at, delay = spec.split(":")
    # RANK: every launcher sets it, and a process of its own is rank 0 (torch.distributed would say the same).
    if int(who) != int(os.environ.get("RANK", "0")) or int(at) != step:
        return
    stop = lambda: os.kill(os.getpid(), signal.SIGSTOP)  # noqa: E731  (stops every thread of the process)
    if float(delay) <= 0:
        stop()
    else:
        timer = threading.Timer(float(delay), stop)
        timer.daemon = True
        timer.start()
