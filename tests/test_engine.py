"""The engine path (scripts/sft.py): the same job under DeepSpeed's own launcher, driving the engine directly.

The fast tests pin the pieces that make it the *same* job (data order, flag mapping); the slow ones
launch `deepspeed --num_gpus 2 scripts/sft.py` for real and compare its per-step losses and saved
weights with the Trainer path (`python finetune/train.py`, one process) on the parity settings of
tests/test_parity.py.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.config.preset import Preset
from finetune.models import tiny
from finetune.training import engine  # scripts/sft.py is its launcher file
from finetune.data.prepare import Collator
from finetune.training.lifecycle import staging_dir
from finetune.data.sampler import DistributedBatchOrder, rank_indices
from launch import BIN, REPO, eval_entries, free_port, losses, matrix, run, tiny_job, unexpected_warnings

ENGINE = REPO / "scripts" / "sft.py"
STEPS = 20


# ----------------------------------------------------------------------------------------------
# Fast: the data order and the flags.


def _dataset(n: int):
    import datasets

    # Row i holds token i + 1 (so a batch tells which rows it holds) and a label to train on.
    return datasets.Dataset.from_list([{"input_ids": [i + 1, 0], "labels": [-100, 0]} for i in range(n)])


@pytest.mark.parametrize("n", [72, 37])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_loader_order_is_distributed_samplers(n, drop_last, world):
    """Per rank and epoch, the engine path's loader yields exactly finetune.data.sampler.rank_indices
    (DistributedSampler's stream), cut into micro-batches, and that is what the Trainer's batch order deals to the
    same rank."""
    dataset = _dataset(n)
    args = SimpleNamespace(per_device_train_batch_size=3, data_seed=None, seed=1234, dataloader_drop_last=drop_last,
                           dataloader_num_workers=0, dataloader_pin_memory=True, dataloader_persistent_workers=False)
    trainer_order = DistributedBatchOrder(n, world, 3, shuffle=True, seed=1234, drop_last=drop_last)
    for rank in range(world):
        loader = engine.build_loader(dataset, Collator(0), args, world, rank)
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)
            expected = rank_indices(n, world, rank, True, 1234, drop_last, epoch)
            assert list(loader.sampler) == expected
            got = [int(i) - 1 for batch in loader for i in batch["input_ids"][:, 0]]
            assert got == expected
            trainer_order.set_epoch(epoch)
            dealt = [i for k, batch in enumerate(trainer_order) if k % world == rank for i in batch]
            assert dealt == expected
        assert len(loader) == -(-len(expected) // 3)
    if world > 1:  # the seed really shuffles, and epochs differ
        assert rank_indices(n, world, 0, True, 1234, drop_last, 0) != rank_indices(n, world, 0, True, 1234, drop_last, 1)


def test_data_seed_wins_over_seed():
    args = SimpleNamespace(per_device_train_batch_size=4, data_seed=7, seed=1234, dataloader_drop_last=False,
                           dataloader_num_workers=0, dataloader_pin_memory=False, dataloader_persistent_workers=False)
    loader = engine.build_loader(_dataset(20), Collator(0), args, 2, 1)
    assert list(loader.sampler) == rank_indices(20, 2, 1, True, 7, False, 0)


def test_flags_it_cannot_honour_are_refused():
    def cfg(**training):
        defaults = dict(resume_from_checkpoint=None, save_strategy="no", save_steps=500)
        return SimpleNamespace(training=SimpleNamespace(**{**defaults, **training}), sources={}, preset=Preset.named("ddp"))

    assert engine.unsupported(cfg()) == [] and engine.unsupported(cfg(save_strategy="steps")) == []
    assert engine.unsupported(cfg(resume_from_checkpoint="out/checkpoint-10")) == []  # resuming is supported now
    problems = engine.unsupported(cfg(save_strategy="epoch"))
    assert len(problems) == 1 and "'epoch'" in problems[0]


def test_save_interval():
    def cfg(sources=(), **training):
        return SimpleNamespace(training=SimpleNamespace(**{"save_strategy": "no", "save_steps": 500, **training}),
                               sources={k: "cli" for k in sources})

    assert engine.save_interval(cfg(), 20) == 0  # the project default: save_strategy no
    assert engine.save_interval(cfg(("save_steps",), save_steps=10), 20) == 10  # --save_steps alone turns it on
    assert engine.save_interval(cfg(("save_steps", "save_strategy"), save_steps=10), 20) == 0  # ... unless --save_strategy no
    assert engine.save_interval(cfg(save_strategy="steps", save_steps=0.25), 20) == 5  # a ratio of the run


def test_bad_config_exits_with_every_problem(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine.main(["--deepspeed", "zero4", "--dataset", str(tmp_path / "none.jsonl"), "--local_rank=0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown preset 'zero4'" in err and "model_name_or_path: required" in err and "none.jsonl" in err


# ----------------------------------------------------------------------------------------------
# Slow: real runs under the deepspeed launcher, compared with the Trainer.


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root, model, data = tiny_job(tmp_path_factory.mktemp("engine"), records=72, seed=7)
    tiny.write_jsonl(root / "eval.jsonl", tiny.synthetic_records(13, seed=99))  # uneven over 2 ranks
    return root, model, data


def common_flags(setup, out: Path) -> list[str]:
    root, model, data = setup
    return [
        "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
        "--dataset_cache_dir", str(root / "cache"), "--max_steps", str(STEPS), "--learning_rate", "2e-3",
        "--warmup_steps", "2", "--seed", "1234", "--max_seq_length", "128", "--disable_tqdm", "true",
        "--eval_dataset", str(root / "eval.jsonl"), "--eval_steps", "10", "--per_device_eval_batch_size", "3",
    ]


def launch(name: str, cmd: list[str], micro: int, world: int) -> tuple[Path, str]:
    out = Path(cmd[cmd.index("--output_dir") + 1])
    result = run(cmd, timeout=300).check()
    # Some launcher flags silently start one process: the run itself reports its world size.
    m = re.search(r"batch: (\d+) per device x (\d+) accumulation x (\d+) processes = global batch (\d+)", result.output)
    assert m, result.output[-3000:]
    assert tuple(map(int, m.groups())) == (micro, 1, world, 8), m.group(0)
    assert not unexpected_warnings(result.output), f"{name}: {unexpected_warnings(result.output)}"
    return out, result.output


@pytest.fixture(scope="module")
def trainer_run(setup):
    root = setup[0]
    cmd = [sys.executable, str(REPO / "finetune" / "train.py"), "--config", "ddp", "--per_device_train_batch_size", "8",
           *common_flags(setup, root / "trainer")]
    out, _ = launch("trainer", cmd, micro=8, world=1)
    return out


def engine_run(setup, name: str, *flags: str) -> tuple[Path, str]:
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(ENGINE), *flags,
           "--per_device_train_batch_size", "4", *common_flags(setup, setup[0] / name)]
    return launch(name, cmd, micro=4, world=2)


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_complete(out: Path, weights: str = "model.safetensors", marker: str = "config.json") -> None:
    names = {p.name for p in out.iterdir()}
    assert {weights, marker, "tokenizer.json", "trainer_state.json", "finetune_config.yaml"} <= names, names
    assert not staging_dir(out).exists() and not list(out.glob(".staging-final*"))
    assert not any(n.endswith((".bin", ".pkl")) for n in names), names  # final outputs are pickle-free


@pytest.mark.slow
# CI: ZeRO-3 with offload (the engine under ZeRO-2 and ZeRO-3 is also test_core's and test_resume's); both with
# FINETUNE_FULL_MATRIX=1.
@pytest.mark.parametrize("ds_json", matrix(["ds_configs/zero2.json", "ds_configs/zero3_offload.json"],
                                           ["ds_configs/zero3_offload.json"]))
def test_engine_matches_the_trainer(ds_json, setup, trainer_run):
    name = Path(ds_json).stem
    extra = ["--save_steps", "10"] if "zero3" in name else []
    out, text = engine_run(setup, name, "--deepspeed", ds_json, *extra)
    ref, got = losses(trainer_run), losses(out)
    assert len(ref) == len(got) == STEPS
    assert ref[-1] < ref[0] - 0.5, f"loss did not fall: {ref}"  # the run really trains
    for step, (a, b) in enumerate(zip(ref, got), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"{name} step {step}: engine {b} vs trainer {a}"
    # The learning rate each step used: the Trainer's schedule (linear, 2 warmup steps).
    lrs = [e["learning_rate"] for e in json.loads((out / "trainer_state.json").read_text())["log_history"]
           if "loss" in e]
    ref_lrs = [e["learning_rate"] for e in json.loads((trainer_run / "trainer_state.json").read_text())["log_history"]
               if "loss" in e]
    assert lrs == pytest.approx(ref_lrs, rel=1e-6)
    # Evaluation on the engine path: the whole eval set's token-normalized loss, as the Trainer's.
    ref_eval, got_eval = eval_entries(trainer_run), eval_entries(out)
    assert [e["step"] for e in got_eval] == [e["step"] for e in ref_eval] == [10, 20]
    assert all(e["eval_samples"] == 13 for e in got_eval)
    for a, b in zip(ref_eval, got_eval):
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-4 * a["eval_loss"], (a, b)
    w_ref, w_got = load_weights(trainer_run), load_weights(out)
    assert w_ref.keys() == w_got.keys()
    for key in w_ref:
        diff = (w_ref[key] - w_got[key]).abs().max().item()
        assert diff <= 1e-4, f"{name} {key}: max |diff| {diff}"
    assert_complete(out)
    if "zero3" in name:
        assert "weights: partitioned across ranks at load (ZeRO-3)" in text
        # --save_steps: a DeepSpeed checkpoint per interval (not at the last step: the final save covers it),
        # carrying the data position for a later resume.
        ckpt = out / "checkpoint-10"
        assert sorted(p.name for p in ckpt.iterdir() if "model_states" in p.name) == [
            "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
        assert not (out / "checkpoint-20").exists()
        state = torch.load(ckpt / "zero_pp_rank_0_mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        position = state["finetune"]
        assert (position["global_step"], position["epoch"], position["micro_batches_done_in_epoch"]) == (10, 1, 1)
        assert position["data"] == {"world_size": 2, "per_device_train_batch_size": 4, "seed": 1234, "drop_last": False}


@pytest.mark.slow
def test_engine_lora_adapter_reloads(setup):
    """LoRA under ZeRO-3 (partitioned base): the adapter is gathered, saved, and reloads with PeftModel."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, text = engine_run(setup, "lora", "--config", "zero3_no_offload", "--use_peft", "--lora_r", "8", "--lora_alpha", "16")
    assert "weights: partitioned across ranks at load (ZeRO-3)" in text
    got = losses(out)
    assert len(got) == STEPS and got[-1] < got[0] - 0.05, got
    assert_complete(out, weights="adapter_model.safetensors", marker="adapter_config.json")
    assert not (out / "model.safetensors").exists()  # only the adapter
    # The reloaded adapter is the trained one: it scores the training data better than the base model does.
    from transformers import AutoTokenizer

    from finetune.data.prepare import tokenize_record

    tokenizer = AutoTokenizer.from_pretrained(setup[1])
    records = tiny.synthetic_records(72, seed=7)[:16]
    batch = Collator(0)([dict(zip(("input_ids", "labels"), tokenize_record(tokenizer, r, "messages", True)))
                         for r in records])
    base = AutoModelForCausalLM.from_pretrained(setup[1], dtype=torch.float32)
    with torch.no_grad():
        base_loss = base(**batch).loss.item()
        model = PeftModel.from_pretrained(base, out)
        lora_b = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
        assert lora_b and all(v.abs().max() > 0 for v in lora_b.values())  # trained (LoRA B starts at zero)
        adapter_loss = model(**batch).loss.item()
    assert adapter_loss < base_loss - 0.05, (adapter_loss, base_loss)
