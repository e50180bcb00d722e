"""Start real multi-process jobs on loopback for tests: free ports, a time bound, whole-group kill."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TRAIN = str(REPO / "finetune" / "train.py")
LOOP = str(REPO / "finetune" / "loop.py")


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
