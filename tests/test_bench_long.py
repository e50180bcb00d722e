"""bench/plan_long.py and bench/longest.py without their runs: the Llama-3.1-8B config counted on the meta device,
the plan's cells, the bisection's planner bound, and its sequence-parallel probe's command and plan."""

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


def test_sequence_parallel_probe(tmp_path):
    """The SP probe: its command is `deepspeed --num_gpus 2` on the memory worker with flags the project's parser
    reads as 2-way sequence parallelism at the probe's length and mode; its per-rank figure is `finetune plan
    --sequence_parallel_size 2`'s for those flags; and the split lengthens the planner's longest record."""
    from finetune import config as C
    from finetune.plan import planner

    L = _load("longest")
    bench = L._memory()
    model = bench.build_model(tmp_path / "model", vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    cmd = L.sp_command(model, tmp_path / "d.jsonl", tmp_path / "o", "tiled", 4096, 2, 1234)
    assert cmd[1:5] == ["--num_gpus", "2", "--master_port", "1234"] and cmd[5].endswith("tests/sp_memory_worker.py")
    assert cmd[6:8] == [str(tmp_path / "o" / "hwm"), "--"]
    cfg = C.parse(cmd[8:], check_paths=False)
    assert (cfg.launch.sequence_parallel_size, cfg.data.max_seq_length, cfg.model.tiled_mlp) == (2, 4096, True)
    assert cfg.preset.name == "ddp" and cfg.training.per_device_train_batch_size == 1
    plan = planner.make_plan(["--model_name_or_path", str(model), "--max_seq_length", "4096",
                              "--per_device_train_batch_size", "1", "--config", "ddp", "--devices_per_node", "2",
                              "--accelerator", "cpu", "--host_memory", "24GiB", "--sequence_parallel_size", "2",
                              "--tiled_mlp", "true"])
    assert L.predicted(bench, model, "tiled", 4096, sp=2) == plan["per_device_total"]
    budget = 700 * 2**20
    for mode in ("plain", "tiled"):
        assert L.planned_longest(bench, model, mode, budget, 256, sp=2) > L.planned_longest(bench, model, mode, budget, 256)
