"""bench/throughput.py on CPU: the mixed data set, the profile grouping, the report, and one tiny grid in-process."""

from __future__ import annotations

import sys
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


@pytest.mark.slow
def test_tiny_grid_runs(tmp_path, one_thread):
    """Every configuration kind runs and reports (the CPU path of the script; the GPU preset is not run here)."""
    p = dict(T.PRESETS["tiny"], attn="sdpa")
    model_dir, data = T.build_assets(tmp_path, p)
    results = [T.run_config(name, "mixed", model_dir, data["mixed"], tmp_path, p, False)
               for name in ("ft_padded", "ft_packed", "trl_packing", "bare")]
    by = {r["config"]: r for r in results}
    for r in results:
        assert r["steps"] == p["timed"] and r["tokens_per_s"] > 0 and 0 < r["efficiency"] <= 1, r
    # ft_packed and bare train on the same packed batches.
    assert by["ft_packed"]["real_tokens"] == by["bare"]["real_tokens"]
    assert by["ft_packed"]["efficiency"] > by["ft_padded"]["efficiency"]
    assert by["ft_packed"]["packing_efficiency"] > 0.9
    assert set(by["ft_packed"]["profile"]["groups_ms"]) >= {"matmul", "optimizer"}
    info = dict(cpu="cpu", cores=2, torch="t", transformers="t", trl="t", python="3")
    report = T.render(results, p, info, {"device": "cpu", "peak": None}, 1, (0, 0, 0), (0, 0, 0), 1.0,
                      SimpleNamespace(), ["bench/throughput.py", "--preset", "tiny"])
    assert "| mixed | ft_packed |" in report and "### Profile" in report
