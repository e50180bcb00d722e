"""`finetune train --method dpo`: per-step losses against a run written out by hand, and the references agreeing."""

from __future__ import annotations

import copy
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from finetune import methods
from finetune.models import tiny
from tests.launch import matrix
from tests.test_dpo import reference_loss

PAIRS = [
    {"prompt": "copy: red cat", "chosen": "red cat", "rejected": "cat red"},
    {"prompt": "count: one two three", "chosen": "3", "rejected": "three, I think"},
    {"prompt": [{"role": "user", "content": "capital of France?"}], "chosen": "Paris", "rejected": "It is Lyon."},
    {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
     "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "five"}]},
]
BETA, LR, STEPS = 0.5, 0.5, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    model = tiny.build(root / "model", style="chatml")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return root, model, data


def train(job, name: str, *flags: str, path: str = "trainer", accum: int = 2, entries: str = "loss") -> list[dict]:
    """One process, in this one: 4 pairs = the global batch (2 per micro-batch x 2 accumulation), SGD at a constant
    learning rate, no clipping: every step's loss is the mean over all pairs, whatever their order."""
    from finetune.training import loop, trainer

    main = {"trainer": trainer.main, "loop": loop.main}[path]

    root, model, data = job
    out = root / name
    main(["--method", "dpo", "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
          "--dataset_cache_dir", str(root / "cache"), "--per_device_train_batch_size", "2",
          "--gradient_accumulation_steps", str(accum), *([] if "--max_steps" in flags else ["--max_steps", str(STEPS)]), "--optim", "sgd", "--learning_rate", str(LR),
          "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--weight_decay", "0", "--beta", str(BETA),
          "--seed", "3", *flags])
    return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if entries in e]


def by_hand(model_dir, tokenizer_batch) -> list[float]:
    """The same run in plain torch: full-batch loss (tests/test_dpo.reference_loss), p -= lr * grad."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = copy.deepcopy(policy).eval()
    losses = []
    for _ in range(STEPS):
        policy.zero_grad()
        loss = reference_loss(policy, ref, tokenizer_batch, BETA, 0.0)
        loss.backward()
        with torch.no_grad():
            for p in policy.parameters():
                p -= LR * p.grad
        losses.append(loss.item())
    return losses


def typed_loss(policy, ref, batch, loss_type: str, eps: float):
    """The mean loss of --loss_type over the batch's pairs, in plain torch from the papers' formulas (the per-token
    loop of tests/test_dpo.reference_logps)."""
    import torch.nn.functional as F

    from tests.test_dpo import reference_logps

    args = batch["input_ids"], batch["attention_mask"], batch["labels"]
    pol = reference_logps(policy, *args)
    with torch.no_grad():
        rf = reference_logps(ref, *args)
    n = pol.shape[0] // 2
    ratio = pol - rf
    d = ratio[:n] - ratio[n:]
    if loss_type == "hinge":
        return torch.clamp(1 - BETA * d, min=0).mean()
    if loss_type == "ipo":
        tokens = (args[2][:, 1:] != -100).sum(1).float()
        return ((ratio[:n] / tokens[:n] - ratio[n:] / tokens[n:] - 1 / (2 * BETA)) ** 2).mean()
    return ((-(1 - eps) * F.logsigmoid(BETA * d) + eps * F.logsigmoid(-BETA * d)) / (1 - 2 * eps)).mean()  # robust


# Learning rates under DPO's 0.5 here: at 0.5 IPO's squared loss diverges, and the hinge is 0 after one step up to
# 5e-2 (the tiny model's summed log-ratios move by several nats a step).
@pytest.mark.parametrize("loss_type, eps, lr", [("hinge", 0.0, 0.002), ("ipo", 0.0, 0.05), ("robust", 0.2, 0.05)])
def test_loss_types_equal_hand_computed_run(job, isolated, one_thread, loss_type, eps, lr):
    """--loss_type on `finetune train` and `finetune loop`: 3 steps equal the run written out in plain torch."""
    from transformers import AutoModelForCausalLM

    _, model, _ = job
    flags = ("--loss_type", loss_type, "--label_smoothing", str(eps), "--learning_rate", str(lr))
    got = [e["loss"] for e in train(job, f"type-{loss_type}", *flags)]
    loop = [e["loss"] for e in train(job, f"type-{loss_type}-loop", *flags, path="loop")]
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ref = copy.deepcopy(policy).eval()
    batch, expected = full_batch(model), []
    for _ in range(STEPS):
        policy.zero_grad()
        loss = typed_loss(policy, ref, batch, loss_type, eps)
        loss.backward()
        with torch.no_grad():
            for p in policy.parameters():
                p -= lr * p.grad
        expected.append(loss.item())
    print(f"\ndpo --loss_type {loss_type}: trainer {got} | loop {loop} | by hand {expected}")
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-5) and loop == pytest.approx(got, abs=1e-6)
    assert got[-1] < got[0] and len(set(got)) == 3


def full_batch(model_dir):
    from finetune.config import ModelConfig
    from finetune.data import preference as PR
    from finetune.models.load import load_tokenizer

    t = load_tokenizer(ModelConfig(model_name_or_path=str(model_dir)))
    features = []
    for i, r in enumerate(PAIRS):
        p, c, cl, rj, rl = PR.tokenize_pair(t, r, f"test:{i}")
        features.append({"prompt_ids": p, "chosen_ids": c, "chosen_labels": cl, "rejected_ids": rj, "rejected_labels": rl})
    return PR.PairCollator(t.pad_token_id)(features)


def test_full_fine_tuning_equals_hand_computed_run(job, isolated, one_thread):
    root, model, _ = job
    logs = train(job, "full")
    expected = by_hand(model, full_batch(model))
    got = [e["loss"] for e in logs]
    assert got[0] == pytest.approx(0.693147, abs=1e-6)  # the policy starts as its reference: log 2
    assert got[-1] < got[0] - 0.05  # it learns the preference
    assert got == pytest.approx(expected, abs=1e-5), (got, expected)
    for e in logs:  # the DPO metrics of every logged step, consistent with each other
        assert e["rewards/margins"] == pytest.approx(e["rewards/chosen"] - e["rewards/rejected"], abs=1e-5)
        assert 0.0 <= e["rewards/accuracies"] <= 1.0 and e["logps/chosen"] < 0
    assert logs[0]["rewards/chosen"] == 0.0 and logs[-1]["rewards/accuracies"] > 0.5
    # The precomputed reference (the model before training, scored once and cached) gives the same run.
    pre = [e["loss"] for e in train(job, "full-pre", "--precompute_ref_log_probs")]
    assert pre == pytest.approx(got, abs=1e-6)
    assert list((root / "cache").glob("*.ref-*.pt"))


def test_lora_live_reference_equals_precomputed(job, isolated, one_thread):
    live = [e["loss"] for e in train(job, "lora", "--use_peft", "--lora_r", "4", "--learning_rate", "2")]
    pre = [e["loss"] for e in train(job, "lora-pre", "--use_peft", "--lora_r", "4", "--learning_rate", "2",
                                    "--precompute_ref_log_probs")]
    assert live[0] == pytest.approx(0.693147, abs=1e-6)  # LoRA's B starts at zero: the policy is its base
    assert live[-1] < live[0]
    assert pre == pytest.approx(live, abs=1e-6)


@pytest.mark.parametrize("flags, problem", [
    (["--method", "dop"], f"method: 'dop' is not one of {', '.join(methods.names())}; did you mean 'dpo'?"),
    (["--precompute_ref_log_probs"], "precompute_ref_log_probs: a DPO option; add --method dpo"),
    (["--beta", "0.2"], "beta: an option of DPO, "),  # --beta is TRL's name in SimPO and ORPO too
    (["--method", "dpo", "--beta", "0"], "beta: must be positive, got 0.0"),
    (["--method", "dpo", "--label_smoothing", "0.5"], "label_smoothing: must be in [0, 0.5), got 0.5"),
    (["--method", "dpo", "--packing"], "packing: not supported with --method dpo yet"),
    (["--method", "dpo", "--loss_type", "ipoo"], "loss_type: 'ipoo' is not one of sigmoid, hinge, ipo, "
                                                 "robust; did you mean 'ipo'?"),
    (["--method", "dpo", "--loss_type", "hinge", "--label_smoothing", "0.1"], "label_smoothing: --loss_type hinge does "
                                                                               "not use it"),
    (["--method", "simpo", "--loss_type", "ipo"], ("loss_type: an option of DPO, CPO, GRPO, RLOO; add --method dpo or "
                                                  "cpo or grpo or rloo")),
    (["--method", "dpo", "--label_smoothing_factor", "0.1"], "label_smoothing_factor: not supported with --method dpo "
                                                             "yet (DPO's own is --label_smoothing)"),
    (["--method", "dpo", "--eval_split_size", "2", "--eval_generate", "2"], "eval_generate: not supported with --method"),
    (["--method", "dpo", "--eval_split_size", "2", "--load_best_model_at_end", "--metric_for_best_model",
      "rewards/acuracies", "--save_steps", "2"], "metric_for_best_model: 'rewards/acuracies' is not logged; did you mean"),
])
def test_config_problems(job, flags, problem):
    from finetune import config as C

    root, model, data = job
    with pytest.raises(C.ConfigError) as e:
        C.parse(["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(root / "o"), *flags])
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


def test_config_accepts_dpo_and_records_it(job, tmp_path, isolated):
    from finetune import config as C

    root, model, data = job
    base = ["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(tmp_path / "o")]
    cfg = C.parse(base + ["--method", "dpo", "--beta", "0.3", "--use_peft", "--config", "zero3"], check_paths=False)
    assert (cfg.objective.method, cfg.objective.beta, cfg.objective.label_smoothing) == ("dpo", 0.3, 0.0)
    assert cfg.resolved()["method"] == "dpo" and cfg.resolved()["beta"] == 0.3
    # An SFT run's recipe is what it was before --method existed (on SFT's data: pairs given to SFT are refused).
    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text('{"text": "a record"}\n')
    sft = ["--model_name_or_path", str(model), "--dataset", str(sft_data), "--output_dir", str(tmp_path / "o")]
    assert "method" not in C.parse(sft, check_paths=False).resolved()


KEYS = ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/margins",
        "rewards/accuracies", "logps/chosen", "logps/rejected", "epoch", "step")


@pytest.mark.parametrize("flags", [(), ("--use_peft", "--lora_r", "4", "--learning_rate", "2"),
                                   ("--precompute_ref_log_probs",)], ids=["full", "lora", "precompute"])
def test_loop_logs_what_the_trainer_logs(job, isolated, one_thread, flags):
    name = "-".join(flags) or "full"
    want = train(job, f"trainer{name}", *flags, "--logging_steps", "2", "--max_steps", "4")
    got = train(job, f"loop{name}", *flags, "--logging_steps", "2", "--max_steps", "4", path="loop")
    assert want[-1]["loss"] < want[0]["loss"]
    assert [e["step"] for e in got] == [e["step"] for e in want] == [2, 4]
    for g, w in zip(got, want):
        assert set(KEYS) <= set(g) and set(KEYS) <= set(w)
        for k in KEYS:
            assert g[k] == pytest.approx(w[k], abs=1e-6), (k, got, want)


def test_plan_counts_the_reference(tmp_path):
    from finetune.plan import planner as plan

    folder = tmp_path / "tiny"
    folder.mkdir()
    shape = dict(vocab_size=301, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(shape))
    base = ["--model_name_or_path", str(folder), "--accelerator", "cpu", "--host_memory", "64GB",
            "--max_seq_length", "128"]
    sft = plan.make_plan(base + ["--per_device_train_batch_size", "4", "--loss_chunk_size", "0"])
    full = plan.make_plan(base + ["--method", "dpo", "--per_device_train_batch_size", "2"])
    params = full["model"]["parameters"]
    # Two rows per pair: the layers of a DPO micro-batch of 2 pairs save what an SFT micro-batch of 4 records does;
    # the loss does not (logits at the scored positions only: bench/memory.py --dpo measures both).
    assert full["activations_detail"]["decoder layers"] == sft["activations_detail"]["decoder layers"]
    assert full["activations_saved"] != sft["activations_saved"]
    assert full["per_device"]["reference model"] == 4 * params  # fp32 on CPU: the whole model again
    precomputed = plan.make_plan(base + ["--method", "dpo", "--per_device_train_batch_size", "2",
                                         "--precompute_ref_log_probs"])
    assert full["per_device_total"] == precomputed["per_device_total"] + 4 * params  # the copy is all that differs
    assert "reference a frozen copy of the model" in full["job"]["method"]
    assert "does not fit" not in full["rejected"].get("zero3", "")
    for flags, what in ((["--use_peft"], "the base, adapters disabled (no copy)"),
                        (["--precompute_ref_log_probs"], "precomputed log-probabilities (no copy)")):
        other = plan.make_plan(base + ["--method", "dpo", "--per_device_train_batch_size", "2", *flags])
        assert "reference model" not in other["per_device"] and what in other["job"]["method"]
    # Under ZeRO-3 the frozen copy is partitioned like the policy: each of 2 ranks holds half of it, and the small
    # parameters its engine keeps whole (the 5 norms of 64 under the persistence threshold, 10 x hidden) whole.
    two = base + ["--method", "dpo", "--per_device_train_batch_size", "2", "--devices_per_node", "2"]
    zero3 = plan.make_plan(two + ["--config", "zero3"])
    assert zero3["per_device"]["reference model"] == 4 * params // 2 + 4 * 5 * 64
    assert "partitioned over the 2 ranks" in " ".join(zero3["notes"])
    assert plan.make_plan(two + ["--config", "ddp"])["per_device"]["reference model"] == 4 * params


EVAL_KEYS = ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins",
             "eval_rewards/accuracies", "eval_logps/chosen", "eval_logps/rejected", "eval_samples")


@pytest.mark.parametrize("held_out", ["split", "file"])
def test_evaluation_on_both_paths(job, isolated, one_thread, held_out):
    """Eval pairs scored like training pairs, each once: the same metrics on the Trainer path and the loop. The
    file case evaluates the training pairs themselves with the precomputed reference: before any update (the
    Trainer's --eval_on_start) the loss is log 2, the policy being its reference."""
    flags = (("--eval_split_size", "2", "--per_device_eval_batch_size", "3") if held_out == "split" else
             ("--eval_dataset", str(job[2]), "--precompute_ref_log_probs"))
    flags += ("--eval_steps", "2", "--max_steps", "4")
    start = ("--eval_on_start", "true") if held_out == "file" else ()
    want = train(job, f"trainer-eval-{held_out}", *flags, *start, accum=1, entries="eval_loss")
    if start:
        first, want = want[0], want[1:]
        assert first["step"] == 0 and first["eval_loss"] == pytest.approx(0.693147, abs=1e-6)
        assert first["eval_samples"] == 4 and want[0]["eval_loss"] < first["eval_loss"] - 0.3
    got = train(job, f"loop-eval-{held_out}", *flags, path="loop", accum=1, entries="eval_loss")
    assert [e["step"] for e in got] == [e["step"] for e in want] == [2, 4]
    assert got[0]["eval_samples"] == (2 if held_out == "split" else 4)
    for g, w in zip(got, want):
        for k in EVAL_KEYS:
            assert g[k] == pytest.approx(w[k], abs=1e-6), (k, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["trainer", "loop"])
@pytest.mark.parametrize("flags", [(), ("--precompute_ref_log_probs",), ("--use_peft", "--lora_r", "4")],
                         ids=["copy", "precompute", "lora"])
def test_resume_gives_the_same_losses(job, isolated, one_thread, tmp_path, path, flags):
    """The run's own mid-epoch checkpoint (step 3 of 4; 2 steps per epoch) resumed in a new folder: the same steps.
    The frozen copy is the base as loaded, not the checkpoint; the precomputed reference comes from the cache."""
    import shutil

    root = job[0]
    name = f"resume-{path}-{'-'.join(flags) or 'copy'}"
    common = (*flags, "--max_steps", "4", "--save_steps", "3")
    whole = train(job, name, *common, path=path, accum=1)
    resumed_dir = root / f"{name}-resumed"
    shutil.copytree(root / name / "checkpoint-3", resumed_dir / "checkpoint-3")
    resumed = train(job, f"{name}-resumed", *common, "--resume_from_checkpoint", "latest", path=path, accum=1)
    # The resumed history is the checkpoint's (steps 1-3) and step 4 trained again.
    assert [e["step"] for e in whole] == [e["step"] for e in resumed] == [1, 2, 3, 4]
    assert whole[-1]["loss"] < whole[0]["loss"]
    for w, r in zip(whole, resumed):
        for k in KEYS:
            assert r[k] == pytest.approx(w[k], abs=1e-6), (k, whole, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("bits", ["--load_in_4bit", "--load_in_8bit"])
def test_quantized_base_lora(job, isolated, one_thread, bits):
    """8/4-bit bases with LoRA: the reference is the quantized base with the adapters off (scored in eval mode,
    which the 4-bit CPU guard keeps from repacking the weights); the adapters learn the preference."""
    flags = ("--use_peft", "--lora_r", "4", bits, "--learning_rate", "2", "--max_steps", "4")
    logs = train(job, f"quant{bits}", *flags)
    # Step 1 is log 2 up to the quantized kernels: 8-bit scores the reference (no grad, eval mode) through another
    # int8 path than the training forward (measured 0.69330 against 0.69315).
    assert logs[0]["loss"] == pytest.approx(0.693147, abs=1e-5 if bits == "--load_in_4bit" else 1e-3)
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.01 and logs[-1]["rewards/margins"] > 0
    pre = train(job, f"quant{bits}-pre", *flags, "--precompute_ref_log_probs")
    assert [e["loss"] for e in pre] == pytest.approx([e["loss"] for e in logs], abs=1e-5)


# ----------------------------------------------------------------------------------------------
# Slow: 2 processes against 1, per step (8 pairs, global batch 4: 2 steps per epoch, 4 steps).

MORE_PAIRS = PAIRS + [
    {"prompt": "copy: blue dog", "chosen": "blue dog", "rejected": "dog blue"},
    {"prompt": "reverse: a b c", "chosen": "c b a", "rejected": "a b c"},
    {"prompt": "2+3?", "chosen": "5", "rejected": "6"},
    {"prompt": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "colour of snow?"}],
     "chosen": "white", "rejected": "Snow is usually white, I believe."},
]
# (path, preset, flags): the Trainer path (accelerate launch finetune/train.py) on every preset: full fine-tuning with
# its frozen copy under DDP and ZeRO-2; under ZeRO-3 LoRA's live reference (adapters off inside the engine) and full
# fine-tuning's frozen copy partitioned, also under ZeRO-Infinity with the policy swapped to disk. The loop: the
# precomputed reference under ZeRO-3, and the partitioned copy under ZeRO-Infinity.
# (LoRA without dropout: one process and two draw different dropout masks, as in tests/test_lora.py.)
# Each with every --loss_type (TRL's names) and --label_smoothing where a type reads it (robust's flip rate,
# sigmoid's conservative DPO).
# CI runs three cells with one loss each (below); FINETUNE_FULL_MATRIX=1 runs every cell with every loss (a loss of
# per-pair terms does not change what is reduced over the ranks; each loss type equals TRL's in tests/test_dpo.py).
CELLS = [("trainer", "ddp", ()), ("trainer", "zero2", ()),
         ("trainer", "zero3", ("--use_peft", "--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "0.005")),
         ("loop", "zero3", ("--precompute_ref_log_probs",)),
         ("trainer", "zero3", ()), ("trainer", "zero3_nvme", ()), ("loop", "zero3_nvme", ())]
LOSSES = {"sigmoid": (), "hinge": ("--loss_type", "hinge"), "ipo": ("--loss_type", "ipo"),
          "robust": ("--loss_type", "robust", "--label_smoothing", "0.2"), "cdpo": ("--label_smoothing", "0.1")}
EVERY = [(path, preset, flags, loss) for path, preset, flags in CELLS for loss in LOSSES]
# CI: three cells, each path under ZeRO-3 once with the reference as the disabled adapter (the Trainer), as
# precomputed log-probs and as a partitioned full copy (the loop, ZeRO-3 on NVMe). The Trainer's DDP and ZeRO-3
# (full) cells share their loss: the ZeRO-3 case's plain-copy run is the DDP case's one-process run (same_runs).
CI_LOSS = {CELLS[2]: "ipo", CELLS[3]: "hinge", ("loop", "zero3_nvme", ()): "cdpo"}
CASES = matrix(EVERY, [(*cell, loss) for cell, loss in CI_LOSS.items()])


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo-multi")
    model = tiny.build(root / "model", style="chatml")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in MORE_PAIRS))
    return root, model, data


@pytest.fixture(scope="module")
def same_runs() -> dict:
    """Log histories by the run's whole command but its output folder: the DDP-preset one-process run that a ZeRO-3
    case checks its partitioned copy against is the trainer-ddp case's own one-process run (same script, flags, seed
    and data), made once."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("path, preset, flags, loss", CASES,
                         ids=[f"{p}-{c}-{f[0].lstrip('-') if f else 'full'}-{loss}" for p, c, f, loss in CASES])
def test_two_processes_equal_one(multi, same_runs, path, preset, flags, loss):
    from tests.launch import LOOP, TRAIN, launcher, run, unexpected_warnings

    root, model, data = multi
    script = {"trainer": TRAIN, "loop": LOOP}[path]
    loss_flags = LOSSES[loss]

    def history(name: str, cmd: list[str], micro: int, config: str = preset, extra=()) -> list[dict]:
        key = (tuple(cmd), config, micro, tuple(extra), tuple(flags), loss_flags)
        if key in same_runs:
            outputs[name], logs = same_runs[key]
            return logs
        out = root / name
        result = run(cmd + ["--config", config, *extra, "--method", "dpo", "--model_name_or_path", str(model), "--dataset",
                            str(data), "--output_dir", str(out), "--dataset_cache_dir", str(root / "cache"),
                            "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", "2",
                            "--max_steps", "4", "--lr_scheduler_type", "constant",
                            *(() if "--learning_rate" in flags else ("--learning_rate", "0.05")),
                            "--beta", str(BETA), "--seed", "3", "--disable_tqdm", "true", *flags, *loss_flags],
                     timeout=600).check()
        assert not unexpected_warnings(result.output), unexpected_warnings(result.output)
        # The run's own line says which loss it trained with.
        assert described in result.output, (described, result.output[-3000:])
        outputs[name] = result.output
        logs = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
        same_runs[key] = (result.output, logs)
        return logs

    options = dict(zip(loss_flags[::2], loss_flags[1::2]))
    described = (f"dpo: loss {options.get('--loss_type', 'sigmoid')}, beta {float(BETA)}, label smoothing "
                 f"{float(options.get('--label_smoothing', 0))}")
    outputs: dict[str, str] = {}
    name = f"{path}-{preset}-{len(flags)}-{loss}"
    # Each job swaps to its own folder under ZeRO-Infinity.
    nvme = lambda job: ("--nvme_path", str(root / f"{name}-{job}-nvme")) if preset == "zero3_nvme" else ()  # noqa: E731
    partitioned_copy = (preset.startswith("zero3") and not flags[:1] == ("--use_peft",)
                        and "--precompute_ref_log_probs" not in flags)
    runs = {"one": (f"{name}-1", [sys.executable, script], 2, preset, nvme("1")),
            "two": (f"{name}-2", launcher("accelerate", 2, script=script), 1, preset, nvme("2"))}
    if partitioned_copy:
        runs["plain"] = (f"{name}-ddp", [sys.executable, script], 2, "ddp", ())
    if "--precompute_ref_log_probs" in flags:
        # One after the other, as before: both runs read and write the cached reference log-probabilities.
        done = {job: history(*args) for job, args in runs.items()}
    else:
        # Independent jobs side by side (each its own output and swap folder; the data cache is shared under its
        # lock, as ranks share it).
        with ThreadPoolExecutor(len(runs)) as pool:
            jobs = {job: pool.submit(history, *args) for job, args in runs.items()}
            done = {job: future.result() for job, future in jobs.items()}
    one, two = done["one"], done["two"]
    assert [e["step"] for e in two] == [e["step"] for e in one] == [1, 2, 3, 4]
    if partitioned_copy:
        # The frozen reference is partitioned: rank 0 holds about half of it (rank 0 prints it).
        shares = [tuple(int(x.replace(",", "")) for x in m) for m in
                  re.findall(r"partitioned by ZeRO-3 like the policy \(([\d,]+) of its ([\d,]+) parameters",
                             outputs[f"{name}-2"])]
        assert len(shares) == 1 and all(0.45 < held / total < 0.55 for held, total in shares), shares
        # and it scores as the plain frozen copy does (one process, DDP preset: a deepcopy; the optimizers differ,
        # DeepSpeed's CPU Adam against torch's AdamW, hence the presets' bound).
        plain = done["plain"]
        for a, b in zip(one, plain):
            for k in ("loss", "rewards/margins", "logps/rejected"):
                assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), (k, one, plain)
    # It learns: the chosen answers move ahead (not the loss: cDPO's and IPO's have a finite optimum that the preset's
    # Adam at 5e-2 overshoots, cDPO's loss back at 0.6955 from 0.6931 with margins at 4.9 by step 4).
    assert one[-1]["rewards/margins"] > max(0.0, one[0]["rewards/margins"]), one
    keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen")
    for a, b in zip(one, two):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), (k, one, two)
    diff = max(abs(a[k] - b[k]) for a, b in zip(one, two) for k in ("loss", "grad_norm", "rewards/margins"))
    bound = max(abs(a[k] - b[k]) / max(1.0, abs(a[k])) for a, b in zip(one, two) for k in keys)
    curve = lambda logs: " ".join(f"{e['loss']:.6f}" for e in logs)  # noqa: E731
    what = " ".join(flags[:1]) or "full, frozen copy"
    print(f"\nDPO parity | {path} | {preset} | {what} | {' '.join(loss_flags) or 'sigmoid'} | 1 process: {curve(one)} "
          f"| 2 processes: {curve(two)} | max diff (loss, grad norm, margins) {diff:.1e} | max diff as asserted "
          f"(relative above 1) {bound:.1e}")
