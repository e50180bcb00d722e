"""finetune/data/pipeline.py and mix.py: the Arrow / `Dataset.map` preparation gives, for every record of the test
data sets, exactly the examples of the per-record reference (`prepare.tokenize_all`), packed or not, on one process
and on several; the once-per-job lock (stale locks, waiting ranks that say what they wait for); mixing by weight."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from finetune.config import DataConfig
from finetune.data import mix, pipeline
from finetune.data import prepare as P
from finetune.data.packing import pack_dataset
from test_data import ALPACA_RECORDS, ASSISTANT_FIRST, CONVERSATIONS, FORMAT_CASES, _tok, _write_all_formats

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def toks(tiny_chatml, tiny_llama3, tiny_plain):
    return {s: _tok(f) for s, f in (("chatml", tiny_chatml), ("llama3", tiny_llama3), ("plain", tiny_plain))}


def quiet(*_a, **_k):
    pass


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def reference(path, tok, cfg):
    """The per-record reference: Python lists read by prepare.read_records, tokenized one record at a time."""
    records, where = P.read_records(path)
    fmt = cfg.dataset_format if cfg.dataset_format != "auto" else P.detect_format(records[0], where[0])
    return P.tokenize_all(records, where, fmt, tok, cfg.max_seq_length, cfg.drop_long_sequences,
                          cfg.completion_only_loss, str(path))


def rows(ds):
    return [(list(r["input_ids"]), list(r["labels"])) for r in ds]


def packed_rows(packed):
    return [(list(packed[i]["input_ids"]), list(packed[i]["labels"]), list(packed[i]["seq_lens"])) for i in range(len(packed))]


# Every record of the test data: the repository's data files and the hand-checked records of test_data.py.
REPO_FILES = [("chatml", "data/demo.jsonl"), ("chatml", "data/quickstart/train.jsonl"), ("llama3", "data/quickstart/heldout.jsonl")]
CASES = {
    "messages_chatml": ("chatml", [{"messages": m} for m in [*CONVERSATIONS.values(), ASSISTANT_FIRST]]),
    "messages_llama3": ("llama3", [{"messages": m} for m in [*CONVERSATIONS.values(), ASSISTANT_FIRST]]),
    "alpaca_plain": ("plain", list(ALPACA_RECORDS.values())),
    **{f"format_{k}": v for k, v in FORMAT_CASES.items()},
}
SETTINGS = [dict(), dict(completion_only_loss=False), dict(max_seq_length=40), dict(max_seq_length=40, drop_long_sequences=True)]


def _check_against_reference(path, tok, cache, kw):
    cfg = DataConfig(dataset=str(path), dataset_cache_dir=str(cache), **kw)
    examples, ref_stats = reference(path, tok, cfg)
    if not examples:
        with pytest.raises(P.DataError, match="no examples left"):
            pipeline.prepare_dataset(cfg, tok, log=quiet)
        return ref_stats
    ds, stats = pipeline.prepare_dataset(cfg, tok, log=quiet)
    assert rows(ds) == [(e["input_ids"], e["labels"]) for e in examples], (path, kw)
    assert stats == ref_stats, (path, kw)
    # --packing: the rows built from the cache equal those built from the reference's lists.
    packed, pstats = pipeline.prepare_dataset(DataConfig(dataset=str(path), dataset_cache_dir=str(cache), packing=True, **kw), tok, log=quiet)
    ref_packed, ref_pstats = pack_dataset(examples, cfg.max_seq_length)
    assert packed_rows(packed) == packed_rows(ref_packed) and pstats.packed_rows == ref_pstats.rows
    return stats


@pytest.mark.parametrize("kw", [dict(), dict(completion_only_loss=False, max_seq_length=64)], ids=["default", "all_tokens_cut"])
def test_pipeline_equals_per_record_reference_repo_data(toks, tmp_path, kw):
    stats = [_check_against_reference(REPO / f, toks[style], tmp_path / "cache", kw) for style, f in REPO_FILES]
    assert sum(s.records for s in stats) == 1136
    if "max_seq_length" in kw:
        assert sum(s.truncated for s in stats) > 100
    else:
        assert sum(s.examples for s in stats) == 1136


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_equals_per_record_reference_every_file_type(toks, tmp_path, case):
    style, records = CASES[case]
    kind = case.split("_")[1] if case.startswith("format_") else case.split("_")[0]
    paths = _write_all_formats(tmp_path, records, kind)
    for path in paths:
        for kw in SETTINGS:
            _check_against_reference(path, toks[style], tmp_path / "cache", kw)


def test_cache_is_int32_arrow_shards_memory_mapped(toks, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS.values()])
    ds, _ = pipeline.prepare_dataset(DataConfig(dataset=str(path), dataset_cache_dir=str(tmp_path / "c")), toks["chatml"], log=quiet)
    [entry] = [p for p in (tmp_path / "c").iterdir() if p.is_dir()]
    # The map's own file, renamed into the entry (no save_to_disk copy), with what loading leaves out.
    assert sorted(f.name for f in entry.iterdir()) == ["data-00000.arrow", "layout.json", "stats.json"]
    assert json.loads((entry / "layout.json").read_text())["drop_columns"] == ["_status", "_trained", "_split", "_no_end"]
    assert ds.column_names == ["input_ids", "labels"]
    assert str(ds.features["input_ids"].feature.dtype) == "int32"
    assert ds.cache_files and all(f["filename"].startswith(str(entry)) for f in ds.cache_files)  # mapped, not copied
    assert not [p for p in (tmp_path / "c").iterdir() if not p.is_dir()]  # no lock, error or tmp left


def test_a_cache_hit_names_the_file_given_this_time(toks, tmp_path):
    """The cache is keyed on content: the same records under another path are not tokenized again, and the data line
    names the path given this time (it once named whichever file first built the entry)."""
    records = [{"messages": m} for m in CONVERSATIONS.values()]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first, second = write_jsonl(tmp_path / "a" / "d.jsonl", records), write_jsonl(tmp_path / "b" / "d.jsonl", records)
    cache = str(tmp_path / "c")
    logs = []
    _, one = pipeline.prepare_dataset(DataConfig(dataset=str(first), dataset_cache_dir=cache), toks["chatml"], log=logs.append)
    _, two = pipeline.prepare_dataset(DataConfig(dataset=str(second), dataset_cache_dir=cache), toks["chatml"], log=logs.append)
    assert len([p for p in (tmp_path / "c").iterdir() if p.is_dir()]) == 1  # one entry: the second run was a hit
    assert (one.path, two.path) == (str(first), str(second))
    assert f"from {second}" in two.summary() and str(first) not in two.summary()
    assert dataclasses.replace(two, path=one.path) == one


# ----------------------------------------------------------------------------------------------
# Several processes.


def _many_records(n: int) -> list[dict]:
    convs = [*CONVERSATIONS.values(), ASSISTANT_FIRST]
    return [{"messages": [{**m, "content": f"{m['content']} {i}"} for m in convs[i % len(convs)]]} for i in range(n)]


@pytest.mark.slow
def test_multiprocess_map_equals_reference_and_locates_errors(toks, tmp_path, monkeypatch):
    """num_proc=2 (forked workers): the same rows in the same order and the same stats; a bad record in the second
    worker's half is reported with its line."""
    monkeypatch.setattr(pipeline, "MIN_RECORDS_PER_PROC", 10)
    tok = toks["chatml"]
    records = _many_records(120)
    path = write_jsonl(tmp_path / "d.jsonl", records)
    cfg = DataConfig(dataset=str(path), dataset_cache_dir=str(tmp_path / "c"), dataset_num_proc=2, max_seq_length=60)
    examples, ref_stats = reference(path, tok, cfg)
    ds, stats = pipeline.prepare_dataset(cfg, tok, log=quiet)
    assert rows(ds) == [(e["input_ids"], e["labels"]) for e in examples] and stats == ref_stats
    assert stats.truncated > 0 and stats.dropped_no_labels > 0  # both paths of the status columns ran
    assert len(list((tmp_path / "c").glob("*/data-*.arrow"))) == 2  # written as 2 shards, by 2 processes

    bad = records[:100] + [{"messages": [{"role": "user", "content": "no answer"}]}] + records[100:]
    path = write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(P.DataError, match=rf"^{path}:101: no assistant message"):
        pipeline.prepare_dataset(DataConfig(dataset=str(path), dataset_cache_dir=str(tmp_path / "c"), dataset_num_proc=2), tok, log=quiet)
    assert not list((tmp_path / "c").glob("*.tmp*")) and not list((tmp_path / "c").glob("*.lock"))


def test_forked_workers_inherit_the_map_function(toks, tmp_path, monkeypatch):
    """The workers are forked: they hold the map function, tokenizer included, without pickling it (datasets' pool
    pickled it for every shard: 0.05 s to write and 0.12 s to read, SmolLM2's). The tokenizer cannot be pickled
    here, so a map on 2 processes passes only if nothing pickles it; its rows equal the reference's."""
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setattr(pipeline, "MIN_RECORDS_PER_PROC", 10)
    tok = toks["chatml"]
    path = write_jsonl(tmp_path / "d.jsonl", _many_records(60))
    cfg = DataConfig(dataset=str(path), dataset_cache_dir=str(tmp_path / "c"), dataset_num_proc=2, max_seq_length=60)
    examples, ref_stats = reference(path, tok, cfg)

    def refuse(self, *a):
        raise AssertionError("the tokenizer was pickled")

    with monkeypatch.context() as m:
        m.setattr(PreTrainedTokenizerFast, "__getstate__", refuse, raising=False)
        m.setattr(PreTrainedTokenizerFast, "__reduce_ex__", refuse)
        ds, stats = pipeline.prepare_dataset(cfg, tok, log=quiet)
    assert rows(ds) == [(e["input_ids"], e["labels"]) for e in examples] and stats == ref_stats
    assert len(list((tmp_path / "c").glob("*/data-*.arrow"))) == 2  # 2 processes wrote it


# ----------------------------------------------------------------------------------------------
# Once per job: the lock.


def _entry(cfg, tok):
    root = Path(cfg.dataset_cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    key = pipeline._fingerprint(cfg, tok)
    return root, key


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_two_nodes_sharing_the_cache_tokenize_once(toks, tmp_path, monkeypatch):
    """Local rank 0 of two nodes on one shared folder: one takes the lock and tokenizes, the other waits and loads."""
    tok = toks["chatml"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS.values()])
    cfg = DataConfig(dataset=str(path), dataset_cache_dir=str(tmp_path / "shared"))
    calls, real = [], pipeline.tokenize_source

    def slow_tokenize(*a, **k):
        calls.append(threading.get_ident())
        time.sleep(1.0)
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "tokenize_source", slow_tokenize)
    out = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, pipeline.prepare_dataset(cfg, tok, log=quiet)), daemon=True)
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(calls) == 1 and len(out) == 2
    assert rows(out[0][0]) == rows(out[1][0]) and out[0][1] == out[1][1]


def test_stale_lock_of_a_dead_process_is_taken_over(toks, tmp_path):
    tok = toks["chatml"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS.values()])
    cfg = DataConfig(dataset=str(path), dataset_cache_dir=str(tmp_path / "c"))
    root, key = _entry(cfg, tok)
    lock = root / f"{key}.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "since": time.time() - 5}))
    assert pipeline.lock_is_stale(lock)
    t0 = time.monotonic()
    ds, stats = pipeline.prepare_dataset(cfg, tok, log=quiet)
    assert time.monotonic() - t0 < 30 and stats.examples == 2 and not lock.exists()
    # A live holder (this process) and one on another host are not stale.
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}))
    assert not pipeline.lock_is_stale(lock)
    lock.write_text(json.dumps({"host": "other-node", "pid": _dead_pid(), "since": time.time()}))
    assert not pipeline.lock_is_stale(lock)
    # A reused pid: alive, but started after the lock was taken.
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time() - 10 ** 6}))
    assert pipeline.lock_is_stale(lock)


def test_waiting_ranks_say_what_they_wait_for(toks, tmp_path, monkeypatch):
    """A lock held on another node: local rank 0 here waits (never silent), local rank 1 too; both load the cache
    once the holder commits it."""
    monkeypatch.setattr(pipeline, "WAIT_NOTE_S", 0.3)
    tok = toks["chatml"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in CONVERSATIONS.values()])
    cfg = DataConfig(dataset=str(path), dataset_cache_dir=str(tmp_path / "c"))
    root, key = _entry(cfg, tok)
    lock = root / f"{key}.lock"
    lock.write_text(json.dumps({"host": "node-7", "pid": 4242, "since": time.time()}))
    logs = {0: [], 1: []}
    out = {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, pipeline.prepare_dataset(
        cfg, tok, local_rank=r, log=logs[r].append)), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    assert not out  # both still waiting
    for r in (0, 1):
        assert len(logs[r]) >= 2, logs[r]
        assert f"for pid 4242 on node-7 to tokenize {path} into {root / key}" in logs[r][-1]
        assert logs[r][-1].startswith("waiting 1s") or logs[r][-1].startswith("waiting 0s"), logs[r][-1]
    # "node-7" finishes: it writes the entry as pipeline._build does, then drops the lock.
    work = root / "node7.tmp"
    work.mkdir()
    pipeline.tokenize_source(cfg, tok, None, work, num_proc=1, name=str(path))
    os.rename(work / "final", root / key)
    lock.unlink()
    for t in threads:
        t.join(timeout=30)
    assert sorted(out) == [0, 1] and rows(out[0][0]) == rows(out[1][0]) and out[0][1].examples == 2


# ----------------------------------------------------------------------------------------------
# Mixing.


def test_mix_counts_exact_and_deterministic():
    sizes = [10_000, 2_000, 7]
    c = mix.counts(sizes, [7, 2, 1])
    assert sum(c) == 12_007 and c == [8405, 2401, 1201]  # 0.7 / 0.2 / 0.1 of 12,007, largest remainder
    assert mix.counts(sizes, None) == sizes
    p1, p2, p3 = mix.plan(sizes, [7, 2, 1], 42), mix.plan(sizes, [7, 2, 1], 42), mix.plan(sizes, [7, 2, 1], 43)
    assert p1 == p2 and p1 != p3
    assert [len(p) for p in p1] == c
    # Fewer than there are: distinct indices in order; more: whole passes then a subset (171 passes + 94 for 7).
    assert p1[0] == sorted(set(p1[0])) and max(p1[0]) < 10_000
    assert p1[1][:2000] == list(range(2000)) and len(set(p1[1][2000:])) == 401
    assert p1[2][: 171 * 7] == list(range(7)) * 171 and len(p1[2]) == 171 * 7 + 4


def test_mix_through_prepare_dataset(toks, tmp_path):
    tok = toks["chatml"]
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": f"a{i}"}, {"role": "assistant", "content": f"A {i}"}]} for i in range(30)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b {i} text"} for i in range(10)])
    cache = str(tmp_path / "c")
    logs = []
    cfg = DataConfig(dataset=[str(a), str(b)], dataset_weights=[0.25, 0.75], dataset_cache_dir=cache)
    ds, stats = pipeline.prepare_dataset(cfg, tok, log=logs.append, seed=3)
    alone = {p: rows(pipeline.prepare_dataset(DataConfig(dataset=str(p), dataset_cache_dir=cache), tok, log=quiet)[0]) for p in (a, b)}
    got = rows(ds)
    assert len(got) == stats.examples == 40
    from_a = [r for r in got if r in alone[a]]
    from_b = [r for r in got if r in alone[b]]
    assert len(from_a) == 10 and len(from_b) == 30 and from_b[:10] == alone[b]  # b three times over
    assert "mix of 2 data sets (by weight, seed 3)" in logs[-1]
    assert f"{a}: 10 of 30 examples (weight 0.250)" in logs[-1] and f"{b}: 30 of 10 examples (weight 0.750; 3.00 passes)" in logs[-1]
    assert stats.records == 40 and stats.format == "mixed: messages, text"
    assert stats.tokens == sum(len(i) for i, _ in got)
    assert stats.trained_tokens == sum(sum(1 for x in lab[1:] if x != -100) for _, lab in got)
    again, _ = pipeline.prepare_dataset(cfg, tok, log=quiet, seed=3)
    other, _ = pipeline.prepare_dataset(cfg, tok, log=quiet, seed=4)
    assert rows(again) == got and rows(other) != got and sorted(map(str, rows(other))) != sorted(map(str, got))
    # Without weights: both whole, in order.
    whole, st = pipeline.prepare_dataset(DataConfig(dataset=[str(a), str(b)], dataset_cache_dir=cache), tok, log=quiet)
    assert rows(whole) == alone[a] + alone[b] and st.examples == 40


def test_mix_flags(tmp_path):
    from finetune.config import ConfigError, parse

    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "y"}])
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text("{}")
    base = ["--model_name_or_path", str(m), "--output_dir", str(tmp_path / "out")]
    cfg = parse([*base, "--dataset", str(a), "--dataset", str(b), "--dataset_weights", "0.7", "0.3",
                            "--dataset_num_proc", "3"], check_paths=False)
    assert cfg.data.dataset == [str(a), str(b)] and cfg.data.dataset_weights == [0.7, 0.3] and cfg.data.dataset_num_proc == 3
    assert parse([*base, "--dataset", str(a)], check_paths=False).data.dataset == str(a)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"dataset: [{a}, {b}]\ndataset_weights: [1, 3]\n")
    cfg = parse([*base, "--recipe", str(recipe)], check_paths=False)
    assert cfg.data.dataset == [str(a), str(b)] and cfg.data.dataset_weights == [1.0, 3.0]
    with pytest.raises(ConfigError) as e:
        parse([*base, "--dataset", str(a), "--dataset", str(b), "--dataset_weights", "1", "--dataset_num_proc", "0"],
              check_paths=False)
    assert "dataset_weights: 1 weights for 2 data set(s); give one per --dataset" in str(e.value)
    assert "dataset_num_proc: must be at least 1, got 0" in str(e.value)


def _resident_kb(path: Path) -> int:
    """This process's resident kB in mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and not fields[0].endswith(":"):  # a mapping's header line (its fields' lines start "Name:")
            inside = fields[-1] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_bookkeeping_columns_read_without_the_memory_map(tmp_path):
    """The counts after the map come from the map's files read batch by batch, not through its memory map (whose
    faults brought in the tokens' pages around each small column: +270 MB RSS at 1M conversations): the same
    numbers as the memory-mapped table's columns, over several files, and no page of the files made resident."""
    import datasets
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from finetune import compat

    rng = np.random.default_rng(0)
    n = 3000
    source = datasets.Dataset.from_dict({
        "input_ids": [list(range(int(k))) for k in rng.integers(0, 300, n)], "_status": rng.integers(0, 8, n).tolist(),
        "_split": rng.integers(0, 3, n).tolist(), "_no_end": rng.integers(0, 2, n).tolist(),
        "_trained": rng.integers(0, 50, n).tolist(),
    })
    mapped = source.map(lambda b: b, batched=True, num_proc=2, writer_batch_size=100,
                        cache_file_name=str(tmp_path / "map.arrow"), features=source.features)
    files = [f["filename"] for f in mapped.cache_files]
    assert len(files) == 2
    compat.release_mapped_pages(files)  # as if the map had written more than memory holds
    before = sum(_resident_kb(Path(f)) for f in files)
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    status, split, no_end, trained, lengths = pipeline._bookkeeping(files, memory_pool=pool)
    assert sum(_resident_kb(Path(f)) for f in files) == before
    # One batch held at a time: the reader's peak is a few batches' bytes, not the files'.
    batch_bytes = max(b.nbytes for b in mapped.data.to_batches(max_chunksize=100))
    assert pool.max_memory() <= 3 * batch_bytes < sum(os.path.getsize(f) for f in files) / 5, (pool.max_memory(), batch_bytes)
    table = mapped.data
    for got, column in ((status, "_status"), (split, "_split"), (no_end, "_no_end"), (trained, "_trained")):
        assert np.array_equal(got, table.column(column).to_numpy()), column
    assert np.array_equal(lengths, pc.list_value_length(table.column("input_ids")).to_numpy())
    # The control: the same columns read through the memory map made pages of the files resident.
    after_map = sum(_resident_kb(Path(f)) for f in files)
    assert after_map > before
    assert int(lengths.sum()) == sum(len(x) for x in source["input_ids"])
