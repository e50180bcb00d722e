"""No hang, no silent wait: a stale DeepSpeed build lock, a rank whose launcher is gone, a rendezvous that never
completes, and SIGINT / SIGTERM / SIGKILL to every launcher and to a rank.

The signal table (tests/test_hangs.py::test_signal_ends_every_rank) starts a real 2-rank tiny job under each launcher,
waits until it trains, sends one signal to one process alone (not to its group), and measures the seconds until every
process of the job (launchers and ranks, in whatever session) has exited; docs/parallelism.md has the numbers.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from finetune import compat, testing
from finetune.training import watchdog
from launch import matrix

BOUND = 30  # seconds: a signalled job is gone within this
ORPHAN_BOUND = 60  # seconds: a rank whose launcher is gone exits within this, with a message


# ----------------------------------------------------------------------------------------------
# The build lock (torch's FileBaton under DeepSpeed's op builds).


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    folder = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder))
    return folder


def test_torch_alone_waits_forever_on_a_dead_builds_lock(ext_dir):
    """The defect: torch's FileBaton polls while the file exists, printing nothing, whoever made it."""
    from torch.utils.file_baton import FileBaton

    lock = ext_dir / "op" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # what a build killed by Ctrl-C or kill -9 leaves
    waiter = threading.Thread(target=FileBaton(str(lock)).wait, daemon=True)
    waiter.start()
    waiter.join(3)
    assert waiter.is_alive()  # still waiting after 3 s, and it would forever
    lock.unlink()
    waiter.join(3)
    assert not waiter.is_alive()


def test_a_dead_builds_lock_is_removed_with_a_message(ext_dir):
    lock = ext_dir / "op" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    said = []
    import torch.utils.cpp_extension  # noqa: F401  (imported before the clock starts)

    start = time.monotonic()
    with compat.build_lock("op", log=said.append):
        held = time.monotonic() - start
        assert not lock.exists()
    assert held < 5, held
    assert said == [f"removed the stale build lock {lock}: no process holds it or works in its folder (a build of the "
                    "op op was interrupted); building or loading op now"]


def test_a_finetune_builder_holding_the_lock_is_named_while_waiting(ext_dir):
    """Another finetune process builds: the waiter says who, every minute after 30 s (here 1 s), then proceeds."""
    got, said = threading.Event(), []

    def other_builder():
        with compat.build_lock("op", log=said.append):
            got.set()
            time.sleep(2.5)

    builder = threading.Thread(target=other_builder)
    builder.start()
    got.wait(10)
    start = time.monotonic()
    with compat.build_lock("op", log=said.append, report_after=1.0):
        waited = time.monotonic() - start
    builder.join()
    assert 1.5 < waited < 6, waited
    [message] = said
    guard = ext_dir / ".op.finetune-lock"
    assert message.startswith(f"waiting 1 s for the build lock {guard} of the op op, held by pid {os.getpid()} on ")
    assert f"it is building or loading {ext_dir / 'op'}" in message


HOLDER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)  # torch's FileBaton.try_acquire, as another program's build
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
"""  # exits without removing the file: a build that died


@pytest.mark.slow
def test_another_programs_live_build_is_waited_for_then_its_dead_lock_removed(ext_dir, tmp_path):
    import torch.utils.cpp_extension  # noqa: F401  (imported before the clock starts)

    lock = ext_dir / "op" / "lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        said = []
        start = time.monotonic()
        with compat.build_lock("op", log=said.append, report_after=1.0):
            waited = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    assert 2 < waited < 10, waited
    assert re.match(rf"waiting \d+ s for the build lock {re.escape(str(lock))} of the op op, held by pid {holder.pid} \(",
                    said[0]), said
    assert said[-1].startswith(f"removed the stale build lock {lock}: no process holds it")


def test_ops_are_compiled_without_debug_information(ext_dir, monkeypatch):
    """The guarded load hands torch DeepSpeed's flags (here cpu_adam's, -g among them) without -g and with -g0 last,
    under the build lock."""
    import torch.utils.cpp_extension as ext
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    calls = []
    monkeypatch.setattr(ext, "load", lambda name, *args, **kwargs: calls.append((name, kwargs)))
    compat.guard_extension_builds()
    flags = CPUAdamBuilder().cxx_args()
    assert "-g" in flags and "-O3" in flags, flags
    ext.load("cpu_adam", sources=["a.cpp"], extra_cflags=list(flags))
    [(name, kwargs)] = calls
    assert kwargs["extra_cflags"] == [f for f in flags if f != "-g"] + ["-g0"], kwargs
    assert (ext_dir / ".cpu_adam.finetune-lock").exists()


def test_each_virtualenv_gets_its_own_extensions_folder(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    ours = compat.extensions_dir()
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    other = compat.extensions_dir()
    assert ours != other and ours.parent == other.parent and ours.name.startswith(f"py{sys.version_info[0]}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/explicit")
    assert compat.extensions_dir() == Path("/explicit")  # the user's choice wins


LOAD_SHM = """
import sys, time
start = time.monotonic()
if sys.argv[1] == "guarded":
    from finetune.training import core
    core.start_run()
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
print("loading the op", flush=True)
builder.load()
print(f"loaded in {time.monotonic() - start:.1f} s", flush=True)
"""


@pytest.mark.slow
def test_deepspeed_op_load_with_a_planted_dead_lock(tmp_path):
    """A real DeepSpeed op (deepspeed_shm_comm, what every CPU DeepSpeed run loads first) in a private copy of this
    virtualenv's extensions folder, with a `lock` left by a dead build: DeepSpeed alone is still waiting after 10 s,
    silently; under finetune the lock is removed with a message and the op loads."""
    source = compat.extensions_dir() / "deepspeed_shm_comm"
    ninja = source / "build.ninja"
    # Built here once (about a minute), then reused by every run; again if an earlier finetune built it otherwise.
    if not (source / "deepspeed_shm_comm.so").is_file() or "-g0" not in ninja.read_text():
        testing.run([sys.executable, "-c", LOAD_SHM, "guarded"], timeout=600).check()
    # Built through the guard: its flags end with -g0 (compat.without_debug_info).
    cflags = next(line for line in ninja.read_text().splitlines() if line.startswith("cflags = ")).split()
    assert cflags[-1] == "-g0" and "-O2" in cflags, cflags
    private = tmp_path / "ext"
    shutil.copytree(source, private / "deepspeed_shm_comm")
    (private / "deepspeed_shm_comm" / "lock").touch()
    with testing.Launched([sys.executable, "-c", LOAD_SHM, "plain"], testing.REPO,
                     testing.env(TORCH_EXTENSIONS_DIR=str(private))) as plain:
        plain.wait(120, until=lambda: "loading the op" in plain.output)  # past the imports, at the lock
        assert "loading the op" in plain.output, plain.output[-3000:]
        assert not plain.wait(10)  # the guarded load below, lock removal included, takes about 2 s
        assert "loaded" not in plain.output and "lock" not in plain.output
        plain.kill()
    start = time.monotonic()
    result = testing.run([sys.executable, "-c", LOAD_SHM, "guarded"], timeout=120,
                         TORCH_EXTENSIONS_DIR=str(private)).check()
    elapsed = time.monotonic() - start
    assert f"removed the stale build lock {private / 'deepspeed_shm_comm' / 'lock'}" in result.output
    assert "loaded in" in result.output and elapsed < 60, (elapsed, result.output[-3000:])


# ----------------------------------------------------------------------------------------------
# The watchdog: what a rank waits for, and no rank without its launcher.


def test_launchers_are_recognized_by_their_command_line():
    venv = "/x/.venv/bin"
    assert watchdog._is_launcher([f"{venv}/python", f"{venv}/deepspeed", "--num_gpus", "2", "sft.py"])
    assert watchdog._is_launcher(["python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30="])
    assert watchdog._is_launcher([f"{venv}/python", f"{venv}/torchrun", "--nproc_per_node", "2"])
    assert watchdog._is_launcher(["python", "-m", "torch.distributed.run", "--nproc_per_node", "2"])
    assert watchdog._is_launcher([f"{venv}/python", f"{venv}/accelerate", "launch", "train.py"])
    assert not watchdog._is_launcher(["bash"]) and not watchdog._is_launcher(["python", "-m", "pytest", "tests"])
    # A script argument that mentions a launcher does not make a launcher.
    assert not watchdog._is_launcher(["python", "train.py", "--config", "ds_configs/deepspeed.json"])


RENDEZVOUS = """
import datetime, os, sys, threading
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], WORLD_SIZE="2", RANK="0")
import torch.distributed as dist
from finetune.training import watchdog
watchdog.Watchdog([], report_after=2.0).start()
dist.init_process_group("gloo", world_size=2, rank=0, timeout=datetime.timedelta(seconds=float(sys.argv[2])))
"""


@pytest.mark.slow
def test_a_rank_waiting_in_the_rendezvous_says_so(tmp_path):
    """Rank 1 never comes: rank 0 says what it waits for (here after 2 s instead of 30) until the timeout."""
    port = testing.free_port()
    result = testing.run([sys.executable, "-c", RENDEZVOUS, str(port), "8"], timeout=120, cwd=tmp_path)
    assert result.returncode != 0
    line = (f"finetune: rank 0: waiting 2 s for the rendezvous of 2 ranks at 127.0.0.1:{port} (every rank must start "
            "and reach it)")
    assert line in result.output, result.output[-3000:]


# ----------------------------------------------------------------------------------------------
# Signals to every launcher and to a rank, on a real 2-rank job that is training.

K, T, I = signal.SIGKILL, signal.SIGTERM, signal.SIGINT
LAUNCHER_OF = {"torchrun": "torchrun", "accelerate": "accelerate launch", "deepspeed": "deepspeed",
               "deepspeed.launcher.launch": "deepspeed.launcher.launch"}
EVERY_TRIAL = [  # (launcher, who gets the signal, signal)
    *[(launcher, "launcher", sig) for launcher in ("torchrun", "accelerate", "deepspeed") for sig in (I, T)],
    ("deepspeed", "deepspeed.launcher.launch", I), ("deepspeed", "deepspeed.launcher.launch", T),
    ("torchrun", "launcher", K), ("deepspeed", "deepspeed.launcher.launch", K),  # the watchdog's cases
    ("torchrun", "rank", I), ("torchrun", "rank", T), ("deepspeed", "rank", I), ("deepspeed", "rank", T),
]
# CI's cover: each launcher and a rank with SIGINT or SIGTERM (both signals over them), and both watchdog cases (one
# of them SIGKILL to DeepSpeed's per-node launch process); all 14 with FINETUNE_FULL_MATRIX=1.
TRIALS = matrix(EVERY_TRIAL, [
    ("torchrun", "launcher", T), ("accelerate", "launcher", I), ("deepspeed", "launcher", T),
    ("torchrun", "launcher", K), ("deepspeed", "deepspeed.launcher.launch", K), ("torchrun", "rank", I),
])
TABLE: list[str] = []


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root, model, data = testing.tiny_job(tmp_path_factory.mktemp("signals"), records=64)
    yield root, model, data
    if TABLE:
        print("\nlauncher | process signalled | signal | seconds until every process of the job is gone\n"
              + "\n".join(TABLE))


@pytest.mark.slow
@pytest.mark.parametrize("launcher, target, sig", TRIALS,
                         ids=[f"{lau}-{tgt}-{signal.Signals(s).name}" for lau, tgt, s in TRIALS])
def test_signal_ends_every_rank(job, launcher, target, sig):
    """SIGINT / SIGTERM to any launcher or to a rank ends every rank within 30 s; after SIGKILL of a launcher (or
    the `deepspeed` runner's SIGINT / SIGTERM, which it does not pass on) each rank's watchdog says why it stops."""
    root, model, data = job
    flags = ["--model_name_or_path", str(model), "--dataset", str(data), "--dataset_cache_dir", str(root / "cache"),
             "--output_dir", str(root / f"out-{launcher}-{target}-{sig}"), "--max_steps", "100000",
             "--logging_steps", "1", "--per_device_train_batch_size", "2", "--disable_tqdm", "true"]
    if launcher == "deepspeed":
        cmd = testing.deepspeed_launcher(2) + flags + ["--config", "ddp"]
    else:
        cmd = testing.launcher(launcher, 2, script=testing.LOOP) + flags
    stopped = testing.run_and_signal(cmd, target, sig, ready="'loss'", bound=ORPHAN_BOUND)
    name = LAUNCHER_OF[target] if target in LAUNCHER_OF else LAUNCHER_OF[launcher] if target == "launcher" else "rank 1"
    TABLE.append(f"{LAUNCHER_OF[launcher]} | {name} | {signal.Signals(sig).name} | "
                 f"{'still running' if stopped.seconds is None else f'{stopped.seconds:.1f}'}")
    assert not stopped.survivors, (stopped.survivors, stopped.output[-4000:])
    assert stopped.seconds < BOUND, (stopped.seconds, stopped.output[-4000:])
    orphaned = sig == K or (launcher, target) == ("deepspeed", "launcher")
    if orphaned:  # a rank that lost its launcher says so (its peer may first see the connection close)
        assert re.search(r"finetune: rank [01]: the launcher `.*` \(pid \d+\) that (started|runs) this rank is gone; "
                         "stopping this rank, as no rank outlives its launcher", stopped.output), stopped.output[-4000:]
    if sig == I and target == "rank":
        assert "finetune: rank 1: interrupted (SIGINT); stopping this rank" in stopped.output, stopped.output[-4000:]
