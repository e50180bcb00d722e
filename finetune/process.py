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
# torch 2.13.0 (gloo, CPU) with CPython 3.11 (3.12-3.13 exit such a thread the same way): a launched rank whose run
# has finished can abort in the interpreter's shutdown, "terminate called without an active exception" (SIGABRT; the
# launcher then exits non-zero). The cause, from the cores of three aborts of a bare gloo script (init, all_reduce,
# barrier, broadcast_object_list, a normal exit): not a std::thread destroyed while joinable, but a gloo worker thread
# (c10d::ProcessGroupGloo::runLoop) that drops the last collective's work after the main thread's wait() returned.
# That work's destructor (~AsyncBroadcastWork -> ~AsyncWork) releases its tensors, whose Python objects need the GIL
# (TensorImpl::decref_pyobject -> pybind11::gil_scoped_acquire); when the worker gets there after Py_FinalizeEx has
# begun (the main thread was in its final gc), CPython ends the thread with pthread_exit (take_gil ->
# PyThread_exit_thread), whose forced unwind meets the noexcept destructor: std::terminate. A race the worker loses
# when it is descheduled past the main thread's exit, so it shows under load: 3 runs of 52 of that script (two ranks
# started with a launcher's env:// variables; 2 cores, load 12-20), 1 in 4 of tests/test_resume.py's mid-epoch engine
# case under pytest. Known upstream and open: pytorch/pytorch#190489; pytorch/pytorch#179291 (destroy_process_group
# in an atexit handler) was abandoned. destroy_process_group() prevents it only where it drops the last reference to
# the group: ~ProcessGroupGloo then joins its workers (5 threads -> 1); with a reference kept (as a library's engine
# or state object keeps its group) the workers outlive it (5 -> 5) and the race stays. tests/exit_abort_worker.py
# (the race widened), 2 ranks a run, counted rank aborts: through the shutdown 18 of 200 (100 runs); after
# destroy_process_group 0 of 60 (30 runs), with a reference kept 2 of 60 (30 runs); by end_finished_process 0 of 300
# (150 runs). So a training process whose work is done ends without the shutdown, however its main ends (run_rank):
# a launched rank, also one that raised SystemExit(0) with nothing to do (a finished run resumed with `latest`, CI
# 2026-11-26), and the process of a training entry point (own_process): a one-process run, not launched (`python
# finetune/loop.py --config zero3_nvme`), printed "saved to" and had not ended 600 s later (CI 2026-11-27; not seen in
# 29 runs of its command here; that hang's cause is not known). CPython 3.14 parks such a thread instead of exiting
# it (PyThread_hang_thread), which would end the abort; recheck this with a newer torch or Python.


_AT_END: list = []


def at_end(fn) -> None:
    """Run `fn()` before end_finished_process ends the process (os._exit skips atexit): a lock to release."""
    if fn not in _AT_END:
        _AT_END.append(fn)


def run_at_end() -> None:
    for fn in _AT_END:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - ending anyway; say what was left
            print(f"finetune: at exit: {e}", file=sys.stderr)


def end_finished_process(code: int = 0, own_process: bool = False) -> None:
    """End the process, its work done: flush, then os._exit. Only a rank its launcher started (LOCAL_RANK set at
    start) or an entry point's own process (own_process, and the process started with the arguments in sys.argv)
    ends; any other caller returns. A test running an entry point in-process sets LOCAL_RANK and sys.argv itself, so
    what counts is the environment and command line the process started with."""
    if not ((own_process and started_with_sys_argv()) or launched_by_launcher()):
        return
    import logging

    run_at_end()
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


# Ctrl-C: Python raises KeyboardInterrupt in whatever the main thread runs when the signal is handled, and when that is
# a finalizer (a __del__ the garbage collector runs at some allocation) Python prints "Exception ignored" and goes on:
# the Ctrl-C is lost. Tokenizing, regex's Group.__del__ (the cyclic garbage every pattern compile leaves) took the
# signal in both processes of `--dataset_num_proc 2` in 3 of 5 Ctrl-Cs sent at the start of the map, and the run went
# on to train. Such a Ctrl-C is sent again 50 ms later, until it lands outside a finalizer.
RESEND_INTERRUPT_S = 0.05


def interrupt_outside_finalizers() -> None:
    """Install the SIGINT handler that raises KeyboardInterrupt anywhere but in a finalizer (in the main thread, where
    SIGINT still has Python's own handler: not where it is ignored, nor over anyone else's)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum, frame) -> None:
    import signal
    import threading

    f = frame
    while f is not None:
        if f.f_code.co_name == "__del__":
            threading.Timer(RESEND_INTERRUPT_S, os.kill, (os.getpid(), signal.SIGINT)).start()
            return
        f = f.f_back
    raise KeyboardInterrupt


def run_rank(main, *args, own_process: bool = False, resume_hint: bool = False) -> None:
    """Run an entry point's main(*args); a launched rank, or the entry point's own process (own_process: the
    training scripts' `__main__`, `finetune train|loop|engine`), that succeeded then ends by end_finished_process, whether
    main returned or raised SystemExit(0) (a finished run resumed with `latest`: nothing to do). A failing process
    keeps the usual way out: ending at once would let its launcher stop local rank 0 before that rank printed the
    error."""
    interrupt_outside_finalizers()
    try:
        main(*args)
    except KeyboardInterrupt:
        end_interrupted(resume_hint, own_process)
    except SystemExit as e:
        if e.code in (None, 0):
            end_finished_process(0, own_process)
        raise
    finally:
        run_at_end()  # in this process too (a test's): the run's lock is released when its main ends
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


def peak_rss_bytes() -> int:
    """This process's own peak RSS: VmHWM. Not ru_maxrss: Linux carries the parent's peak across a vfork+exec
    (Python's subprocess), so a process started by a grown parent reports that parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # not Linux: no VmHWM

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
