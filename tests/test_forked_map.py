"""finetune/data/forked.py: the map over forked processes gives the one-process map's rows with global indices, one
progress bar over every process's records, the error of the first bad record in file order whichever process meets
it first, and leaves no worker behind: not when a worker dies, not when this process fails, not when it is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import psutil
import pytest

from finetune.data import forked
from finetune.data.prepare import DataError

REPO = Path(__file__).resolve().parent.parent
FEATURES = datasets.Features({"y": datasets.Value("int64"), "pid": datasets.Value("int64")})


def _source(n: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"x": list(range(n))})


def _double(batch, indices):
    return {"y": [x * 2 + i * 1000 for x, i in zip(batch["x"], indices)], "pid": [os.getpid()] * len(indices)}


def _map(ds, fn, tmp_path, procs, **kw):
    files = [str(tmp_path / f"m_{r}.arrow") for r in range(procs)]
    return forked.map_shards(ds, fn, procs=procs, files=files, fingerprint="t", desc="test map", batch_size=7,
                             remove_columns=["x"], features=FEATURES, load_from_cache_file=False, **kw)


_EARLIER: set[int] = set()  # children this process had before the test (a multiprocessing resource tracker)


@pytest.fixture(autouse=True)
def _earlier_children():
    _EARLIER.clear()
    _EARLIER.update(c.pid for c in psutil.Process().children())


def _no_children():
    """The children the test left (its workers), after up to 10 s for them to end."""
    def left():
        return [c for c in psutil.Process().children() if c.pid not in _EARLIER]

    deadline = time.time() + 10
    while left() and time.time() < deadline:
        time.sleep(0.05)
    return left()


@pytest.mark.parametrize("procs", [2, 3])
def test_rows_equal_one_process_with_global_indices(tmp_path, procs, capsys):
    ds = _source(100)
    one = ds.map(_double, with_indices=True, batched=True, batch_size=7, remove_columns=["x"], features=FEATURES)
    datasets.enable_progress_bars()
    try:
        got = _map(ds, _double, tmp_path, procs)
    finally:
        datasets.disable_progress_bars()
    assert got["y"] == one["y"] and len(got) == 100
    pids = got["pid"]
    assert len(set(pids)) == procs and pids[0] == os.getpid()  # this process mapped the first shard, in order
    assert [f["filename"] for f in got.cache_files] == [str(tmp_path / f"m_{r}.arrow") for r in range(procs)]
    bar = capsys.readouterr().err
    assert "test map" in bar and "100/100" in bar  # one bar, over every process's records
    assert not _no_children()


def _bad_at(*bad: int):
    def fn(batch, indices):
        for i in indices:
            if i in bad:
                raise DataError(f"data.jsonl:{i + 1}: bad record")
        return _double(batch, indices)
    return fn


def test_the_first_bad_record_in_file_order_is_reported(tmp_path):
    """Bad records in shards 1 and 2 of 3: shard 2 fails first (its bad record comes first in its shard), yet the
    error is shard 1's, as one process would report it; with one also in this process's shard, that one."""
    ds = _source(90)  # shards of 30
    with pytest.raises(DataError, match=r"^data.jsonl:59: bad record$"):
        _map(ds, _bad_at(58, 60), tmp_path, 3)
    assert not _no_children()
    with pytest.raises(DataError, match=r"^data.jsonl:30: bad record$"):
        _map(ds, _bad_at(29, 58, 60), tmp_path, 3)
    assert not _no_children()


def test_a_worker_that_dies_is_named(tmp_path):
    def die(batch, indices):
        if os.getpid() != parent and 60 in indices:
            os.kill(os.getpid(), signal.SIGKILL)
        return _double(batch, indices)

    parent = os.getpid()
    with pytest.raises(RuntimeError, match=r"worker tokenizing shard 2 \(pid \d+\) was killed by signal 9 \(SIGKILL: "
                                           r"out of memory\? fewer processes: --dataset_num_proc\)"):
        _map(_source(90), die, tmp_path, 3)
    assert not _no_children()


def test_an_error_other_than_bad_data_carries_its_traceback(tmp_path):
    def fail(batch, indices):
        if os.getpid() != parent:
            raise ZeroDivisionError("in the worker")
        return _double(batch, indices)

    parent = os.getpid()
    with pytest.raises(RuntimeError, match=r"(?s)shard 1 \(pid \d+\) failed:\nTraceback.*ZeroDivisionError: in the worker"):
        _map(_source(40), fail, tmp_path, 2)


def test_when_this_process_fails_its_workers_are_ended(tmp_path):
    """This process's own shard fails at once while the workers would run for minutes: they are killed, not
    awaited."""
    def slow(batch, indices):
        if os.getpid() == parent:
            raise DataError("data.jsonl:1: bad record")
        time.sleep(60)
        return _double(batch, indices)

    parent = os.getpid()
    t0 = time.time()
    with pytest.raises(DataError, match="data.jsonl:1"):
        _map(_source(60), slow, tmp_path, 3)
    assert time.time() - t0 < 20 and not _no_children()


KILLED_PARENT = """
import os, sys, time
import datasets
from finetune.data import forked

def slow(batch, indices):
    if os.getpid() != parent:
        os.write(1, f"{os.getpid()}\\n".encode())  # one write under PIPE_BUF: the two workers' lines never mix
        time.sleep(120)
    return {"y": list(indices)}

parent = os.getpid()
ds = datasets.Dataset.from_dict({"x": list(range(40))})
forked.map_shards(ds, slow, procs=3, files=[sys.argv[1] + f"/m{r}.arrow" for r in range(3)], fingerprint="k", desc="k",
                  batch_size=5, remove_columns=["x"], features=datasets.Features({"y": datasets.Value("int64")}))
"""


def test_workers_end_with_a_killed_parent(tmp_path):
    """A launcher's signal can end the rank with SIGKILL, which it cannot pass on: its workers end with it."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    pids = []
    try:
        pids += [int(proc.stdout.readline()) for _ in range(2)]  # both workers are in their first batch
        assert all(psutil.pid_exists(p) for p in pids)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.time() + 10
        while any(psutil.pid_exists(p) for p in pids) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(psutil.pid_exists(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for p in pids:  # workers left by a failed check (forks of this test's script: the same command line)
            try:
                if psutil.Process(p).cmdline()[-2:] == [KILLED_PARENT, str(tmp_path)]:
                    os.kill(p, signal.SIGKILL)
            except (psutil.Error, ProcessLookupError):
                pass


@pytest.mark.slow
def test_a_launched_rank_tokenizes_on_two_processes(tmp_path):
    """accelerate launch, 2 ranks, 4,400 records: local rank 0 forks a worker (torch loaded, the process group up)
    while rank 1 waits; training runs, and the cache holds the 2 processes' files with the rows a one-process
    preparation gives."""
    from types import SimpleNamespace

    from finetune.config import DataConfig
    from finetune.data import pipeline
    from finetune.data.pipeline import prepare_dataset
    from finetune.models.load import load_tokenizer
    from finetune.testing import TRAIN, launcher, losses, run, tiny_job

    root, model, data = tiny_job(tmp_path, records=4400, seed=3)
    out = run([*launcher("accelerate", 2, script=TRAIN), "--model_name_or_path", str(model), "--dataset", str(data),
               "--output_dir", str(root / "out"), "--dataset_cache_dir", str(root / "cache"), "--max_steps", "2",
               "--per_device_train_batch_size", "2", "--max_seq_length", "128", "--dataset_num_proc", "2"], timeout=300)
    assert out.returncode == 0, out.output[-3000:]
    assert "(2 processes)" in out.output and len(losses(root / "out")) == 2
    entries = [p for p in (root / "cache").iterdir() if (p / "stats.json").is_file()]
    assert len(entries) == 1 and sorted(p.name for p in entries[0].glob("data-*.arrow")) == ["data-00000.arrow", "data-00001.arrow"]
    tok = load_tokenizer(SimpleNamespace(model_name_or_path=str(model), trust_remote_code=False))
    one, _ = prepare_dataset(DataConfig(dataset=str(data), dataset_cache_dir=str(tmp_path / "one"), dataset_num_proc=1,
                                        max_seq_length=128), tok, log=lambda *a: None)
    launched = pipeline.load_final(entries[0])
    assert launched["input_ids"] == one["input_ids"] and launched["labels"] == one["labels"] and len(one) == 4400
