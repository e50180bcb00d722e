"""finetune.methods.kto and finetune.data.unpaired: one batch's loss, KL reference point, rewards and gradients against
TRL 1.16's KTOTrainer on the same batch; the records' checks; `finetune train` and `finetune loop` per step; the
planner; resume; 2 processes against 1 (slow)."""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from finetune.data import unpaired as U
from finetune.methods import kto
from finetune.methods.base import Context
from tests.launch import matrix

PLAIN = [
    {"prompt": "copy: red cat", "completion": "red cat", "label": True},
    {"prompt": "copy: red cat", "completion": "cat red", "label": False},
    {"prompt": "count: one two three", "completion": "3", "label": True},
    {"prompt": "count: one two three", "completion": "three, I think", "label": False},
    {"prompt": "capital of France?", "completion": "Paris", "label": True},
]


def features(tokenizer, records, max_len=512):
    out = []
    for i, r in enumerate(records):
        (p, c, cl, label), _ = U.example_features(tokenizer, r, f"test:{i}", max_len)
        out.append({"prompt_ids": p, "completion_ids": c, "completion_labels": cl, "label": label,
                    "example_index": i})
    return out


class Rows:
    """A data set of `features` rows, indexable as datasets.Dataset is."""

    def __init__(self, rows):
        self.rows = rows

    def __getitem__(self, i):
        return self.rows[i]

    def __len__(self):
        return len(self.rows)


def session(model, rows, *, use_peft=False, max_len=512, pad=0, **options):
    """A KTO session on one process (CPU), its reference a frozen copy of `model` as it is now."""
    cfg = SimpleNamespace(model=SimpleNamespace(use_peft=use_peft), data=SimpleNamespace(max_seq_length=max_len))
    context = Context(cfg, torch.device("cpu"), lambda: model)
    opts = kto.KTOConfig(method="kto", **options)
    from finetune.methods.base import Examples

    collate = U.UnpairedCollator(pad)
    return kto.KTO().setup(opts, model, SimpleNamespace(pad_token_id=pad), [Examples(Rows(rows)), None], collate,
                           context), collate


def perturbed(model, seed, scale=0.05):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


OPTIONS = [dict(beta=0.1, desirable_weight=1.0, undesirable_weight=1.0),
           dict(beta=0.7, desirable_weight=1.33, undesirable_weight=0.6)]


def flatter(model):
    """The policy's next-token distributions flattened (its head scaled down): on these completions its log-probs
    rise above the reference's, so the KL point is positive, not the clamp's 0."""
    with torch.no_grad():
        model.lm_head.weight.mul_(0.1)
    return model


MOVES = {"noise": lambda model: perturbed(model, 2, 0.08), "flatter": flatter}
CASES = [(OPTIONS[0], "noise"), (OPTIONS[1], "noise"), (OPTIONS[1], "flatter")]


@pytest.mark.parametrize("options, move", CASES, ids=["default", "weighted", "weighted-kl-positive"])
def test_equal_to_trl(tiny_plain, tmp_path, one_thread, isolated, options, move):
    """TRL's KTOTrainer on its own tokens and collator (which on these plain-text records are ours: TRL joins prompt and
    completion before tokenizing, a difference on purpose that other tokenizers may show), its KL rows its batch's
    completions rotated by one, as ours are for a global batch in data-set order: the loss, the KL reference point
    (before and after its clamp at 0), the rewards and logps logged, and the gradients equal within 1e-5."""
    pytest.importorskip("trl")
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(tiny_plain)))
    base = perturbed(AutoModelForCausalLM.from_pretrained(tiny_plain, dtype=torch.float32), 1)
    model = copy.deepcopy(base)
    n = len(PLAIN)
    ours, collate = session(model, features(tokenizer, PLAIN), pad=tokenizer.pad_token_id, **options)  # its reference: a copy of `base`
    # fp32 throughout: KTOConfig turns bf16 on by default, and accelerate then wraps the reference in autocast.
    args = KTOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, per_device_train_batch_size=n,
                     **options)
    trainer = KTOTrainer(model=model, ref_model=copy.deepcopy(base), args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list(PLAIN))
    MOVES[move](model)  # the policy moves away from the reference (both frozen copies of `base`)

    feats = features(tokenizer, PLAIN)
    tokenized = [trainer.train_dataset[i] for i in range(n)]
    for i, (o, t) in enumerate(zip(feats, tokenized)):  # TRL's tokens are ours, and so are its KL rows' completions
        assert t["prompt_ids"] == o["prompt_ids"] and t["completion_ids"] == o["completion_ids"] == o["completion_labels"]
        assert t["KL_completion_ids"] == feats[kto.rotated(list(range(n)))[i]]["completion_ids"]
    trl_inputs = trainer.data_collator(tokenized)
    batch = collate(feats)
    kl_rows = ours.kl_rows(Rows(feats), list(range(n)), list(range(n)))
    for mine, theirs in ((batch, ""), (kl_rows, "KL_")):
        assert torch.equal(mine["input_ids"], trl_inputs[f"{theirs}input_ids"])
        assert torch.equal(mine["attention_mask"], trl_inputs[f"{theirs}attention_mask"])
        assert torch.equal(mine["labels"] != -100, trl_inputs[f"{theirs}completion_mask"][:, :] == 1)

    # TRL's KL point before its clamp: its own KL log-probs under policy and reference.
    with torch.no_grad():
        trl_raw = (trainer._compute_kl_logps(model, trl_inputs)
                   - trainer._compute_kl_logps(trainer.ref_model, trl_inputs)).mean().item()
    model.zero_grad()
    model.train()
    theirs = trainer._compute_loss(model, trl_inputs, return_outputs=False)
    theirs.backward()
    want = grads(model)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    model.zero_grad()
    sums = ours.kl_sums(Rows(feats), [list(range(n))], list(range(n)))
    raw = (sums[0] / sums[1]).item()
    ours.step_start([batch])
    got = ours.loss(model, batch, n)
    got.backward()
    mine = ours.metrics()
    grad_diff = max((p.grad - want[k]).abs().max().item() for k, p in model.named_parameters())
    print(f"\nKTO {options}: ours {got.item():.8f} TRL {theirs.item():.8f} diff {abs(got.item() - theirs.item()):.1e} | "
          f"KL point before clamp ours {raw:.8f} TRL {trl_raw:.8f} | kl ours {mine['kl']:.8f} TRL {logged['kl']:.8f} | "
          f"max grad diff {grad_diff:.1e}")
    assert abs(got.item() - theirs.item()) < 1e-5
    assert abs(raw - trl_raw) < 1e-5 and mine["kl"] == pytest.approx(logged["kl"], abs=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert mine[key] == pytest.approx(logged[key], abs=1e-5), (key, mine, logged)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], atol=1e-5, rtol=1e-5)
    assert abs(mine["rewards/margins"]) > 1e-3  # the policy is not the reference: the comparison has teeth
    assert (mine["kl"] > 0.1) == (move == "flatter")  # and the KL point is positive where it should be


def test_kl_point_positive_and_clamped(tiny_plain, one_thread):
    """z0 is the mean of the KL rows' log-ratios when positive, 0 otherwise (KTO's max(0, ·)), and the loss moves
    with it: a desirable example's loss grows with z0, an undesirable one's falls."""
    logps, ref = torch.tensor([-3.0, -5.0]), torch.tensor([-3.5, -4.0])
    label = torch.tensor([True, False])
    low, _ = kto.kto_loss(logps, ref, label, 0.0, 0.5, 1.0, 1.0)
    high, _ = kto.kto_loss(logps, ref, label, 2.0, 0.5, 1.0, 1.0)
    assert high[0] > low[0] and high[1] < low[1]
    assert low[0].item() == pytest.approx(1 - torch.sigmoid(torch.tensor(0.5 * 0.5)).item())
    assert low[1].item() == pytest.approx(1 - torch.sigmoid(torch.tensor(0.5 * 1.0)).item())
    assert kto.rotated([7, 3, 5]) == {3: 7, 5: 3, 7: 5}


@pytest.mark.parametrize("splits", [[[0, 1, 2, 3]], [[0, 1], [2, 3]], [[2, 0], [3, 1]]])
def test_kl_point_does_not_depend_on_the_split(tiny_plain, one_thread, splits):
    """The same global batch cut into micro-batches differently (or dealt out in another order): the same z0 and
    the same sum of per-micro-batch losses."""
    from transformers import AutoModelForCausalLM

    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(tiny_plain)))
    model = perturbed(AutoModelForCausalLM.from_pretrained(tiny_plain, dtype=torch.float32), 1)
    feats = features(tokenizer, PLAIN[:4])
    s, collate = session(model, feats, beta=0.5)
    flatter(model)
    batches = [collate([feats[i] for i in chunk]) for chunk in splits]
    s.step_start(batches)
    total = sum(s.loss(model, b, 4).item() for b in batches)
    s.step_start([collate(feats)])
    whole = s.loss(model, collate(feats), 4).item()
    assert total == pytest.approx(whole, abs=1e-6)
    assert s.z0 > 0  # this policy's KL rows have a positive mean log-ratio: the point is not the clamp's 0


# ----------------------------------------------------------------------------------------------
# Records: the forms, and bad data named by file and line.

CHAT = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "capital of France?"}],
        "completion": [{"role": "assistant", "content": "Paris"}], "label": True}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def data_cfg(path, cache, **kw):
    from finetune.config import DataConfig

    return DataConfig(dataset=str(path) if not isinstance(path, list) else [str(p) for p in path],
                      dataset_cache_dir=str(cache), dataset_num_proc=1, **kw)


def tok(folder):
    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    return load_tokenizer(ModelConfig(model_name_or_path=str(folder)))


def test_forms_tokenize_as_preference_pairs(tiny_chatml, tmp_path):
    """A string record and its conversational form give the same tokens, and they are a preference pair's: the
    prompt rendered with the generation prompt, the completion's trained tokens the SFT masks'."""
    from finetune.data import preference as PR

    t = tok(tiny_chatml)
    as_text = {"prompt": "capital of France?", "completion": "Paris", "label": False}
    as_chat = {"prompt": [{"role": "user", "content": "capital of France?"}],
               "completion": {"role": "assistant", "content": "Paris"}, "label": False}
    a, b = U.tokenize_example(t, as_text), U.tokenize_example(t, as_chat)
    p, c, cl, _, _ = PR.tokenize_pair(t, {"prompt": "capital of France?", "chosen": "Paris", "rejected": "Lyon"})
    assert a == b == (p, c, cl, False)
    ds, stats, key = U.prepare_unpaired(data_cfg(write_jsonl(tmp_path / "c.jsonl", [CHAT, CHAT | {"label": False}]),
                                                 tmp_path / "cache"), t, log=lambda *a: None)
    assert key.startswith("unpaired1-") and (stats.desirable, stats.undesirable) == (1, 1) and ds["label"] == [True, False]


@pytest.mark.parametrize("record, message", [
    ({"prompt": "p", "completion": "a"}, "x.jsonl:3: missing field 'label'"),
    ({"prompt": "p", "completion": "a", "label": "yes"}, "x.jsonl:3: field 'label' must be true or false, got 'yes'"),
    ({"prompt": "p", "completion": "  ", "label": True}, "x.jsonl:3: field 'completion' is empty: an empty completion"),
    ({"prompt": [{"role": "user", "content": "p"}], "completion": [], "label": True},
     "x.jsonl:3: field 'completion' is empty: an empty completion"),
    ({"prompt": [{"role": "user", "content": "p"}], "completion": {"role": "assistant", "content": " "}, "label": True},
     "x.jsonl:3: 'completion' is empty: an empty completion (no assistant content)"),
    ({"prompt": "p", "completion": {"role": "assistant", "content": "a"}, "label": True},
     "x.jsonl:3: a conversational record in a file whose first record is text"),
    ({"prompt": [{"role": "user", "content": "p"}], "completion": "a", "label": True},
     "x.jsonl:3: a text record in a file whose first record is conversational"),
    ({"prompt": "p", "chosen": "a", "rejected": "b"}, "x.jsonl:3: missing field 'completion'"),
])
def test_bad_records_name_file_and_line(tiny_chatml, tmp_path, record, message):
    from finetune.data.prepare import DataError

    first = [CHAT, CHAT] if isinstance(record["prompt"], list) else [PLAIN[0], PLAIN[1]]
    path = write_jsonl(tmp_path / "x.jsonl", [*first, record])
    with pytest.raises(DataError) as e:
        U.prepare_unpaired(data_cfg(path, tmp_path / "cache"), tok(tiny_chatml), log=lambda *a: None)
    assert str(e.value).startswith(f"{tmp_path}/{message}"), str(e.value)


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "p", "completion": "a"}, "missing field 'label'"),
    ({"prompt": "p", "completion": "", "label": False}, "field 'completion' is empty"),
    (CHAT, "a conversational record in a file whose first record is text"),
])
def test_bad_data_exits_2_before_the_model_loads(tmp_path, bad, message):
    """`finetune train --method kto` on a bad record: one line naming the file and line, exit 2, no model loaded."""
    import subprocess

    from finetune.models import tiny as T

    model = T.build(tmp_path / "model", style="chatml")
    data = write_jsonl(tmp_path / "bad.jsonl", [PLAIN[0], bad])
    r = subprocess.run([sys.executable, "-m", "finetune", "train", "--method", "kto", "--model_name_or_path", str(model),
                        "--dataset", str(data), "--output_dir", str(tmp_path / "out"), "--dataset_cache_dir",
                        str(tmp_path / "cache")], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    errors = [line for line in r.stderr.splitlines() if line.startswith("finetune:")]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(errors) == 1 and f"{data}:2: {message}" in errors[0], r.stderr[-2000:]
    assert "Loading weights" not in r.stdout + r.stderr and not (tmp_path / "out").exists()


def test_collator_rows_and_labels():
    f = [{"prompt_ids": [1, 2], "completion_ids": [3, 4], "completion_labels": [3, 4], "label": True, "example_index": 5},
         {"prompt_ids": [1], "completion_ids": [6], "completion_labels": [-100], "label": False, "example_index": 2}]
    b = U.UnpairedCollator(0)(f)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4], [1, 6, 0, 0]]
    assert b["labels"].tolist() == [[-100, -100, 3, 4], [-100, -100, -100, -100]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b["label"].tolist() == [True, False] and b["example_index"].tolist() == [5, 2]


# ----------------------------------------------------------------------------------------------
# `finetune train` (the HF Trainer path) and `finetune loop`, per step.

EXAMPLES = PLAIN[:4] + [
    {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}],
     "label": True},
    {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "five"}],
     "label": False},
    {"prompt": "name a color", "completion": "blue", "label": True},
    {"prompt": "name a color", "completion": "the number seven", "label": False},
]
LR, STEPS = 0.1, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from finetune.models import tiny as T

    root = tmp_path_factory.mktemp("kto")
    model = T.build(root / "model", style="chatml")
    text = write_jsonl(root / "text.jsonl", EXAMPLES[:4] + EXAMPLES[6:])
    chat = write_jsonl(root / "chat.jsonl", EXAMPLES[4:6])
    return root, model, text, chat


def train(job, name: str, *flags: str, path: str = "trainer", entries: str = "loss", data=None) -> list[dict]:
    """One process: 4 examples = the global batch (2 per micro-batch x 2 accumulation), SGD, constant learning rate."""
    from finetune.training import loop, trainer

    root, model, text, _ = job
    out = root / name
    {"trainer": trainer.main, "loop": loop.main}[path](
        ["--method", "kto", "--model_name_or_path", str(model), *(data or ["--dataset", str(text)]),
         "--output_dir", str(out), "--dataset_cache_dir", str(root / "cache"), "--per_device_train_batch_size", "2",
         "--gradient_accumulation_steps", "2", "--optim", "sgd", "--learning_rate", str(LR),
         "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--weight_decay", "0", "--seed", "3",
         "--beta", "0.5", "--desirable_weight", "1.2", *flags])
    return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if entries in e]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trainer_and_loop_equal_per_step(job, isolated, one_thread, lora):
    flags = ("--max_steps", str(STEPS)) + (("--use_peft", "--lora_r", "4", "--lora_dropout", "0") if lora else ())
    name = "lora" if lora else "full"
    want = train(job, f"{name}-trainer", *flags)
    got = train(job, f"{name}-loop", *flags, path="loop")
    a, b = [e["loss"] for e in want], [e["loss"] for e in got]
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(f"\nKTO {name}: trainer {a} | loop {b} | max relative diff {rel:.1e}")
    assert [e["step"] for e in want] == [e["step"] for e in got] == [1, 2, 3]
    assert rel < 1e-5
    # Step 1: the policy is the reference (LoRA's B is zero; the frozen copy is the model as loaded): every
    # log-ratio is 0, z0 is 0, and each example's loss is its weight x (1 - sigmoid(0)): with k desirable examples
    # of the 4, (1.2 x 0.5 x k + 0.5 x (4 - k)) / 4.
    k = (4 * a[0] - 2) / 0.1
    assert abs(k - round(k)) < 1e-4 and 0 < round(k) < 4, a[0]
    for g, w in zip(got, want):
        for k in kto.METRICS:
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-6), (k, g, w)
    assert want[-1]["rewards/margins"] > 0  # desirable completions gain on undesirable ones


def test_evaluation_on_both_paths(job, isolated, one_thread):
    flags = ("--eval_split_size", "3", "--per_device_eval_batch_size", "2", "--eval_steps", "2", "--max_steps", "2")
    want = train(job, "trainer-eval", *flags, entries="eval_loss")
    got = train(job, "loop-eval", *flags, path="loop", entries="eval_loss")
    assert [e["step"] for e in got] == [e["step"] for e in want] == [2]
    for k in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_kl", "eval_samples"):
        assert got[0][k] == pytest.approx(want[0][k], rel=1e-5, abs=1e-6), (k, got, want)
    assert want[0]["eval_samples"] == 3


def test_mixed_files_train(job, isolated, one_thread):
    """A plain-text file and a conversational one, mixed by weight: the log names the shares, and it trains."""
    root, _, text, chat = job
    logs = train(job, "mixed", "--max_steps", "3", data=["--dataset", str(text), "--dataset", str(chat),
                                                         "--dataset_weights", "0.75", "0.25"])
    assert len(logs) == 3 and logs[-1]["loss"] < logs[0]["loss"]


@pytest.mark.parametrize("path", ["trainer", "loop"])
def test_resume_gives_the_same_losses(job, isolated, one_thread, path):
    """The run's own mid-epoch checkpoint (step 3 of 4) resumed in a new folder: the same steps and metrics (the
    KL rows of each step are made from its batch, so nothing of them is in the checkpoint)."""
    import shutil

    root = job[0]
    name = f"resume-{path}"
    common = ("--max_steps", "4", "--save_steps", "3", "--gradient_accumulation_steps", "1")
    whole = train(job, name, *common, path=path)
    shutil.copytree(root / name / "checkpoint-3", root / f"{name}-resumed" / "checkpoint-3")
    resumed = train(job, f"{name}-resumed", *common, "--resume_from_checkpoint", "latest", path=path)
    assert [e["step"] for e in whole] == [e["step"] for e in resumed] == [1, 2, 3, 4]
    diff = max(abs(r[k] - w[k]) for w, r in zip(whole, resumed) for k in ("loss", "grad_norm", *kto.METRICS))
    print(f"\nKTO resume {path}: max diff {diff:.1e}")
    assert diff <= 1e-6, (whole, resumed)


@pytest.mark.parametrize("flags, problem", [
    (["--desirable_weight", "2"], "desirable_weight: a KTO option; add --method kto"),
    (["--method", "kto", "--beta", "0"], "beta: must be positive, got 0.0"),
    (["--method", "kto", "--undesirable_weight", "-1"], "undesirable_weight: must be positive, got -1.0"),
    (["--method", "kto", "--packing"], "packing: not supported with --method kto yet"),
])
def test_config_problems(job, flags, problem):
    from finetune import config as C

    root, model, data, _ = job
    with pytest.raises(C.ConfigError) as e:
        C.parse(["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(root / "o"), *flags])
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


def test_engine_path_refuses_by_name():
    from finetune.config.preset import Preset
    from finetune.training import core

    cfg = SimpleNamespace(training=SimpleNamespace(), sources={}, preset=Preset.named("ddp"),
                          objective=kto.KTOConfig(method="kto"))
    assert core.refused_flags(cfg, "scripts/sft.py") == ["method kto: not supported by scripts/sft.py "
                                                         "(finetune/train.py supports it)"]
    assert core.refused_flags(cfg, "finetune/loop.py") == core.refused_flags(cfg, "finetune/train.py") == []


def test_plan_counts_the_reference(tmp_path):
    """Full fine-tuning holds a frozen copy (DPO's, as much memory); LoRA none; the KL row is counted as a second
    row per example (DPO's pair: an upper bound, as it is scored without gradients)."""
    from finetune.plan import planner as plan

    folder = tmp_path / "tiny"
    folder.mkdir()
    shape = dict(vocab_size=301, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(shape))
    base = ["--model_name_or_path", str(folder), "--accelerator", "cpu", "--host_memory", "64GB",
            "--max_seq_length", "128", "--per_device_train_batch_size", "2"]
    full = plan.make_plan(base + ["--method", "kto"])
    params = full["model"]["parameters"]
    assert full["per_device"]["reference model"] == 4 * params  # fp32 on CPU: the whole model again
    assert full["per_device_total"] == plan.make_plan(base + ["--method", "dpo"])["per_device_total"]
    assert "KTO: 1 row per example plus its KL row" in full["job"]["method"]
    lora = plan.make_plan(base + ["--method", "kto", "--use_peft"])
    assert "reference model" not in lora["per_device"] and "adapters disabled (no copy)" in lora["job"]["method"]
    sft = plan.make_plan(base + ["--per_device_train_batch_size", "4", "--loss_chunk_size", "0"])
    assert full["activations_detail"]["decoder layers"] == sft["activations_detail"]["decoder layers"]


# ----------------------------------------------------------------------------------------------
# 2 processes against 1 (each a real job on loopback).

PARITY = [("trainer", "zero2"), ("trainer", "zero3"), ("loop", "ddp"), ("loop", "zero3")]
# CI's cover: the partitioned frozen reference (ZeRO-3) on the Trainer, with its all-reduced KL term; the loop's
# preference step is DPO's and GRPO's in CI; all four with FINETUNE_FULL_MATRIX=1.
PARITY_CASES = matrix(PARITY, [("trainer", "zero3")])


@pytest.mark.slow
@pytest.mark.parametrize("path, preset", PARITY_CASES, ids=[f"{p}-{c}" for p, c in PARITY_CASES])
def test_two_processes_equal_one(job, path, preset):
    """The same global batch of 4 (1 process: 2 per micro-batch x 2 accumulation; 2 processes: 1 x 2 each): the
    same KL point (made over the global batch, whatever its split), so the same loss, gradient norm and metrics
    per step within 1e-4. Full fine-tuning: the frozen reference is a copy (ZeRO-2) or partitioned (ZeRO-3)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.launch import LOOP, TRAIN, launcher, run

    root, model, text, _ = job
    script = {"trainer": TRAIN, "loop": LOOP}[path]

    def history(name, cmd, micro):
        out = root / name
        run(cmd + ["--config", preset, "--method", "kto", "--model_name_or_path", str(model), "--dataset", str(text),
                   "--output_dir", str(out), "--dataset_cache_dir", str(root / "cache"),
                   "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", "2",
                   "--max_steps", "3", "--lr_scheduler_type", "constant", "--learning_rate", "0.05", "--beta", "0.5",
                   "--seed", "3", "--disable_tqdm", "true"], timeout=600).check()
        return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]

    name = f"parity-{path}-{preset}"
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(history, f"{name}-1", [sys.executable, script], 2)
        two = pool.submit(history, f"{name}-2", launcher("accelerate", 2, script=script), 1)
        one, two = one.result(), two.result()
    assert [e["step"] for e in one] == [e["step"] for e in two] == [1, 2, 3]
    keys = ("loss", "grad_norm", *kto.METRICS)
    diff = max(abs(a[k] - b[k]) for a, b in zip(one, two) for k in keys)
    print(f"\nKTO parity | {path} | {preset} | 1 process: {[round(e['loss'], 6) for e in one]} | 2 processes: "
          f"{[round(e['loss'], 6) for e in two]} | kl {[round(e['kl'], 6) for e in one]} | max diff {diff:.1e}")
    for a, b in zip(one, two):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), (k, one, two)


# ----------------------------------------------------------------------------------------------
# finetune quickstart --method kto


@pytest.mark.slow
@pytest.mark.full_matrix  # CI: the quickstart's preference stage as --method dpo (test_quickstart.py)
def test_quickstart_kto_on_a_tiny_model(tiny_chatml, tmp_path, one_thread):
    """`quickstart --method kto` after a LoRA SFT (a random adapter on a tiny model): the bundled pairs split into
    2 unpaired examples each (chosen: label true, rejected: false), KTO trains a new adapter whose reference is the
    merged SFT model (first loss 0.5: every log-ratio and z0 are 0), and the report's before/after holds preference
    accuracy as --method dpo's does."""
    import subprocess

    from finetune.apps.quickstart import DEFAULT_TRAIN_PAIRS
    from finetune.models import tiny as T

    data = DEFAULT_TRAIN_PAIRS.parent
    sft = T.save_random_adapter(tiny_chatml, tmp_path / "sft", r=4)
    lines = lambda name, n: "".join((data / name).read_text().splitlines(keepends=True)[:n])  # noqa: E731
    (tmp_path / "pairs.jsonl").write_text(lines("train_pairs.jsonl", 16))
    (tmp_path / "heldout.jsonl").write_text(lines("heldout.jsonl", 5))
    (tmp_path / "heldout_pairs.jsonl").write_text(lines("train_pairs.jsonl", 5))
    out = tmp_path / "kto"
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "quickstart", "--method", "kto", "--model_name_or_path", str(sft),
         "--train_file", str(tmp_path / "pairs.jsonl"), "--eval_file", str(tmp_path / "heldout.jsonl"),
         "--eval_pairs_file", str(tmp_path / "heldout_pairs.jsonl"), "--max_steps", "3", "--processes", "1",
         "--eval_threads", "1", "--max_new_tokens", "6", "--learning_rate", "0.05", "--output_dir", str(out)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    split = [json.loads(line) for line in (out / "train_unpaired.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert split[:2] == [{"prompt": pairs[0]["prompt"], "completion": pairs[0]["chosen"], "label": True},
                         {"prompt": pairs[0]["prompt"], "completion": pairs[0]["rejected"], "label": False}]
    assert len(split) == 32 and sum(r["label"] for r in split) == 16
    metrics = json.loads((out / "report" / "metrics.json").read_text())
    b, t, tr = metrics["base"], metrics["finetuned"], metrics["training"]
    assert metrics["stage"] == "kto" and metrics["labels"] == ["SFT model", "after KTO"]
    assert (tr["objective"], tr["beta"], tr["steps"]) == ("kto", 0.5, 3)
    assert tr["losses"][0] == pytest.approx(0.5, abs=1e-6)
    assert b["preference_pairs"] == t["preference_pairs"] == 5
    assert f"quickstart kto: preference accuracy {b['preference_accuracy']:.1%} -> {t['preference_accuracy']:.1%}" in proc.stdout


def test_conversational_tokens_against_trl(tiny_chatml, tmp_path, one_thread, isolated):
    """Conversational records through TRL's KTOTrainer: the prompt's and the completion's tokens are ours; which of
    them are scored differs on purpose (TRL scores every token after the prompt, the end-of-turn's trailing newline
    included; here the SFT masks decide, and leave that newline out, measured below). On the same rows and scored
    tokens the per-example log-probabilities of our scoring (dpo.sequence_logps) equal TRL's within 1e-5."""
    pytest.importorskip("trl")
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    from finetune.methods import dpo

    tokenizer = tok(tiny_chatml)
    model = perturbed(AutoModelForCausalLM.from_pretrained(tiny_chatml, dtype=torch.float32), 3)
    records = [CHAT, EXAMPLES[4], EXAMPLES[5]]
    args = KTOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(records))
    trainer = KTOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list(records))
    differs = []
    for i, r in enumerate(records):
        t = trainer.train_dataset[i]
        p, c, cl, _ = U.tokenize_example(tokenizer, r)
        assert t["prompt_ids"] == p
        assert t["completion_ids"] == c
        differs.append([tokenizer.decode([x]) for x, lab in zip(c, cl) if lab == -100])
    print(f"\nthe completion tokens TRL scores and we do not, per record: {differs}")
    assert differs == [["\n"]] * len(records)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    with torch.no_grad():
        theirs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                       fused_lm_head=True).log_probs.sum(-1)
        mine = dpo.sequence_logps(model, {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
                                          "labels": labels})
    print(f"per-example log-probs on TRL's rows: ours {mine.tolist()} TRL {theirs.tolist()}")
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
