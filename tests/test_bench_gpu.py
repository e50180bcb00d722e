"""bench/gpu.py: the one-GPU bench, run end to end on CPU with tiny shapes (--cpu-smoke), and its report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import gpu as G  # noqa: E402


def test_peak_from_the_device_name():
    assert G.peak_for("NVIDIA H100 80GB HBM3") == (989e12, "H100")
    assert G.peak_for("NVIDIA H100 PCIe")[0] == 756e12
    assert G.peak_for("NVIDIA H100 NVL")[0] == 835e12
    assert G.peak_for("NVIDIA H200")[0] == 989e12
    assert G.peak_for("cpu") == (None, "")


def test_record_replaces_the_section_of_the_same_device(tmp_path):
    data = {"mode": "gpu", "command": "bash bench/gpu_run.sh", "date": "2026-11-27 18:00 UTC", "wall": 400,
            "budget": 450, "info": {"device": "NVIDIA H100 80GB HBM3", "versions": {}}, "sections": {
                "padfree": {"error": "RuntimeError: boom"}}, "notes": []}
    run = tmp_path / "gpu.json"
    run.write_text(json.dumps(data))
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmarks\n\n## Memory planner\n\nkeep me\n\n## Throughput\n\nkeep me too\n")
    G.record(str(run), results)
    data["wall"] = 123
    run.write_text(json.dumps(data))
    G.record(str(run), results)
    text = results.read_text()
    assert text.count("## GPU: NVIDIA H100 80GB HBM3 (bench/gpu.py)") == 1 and "123 s of a 450 s budget" in text
    assert "keep me\n" in text and "keep me too" in text and "Section failed: RuntimeError: boom" in text
    assert "`bash bench/gpu_run.sh`" in text


def test_long_section_renders_a_gpu_run():
    """The long section's GPU rows (measured peaks, the planner's error) as --record writes them: the CPU smoke test has
    no CUDA peak to show, so this part of the report is checked on a run's JSON."""
    gib = 2**30
    modes = [{"mode": "ckpt", "cuda": 14 * gib, "device": 14.4 * gib, "step_s": 1.5, "losses": [12.0, 11.9]},
             {"mode": "ckpt+offload", "cuda": 12 * gib, "device": 13.0 * gib, "step_s": 1.6, "losses": [12.0, 11.9]},
             {"mode": "ckpt+tiled", "skipped": "over the section's 90 s (10 s left)"},
             {"mode": "ckpt+tiled+offload", "error": "RuntimeError: CUDA out of memory"}]
    for r in modes[:2]:
        r["rel_error"] = (r["device"] - r["cuda"]) / r["cuda"]
        r["within"] = abs(r["rel_error"]) <= G.MEMORY_RTOL
        r["loss_rel_diff"] = 0.0
    sec = {"model": "1b", "description": "1,235,814,400 parameters", "seq": 32768, "steps": 3,
           "bound": G.LONG_LOSS_RTOL, "planner_bound": G.MEMORY_RTOL, "modes": modes, "notes": [],
           "max_loss_rel_diff": 0.0, "loss_pass": True}
    data = {"mode": "gpu", "info": {"device": "NVIDIA H200", "versions": {}}, "sections": {"long": sec}, "notes": []}
    text = G.render(data)
    assert "one record of 32,768 tokens" in text
    assert "| ckpt | 14.00 GiB | 14.40 GiB | +2.9% ok | 1,500 ms | 12.000000 | 0.0e+00 |" in text
    assert "| ckpt+offload | 12.00 GiB | 13.00 GiB | +8.3% OFF |" in text
    assert "| ckpt+tiled | over the section's 90 s" in text and "| ckpt+tiled+offload | FAILED: RuntimeError" in text
    checks = G.verdict_lines(data)
    assert "CHECK long ckpt: planner +2.9% (within 5%), peak 14.00 GiB, step 1.50 s" in checks
    assert "CHECK long ckpt+offload: planner +8.3% (OUTSIDE 5%), peak 12.00 GiB, step 1.60 s" in checks
    assert "CHECK long ckpt+tiled: skipped (time)" in checks and "CHECK long ckpt+tiled+offload: FAILED to run" in checks
    assert "CHECK long step-1 losses equal across modes: PASS (max rel diff 0.0e+00, bound 0.01)" in checks


# About 3 minutes on 2 cores (every section in forked children, 18 throughput rows, 4 profiled): a bench script's
# readiness, run before a GPU session and with FINETUNE_FULL_MATRIX=1, not in CI.
@pytest.mark.slow
@pytest.mark.full_matrix
def test_cpu_smoke_runs_every_section_with_sane_numbers(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    # A generous budget: under a loaded test machine nothing should be skipped for time.
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--cpu-smoke", "--budget", "900", "--write", str(out),
                           "--work", str(work)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    (out / "stdout.txt").write_text(proc.stdout)
    data = json.loads((out / "gpu.json").read_text())
    assert (out / "gpu.md").read_text().startswith("## GPU: cpu (bench/gpu.py)")
    secs = data["sections"]
    assert set(secs) == {"long", "rows", "padfree", "bf16", "memory", "throughput", "profile"}
    assert not any("error" in s for s in secs.values()), {k: s.get("error", "")[:500] for k, s in secs.items()}

    check_long_section(secs["long"], out)

    # Padding-free and packed rows give the padded batch's loss on the same trained tokens.
    (run,) = secs["padfree"]["runs"]
    assert run["pass"], run["layouts"]
    layouts = run["layouts"]
    assert {"padded", "padding-free (one flat row)", "packed rows (per-record sdpa, finetune)"} <= set(layouts)
    for name, r in layouts.items():
        assert math.isfinite(r["loss"]) and r["same_targets"], (name, r)
        if not r["control"]:
            assert r["rel_diff"] <= G.PADFREE_RTOL, (name, r)
    assert run["control_detected"] in ("loss", "gradient")

    # bf16 mixed precision tracks fp32 step by step; every save reloads to the same logits.
    runs = secs["bf16"]["runs"]
    assert set(runs) == set(G.BF16_RUNS)
    for name, r in runs.items():
        assert "error" not in r, (name, r.get("error", "")[:2000])
        assert len(r["losses"]) == secs["bf16"]["steps"] and all(map(math.isfinite, r["losses"])), (name, r["losses"])
        assert r["save_pass"] and r["verify"]["max_logit_diff"] <= r["verify"]["atol"], (name, r["verify"])
    mixed = runs["bf16 mixed (fp32 weights, --bf16)"]
    assert mixed["loss_pass"] and mixed["max_rel_diff"] <= G.BF16_MIXED_RTOL
    assert 0 < mixed["first_rel_diff"] < 1e-3  # autocast did run, and step 1 is the same forward up to rounding
    assert runs["LoRA, bf16 base, --bf16"]["verify"]["kind"] == "adapter"

    # The planner's numbers for each cell (no CUDA here, so nothing measured to compare).
    rows = secs["memory"]["rows"]
    assert [r["cell"] for r in rows] == list(G.SETTINGS["cpu-smoke"]["memory_cells"])
    for r in rows:
        assert "error" not in r, r["error"][:2000]
        assert r["device"] > 0 and r["saved_planned"] > 0 and r["cuda"] is None

    # Throughput: every row ran every repeat, and the ratio ft/TRL is taken within repeats with its spread.
    tp = secs["throughput"]
    assert not [r for r in tp["results"] if "error" in r]
    assert not tp["notes"], tp["notes"]
    summary = {(e["model"], e["method"]): e for e in tp["summary"]}
    assert set(summary) == {("tiny", "lora"), ("tiny", "full")}
    for e in summary.values():
        for row in ("ft_packed", "trl_packing"):
            assert e["rows"][row]["repeats"] == 3 and e["rows"][row]["tokens_per_s"][0] > 0
        med, spread = e["ratio"]
        assert 0.1 < med < 10 and 0 <= spread < 5
        tps = {r["repeat"]: r["tokens_per_s"] for r in tp["results"]
               if (r["model"], r["method"]) == (e["model"], e["method"]) and r["config"] == "ft_packed"}
        trl = {r["repeat"]: r["tokens_per_s"] for r in tp["results"]
               if (r["model"], r["method"]) == (e["model"], e["method"]) and r["config"] == "trl_packing"}
        ratios = sorted(tps[k] / trl[k] for k in tps)
        assert med == pytest.approx(ratios[1])
    assert tp["peak"] is None  # no MFU without a known peak

    # The profile: every variant timed; the two profiled ones say where their step went.
    variants = secs["profile"]["variants"]
    assert set(variants) == set(G.PROFILE_VARIANTS)
    for name, r in variants.items():
        assert "error" not in r and r["tokens_per_s"] > 0, (name, r)
    for name in ("ft_packed", "trl_packing"):
        prof = variants[name]["profile"]
        assert prof["total_self_cpu_ms"] > 0 and prof["top"] and sum(prof["groups_ms"].values()) > 0, prof
    assert "### Profile: the packed step taken apart" in (out / "gpu.md").read_text()

    # The section goes into RESULTS.md from the JSON alone.
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmarks\n")
    rec = subprocess.run([sys.executable, "bench/gpu.py", "--record", str(out / "gpu.json"), "--results",
                          str(results)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert rec.returncode == 0, rec.stderr[-3000:]
    text = results.read_text()
    assert "## GPU: cpu (bench/gpu.py)" in text and "--cpu-smoke" in text and "| tiny | lora |" in text


def check_long_section(sec: dict, out: Path) -> None:
    """The long section on CPU: checkpointing alone and with the tiled MLP ran, the same step-1 loss; the offload modes
    are recorded as needing CUDA, with finetune.config's refusal."""
    modes = {r["mode"]: r for r in sec["modes"]}
    assert list(modes) == list(G.LONG_MODES), modes
    for name in ("ckpt", "ckpt+tiled"):
        r = modes[name]
        assert "error" not in r and "skipped" not in r, (name, r)
        assert len(r["losses"]) == sec["steps"] and all(map(math.isfinite, r["losses"])), (name, r["losses"])
        assert len(r["step_seconds"]) == sec["steps"] and r["step_s"] > 0
        assert r["device"] > 0 and r["saved_planned"] > 0 and r["cuda"] is None  # planned for a GPU; nothing measured
    plain, tiled = modes["ckpt"], modes["ckpt+tiled"]
    assert "--tiled_mlp" in tiled["flags"] and "--tiled_mlp" not in plain["flags"]
    # the same weights and record: the tiled MLP changes memory, not the loss (bf16 weights)
    assert tiled["losses"][0] == pytest.approx(plain["losses"][0], rel=G.LONG_LOSS_RTOL)
    assert sec["loss_pass"] and sec["max_loss_rel_diff"] == tiled["loss_rel_diff"] <= G.LONG_LOSS_RTOL
    # the tiles were installed on the worker's model (its log): 512 positions, 8 tiles a layer
    (log,) = (out / "logs").glob("*-long-ckpt+tiled.log")
    assert "tiled MLP: 2 layers, tiles of 64 positions" in log.read_text()
    for name in ("ckpt+offload", "ckpt+tiled+offload"):
        r = modes[name]
        assert r["needs"] == "CUDA" and "offload_activations" in r["refused"] and "no CUDA" in r["refused"], r
    md = (out / "gpu.md").read_text()
    assert "### Long records" in md and "| ckpt+offload | needs CUDA" in md
    assert "CHECK long step-1 losses equal across modes: PASS" in (out / "stdout.txt").read_text()


# About 40 s on 2 cores (the tiny model, 2 training runs and 2 refusals in forked children): the long section's
# readiness for a GPU session, with FINETUNE_FULL_MATRIX=1, not in CI.
@pytest.mark.slow
@pytest.mark.full_matrix
def test_cpu_smoke_long_section(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--cpu-smoke", "--sections", "long", "--budget", "600",
                           "--write", str(out), "--work", str(work)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    (out / "stdout.txt").write_text(proc.stdout)
    data = json.loads((out / "gpu.json").read_text())
    assert set(data["sections"]) == {"long"}
    check_long_section(data["sections"]["long"], out)
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmarks\n")
    rec = subprocess.run([sys.executable, "bench/gpu.py", "--record", str(out / "gpu.json"), "--results",
                          str(results)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert rec.returncode == 0, rec.stderr[-3000:]
    text = results.read_text()
    assert "### Long records" in text and "| ckpt+tiled |" in text and "| ckpt+tiled+offload | needs CUDA" in text


def _fails_with_liger(no_liger: bool, x: int) -> dict:
    if not no_liger:
        raise RuntimeError("triton: a kernel did not compile")
    return {"x": x}


def test_a_child_that_fails_with_liger_runs_again_without_it(tmp_path, monkeypatch):
    import multiprocessing as mp

    monkeypatch.setattr(G, "CTX", mp.get_context("fork"))
    monkeypatch.setattr(G, "LOGS", tmp_path)
    ctx = {"no_liger": False, "liger_failed": {}, "info": {"liger": True}, "budget": G.Budget(10_000)}
    status, res, _ = G.run_guarded(ctx, "first", "ft_packed", _fails_with_liger, 1)
    assert status == "ok" and res["x"] == 1 and "did not compile" in res["liger_hidden"]
    assert "ft_packed" in ctx["liger_failed"]
    status, res, _ = G.run_guarded(ctx, "second", "ft_packed", _fails_with_liger, 2)  # hidden from the start now
    assert status == "ok" and res["x"] == 2 and "liger_hidden" in res
    status, res, _ = G.run_guarded(ctx, "other", "trl_packing", _fails_with_liger, 3)  # another kind still tries
    assert status == "ok" and res["x"] == 3 and len(list(tmp_path.glob("*other*.log"))) == 2
    ctx["info"]["liger"] = False  # Liger not in use: a failure is a failure
    status, res, _ = G.run_guarded(ctx, "plain", "bf16", _fails_with_liger, 4)
    assert status == "error" and "did not compile" in res


ROW = {"model": "1b", "method": "lora", "batch": 8, "ours_tokens_per_s": 30000.0, "trl_tokens_per_s": 20000.0,
       "ratio": 1.5, "mfu": 0.41, "mfu_measured_peak": 0.5, "peak_gib": 20.0, "planned_gib": 20.5,
       "ours": {"tokens_per_s": 30000.0, "peak_gib": 20.0, "reserved_gib": 22.0, "profile": {"launches": 900,
                                                                                               "syncs": 0}},
       "trl": {"tokens_per_s": 20000.0, "profile": {"launches": 2100, "syncs": 3}}}


def test_rows_make_the_issue_json_and_a_results_section(tmp_path):
    """bench/results/gpu.json has exactly the issue's keys; --record writes it beside RESULTS.md with the section."""
    data = {"mode": "gpu", "command": "bash bench/gpu_run.sh", "date": "2026-11-28 21:00 UTC", "wall": 400,
            "budget": 420, "peak": 989e12, "info": {"device": "NVIDIA H200", "versions": {}},
            "sections": {"rows": {"settings": {"seq": 2048, "batches": {"1b": 8, "8b": 4}, "warmup": 2, "timed": 15,
                                               "logging_steps": 20}, "matmul_peak": 780e12, "notes": [],
                                  "rows": [ROW, {"model": "8b", "method": "qlora", "error": "model not built"}]}},
            "notes": []}
    assert G.results_json(data) == {"gpu": "NVIDIA H200", "rows": [
        {k: ROW[k] for k in ("model", "method", "ours_tokens_per_s", "trl_tokens_per_s", "mfu", "peak_gib",
                             "planned_gib")},
        {"model": "8b", "method": "qlora", "ours_tokens_per_s": None, "trl_tokens_per_s": None, "mfu": None,
         "peak_gib": None, "planned_gib": None}]}
    run = tmp_path / "run.json"
    run.write_text(json.dumps(data))
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmarks\n")
    G.record(str(run), results)
    assert json.loads((tmp_path / "results" / "gpu.json").read_text()) == G.results_json(data)
    text = results.read_text()
    assert "| 1b | lora | 30,000 | 20,000 | 1.50 | 41.0% | 50.0% | 20.0 / 22.0 | 20.5 | 900 / 2100 | 0 / 3 |" in text
    assert "8b qlora error: model not built" in text
    assert "CHECK rows 1b lora: ours / TRL 1.50x (PASS against 1.2x); MFU 41.0%; peak 20.0 GiB, planned 20.5 GiB " \
           "(+2.5%)" in G.verdict_lines(data)


@pytest.mark.slow
def test_cpu_smoke_rows_run_both_sides_of_every_row(tmp_path):
    """The GPU run's default section end to end on CPU (tiny shapes, one thread; CPU wall time on a shared machine,
    so the numbers say only that every part ran): ours and TRL on full, LoRA and QLoRA, bench/results/gpu.json."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--cpu-smoke", "--sections", "rows", "--budget", "900",
                           "--write", str(out), "--work", str(work)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    table = json.loads((out / "results" / "gpu.json").read_text())
    assert table["gpu"] == "cpu" and [(r["model"], r["method"]) for r in table["rows"]] == [
        ("tiny", "full"), ("tiny", "lora"), ("tiny", "qlora")]
    for r in table["rows"]:
        assert r["ours_tokens_per_s"] > 0 and r["trl_tokens_per_s"] > 0 and r["planned_gib"] > 0, r
    rows = json.loads((out / "gpu.json").read_text())["sections"]["rows"]
    assert rows["matmul_peak"] > 0
    for r in rows["rows"]:
        for side in ("ours", "trl"):
            assert r[side]["steps"] == G.SETTINGS["cpu-smoke"]["timed_rows"] and r[side]["profile"] is not None
        assert r["ours"]["attention_packed"] and 0 < r["mfu_measured_peak"] < 1
