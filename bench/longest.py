"""The longest record one process trains within a memory budget, by bisection over measured runs (CPU).

    python bench/longest.py --budget 3GiB [--modes plain ckpt tiled ckpt+tiled] [--minutes 20]
    python bench/longest.py --budget 2GiB --modes --keep --sequence_parallel_size 2 --sp_modes plain tiled

Each probe is a real run of bench/memory.py's worker (the project's config -> load_model -> HF Trainer, the chunked
loss as by default) on the 56M-parameter bench model, one record of L random tokens per step, 2 steps (Adam's
states exist in the second), one process, fp32; it fits when it finishes and its peak RSS (VmHWM) is within the
budget. Per mode (--gradient_checkpointing, --tiled_mlp, both, neither) the bisection starts at the planner's
longest length for the budget, widens until it has a fitting and a failing length, and halves the gap down to
--step tokens. A probe the planner puts above the memory this machine has free (MemAvailable less --margin) is not
run: the row then says so, rather than swapping or killing a neighbour. The planner's longest length for --report
(24 GiB by default: the machine's memory) is recorded beside each measured one.

With --sequence_parallel_size N (N > 1) each mode in --sp_modes is bisected again with every record split over N
real ranks (DeepSpeed Ulysses on the engine path, `deepspeed --num_gpus N scripts/sft.py` through
tests/sp_memory_worker.py, OMP_NUM_THREADS=1): the same model with a tokenizer added, records of chat text
truncated to L tokens (one record per step, 2 steps), `--config ddp` (DeepSpeed's stage 0: every rank keeps the
whole model, gradients and Adam states, as the one process does, so only the split differs); it fits when every
rank's VmHWM is within the same budget. Its planner figures are for N ranks of that budget each (and of --report).

Writes bench/results/longest.json (every probe: length, predicted and measured peak, seconds) and the table
between the `longest-table` markers of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def predicted(bench, model, mode: str, length: int, sp: int = 1) -> int:
    """The planner's peak of one rank (sp > 1: of `sp` ranks splitting each record, stage 0)."""
    from finetune.plan import planner as plan

    job = bench.job_for(model, "ddp", sp, micro=1, seq=length)
    return plan.predict(job.replace(grad_ckpt="--gradient_checkpointing" in MODES[mode],
                                    tiled_mlp="--tiled_mlp" in MODES[mode], sequence_parallel=sp)).device_total


def planned_longest(bench, model, mode: str, budget: int, step: int, sp: int = 1) -> int:
    """The longest multiple of `step` the planner fits within `budget` per rank (0: none)."""
    lo, hi = 0, step
    while predicted(bench, model, mode, hi, sp) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if predicted(bench, model, mode, mid, sp) <= budget else (lo, mid)
    return lo


def sp_model(bench, work: Path) -> Path:
    """The bench model with a tiny chat tokenizer beside it (the engine path reads text; its 512 ids are within the
    model's 32,000, so the model, its states and its logits are the plain probes')."""
    from finetune.models import tiny

    folder = work / "model-sp"
    if not (folder / "tokenizer.json").is_file():
        shutil.copytree(bench.build_model(work / "model"), folder, dirs_exist_ok=True)
        tiny.build_tokenizer(folder, style="chatml")
    return folder


def sp_data(work: Path, length: int) -> Path:
    """Two text records (every token trained) of more than `length` tokens, truncated to it by the run."""
    from finetune.models import tiny

    path = work / f"sp-data-{length}.jsonl"
    if not path.is_file():
        import random

        rng = random.Random(length)
        tiny.write_jsonl(path, [{"text": " ".join(rng.choice(tiny.WORDS) for _ in range(length))} for _ in range(2)])
    return path


def sp_command(model: Path, data: Path, out: Path, mode: str, length: int, sp: int, port: int) -> list[str]:
    """One sequence-parallel probe: `sp` ranks of the engine path, each recording its VmHWM under OUT/hwm."""
    from finetune import testing as launch

    return [str(launch.BIN / "deepspeed"), "--num_gpus", str(sp), "--master_port", str(port),
            str(REPO / "tests" / "sp_memory_worker.py"), str(out / "hwm"), "--",
            "--config", "ddp", "--model_name_or_path", str(model), "--dataset", str(data),
            "--output_dir", str(out / "out"), "--dataset_cache_dir", str(out / "cache"), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1", "--max_seq_length",
            str(length), "--seed", "0", "--learning_rate", "1e-5", "--disable_tqdm", "true",
            "--sequence_parallel_size", str(sp), *MODES[mode]]


def measure_sp(bench, model: Path, mode: str, length: int, work: Path, sp: int, timeout: float) -> int:
    """The largest VmHWM of the `sp` ranks of one probe, bytes."""
    from finetune import testing as launch

    out = work / f"sp{sp}-{mode}-{length}"
    cmd = sp_command(model, sp_data(work, length), out, mode, length, sp, launch.free_port())
    result = launch.run(cmd, timeout=timeout, MALLOC_MMAP_THRESHOLD_=bench.MMAP_THRESHOLD, OMP_NUM_THREADS="1").check()
    assert f"each record split over {sp}" in result.output, result.output[-2000:]
    data = next((line for line in result.output.splitlines() if line.startswith("data:")), "no data line")
    assert f"2 examples, {2 * length} tokens" in data, f"records not {length} tokens long: {data}"
    shutil.rmtree(out / "out")  # the saved model: not needed
    return max(int((out / "hwm" / f"hwm-{r}").read_text()) * 1024 for r in range(sp))


def probe(bench, model, mode: str, length: int, work: Path, budget: int, margin: int, timeout: float,
          sp: int = 1) -> dict:
    pred = predicted(bench, model, mode, length, sp)
    row = {"mode": mode, "length": length, "predicted": pred, **({"sequence_parallel": sp} if sp > 1 else {})}
    free = available() - margin
    if pred * sp > free:
        return {**row, "fits": None,
                "why": f"not run: predicted {sp} x {pred / 2**30:.2f} GiB > {free / 2**30:.2f} GiB free"}
    flags = ["--per_device_train_batch_size", "1", "--max_seq_length", str(length), "--seed", "0", *MODES[mode]]
    t0 = time.time()
    try:
        if sp > 1:
            peak = measure_sp(bench, model, mode, length, work, sp, timeout)
        else:
            (rank,) = bench.measure(model, "ddp", 1, work / f"{mode}-{length}", flags, steps=STEPS, timeout=timeout)
            peak = rank["maxrss"]
    except BaseException as e:  # noqa: BLE001 - a run that died (killed for memory, timed out) does not fit
        return {**row, "fits": False, "why": f"failed: {str(e).splitlines()[0][:200]}", "seconds": time.time() - t0}
    return {**row, "fits": peak <= budget, "measured": peak, "seconds": time.time() - t0}


def bisect(bench, model, mode: str, work: Path, args, deadline: float, sp: int = 1) -> tuple[int | None, list[dict]]:
    """-> (the longest fitting length measured, or None; the probes)."""
    step, probes = args.step, []
    start = max(step, planned_longest(bench, model, mode, args.budget, step, sp))
    lo = hi = None
    length = start
    while time.time() < deadline:
        row = probe(bench, model, mode, length, work, args.budget, args.margin, args.probe_timeout, sp)
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


def _measured(m: dict) -> tuple[str, str, str]:
    """(longest measured, its peak (planned), first length that did not fit) of one bisection."""
    fit = next((p for p in m["probes"] if p["length"] == m["longest"] and p.get("fits")), None)
    over = min((p["length"] for p in m["probes"] if p["fits"] is False), default=None)
    peak = (f"{fit['measured'] / 1e6:,.0f} MB ({fit['predicted'] / 1e6:,.0f} MB, "
            f"{(fit['predicted'] / fit['measured'] - 1) * 100:+.1f}%)" if fit else "-")
    return str(m["longest"] or "-"), peak, str(over or "-")


def table(result: dict) -> str:
    gib = 2**30
    budget, sp = f"{result['budget'] / gib:.1f} GiB", result.get("sequence_parallel", 1)
    runs = [*result.get("earlier", []), result]
    lines = [f"Budget {budget} measured (peak RSS; with SP: each rank's), micro-batch 1, fp32, the chunked loss; "
             f"bench model ({result['params'] / 1e6:.0f}M parameters). "
             + " ".join(f"Run: `{r['command']}`, load average {r['load'][0]:.1f} before, {r['load'][1]:.1f} after "
                        f"(2 cores shared), {r['minutes']:.1f} min." for r in runs), "",
             f"| mode | longest measured within {budget} | its peak RSS (planned) | first length that did not fit | "
             f"planner's longest within {budget} | planner's longest within {result['report'] / gib:.0f} GiB | with "
             f"SP {sp}: longest measured within {budget} per rank | its largest rank's peak (planned) | first length "
             f"that did not fit | planner's longest within {budget} per rank | planner's longest within "
             f"{result['report'] / gib:.0f} GiB ({result['report'] / sp / gib:.0f} GiB per rank) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, m in result["modes"].items():
        cells = list(_measured(m)) if m["probes"] is not None else ["not measured", "", ""]
        cells += [str(m["planned"]), str(m["planned_report"])]
        s = result.get("sp", {}).get(mode)
        if s is None:
            cells += ["", "", "", "", ""]
        else:
            cells += list(_measured(s)) if s["probes"] is not None else ["not measured", "", ""]
            cells += [str(s["planned"]), str(s["planned_report"])]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
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
    ap.add_argument("--sequence_parallel_size", type=int, default=1,
                    help="N > 1: also bisect --sp_modes with each record split over N ranks")
    ap.add_argument("--sp_modes", nargs="*", default=["plain"], choices=list(MODES))
    ap.add_argument("--keep", action="store_true",
                    help="keep the measured bisections of bench/results/longest.json for the modes not asked for "
                         "(its command, load and minutes stay in the table)")
    args = ap.parse_args(argv)
    bench = _memory()
    work = Path(args.work)
    model = bench.build_model(work / "model")
    out = REPO / "bench" / "results" / "longest.json"
    earlier = json.loads(out.read_text()) if args.keep and out.is_file() else None
    t0, load0 = time.time(), os.getloadavg()[0]
    deadline = t0 + 60 * args.minutes
    sp = args.sequence_parallel_size
    result = {"budget": args.budget, "report": args.report, "step": args.step, "modes": {}, "sp": {},
              "sequence_parallel": sp,
              "command": "python bench/longest.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    for mode in MODES:  # the modes not asked for: the planner's figures only (or the kept measurements)
        if mode in args.modes:
            longest, probes = bisect(bench, model, mode, work, args, deadline)
        elif earlier and earlier["modes"].get(mode, {}).get("probes") is not None:
            longest, probes = earlier["modes"][mode]["longest"], earlier["modes"][mode]["probes"]
        else:
            longest, probes = None, None
        result["modes"][mode] = {"longest": longest, "probes": probes,
                                 "planned": planned_longest(bench, model, mode, args.budget, args.step),
                                 "planned_report": planned_longest(bench, model, mode, args.report, args.step)}
    if earlier and any(earlier["modes"][m].get("probes") is not None for m in MODES if m not in args.modes):
        result["earlier"] = [{k: earlier[k] for k in ("command", "load", "minutes")}, *earlier.get("earlier", [])]
    if sp > 1:
        smodel = sp_model(bench, work)
        for mode in MODES:
            longest, probes = (bisect(bench, smodel, mode, work, args, deadline, sp) if mode in args.sp_modes
                               else (None, None))
            result["sp"][mode] = {"longest": longest, "probes": probes,
                                  "planned": planned_longest(bench, model, mode, args.budget, args.step, sp),
                                  "planned_report": planned_longest(bench, model, mode, args.report // sp,
                                                                    args.step, sp)}
    from finetune.plan import planner as plan

    result.update(minutes=(time.time() - t0) / 60, load=[load0, os.getloadavg()[0]],
                  params=plan.model_shape(plan.read_config(model)).num_params)
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    if not args.no_write:
        bench.write_results([], marker="longest-table", title="Longest record on one CPU process (bench/longest.py)",
                            render=lambda _rows: table(result))


if __name__ == "__main__":
    main()
