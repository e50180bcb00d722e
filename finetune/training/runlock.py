"""One run per output folder at a time: OUTPUT_DIR/.finetune_run.lock.

Made with O_CREAT|O_EXCL (atomic on local disks and on NFS v3+ and the usual cluster filesystems), holding the
holder's host, pid, start time and command; its main process touches it every HEARTBEAT_S s. A second run into the
folder is refused at start naming the holder. A lock is stale, and taken over, when its pid is gone on this host
(or is another process by now), or when it was not touched for STALE_S s (a holder on another node killed with
kill -9, or its node gone). Released when the run ends (atexit, and before finetune.process ends a finished
process). Every rank learns rank 0's outcome, and the run id that names this run's temporary files.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from finetune import process

NAME = ".finetune_run.lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0  # several missed heartbeats: a process that can still write its lock does so well within this

_held: dict = {}  # path, run, created (the output folder was made for this run), stop (the heartbeat's event)
_run_id: str | None = None


def run_id() -> str | None:
    """This run's id (set on every rank once the lock is taken), for temporary names no other run shares."""
    return _run_id


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # A process that has exited but is not yet reaped (a zombie: its launcher or test harness has not waited) holds
    # nothing: its exit is final, whether or not its atexit ran.
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def _stale(holder: dict, age: float) -> str | None:
    """Why the lock `holder` wrote is stale, or None while it holds."""
    if holder.get("host") == socket.gethostname():
        pid = int(holder.get("pid", 0))
        ticks = _start_ticks(pid) if pid > 0 else None
        if ticks is None:
            return f"its process {pid} on this host is gone"
        if holder.get("pid_start") not in (None, ticks):
            return f"pid {pid} on this host is another process now"
        if pid == os.getpid():
            return "an earlier run in this process, ended (runs in one process follow each other)"
        return None
    if age > STALE_S:
        return f"not refreshed for {age:.0f} s (its holder updates it every {HEARTBEAT_S:.0f} s)"
    return None


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {started}: {holder.get('command', '?')}"


def _heartbeat(path: Path, run: str, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            os.utime(path)
        except OSError:
            return  # removed under us (another run judged it stale): nothing to keep alive


def acquire(output_dir: str | Path) -> str | None:
    """Take the folder's lock for this process; the refusal's words when another live run holds it."""
    release()  # an earlier run of this process (a caller running entry points in-process) that did not release
    out = Path(output_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path, run = out / NAME, uuid.uuid4().hex[:12]
    me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_ticks(os.getpid()),
          "started": time.time(), "run": run, "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:300]}
    for _ in range(5):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder, age = json.loads(path.read_text() or "{}"), time.time() - path.stat().st_mtime
            except (OSError, ValueError):
                # Being written at this instant (an empty or partial file), or just removed: look again.
                time.sleep(0.2)
                continue
            why = _stale(holder, age)
            if why is None:
                return (f"--output_dir {out} is in use by another run ({describe(holder)}); one run per output "
                        f"folder at a time: wait for it to end, or use another --output_dir")
            print(f"finetune: removed the stale run lock {path} ({describe(holder)}; {why})", file=sys.stderr,
                  flush=True)
            try:  # rename first: of two runs taking over at once, one wins the rename
                grave = path.with_name(f"{NAME}.stale-{run}")
                os.rename(path, grave)
                grave.unlink()
            except OSError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        stop = threading.Event()
        threading.Thread(target=_heartbeat, args=(path, run, stop), daemon=True, name="finetune-run-lock").start()
        _held.update(path=path, run=run, created=created, stop=stop)
        atexit.register(release)
        process.at_end(release)
        return None
    return f"--output_dir {out}: could not take its run lock {path} (it keeps changing); try again"


def held_run() -> str | None:
    return _held.get("run")


def adopt(run: str | None) -> None:
    """Every rank: the run id rank 0's lock holds (names this run's temporary files)."""
    global _run_id
    _run_id = run


def release() -> None:
    """Remove the lock if it is still this run's; the output folder too when this run made it and left it empty."""
    if not _held:
        return
    held = dict(_held)
    _held.clear()
    held["stop"].set()
    path = held["path"]
    try:
        if json.loads(path.read_text()).get("run") == held["run"]:
            path.unlink()
    except (OSError, ValueError):
        pass
    if held["created"]:
        try:
            path.parent.rmdir()  # only when empty: a run refused before it wrote anything leaves no folder
        except OSError:
            pass
