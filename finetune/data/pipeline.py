"""Preparation at scale: a data source as an Arrow `datasets.Dataset`, tokenized by a batched, multi-process
`Dataset.map` into an Arrow cache (the map's own shards, reloaded memory-mapped), once per node and once per job
where nodes share the cache folder (a lock file). docs/data.md describes it for users.

Every record goes through prepare.py's `tokenize_many` (a batch's records rendered one by one, their texts tokenized
in one call; `tokenize_examples` is it for one record), so masks are the ones the per-record reference
(`prepare.tokenize_all`) gives, token for token; only where the records live changed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import asdict, replace
from pathlib import Path

from finetune import compat
from finetune.constants import IGNORE_INDEX
from finetune.data import forked, formats, images, mix, vision
from finetune.data import prepare as P
from finetune.data.packing import pack_dataset
from finetune.data.prepare import DataError, DataStats

# Per-example status bits, stored next to the tokens while the map runs (then dropped): stats come from these columns.
# A truncated example can still be dropped for having no trained token left; it counts in both, as before.
TRUNCATED, DROPPED_LONG, DROPPED_NO_LABELS, DROPPED_IMAGE_CUT = 1, 2, 4, 8
DROPPED = DROPPED_LONG | DROPPED_NO_LABELS | DROPPED_IMAGE_CUT
# Fewer records than this per process: more processes cost more to start than they save.
MIN_RECORDS_PER_PROC = 2000
READ_BATCH = 10_000  # lines per Arrow batch when a text file is read (bounds the reader's memory)
RELEASE_EVERY = 50  # map batches (of 200 records) between two compat.release_mapped_pages of the source
WAIT_NOTE_S = 30.0  # a waiting rank says what it waits for at least this often


def default_num_proc() -> int:
    """The cores this process may run on (cgroup/affinity aware), not the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# ----------------------------------------------------------------------------------------------
# A source as an Arrow data set. Text files become two string columns (the record as JSON, where it was found),
# written batch by batch, so a 1M-line file never sits in memory as Python objects.

TEXT_COLUMNS = ("_json", "_where")


def _write_text_rows(rows, out: Path):
    """rows: iterable of (json text, where). Returns a memory-mapped Dataset, or None when there were none."""
    import datasets
    import pyarrow as pa

    schema = pa.schema([("_json", pa.large_string()), ("_where", pa.string())])
    n = 0
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        texts, wheres = [], []
        for text, where in rows:
            texts.append(text)
            wheres.append(where)
            if len(texts) >= READ_BATCH:
                writer.write_batch(pa.record_batch([pa.array(texts, pa.large_string()), pa.array(wheres)], schema=schema))
                n += len(texts)
                texts, wheres = [], []
        if texts:
            writer.write_batch(pa.record_batch([pa.array(texts, pa.large_string()), pa.array(wheres)], schema=schema))
            n += len(texts)
    return datasets.Dataset.from_file(str(out)) if n else None


def _jsonl_rows(p: Path):
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{p}:{lineno}: not UTF-8 text; save the file as UTF-8") from None
            if line.strip():
                yield line, f"{p}:{lineno}"  # parsed (and its errors located) inside the map


def _json_array_rows(p: Path):
    records, where = P.read_json(p)  # one JSON document: parsed whole, as before
    for record, loc in zip(records, where):
        yield json.dumps(record, ensure_ascii=False), loc


def _csv_rows(p: Path):
    with p.open(newline="", encoding="utf-8-sig") as f:  # Excel writes a byte order mark
        for i, row in enumerate(csv.DictReader(f), start=1):
            # A `messages` column in CSV holds JSON text.
            if isinstance(row.get("messages"), str) and row["messages"].lstrip().startswith("["):
                try:
                    row["messages"] = json.loads(row["messages"])
                except json.JSONDecodeError:
                    pass  # reported by validation as a wrong type
            yield json.dumps(row, ensure_ascii=False), f"{p} row {i}"


def _parquet(p: Path, out: Path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p)
        with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_stream(sink, pf.schema_arrow) as writer:
            for batch in pf.iter_batches(batch_size=READ_BATCH):
                writer.write_batch(batch)
    except Exception as e:  # pyarrow.ArrowInvalid and friends: not a Parquet file
        raise DataError(f"{p}: cannot read as Parquet: {e}") from None
    return datasets.Dataset.from_file(str(out))


def source_dataset(cfg, hub, work: Path):
    """(Dataset, location prefix for rows of an Arrow source or None for text sources). Errors name the file."""
    if hub is not None:
        where = hub.repo_id + (f"@{hub.revision[:12]}" if hub.revision else "")
        ds, prefix, empty = hub.dataset, where, f"{where}: the data set holds no records"
    else:
        p = Path(cfg.dataset)
        suffix = p.suffix.lower()
        prefix, empty = str(p), f"{p}: the file holds no records"
        try:
            if p.is_dir():
                ds, empty = P.load_saved(p), f"{p}: the data set holds no records"
            elif suffix == ".jsonl" or (suffix == ".json" and not _starts_with_bracket(p)):
                ds, prefix = _write_text_rows(_jsonl_rows(p), work / "records.arrow"), None
            elif suffix == ".json":
                ds, prefix = _write_text_rows(_json_array_rows(p), work / "records.arrow"), None
            elif suffix == ".csv":
                ds, prefix = _write_text_rows(_csv_rows(p), work / "records.arrow"), None
            elif suffix == ".parquet":
                ds = _parquet(p, work / "records.arrow")
            else:
                raise DataError(f"{p}: unsupported file type '{suffix}'; use .jsonl, .json, .csv, .parquet or a save_to_disk folder")
        except UnicodeDecodeError:
            raise DataError(f"{p}:{P.first_bad_utf8_line(p)}: not UTF-8 text; save the file as UTF-8") from None
    if ds is None or len(ds) == 0:
        raise DataError(empty)
    return ds, prefix


def _starts_with_bracket(p: Path) -> bool:
    with p.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _record(batch: dict, k: int, index: int, prefix: str | None) -> tuple[dict, str]:
    if prefix is not None:
        return {c: batch[c][k] for c in batch}, f"{prefix} row {index}"
    where = batch["_where"][k]
    try:
        record = json.loads(batch["_json"][k])
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
    return record, where


def first_record(ds, prefix: str | None) -> tuple[dict, str]:
    return _record(ds[:1], 0, 0, prefix)


class Tokenize:
    """The batched map function: records in, their examples out (with a status and trained-token count each)."""

    def __init__(self, tokenizer, fmt: str, completion_only: bool, max_seq_length: int, drop_long: bool, prefix: str | None,
                 sources: tuple[str, ...] = (), base: Path | None = None):
        self.tokenizer, self.fmt, self.completion_only = tokenizer, fmt, completion_only
        self.max_seq_length, self.drop_long, self.prefix = max_seq_length, drop_long, prefix
        self.end_ids = P.end_of_turn_ids(tokenizer)
        self.sources, self.calls = sources, 0  # the source's Arrow files: their read pages are let go as we go
        # Image records (finetune.data.vision): each example also keeps its rendered text and its images; `base` is
        # the folder their relative paths start from.
        self.images, self.base = formats.get(fmt).images, base

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        self.calls += 1
        if self.sources and self.calls % RELEASE_EVERY == 0:
            compat.release_mapped_pages(self.sources)
        out: dict[str, list] = {"input_ids": [], "labels": [], "_status": [], "_trained": [], "_split": [], "_no_end": []}
        if self.images:
            out.update(text=[], images=[], _no_image=[])

        def records():  # each validated just before it is rendered, so the first bad record is the one reported
            for k, index in enumerate(indices):
                record, where = _record(batch, k, index, self.prefix)
                P.validate_record(record, self.fmt, where)
                yield record, where

        if self.images:
            tokenized = [[(e.input_ids, e.labels, e) for e in examples] for examples in
                         vision.tokenize_many(self.tokenizer, records(), self.fmt, self.completion_only, self.base)]
        else:
            tokenized = [[(ids, labels, None) for ids, labels in pairs] for pairs in
                         P.tokenize_many(self.tokenizer, records(), self.fmt, self.completion_only)]
        for pairs in tokenized:
            for j, (ids, labels, example) in enumerate(pairs):
                # A record the template splits per turn: its first example carries the count.
                out["_split"].append(len(pairs) if len(pairs) > 1 and j == 0 else 0)
                status = 0
                if len(ids) > self.max_seq_length:
                    if self.drop_long:
                        status, ids, labels = DROPPED_LONG, [], []
                    elif example is not None and example.image_end > self.max_seq_length:
                        # The cut would lose an image's tokens, and the model needs every token of each image it
                        # is given ("Image features and image tokens do not match"): the record is dropped.
                        status, ids, labels = DROPPED_IMAGE_CUT, [], []
                    else:
                        status, ids, labels = TRUNCATED, ids[: self.max_seq_length], labels[: self.max_seq_length]
                # Position 0 is never predicted (labels shift by one), so it cannot carry the only trained token.
                trained = max(len(labels) - 1, 0) - labels[1:].count(IGNORE_INDEX)  # list.count: no Python loop per token
                if not status & (DROPPED_LONG | DROPPED_IMAGE_CUT) and not trained:
                    status, ids, labels = status | DROPPED_NO_LABELS, [], []
                out["input_ids"].append(ids)
                out["labels"].append(labels)
                out["_status"].append(status)
                out["_trained"].append(trained if not status & DROPPED else 0)
                out["_no_end"].append(int(not status & DROPPED and not P.has_trained_end(labels, self.end_ids)))
                if self.images:
                    kept = not status & DROPPED
                    out["text"].append(example.text if kept else "")
                    out["images"].append(example.images if kept else [])
                    out["_no_image"].append(int(kept and not example.images))
        return out


def _features(with_images: bool = False):
    import datasets

    # int32: token ids fit, and it halves the cache against Python ints' int64.
    features = {
        "input_ids": datasets.List(datasets.Value("int32")), "labels": datasets.List(datasets.Value("int32")),
        "_status": datasets.Value("int8"), "_trained": datasets.Value("int32"), "_split": datasets.Value("int32"),
        "_no_end": datasets.Value("int8"),
    }
    if with_images:
        # The images as datasets.Image values: a path stays a path, bytes (an image column, a URL) are kept.
        features.update(text=datasets.Value("large_string"), images=datasets.List(datasets.Image()),
                        _no_image=datasets.Value("int8"))
    return datasets.Features(features)


def _undecoded(ds):
    """The data set with its image columns read as {"bytes", "path"} (finetune.data.vision opens them, naming the
    record when one cannot be read), not decoded to PIL by datasets on access."""
    import datasets

    def undecoded(feature):
        if isinstance(feature, datasets.Image):
            return datasets.Image(decode=False)
        if isinstance(feature, (datasets.List, datasets.LargeList)):
            return type(feature)(undecoded(feature.feature))
        if isinstance(feature, datasets.Sequence):
            return datasets.Sequence(undecoded(feature.feature), length=feature.length)
        return feature

    features = datasets.Features({name: undecoded(f) for name, f in ds.features.items()})
    return ds.cast(features) if features != ds.features else ds


def map_records(ds, fn, work: Path, *, num_proc: int, features, what: str):
    """The batched map of a source's records into `work`: on one process, or on forked ones (finetune.data.forked)
    when each gets MIN_RECORDS_PER_PROC records or more."""
    procs = max(1, min(num_proc, len(ds) // MIN_RECORDS_PER_PROC))
    desc = f"tokenizing {what} ({procs} process{'es' if procs > 1 else ''})"
    kw = dict(batch_size=200, remove_columns=ds.column_names, features=features, load_from_cache_file=False)
    fingerprint = work.name.replace(".", "_")  # given, so datasets never hashes (pickles) the function and tokenizer
    if procs == 1:
        return ds.map(fn, with_indices=True, batched=True, cache_file_name=str(work / "map.arrow"),
                      new_fingerprint=fingerprint, desc=desc, **kw)
    files = [str(work / f"map_{r:05d}_of_{procs:05d}.arrow") for r in range(procs)]
    return forked.map_shards(ds, fn, procs=procs, files=files, fingerprint=fingerprint, desc=desc, **kw)


def tokenize_source(cfg, tokenizer, hub, work: Path, *, num_proc: int, name: str):
    """Read, validate and tokenize one source into `work/final` (see commit). Returns its DataStats."""
    ds, prefix = source_dataset(cfg, hub, work)
    fmt = cfg.dataset_format
    if fmt == "auto":
        fmt = P.detect_format(*first_record(ds, prefix))
    if images.processor_of(tokenizer) is not None and formats.get(fmt).with_images:
        fmt = formats.get(fmt).with_images  # a vision-language model reads a set's text records as its image records
    if formats.get(fmt).chat:
        P.require_chat_template(tokenizer, fmt, str(name))
    has_images = formats.get(fmt).images
    if has_images:
        ds = _undecoded(ds)
    base = None if hub is not None else Path(cfg.dataset).resolve() if Path(cfg.dataset).is_dir() else Path(cfg.dataset).resolve().parent
    fn = Tokenize(tokenizer, fmt, cfg.completion_only_loss, cfg.max_seq_length, cfg.drop_long_sequences, prefix,
                  tuple(f["filename"] for f in ds.cache_files), base=base)
    mapped = map_records(ds, fn, work, num_proc=num_proc, features=_features(has_images), what=name)
    # datasets opens the map's output memory-mapped, and reading its stream in touches pages (about 40% of the file:
    # 320 MB at 1M conversations) that would stay in RSS; the training reads them again as it needs them.
    files = [f["filename"] for f in mapped.cache_files]
    compat.release_mapped_pages(files)
    status, split, no_end, trained, lengths = _bookkeeping(files)
    keep = (status & DROPPED) == 0
    no_end = no_end.astype(bool)
    stats = DataStats(
        path=str(name), format=fmt, records=len(ds), truncated=int(((status & TRUNCATED) != 0).sum()),
        dropped_long=int(((status & DROPPED_LONG) != 0).sum()),
        dropped_no_labels=int(((status & DROPPED_NO_LABELS) != 0).sum()), examples=int(keep.sum()),
        dropped_image_cut=int(((status & DROPPED_IMAGE_CUT) != 0).sum()),
        tokens=int(lengths.sum()), trained_tokens=int(trained.sum()), max_seq_length=cfg.max_seq_length,
        split_records=int((split > 0).sum()), split_examples=int(split.sum()), no_trained_end=int(no_end.sum()),
        no_trained_end_truncated=int((no_end & ((status & TRUNCATED) != 0)).sum()),
        end_tokens=", ".join(tokenizer.convert_ids_to_tokens(sorted(fn.end_ids))),
    )
    if has_images:
        stats.without_images = _column_sum(files, "_no_image")
    if not stats.examples:
        raise DataError(f"{name}: no examples left after filtering ({stats.summary()})")
    commit(mapped, keep, ["_status", "_trained", "_split", "_no_end"] + (["_no_image"] if has_images else []),
           work / "final", asdict(stats))
    del mapped, ds
    return stats


def _bookkeeping(files: list[str], memory_pool=None):
    """(status, split, no_end, trained, token count) per example, read from the map's files batch by batch with
    plain reads: through the memory map, each column's few bytes per batch faulted in the pages around them, +270 MB
    of RSS at 1M conversations (bench/data.py), most of the tokens' pages. Each batch's numbers are copied out, so
    only one batch is held at a time (a zero-copy view would keep its whole batch, tokens included, alive)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    names = ("_status", "_split", "_no_end", "_trained")
    parts: list[list] = [[] for _ in range(len(names) + 1)]
    for name in files:
        with pa.OSFile(name, "rb", memory_pool=memory_pool) as f, pa.ipc.open_stream(f, memory_pool=memory_pool) as reader:
            for batch in reader:
                for k, c in enumerate(names):
                    parts[k].append(np.array(batch.column(c).to_numpy(zero_copy_only=False), copy=True))
                lengths = pc.list_value_length(batch.column("input_ids"), memory_pool=memory_pool)
                parts[-1].append(np.array(lengths.to_numpy(zero_copy_only=False), copy=True))
    return tuple(np.concatenate(v) if v else np.zeros(0, dtype=np.int64) for v in parts)


def _column_sum(files: list[str], column: str) -> int:
    """The sum of an int column of the map's files, read batch by batch (as _bookkeeping)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total = 0
    for name in files:
        with pa.OSFile(name, "rb") as f, pa.ipc.open_stream(f) as reader:
            for batch in reader:
                total += int(pc.sum(batch.column(column)).as_py() or 0)
    return total


def commit(mapped, keep, drop: list[str], final: Path, stats: dict) -> None:
    """The map's own Arrow files become the cache, renamed into `final`: a save_to_disk copy read every page of them
    back (peak RSS 1,596 MB against 1,162 MB without it, 1M conversations, bench/data.py) and wrote the data a
    second time. Dropped rows (`keep` false) and the bookkeeping columns `drop` are left out when it is loaded;
    stats.json, written last, marks it complete."""
    import numpy as np

    final.mkdir()
    files = []
    for i, cache in enumerate(mapped.cache_files):
        files.append(f"data-{i:05d}.arrow")
        os.rename(cache["filename"], final / files[-1])
    if not keep.all():
        np.save(final / "keep.npy", np.flatnonzero(keep))
    (final / "layout.json").write_text(json.dumps({"files": files, "drop_columns": drop}))
    (final / "stats.json").write_text(json.dumps(stats))


def load_final(final: Path):
    """A committed cache entry as a memory-mapped Dataset."""
    import datasets
    import numpy as np

    layout = json.loads((final / "layout.json").read_text())
    parts = [datasets.Dataset.from_file(str(final / name)) for name in layout["files"]]
    dataset = (parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)).remove_columns(layout["drop_columns"])
    if (final / "keep.npy").is_file():
        dataset = dataset.select(np.load(final / "keep.npy"))
    compat.release_mapped_pages([str(final / name) for name in layout["files"]])  # as after the map
    return dataset


# ----------------------------------------------------------------------------------------------
# Once per node and once per job: a lock file beside the cache entry. Its holder tokenizes; everyone else waits,
# saying what for. A lock left by a dead process on this host is taken over; on another host it cannot be checked.


def _holder(lock: Path) -> dict | None:
    try:
        return json.loads(lock.read_text() or "{}")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _describe(holder: dict | None) -> str:
    if not holder or "pid" not in holder:
        return "another process"
    return f"pid {holder['pid']} on {holder.get('host', '?')}"


def try_lock(lock: Path) -> bool:
    """O_CREAT|O_EXCL: exactly one process creates the file, on a local disk and on NFS v3+."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}, f)
    return True


def _pid_alive(pid: int, since: float | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a reused pid: the process now running started after the lock was taken
        import psutil

        return since is None or psutil.Process(pid).create_time() <= since + 1
    except Exception:
        return True


def lock_is_stale(lock: Path) -> bool:
    holder = _holder(lock)
    if not holder or holder.get("host") != socket.gethostname() or "pid" not in holder:
        return False  # being written, or another host's: cannot be checked from here
    return not _pid_alive(int(holder["pid"]), holder.get("since"))


def break_stale(lock: Path) -> bool:
    """Move a stale lock aside (one rename wins among several takers), so try_lock can be retried."""
    try:
        os.rename(lock, lock.with_name(f"{lock.name}.stale{os.getpid()}"))
    except FileNotFoundError:
        return False
    for f in lock.parent.glob(f"{lock.name}.stale*"):
        f.unlink(missing_ok=True)
    return True


def _format_s(s: float) -> str:
    s = int(s)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def wait_for(done: Path, error_file: Path, lock: Path | None, what: str, log, *, take_over=None) -> bool:
    """Wait until `done` exists (True) or an error of this run appears (DataError). `take_over`: this process may
    take a stale lock; then it returns False once it holds the lock."""
    started, t0 = _process_start_time(), time.time()
    last_note = t0
    while not done.is_file():
        # Only an error written during this run counts; an old one is left from an earlier run.
        try:
            if error_file.is_file() and error_file.stat().st_mtime >= started - 1:
                raise DataError(error_file.read_text())
        except FileNotFoundError:
            pass  # the holder removed an old error file between the checks
        if take_over and lock is not None:
            if not lock.exists() or (lock_is_stale(lock) and break_stale(lock)):
                if try_lock(lock):
                    return False
        if time.time() - last_note >= WAIT_NOTE_S:
            holder = _describe(_holder(lock)) if lock is not None and lock.exists() else "local rank 0"
            log(f"waiting {_format_s(time.time() - t0)} for {holder} to tokenize {what} into {done.parent}")
            last_note = time.time()
        time.sleep(0.2)
    return True


def prepare_source(cfg, tokenizer, hub, *, local_rank: int, num_proc: int, log, build=None, stats_cls=DataStats,
                   kind: str = "", with_key: bool = False):
    """One source, tokenized once (per job where the cache folder is shared) and loaded memory-mapped: (Dataset,
    stats), and the cache key too `with_key`. `build` and `stats_cls`: another map than tokenize_source (the
    preference pairs of finetune.data.preference), cached under keys starting with `kind`."""
    root = P.cache_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    key = (f"{kind}-" if kind else "") + _fingerprint(cfg, tokenizer, hub)
    final, error_file, lock = root / key, root / f"{key}.error", root / f"{key}.lock"
    name = hub.repo_id if hub is not None else str(cfg.dataset)
    done = final / "stats.json"
    if not done.is_file():
        if local_rank != 0:
            wait_for(done, error_file, lock, name, log)
        elif try_lock(lock) or not wait_for(done, error_file, lock, name, log, take_over=True):
            try:
                if not done.is_file():  # another node may have finished between our check and the lock
                    _build(cfg, tokenizer, hub, root, key, num_proc, name, build or tokenize_source)
            finally:
                lock.unlink(missing_ok=True)
    stats = stats_cls(**json.loads(done.read_text()))
    if hasattr(stats, "path"):
        # The cache is keyed on content: a hit may have been built from another path holding the same records; the
        # log names the source given this time.
        stats = replace(stats, path=name)
    dataset = load_final(final)
    return (dataset, stats, key) if with_key else (dataset, stats)


def _build(cfg, tokenizer, hub, root: Path, key: str, num_proc: int, name: str, build=None) -> None:
    final, error_file = root / key, root / f"{key}.error"
    error_file.unlink(missing_ok=True)
    work = root / f"{key}.tmp{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        try:
            (build or tokenize_source)(cfg, tokenizer, hub, work, num_proc=num_proc, name=name)
        except DataError as e:
            # Write then rename, so a waiting rank never reads a half-written (empty) message.
            tmp_error = root / f"{key}.error.tmp{os.getpid()}"
            tmp_error.write_text(str(e))
            os.replace(tmp_error, error_file)
            raise
        # The rename is the commit point: a crash before it leaves only a .tmp folder, never a half cache.
        os.rename(work / "final", final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def source_configs(cfg) -> list:
    """One DataConfig per `--dataset` (a repeated flag or a recipe list)."""
    names = cfg.dataset if isinstance(cfg.dataset, list) else [cfg.dataset]
    return [replace(cfg, dataset=n) for n in names]


def prepare(cfg, tokenizer, *, local_rank: int = 0, log=print, seed: int = 42):
    """Every source prepared (cached apart, so changing a weight re-tokenizes nothing), then mixed by weight."""
    num_proc = getattr(cfg, "dataset_num_proc", None) or default_num_proc()
    parts = []
    for sub in source_configs(cfg):
        parts.append(prepare_source(sub, tokenizer, P.load_hub(sub), local_rank=local_rank, num_proc=num_proc, log=log))
    if len(parts) == 1:
        return parts[0]
    return mix.mix([d for d, _ in parts], [s for _, s in parts], getattr(cfg, "dataset_weights", None), seed, log)


# ----------------------------------------------------------------------------------------------
# Tokenize once per node, cache, and let the other ranks wait on the cache (no collective, so no timeout).


def _fingerprint(cfg, tokenizer, hub=None) -> str:
    h = hashlib.sha256()
    h.update(P.DATA_VERSION.encode())
    for key in ("dataset_format", "max_seq_length", "drop_long_sequences", "completion_only_loss"):
        h.update(f"{key}={getattr(cfg, key)};".encode())
    if hub is not None:
        # A Hub data set: the repo, what was asked for, the commit it came from and datasets' hash of the data.
        h.update(repr((hub.repo_id, cfg.dataset_config, cfg.dataset_split, hub.revision, hub.fingerprint)).encode())
    else:
        p = Path(cfg.dataset)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode())
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
    h.update(repr((tokenizer.chat_template, tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id)).encode())
    h.update(images.fingerprint(tokenizer).encode())
    return h.hexdigest()[:24]


def prepare_dataset(cfg, tokenizer, *, local_rank: int = 0, log=print, seed: int = 42):
    """Return (datasets.Dataset with input_ids/labels, DataStats), tokenized once per node (once per job on a shared
    cache folder) with a multi-process `Dataset.map` while the other ranks wait, then packed where asked."""
    processor = images.processor_of(tokenizer)
    if processor is not None and not images.packs_images(tokenizer) and \
            (getattr(cfg, "packing", False) or getattr(cfg, "padding_free", False)):
        # Packed rows need each record's own positions, mrope's 3-D ones included, and its images in order: the
        # families that take them say so (VisionFamily.packing_refusal; the run's checks name the others first).
        flag = "--packing" if getattr(cfg, "packing", False) else "--padding_free"
        raise DataError(f"{flag} is not supported for vision-language models ({type(processor).__name__}): image "
                        f"records are not packed; leave {flag} out")
    dataset, stats = prepare(cfg, tokenizer, local_rank=local_rank, log=log, seed=seed)
    stats.padding_free = bool(getattr(cfg, "padding_free", False))
    if getattr(cfg, "packing", False):
        # Packed after the cache (the packer is deterministic and cheap, so every rank packs the same rows itself
        # and the cache stays the same with and without --packing), before sampling: rows are the items.
        dataset, packing = pack_dataset(dataset, cfg.max_seq_length)
        stats.packed_rows = packing.rows
    return dataset, stats


def _process_start_time() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:
        return time.time()
