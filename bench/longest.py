"""The longest record one process trains within a memory budget, by bisection over measured runs (CPU).

    python bench/longest.py --budget 3GiB [--modes plain ckpt tiled ckpt+tiled] [--minutes 20]

Each probe is a real run of bench/memory.py's worker (the project's config -> load_model -> HF Trainer, the chunked
loss as by default) on the 56M-parameter bench model, one record of L random tokens per step, 2 steps (Adam's
states exist in the second), one process, fp32; it fits when it finishes and its peak RSS (VmHWM) is within the
budget. Per mode (--gradient_checkpointing, --tiled_mlp, both, neither) the bisection starts at the planner's
longest length for the budget, widens until it has a fitting and a failing length, and halves the gap down to
--step tokens. A probe the planner puts above the memory this machine has free (MemAvailable less --margin) is not
run: the row then says so, rather than swapping or killing a neighbour. The planner's longest length for --report
(24 GiB by default: the machine's memory) is recorded beside each measured one.

Writes bench/results/longest.json (every probe: length, predicted and measured peak, seconds) and the table
between the `longest-table` markers of bench/RESULTS.md; the "with SP" column is left for the sequence-parallel
rows (--sequence_parallel_size), to be filled where that option exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODES = {"plain": [], "ckpt": ["--gradient_checkpointing"], "tiled": ["--tiled_mlp"],
         "ckpt+tiled": ["--gradient_checkpointing", "--tiled_mlp"]}
STEPS = 2


def _memory():
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_bench_memory", REPO / "bench" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def available() -> int:
    """MemAvailable of this machine, bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def predicted(bench, model, mode: str, length: int) -> int:
    from finetune.plan import planner as plan

    job = bench.job_for(model, "ddp", 1, micro=1, seq=length)
    return plan.predict(job.replace(grad_ckpt="--gradient_checkpointing" in MODES[mode],
                                    tiled_mlp="--tiled_mlp" in MODES[mode])).device_total


def planned_longest(bench, model, mode: str, budget: int, step: int) -> int:
    """The longest multiple of `step` the planner fits within `budget` (0: none)."""
    lo, hi = 0, step
    while predicted(bench, model, mode, hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if predicted(bench, model, mode, mid) <= budget else (lo, mid)
    return lo


def probe(bench, model, mode: str, length: int, work: Path, budget: int, margin: int, timeout: float) -> dict:
    pred = predicted(bench, model, mode, length)
    row = {"mode": mode, "length": length, "predicted": pred}
    free = available() - margin
    if pred > free:
        return {**row, "fits": None, "why": f"not run: predicted {pred / 2**30:.2f} GiB > {free / 2**30:.2f} GiB free"}
    flags = ["--per_device_train_batch_size", "1", "--max_seq_length", str(length), "--seed", "0", *MODES[mode]]
    t0 = time.time()
    try:
        (rank,) = bench.measure(model, "ddp", 1, work / f"{mode}-{length}", flags, steps=STEPS, timeout=timeout)
    except BaseException as e:  # noqa: BLE001 - a run that died (killed for memory, timed out) does not fit
        return {**row, "fits": False, "why": f"failed: {str(e).splitlines()[0][:200]}", "seconds": time.time() - t0}
    return {**row, "fits": rank["maxrss"] <= budget, "measured": rank["maxrss"], "seconds": time.time() - t0}


def bisect(bench, model, mode: str, work: Path, args, deadline: float) -> tuple[int | None, list[dict]]:
    """-> (the longest fitting length measured, or None; the probes)."""
    step, probes = args.step, []
    start = max(step, planned_longest(bench, model, mode, args.budget, step))
    lo = hi = None
    length = start
    while time.time() < deadline:
        row = probe(bench, model, mode, length, work, args.budget, args.margin, args.probe_timeout)
        probes.append(row)
        print(json.dumps(row), flush=True)
        if row["fits"] is None:
            hi = length if hi is None else min(hi, length)  # above what may be run here: bisect below it
        elif row["fits"]:
            lo = length
        else:
            hi = length
        if lo is not None and hi is not None and hi - lo <= step:
            break
        if hi is None:
            length = lo + max(step, lo // 4 // step * step)
        elif lo is None:
            length = max(step, hi - max(step, hi // 4 // step * step))
            if length == hi:
                break
        else:
            length = (lo + hi) // 2 // step * step
    return lo, probes


def table(result: dict) -> str:
    gib = 2**30
    lines = [f"Budget {result['budget'] / gib:.1f} GiB measured (peak RSS), one process, micro-batch 1, fp32, the "
             f"chunked loss; bench model ({result['params'] / 1e6:.0f}M parameters); load average "
             f"{result['load'][0]:.1f} before, {result['load'][1]:.1f} after (2 cores shared); "
             f"{result['minutes']:.1f} min; `{result['command']}`.", "",
             f"| mode | longest measured within {result['budget'] / gib:.1f} GiB | its peak RSS (planned) | first "
             f"length that did not fit | planner's longest within {result['budget'] / gib:.1f} GiB | planner's "
             f"longest within {result['report'] / gib:.0f} GiB | with SP |",
             "|---|---|---|---|---|---|---|"]
    for mode, m in result["modes"].items():
        if m["probes"] is None:
            lines.append(f"| {mode} | not measured | | | {m['planned']} | {m['planned_report']} | |")
            continue
        fit = next((p for p in m["probes"] if p["length"] == m["longest"] and p.get("fits")), None)
        over = min((p["length"] for p in m["probes"] if p["fits"] is False), default=None)
        lines.append(
            f"| {mode} | {m['longest'] or '-'} | "
            + (f"{fit['measured'] / 1e6:,.0f} MB ({fit['predicted'] / 1e6:,.0f} MB, "
               f"{(fit['predicted'] / fit['measured'] - 1) * 100:+.1f}%)" if fit else "-")
            + f" | {over or '-'} | {m['planned']} | {m['planned_report']} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from finetune.plan.planner import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=parse_size, default=parse_size("3GiB"), help="peak RSS a probe may reach")
    ap.add_argument("--report", type=parse_size, default=parse_size("24GiB"),
                    help="the memory the planner's second longest length is for (the machine's)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--step", type=int, default=512, help="tokens: the bisection stops at this gap")
    ap.add_argument("--margin", type=parse_size, default=parse_size("2GiB"), help="memory left free for others")
    ap.add_argument("--minutes", type=float, default=20.0, help="no probe starts after this")
    ap.add_argument("--probe-timeout", type=float, default=600.0)
    ap.add_argument("--work", default="/tmp/finetune-longest")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    bench = _memory()
    work = Path(args.work)
    model = bench.build_model(work / "model")
    t0, load0 = time.time(), os.getloadavg()[0]
    deadline = t0 + 60 * args.minutes
    result = {"budget": args.budget, "report": args.report, "step": args.step, "modes": {},
              "command": "python bench/longest.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    for mode in MODES:  # the modes not asked for: the planner's figures only
        longest, probes = bisect(bench, model, mode, work, args, deadline) if mode in args.modes else (None, None)
        result["modes"][mode] = {"longest": longest, "probes": probes,
                                 "planned": planned_longest(bench, model, mode, args.budget, args.step),
                                 "planned_report": planned_longest(bench, model, mode, args.report, args.step)}
    from finetune.plan import planner as plan

    result.update(minutes=(time.time() - t0) / 60, load=[load0, os.getloadavg()[0]],
                  params=plan.model_shape(plan.read_config(model)).num_params)
    out = REPO / "bench" / "results" / "longest.json"
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    if not args.no_write:
        bench.write_results([], marker="longest-table", title="Longest record on one CPU process (bench/longest.py)",
                            render=lambda _rows: table(result))


if __name__ == "__main__":
    main()
