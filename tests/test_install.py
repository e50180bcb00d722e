"""`pip install .` (not editable) gives a working finetune outside the checkout: every subpackage and the presets
are installed, and `--config zero3` trains on 2 processes from another folder with the installed package's preset.

The dependencies come from the interpreter running the tests: a plain path line in a .pth file of the new
environment puts that interpreter's site-packages on sys.path (its own .pth files, an editable install's finder
among them, are not run), so nothing is downloaded and nothing of the checkout is importable.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from launch import env, free_port, tiny_job

REPO = Path(__file__).resolve().parent.parent


def bounded(cmd: list[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run with the checkout off PYTHONPATH, in its own process group, killed whole at the time bound."""
    e = env()
    e.pop("PYTHONPATH", None)
    proc = subprocess.Popen(cmd, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-6000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def package_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")}


def test_the_checkout_presets_are_the_package_presets(monkeypatch):
    """One source of truth: the top-level folders link into the package, and an accelerate file's DeepSpeed path,
    read from the repository root as accelerate does, is the file `--config NAME` resolves to."""
    import yaml

    from finetune.config import training as C

    for name in ("ds_configs", "accelerate_configs"):
        assert (REPO / name).is_symlink() and (REPO / name).resolve() == REPO / "finetune" / "presets" / name
    monkeypatch.chdir(REPO)
    for preset in ("zero2", "zero3"):
        accelerate = yaml.safe_load((REPO / "accelerate_configs" / f"{preset}.yaml").read_text())
        file = accelerate["deepspeed_config"]["deepspeed_config_file"]
        assert Path(file).resolve() == C.Preset.named(preset).path.resolve() == C.DS_CONFIG_DIR / C.PRESETS[preset]
        assert C.Preset.named(preset).accelerate_config.resolve() == (REPO / "accelerate_configs" / f"{preset}.yaml").resolve()
        environ = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": file}
        assert C.Preset.resolve(preset, environ=environ) == C.Preset.named(preset)
        other = "zero3" if preset == "zero2" else "zero2"
        with pytest.raises(C.ConfigError):
            C.Preset.resolve(other, environ=environ)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh environment with finetune installed from a copy of the checkout by `pip install --no-deps .`."""
    root = tmp_path_factory.mktemp("install")
    # A copy, so the build's egg-info and build/ folders are not left in the checkout.
    src = root / "src"
    shutil.copytree(REPO, src, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", ".venv", "tmp", "outputs", "build", "*.egg-info",
                                                  "__pycache__", ".pytest_cache"))
    venv = root / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    (site / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    result = bounded([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", str(src)],
                     cwd=root, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    return python


@pytest.mark.slow
def test_every_module_and_preset_is_installed(installed, tmp_path):
    code = "import finetune, pathlib; print(pathlib.Path(finetune.__file__).parent)"
    result = bounded([str(installed), "-c", code], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout
    package = Path(result.stdout.strip().splitlines()[-1])
    assert package.is_relative_to(installed.parent.parent), f"imported {package}, not the installed copy"
    assert package.parent.name == "site-packages"
    assert package_files(package) == package_files(REPO / "finetune")
    assert sorted(p.name for p in (package / "presets" / "ds_configs").glob("*.json")) == sorted(
        p.name for p in (REPO / "ds_configs").glob("*.json"))
    # Every module imports from the installed copy (a subpackage missing from the wheel fails here).
    modules = sorted(".".join(Path(p).with_suffix("").parts) for p in package_files(package) if p.endswith(".py"))
    code = ("import importlib, sys\n"
            f"for name in {['finetune.' + m for m in modules if m != '__main__']!r}:\n"
            "    module = importlib.import_module(name.removesuffix('.__init__'))\n"
            f"    assert module.__file__.startswith({str(package)!r}), module.__file__\n"
            "from finetune.apps import quickstart as Q\n"
            f"assert Q.DEFAULT_TRAIN.is_file() and Q.DEFAULT_EVAL.is_file() and str(Q.DEFAULT_TRAIN).startswith({str(package)!r})\n"
            "from finetune import config as C\n"
            "print(C.Preset.named('zero3').path)\n")
    result = bounded([str(installed), "-c", code], cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.strip().splitlines()[-1] == str(package / "presets" / "ds_configs" / "zero3_offload.json")


@pytest.mark.slow
def test_zero3_trains_on_two_processes_outside_the_checkout(installed, tmp_path):
    _, model, data = tiny_job(tmp_path / "job", records=16)
    work = tmp_path / "elsewhere"
    work.mkdir()
    out = work / "out"
    start = time.time()
    result = bounded([
        str(installed), "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
        "-m", "finetune.cli", "train", "--config", "zero3", "--model_name_or_path", str(model),
        "--dataset", str(data), "--output_dir", str(out), "--dataset_cache_dir", str(work / "cache"),
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--logging_steps", "1", "--disable_tqdm", "true",
    ], cwd=work, timeout=540)
    took = time.time() - start
    assert result.returncode == 0, result.stdout[-6000:]
    site = installed.parent.parent
    preset = next(line for line in result.stdout.splitlines() if line.startswith("parallelism:"))
    # The preset file in force is the installed package's, and both ranks took part.
    assert preset.startswith(f"parallelism: zero3 ({site}/") and "presets/ds_configs/zero3_offload.json)" in preset
    assert "world size 2" in preset
    assert "x 2 processes = global batch 4" in result.stdout
    # No file of the checkout's package was used (the dependencies may live in a .venv inside the checkout).
    assert f"{REPO / 'finetune'}/" not in result.stdout
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    state = json.loads((out / "trainer_state.json").read_text())
    steps = [e["loss"] for e in state["log_history"] if "loss" in e]
    assert state["global_step"] == 2 and len(steps) == 2 and all(math.isfinite(x) for x in steps), state
    print(f"{preset}; losses {steps}; {took:.0f} s")
