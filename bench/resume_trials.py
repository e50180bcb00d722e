"""Random-kill resume trials: `kill -9` of a random rank at a random moment, then `--resume_from_checkpoint latest`.

For each path (Trainer: finetune/train.py under accelerate launch; loop: finetune/loop.py under accelerate launch;
engine: scripts/sft.py under deepspeed; dpo: the Trainer path with --method dpo, full fine-tuning; orpo: the loop with
--method orpo, a method without a reference model) and preset (zero2,
zero3 = ZeRO-3 with CPU Adam offload): one uninterrupted 2-rank reference run. Each trial (seeded) starts the same
job into a fresh folder and kills (SIGKILL) a random rank a random step and a random fraction of the reference's
mean step time later, so the kill lands anywhere in the next step or a checkpoint save. The rank stops itself at that
point (finetune.testing.stop_env) and is killed there: the kill point does not depend on how fast this harness polls,
and a run of a few tenths of a second cannot end first. Then the same command runs again; the resumed run's per-step
losses (all STEPS of them) must equal the reference's within 1e-6. STEPS=8 with 6 steps per epoch: every resume
after step 6 is in the second epoch.

    python bench/resume_trials.py --trials 10 --work /tmp/trials --write   # the table in bench/RESULTS.md

tests/test_resume_trials.py runs the same trials (the loop and DPO once each in CI; FINETUNE_RESUME_TRIALS=10: ten on
every path) and can record its rows, which `--rows FILE --write` turns into the table.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from finetune.testing import (LOOP, REPO, TRAIN, deepspeed_launcher, launcher, losses, run,  # noqa: E402
                              run_and_kill_rank)

STEPS, SAVE, RECORDS, TOL = 8, 2, 24, 1e-6
PATHS = {
    "trainer": lambda: launcher("accelerate", 2, script=TRAIN),
    "loop": lambda: launcher("accelerate", 2, script=LOOP),
    "engine": lambda: deepspeed_launcher(2),
    # DPO (full fine-tuning: under ZeRO-3 its frozen reference is partitioned too) on the Trainer path.
    "dpo": lambda: launcher("accelerate", 2, script=TRAIN),
    # ORPO (no reference model: the run's state is the policy's alone) on the loop.
    "orpo": lambda: launcher("accelerate", 2, script=LOOP),
}
# The paths that train a preference method on the pairs: their --method.
PAIR_METHODS = {"dpo": "dpo", "orpo": "orpo"}
PRESETS = ("zero2", "zero3")
BEGIN, END = "<!-- resume_trials:begin -->", "<!-- resume_trials:end -->"


def setup(work: Path) -> tuple[Path, Path]:
    from finetune.models import tiny

    model = work / "model"
    if not (model / "config.json").is_file():
        tiny.build(model, style="chatml")
    records = tiny.synthetic_records(RECORDS, seed=7)
    # Preference pairs from the same records: the right answer against its words reversed (or a count off by one).
    pairs = []
    for r in records:
        prompt, answer = r["messages"][:-1], r["messages"][-1]["content"]
        wrong = str(int(answer) + 1) if answer.isdigit() else " ".join(reversed(answer.split()))
        pairs.append({"prompt": prompt, "chosen": answer, "rejected": wrong if wrong != answer else answer + " again"})
    tiny.write_jsonl(work / "pairs.jsonl", pairs)
    return model, tiny.write_jsonl(work / "data.jsonl", records)


def command(path: str, preset: str, work: Path, out: Path) -> list[str]:
    model, data = work / "model", work / ("pairs.jsonl" if path in PAIR_METHODS else "data.jsonl")
    return PATHS[path]() + (["--method", PAIR_METHODS[path]] if path in PAIR_METHODS else []) + [
        "--config", preset, "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
        "--dataset_cache_dir", str(work / "cache"), "--max_steps", str(STEPS), "--save_steps", str(SAVE),
        "--per_device_train_batch_size", "2", "--learning_rate", "2e-3", "--warmup_steps", "2", "--seed", "1234",
        "--max_seq_length", "128", "--disable_tqdm", "true", "--resume_from_checkpoint", "latest",
    ]


def steps_logged(output: str) -> int:
    return output.count("{'loss'")


def kill_at(cmd: list[str], step: int, rank: int, delay: float, timeout: float = 600) -> dict:
    """Run `cmd`; `delay` s after optimizer step `step`, rank `rank` stops itself and is killed with SIGKILL there
    (finetune.testing.run_and_kill_rank with stop_at); wait for every process. The kill point does not depend on how
    fast this harness polls: a run of a few tenths of a second cannot end first."""
    killed = run_and_kill_rank(cmd, None, rank=rank, timeout=timeout, exit_bound=120, stop_at=(step, delay))
    if killed.returncode == 0 or killed.survivors:
        raise AssertionError(f"after the kill: exit {killed.returncode}, left running {killed.survivors}\n"
                             f"{killed.output[-4000:]}")
    return {"logged_at_kill": steps_logged(killed.output[:killed.output_at_kill]),
            "exit_s": round(killed.exit_seconds, 1)}


def step_seconds(out: Path) -> float:
    """Mean seconds per step of a finished run, its checkpoint saves included."""
    state = json.loads((out / "trainer_state.json").read_text())
    return state["log_history"][-1]["train_runtime"] / STEPS


def reference(path: str, preset: str, work: Path) -> tuple[list[float], float]:
    """The uninterrupted run's per-step losses, and its mean seconds per step."""
    out = work / f"ref-{path}-{preset}"
    if not (out / "trainer_state.json").is_file():
        run(command(path, preset, work, out), timeout=900).check()
    return losses(out), step_seconds(out)


def trial(path: str, index: int, seed: int, work: Path) -> dict:
    rng = random.Random(f"{seed}-{path}-{index}")
    preset = PRESETS[index % len(PRESETS)]
    step, rank, fraction = rng.randint(1, STEPS - 2), rng.randint(0, 1), rng.uniform(0.0, 1.0)
    expected, per_step = reference(path, preset, work)
    # Anywhere within about one step (its checkpoint save included) after `step`.
    delay = round(fraction * per_step, 3)
    out = work / f"trial-{path}-{index}"
    cmd = command(path, preset, work, out)
    start = time.time()
    row = {"path": path, "trial": index, "preset": preset, "kill_after_step": step, "rank": rank, "delay_s": delay}
    row.update(kill_at(cmd, step, rank, delay))
    resumed = run(cmd, timeout=900).check()
    found = re.search(r"resume: from \S*checkpoint-(\d+)", resumed.output)
    # "final": the kill came after the final model was saved, and `latest` found it and did nothing.
    done = "already holds this run's final model" in resumed.output
    row["resumed_from"] = int(found.group(1)) if found else ("final" if done else 0)
    got = losses(out)
    row["max_diff"] = max(abs(a - b) for a, b in zip(expected, got)) if len(got) == len(expected) == STEPS else None
    row["ok"] = row["max_diff"] is not None and row["max_diff"] <= TOL
    row["seconds"] = round(time.time() - start, 1)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| path | trial | preset | killed rank | after step (+s) | steps logged at kill | resumed from step "
             "| launcher exit after kill (s) | max loss diff | exact |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "n/a" if r["max_diff"] is None else f"{r['max_diff']:.1e}"
        lines.append(f"| {r['path']} | {r['trial']} | {r['preset']} | {r['rank']} | {r['kill_after_step']} "
                     f"(+{r['delay_s']}) | {r['logged_at_kill']} | {r['resumed_from']} | {r['exit_s']} | {diff} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def run_trials(args) -> list[dict]:
    args.work.mkdir(parents=True, exist_ok=True)
    setup(args.work)
    rows, results = [], args.work / "trials.jsonl"
    for i in range(args.trials):  # paths interleaved: a cut-short run still covers each path
        for path in args.paths:
            row = trial(path, i, args.seed, args.work)
            rows.append(row)
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10, help="trials per path (presets alternate)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=Path("/tmp/finetune-resume-trials"))
    p.add_argument("--write", action="store_true", help="write the table into bench/RESULTS.md")
    p.add_argument("--rows", type=Path, help="no trials: the table of rows already recorded in this JSONL file "
                   "(FINETUNE_RESUME_TRIALS_ROWS of tests/test_resume_trials.py)")
    args = p.parse_args(argv)
    if args.rows:
        rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    else:
        rows = run_trials(args)
    text = table(rows)
    print(text)
    if args.write:
        target = REPO / "bench" / "RESULTS.md"
        body = target.read_text()
        block = f"{BEGIN}\n{text}\n{END}"
        body = (body[:body.index(BEGIN)] + block + body[body.index(END) + len(END):]) if BEGIN in body \
            else body.rstrip() + f"\n\n## Random-kill resume trials (bench/resume_trials.py)\n\n{block}\n"
        target.write_text(body)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
