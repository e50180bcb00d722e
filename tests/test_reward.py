"""finetune.methods.reward (--method reward) and `finetune score`: one batch's loss and gradients against TRL 1.16's
RewardTrainer.compute_loss and a float64 computation written here; `finetune train` and `finetune loop` per step; the
saved folder read back by plain transformers; the scoring command."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from finetune.data import preference as PR
from finetune.methods import reward
from finetune.models import tiny
from tests.launch import matrix
from tests.test_dpo import RECORDS, pair_features

MARGINS = [0.5, 0.0, 1.25]


def seq_cls(folder, pad_token_id, seed=1):
    """The tiny model with a score head of one output, moved away from its near-uniform start."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32, num_labels=1,
                                                               pad_token_id=pad_token_id)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def tokenizer_of(folder):
    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    return load_tokenizer(ModelConfig(model_name_or_path=str(folder)))


def f64_loss(model, batch, margins, center):
    """Written from the Bradley-Terry formula: each row's reward read at its last real token by hand (the attention
    mask, not the pad id), in float64."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    hidden = out.hidden_states[-1].double()
    last = batch["attention_mask"].sum(1) - 1
    r = hidden[torch.arange(len(last)), last] @ model.score.weight.double().T
    c, rj = r.squeeze(-1).chunk(2)
    m = torch.tensor(margins, dtype=torch.float64)
    return (-F.logsigmoid(c - rj - m) + center * (c + rj) ** 2).mean()


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def trl_trainer(model, tokenizer, tmp_path, features, margins, center):
    """TRL's RewardTrainer on our tokens (its pre-tokenized form: chosen_ids, rejected_ids, margin)."""
    import datasets
    from trl import RewardConfig, RewardTrainer

    rows = [{"chosen_ids": f["prompt_ids"] + f["chosen_ids"], "rejected_ids": f["prompt_ids"] + f["rejected_ids"],
             "margin": m} for f, m in zip(features, margins)]
    args = RewardConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=len(rows),
                        center_rewards_coefficient=center or None)
    return RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer)


@pytest.mark.parametrize("center", [0.0, 0.01], ids=["plain", "centered"])
def test_loss_and_gradients_equal_trl(tiny_chatml, tmp_path, one_thread, isolated, center):
    """On identical batches (our tokens, TRL's collator and ours padding them alike) our loss and every gradient
    equal TRL's RewardTrainer.compute_loss within 1e-5 in fp32, and both the float64 loss written here."""
    pytest.importorskip("trl")
    tokenizer = tokenizer_of(tiny_chatml)
    model = seq_cls(tiny_chatml, tokenizer.pad_token_id)
    features = [dict(f, margin=m) for f, m in zip(pair_features(tokenizer, RECORDS), MARGINS)]
    batch = PR.PairCollator(tokenizer.pad_token_id)(features)
    trainer = trl_trainer(model, tokenizer, tmp_path, features, MARGINS, center)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(features))])
    assert torch.equal(inputs["input_ids"], batch["input_ids"])
    assert torch.equal(inputs["attention_mask"], batch["attention_mask"])
    assert inputs["margin"].tolist() == batch["margin"].tolist() == MARGINS

    model.zero_grad()
    theirs = trainer.compute_loss(model, dict(inputs))
    theirs.backward()
    want = grads(model)
    model.zero_grad()
    window = reward.Window(reward.METRICS)
    ours = reward.micro_batch_loss(reward.RewardConfig(method="reward", center_rewards_coefficient=center), model,
                                   batch, len(features), window)
    ours.backward()
    got = grads(model)
    f64 = f64_loss(copy.deepcopy(model).double(), batch, MARGINS, center).item()
    grad_diff = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"\nreward center={center}: ours {ours.item():.8f} TRL {theirs.item():.8f} float64 {f64:.8f} | ours-TRL "
          f"{abs(ours.item() - theirs.item()):.1e} ours-f64 {abs(ours.item() - f64):.1e} | max grad diff {grad_diff:.1e}")
    assert abs(ours.item() - theirs.item()) < 1e-5 and abs(ours.item() - f64) < 1e-5 and abs(theirs.item() - f64) < 1e-5
    assert set(got) == set(want) and "score.weight" in got
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)
    logged = window.pop()
    chosen, rejected = reward.rewards_of(model, batch).detach().double().chunk(2)
    assert logged["accuracy"] == pytest.approx((chosen > rejected).double().mean().item())
    assert logged["margin"] == pytest.approx((chosen - rejected).mean().item())
    assert logged["margin"] == pytest.approx(logged["rewards/chosen"] - logged["rewards/rejected"])


def test_trl_tokenizes_these_records_as_we_do(tiny_chatml, tiny_plain, tmp_path, one_thread, isolated):
    """TRL's own tokenization of the raw records (prompt + completion joined, then tokenized whole; EOS appended to a
    string record without a chat template) against ours (DPO's: the prompt as rendered at inference, the completion
    after it). Where the tokens are equal the losses are too (the test above); printed where they differ."""
    pytest.importorskip("trl")
    import datasets
    from trl import RewardConfig, RewardTrainer

    for folder, records in ((tiny_chatml, RECORDS), (tiny_plain, [r for r in RECORDS if isinstance(r["prompt"], str)])):
        tokenizer = tokenizer_of(folder)
        model = seq_cls(folder, tokenizer.pad_token_id)
        plain = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in records]
        if not tokenizer.chat_template:
            trl_rows = plain
        else:  # TRL's conversational form of the same records
            trl_rows = [{"prompt": r["prompt"] if isinstance(r["prompt"], list) else
                         [{"role": "user", "content": r["prompt"]}],
                         "chosen": [{"role": "assistant", "content": r["chosen"]}],
                         "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in plain]
        args = RewardConfig(output_dir=str(tmp_path / folder.name), report_to="none", use_cpu=True)
        trainer = RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(trl_rows),
                                processing_class=tokenizer)
        ours = pair_features(tokenizer, records)
        same = [trainer.train_dataset[i][f"{side}_ids"] == o["prompt_ids"] + o[f"{side}_ids"]
                for i, o in enumerate(ours) for side in ("chosen", "rejected")]
        print(f"\n{folder.name}: {sum(same)} of {len(same)} sequences tokenized identically by TRL and by us")
        assert all(same)


# ----------------------------------------------------------------------------------------------
# `finetune train` (the HF Trainer path) and `finetune loop`, per step; the saved folder; `finetune score`.

PAIRS = [
    {"prompt": "copy: red cat", "chosen": "red cat", "rejected": "cat red", "margin": 0.5},
    {"prompt": "count: one two three", "chosen": "3", "rejected": "three, I think"},
    {"prompt": [{"role": "user", "content": "capital of France?"}], "chosen": "Paris", "rejected": "It is Lyon.",
     "margin": 1.0},
    {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
     "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "five"}]},
]
LR, STEPS = 0.05, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from finetune.models import tiny

    root = tmp_path_factory.mktemp("reward")
    model = tiny.build(root / "model", style="chatml")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return root, model, data


def train(job, name: str, *flags: str, path: str = "trainer", entries: str = "loss") -> list[dict]:
    """One process: 4 pairs = the global batch (2 per micro-batch x 2 accumulation), SGD, constant learning rate."""
    from finetune.training import loop, trainer

    root, model, data = job
    out = root / name
    {"trainer": trainer.main, "loop": loop.main}[path](
        ["--method", "reward", "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
         "--dataset_cache_dir", str(root / "cache"), "--per_device_train_batch_size", "2",
         "--gradient_accumulation_steps", "2", "--optim", "sgd", "--learning_rate", str(LR),
         "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--weight_decay", "0", "--seed", "3", *flags])
    return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if entries in e]


def full_batch(model_dir):
    t = tokenizer_of(model_dir)
    features = [dict(f, margin=p.get("margin", 0.0)) for f, p in zip(pair_features(t, PAIRS), PAIRS)]
    return PR.PairCollator(t.pad_token_id)(features), t


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trainer_and_loop_equal_per_step_and_float64(job, isolated, one_thread, lora):
    """Step 1 is the model as loaded, its new head drawn from --seed: the float64 loss of the whole batch; without
    LoRA every step is the run written out in float64 (p -= lr * grad)."""
    _, model_dir, _ = job
    flags = ("--max_steps", str(STEPS)) + (("--use_peft", "--lora_r", "4", "--lora_dropout", "0") if lora else ())
    name = "lora" if lora else "full"
    want = train(job, f"{name}-trainer", *flags)
    got = train(job, f"{name}-loop", *flags, path="loop")
    batch, tokenizer = full_batch(model_dir)
    margins = batch["margin"].tolist()
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(3)  # the head as load_model draws it
    model64 = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32, num_labels=1,
                                                                 pad_token_id=tokenizer.pad_token_id).double()
    by_hand = []
    for _ in range(1 if lora else STEPS):
        model64.zero_grad()
        loss = f64_loss(model64, batch, margins, 0.0)
        loss.backward()
        with torch.no_grad():
            for p in model64.parameters():
                p -= LR * p.grad
        by_hand.append(loss.item())
    a, b = [e["loss"] for e in want], [e["loss"] for e in got]
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(f"\nreward {name}: trainer {a} | loop {b} | max relative diff {rel:.1e} | float64 by hand {by_hand}")
    assert [e["step"] for e in want] == [e["step"] for e in got] == [1, 2, 3]
    assert a[:len(by_hand)] == pytest.approx(by_hand, rel=1e-5)
    assert rel < 1e-5, (a, b)
    assert a[-1] < a[0]  # it learns
    for g, w in zip(got, want):
        for k in reward.METRICS:
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-6), (k, g, w)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_saved_folder_scores_as_the_trained_model(job, isolated, one_thread, tmp_path, lora):
    """The final evaluation (after the last update, on the training pairs) against the saved folder read back by
    plain transformers (AutoModelForSequenceClassification; peft for the adapter) and by `finetune score`, batched
    and one record at a time: the same rewards."""
    from transformers import AutoModelForSequenceClassification

    from finetune.inference import score

    root, model_dir, data = job
    name = f"saved-{'lora' if lora else 'full'}"
    flags = ("--max_steps", "3", "--eval_dataset", str(data), "--eval_steps", "3", "--per_device_eval_batch_size", "3")
    flags += ("--use_peft", "--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "0.5") if lora else ()
    final = train(job, name, *flags, entries="eval_loss")[-1]
    out = root / name
    batch, tokenizer = full_batch(model_dir)
    if lora:
        from peft import PeftModel

        assert "score" in json.loads((out / "adapter_config.json").read_text())["modules_to_save"]
        base = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1,
                                                                  pad_token_id=tokenizer.pad_token_id)
        model = PeftModel.from_pretrained(base, str(out)).eval()
    else:
        config = json.loads((out / "config.json").read_text())
        assert config["pad_token_id"] == tokenizer.pad_token_id and config["architectures"] == [
            "LlamaForSequenceClassification"]
        model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        chosen, rejected = reward.rewards_of(model, batch).double().chunk(2)
    assert final["step"] == 3 and final["eval_samples"] == 4
    print(f"\n{name}: eval at the last step rewards/chosen {final['eval_rewards/chosen']:.8f}, saved folder "
          f"{chosen.mean().item():.8f}; margin {final['eval_margin']:.8f} vs {(chosen - rejected).mean().item():.8f}")
    assert chosen.mean().item() == pytest.approx(final["eval_rewards/chosen"], abs=1e-6)
    assert rejected.mean().item() == pytest.approx(final["eval_rewards/rejected"], abs=1e-6)
    assert (chosen > rejected).double().mean().item() == pytest.approx(final["eval_accuracy"])
    for batch_size in (4, 1):
        results = score.run(score.ScoreArgs(model_name_or_path=str(out), dataset=str(data), batch_size=batch_size,
                                            output=str(tmp_path / f"scores{batch_size}.jsonl")))
        assert [r["chosen_reward"] for r in results] == pytest.approx(chosen.tolist(), abs=1e-6)
        assert [r["rejected_reward"] for r in results] == pytest.approx(rejected.tolist(), abs=1e-6)
    if lora:  # `finetune export` merges the adapter and its score head: a plain reward model, the same rewards
        from finetune.convert.writers.hf import merge_adapter

        merge_adapter(out, tmp_path / "merged")
        merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
        with torch.no_grad():
            again = reward.rewards_of(merged, batch).double()
        assert again.tolist() == pytest.approx(torch.cat([chosen, rejected]).tolist(), abs=1e-6)
    completions = tmp_path / "completions.jsonl"
    completions.write_text("".join(json.dumps({"prompt": p["prompt"], "completion": p["chosen"]}) + "\n"
                                   for p in PAIRS if "prompt" in p))
    got = score.run(score.ScoreArgs(model_name_or_path=str(out), dataset=str(completions), batch_size=3,
                                    output=str(tmp_path / "c.jsonl")))
    # A completion scores as the chosen side of its pair (the 4th pair, a whole conversation, has no prompt field).
    assert [r["reward"] for r in got] == pytest.approx(chosen.tolist()[:3], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["trainer", "loop"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_gives_the_same_losses(job, isolated, one_thread, path, lora):
    """The run's own mid-epoch checkpoint (step 3 of 4) resumed in a new folder, as after a kill -9: the same steps
    and metrics."""
    import shutil

    root = job[0]
    name = f"resume-{path}-{'lora' if lora else 'full'}"
    common = ("--max_steps", "4", "--save_steps", "3", "--gradient_accumulation_steps", "1")
    common += ("--use_peft", "--lora_r", "4", "--lora_dropout", "0") if lora else ()
    whole = train(job, name, *common, path=path)
    shutil.copytree(root / name / "checkpoint-3", root / f"{name}-resumed" / "checkpoint-3")
    resumed = train(job, f"{name}-resumed", *common, "--resume_from_checkpoint", "latest", path=path)
    assert [e["step"] for e in whole] == [e["step"] for e in resumed] == [1, 2, 3, 4]
    keys = ("loss", "grad_norm", *reward.METRICS)
    for w, r in zip(whole, resumed):
        for k in keys:
            assert r[k] == pytest.approx(w[k], abs=1e-6), (k, whole, resumed)
    print(f"\n{name}: max difference after resuming {max(abs(w[k] - r[k]) for w, r in zip(whole, resumed) for k in keys):.1e}")


def test_engine_path_refuses_by_name():
    from types import SimpleNamespace

    from finetune.config.preset import Preset
    from finetune.training import core

    cfg = SimpleNamespace(training=SimpleNamespace(), sources={}, preset=Preset.named("ddp"),
                          objective=reward.RewardConfig(method="reward"))
    assert core.refused_flags(cfg, "scripts/sft.py") == ["method reward: not supported by scripts/sft.py "
                                                         "(finetune/train.py supports it)"]
    assert core.refused_flags(cfg, "finetune/loop.py") == core.refused_flags(cfg, "finetune/train.py") == []


@pytest.mark.parametrize("flags, problem", [
    (["--center_rewards_coefficient", "0.1"], "center_rewards_coefficient: a reward"),
    (["--method", "reward", "--center_rewards_coefficient", "-1"], "center_rewards_coefficient: must be 0 or more"),
    (["--method", "reward", "--packing"], "packing: not supported with --method reward yet"),
    (["--method", "reward", "--beta", "0.2"], "beta: an option of"),
])
def test_config_problems(job, flags, problem):
    from finetune import config as C

    root, model, data = job
    with pytest.raises(C.ConfigError) as e:
        C.parse(["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(root / "o"), *flags])
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


@pytest.mark.parametrize("line, problem", [
    ({"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}, "field 'margin' must be a finite number"),
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "'chosen' and 'rejected' are identical"),
    ({"prompt": "p", "chosen": "a"}, "missing field 'rejected'"),
])
def test_bad_data_is_one_line_before_the_model_loads(job, isolated, tmp_path, capsys, monkeypatch, line, problem):
    """The file and line named, exit 2, and the model never loaded."""
    from finetune.models import load

    root, model, _ = job

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(load, "load_model", loaded)
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps(line) + "\n")
    from finetune.training import trainer

    with pytest.raises(SystemExit) as e:
        trainer.main(["--method", "reward", "--model_name_or_path", str(model), "--dataset", str(data),
                      "--output_dir", str(tmp_path / "o"), "--dataset_cache_dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{data}:2: " in err and problem in err, err


def test_score_refuses_bad_input_before_loading(job, tmp_path, capsys):
    from finetune.inference import score

    root, model, data = job
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    for folder, dataset, problem in ((model, data, "not a reward model"),
                                     (None, mixed, f"{mixed}:2: a completion in a file of pairs")):
        if folder is None:  # a reward model's folder without weights: the records are read first
            folder = tmp_path / "rm"
            folder.mkdir()
            for f in model.iterdir():
                if f.suffix != ".safetensors":
                    (folder / f.name).write_bytes(f.read_bytes())
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(dict(config, architectures=["LlamaForSequenceClassification"])))
        with pytest.raises(SystemExit) as e:
            score.main(["--model_name_or_path", str(folder), "--dataset", str(dataset)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and problem in err and len(err.strip().splitlines()) == 1, err


def test_plan_counts_the_score_head(tmp_path):
    from finetune.plan import planner as plan

    folder = tmp_path / "tiny"
    folder.mkdir()
    shape = dict(vocab_size=32000, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(shape))
    base = ["--model_name_or_path", str(folder), "--accelerator", "cpu", "--host_memory", "64GB",
            "--max_seq_length", "128", "--per_device_train_batch_size", "2"]
    simpo = plan.make_plan(base + ["--method", "simpo"])
    rm = plan.make_plan(base + ["--method", "reward"])
    assert "score head of 1 output" in rm["job"]["method"]
    # The LM head (vocab x hidden) is gone, a score head (1 x hidden) in its place; no vocabulary logits.
    assert rm["model"]["parameters"] == simpo["model"]["parameters"] - 32000 * 64 + 64
    assert rm["per_device_total"] < simpo["per_device_total"]
    # LoRA: the score head trains whole beside the adapters (peft's modules_to_save).
    lora = ["--use_peft", "--lora_r", "4"]
    assert (plan.make_plan(base + lora + ["--method", "reward"])["model"]["trainable_parameters"]
            == plan.make_plan(base + lora + ["--method", "simpo"])["model"]["trainable_parameters"] + 64)


# ----------------------------------------------------------------------------------------------
# Slow: 2 processes against 1, per step (8 pairs, global batch 4: 2 steps per epoch, 4 steps).

MORE_PAIRS = PAIRS + [
    {"prompt": "copy: blue dog", "chosen": "blue dog", "rejected": "dog blue", "margin": 0.25},
    {"prompt": "reverse: a b c", "chosen": "c b a", "rejected": "a b c"},
    {"prompt": "2+3?", "chosen": "5", "rejected": "6"},
    {"prompt": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "colour of snow?"}],
     "chosen": "white", "rejected": "Snow is usually white, I believe."},
]
# (path, preset, flags): the Trainer path under ZeRO-2 and ZeRO-3 (full, and LoRA with its score head under ZeRO-3),
# the loop under ZeRO-3. (LoRA without dropout: one process and two draw different dropout masks.)
PARITY = [("trainer", "zero2", ()), ("trainer", "zero3", ()), ("loop", "zero3", ()),
          ("trainer", "zero3", ("--use_peft", "--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "0.005"))]
# CI's cover: LoRA with its score head under ZeRO-3 on the Trainer (the loop runs the method seam the same way for
# DPO, GRPO and KTO in CI; this loop cell with FINETUNE_FULL_MATRIX=1, with the other two).
PARITY_CASES = matrix(PARITY, [PARITY[3]])


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    from finetune.models import tiny

    root = tmp_path_factory.mktemp("reward-multi")
    model = tiny.build(root / "model", style="chatml")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in MORE_PAIRS))
    return root, model, data


@pytest.mark.slow
@pytest.mark.parametrize("path, preset, flags", PARITY_CASES, ids=[f"{p}-{c}-{len(f) and 'lora' or 'full'}"
                                                                  for p, c, f in PARITY_CASES])
def test_two_processes_equal_one(multi, path, preset, flags):
    from concurrent.futures import ThreadPoolExecutor

    from tests.launch import LOOP, TRAIN, launcher, run, unexpected_warnings

    root, model, data = multi
    script = {"trainer": TRAIN, "loop": LOOP}[path]
    name = f"{path}-{preset}-{len(flags)}"

    def history(job: str, cmd: list[str], micro: int) -> list[dict]:
        out = root / f"{name}-{job}"
        result = run(cmd + ["--config", preset, "--method", "reward", "--model_name_or_path", str(model), "--dataset",
                            str(data), "--output_dir", str(out), "--dataset_cache_dir", str(root / "cache"),
                            "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", "2",
                            "--max_steps", "4", "--lr_scheduler_type", "constant",
                            *(() if "--learning_rate" in flags else ("--learning_rate", "0.001")),
                            "--center_rewards_coefficient", "0.01", "--seed", "3", "--disable_tqdm", "true", *flags],
                     timeout=600).check()
        assert not unexpected_warnings(result.output), unexpected_warnings(result.output)
        return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]

    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(history, "1", [sys.executable, script], 2)
        two = pool.submit(history, "2", launcher("accelerate", 2, script=script), 1)
        one, two = one.result(), two.result()
    assert [e["step"] for e in two] == [e["step"] for e in one] == [1, 2, 3, 4]
    assert one[-1]["loss"] < one[0]["loss"]
    keys = ("loss", "grad_norm", *reward.METRICS)
    for a, b in zip(one, two):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), (k, one, two)
    diff = max(abs(a[k] - b[k]) for a, b in zip(one, two) for k in keys)
    curve = lambda logs: " ".join(f"{e['loss']:.6f}" for e in logs)  # noqa: E731
    print(f"\nreward parity | {path} | {preset} | {' '.join(flags[:1]) or 'full'} | 1 process: {curve(one)} | "
          f"2 processes: {curve(two)} | max diff (loss, grad norm, metrics) {diff:.1e}")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("fam", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_family_loads_with_its_score_head_as_the_plan_counts(fam, tied, tmp_path, one_thread):
    """load_model(task="SEQ_CLS") on a causal-LM folder of each family: the LM head dropped, a score head of one output
    drawn from the seed; its parameters (full, and LoRA's trainable ones with the head) are what `finetune plan
    --method reward` counts."""
    from finetune.config import ModelConfig
    from finetune.models.load import load_model
    from finetune.plan import planner as plan
    from tests.test_families_qwen_mistral import FAMILIES, tiny_config

    folder = tmp_path / fam
    tokenizer = tiny.build_tokenizer(folder, style="chatml")
    if fam == "llama":
        tiny.build_model(folder, tokenizer, tied=tied)
    else:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_config(tiny_config(FAMILIES[fam], len(tokenizer), tied)).save_pretrained(folder)
    base = ["--model_name_or_path", str(folder), "--accelerator", "cpu", "--host_memory", "64GB",
            "--max_seq_length", "64", "--per_device_train_batch_size", "1", "--method", "reward"]
    counted = {}
    for lora in (False, True):
        flags = ["--use_peft", "--lora_r", "4"] if lora else []
        model = load_model(ModelConfig(model_name_or_path=str(folder), torch_dtype="float32", **(
            dict(use_peft=True, lora_r=4) if lora else {})), task="SEQ_CLS")
        assert type(model.get_base_model() if lora else model).__name__.endswith("ForSequenceClassification")
        p = plan.make_plan(base + flags)["model"]
        if lora:
            trainable = {n: q.numel() for n, q in model.named_parameters() if q.requires_grad}
            assert any("score" in n for n in trainable)
            assert p["trainable_parameters"] == sum(trainable.values())
        else:
            assert p["parameters"] == sum(q.numel() for q in model.parameters())
            assert model.score.weight.shape == (1, 64)
            counted = p
    print(f"\n{fam} ({'tied' if tied else 'untied'}): {counted['parameters']:,} parameters with the score head, as "
          "planned")


def test_gguf_export_refuses_a_reward_model(job, tmp_path, capsys, one_thread):
    """Loaded as a causal LM its head would be drawn at random and written: refused by name, nothing written."""
    from transformers import AutoModelForSequenceClassification

    from finetune.convert import export

    _, model_dir, _ = job
    folder = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, pad_token_id=0).save_pretrained(folder)
    tokenizer_of(model_dir).save_pretrained(folder)
    with pytest.raises(SystemExit) as e:
        export.main(["--model_name_or_path", str(folder), "--to", "gguf", "--output_dir", str(tmp_path / "rm.gguf")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "a SequenceClassification model (a reward model's score head) cannot be written as GGUF" in err
    assert not (tmp_path / "rm.gguf").exists()
