"""The launcher watchdog every rank starts under a launcher: no rank outlives its launcher, no wait is silent.

A daemon thread checks once a second that every launcher above this rank is alive (for the `deepspeed` runner: its
per-node launcher, and the runner above it, which on SIGINT/SIGTERM exits without stopping the ranks) and ends the
rank within seconds, with a message, once one is gone, instead of training on or waiting 30 minutes in the
rendezvous; and it prints what the rank waits for (the rendezvous, a collective) once a wait passes 30 s. Ctrl-C
stops a rank at once (launchers pass SIGINT on to every rank).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

WAIT_REPORT = 30.0  # seconds a wait stays silent before the rank says what it waits for
_LAUNCHER_NAMES = ("torchrun", "accelerate", "deepspeed")
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "deepspeed.launcher", "accelerate.commands")
# Main-thread frames that mean "waiting for other ranks": the rendezvous, or one collective.
_RENDEZVOUS = ("init_process_group", "rendezvous", "_create_c10d_store", "_env_rendezvous_handler",
               "_tcp_rendezvous_handler")
_COLLECTIVES = ("barrier", "monitored_barrier", "all_reduce", "broadcast", "broadcast_object_list", "all_gather",
                "all_gather_object", "gather_object", "reduce_scatter", "all_to_all", "reduce", "gather", "scatter")
_watchdog = None


def start() -> None:
    """Under a launcher, start the watchdog (once per process) and stop at once on Ctrl-C."""
    global _watchdog

    if _watchdog is None and ("LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ):
        _watchdog = Watchdog(launcher_chain())
        _watchdog.start()
        # Ctrl-C reaches every rank (launchers pass SIGINT on): stop at once rather than unwind through DeepSpeed and
        # torch's exit handlers while the other ranks wait in a collective (up to 28 s measured under DeepSpeed).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, _interrupted)


def _interrupted(signum, frame) -> None:
    _rank_says("interrupted (SIGINT); stopping this rank")
    os._exit(130)


def _is_launcher(cmdline: list[str]) -> bool:
    head = cmdline[:4]
    names = {os.path.basename(a) for a in head[:2]}
    modules = {b for a, b in zip(head, head[1:]) if a == "-m"}
    return bool(names & set(_LAUNCHER_NAMES)) or any(m.startswith(_LAUNCHER_MODULES) for m in modules)


def launcher_chain() -> list:
    """psutil.Process of the process that started this rank, and of the launchers above it (the `deepspeed`
    runner above deepspeed.launcher.launch), up to the first process that is not a launcher (the user's shell)."""
    import psutil

    chain = []
    try:
        chain.append(psutil.Process(os.getppid()))
        while (parent := chain[-1].parent()) is not None and parent.pid > 1 and _is_launcher(parent.cmdline()):
            chain.append(parent)
    except psutil.Error:
        pass
    return chain


def _describe(p) -> str:
    import psutil

    try:
        words = [os.path.basename(a) if i < 2 else a for i, a in enumerate(p.cmdline()[:4])]
    except psutil.Error:
        words = []
    return f"`{' '.join(w for w in words if w not in ('python', 'python3', '-u'))}` (pid {p.pid})"


class Watchdog(threading.Thread):
    """A daemon thread, once a second: is every launcher above this rank alive; is the main thread waiting?"""

    def __init__(self, launchers: list, *, report_after: float = WAIT_REPORT, interval: float = 1.0):
        super().__init__(name="finetune-watchdog", daemon=True)
        self.launchers, self.report_after, self.interval = launchers, report_after, interval
        self.parent = os.getppid()
        self.names = [_describe(p) for p in launchers]
        self.main = threading.main_thread().ident
        self.frame, self.since, self.next_report = None, 0.0, 0.0

    def run(self) -> None:
        while True:
            time.sleep(self.interval)
            if gone := self.gone():
                _rank_says(f"{gone} is gone; stopping this rank, as no rank outlives its launcher")
                os._exit(1)  # the main thread may be blocked in a collective that never returns
            self.check_wait()

    def gone(self) -> str | None:
        import psutil

        for i, p in enumerate(self.launchers):
            try:
                alive = p.is_running() and p.status() != psutil.STATUS_ZOMBIE  # is_running: same pid, same start
            except psutil.Error:
                alive = False
            if not alive or (i == 0 and os.getppid() != self.parent):
                return f"the launcher {self.names[i]} that {'started' if i == 0 else 'runs'} this rank"
        return None

    def check_wait(self) -> None:
        frame, what = waiting_for(sys._current_frames().get(self.main))
        if frame is None or frame is not self.frame:
            self.frame, self.since, self.next_report = frame, time.monotonic(), self.report_after
            return
        waited = time.monotonic() - self.since
        if waited >= self.next_report:
            _rank_says(f"waiting {waited:.0f} s for {what}")
            self.next_report += 60


def waiting_for(frame) -> tuple[object, str]:
    """(the frame of the wait, what is waited for) if the main thread is in a rendezvous or collective, else (None, "")."""
    while frame is not None:
        name, file = frame.f_code.co_name, frame.f_code.co_filename
        if "distributed" in file or "deepspeed" in file:
            if name in _RENDEZVOUS:
                where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
                return frame, (f"the rendezvous of {os.environ.get('WORLD_SIZE', '?')} ranks at {where} (every rank "
                               "must start and reach it)")
            if name in _COLLECTIVES:
                return frame, (f"the other ranks in a collective ({name}, called from "
                               f"{_caller(frame)}): one of them is slower, stuck or gone")
        frame = frame.f_back
    return None, ""


def _caller(frame) -> str:
    while frame is not None and ("distributed" in frame.f_code.co_filename or "deepspeed" in frame.f_code.co_filename
                                 or "accelerate" in frame.f_code.co_filename):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else "?"


def _rank_says(message: str) -> None:
    print(f"finetune: rank {os.environ.get('RANK', '?')}: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
