"""The runs of `finetune ui`: each is the CLI's own process (`finetune train ...`, or `finetune export ...`), started
in a process group of its own, its output in a log file; what the page shows is read back from the run folder.

A run launched from the page is RUNS/NAME (its --output_dir, written by the training command only) and
RUNS/.ui/NAME/ (the page's records: run.json with the command, train.log, exit.json, export logs). Curves come from
the run's trainer_state.json (its final save, else its newest checkpoint: exact values) followed by the log entries
the Trainer printed since (4 significant digits, as printed), so they move while the run trains.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from finetune.ship.report import ReportError, find_state, method_of, series, summary

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
UI = ".ui"  # RUNS/.ui/NAME: the page's records of a run
EXPORTS = "exports"  # RUNS/exports/: what the page exported
# The Trainer's progress bar is the one tqdm bar without a label: "  8%|▊   | 1/12 [00:01<00:11, ...]".
_BAR = re.compile(r"(?:^|[\r\n])\s*\d+%\|[^|\r\n]*\|\s*(\d+)/(\d+) \[")
_ENTRY = re.compile(r"\{'[^{}\r\n]*\}")
STOP_WAIT_S = 30.0  # after SIGTERM, how long the group may take to end before SIGKILL


def shell_line(cmd: list[str]) -> str:
    return shlex.join(cmd)


def _number(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def parse_log(text: str) -> dict:
    """The Trainer's printed progress and log entries: {step, max_steps, entries: [(step, {key: value})]}.

    An entry is printed with tqdm.write, which redraws the bar under it at the step just done: its step is the
    bar's that follows it (the bar before it may lag behind by tqdm's refresh interval). An entry with no bar
    after it yet waits for the next read."""
    events = sorted([(m.start(), "bar", m) for m in _BAR.finditer(text)] +
                    [(m.start(), "entry", m) for m in _ENTRY.finditer(text)], key=lambda e: e[0])
    step = max_steps = None
    entries, waiting = [], []
    for _, kind, m in events:
        if kind == "bar":
            step, max_steps = int(m.group(1)), int(m.group(2))
            entries += [(step, entry) for entry in waiting]
            waiting = []
            continue
        try:
            entry = ast.literal_eval(m.group(0))
        except (ValueError, SyntaxError):
            continue
        if isinstance(entry, dict):
            waiting.append({k: _number(v) for k, v in entry.items() if _number(v) is not None})
    return {"step": step, "max_steps": max_steps, "entries": entries}


def curves(output_dir: Path, log_text: str) -> dict:
    """Train and eval loss by step: the saved history (exact), then the printed entries after its last step."""
    out = {"train": [], "eval": [], "source": None}
    last = -1
    try:
        path, state = find_state(output_dir)
    except ReportError:
        state = None
    if state:
        history = state["log_history"]
        out["train"] = [list(p) for p in zip(*series(history, "loss"))]
        out["eval"] = [list(p) for p in zip(*series(history, "eval_loss"))]
        last = max([e.get("step", -1) for e in history] or [-1])
        out["source"] = str(path.relative_to(output_dir))
    # By step, the last printed wins: a resumed run prints again the steps after its checkpoint.
    train, evals = {}, {}
    for step, entry in parse_log(log_text)["entries"]:
        if step <= last:
            continue
        if "loss" in entry and "train_loss" not in entry:
            train[step] = entry["loss"]
        if "eval_loss" in entry:
            evals[step] = entry["eval_loss"]
    out["train"] += [[k, v] for k, v in sorted(train.items())]
    out["eval"] += [[k, v] for k, v in sorted(evals.items())]
    return out


def tail(text: str, limit: int = 12000) -> str:
    """The log as a terminal shows it: each carriage-return-rewritten line at its last state."""
    lines = [line.split("\r")[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r") for line in text.split("\n")]
    lines = [re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line).rstrip() for line in lines]
    kept = [line for i, line in enumerate(lines) if line and (i == 0 or line != lines[i - 1])]  # no blank or repeated
    shown = "\n".join(kept)
    return shown[-limit:]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class Runs:
    """The runs folder: launch, list, read, stop, resume, export."""

    def __init__(self, runs_dir: Path, cwd: Path):
        self.dir = runs_dir
        self.cwd = cwd
        self.procs: dict[str, subprocess.Popen] = {}
        self.lock = threading.Lock()

    def ui_dir(self, name: str) -> Path:
        return self.dir / UI / name

    def output_dir(self, name: str) -> Path:
        return self.dir / name

    # -- processes ------------------------------------------------------------------------------

    def _spawn(self, key: str, cmd: list[str], log: Path, done: Path, on_exit=None) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        with open(log, "ab") as fh:
            # A process group of its own: stop signals the command and every process it started (launcher ranks).
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.cwd, env=env, start_new_session=True)
        done.unlink(missing_ok=True)
        self.procs[key] = proc

        def wait() -> None:
            rc = proc.wait()
            done.write_text(json.dumps({"returncode": rc, "ended": time.time()}))
            if on_exit is not None:
                on_exit(rc)

        threading.Thread(target=wait, daemon=True).start()
        return proc

    def launch(self, name: str, cmd: list[str], shown: str, wait_s: float = 1.0) -> tuple[dict | None, str | None]:
        """Start `cmd` as run NAME. A command the CLI refuses at once (its flag checks: exit 2 within `wait_s`) is
        not a run: its message comes back and no record is left."""
        ui = self.ui_dir(name)
        with self.lock:
            if name in self.procs and self.procs[name].poll() is None:
                return None, f"run {name} is running; stop it first"
            ui.mkdir(parents=True, exist_ok=True)
            record = {"name": name, "command": cmd, "shown": shown, "started": time.time(), "stopped": False}
            log = ui / "train.log"
            if log.exists():  # a resume appends: one log for the whole run
                with open(log, "a") as fh:
                    fh.write(f"\n--- finetune ui: started again {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
            proc = self._spawn(name, cmd, log, ui / "exit.json")
            record["pid"] = proc.pid
            (ui / "run.json").write_text(json.dumps(record, indent=2))
        deadline = time.time() + wait_s
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        if proc.poll() == 2 and not self.output_dir(name).exists():
            text = tail(log.read_text(errors="replace"))
            with self.lock:
                for f in ("run.json", "train.log", "exit.json"):
                    for _ in range(20):  # the waiter thread writes exit.json just after the exit
                        if f != "exit.json" or (ui / f).exists():
                            break
                        time.sleep(0.05)
                    (ui / f).unlink(missing_ok=True)
                try:
                    ui.rmdir()
                except OSError:
                    pass
                self.procs.pop(name, None)
            return None, text.strip()
        return record, None

    def stop(self, name: str) -> dict:
        """SIGTERM to the run's process group (a launcher passes it on to its ranks, which it starts in sessions of
        their own); SIGKILL after STOP_WAIT_S to whatever of the group or of its descendants is left."""
        import psutil

        record = self.record(name)
        if record is None:
            return {"error": f"no run named {name}"}
        pid = record.get("pid")
        if not pid or not _alive(pid):
            return {"error": f"run {name} is not running"}
        record["stopped"] = True
        (self.ui_dir(name) / "run.json").write_text(json.dumps(record, indent=2))
        try:
            family = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            family = []
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        t0 = time.time()
        proc = self.procs.get(name)

        def running() -> bool:
            return (_alive(pid) if proc is None else proc.poll() is None) or any(_alive(p.pid) for p in family)

        while time.time() - t0 < STOP_WAIT_S and running():
            time.sleep(0.1)
        killed = []
        try:
            os.killpg(pid, 0)  # anything left in the group
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
        for p in family:
            if _alive(p.pid):
                try:
                    p.kill()
                    killed.append(p.pid)
                except psutil.Error:
                    pass
        return {"stopped": True, "seconds": round(time.time() - t0, 2), "processes": 1 + len(family),
                "killed": killed}

    # -- reading --------------------------------------------------------------------------------

    def record(self, name: str) -> dict | None:
        try:
            return json.loads((self.ui_dir(name) / "run.json").read_text())
        except (OSError, ValueError):
            return None

    def status(self, name: str) -> str:
        record = self.record(name)
        ui = self.ui_dir(name)
        proc = self.procs.get(name)
        if record is not None:
            running = proc.poll() is None if proc is not None else (
                bool(record.get("pid")) and _alive(record["pid"]) and not (ui / "exit.json").exists())
            if running:
                return "stopping" if record.get("stopped") else "running"
            try:
                rc = json.loads((ui / "exit.json").read_text())["returncode"]
            except (OSError, ValueError, KeyError):
                rc = None
            if record.get("stopped"):
                return "stopped"
            if rc is None:  # ended while no server of this page watched it
                return "finished" if (self.output_dir(name) / "trainer_state.json").is_file() else "ended"
            if rc != 0:
                return f"failed (exit {rc})"
        out = self.output_dir(name)
        return "finished" if (out / "trainer_state.json").is_file() else ("stopped" if record is None else "ended")

    def names(self) -> list[str]:
        if not self.dir.is_dir():
            return []
        found = set()
        for p in self.dir.iterdir():
            if p.name in (UI, EXPORTS) or not p.is_dir():
                continue
            if (p / "finetune_config.yaml").is_file() or (p / "trainer_state.json").is_file() or any(
                    p.glob("checkpoint-*")):
                found.add(p.name)
        if (self.dir / UI).is_dir():
            found.update(p.name for p in (self.dir / UI).iterdir() if (p / "run.json").is_file())
        return sorted(found, key=lambda n: -self._mtime(n))

    def _mtime(self, name: str) -> float:
        times = [p.stat().st_mtime for p in (self.output_dir(name), self.ui_dir(name) / "run.json") if p.exists()]
        return max(times or [0.0])

    def log_text(self, name: str) -> str:
        log = self.ui_dir(name) / "train.log"
        return log.read_text(errors="replace") if log.is_file() else ""

    def summary_of(self, name: str) -> dict:
        out = self.output_dir(name)
        status = self.status(name)
        row = {"name": name, "status": status, "output_dir": str(out)}
        try:
            _, state = find_state(out)
            metrics = summary(state, method_of(out))
            row.update(step=metrics.get("global_step"), max_steps=metrics.get("max_steps"),
                       last_loss=(metrics.get("train") or {}).get("last_loss"),
                       eval_loss=(metrics.get("eval") or {}).get("eval_loss"))
        except ReportError:
            pass
        if status in ("running", "stopping"):
            parsed = parse_log(self.log_text(name))
            row.update(step=parsed["step"], max_steps=parsed["max_steps"])
        row["report"] = (out / "report" / "README.md").is_file()
        return row

    def detail(self, name: str) -> dict:
        out = self.output_dir(name)
        text = self.log_text(name)
        parsed = parse_log(text)
        record = self.record(name) or {}
        data = self.summary_of(name)
        data.update(
            command=record.get("shown"), log=tail(text), curves=curves(out, text),
            progress={"step": parsed["step"], "max_steps": parsed["max_steps"]},
            adapter=(out / "adapter_config.json").is_file(),
            model=(out / "config.json").is_file() or (out / "adapter_config.json").is_file(),
            exports=self.exports_of(name),
        )
        if data["status"] == "finished" or data["status"] == "stopped":
            try:
                _, state = find_state(out)
                data["metrics"] = summary(state, method_of(out))
                data["progress"] = {"step": state.get("global_step"), "max_steps": state.get("max_steps")}
            except ReportError:
                pass
        report = out / "report"
        if report.is_dir():
            data["report_images"] = sorted(p.name for p in report.glob("*.png"))
        return data

    # -- export ---------------------------------------------------------------------------------

    def export_paths(self, name: str, to: str) -> Path:
        # A folder per run: the GGUF writer puts its Modelfile beside the file.
        from finetune.convert.writers import WRITERS

        suffix = WRITERS[to].suffix
        return self.dir / EXPORTS / name / (f"{name}{suffix}" if suffix else to)

    def start_export(self, name: str, cmd: list[str], to: str, shown: str) -> None:
        ui = self.ui_dir(name)
        ui.mkdir(parents=True, exist_ok=True)
        log = ui / f"export-{to}.log"
        log.unlink(missing_ok=True)
        (ui / f"export-{to}.json").write_text(json.dumps({"command": shown}))
        self._spawn(f"{name}:export:{to}", cmd, log, ui / f"export-{to}.exit.json")

    def exports_of(self, name: str) -> dict:
        ui = self.ui_dir(name)
        found = {}
        from finetune.convert.writers import WRITERS

        for to in WRITERS:
            if not (ui / f"export-{to}.json").is_file():
                continue
            proc = self.procs.get(f"{name}:export:{to}")
            done = ui / f"export-{to}.exit.json"
            rc = json.loads(done.read_text())["returncode"] if done.is_file() else None
            state = "running" if (proc is not None and proc.poll() is None) or rc is None else (
                "done" if rc == 0 else f"failed (exit {rc})")
            log = ui / f"export-{to}.log"
            found[to] = {"state": state, "path": str(self.export_paths(name, to)),
                         "command": json.loads((ui / f"export-{to}.json").read_text())["command"],
                         "log": tail(log.read_text(errors="replace"), 4000) if log.is_file() else ""}
        return found


def python_cli(*args: str) -> list[str]:
    """The CLI as a process: `python -m finetune.cli ...`, the interpreter this server runs on."""
    return [sys.executable, "-m", "finetune.cli", *args]
