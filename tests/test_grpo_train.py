"""`finetune train --method grpo|rloo`: the Trainer path and the loop agree step for step, a resumed run repeats the
uninterrupted one (the sampling seeds included), evaluation writes its completions, 2 processes equal 1."""

from __future__ import annotations

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from finetune.models import tiny
from tests.launch import matrix

ORDERS = Path(__file__).resolve().parents[1] / "finetune" / "apps" / "quickstart_data" / "train.jsonl"
KEYS = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "rewards/json_valid/mean",
        "rewards/length_penalty/mean", "rewards/regex/mean", "frac_reward_zero_std", "step")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    model = tiny.build(root / "model", style="chatml")
    data = root / "orders.jsonl"
    data.write_text("".join(ORDERS.read_text().splitlines(keepends=True)[:8]))
    return root, model, data


def common(model, data, out) -> list[str]:
    return ["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
            # A random tiny model: no JSON and no EOS yet, but digits in about half of its completions.
            "--reward_funcs", "json_valid", "length_penalty", "regex:[0-9]", "--reward_weights", "1", "0.5", "2",
            "--num_generations", "4", "--max_completion_length", "6", "--lr_scheduler_type", "constant",
            "--seed", "3", "--logging_steps", "1"]


def train(job, name: str, *flags: str, path: str = "trainer", method: str = "grpo", entries: str = "loss"):
    from finetune.training import loop, trainer

    main = {"trainer": trainer.main, "loop": loop.main}[path]
    root, model, data = job
    out = root / name
    main(["--method", method, *common(model, data, out), "--per_device_train_batch_size", "2",
          "--gradient_accumulation_steps", "2", "--optim", "sgd", "--learning_rate", "0.5", "--max_grad_norm", "0",
          *([] if "--max_steps" in flags else ["--max_steps", "3"]), *flags])
    return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if entries in e]


def same(got: list[dict], want: list[dict], keys=KEYS, bound: float = 1e-6) -> tuple[float, str]:
    """(the largest difference, its key): every key of every step within `bound` (relative above 1)."""
    assert [e["step"] for e in got] == [e["step"] for e in want]
    worst = (0.0, "")
    for g, w in zip(got, want):
        for k in keys:
            assert abs(g[k] - w[k]) <= bound * max(1.0, abs(w[k])), (k, got, want)
            worst = max(worst, (abs(g[k] - w[k]), k))
    return worst


@pytest.mark.parametrize("method, flags", [("grpo", ("--loss_type", "grpo")), ("grpo", ("--loss_type", "dapo")),
                                           ("rloo", ()), ("grpo", ("--loss_type", "grpo", "--num_iterations", "2"))])
def test_loop_logs_what_the_trainer_logs(job, isolated, one_thread, method, flags):
    name = f"{method}-{'-'.join(flags)}"
    want = train(job, f"trainer-{name}", *flags, method=method)
    got = train(job, f"loop-{name}", *flags, method=method, path="loop")
    # (grpo's loss is 0 at a ratio of 1: the advantages of a group sum to 0; its gradient is not.)
    assert len(want) == 3 and any(e["grad_norm"] > 0 for e in want)
    # Completions of the step are whole groups of 4 up to 6 tokens; the rewards are the two functions' weighted sum.
    for e in want:
        assert 0 < e["completions/mean_length"] <= 6
        assert e["reward"] == pytest.approx(e["rewards/json_valid/mean"] + 0.5 * e["rewards/length_penalty/mean"]
                                            + 2 * e["rewards/regex/mean"], abs=1e-9)
    print(f"\n{method} {flags}: trainer vs loop max diff {same(got, want)}")
    if "--num_iterations" in flags:
        # Step 2 trains on step 1's completions (the same prompts: the same rewards) against p_old, the model that
        # generated them: the ratios moved from 1, so grpo's loss is no longer 0 (at step 1 it is: ratio 1, and a
        # group's advantages sum to 0). Step 3 generates again.
        a, b, c = want
        assert all(a[k] == b[k] for k in KEYS if k not in ("loss", "grad_norm", "step"))
        assert abs(a["loss"]) < 1e-6 and abs(b["loss"]) > 1e-4 and b["clip_ratio/region_mean"] > 0
        assert a["clip_ratio/region_mean"] == 0 and c["reward"] != a["reward"]
        print(f"num_iterations 2: losses {[round(e['loss'], 6) for e in want]}, clip ratios "
              f"{[round(e['clip_ratio/region_mean'], 4) for e in want]}, rewards {[round(e['reward'], 4) for e in want]}")


@pytest.mark.parametrize("more", [(), ("--num_iterations", "2")])
def test_resume_repeats_the_run(job, isolated, one_thread, more):
    """The step-2 checkpoint resumed in a new folder: steps 3 and 4 sample the same completions (the seeds are the
    step's, not a generator's state) and log the same numbers; with --num_iterations 2, step 3 generates and step 4
    reuses its completions, as in the uninterrupted run."""
    root = job[0]
    flags = ("--max_steps", "4", "--save_steps", "2", "--use_peft", "--lora_r", "4", "--beta", "0.1", *more)
    name = "resume" + "-".join(more)
    whole = train(job, name, *flags)
    shutil.copytree(root / name / "checkpoint-2", root / f"{name}-again" / "checkpoint-2")
    again = train(job, f"{name}-again", *flags, "--resume_from_checkpoint", "latest")
    print(f"\nresume: max diff {same(again, whole, KEYS + ('kl',))}")
    assert any(e["kl"] > 0 for e in whole[1:])  # the reference (adapters off) and the policy part


def test_evaluation_writes_completions(job, isolated, one_thread):
    evals = train(job, "eval", "--eval_split_size", "2", "--eval_steps", "2", "--max_steps", "2",
                  entries="eval_reward")
    root = job[0]
    assert [e["step"] for e in evals] == [2]
    rows = [json.loads(line) for line in (root / "eval" / "completions" / "step-2.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and evals[0]["eval_samples"] == 2 and evals[0]["eval_loss"] == -evals[0]["eval_reward"]
    mean = sum(r["reward"] for r in rows) / 2
    assert evals[0]["eval_reward"] == pytest.approx(mean, abs=1e-9)
    assert set(rows[0]["rewards"]) == {"json_valid", "length_penalty", "regex"} and "Extract the order" in rows[0]["prompt"]


@pytest.mark.parametrize("flags, problem", [
    (["--method", "grpo"], "reward_funcs: --method grpo needs at least one"),
    (["--method", "grpo", "--reward_funcs", "json_feilds"], "reward_funcs: 'json_feilds' is not a built-in"),
    (["--method", "grpo", "--reward_funcs", "json_valid", "--reward_weights", "1", "2"], "reward_weights: 2 weights"),
    (["--method", "grpo", "--reward_funcs", "json_valid", "--loss_type", "ppo"], "loss_type: one of grpo, dr_grpo"),
    (["--method", "grpo", "--reward_funcs", "json_valid", "--num_generations", "1"], "num_generations: at least 2"),
    (["--method", "grpo", "--reward_funcs", "json_valid", "--num_iterations", "0"], "num_iterations: at least 1"),
    (["--method", "grpo", "--reward_funcs", "json_valid", "--num_iterations", "2", "--save_steps", "3"],
     "save_steps: a multiple of --num_iterations (2) with it, got 3"),
    (["--method", "rloo", "--reward_funcs", "json_valid", "--loss_type", "grpo"], "loss_type: a GRPO option"),
    (["--num_generations", "4"], "num_generations: an option of GRPO, RLOO"),
])
def test_config_problems(job, flags, problem):
    from finetune import config as C

    root, model, data = job
    with pytest.raises(C.ConfigError) as e:
        C.parse(["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(root / "o"), *flags])
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


def test_a_failing_reward_stops_the_run_with_one_line(job, isolated, one_thread, tmp_path, capsys):
    f = tmp_path / "bad.py"
    f.write_text("def reward(prompts, completions, **kw):\n    return [1.0]\n")
    _, model, data = job
    with pytest.raises(SystemExit) as e:
        from finetune.training import trainer

        trainer.main(["--method", "grpo", "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir",
                      str(tmp_path / "o"), "--reward_funcs", f"{f}:reward", "--num_generations", "2",
                      "--per_device_train_batch_size", "2",
                      "--max_completion_length", "2", "--max_steps", "1"])
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err
    assert f"reward {f}:reward returned 1 values for 4 completions" in err


# ----------------------------------------------------------------------------------------------
# Slow: 2 processes against 1, per step (8 prompts, 4 per step: 2 steps per epoch, 3 steps).

EVERY = [("trainer", "zero2", ()), ("trainer", "zero3", ()),
         ("trainer", "zero3", ("--use_peft", "--lora_r", "4", "--lora_dropout", "0", "--beta", "0.1")),
         ("loop", "zero3", ()), ("loop", "ddp", ("--method", "rloo")),
         # the std of the whole step, both ranks' (an all-reduce); 2 steps on one batch of generations
         ("loop", "ddp", ("--scale_rewards", "batch", "--num_iterations", "2"))]
# CI's cover: the Trainer on ZeRO-2, and the loop with the whole step's std and a reused batch of generations; every
# cell with FINETUNE_FULL_MATRIX=1.
CASES = matrix(EVERY, [EVERY[0], EVERY[5]])


@pytest.mark.slow
@pytest.mark.parametrize("path, preset, flags", CASES, ids=[f"{p}-{c}-{len(f)}" for p, c, f in CASES])
def test_two_processes_equal_one(job, path, preset, flags):
    from tests.launch import LOOP, TRAIN, launcher, run

    root, model, data = job
    script = {"trainer": TRAIN, "loop": LOOP}[path]
    name = f"multi-{path}-{preset}-{len(flags)}"

    def history(tag: str, cmd: list[str], micro: int) -> list[dict]:
        out = root / f"{name}-{tag}"
        method = () if "--method" in flags else ("--method", "grpo")
        run(cmd + ["--config", preset, *method, *common(model, data, out), "--per_device_train_batch_size", str(micro),
                   "--gradient_accumulation_steps", "2", "--max_steps", "3", "--learning_rate", "0.05",
                   "--disable_tqdm", "true", *flags], timeout=600).check()
        return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]

    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(history, "1", [sys.executable, script], 2)
        two = pool.submit(history, "2", launcher("accelerate", 2, script=script), 1)
        one, two = one.result(), two.result()
    worst = same(two, one, bound=1e-4)
    assert any(e["grad_norm"] > 0 for e in one)
    losses = " ".join(f"{e['loss']:.6f}" for e in one)
    rewards = " ".join(f"{e['reward']:.4f}" for e in one)
    grads = " ".join(f"{e['grad_norm']:.6f}" for e in one)
    print(f"\nGRPO parity | {path} | {preset} | {' '.join(flags) or 'full'} | 1 process: loss {losses} | grad norm "
          f"{grads} | rewards {rewards} | max diff {worst[0]:.1e} ({worst[1]})")


def test_plan_counts_generation(tmp_path):
    """The planner's GRPO terms: prompts x generations rows of prompt + completion in the training forward (the
    layers save what an SFT micro-batch of that many rows of that length saves), and the KV cache of sampling."""
    from finetune.plan import planner as plan

    folder = tmp_path / "tiny"
    folder.mkdir()
    shape = dict(vocab_size=301, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(shape))
    base = ["--model_name_or_path", str(folder), "--accelerator", "cpu", "--host_memory", "64GB"]
    grpo = ["--method", "grpo", "--reward_funcs", "json_valid", "--num_generations", "4", "--max_completion_length",
            "64", "--max_seq_length", "128", "--per_device_train_batch_size", "2"]
    g = plan.make_plan(base + grpo)
    sft = plan.make_plan(base + ["--per_device_train_batch_size", "8", "--max_seq_length", "192", "--loss_chunk_size",
                                 "0"])
    assert g["activations_detail"]["decoder layers"] == sft["activations_detail"]["decoder layers"]
    kv = 2 * 2 * 32 * 8 * 192 * 4 + 4 * 8 * 301  # k and v, 2 layers, 2 kv heads of 16, 8 rows, 192 positions, fp32
    assert f"a KV cache of 8 rows (2 prompts x 4) x 192 positions, {plan.fmt_bytes(kv)}" in " ".join(g["notes"])
    assert "reference model" not in g["per_device"]
    full = plan.make_plan(base + grpo + ["--beta", "0.1"])
    lora = plan.make_plan(base + grpo + ["--beta", "0.1", "--use_peft"])
    assert full["per_device"]["reference model"] > 0 and "reference model" not in lora["per_device"]
    assert "reference: a frozen copy" in full["job"]["method"]


# 3 two-process GRPO runs (120 s of CPU): full matrix only. CI holds the parts: a kill -9 and resume on 2 processes
# (tests/test_resume.py, test_resume_trials.py) and GRPO's resume sampling the same completions
# (test_resume_repeats_the_run).
@pytest.mark.slow
@pytest.mark.full_matrix
def test_kill_one_rank_then_resume_repeats_the_run(job):
    """2 processes (Trainer path, ZeRO-2): rank 1 killed (-9) after step 3, checkpoint-2 complete; the resumed run
    logs what the uninterrupted one does, the completions of steps 3 and 4 sampled again alike."""
    from finetune.training import checkpoint
    from tests.launch import TRAIN, launcher, run, run_and_kill_rank

    root, model, data = job

    def command(out: Path) -> list[str]:
        return launcher("accelerate", 2, script=TRAIN) + [
            "--config", "zero2", "--method", "grpo", *common(model, data, out), "--per_device_train_batch_size", "1",
            "--gradient_accumulation_steps", "2", "--max_steps", "4", "--save_steps", "2", "--learning_rate", "0.05",
            "--disable_tqdm", "true", "--resume_from_checkpoint", "latest"]

    whole, cut = root / "kill-whole", root / "kill-cut"
    with ThreadPoolExecutor(2) as pool:
        reference = pool.submit(run, command(whole), timeout=600)
        killing = pool.submit(run_and_kill_rank, command(cut), cut / "checkpoint-2" / checkpoint.MARKER, rank=1,
                              timeout=600, stop_at=(3, 0.0))
        reference.result().check()
        killed = killing.result()
    assert killed.returncode != 0 and not killed.survivors
    resumed = run(command(cut), timeout=600).check()
    assert f"resume: from {cut / 'checkpoint-2'}" in resumed.output, resumed.output[-3000:]

    def logs(out):
        return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]

    worst = same(logs(cut), logs(whole), bound=1e-6)
    print(f"\nkill -9 and resume (zero2, 2 processes): max diff {worst[0]:.1e} ({worst[1]}) over 4 steps")
