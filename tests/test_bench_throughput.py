"""bench/throughput.py on CPU: the mixed data set, the profile grouping, the report, and one tiny grid in-process."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import throughput as T  # noqa: E402


def test_mixed_set_spreads_over_20x(tiny_chatml):
    from finetune.data.prepare import tokenize_record
    from finetune.models.load import load_tokenizer

    tok = load_tokenizer(SimpleNamespace(model_name_or_path=str(tiny_chatml), trust_remote_code=False))
    records = T.mixed_records(300, 512, seed=0)
    assert records == T.mixed_records(300, 512, seed=0)  # deterministic
    lengths = [len(tokenize_record(tok, r, "messages", True)[0]) for r in records]
    assert max(lengths) <= 512 and max(lengths) / min(lengths) >= 20


def test_op_groups():
    assert T.op_group("aten::mm") == "matmul" and T.op_group("aten::addmm") == "matmul"
    assert T.op_group("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert T.op_group("aten::_fused_adamw_") == "optimizer" and T.op_group("aten::_foreach_norm") == "optimizer"
    assert T.op_group("aten::mul") == "other"


def test_results_section_replaces_only_throughput(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmarks\n\n## Memory planner\n\nkeep me\n")
    T.write_results("## Throughput\n\nfirst\n", path)
    T.write_results("## Throughput\n\nsecond\n", path)
    text = path.read_text()
    assert "keep me" in text and "second" in text and "first" not in text and text.count("## Throughput") == 1


def test_summary_ratios_spreads_and_headline():
    """Ratios are taken within a repeat (against TRL's rows with the same checkpointing), then summarized."""
    def row(config, rep, tps, flops=1e9):
        return {"model": "m", "method": "full", "dataset": "d", "config": config, "repeat": rep, "tokens_per_s": tps,
                "flops": flops, "real_tokens": 20000, "steps": 10, "efficiency": 1.0, "wall_tokens_per_s": tps,
                "peak_mb": 1.0}

    rows = [row("ft_packed", 0, 130), row("trl_default", 0, 80), row("trl_packing", 0, 100),
            row("ft_packed", 1, 150), row("trl_default", 1, 90), row("trl_packing", 1, 100),
            row("ft_packed+gc", 0, 100), row("trl_packing+gc", 0, 50), row("trl_default+gc", 0, 100)]
    table = T.summarize(rows, peak=2e9)[("m", "full", "d")]
    med, spread = table["ft_packed"]["ratios"]["best"]
    assert med == pytest.approx(1.4) and spread == pytest.approx(0.2 / 1.4)  # 1.3x and 1.5x of trl_packing
    assert table["ft_packed+gc"]["ratios"]["best"][0] == pytest.approx(1.0)  # against trl_default+gc, not nogc rows
    assert table["ft_packed"]["mfu"][0] == pytest.approx(0.5)
    assert "**unstable**" in T._fmt(table["ft_packed"]["ratios"]["best"], ".2f", ratio=True)
    assert "**unstable**" not in T._fmt((1.4, 0.04), ".2f", ratio=True)


def _row(method: str, config: str, rep: int, tps: float) -> dict:
    return {"model": "smollm2", "method": method, "dataset": "mixed", "config": config, "repeat": rep,
            "tokens_per_s": tps, "flops": tps * 1e6, "real_tokens": 20000, "steps": 10, "efficiency": 1.0,
            "wall_tokens_per_s": tps, "peak_mb": 1.0}


def _saved_json(path: Path, rows: list[dict], argv: list[str], peak: float, repeats: int) -> Path:
    """What an invocation's --json writes, SmolLM2 rows of 20,000 tokens on a 2-core CPU."""
    import json

    path.write_text(json.dumps({
        "rows": rows, "gemm": [{"peak": peak, "shapes": {}}],
        "run": {"argv": ["bench/throughput.py", *argv], "load_before": [1, 1, 1], "load_after": [2, 2, 2], "wall": 60.0},
        "info": dict(cpu="cpu", cores=2, torch="t", transformers="t", trl="t", python="3"),
        "dev": {"device": "cpu", "peak": None},
        "models": {"smollm2": [dict(T.PRESETS["smollm2"], attn="sdpa"), "SmolLM2"]},
        "min_tokens": 20000, "repeats": repeats, "gpu": False}))
    return path


def test_merge_renders_invocations_run_side_by_side(tmp_path):
    """Two --json files (LoRA on one core, full on the other): one report, each group's ratios against its own TRL
    rows, both commands with their loads, MFU against the best GEMM peak of either."""
    files = []
    for method, tps, peak in (("lora", 300, 4e10), ("full", 200, 5e10)):
        rows = [_row(method, "ft_packed", r, tps) for r in range(2)] + [_row(method, "trl_packing", r, tps / 2) for r in range(2)]
        files.append(_saved_json(tmp_path / f"{method}.json", rows, ["--methods", method], peak, repeats=2))
    report = T.merge([str(f) for f in files], SimpleNamespace())
    assert "2 invocations merged with `--merge`, run side by side on the cores" in report
    assert "--methods lora`" in report and "--methods full`" in report and report.count("load average") == 2
    assert "### smollm2, lora, mixed" in report and "### smollm2, full, mixed" in report
    assert report.count("ft_packed 2.00x TRL's best (trl_packing)") == 2
    assert "GEMM peak** (one thread, fp32 torch.mm, CPU time, best shape): 50.0 GFLOP/s" in report
    assert "| ft_packed | 300 ±0.0% | 2.00 ±0.0% |" in report and "| 0.6% ±0.0% |" in report  # 3e8 / 5e10


def test_merge_adds_the_repeats_of_a_pair(tmp_path):
    """Two invocations of the same group (--pair, one per core): six repeats, each ratio within its own repeat."""

    files = []
    for core, (ft, trl) in enumerate(((150, 100), (160, 100))):  # 1.5x on one core, 1.6x on the other
        rows = [_row("full", "ft_packed", r, ft) for r in range(3)] + [_row("full", "trl_packing_rows", r, trl) for r in range(3)]
        files.append(_saved_json(tmp_path / f"{core}.json", rows, ["--pair", "p"], 1e9, repeats=3))
    report = T.merge([str(f) for f in files], SimpleNamespace())
    assert "6 repeats" in report and "3 repeats" not in report and ">= 20,000 real tokens timed per row" in report
    assert "2 invocations merged with `--merge`, those given the same `--pair` folder in lockstep" in report
    # median of 1.5 x3 and 1.6 x3 is 1.55; spread 0.1 / 1.55 = 6.5%: had the repeats overwritten each other, 1.60
    assert "ft_packed 1.55x TRL's best (trl_packing_rows), spread 6.5% (UNSTABLE)" in report


def test_pair_barrier_runs_invocations_in_lockstep(tmp_path):
    """Each of two processes logs when it passes three barriers: no process passes barrier k+1 before the other
    has reached barrier k+1 (the slow one sleeps before each); a stale folder is refused."""
    import multiprocessing as mp

    log = tmp_path / "log"

    def run(delay):
        b = T.Barrier(str(tmp_path / "pair"), 2, timeout=30, poll=0.01)
        for k in range(3):
            time.sleep(delay)
            with open(log, "a") as f:
                f.write(f"reach {k} {os.getpid()} {time.monotonic()}\n")
            b.wait(f"row {k}")
            with open(log, "a") as f:
                f.write(f"pass {k} {os.getpid()} {time.monotonic()}\n")

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=run, args=(d,)) for d in (0.0, 0.3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    events = [line.split() for line in log.read_text().splitlines()]
    for k in range(3):
        last_reach = max(float(t) for e, kk, _, t in events if e == "reach" and int(kk) == k)
        first_pass = min(float(t) for e, kk, _, t in events if e == "pass" and int(kk) == k)
        assert first_pass >= last_reach  # nobody started row k before both had reached it
    assert sum(e == "pass" for e, *_ in events) == 6
    with pytest.raises(SystemExit, match="earlier run's files"):
        T.Barrier(str(tmp_path / "pair"), 2)


def test_steps_that_compiled_are_not_timed():
    """A step in which torch.compile compiled a graph is left out of the timing (and of the token count that ends a
    row); the count is dynamo's own, read in _now()."""
    import torch

    counting = T.Counting(None)
    counting.batches = [{"real": 100 + k} for k in range(6)]
    graphs = [0, 0, 1, 1, 2, 2, 2]  # step k runs from ends[k] to ends[k + 1]: steps 1 and 3 compiled
    ends = [(float(k), float(k), g) for k, g in enumerate(graphs)]
    assert counting.timed(ends, 1) == [2, 4, 5] and counting.timed_tokens(ends, 1) == 102 + 104 + 105
    before = T._now()[2]
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    f(torch.ones(3))
    f(torch.ones(3))
    assert T._now()[2] == before + 1


def test_headline_rows_run_next_to_each_other():
    configs = ["ft_padded", "ft_packed", "trl_default", "trl_packing", "trl_packing_rows", "bare"]
    assert T.row_order(configs, 0) == ["ft_packed", "trl_packing_rows", "ft_padded", "trl_default", "trl_packing", "bare"]
    assert T.row_order(configs, 1)[:2] == ["trl_packing_rows", "ft_packed"] and T.row_order(configs, 2) == T.row_order(configs, 0)
    assert T.row_order(["trl_default", "ft_packed"], 1) == ["ft_packed", "trl_default"]


def _job(name: str, steps: int, log: str, fail_at: int | None = None, pause: float = 0.0, turns=None) -> dict:
    """A stand-in row: `steps` steps of 100 real tokens, each logged in order."""
    start, batches = T._now()[0], []
    for k in range(steps):
        if k == fail_at:
            raise ValueError("a broken row")
        time.sleep(pause)
        with open(log, "a") as f:
            f.write(f"{name}{k} ")
        batches.append({"real": 100})
        turns.step_end(SimpleNamespace(batches=batches), k + 1)
    return {"name": name, "turns": turns.count, "wall": T._now()[0] - start}


def test_interleaved_rows_take_turns(tmp_path):
    """--interleave: the rows run in turns of `tokens` real tokens, in order, until each ends; one that fails is
    reported and the others go on."""
    log = str(tmp_path / "log")
    out = T.ring([("a", _job, ("a", 4, log)), ("b", _job, ("b", 2, log)), ("c", _job, ("c", 3, log, 1))], 200,
                 timeout=60)
    assert Path(log).read_text().split() == ["a0", "a1", "b0", "b1", "c0", "a2", "a3"]
    assert out["a"] == ("ok", {"name": "a", "turns": 3, "wall": pytest.approx(out["a"][1]["wall"])})
    assert out["b"][0] == "ok" and out["b"][1]["turns"] == 2
    assert out["c"][0] == "error" and "ValueError: a broken row" in out["c"][1]


def test_the_wait_for_a_turn_is_not_timed(tmp_path):
    """Two rows of 3 x 0.2 s steps, a turn each step: each waits ~0.6 s for the other, which its wall time leaves
    out (CPU time has no waits to leave out)."""
    log = str(tmp_path / "log")
    start = time.perf_counter()
    out = T.ring([(n, _job, (n, 3, log, None, 0.2)) for n in "ab"], 100, timeout=60)
    assert time.perf_counter() - start > 1.2
    for name in "ab":
        assert out[name][0] == "ok" and out[name][1]["turns"] == 4
        assert 0.55 < out[name][1]["wall"] < 0.9, out


def test_model_flops_count_the_job():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config)
    body = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    assert T.model_flops(model, 10, 4, 50) == 6 * body * 10 + 6 * 1600 * 4 + 6 * 2 * 16 * 50
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    adapter = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)
    assert T.model_flops(lora, 10, 4, 50, lora=True) == (4 * body * 10 + 4 * 1600 * 4 + 6 * adapter * 10
                                                         + 6 * 2 * 16 * 50)


@pytest.mark.slow
@pytest.mark.full_matrix  # a bench script's end-to-end run (50 s): with FINETUNE_FULL_MATRIX=1, not in CI
def test_tiny_grid_runs(tmp_path, one_thread):
    """Every kind of row runs, times at least min_tokens, and reports (the CPU path; the GPU preset is not run)."""
    p = dict(T.PRESETS["tiny"], attn="sdpa", name="tiny")
    model_dir, data = T.build_assets(tmp_path, p)
    results = [T.run_config(name, "mixed", model_dir, data["mixed"], tmp_path, p, False, "full", 600, name == "ft_packed")
               for name in ("ft_padded", "ft_packed", "trl_packing", "trl_packing_rows", "bare", "ft_packed+gc")]
    by = {r["config"]: r for r in results}
    for r in results:
        assert r["real_tokens"] >= 600 and r["tokens_per_s"] > 0 and 0 < r["efficiency"] <= 1, r
        assert r["trained_tokens"] > 0.9 * r["real_tokens"] - 2 * r["steps"] * p["batch"], r  # every token trains
    # ft_packed and bare train on the same packed batches, and stop at the same step.
    assert by["ft_packed"]["real_tokens"] == by["bare"]["real_tokens"]
    assert by["ft_packed"]["efficiency"] > by["ft_padded"]["efficiency"]
    assert by["ft_packed"]["packing_efficiency"] > 0.9
    assert by["trl_packing"]["trl_layout"] == "one flattened row" and by["trl_packing_rows"]["trl_layout"] == "rows"
    assert by["trl_packing"]["real_tokens"] == by["trl_packing_rows"]["real_tokens"]  # the same packed sequences
    assert by["trl_packing_rows"]["efficiency"] < 1 == by["trl_packing"]["efficiency"]
    assert by["ft_packed+gc"]["gradient_checkpointing"] and not by["ft_packed"]["gradient_checkpointing"]
    assert set(by["ft_packed"]["profile"]["groups_ms"]) >= {"matmul", "optimizer"}
    # Interleaved (--interleave), the same rows do the same work, in turns.
    ring = T.ring([(n, T.run_config, (n, "mixed", model_dir, data["mixed"], tmp_path, p, False, "full", 600))
                   for n in ("ft_packed", "bare")], 150, timeout=600)
    for name in ("ft_packed", "bare"):
        status, r = ring[name]
        assert status == "ok" and r["turns"] >= 4, ring
        assert (r["real_tokens"], r["steps"]) == (by[name]["real_tokens"], by[name]["steps"])
    info = dict(cpu="cpu", cores=2, torch="t", transformers="t", trl="t", python="3")
    rows = [{**r, "model": "tiny", "repeat": 0} for r in results]
    gemm = {"peak": 1e10, "shapes": {}}
    report = T.render(rows, {"tiny": (p, model_dir, data, "tiny model")}, info, {"device": "cpu", "peak": None},
                      gemm, [gemm], [{"argv": ["bench/throughput.py", "--models", "tiny"], "load_before": (0, 0, 0),
                                      "load_after": (0, 0, 0), "wall": 1.0}],
                      SimpleNamespace(gpu=False, min_tokens=600, repeats=1))
    assert "| ft_packed |" in report and "### Profile" in report and "**Headline**" in report
    assert "ft_packed" in report.split("**Headline**")[1].split("###")[0]
