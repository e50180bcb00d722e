"""finetune/training/core.py: the prepare() loop and the DeepSpeed engine path do what the Trainer does.

Fast: the optimizer's parameter groups (names in each group, weight decay, class) are the Trainer's, with and
without a DeepSpeed "optimizer" section; an --optim they cannot build is refused by name; the logging window
averages and carries over a resume.

Slow: NON-default flags (weight decay, cosine_with_min_lr with warmup and a min_lr_rate that changes the curve,
clipping at 0.5, beta2 0.95, accumulation 2, gradient checkpointing, logging every 2 steps) on all three paths,
2 processes, ZeRO-2 and ZeRO-3 with CPU offload (DeepSpeedCPUAdam): every log_history entry (loss, grad_norm,
learning_rate, epoch, step) equals the one-process Trainer's on the same preset within 1e-4 relative.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune import config as C
from finetune.models import tiny
from finetune.training import core
from launch import ENGINE, LOOP, REPO, TRAIN, deepspeed_launcher, launcher, matrix, run, tiny_job, unexpected_warnings

# ----------------------------------------------------------------------------------------------
# Fast.


@pytest.fixture
def parsed(tmp_path, tiny_chatml):
    data = tiny.write_jsonl(tmp_path / "d.jsonl", tiny.synthetic_records(4))

    def parse(*flags: str):
        return C.parse(["--model_name_or_path", str(tiny_chatml), "--dataset", str(data),
                        "--output_dir", str(tmp_path / "o"), *flags])

    return parse


def _names(model, params) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return sorted(by_id[id(p)] for p in params)


@pytest.mark.parametrize("optim", core.SUPPORTED_OPTIMIZERS)
def test_parameter_groups_are_the_trainers(optim, parsed, tiny_chatml, one_thread):
    import transformers

    args = parsed("--weight_decay", "0.1", "--optim", optim, "--adam_beta2", "0.95").training
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_chatml)
    reference = transformers.Trainer(model=model, args=args).create_optimizer()
    ours = core.build_optimizer(args, model, {})  # what loop.py and engine.py hand to prepare() / initialize()
    assert type(ours) is type(reference)
    assert len(ours.param_groups) == len(reference.param_groups) == 2
    for got, want in zip(ours.param_groups, reference.param_groups):
        assert _names(model, got["params"]) == _names(model, want["params"])
        assert {k: v for k, v in got.items() if k != "params"} == {k: v for k, v in want.items() if k != "params"}
    decay, no_decay = (_names(model, g["params"]) for g in ours.param_groups)
    assert ours.param_groups[0]["weight_decay"] == 0.1 and ours.param_groups[1]["weight_decay"] == 0.0
    assert "model.norm.weight" in no_decay and "model.layers.0.input_layernorm.weight" in no_decay
    assert "model.layers.0.self_attn.q_proj.weight" in decay and not any("norm" in n for n in decay)


def test_deepspeed_optimizer_gets_what_the_trainer_hands_it(parsed, tiny_chatml):
    """A DeepSpeed JSON with its own "optimizer" (zero3: DeepSpeedCPUAdam): the Trainer hands DeepSpeed every trainable
    parameter in one group (deepspeed_optim_sched), so decay then covers norms too; loop and engine do the same."""
    import transformers
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, deepspeed_optim_sched

    args = parsed("--weight_decay", "0.1").training
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_chatml)
    ds = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    hf_ds = HfTrainerDeepSpeedConfig(ds)
    trainer_optimizer, _ = deepspeed_optim_sched(None, hf_ds, args, 10, core.trainable_parameters(model))
    assert core.build_optimizer(args, model, hf_ds.config) is None  # DeepSpeed builds it ...
    assert _names(model, core.trainable_parameters(model)) == _names(model, trainer_optimizer.params)  # ... over these


@pytest.mark.parametrize("module, script", [("loop", "finetune/loop.py"), ("engine", "scripts/sft.py")])
def test_unsupported_optim_is_refused_by_name(module, script, tmp_path, tiny_chatml, capsys):
    import importlib

    data = tiny.write_jsonl(tmp_path / "d.jsonl", tiny.synthetic_records(4))
    main = importlib.import_module(f"finetune.training.{module}").main
    with pytest.raises(SystemExit) as e:
        main(["--model_name_or_path", str(tiny_chatml), "--dataset", str(data), "--output_dir", str(tmp_path / "o"),
              "--optim", "adamw_bnb_8bit", "--save_total_limit", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"optim: {script} supports --optim adamw_torch, adamw_torch_fused, sgd, adafactor, not 'adamw_bnb_8bit'" in err
    assert f"save_total_limit: not supported by {script}" in err
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_flags_a_path_cannot_honour_are_listed():
    def problems(sources=(), ds=None, **training):
        cfg = SimpleNamespace(training=SimpleNamespace(**training), sources={k: "cli" for k in sources},
                              preset=C.Preset.named(str(REPO / "ds_configs" / ds) if ds else "ddp"))
        return core.refused_flags(cfg, "x.py")

    assert problems() == [] and problems(optim="sgd", save_strategy="steps", ds="zero2.json") == []
    assert "optim: the DeepSpeed config" in problems(("optim",), ds="zero3_offload.json", optim="sgd")[0]
    assert problems(ds="zero3_offload.json") == []  # --optim not given: the JSON's optimizer, as in the Trainer
    for flag, value in [("save_strategy", "epoch"), ("logging_strategy", "epoch"), ("do_predict", True),
                        ("lr_scheduler_type", "reduce_lr_on_plateau"), ("torch_compile", True),
                        ("neftune_noise_alpha", 5.0), ("label_smoothing_factor", 0.1), ("ignore_data_skip", True),
                        ("eval_on_start", True), ("eval_delay", 2)]:
        [problem] = problems(**{flag: value})
        assert flag in problem.split(":")[0], problem  # named
    # The loop compiles (prepare() with the Trainer's dynamo settings); the DeepSpeed engine script does not.
    cfg = SimpleNamespace(training=SimpleNamespace(torch_compile=True), sources={}, preset=C.Preset("ddp"))
    assert core.refused_flags(cfg, "finetune/loop.py") == [] and core.refused_flags(cfg, "scripts/sft.py")
    # Evaluation, the best model and early stopping are the paths' own now (finetune.training.evaluate).
    assert problems(eval_strategy="steps", do_eval=True, load_best_model_at_end=True, save_strategy="steps") == []


def test_gradient_checkpointing_is_turned_on(parsed, tiny_chatml):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_chatml)
    core.enable_gradient_checkpointing(model, parsed().training)
    assert not model.is_gradient_checkpointing
    core.enable_gradient_checkpointing(model, parsed("--gradient_checkpointing", "true").training)
    assert model.is_gradient_checkpointing


def test_logging_window_and_resume():
    args = SimpleNamespace(logging_steps=3, logging_strategy="steps", logging_first_step=False)
    losses = [5.0, 4.0, 3.0, 2.5, 2.0, 1.0, 0.5]

    def run(log, steps):
        for step in steps:
            log.add(step, losses[step - 1], step / 10, step / 10, step / 4)
        return log

    whole = run(core.LogWindow.for_run(args, 7), range(1, 8))
    assert [e["step"] for e in whole.history] == [3, 6]  # the partial window (step 7) is not logged
    assert whole.history[0] == {"loss": 4.0, "grad_norm": 0.3, "learning_rate": 0.3, "epoch": 0.75, "step": 3}
    assert whole.history[1]["loss"] == pytest.approx((2.5 + 2.0 + 1.0) / 3)
    # Saved after step 4 (window open) and resumed: the same history.
    saved = json.loads(json.dumps(run(core.LogWindow.for_run(args, 7), range(1, 5)).state()))
    resumed = run(core.LogWindow.for_run(args, 7, saved), range(5, 8))
    assert resumed.history == whole.history
    whole.finish(7, 1.75, 8)
    assert whole.history[-1]["train_loss"] == pytest.approx(sum(losses) / 7) and whole.history[-1]["step"] == 7
    ratio = core.LogWindow.for_run(SimpleNamespace(logging_steps=0.25, logging_strategy="steps", logging_first_step=False), 10)
    assert ratio.every == 3  # a ratio of the run, rounded up, as the Trainer


# ----------------------------------------------------------------------------------------------
# Slow: non-default flags on all three paths, 2 processes, against the one-process Trainer.

STEPS, LR, WARMUP, MIN_LR_RATE = 12, 2e-3, 2, 0.3
FLAGS = ["--max_steps", str(STEPS), "--learning_rate", str(LR), "--warmup_steps", str(WARMUP), "--seed", "1234",
         "--max_seq_length", "128", "--disable_tqdm", "true", "--weight_decay", "0.1",
         "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", json.dumps({"min_lr_rate": MIN_LR_RATE}),
         "--max_grad_norm", "0.5", "--adam_beta2", "0.95", "--gradient_accumulation_steps", "2",
         "--gradient_checkpointing", "true", "--logging_steps", "2", "--eval_steps", "6", "--per_device_eval_batch_size", "2"]
PRESETS = ["zero2", "zero3"]  # zero3: CPU offload, the JSON's own optimizer (DeepSpeedCPUAdam)
PATHS = {
    "trainer": lambda: launcher("accelerate", 2, script=TRAIN),
    "loop": lambda: launcher("accelerate", 2, script=LOOP),
    "engine": lambda: deepspeed_launcher(2, script=ENGINE),
}
KEYS = ("loss", "grad_norm", "learning_rate", "epoch", "step")
EVAL_KEYS = ("eval_loss", "eval_perplexity")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root, model, data = tiny_job(tmp_path_factory.mktemp("core"), records=72, seed=7)
    tiny.write_jsonl(root / "eval.jsonl", tiny.synthetic_records(7, seed=99))  # uneven over 2 ranks
    return root, model, data


_runs: dict[str, list[dict]] = {}


def history(job, name: str, cmd: list[str], micro: int) -> list[dict]:
    if name not in _runs:
        root, model, data = job
        out = root / name
        result = run(cmd + ["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
                            "--dataset_cache_dir", str(root / "cache"), "--per_device_train_batch_size", str(micro),
                            "--eval_dataset", str(root / "eval.jsonl"), *FLAGS], timeout=600).check()
        # Gradient checkpointing, DDP and DeepSpeed, on every path: no warning line but those allowed by name.
        assert not unexpected_warnings(result.output), f"{name}: {unexpected_warnings(result.output)}"
        _runs[name] = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return _runs[name]


def reference(job, preset: str) -> list[dict]:
    """The one-process Trainer on the same preset (global batch 4 x 2 accumulation = 8, as 2 x 2 x 2 processes)."""
    return history(job, f"reference-{preset}", [sys.executable, TRAIN, "--config", preset], micro=4)


def expected_learning_rates() -> list[float]:
    """The schedule the flags ask for, at the logged steps: the lr each logged step used."""
    import torch
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = get_scheduler("cosine_with_min_lr", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS,
                          scheduler_specific_kwargs={"min_lr_rate": MIN_LR_RATE})
    lrs = []
    for _ in range(STEPS):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs[1::2]


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


@pytest.mark.slow
# CI's cover: each path once, each preset at least once (ZeRO-3 with the JSON's CPU Adam on the Trainer and the
# engine); every path x preset with FINETUNE_FULL_MATRIX=1.
@pytest.mark.parametrize("path, preset", matrix([(p, c) for c in PRESETS for p in PATHS],
                                                [("trainer", "zero3"), ("loop", "zero2"), ("engine", "zero3")]))
def test_non_default_flags_match_the_one_process_trainer(path, preset, job):
    # The one-process reference (made once per preset) and the 2-process run are independent: side by side.
    with ThreadPoolExecutor(2) as pool:
        ref = pool.submit(reference, job, preset)
        got = pool.submit(history, job, f"{path}-{preset}", PATHS[path]() + ["--config", preset], micro=2)
        ref, got = ref.result(), got.result()
    ref_logs, got_logs = [e for e in ref if "loss" in e], [e for e in got if "loss" in e]
    # One entry per window of 2 steps; the schedule is the one asked for (min_lr_rate lifts its tail well above
    # plain cosine's) and the run trains.
    assert [e["step"] for e in ref_logs] == list(range(2, STEPS + 1, 2))
    assert [e["learning_rate"] for e in ref_logs] == pytest.approx(expected_learning_rates(), rel=1e-9)
    assert ref_logs[-1]["learning_rate"] > LR * MIN_LR_RATE
    assert ref_logs[-1]["loss"] < ref_logs[0]["loss"] - 0.5
    assert len(got_logs) == len(ref_logs)
    diffs = {k: max(relative(r[k], g[k]) for r, g in zip(ref_logs, got_logs)) for k in KEYS}
    ref_end, got_end = ref[-1], got[-1]
    assert "train_loss" in got_end and (got_end["step"], got_end["epoch"]) == (ref_end["step"], ref_end["epoch"])
    diffs["train_loss"] = relative(ref_end["train_loss"], got_end["train_loss"])
    # Evaluation (7 records, batches of 2, uneven over 2 ranks) after steps 6 and 12, on every path and preset.
    ref_evals, got_evals = [e for e in ref if "eval_loss" in e], [e for e in got if "eval_loss" in e]
    assert [e["step"] for e in got_evals] == [e["step"] for e in ref_evals] == [6, 12]
    assert all(e["eval_samples"] == 7 for e in ref_evals + got_evals)
    diffs.update({k: max(relative(r[k], g[k]) for r, g in zip(ref_evals, got_evals)) for k in EVAL_KEYS})
    _write_table(path, preset, diffs)
    assert all(d <= 1e-4 for d in diffs.values()), f"{path} {preset}: {diffs}\n{ref_logs}\n{got_logs}"


_table: dict[str, dict] = {}


def _write_table(path: str, preset: str, diffs: dict) -> None:
    _table[f"{path} {preset}"] = diffs
    target = os.environ.get("FINETUNE_CORE_TABLE")
    if target:
        cols = [*KEYS, "train_loss", *EVAL_KEYS]
        lines = ["| path x preset | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        lines += [f"| {k} | " + " | ".join(f"{v[c]:.1e}" for c in cols) + " |" for k, v in _table.items()]
        Path(target).write_text("\n".join(lines) + "\n")


def test_logging_window_read_only_when_it_logs_over_two_ranks():
    """The window sums this rank's step losses on the device and reduces them only when a step logs (or the state is
    saved): rank 0's window, read through a reduce that adds rank 1's share (all_sum over two ranks), logs the mean
    of the per-step global losses; a window saved open resumes with its global sum on rank 0 alone."""
    import torch

    args = SimpleNamespace(logging_steps=3, logging_strategy="steps", logging_first_step=False)
    shares = [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], [0.5, 0.25, 1.5, 2.0, 0.75, 1.0, 3.0]]
    sums = [a + b for a, b in zip(*shares)]

    def pair(state=None):
        w = [core.LogWindow.for_run(args, 7, state, main=rank == 0) for rank in (0, 1)]
        w[1].enabled = False  # rank 1 logs the same entries; here its window is emptied when rank 0 logs
        w[0].reduce = lambda t: t + torch.as_tensor(w[1].loss, dtype=t.dtype)
        return w

    def run(w, steps, state_after=None):
        saved = None
        for step in steps:
            w[1].add(step, torch.tensor(shares[1][step - 1]), 0.1, None, 0.0)
            if w[0].add(step, torch.tensor(shares[0][step - 1]), 0.1, None, 0.0) is not None:
                w[1].loss = 0.0
            if step == state_after:
                saved = json.loads(json.dumps(w[0].state()))
        return saved

    whole = pair()
    run(whole, range(1, 8))
    assert [e["loss"] for e in whole[0].history] == pytest.approx([sum(sums[0:3]) / 3, sum(sums[3:6]) / 3])
    first = pair()
    saved = run(first, range(1, 6), state_after=5)  # the window of steps 4-5 is open
    assert saved["window"] == [pytest.approx(sums[3] + sums[4]), 2]
    resumed = pair(saved)
    assert resumed[0].loss == pytest.approx(sums[3] + sums[4]) and resumed[1].loss == 0.0
    run(resumed, range(6, 8))
    assert resumed[0].history[-1] == pytest.approx(whole[0].history[-1])
