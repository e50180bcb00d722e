"""bench/plan_long.py and bench/longest.py without their runs: the Llama-3.1-8B config counted on the meta device,
the plan's cells, and the bisection's planner bound."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"finetune_bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_llama_31_8b_plan_cells(tmp_path):
    """The config's meta-device model has the published 8,030,261,248 parameters, as the planner counts; at 128k
    tokens with checkpointing, the tiled MLP and offload, the plan recommends FSDP2 on 8 cards of 80 GB."""
    from finetune.plan import planner as plan

    P = _load("plan_long")
    model = P.build(tmp_path / "llama")
    assert plan.model_shape(plan.read_config(model)).num_params == P.PUBLISHED_PARAMETERS
    data = plan.make_plan(P.argv_for(model, 131072, 8, P.OPTIONS["+ tiled MLP + offload"]))
    assert data["recommendation"]["config"] == "fsdp2" and data["recommendation"]["gradient_checkpointing"]
    assert data["per_host"]["offloaded activations"] == 8 * 2 * 131072 * 4096 * 32  # 8 ranks' bf16 layer inputs
    plain = plan.make_plan(P.argv_for(model, 131072, 8, P.OPTIONS["checkpointing"]))
    assert plain["recommendation"]["config"] is None  # nothing fits with checkpointing alone


def test_longest_starts_at_the_planners_bound(tmp_path):
    L = _load("longest")
    bench = L._memory()
    model = bench.build_model(tmp_path / "model", vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    budget = 700 * 2**20
    for mode in L.MODES:
        n = L.planned_longest(bench, model, mode, budget, 256)
        assert n and L.predicted(bench, model, mode, n) <= budget < L.predicted(bench, model, mode, n + 256)
    assert L.planned_longest(bench, model, "tiled", budget, 256) > L.planned_longest(bench, model, "plain", budget, 256)
