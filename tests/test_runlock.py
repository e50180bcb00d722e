"""One run per output folder at a time (finetune/training/runlock.py).

A second run into a folder in use is refused at start, exit 2, in one line naming the other run's pid and host; the
lock is released when a run ends and recognised as stale after kill -9 (its pid gone on this host) or when its
heartbeat stops (a holder on another node); temporary names are the run's own. Before: two runs into one folder
both exited 0 and the folder held only one of them, or one died on a temporary name both used.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.training import runlock
from launch import matrix
from test_cli_errors import REPO, _command, _environ
from test_output_dir import args, global_step, job  # noqa: F401  (fixture)

HOST = socket.gethostname()


@pytest.fixture(autouse=True)
def released():
    yield
    runlock.release()


def hold_in_a_process(out: Path) -> subprocess.Popen:
    code = ("import sys, time; from finetune.training import runlock; "
            f"print(runlock.acquire({str(out)!r}), flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "None"
    return p


def test_a_held_folder_is_refused_naming_the_holder_and_taken_over_after_kill_9(tmp_path, capfd):
    out = tmp_path / "out"
    holder = hold_in_a_process(out)
    try:
        refused = runlock.acquire(out)
        assert refused is not None and f"--output_dir {out} is in use by another run (pid {holder.pid} on {HOST}, " \
            in refused and "wait for it to end, or use another --output_dir" in refused, refused
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        assert runlock.acquire(out) is None  # stale: its pid is gone on this host
        assert f"removed the stale run lock {out / runlock.NAME} (pid {holder.pid} on {HOST}" in capfd.readouterr().err
        assert json.loads((out / runlock.NAME).read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait(30)
    runlock.release()
    assert out.is_dir() and not list(out.iterdir())  # released; the folder was there before this run: kept
    fresh = tmp_path / "fresh"
    assert runlock.acquire(fresh) is None and (fresh / runlock.NAME).is_file()
    runlock.release()
    assert not fresh.exists()  # made for a run that wrote nothing (refused later): removed with the lock


def test_a_holder_on_another_node_is_stale_only_once_its_heartbeat_stops(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    lock = out / runlock.NAME
    lock.write_text(json.dumps({"host": "node7", "pid": 4242, "started": time.time(), "command": "train.py"}))
    assert "(pid 4242 on node7, started " in runlock.acquire(out)
    old = time.time() - runlock.STALE_S - 5
    os.utime(lock, (old, old))
    assert runlock.acquire(out) is None and json.loads(lock.read_text())["host"] == HOST
    # The holder's heartbeat keeps its lock fresh.
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.1)
    runlock.release()
    assert runlock.acquire(out) is None
    os.utime(lock, (old, old))
    deadline = time.time() + 10
    while time.time() - lock.stat().st_mtime > 5 and time.time() < deadline:
        time.sleep(0.1)
    assert time.time() - lock.stat().st_mtime < 5
    runlock.release()
    assert not lock.exists() and out.is_dir()  # the folder was there before: kept


EVERY = [(path, case) for path in ("script", "loop", "engine") for case in ("same flags", "different flags")]
# CI's cover: each path once and each case (the lock is the three paths' shared start); all six with
# FINETUNE_FULL_MATRIX=1.
CASES = matrix(EVERY, [("script", "same flags"), ("loop", "different flags"), ("engine", "same flags")])


@pytest.mark.slow
@pytest.mark.parametrize("how, case", CASES)
def test_two_runs_at_once_into_one_folder_one_trains_the_other_is_refused(how, case, job, tmp_path):  # noqa: F811
    flags = [args(job), args(job, "--learning_rate", "2e-3") if case == "different flags" else args(job)]
    procs = []
    start = time.time()
    for a in flags:
        cmd, cwd = _command(how, a, tmp_path)
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=_environ(tmp_path), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    try:
        done = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
    codes = sorted(p.returncode for p in procs)
    report = "\n".join(f"--- {p.pid} exit {p.returncode}\n{err[-3000:]}" for p, (_, err) in zip(procs, done))
    assert codes == [0, 2], report
    won = 0 if procs[0].returncode == 0 else 1
    winner, loser = procs[won], procs[1 - won]
    err = done[1 - won][1]
    line = f"finetune: --output_dir {job['out']} is in use by another run (pid {winner.pid} on {HOST}, started "
    assert line in err and len([x for x in err.splitlines() if x.startswith("finetune:")]) == 1, report
    assert "Traceback" not in err and "saved to" not in done[1 - won][0] + err, report
    refused_after = max(0.0, time.time() - start)
    # Nothing of either lost: the winner's run complete, with its own flags; no lock, no temporary name left.
    out = job["out"]
    assert global_step(out) == 3 and (out / "model.safetensors").is_file(), report
    lr = "2e-3" if case == "different flags" and won == 1 else "1e-3"
    assert f"learning_rate: {float(lr)}" in (out / "finetune_config.yaml").read_text(), report
    left = [p.name for p in out.rglob("*") if ".tmp" in p.name or p.name.startswith((".staging", runlock.NAME))]
    assert not left, left
    # The lock was released: the same run resumes into the folder (one more step from its last checkpoint).
    resumed = subprocess.run(_command(how, flags[won] + ["--max_steps", "4", "--resume_from_checkpoint", "latest"],
                                      tmp_path)[0], cwd=_command(how, [], tmp_path)[1], env=_environ(tmp_path),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0 and f"resume: from {out}/checkpoint-" in resumed.stdout + resumed.stderr, \
        resumed.stderr[-3000:]
    assert global_step(out) == 4 and not (out / runlock.NAME).exists()
    print(f"{how}, {case}: pid {winner.pid} trained (exit 0), pid {loser.pid} refused (exit 2); both ended "
          f"{refused_after:.0f}s after the start; resumed to step 4 after")
