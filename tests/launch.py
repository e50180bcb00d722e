"""Start real multi-process jobs on loopback for tests: free ports, a time bound, whole-group kill."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TRAIN = str(REPO / "finetune" / "train.py")
LOOP = str(REPO / "finetune" / "loop.py")
SFT = str(REPO / "scripts" / "sft.py")


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
        # The checkout under test, not whichever copy `pip install -e` pointed at.
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


@dataclass
class Result:
    returncode: int
    output: str

    def check(self) -> "Result":
        assert self.returncode == 0, f"exit {self.returncode}\n{self.output[-6000:]}"
        return self


def run(cmd: list[str], timeout: float = 300, cwd: Path = REPO, **extra_env: str) -> Result:
    """Run in its own process group; on timeout kill the whole group so no rank outlives the test."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-6000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return Result(proc.returncode, out)


def losses(output_dir: str | Path) -> list[float]:
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def deepspeed_launcher(nproc: int = 2, script: str = SFT) -> list[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), script]


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


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Killed:
    returncode: int
    output: str
    exit_seconds: float  # from the kill to the launcher's exit
    survivors: list[int]  # training processes still alive after the launcher exited (should be none)


def run_and_kill_rank(cmd: list[str], when: Path, rank: int = 1, timeout: float = 300, exit_bound: float = 120,
                      **extra_env: str) -> Killed:
    """Start `cmd`, and as soon as the file `when` exists, `kill -9` the process of one rank (not a clean stop).

    Then wait, at most `exit_bound` seconds, for the launcher to exit by itself: the other ranks must not hang.
    The whole process group is killed on any failure, so no rank outlives the test.
    """
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    start = time.time()
    try:
        while not when.exists():
            if proc.poll() is not None:
                reader.join(5)
                raise AssertionError(f"exited ({proc.returncode}) before {when} appeared\n{''.join(chunks)[-6000:]}")
            if time.time() - start > timeout:
                raise AssertionError(f"{when} did not appear in {timeout}s\n{''.join(chunks)[-6000:]}")
            time.sleep(0.05)
        ranks = rank_pids(proc.pid)
        assert rank in ranks, f"no process with RANK={rank} under {cmd[0]}: {ranks}"
        os.kill(ranks[rank], signal.SIGKILL)
        killed_at = time.time()
        try:
            proc.wait(timeout=exit_bound)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {exit_bound}s after rank {rank} was killed\n{''.join(chunks)[-6000:]}") from None
        exit_seconds = time.time() - killed_at
        reader.join(10)
        survivors = [pid for pid in ranks.values() if _alive(pid)]
        return Killed(proc.returncode, "".join(chunks), exit_seconds, survivors)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            try:  # a rank the launcher lost track of still belongs to the group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
