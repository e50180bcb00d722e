"""A batched `Dataset.map` over contiguous shards, one per process: this process maps the first, processes forked from
it the others, each with `datasets`' own single-process map writing its own Arrow file; the results are concatenated
in order.

Why not `map(num_proc=N)`: its pool, the manager process behind its progress queue and their shutdown cost about
0.25 s, a sixth of 10,000 conversations' work on 2 cores (bench/data.py), and it pickles the map function, tokenizer
included, for every shard. A fork costs milliseconds and hands the function over as it is. And here a bad record is
always the first one in file order, whichever process meets it first: the error of the lowest shard that failed is
the one raised, as one process would have raised it.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import signal
import struct
import sys
import time
import traceback

from finetune.data.prepare import DataError

WAIT_NOTE_S = 30.0  # no record done by any worker for this long: say what is awaited


class _Counted:
    """The map function on one shard: indices made global, records done written to this process's slot of a counter
    shared by all of them (the progress bar's)."""

    def __init__(self, fn, offset: int, counter: mmap.mmap, slot: int, on_batch=None):
        self.fn, self.offset, self.counter, self.slot, self.on_batch = fn, offset, counter, slot, on_batch
        self.done = 0

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        out = self.fn(batch, [i + self.offset for i in indices] if self.offset else indices)
        self.done += len(indices)
        struct.pack_into("q", self.counter, 8 * self.slot, self.done)
        if self.on_batch is not None:
            self.on_batch()
        return out


def map_shards(ds, fn, *, procs: int, files: list[str], fingerprint: str, desc: str, **map_kw):
    """`ds.map(fn, with_indices=True, batched=True, **map_kw)` on `procs` processes; shard r written to files[r]."""
    import datasets
    from datasets.utils import tqdm as hf_tqdm

    shards = [ds.shard(num_shards=procs, index=r, contiguous=True) for r in range(procs)]
    offsets = [sum(len(s) for s in shards[:r]) for r in range(procs)]
    counter = mmap.mmap(-1, 8 * procs)  # anonymous and shared: the forked processes write into the same pages

    def run(r: int, on_batch=None):
        return shards[r].map(_Counted(fn, offsets[r], counter, r, on_batch), with_indices=True, batched=True,
                             cache_file_name=files[r], new_fingerprint=f"{fingerprint}_{r:05d}_of_{procs:05d}", **map_kw)

    def done() -> int:
        return sum(struct.unpack_from(f"{procs}q", counter))

    workers: dict[int, tuple[int, int]] = {}  # shard -> (pid, read end of its error pipe)
    with _tokenizers_serial():
        try:
            for r in range(1, procs):
                workers[r] = _fork(lambda r=r: run(r))
            # Made after the forks: tqdm's monitor thread must not be running while a process forks.
            bar = hf_tqdm(total=len(ds), unit=" examples", desc=desc)

            def update():
                bar.update(done() - bar.n)

            try:
                with _own_bar_off():
                    first = run(0, update)
                errors = _await(workers, update, done, len(ds))
            finally:
                bar.close()
        finally:
            _kill(workers)
    if errors:
        raise errors[min(errors)]
    return datasets.concatenate_datasets([first, *(datasets.Dataset.from_file(f) for f in files[1:])])


@contextlib.contextmanager
def _tokenizers_serial():
    # As datasets does before it forks: a Rust thread pool does not survive a fork, and the tokenizers library warns
    # in each child if the parent has used it. This process too is one of the map's: one core each.
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


@contextlib.contextmanager
def _own_bar_off():
    """datasets' bar of the first shard alone is replaced by the one that counts every process's records."""
    import datasets

    was_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _fork(work) -> tuple[int, int]:
    parent = os.getpid()
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    os.close(read)
    code = 1
    try:
        try:
            _die_with(parent)
            import datasets

            datasets.disable_progress_bars()
            work()
            code = 0
        except BaseException as e:  # reported to the parent, which raises it
            report = {"data_error": isinstance(e, DataError), "message": str(e), "traceback": traceback.format_exc()}
            with os.fdopen(write, "wb") as f:
                f.write(json.dumps(report).encode())
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)  # no interpreter shutdown: the parent's atexit handlers and objects are not ours to run


def _die_with(parent: int) -> None:
    """A worker whose parent is gone (killed, or ended by a signal to its launcher) ends too."""
    with contextlib.suppress(OSError, AttributeError):  # prctl: Linux only
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _await(workers: dict[int, tuple[int, int]], update, done, total: int) -> dict[int, BaseException]:
    """Until every worker has ended: their errors by shard (their pipe closes when they end)."""
    reports = {r: b"" for r in workers}
    errors: dict[int, BaseException] = {}
    pending = dict(workers)
    last, last_done, t0 = time.time(), done(), time.time()
    while pending:
        ready, _, _ = select.select([fd for _, fd in pending.values()], [], [], 0.1)
        for r, (pid, fd) in list(pending.items()):
            if fd not in ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if chunk:
                reports[r] += chunk
                continue
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            del pending[r], workers[r]
            code = os.waitstatus_to_exitcode(status)
            if code:
                errors[r] = _error(r, pid, code, reports[r])
        update()
        if done() != last_done:
            last, last_done = time.time(), done()
        elif pending and time.time() - last >= WAIT_NOTE_S:
            pids = ", ".join(str(pid) for pid, _ in pending.values())
            print(f"waiting {time.time() - t0:.0f}s for the tokenizing workers (pid {pids}): {last_done:,} of "
                  f"{total:,} records done, none in the last {WAIT_NOTE_S:.0f}s", file=sys.stderr, flush=True)
            last = time.time()
    return errors


def _error(shard: int, pid: int, code: int, report: bytes) -> BaseException:
    try:
        r = json.loads(report)
    except ValueError:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        hint = " (SIGKILL: out of memory? fewer processes: --dataset_num_proc)" if code == -signal.SIGKILL else ""
        return RuntimeError(f"data preparation: the worker tokenizing shard {shard} (pid {pid}) {how}{hint}")
    if r["data_error"]:
        return DataError(r["message"])
    return RuntimeError(f"data preparation: the worker tokenizing shard {shard} (pid {pid}) failed:\n{r['traceback']}")


def _kill(workers: dict[int, tuple[int, int]]) -> None:
    """Workers still running when this process gives up (its own shard failed, or it was interrupted)."""
    for pid, fd in workers.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            os.close(fd)
    workers.clear()
