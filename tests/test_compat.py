"""finetune.compat: the version check (with faked installed versions) and the refusal it guards."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune import compat
from finetune.testing import side_by_side
from finetune.training import checkpoint

REPO = Path(__file__).resolve().parent.parent


def fake_versions(monkeypatch, **versions: str) -> None:
    """Installed versions as given; a package not named keeps a version inside its tested range."""
    inside = {"deepspeed": "0.19.8", "bitsandbytes": "0.50.2", "transformers": "5.23.0", "accelerate": "1.15.0"}
    inside.update(versions)

    def version(name: str) -> str:
        if inside.get(name) is None:
            raise metadata.PackageNotFoundError(name)
        return inside[name]

    monkeypatch.setattr(metadata, "version", version)


def test_inside_the_tested_ranges_says_nothing(monkeypatch):
    fake_versions(monkeypatch, deepspeed="0.19.9", bitsandbytes="0.50.0", transformers="5.23.4")
    out = io.StringIO()
    assert compat.check_versions(out) == [] and out.getvalue() == ""


@pytest.mark.parametrize("package, version", [
    ("deepspeed", "0.20.0"), ("deepspeed", "0.19.7"), ("bitsandbytes", "0.51.0"), ("transformers", "5.25.0"),
    ("transformers", "6.0.0.dev0"), ("accelerate", "1.16.0"), ("deepspeed", "not-a-version"),
])
def test_outside_a_range_gets_one_message_naming_package_version_range_and_risk(monkeypatch, package, version):
    fake_versions(monkeypatch, **{package: version})
    out = io.StringIO()
    messages = compat.check_versions(out)
    assert len(messages) == 1
    spec = compat.TESTED[package].spec
    assert messages[0].startswith(f"{package} {version} is outside the range finetune was tested with ({package}{spec})")
    assert compat.TESTED[package].risk in messages[0]
    assert out.getvalue() == f"finetune: warning: {messages[0]}\n"


def test_every_package_outside_is_reported_once_and_only_rank_0_prints(monkeypatch):
    fake_versions(monkeypatch, deepspeed="0.21.0", bitsandbytes="0.52.0", transformers="5.30.0", accelerate="2.0.0")
    out = io.StringIO()
    assert [m.split()[0] for m in compat.check_versions(out)] == list(compat.TESTED)
    assert out.getvalue().count("finetune: warning:") == 4
    monkeypatch.setenv("RANK", "1")
    out = io.StringIO()
    assert len(compat.check_versions(out)) == 4 and out.getvalue() == ""


def test_a_package_not_installed_is_not_reported(monkeypatch):
    fake_versions(monkeypatch, bitsandbytes=None)
    assert compat.untested("bitsandbytes") is None


def test_the_pyproject_bounds_contain_the_tested_ranges():
    """pip must be able to install every tested version, and no package whose internals are read is unbounded."""
    import tomllib

    from packaging.requirements import Requirement

    declared = {Requirement(r).name: Requirement(r).specifier
                for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    for package, tested in compat.TESTED.items():
        lowest_tested = tested.spec.split(",")[0].removeprefix(">=")
        assert lowest_tested in declared[package], (package, lowest_tested, str(declared[package]))
        assert any(s.operator == "<" for s in declared[package]), f"{package}: no upper bound in pyproject.toml"


class _SwappingOptimizer:
    swap_optimizer = True
    dp_process_group = None


def test_nvme_restore_refuses_an_untested_deepspeed(monkeypatch, tmp_path):
    """The one refusal: the NVMe-offload restore reads DeepSpeed's swap files by name and layout."""
    fake_versions(monkeypatch, deepspeed="0.20.1")
    engine = SimpleNamespace(optimizer=_SwappingOptimizer())
    with pytest.raises(checkpoint.ResumeError) as e:
        checkpoint.restore_after_load(engine, tmp_path)
    assert "deepspeed 0.20.1 is outside the range" in str(e.value)
    assert f"{compat.ALLOW_UNTESTED}=1" in str(e.value)


def test_nvme_restore_runs_on_an_untested_deepspeed_when_allowed(monkeypatch, tmp_path):
    fake_versions(monkeypatch, deepspeed="0.20.1")
    monkeypatch.setenv(compat.ALLOW_UNTESTED, "1")
    monkeypatch.setattr("torch.distributed.get_rank", lambda group=None: 0)
    engine = SimpleNamespace(optimizer=_SwappingOptimizer())
    # Past the version check it looks for this rank's ZeRO optimizer file (none in an empty folder).
    with pytest.raises(checkpoint.ResumeError, match="expected one ZeRO optimizer file for rank 0, found 0"):
        checkpoint.restore_after_load(engine, tmp_path)


def test_without_nvme_offload_nothing_is_refused(monkeypatch, tmp_path):
    fake_versions(monkeypatch, deepspeed="0.20.1")
    checkpoint.restore_after_load(SimpleNamespace(optimizer=None), tmp_path)  # no optimizer: nothing to restore


ENTRY_POINTS = [
    [sys.executable, "-m", "finetune.cli", "train", "--help"],
    [sys.executable, str(REPO / "finetune" / "train.py"), "--help"],
    [sys.executable, str(REPO / "finetune" / "loop.py"), "--help"],
    [sys.executable, str(REPO / "scripts" / "sft.py"), "--help"],
]


@pytest.mark.slow  # 7-10 s each: a fresh interpreter importing the training stack (the four run side by side)
def test_every_entry_point_checks_versions():
    """A real process per entry point with deepspeed's installed version faked (the lookup is patched before the
    entry point runs)."""
    codes = []
    for entry in ENTRY_POINTS:
        code = ("import importlib.metadata as m, runpy, sys; v = m.version; "
                "m.version = lambda name, v=v: '0.99.0' if name == 'deepspeed' else v(name); ")
        if entry[1] == "-m":
            code += f"sys.argv = ['finetune', *{entry[3:]!r}]; from finetune.cli import main; main()"
        else:
            code += f"sys.argv = [{entry[1]!r}, *{entry[2:]!r}]; runpy.run_path({entry[1]!r}, run_name='__main__')"
        codes.append(code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("RANK", None)
    procs = side_by_side([[sys.executable, "-c", code] for code in codes], timeout=180, env=env)
    for entry, proc in zip(ENTRY_POINTS, procs):
        assert proc.returncode == 0, (entry, proc.stderr[-3000:])
        assert proc.stderr.count("finetune: warning: deepspeed 0.99.0 is outside the range") == 1, \
            (entry, proc.stderr[-3000:])


def test_collective_deprecations_silenced_and_nothing_else():
    import warnings

    from finetune import compat

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compat.quiet_collective_deprecations()
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning)
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...", FutureWarning)
        warnings.warn("`torch.distributed.all_reduce_coalesced` will be deprecated.", FutureWarning)
    assert [str(w.message) for w in seen] == ["`torch.distributed.all_reduce_coalesced` will be deprecated."]


@pytest.mark.slow  # 19 s: two fresh interpreters loading bitsandbytes
def test_bitsandbytes_hub_kernel_notice_is_quiet():
    import subprocess
    import sys

    def stderr_of(code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr

    # The first two side by side: with finetune, and whether this CPU is one where bitsandbytes looks for the kernel.
    with_finetune, avx = side_by_side([[sys.executable, "-c", "import finetune, bitsandbytes"],
                                       [sys.executable, "-c", "from bitsandbytes.functional import has_avx512bf16; "
                                        "print(bool(has_avx512bf16()))"]], timeout=120)
    quiet = with_finetune.stderr
    assert "kernels-community" not in quiet, quiet
    # The control: where bitsandbytes looks for the Hub kernel (AVX512-BF16 CPUs), it says so without finetune.
    if "True" in avx.stdout:
        assert "kernels-community" in stderr_of("import bitsandbytes")


def test_no_deepspeed_accelerator_warning_on_a_cpu_machine():
    """finetune.convert.export, finetune.inference.generate, finetune.training.core: each imported with deepspeed in a
    fresh interpreter (the three side by side), without DS_ACCELERATOR set."""
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("DeepSpeed finds CUDA here and says nothing")
    modules = ["finetune.convert.export", "finetune.inference.generate", "finetune.training.core"]
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    procs = side_by_side([[sys.executable, "-c", f"import {module}, deepspeed"] for module in modules], timeout=120,
                         env=env)
    for module, proc in zip(modules, procs):
        assert "Setting accelerator to CPU" not in proc.stderr, (module, proc.stderr)


SHM_WORKER = """
import sys, torch, deepspeed, deepspeed.comm as ds_dist
from finetune import compat
if sys.argv[-1] == "ours":  # the launcher puts --local_rank=N first
    compat.guard_extension_builds()  # as every run's start does: the op from this virtualenv's folder
    compat.init_deepspeed_distributed()
else:
    deepspeed.init_distributed(dist_backend="gloo")
rank = ds_dist.get_rank()
# DeepSpeed's shared-memory all-reduce, after the names are gone: the mappings must still carry it.
t = ds_dist.inference_all_reduce(torch.full((1000,), float(rank + 1)))
print(f"rank {rank} sum {t[0].item():g} buffer named {compat.shm_buffer_path(rank).exists()}", flush=True)
ds_dist.barrier()
"""


def test_deepspeed_is_imported_without_mlflow_which_still_imports_after():
    """DeepSpeed's autotuner imports mlflow when installed (every process, every rank, even DDP runs): with finetune
    imported first, DeepSpeed comes in without it, and mlflow is importable afterwards (--report_to mlflow)."""
    pytest.importorskip("mlflow")  # the trackers extra, which requirements.lock installs
    code = ("import sys, finetune.compat, deepspeed; from deepspeed.autotuning import autotuner; "
            "print('mlflow' in sys.modules, autotuner.has_mlflow, type(deepspeed.__spec__.loader).__name__); "
            "import mlflow; print(mlflow.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("[")]  # DeepSpeed's log lines
    assert lines == ["False False SourceFileLoader", "mlflow"], proc.stdout


# The control (DeepSpeed's own init leaving its buffers; 80 s of CPU on 2 cores, ours 20 s) shows the
# workaround is still needed on a new DeepSpeed; CI runs ours.
@pytest.mark.slow  # 2 DeepSpeed ranks
@pytest.mark.parametrize("init", [pytest.param("deepspeed", marks=pytest.mark.full_matrix), "ours"])
def test_deepspeed_shared_memory_buffers_do_not_outlive_the_job(tmp_path, init):
    """A real `deepspeed --num_gpus 2` job: DeepSpeed's own init leaves a 66 MiB buffer per rank in /dev/shm after the
    job (the control, which finetune.testing.run reports and removes); ours unlinks them once every rank has mapped
    them, and the shared-memory all-reduce still sums (1 + 2 on 1000 elements)."""
    from finetune.testing import free_port, run

    script = tmp_path / "worker.py"
    script.write_text(SHM_WORKER)
    port = str(free_port())
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", port, str(script), init]
    if init == "deepspeed":
        with pytest.raises(AssertionError, match="left DeepSpeed's shared-memory buffers") as error:
            run(cmd, timeout=240)
        for rank in (0, 1):
            assert re.search(rf"deepspeed_allreduce_buffer_{os.getuid()}_127\.0\.0\.1_{port}_{rank} \(66 MiB\)",
                             str(error.value)), str(error.value)
    else:
        result = run(cmd, timeout=240).check()
        for rank in (0, 1):
            assert f"rank {rank} sum 3 buffer named False" in result.output, result.output[-3000:]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def test_os_exit_in_the_test_process_raises():
    """conftest's guard: a stray os._exit here fails the test instead of ending the session with its code."""
    with pytest.raises(RuntimeError, match="called in the pytest process"):
        os._exit(0)


def test_stale_shared_memory_buffers_of_killed_jobs_are_swept(tmp_path):
    """Buffers a job killed during start-up left: unmapped and older than the bound, removed by the next job's
    local rank 0; one still mapped by a live process (a job running) and a young one (a job starting) stay."""
    import subprocess
    import time

    tag = f"sweeptest{os.getpid()}"
    paths = {k: compat.SHM_DIR / f"{compat.SHM_BUFFER}_{os.getuid()}_127.0.0.1_{tag}_{k}" for k in ("dead", "mapped", "young")}
    holder = None
    try:
        for path in paths.values():
            path.write_bytes(b"\0" * 4096)
        old = time.time() - 2 * compat.STALE_AFTER_S
        for k in ("dead", "mapped"):
            os.utime(paths[k], (old, old))
        holder = subprocess.Popen([sys.executable, "-c", (
            "import mmap, sys; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); "
            "print('mapped', flush=True); sys.stdin.read()"), str(paths["mapped"])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "mapped"
        removed = [r for r in compat.sweep_stale_shm_buffers() if tag in r]
        assert removed == [f"{paths['dead'].name} (0 MiB)"], removed
        assert not paths["dead"].exists() and paths["mapped"].exists() and paths["young"].exists()
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(timeout=30)
        for path in paths.values():
            path.unlink(missing_ok=True)


def _rss_file_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_released_pages_of_a_read_only_map_leave_rss_and_read_back_the_same(tmp_path):
    """The pages a memory-mapped read touched leave RSS (datasets' Arrow maps; pipeline's Tokenize lets its source's
    go every few batches); a read afterwards gives the same bytes; a private map's written pages are never dropped."""
    import mmap

    path = tmp_path / "data.bin"
    size = 64 * 2**20
    with open(path, "wb") as f:
        for i in range(64):
            f.write(bytes([i]) * 2**20)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    before = _rss_file_mb()
    touched = sum(m[i] for i in range(0, size, 4096))
    assert _rss_file_mb() - before > 60
    assert compat.release_mapped_pages([path]) >= size
    assert _rss_file_mb() - before < 8
    assert sum(m[i] for i in range(0, size, 4096)) == touched  # faulted back in from the page cache
    m.close()
    # A private writable map (copy on write): its written page is data only this process has.
    with open(path, "r+b") as f:
        c = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    c[0:5] = b"hello"
    assert compat.release_mapped_pages([path]) == 0
    assert c[0:5] == b"hello"
    c.close()


DEFERRED = """
import importlib.util, sys
import finetune
from transformers import Trainer, TrainingArguments
from transformers.utils import is_bitsandbytes_available
import peft
from peft.helpers import bnb
print("deferred:", type(sys.modules["bitsandbytes"]).__name__, "bitsandbytes.nn" in sys.modules)
print("seen:", importlib.util.find_spec("bitsandbytes") is not None, is_bitsandbytes_available())
if sys.argv[1] == "attribute":
    layer = bnb.nn.Linear4bit
else:
    import bitsandbytes.nn
    layer = sys.modules["bitsandbytes.nn"].Linear4bit
real = sys.modules["bitsandbytes"]
print("loaded:", type(real).__name__, real.__version__, layer is real.nn.Linear4bit is bnb.nn.Linear4bit)
"""


@pytest.mark.slow  # imports bitsandbytes for real in fresh processes
def test_bitsandbytes_is_imported_at_first_use():
    """Importing transformers' Trainer and peft leaves bitsandbytes unimported (1.5-2 s of every start), while the
    package is still seen as installed; its first use, an attribute or a submodule import, imports it for real, and
    peft's module-level `bnb` then reads the real classes."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = side_by_side([[sys.executable, "-c", DEFERRED, first_use] for first_use in ("attribute", "submodule")],
                         timeout=120, env=env)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        assert lines[0] == "deferred: _Deferred False"
        assert lines[1] == "seen: True True"
        assert lines[2] == f"loaded: module {metadata.version('bitsandbytes')} True"


CPU_INFO = """
import json, sys
runs = []
sys.addaudithook(lambda event, args: runs.append(1) if event == "subprocess.Popen" and "cpuinfo" in str(args[1]) else None)
if sys.argv[1] == "cached":
    from finetune import compat
    compat.cache_cpu_info()
    compat.cache_cpu_info()
import cpuinfo
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder
flags = [(b.cpu_arch(), b.simd_width()) for b in (CPUAdamBuilder(), ShareMemCommBuilder())]
mine = cpuinfo.get_cpu_info()
mine["flags"].append("changed by a caller")
info = cpuinfo.get_cpu_info()
print(json.dumps({"runs": len(runs), "flags": flags, "info": info}))
"""


@pytest.mark.slow
def test_deepspeed_asks_for_the_cpu_once_per_process():
    """DeepSpeed's op builders ask py-cpuinfo for the CPU twice per op (a Python process each time); with
    compat.cache_cpu_info, one process answers every call, with the same compile flags and a copy per caller."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    procs = side_by_side([[sys.executable, "-c", CPU_INFO, mode] for mode in ("plain", "cached")], timeout=180, env=env)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    plain, cached = (json.loads(proc.stdout.splitlines()[-1]) for proc in procs)
    assert plain["runs"] == 6 and cached["runs"] == 1, (plain["runs"], cached["runs"])
    assert cached["flags"] == plain["flags"] and plain["flags"][0][0].startswith("-m")
    assert cached["info"] == plain["info"] and "changed by a caller" not in cached["info"]["flags"]


def test_zero_sizes_of_a_multimodal_config_come_from_its_text_config():
    """accelerate 1.15's prepare() raises on a DeepSpeed config whose ZeRO sizes are "auto" when model.config has no
    hidden_size (Gemma3ForConditionalGeneration's is in text_config); fill_zero_sizes sets accelerate's values from
    the text config's 64 (64², 0.9 x 64², 10 x 64) and leaves a text model's to accelerate."""
    from accelerate.utils import DeepSpeedPlugin
    from family_configs import tiny_config

    keys = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    for name, expected in (("gemma3_mm", (4096, 3686, 640)), ("gemma3", ("auto",) * 3)):
        plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3, **dict.fromkeys(keys, "auto")}})
        compat.fill_zero_sizes(plugin, SimpleNamespace(config=tiny_config(name)))
        assert tuple(plugin.deepspeed_config["zero_optimization"][k] for k in keys) == expected, name
