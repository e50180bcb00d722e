"""Start real multi-process jobs on loopback, for tests and benchmarks.

Free ports, the launch lines users type, and runs in which every wait is bounded and no process is left
behind: launchers such as torch elastic start their ranks in sessions of their own, out of reach of a kill of
the launcher's process group, so a job's processes are tracked (descendants seen while it runs, and an
environment tag every process of the job inherits) and killed one by one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

# The checkout the code comes from (this package's parent folder): its launcher files run, and PYTHONPATH points
# at it, whichever copy `pip install -e` registered.
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TRAIN = str(REPO / "finetune" / "train.py")
LOOP = str(REPO / "finetune" / "loop.py")
ENGINE = str(REPO / "scripts" / "sft.py")  # the engine path's launcher file

# Every process of a job inherits this variable; its value lists the tags of the jobs it belongs to (nested runs).
TAG_VAR = "FINETUNE_TESTING_JOB"
LINGER = 5.0  # after the launcher exits: how long its processes may take to finish before they count as left behind
DRAIN = 10.0  # after a kill: how long the output pipe may stay open


def tiny_job(root: Path, records: int = 72, seed: int = 7, **model: int) -> tuple[Path, Path, Path]:
    """(root, model folder, data file): a tiny random Llama (chatml tokenizer) and synthetic chat records."""
    from finetune.models import tiny

    path = tiny.build(root / "model", style="chatml", **model)
    return root, path, tiny.write_jsonl(root / "data.jsonl", tiny.synthetic_records(records, seed=seed))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update(
        HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu",
        # Two ranks on two cores: more threads per rank only oversubscribes (3x slower).
        OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1",
        # A process that gets SIGABRT (Launched.abort, on a timeout) prints every thread's Python stack first.
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        e.pop(key, None)
    e.update(extra)
    return e


def launcher(kind: str, nproc: int = 2, config_file: str | None = None, script: str = TRAIN) -> list[str]:
    """The launch line a user would type, for each supported launcher."""
    port = str(free_port())
    if kind == "python":
        return [sys.executable, script]
    if kind == "accelerate":
        cmd = [str(BIN / "accelerate"), "launch", "--main_process_ip", "127.0.0.1", "--main_process_port", port]
        if config_file:
            return cmd + ["--config_file", str(REPO / config_file), "--num_processes", str(nproc), script]
        return cmd + ["--multi_gpu", "--num_processes", str(nproc), "--num_machines", "1",
                      "--mixed_precision", "no", "--dynamo_backend", "no", script]
    if kind == "torchrun":
        return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                "--master_port", port, script]
    raise ValueError(kind)


def deepspeed_launcher(nproc: int = 2, script: str = ENGINE) -> list[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), script]


NODES_TIMEOUT = 300.0  # `finetune nodes --timeout` in the tests' launch lines (its default)
SLURM_SCRIPT = REPO / "scripts" / "slurm" / "finetune.sbatch"


def node_launcher(kind: str, node_rank: int, port: int, nnodes: int = 2, script: str = TRAIN,
                  hostfile: Path | None = None, timeout: float = NODES_TIMEOUT) -> list[str]:
    """The launch line of one node of an `nnodes`-node job, one rank per node, all "nodes" on 127.0.0.1, as
    docs/multi-node.md gives it: `finetune nodes --timeout S` then the launcher's line.

    Every node's line names the same `port` (node 0's rendezvous); deepspeed's runner also needs a `hostfile`
    (see write_hostfile) and starts this node's ranks itself (`--no_ssh`). "slurm" runs
    scripts/slurm/finetune.sbatch as one node's share of its `srun` (see slurm_stubs; the hostfile argument
    names the stubs' folder)."""
    nodes = [str(BIN / "finetune"), "nodes", "--timeout", f"{timeout:g}"]
    if kind == "torchrun":
        return nodes + [str(BIN / "torchrun"), "--nnodes", str(nnodes), "--node_rank", str(node_rank),
                        "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), script]
    if kind == "accelerate":  # --num_processes counts every node's processes
        return nodes + [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_machines", str(nnodes),
                        "--machine_rank", str(node_rank), "--num_processes", str(nnodes), "--main_process_ip",
                        "127.0.0.1", "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend",
                        "no", script]
    if kind == "deepspeed":
        assert hostfile is not None, "deepspeed needs a hostfile: write_hostfile()"
        return nodes + [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank",
                        str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port), script]
    if kind == "slurm":
        assert hostfile is not None, "slurm needs the stubs' folder: slurm_stubs()"
        stubs = hostfile if hostfile.is_dir() else slurm_stubs(hostfile.parent / "slurm-stubs")
        return ["env", f"PATH={stubs}{os.pathsep}{os.environ.get('PATH', '')}", "SLURM_JOB_NODELIST=loopback",
                f"SLURM_NTASKS={nnodes}", f"SLURM_PROCID={node_rank}", "SLURM_JOB_ID=1", "NPROC_PER_NODE=1",
                f"FINETUNE_SCRIPT={script}", f"TORCHRUN={BIN / 'torchrun'}", f"FINETUNE={BIN / 'finetune'}",
                f"RDZV_PORT={port}", f"NODES_TIMEOUT={timeout:g}", "bash", str(SLURM_SCRIPT)]
    raise ValueError(kind)


def slurm_stubs(folder: Path) -> Path:
    """`srun` and `scontrol` for running scripts/slurm/finetune.sbatch as one node's task: srun runs its command
    once (this node's task; SLURM_PROCID comes from the line), scontrol names 127.0.0.1 as the job's first node."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in (("srun", 'while [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n'),
                       ("scontrol", "echo 127.0.0.1\n")):
        (folder / name).write_text("#!/bin/sh\n" + body)
        (folder / name).chmod(0o755)
    return folder


def write_hostfile(path: Path, nnodes: int = 2) -> Path:
    """DeepSpeed's hostfile for `nnodes` one-slot nodes (with --no_ssh the names are only labels)."""
    path.write_text("".join(f"node{i} slots=1\n" for i in range(nnodes)))
    return path


def losses(output_dir: str | Path) -> list[float]:
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def eval_entries(output_dir: str | Path) -> list[dict]:
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "eval_loss" in entry]


def eval_losses(output_dir: str | Path) -> list[float]:
    return [entry["eval_loss"] for entry in eval_entries(output_dir)]


# The warning lines an ordinary run may still print, each allowed by a name found in the line, and why it stays.
ALLOWED_WARNINGS = {
    # finetune.compat.check_versions: printed only when an installed library is outside the versions the
    # workarounds were tested on; it names what may misbehave, so the user can act on it.
    "is outside the range finetune was tested with": "an untested library version: actionable, and only then",
    # DeepSpeed's own launcher (the `deepspeed` command, before any finetune code runs) on one node with no hostfile
    # at /job/hostfile: true and harmless; a multi-node job passes --hostfile (docs/multi-node.md). Its runner has
    # no flag that drops this line alone.
    "Unable to find hostfile, will proceed with training with local resources only":
        "DeepSpeed's launcher on one node without a hostfile: what it says, and the user's launch line decides it",
}
_WARNING_LINE = re.compile(r"warn|^[WE]\d{4} \d\d:\d\d:\d\d", re.IGNORECASE)  # words, and glog's W/E lines (torch elastic)


def unexpected_warnings(output: str, allowed: dict[str, str] = ALLOWED_WARNINGS) -> list[str]:
    """The lines of a job's output that look like warnings and are not allowed by name."""
    return [line for line in output.splitlines()
            if _WARNING_LINE.search(line) and not any(name in line for name in allowed)]


def _in_child() -> None:
    """Run in a job's process before its command: SIGINT as a terminal gives it, and no core file (Launched.abort)."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@dataclass
class Result:
    returncode: int
    output: str

    def check(self) -> "Result":
        assert self.returncode == 0, f"exit {self.returncode}\n{self.output[-6000:]}"
        return self


def _abort_main_thread(pid: int) -> None:
    """SIGABRT to the process's main thread (tgkill), not the process: a signal sent to a stopped process waits for
    any thread to take it, and when a helper thread did, the main thread ran on while the dump was written (a
    launcher whose rank had just died left its wait and was found in interpreter shutdown, not where it had waited:
    test_a_timeout_shows_where_each_process_waits, once in a full suite). The main thread takes it before it runs
    another line."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    tgkill = getattr(libc, "tgkill", None)
    if tgkill is None or tgkill(pid, pid, signal.SIGABRT) != 0:
        try:
            os.kill(pid, signal.SIGABRT)
        except OSError:
            pass


def _running(p) -> bool:
    """Alive and not a zombie (an orphan's exit is collected by PID 1, which may take its time)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Launched:
    """One started command: output read by a thread, its processes tracked, all of them killable."""

    def __init__(self, cmd: list[str], cwd: Path, environ: dict[str, str]):
        import psutil

        self.cmd = cmd
        self.tag = uuid.uuid4().hex
        environ = dict(environ)
        environ[TAG_VAR] = ",".join(filter(None, [environ.get(TAG_VAR), self.tag]))
        # SIGINT as a terminal gives it: a test run started in the background (`cmd &`, nohup) inherits SIGINT
        # ignored, and Python then never installs its handler, so the launcher would not see a Ctrl-C.
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_in_child)
        self.root = psutil.Process(self.proc.pid)
        self.seen: dict[int, psutil.Process] = {}
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for chunk in iter(lambda: self.proc.stdout.read1(1 << 16), b""):
            self._chunks.append(chunk)

    @property
    def output(self) -> str:
        return b"".join(self._chunks).decode("utf-8", errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def watch(self) -> None:
        """Remember the launcher's descendants now: a rank in its own session is found only while its parent lives."""
        import psutil

        if self.proc.poll() is not None:  # its pid may belong to another process by now
            return
        try:
            for p in self.root.children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def wait(self, seconds: float, until=None) -> bool:
        """Wait at most `seconds` for the launcher to exit (or for `until()` to be true): True if it happened."""
        deadline = time.monotonic() + seconds
        while True:
            self.watch()
            if self.proc.poll() is not None or (until is not None and until()):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                self.proc.wait(timeout=min(0.25, left))
            except subprocess.TimeoutExpired:
                pass

    def alive(self) -> list:
        """The job's processes still running (the launcher excluded): seen descendants and tagged processes."""
        import psutil

        found = {pid: p for pid, p in self.seen.items()}
        for p in psutil.process_iter():
            if p.pid in found or p.pid == self.proc.pid or p.pid == os.getpid():
                continue
            try:
                if self.tag in p.environ().get(TAG_VAR, "").split(","):
                    found[p.pid] = p
            except psutil.Error:
                continue
        return [p for p in found.values() if _running(p)]

    def kill(self) -> None:
        """SIGKILL the launcher's group, then every process of the job and each one's own group; bounded waits."""
        import psutil

        self.watch()
        own = os.getpgrp()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        procs = self.alive()
        for p in procs:
            try:
                if not p.is_running():
                    continue
                pgid = os.getpgid(p.pid)
                if pgid != own:
                    os.killpg(pgid, signal.SIGKILL)
                p.kill()
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        deadline = time.monotonic() + 5
        while any(_running(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def abort(self, grace: float = 2.0) -> None:
        """On a timeout: make every process of the job print its threads' Python stacks into the output (SIGABRT;
        PYTHONFAULTHANDLER is set by env()), then kill what is left and read the output to its end. All are stopped
        first, then woken one at a time, ranks before launchers: none reacts to another's end before its own dump,
        and the dumps do not interleave."""
        import psutil

        self.watch()
        procs = sorted(self.alive(), key=lambda p: -p.pid) + ([self.root] if self.proc.poll() is None else [])
        for p in procs:
            try:
                p.send_signal(signal.SIGSTOP)
            except psutil.Error:
                pass
        for p in procs:
            _abort_main_thread(p.pid)
        for p in procs:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                continue
            deadline = time.monotonic() + grace
            while _running(p) and time.monotonic() < deadline:
                time.sleep(0.05)
        self.kill()
        self.drain()

    def drain(self, seconds: float = DRAIN) -> bool:
        """Wait at most `seconds` for the output pipe to close: True if everything was read."""
        self._reader.join(seconds)
        return not self._reader.is_alive()

    def finish(self, linger: float = LINGER) -> list[int]:
        """After the launcher exited: give its processes `linger` seconds to end, then kill what is left.

        Returns the pids that were still running (empty when the job ended cleanly)."""
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline:
            if not self._reader.is_alive() and not self.alive():
                break
            self._reader.join(0.25)
        left = self.alive()
        if left:
            self.kill()
        if not self.drain():
            # Something outside the job's tracked processes still holds the pipe.
            raise AssertionError(f"output of {' '.join(self.cmd)} still open {linger + DRAIN:.0f}s after it exited "
                                 f"({self.proc.returncode})\n{self.output[-6000:]}")
        return [p.pid for p in left]

    def __enter__(self) -> "Launched":
        return self

    def __exit__(self, *exc) -> None:
        """On any way out (an assertion, Ctrl-C): nothing of the job keeps running."""
        if self.proc.poll() is None or self.alive():
            self.kill()
            self.drain()


def run(cmd: list[str], timeout: float = 300, cwd: Path = REPO, **extra_env: str) -> Result:
    """Run `cmd` to its end, at most `timeout` seconds, then kill every process it started.

    A process left running after the launcher exited, or anything still running at the timeout, is an error.
    """
    with Launched(cmd, cwd, env(**extra_env)) as job:
        if not job.wait(timeout):
            job.abort()
            raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{job.output[-12000:]}")
        left = job.finish()
        if left:
            raise AssertionError(f"{' '.join(cmd)} exited ({job.returncode}) leaving {len(left)} process(es) running "
                                 f"(killed): {left}\n{job.output[-6000:]}")
        shm = shm_left(cmd)
        if shm:
            raise AssertionError(f"{' '.join(cmd)} left DeepSpeed's shared-memory buffers (removed): {shm}")
        return Result(job.returncode, job.output)


def finish(*procs: subprocess.Popen, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Independent processes started together (each is mostly single-threaded imports: two cores run two at once),
    each awaited to its end (stdout and stderr piped); any still running at the timeout, or on any way out, is killed."""
    try:
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return results
    finally:
        _kill(procs)


def side_by_side(cmds: list[list[str]], timeout: float = 300, **popen_kw) -> list[subprocess.CompletedProcess]:
    """`cmds` started together (Popen keywords: cwd, env), then `finish`ed; if one fails to start, the others are
    killed."""
    procs = []
    try:
        for cmd in cmds:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kw))
    except BaseException:
        _kill(procs)
        raise
    return finish(*procs, timeout=timeout)


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def shm_left(cmd: list[str]) -> list[str]:
    """DeepSpeed shared-memory buffers of the job on `cmd`'s --master_port still in /dev/shm (removed here)."""
    if "--master_port" not in cmd:
        return []
    port = cmd[cmd.index("--master_port") + 1]
    found = []
    from finetune.compat import SHM_BUFFER, SHM_DIR

    for path in sorted(SHM_DIR.glob(f"{SHM_BUFFER}_*_{port}_*")):
        found.append(f"{path.name} ({path.stat().st_size / 2**20:.0f} MiB)")
        path.unlink(missing_ok=True)
    return found


def rank_pids(root_pid: int) -> dict[int, int]:
    """rank -> pid of the training processes among `root_pid`'s descendants (any launcher sets RANK)."""
    import psutil

    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for child in children:
        try:
            rank = child.environ().get("RANK")
            if rank is not None and "python" in os.path.basename(child.exe()):
                out[int(rank)] = child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


@dataclass
class Killed:
    returncode: int
    output: str
    exit_seconds: float  # from the kill to the launcher's exit
    survivors: list[int]  # processes of the job still running after the launcher exited (killed; should be none)
    output_at_kill: int = 0  # how much of `output` there was when the kill was sent


def stop_env(rank: int, step: int, delay: float = 0.0) -> dict[str, str]:
    """The environment that makes rank `rank` stop itself `delay` s after its optimizer step `step`
    (finetune.training.faults.stop_point), so that it can be killed at that point of the run."""
    from finetune.training.faults import STOP_VAR

    return {STOP_VAR: f"{rank}:{step}:{delay}"}


def stopped_rank(root_pid: int, rank: int) -> int | None:
    """The pid of rank `rank` under `root_pid` if it is stopped (SIGSTOP), else None."""
    import psutil

    pid = rank_pids(root_pid).get(rank)
    try:
        return pid if pid is not None and psutil.Process(pid).status() == psutil.STATUS_STOPPED else None
    except psutil.NoSuchProcess:
        return None


def run_and_kill_rank(cmd: list[str], when: Path | None, rank: int = 1, timeout: float = 300, exit_bound: float = 120,
                      stop_at: tuple[int, float] | None = None, **extra_env: str) -> Killed:
    """Start `cmd`, and as soon as the file `when` exists, `kill -9` the process of one rank (not a clean stop).

    stop_at=(step, delay): the rank stops itself `delay` s after optimizer step `step` (stop_env) and is killed
    there; `when` (None: no file) must exist by then. A short run cannot end before the harness sees `when`.
    Then wait, at most `exit_bound` seconds, for the launcher to exit by itself: the other ranks must not hang.
    Every process of the job is killed on any failure, so no rank outlives the test.
    """
    if stop_at is not None:
        extra_env.update(stop_env(rank, *stop_at))
    with Launched(cmd, REPO, env(**extra_env)) as job:
        ready = when.exists if stop_at is None else (lambda: stopped_rank(job.proc.pid, rank) is not None)
        what = when if stop_at is None else f"rank {rank} stopped after step {stop_at[0]} (+{stop_at[1]} s)"
        if not job.wait(timeout, until=ready):
            job.abort()
            raise AssertionError(f"{what} did not happen in {timeout}s\n{job.output[-12000:]}")
        if job.returncode is not None or (when is not None and not when.exists()):
            job.finish()
            raise AssertionError(f"exited ({job.returncode}) or {when} missing when {what}\n{job.output[-6000:]}")
        ranks = rank_pids(job.proc.pid)
        assert rank in ranks, f"no process with RANK={rank} under {cmd[0]}: {ranks}"
        at_kill = len(job.output)
        os.kill(ranks[rank], signal.SIGKILL)
        killed_at = time.time()
        if not job.wait(exit_bound):
            job.abort()
            raise AssertionError(f"still running {exit_bound}s after rank {rank} was killed\n{job.output[-12000:]}")
        exit_seconds = time.time() - killed_at
        survivors = job.finish()
        return Killed(job.returncode, job.output, exit_seconds, survivors, at_kill)


# ----------------------------------------------------------------------------------------------
# Signals: how long until every process of a job is gone after a signal to one of them.


@dataclass
class Stopped:
    target: str  # what got the signal: "launcher", "rank", or a name in its command line
    pid: int
    seconds: float | None  # from the signal until no process of the job runs; None: some still ran at the bound
    output: str
    survivors: list[str]  # command lines still running at the bound (then killed)


def find_process(job: "Launched", target: str) -> int:
    """The pid of `target` in a running job: "launcher" (the command itself), "rank" (the process with RANK=1, or
    the only rank), or the first process whose command line contains `target` (e.g. deepspeed.launcher.launch)."""
    import psutil

    if target == "launcher":
        return job.proc.pid
    if target == "rank":
        ranks = rank_pids(job.proc.pid)
        if ranks:
            return ranks[max(ranks)]
    job.watch()
    procs = sorted(job.seen.values(), key=lambda p: p.pid)
    for p in procs:
        try:
            if target != "rank" and any(target in part for part in p.cmdline()[:4]):
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no process {target!r} in {' '.join(job.cmd)}: "
                         f"{[' '.join(p.cmdline()[:4]) for p in procs if _running(p)]}")


def run_and_signal(cmd: list[str], target: str, sig: int, ready: str, *, timeout: float = 300, bound: float = 60,
                   **extra_env: str) -> Stopped:
    """Start `cmd`; once its output contains `ready`, send `sig` to `target` (see find_process) alone, not to a
    process group; then time how long until every process of the job (launchers and ranks, in whatever session)
    has exited, at most `bound` seconds. Whatever still runs then is killed and listed."""
    with Launched(cmd, REPO, env(**extra_env)) as job:
        if not job.wait(timeout, until=lambda: ready in job.output):
            job.abort()
            raise AssertionError(f"{ready!r} did not appear in {timeout}s\n{job.output[-12000:]}")
        if job.returncode is not None:
            job.finish()
            raise AssertionError(f"exited ({job.returncode}) before the signal\n{job.output[-6000:]}")
        time.sleep(1.0)  # the ranks' descendants seen, training under way
        job.watch()
        pid = find_process(job, target)
        os.kill(pid, sig)
        sent = time.monotonic()
        seconds = None
        while time.monotonic() - sent < bound:
            job.watch()
            if job.proc.poll() is not None and not job.alive():
                seconds = time.monotonic() - sent
                break
            time.sleep(0.2)
        survivors = []
        for p in job.alive() + ([job.root] if job.proc.poll() is None else []):
            try:
                survivors.append(" ".join(p.cmdline()[:4]))
            except Exception:
                continue
        if survivors:
            job.kill()
        job.drain()
        return Stopped(target, pid, seconds, job.output, survivors)


# Several "nodes" on loopback: one launcher per node, started together, each one's processes tracked.


def run_nodes(cmds: list[list[str]], timeout: float = 300, delays: list[float] | None = None,
              **extra_env: str) -> list[Result]:
    """Run one launch line per node, to their end (at most `timeout` s in all); no process may outlive it.
    delays: seconds after the first node's start at which each node starts (default: all at once)."""
    jobs: list[Launched] = []
    try:
        start = time.monotonic()
        for cmd, delay in zip(cmds, delays or [0.0] * len(cmds)):
            while time.monotonic() < start + delay and not any(job.returncode is not None for job in jobs):
                for job in jobs:  # a node that already ended stops the wait: its output says why
                    job.watch()
                time.sleep(0.1)
            jobs.append(Launched(cmd, REPO, env(**extra_env)))
        deadline = start + timeout
        for job in jobs:
            if not job.wait(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"timed out after {timeout}s: {' '.join(job.cmd)}\n" + _outputs(jobs))
        for job in jobs:
            left = job.finish()
            if left:
                raise AssertionError(f"{' '.join(job.cmd)} exited ({job.returncode}) leaving {left} running\n"
                                     + _outputs(jobs))
        return [Result(job.returncode, job.output) for job in jobs]
    finally:
        for job in jobs:
            job.__exit__()


def run_nodes_and_kill_rank(cmds: list[list[str]], when, node: int = 1, timeout: float = 300,
                            exit_bound: float = 120, delay: float = 0.0, **extra_env: str) -> list[Killed]:
    """Start one launch line per node; as soon as `when()` is true (or the file `when` exists), wait `delay` s and
    `kill -9` the rank on node `node` (one rank per node). Then every node's launcher must exit by itself within
    `exit_bound` s, none left running. exit_seconds: from the kill to that node's launcher exit."""
    until = when.exists if isinstance(when, Path) else when
    jobs = [Launched(cmd, REPO, env(**extra_env)) for cmd in cmds]
    try:
        target = jobs[node]
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline or any(job.returncode is not None for job in jobs):
                raise AssertionError(f"{when} not reached (timeout {timeout}s or a node exited)\n" + _outputs(jobs))
            for job in jobs:
                job.watch()
            time.sleep(0.02)
        if delay:
            time.sleep(delay)
        ranks = rank_pids(target.proc.pid)
        assert len(ranks) == 1, f"expected one rank under node {node}'s launcher: {ranks}\n" + _outputs(jobs)
        os.kill(next(iter(ranks.values())), signal.SIGKILL)
        killed_at = time.time()
        out = []
        for job in jobs:
            if not job.wait(max(0.0, killed_at + exit_bound - time.time())):
                raise AssertionError(f"still running {exit_bound}s after the kill: {' '.join(job.cmd)}\n"
                                     + _outputs(jobs))
            out.append(time.time() - killed_at)
        return [Killed(job.returncode, job.output, seconds, job.finish()) for job, seconds in zip(jobs, out)]
    finally:
        for job in jobs:
            job.__exit__()


def _outputs(jobs: list[Launched]) -> str:
    return "\n".join(f"--- node {i}: {' '.join(job.cmd[:2])} (exit {job.returncode})\n{job.output[-4000:]}"
                     for i, job in enumerate(jobs))


def ops_built_elsewhere(ours: Path, since: float) -> list[str]:
    """DeepSpeed ops JIT-built since `since` anywhere but `ours` (this virtualenv's folder, which every finetune
    process builds into through compat.guard_extension_builds), or built in it again under other flags (torch names
    such a rebuild NAME_v1): each one a second build of an op, a minute of CPU or more."""
    found = []
    for folder in sorted(p for p in ours.parent.glob("*/*") if p.is_dir()):
        built = [so for so in folder.glob("*.so") if so.stat().st_mtime >= since]
        if folder.parent == ours:
            found += [str(so) for so in built if re.search(r"_v\d+\.so$", so.name)]
        elif built:
            found.append(str(folder))
    return found


# ----------------------------------------------------------------------------------------------
# Host-device syncs, counted on a CPU.

# Tensor methods and torch functions whose result the host needs before it can go on: on a GPU each waits for every
# kernel queued before it (torch.cuda.set_sync_debug_mode reports the same places).
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "nonzero", "cpu",
                "numpy", "equal", "unique", "unique_consecutive", "masked_select", "bincount", "argwhere")
SYNC_FUNCTIONS = ("nonzero", "unique", "unique_consecutive", "masked_select", "equal", "allclose", "bincount",
                  "argwhere", "repeat_interleave")
_FINETUNE_DIR = str(REPO / "finetune") + os.sep
# Calls made on host data by design, wherever they are: the data loader (collators run in its workers on a GPU
# machine, on CPU tensors) and torch's optimizers (their step counters stay on the host unless capturable).
HOST_SIDE = (os.sep + os.path.join("torch", "utils", "data") + os.sep, os.sep + os.path.join("torch", "optim") + os.sep)


class SyncCounter:
    """Counts the calls that force a host-device sync (SYNC_METHODS, SYNC_FUNCTIONS, indexing with a bool mask, a
    copy `.to("cpu")` by name), each attributed to its first caller outside torch, per step: `begin()` starts the next step.

    A call counts as the project's (`ours`) when that caller is a file of the finetune package. Calls anywhere under
    torch's data loader or optimizers (HOST_SIDE) act on host data by design and are left out. On a CPU every tensor
    is on the host, so this finds the places a GPU run would wait, without a GPU. Not seen: a blocking copy of host
    data to the device (`torch.tensor(x, device=...)`, `.to(device)` without non_blocking), which waits for the
    device's queue too; the GPU bench's set_sync_debug_mode("error") does see it.

        with SyncCounter() as c:
            ...             # c.begin() at each step's start
        c.ours(step), c.calls[step]
    """

    def __init__(self):
        self.step = 0
        self.calls: dict[int, list[dict]] = {}
        self._mode = None
        import torch

        self._torch_dir = os.path.dirname(torch.__file__) + os.sep

    def begin(self) -> None:
        self.step += 1

    def ours(self, step: int) -> list[dict]:
        return [c for c in self.calls.get(step, []) if c["ours"]]

    def summary(self) -> dict:
        """{step: {"ours": n, "others": n, "where": ["what at file:line", ...]}} for every step with a call."""
        return {step: {"ours": sum(c["ours"] for c in calls), "others": sum(not c["ours"] for c in calls),
                       "where": sorted({f"{c['what']} at {c['where']}" for c in calls})}
                for step, calls in sorted(self.calls.items())}

    def _record(self, what: str) -> None:
        import sys as _sys

        frame, caller = _sys._getframe(2), None
        while frame is not None:
            name = frame.f_code.co_filename
            if any(part in name for part in HOST_SIDE):
                return
            if caller is None and not name.startswith(self._torch_dir) and name != __file__:
                caller = frame
            frame = frame.f_back
        if caller is None:
            return
        name = caller.f_code.co_filename
        ours = name.startswith(_FINETUNE_DIR)
        where = f"{os.path.relpath(name, REPO) if ours else name}:{caller.f_lineno}"
        self.calls.setdefault(self.step, []).append({"what": what, "where": where, "ours": ours})

    def __enter__(self) -> "SyncCounter":
        # A TorchFunctionMode sees every call below (a Tensor method, its dunders and indexing included) without
        # touching torch.Tensor: assigning a Python function to Tensor.__getitem__ and back leaves CPython's
        # sequence slot (sq_item) generic for the rest of the process, so every tensor reads as a sequence and
        # torch.tensor([0-d tensors]) raises "len() of a 0-d tensor" (transformers' Qwen2.5-VL get_rope_index, in
        # whatever test ran next in the same process).
        import torch
        from torch.overrides import TorchFunctionMode

        counter = self
        methods = {getattr(torch.Tensor, n): n for n in SYNC_METHODS if hasattr(torch.Tensor, n)}
        functions = {getattr(torch, n): n for n in SYNC_FUNCTIONS}
        indexing = {torch.Tensor.__getitem__: "__getitem__", torch.Tensor.__setitem__: "__setitem__"}

        def bool_index(args) -> bool:
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, tuple) else (index,)
            return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)

        def to_host(args, kwargs) -> bool:
            # Only a copy asked for by name: `.to(x.device)` is on the CPU here but a device's own on a GPU.
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            return isinstance(target, str) and target.startswith("cpu")

        class Counting(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = methods.get(func) or functions.get(func)
                if name is None and func in indexing and bool_index(args):
                    name = indexing[func]
                elif name is None and func is torch.Tensor.to and to_host(args, kwargs):
                    name = "to"
                if name is not None:
                    counter._record(name)
                return func(*args, **kwargs)

        self._mode = Counting()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


# The paths by name (the launcher files' main functions), for count_syncs.
PATH_MAINS = {"trainer": "finetune.training.trainer", "loop": "finetune.training.loop",
              "engine": "finetune.training.engine"}


def count_syncs(path: str, argv: list[str]) -> SyncCounter:
    """Run one training path (`path` of PATH_MAINS) in this process on `argv` under a SyncCounter whose steps are
    the path's optimizer steps: a step begins where the path takes its micro-batches' count (the Trainer's
    get_batch_samples, the hand-written paths' core.global_count), so a step's log and save count in that step.
    Whatever comes before the first step (loading) is step 0; the final save is in the last step."""
    import importlib

    import transformers

    from finetune.training import core

    counter = SyncCounter()
    restore = []

    def marked(owner, name):
        original = getattr(owner, name)

        def begin(*args, **kwargs):
            counter.begin()
            return original(*args, **kwargs)

        restore.append((owner, name, original))
        setattr(owner, name, begin)

    if path == "trainer":
        marked(transformers.Trainer, "get_batch_samples")
    else:
        marked(core, "global_count")
    main = importlib.import_module(PATH_MAINS[path]).main
    try:
        with counter:
            main(argv)
    finally:
        for owner, name, original in restore:
            setattr(owner, name, original)
    return counter


if __name__ == "__main__":  # python -m finetune.testing count-syncs PATH OUT.json ARGV...: count_syncs in a process
    if len(sys.argv) < 4 or sys.argv[1] != "count-syncs":
        raise SystemExit("usage: python -m finetune.testing count-syncs trainer|loop|engine OUT.json ARGV...")
    _counter = count_syncs(sys.argv[2], sys.argv[4:])
    Path(sys.argv[3]).write_text(json.dumps({"steps": _counter.step, "syncs": _counter.summary()}, indent=1))
