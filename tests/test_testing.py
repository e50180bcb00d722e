"""finetune.testing cannot hang: a launcher that dies or hangs while a rank in a session of its own holds the
output pipe (what torch elastic's workers do) ends within a bound, and that rank is dead afterwards."""

from __future__ import annotations

import re
import sys
import time

import psutil
import pytest

from finetune import testing

BOUND = 15  # seconds: the longest any of these may take

# A stand-in launcher: starts a "rank" in a new session (out of reach of a kill of the launcher's group) that
# inherits stdout and sleeps for 10 minutes; then the launcher sleeps argv[1] seconds and exits 0.
LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("rank", rank.pid, flush=True)
time.sleep(float(sys.argv[1]))
"""

# Two "ranks" (RANK=0, 1) in sessions of their own; writes the `when` file; exits 3 once rank 1 is gone,
# leaving rank 0 running (a launcher that lost track of a rank).
KILLABLE = """
import os, pathlib, subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                          env={**os.environ, "RANK": str(r)}) for r in (0, 1)]
for r in ranks:
    print("rank", r.pid, flush=True)
pathlib.Path(sys.argv[1]).write_text("ready")
ranks[1].wait()
sys.exit(3)
"""


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def rank_pids_in(text: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"^rank (\d+)$", text, re.M)]


@pytest.mark.parametrize("launcher_lives, timeout, message", [
    (0.0, 60, "leaving 1 process(es) running"),  # exits at once: the rank is found by its environment tag
    (1.0, 60, "leaving 1 process(es) running"),  # exits after the rank was seen as its descendant
    (600.0, 3, "timed out after 3s"),  # hangs
])
def test_a_rank_in_its_own_session_cannot_hang_run(tmp_path, launcher_lives, timeout, message):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    start = time.monotonic()
    with pytest.raises(AssertionError, match=re.escape(message)) as e:
        testing.run([sys.executable, str(script), str(launcher_lives)], timeout=timeout, cwd=tmp_path)
    elapsed = time.monotonic() - start
    [pid] = rank_pids_in(str(e.value))
    assert elapsed < BOUND, elapsed
    assert dead(pid), psutil.Process(pid).cmdline()


# A launcher that hangs in its main thread and in a second thread, and a rank (its own session) that hangs too.
# The rank touches `ready` from inside its waiting function and the launcher waits for that file before it waits on
# the rank: under load (the suite's other workers starting processes) the rank's interpreter could still be starting
# when the bound came, and its stack then showed no rank_waits_here.
HUNG = """
import os, subprocess, sys, threading, time
rank = subprocess.Popen([sys.executable, "-c", "import pathlib, time\\ndef rank_waits_here():\\n    pathlib.Path('ready').touch()\\n    time.sleep(600)\\nrank_waits_here()"],
                        start_new_session=True)
def helper_thread_waits_here():
    time.sleep(600)
threading.Thread(target=helper_thread_waits_here, daemon=True).start()
def launcher_waits_here():
    rank.wait()
while not os.path.exists("ready"):
    time.sleep(0.01)
print("started", flush=True)
launcher_waits_here()
"""


def test_a_timeout_shows_where_each_process_waits(tmp_path):
    """run's timeout: every process of the job prints its threads' Python stacks before it is killed, so a hang
    seen once (in CI) says where it was."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    start = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 8s") as e:
        testing.run([sys.executable, str(script)], timeout=8, cwd=tmp_path)
    text = str(e.value)
    assert "started" in text, text[-3000:]  # both processes were in their waiting functions when the bound came
    for frame in ("launcher_waits_here", "helper_thread_waits_here", "rank_waits_here"):
        assert re.search(rf'File ".*", line \d+ in {frame}', text), text[-3000:]
    assert text.index("rank_waits_here") < text.index("launcher_waits_here"), text[-3000:]  # ranks first
    assert time.monotonic() - start < 8 + BOUND, (time.monotonic() - start, text[-3000:])
    assert not list(tmp_path.glob("core*")), list(tmp_path.glob("core*"))


def test_run_and_kill_rank_kills_the_rank_the_launcher_left(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(KILLABLE)
    when = tmp_path / "ready"
    start = time.monotonic()
    killed = testing.run_and_kill_rank([sys.executable, str(script), str(when)], when, rank=1, timeout=60)
    elapsed = time.monotonic() - start
    rank0, rank1 = rank_pids_in(killed.output)
    assert killed.returncode == 3 and killed.exit_seconds < 5, (killed.returncode, killed.exit_seconds)
    assert killed.survivors == [rank0] and elapsed < BOUND, (killed.survivors, elapsed)
    assert dead(rank0) and dead(rank1)


def test_a_clean_run_returns_at_once_with_its_output_and_exit_code(tmp_path):
    start = time.monotonic()
    result = testing.run([sys.executable, "-c", "import os, sys; print(os.environ['PYTHONPATH']); sys.exit(4)"],
                         timeout=60, cwd=tmp_path)
    assert time.monotonic() - start < 5
    assert result.returncode == 4
    # The checkout the code comes from is first on the path of everything a job starts.
    assert result.output.split("\n")[0].split(":")[0] == str(testing.REPO)


# A "rank" that reports steps 1..4 to finetune.training.faults.stop_point, then says it is done and exits.
STEPPER = """
import time
from finetune.training import faults
for step in range(1, 5):
    faults.stop_point(step)
    print("step", step, time.monotonic(), flush=True)
    time.sleep(0.5)
print("done", flush=True)
"""


@pytest.mark.parametrize("spec, stops", [("0:3:0", True), ("0:2:0.75", True), ("1:3:0", False), ("0:9:0", False)])
def test_a_rank_stops_itself_at_the_step_it_is_told(spec, stops):
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", STEPPER], stdout=subprocess.PIPE, text=True,
                            env=testing.env(FINETUNE_TEST_STOP=spec), cwd=testing.REPO)
    try:
        deadline = time.monotonic() + BOUND
        while proc.poll() is None and time.monotonic() < deadline:
            if psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED:
                break
            time.sleep(0.01)
        stopped = proc.poll() is None and psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
        assert stopped == stops, spec
    finally:
        proc.kill()
        out = proc.communicate(timeout=BOUND)[0]
    steps = [line.split() for line in out.splitlines() if line.startswith("step")]
    if not stops:
        assert len(steps) == 4 and out.rstrip().endswith("done"), out
    elif spec == "0:3:0":
        # Stopped inside step 3's call, before it printed: nothing after it ran.
        assert [s[1] for s in steps] == ["1", "2"], out
    else:
        # 0.75 s after step 2: step 3 (0.5 s later) ran meanwhile, step 4 (1 s later) did not.
        assert [s[1] for s in steps] == ["1", "2", "3"], out


def test_an_op_built_twice_is_found(tmp_path):
    """conftest fails the session on an op built outside this virtualenv's folder, or rebuilt in it under other flags
    (torch's NAME_v1); ops built before the session, and ours, are not counted."""
    import os

    ours, default = tmp_path / "py311_cpu-venvabc", tmp_path / "py311_cpu"
    for folder, files in ((ours / "cpu_adam", ["cpu_adam.so"]), (ours / "async_io", ["async_io.so", "async_io_v1.so"]),
                          (default / "cpu_adam", ["cpu_adam.so"]), (default / "old_op", ["old_op.so"])):
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_bytes(b"")
    os.utime(default / "old_op" / "old_op.so", (1.0, 1.0))  # built long before the session
    since = (ours / "cpu_adam" / "cpu_adam.so").stat().st_mtime - 1
    assert sorted(testing.ops_built_elsewhere(ours, since)) == sorted([str(ours / "async_io" / "async_io_v1.so"),
                                                                       str(default / "cpu_adam")])
    assert testing.ops_built_elsewhere(ours, time.time() + 60) == []
