"""finetune.methods.simpo, .orpo and .cpo: one batch's loss and gradients against a float64 computation written here
and against TRL 1.16 (CPOTrainer with loss_type="simpo" for SimPO, and each of its loss types for CPO; ORPOTrainer);
`finetune train` and `finetune loop` per step."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from finetune.data import preference as PR
from finetune.methods import cpo, orpo, reference_free, simpo
from tests.launch import matrix
from tests.test_dpo import RECORDS, pair_features

SIMPO = simpo.SimPO()
ORPO = orpo.ORPO()
CPO = cpo.CPO()


def f64_logps(model, batch, mean: bool = True):
    """Plain torch in float64: every position's full log-softmax, then a loop over each row's scored tokens, summed
    (and averaged: `mean`)."""
    logp = torch.log_softmax(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double(),
                             dim=-1)
    labels = batch["labels"]
    out = []
    for i in range(labels.shape[0]):
        total, n = logp.new_zeros(()), 0
        for t in range(labels.shape[1] - 1):
            if labels[i, t + 1] != -100:
                total, n = total + logp[i, t, labels[i, t + 1]], n + 1
        out.append(total / n if mean else total)
    return torch.stack(out)


def f64_mean_logps(model, batch):
    return f64_logps(model, batch)


def f64_loss(method: str, model, batch, **options):
    """The mean over the batch's pairs, written from the papers' formulas (docs/preference.md)."""
    a, b = f64_mean_logps(model, batch).chunk(2)
    if method == "simpo":
        beta, gamma, eps = options["beta"], options["simpo_gamma"], options["label_smoothing"]
        z = beta * (a - b) - gamma
        return (-(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)).mean()
    if method == "cpo":  # TRL's CPOTrainer.cpo_loss, each loss type, on sums (means for ipo and simpo)
        beta, alpha, eps = options["beta"], options["cpo_alpha"], options.get("label_smoothing", 0.0)
        loss_type = options.get("loss_type", "sigmoid")
        x, y = (a, b) if loss_type in ("ipo", "simpo") else f64_logps(model, batch, mean=False).chunk(2)
        if loss_type == "hinge":
            term = torch.clamp(1 - beta * (x - y), min=0)
        elif loss_type == "ipo":
            term = (x - y - 1 / (2 * beta)) ** 2
        else:
            p = torch.sigmoid(beta * (x - y) - (options["simpo_gamma"] if loss_type == "simpo" else 0.0))
            term = (1 - eps) * -torch.log(p) + eps * -torch.log(1 - p)
        return (term - alpha * a).mean()
    beta = options["beta"]
    log_odds = (a - b) - (torch.log1p(-torch.exp(a)) - torch.log1p(-torch.exp(b)))
    return (-a - beta * F.logsigmoid(log_odds)).mean()


CASES = [("simpo", dict(beta=2.0, simpo_gamma=0.5, label_smoothing=0.0)),
         ("simpo", dict(beta=1.3, simpo_gamma=0.2, label_smoothing=0.15)),
         ("orpo", dict(beta=0.1)), ("orpo", dict(beta=0.7)),
         ("cpo", dict(beta=0.1, cpo_alpha=1.0, label_smoothing=0.0)),
         ("cpo", dict(beta=0.5, cpo_alpha=0.3, label_smoothing=0.1)),
         # CPO's other loss types (TRL's CPOConfig.loss_type); simpo with α > 0 is CPO-SimPO.
         # β 0.05: on test_equal_to_trl's batch one pair inside the hinge (1 - β d = 1.03), one past it (-0.82).
         ("cpo", dict(beta=0.05, cpo_alpha=1.0, loss_type="hinge")),
         ("cpo", dict(beta=0.4, cpo_alpha=0.5, loss_type="ipo")),
         ("cpo", dict(beta=2.0, cpo_alpha=1.0, loss_type="simpo", simpo_gamma=0.3, label_smoothing=0.1))]
IDS = [f"{n}-{o.get('loss_type', '')}{'-' if 'loss_type' in o else ''}{o['beta']}" for n, o in CASES]
METHOD = {"simpo": (SIMPO, simpo.SimPOConfig), "orpo": (ORPO, orpo.ORPOConfig), "cpo": (CPO, cpo.CPOConfig)}


def ours(name, model, batch, n_pairs, window=None, **options):
    method, config = METHOD[name]
    return reference_free.micro_batch_loss(method, config(method=name, **options), model, batch, n_pairs, window)


@pytest.fixture(scope="module")
def tiny(tiny_chatml, one_thread):
    from transformers import AutoModelForCausalLM

    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(tiny_chatml)))
    model = AutoModelForCausalLM.from_pretrained(tiny_chatml, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():  # away from the tiny model's near-uniform start, so the pairs' terms differ
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return tokenizer, model


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name, options", CASES, ids=IDS)
def test_loss_and_gradients_equal_float64(tiny, name, options):
    import copy

    tokenizer, model = tiny
    batch = PR.PairCollator(tokenizer.pad_token_id)(pair_features(tokenizer, RECORDS))
    model64 = copy.deepcopy(model).double()
    model64.zero_grad()
    expected = f64_loss(name, model64, batch, **options)
    expected.backward()
    want = grads(model64)
    model.zero_grad()
    window = reference_free.Window(METHOD[name][0].metrics)
    got = ours(name, model, batch, 3, window, **options)
    got.backward()
    assert abs(got.item() - expected.item()) < 1e-5 * max(1.0, abs(expected.item())), (got.item(), expected.item())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), want[n], atol=1e-5, rtol=1e-4)
    logged = window.pop()
    assert logged["rewards/margins"] == pytest.approx(logged["rewards/chosen"] - logged["rewards/rejected"])
    assert logged["rewards/chosen"] == pytest.approx(options["beta"] * logged["logps/chosen"])
    if name == "orpo":
        assert logged["nll_loss"] == pytest.approx(-logged["logps/chosen"])
    if name == "cpo" and options.get("loss_type") in ("ipo", "simpo"):  # the means: the NLL is -logps/chosen
        assert logged["nll_loss"] == pytest.approx(-logged["logps/chosen"])
    elif name == "cpo":  # TRL's CPO logs the sums: the rewards are β × them, the NLL the chosen tokens' mean
        assert logged["logps/chosen"] < -logged["nll_loss"] < 0


def test_cpo_simpo_without_nll_is_simpo(tiny):
    """--method cpo --loss_type simpo --cpo_alpha 0 is --method simpo (TRL's SimPO is its CPOTrainer so): the same
    loss, to the last bit, and the same logged rewards."""
    tokenizer, model = tiny
    batch = PR.PairCollator(tokenizer.pad_token_id)(pair_features(tokenizer, RECORDS))
    options = dict(beta=1.5, simpo_gamma=0.4, label_smoothing=0.1)
    windows = [reference_free.Window(m.metrics) for m in (SIMPO, CPO)]
    with torch.no_grad():
        want = ours("simpo", model, batch, 3, windows[0], **options)
        got = ours("cpo", model, batch, 3, windows[1], cpo_alpha=0.0, loss_type="simpo", **options)
    assert got.item() == want.item()
    simpo_logged, cpo_logged = (w.pop() for w in windows)
    assert {k: cpo_logged[k] for k in simpo_logged} == simpo_logged


def test_global_batch_normalization(tiny):
    """Pairs split over micro-batches (or ranks), each over the global pair count: the whole batch's gradient."""
    tokenizer, model = tiny
    features = pair_features(tokenizer, RECORDS)
    collate = PR.PairCollator(tokenizer.pad_token_id)
    for name, options in CASES[1:3] + CASES[5:]:
        model.zero_grad()
        whole = ours(name, model, collate(features), 3, **options)
        whole.backward()
        want = grads(model)
        model.zero_grad()
        parts = [ours(name, model, collate(f), 3, **options) for f in (features[:1], features[1:])]
        sum(parts).backward()
        assert abs(sum(p.item() for p in parts) - whole.item()) < 1e-6
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# TRL 1.16 on the same batches.


def trl_batch(batch):
    """Our pair batch (rows: chosen..., rejected...) in TRL's CPO/ORPO form: the same tokens, labels and padding."""
    n = batch["input_ids"].shape[0] // 2
    out = {}
    for side, rows in (("chosen", slice(0, n)), ("rejected", slice(n, None))):
        for key in ("input_ids", "attention_mask", "labels"):
            out[f"{side}_{key}"] = batch[key][rows]
    return out


def trl_trainer(name, model, tokenizer, tmp_path, records, options):
    import datasets

    dataset = datasets.Dataset.from_list(records)
    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=len(records))
    if name == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0, beta=options["beta"],
                         simpo_gamma=options["simpo_gamma"], label_smoothing=options["label_smoothing"])
        return CPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    if name == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(**common, beta=options["beta"], cpo_alpha=options["cpo_alpha"],
                         label_smoothing=options.get("label_smoothing", 0.0),
                         loss_type=options.get("loss_type", "sigmoid"),  # TRL's default
                         simpo_gamma=options.get("simpo_gamma", 0.5))
        return CPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    args = ORPOConfig(**common, beta=options["beta"])
    return ORPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


def trl_cpo_nll(model, batch):
    """TRL's CPO NLL (CPOTrainer.concatenated_forward): the chosen rows' cross-entropy over their completions, a token
    mean over the batch."""
    n = batch["input_ids"].shape[0] // 2
    logits = model(input_ids=batch["input_ids"][:n], attention_mask=batch["attention_mask"][:n]).logits
    labels = batch["labels"][:n]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def trl_nll(model, batch):
    """TRL's ORPO NLL (ORPOTrainer.concatenated_forward): the chosen rows' cross-entropy over every token, prompt
    included, a token mean over the batch."""
    n = batch["input_ids"].shape[0] // 2
    logits = model(input_ids=batch["input_ids"][:n], attention_mask=batch["attention_mask"][:n]).logits
    labels = torch.where(batch["attention_mask"][:n] == 1, batch["input_ids"][:n], -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


@pytest.mark.parametrize("name, options", CASES, ids=IDS)
def test_equal_to_trl(tiny_plain, tmp_path, one_thread, isolated, name, options):
    """TRL's trainer on its own tokens and collator, which on these records are ours (TRL tokenizes a string record
    by joining prompt and answer first, a difference on purpose that other tokenizers may show: docs/preference.md),
    so the loss functions meet on identical batches. The
    float64 computation decides: both within 1e-5 of it. ORPO's NLL differs on purpose (TRL's covers the prompt, a
    token mean over the micro-batch; ours the chosen completion, per pair), and so does CPO's (TRL's a token mean
    over the micro-batch's chosen completions; ours per pair): the preference term, the per-example log-probabilities
    and, with TRL's NLL put in ours, the loss and gradients equal TRL's."""
    pytest.importorskip("trl")
    import copy

    from transformers import AutoModelForCausalLM

    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(tiny_plain)))
    model = AutoModelForCausalLM.from_pretrained(tiny_plain, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    records = [r for r in RECORDS if isinstance(r["prompt"], str)]
    trainer = trl_trainer(name, model, tokenizer, tmp_path, records, options)
    features = pair_features(tokenizer, records)
    batch = PR.PairCollator(tokenizer.pad_token_id)(features)
    n = len(records)
    tokenized = [trainer.train_dataset[i] for i in range(n)]
    for o, t in zip(features, tokenized):  # on these records TRL's own tokens are ours, and so are the scored ones
        for side in ("chosen", "rejected"):
            assert t[f"{side}_input_ids"] == o["prompt_ids"] + o[f"{side}_ids"]
            assert [x for x in t[f"{side}_labels"] if x != -100] == o[f"{side}_labels"]
    trl_inputs = trainer.data_collator(tokenized)  # TRL's collator: our rows, padded to each side's longest
    for key, value in trl_batch(batch).items():
        side = key.split("_")[0]
        for i, length in enumerate(trl_inputs[f"{side}_attention_mask"].sum(1).tolist()):
            assert trl_inputs[key][i, :length].tolist() == value[i, :length].tolist(), key

    model.zero_grad()
    theirs, metrics = trainer.get_batch_loss_metrics(model, trl_inputs)
    theirs.backward()
    want = grads(model)
    model.zero_grad()
    window = reference_free.Window(METHOD[name][0].metrics)
    got = ours(name, model, batch, n, window, **options)
    # ORPO and CPO: our NLL (the chosen completions' per-pair mean, weighted 1 and α) swapped for TRL's.
    alpha = {"orpo": 1.0, "cpo": options.get("cpo_alpha", 0.0)}.get(name, 0.0)
    nll = {"orpo": trl_nll, "cpo": trl_cpo_nll}.get(name)
    extra = alpha * (nll(model, batch) + reference_free.mean_logps(model, batch)[:n].mean()) if nll else 0.0
    (got + extra).backward()
    model64 = copy.deepcopy(model).double()
    f64 = f64_loss(name, model64, batch, **options).item()
    if nll:
        f64 += alpha * (nll(model64, batch).item() + f64_mean_logps(model64, batch)[:n].mean().item())
    ours_total, trl_total = (got + extra).item(), theirs.item()
    grad_diff = max((p.grad - want[k]).abs().max().item() for k, p in model.named_parameters())
    print(f"\n{name} {options}: ours {ours_total:.8f} TRL {trl_total:.8f} float64 {f64:.8f} | ours-f64 "
          f"{abs(ours_total - f64):.1e} TRL-f64 {abs(trl_total - f64):.1e} ours-TRL {abs(ours_total - trl_total):.1e}"
          f" | max grad diff {grad_diff:.1e}" + (f" | {name} as defined here (per-pair completion NLL) "
                                                 f"{got.item():.8f}" if nll else ""))
    assert abs(ours_total - f64) < 1e-5 and abs(trl_total - f64) < 1e-5 and abs(ours_total - trl_total) < 1e-5
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], atol=1e-5, rtol=1e-5)
    logged = window.pop()
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected") + (("log_odds_ratio", "log_odds_chosen") if name == "orpo" else ()):
        if name == "cpo" and key != "rewards/accuracies":  # sums (and β × them): tens; or means for ipo and simpo
            assert logged[key] == pytest.approx(float(metrics[key]), rel=1e-5, abs=1e-5), key
            continue
        assert logged[key] == pytest.approx(float(metrics[key]), abs=1e-5), key


# ----------------------------------------------------------------------------------------------
# `finetune train` (the HF Trainer path) and `finetune loop`, per step.

PAIRS = [
    {"prompt": "copy: red cat", "chosen": "red cat", "rejected": "cat red"},
    {"prompt": "count: one two three", "chosen": "3", "rejected": "three, I think"},
    {"prompt": [{"role": "user", "content": "capital of France?"}], "chosen": "Paris", "rejected": "It is Lyon."},
    {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
     "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "five"}]},
]
LR, STEPS = 0.05, 3
FLAGS = {"simpo": ("--beta", "2.0", "--simpo_gamma", "0.5"), "orpo": ("--beta", "0.1"),
         "cpo": ("--beta", "0.1", "--cpo_alpha", "1.0")}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from finetune.models import tiny

    root = tmp_path_factory.mktemp("pref")
    model = tiny.build(root / "model", style="chatml")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return root, model, data


def train(job, name: str, method: str, *flags: str, path: str = "trainer", entries: str = "loss") -> list[dict]:
    """One process: 4 pairs = the global batch (2 per micro-batch x 2 accumulation), SGD, constant learning rate."""
    from finetune.training import loop, trainer

    root, model, data = job
    out = root / name
    {"trainer": trainer.main, "loop": loop.main}[path](
        ["--method", method, "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
         "--dataset_cache_dir", str(root / "cache"), "--per_device_train_batch_size", "2",
         "--gradient_accumulation_steps", "2", "--optim", "sgd", "--learning_rate", str(LR),
         "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--weight_decay", "0", "--seed", "3",
         *FLAGS[method], *flags])
    return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if entries in e]


def full_batch(model_dir):
    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    t = load_tokenizer(ModelConfig(model_name_or_path=str(model_dir)))
    return PR.PairCollator(t.pad_token_id)(pair_features(t, PAIRS))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("method", ["simpo", "orpo", "cpo"])
def test_trainer_and_loop_equal_per_step_and_float64(job, isolated, one_thread, method, lora):
    """Step 1 is the model as loaded (LoRA's B starts at zero): the float64 loss of the whole batch."""
    from transformers import AutoModelForCausalLM

    _, model_dir, _ = job
    flags = ("--max_steps", str(STEPS)) + (("--use_peft", "--lora_r", "4", "--lora_dropout", "0",
                                             "--learning_rate", "0.02") if lora else ())
    name = f"{method}-{'lora' if lora else 'full'}"
    want = train(job, f"{name}-trainer", method, *flags)
    got = train(job, f"{name}-loop", method, *flags, path="loop")
    model64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    opts = dict(zip([f.lstrip("-") for f in FLAGS[method][::2]], map(float, FLAGS[method][1::2])))
    opts.setdefault("label_smoothing", 0.0)
    with torch.no_grad():
        first = f64_loss(method, model64, full_batch(model_dir), **opts).item()
    if not lora:  # every step: the run written out in float64 (full-batch loss, p -= lr * grad)
        by_hand = []
        for _ in range(STEPS):
            model64.zero_grad()
            loss = f64_loss(method, model64, full_batch(model_dir), **opts)
            loss.backward()
            with torch.no_grad():
                for p in model64.parameters():
                    p -= LR * p.grad
            by_hand.append(loss.item())
        assert [e["loss"] for e in want] == pytest.approx(by_hand, rel=1e-5), ([e["loss"] for e in want], by_hand)
        print(f"\n{method}: by hand in float64 {by_hand}, max relative diff to the Trainer "
              f"{max(abs(e['loss'] - h) / abs(h) for e, h in zip(want, by_hand)):.1e}")
    a, b = [e["loss"] for e in want], [e["loss"] for e in got]
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(f"\n{name}: trainer {a} | loop {b} | max relative diff {rel:.1e} | step 1 float64 {first:.8f} "
          f"(trainer {abs(a[0] - first):.1e} off)")
    assert [e["step"] for e in want] == [e["step"] for e in got] == [1, 2, 3]
    assert rel < 1e-5, (a, b)
    assert a[0] == pytest.approx(first, rel=1e-5, abs=1e-6)
    assert a[-1] < a[0]  # it learns
    for g, w in zip(got, want):
        for k in METHOD[method][0].metrics:
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-6), (k, g, w)
        assert w["rewards/margins"] == pytest.approx(w["rewards/chosen"] - w["rewards/rejected"], abs=1e-5)


@pytest.mark.parametrize("flags", [("--loss_type", "hinge"), ("--loss_type", "ipo"),
                                   ("--loss_type", "simpo", "--simpo_gamma", "0.3", "--label_smoothing", "0.1")],
                         ids=["hinge", "ipo", "simpo"])
def test_cpo_loss_type_on_both_paths(job, isolated, one_thread, flags):
    """CPO's --loss_type from the command line: step 1 is that type's float64 loss of the whole batch, and the Trainer
    and the loop log the same losses and metrics at every step."""
    from transformers import AutoModelForCausalLM

    _, model_dir, _ = job
    name = f"cpo-{flags[1]}"
    want = train(job, f"{name}-trainer", "cpo", "--max_steps", "2", *flags)
    got = train(job, f"{name}-loop", "cpo", "--max_steps", "2", *flags, path="loop")
    opts = {"beta": 0.1, "cpo_alpha": 1.0, "loss_type": flags[1],
            **{k.lstrip("-"): float(v) for k, v in zip(flags[2::2], flags[3::2])}}
    with torch.no_grad():
        first = f64_loss("cpo", AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64),
                         full_batch(model_dir), **opts).item()
    print(f"\ncpo {' '.join(flags)}: trainer {[e['loss'] for e in want]} | loop {[e['loss'] for e in got]} | step 1 "
          f"float64 {first:.8f}")
    assert [e["step"] for e in want] == [e["step"] for e in got] == [1, 2]
    assert want[0]["loss"] == pytest.approx(first, rel=1e-5)
    for g, w in zip(got, want):
        for k in ("loss", *CPO.metrics):
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-6), (k, g, w)


@pytest.mark.parametrize("method", ["simpo", "orpo", "cpo"])
def test_evaluation_on_both_paths(job, isolated, one_thread, method):
    flags = ("--eval_split_size", "2", "--per_device_eval_batch_size", "3", "--eval_steps", "2", "--max_steps", "2")
    want = train(job, f"{method}-trainer-eval", method, *flags, entries="eval_loss")
    got = train(job, f"{method}-loop-eval", method, *flags, path="loop", entries="eval_loss")
    assert [e["step"] for e in got] == [e["step"] for e in want] == [2]
    for k in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_samples"):
        assert got[0][k] == pytest.approx(want[0][k], rel=1e-5, abs=1e-6), (k, got, want)
    assert want[0]["eval_samples"] == 2


@pytest.mark.parametrize("method", ["simpo", "orpo", "cpo"])
def test_engine_path_refuses_by_name(method):
    """scripts/sft.py (the DeepSpeed engine path) is not written for pairs: it refuses them by name, as DPO."""
    from types import SimpleNamespace

    from finetune.config.preset import Preset
    from finetune.training import core

    cfg = SimpleNamespace(training=SimpleNamespace(), sources={}, preset=Preset.named("ddp"),
                          objective=METHOD[method][1](method=method))
    assert core.refused_flags(cfg, "scripts/sft.py") == [f"method {method}: not supported by scripts/sft.py "
                                                         "(finetune/train.py supports it)"]
    assert core.refused_flags(cfg, "finetune/loop.py") == core.refused_flags(cfg, "finetune/train.py") == []


@pytest.mark.slow
@pytest.mark.parametrize("path", ["trainer", "loop"])
@pytest.mark.parametrize("method", ["simpo", "orpo", "cpo"])
def test_resume_gives_the_same_losses(job, isolated, one_thread, method, path):
    """The run's own mid-epoch checkpoint (step 3 of 4) resumed in a new folder: the same steps and metrics."""
    import shutil

    root = job[0]
    name = f"resume-{method}-{path}"
    common = ("--max_steps", "4", "--save_steps", "3", "--gradient_accumulation_steps", "1")
    whole = train(job, name, method, *common, path=path)
    shutil.copytree(root / name / "checkpoint-3", root / f"{name}-resumed" / "checkpoint-3")
    resumed = train(job, f"{name}-resumed", method, *common, "--resume_from_checkpoint", "latest", path=path)
    assert [e["step"] for e in whole] == [e["step"] for e in resumed] == [1, 2, 3, 4]
    for w, r in zip(whole, resumed):
        for k in ("loss", "grad_norm", *METHOD[method][0].metrics):
            assert r[k] == pytest.approx(w[k], abs=1e-6), (k, whole, resumed)


@pytest.mark.parametrize("flags, problem", [
    (["--simpo_gamma", "0.2"], "simpo_gamma: an option of SimPO, CPO; add --method simpo or cpo"),
    (["--method", "orpo", "--label_smoothing", "0.1"], ("label_smoothing: an option of DPO, SimPO, CPO; add "
                                                       "--method dpo or simpo or cpo")),
    (["--cpo_alpha", "0.5"], "cpo_alpha: a CPO option; add --method cpo"),
    (["--method", "cpo", "--cpo_alpha", "-1"], "cpo_alpha: must be 0 or more, got -1.0"),
    (["--method", "cpo", "--label_smoothing", "0.5"], "label_smoothing: must be in [0, 0.5), got 0.5"),
    (["--method", "cpo", "--loss_type", "robust"], "loss_type: 'robust' is not one of sigmoid, hinge, ipo, simpo"),
    (["--method", "cpo", "--loss_type", "simp"], "loss_type: 'simp' is not one of sigmoid, hinge, ipo, simpo; did "
                                                 "you mean 'simpo'?"),
    (["--method", "cpo", "--loss_type", "ipo", "--label_smoothing", "0.1"], ("label_smoothing: --loss_type ipo does "
                                                                             "not use it; leave it out or use "
                                                                             "--loss_type sigmoid or simpo")),
    (["--method", "cpo", "--simpo_gamma", "0.3"], ("simpo_gamma: --loss_type sigmoid does not use it; leave it out "
                                                   "or use --loss_type simpo")),
    (["--method", "orpo", "--beta", "0"], "beta: must be positive, got 0.0"),
    (["--method", "simpo", "--label_smoothing", "0.5"], "label_smoothing: must be in [0, 0.5), got 0.5"),
    (["--method", "simpo", "--packing"], "packing: not supported with --method simpo yet"),
])
def test_config_problems(job, flags, problem):
    from finetune import config as C

    root, model, data = job
    with pytest.raises(C.ConfigError) as e:
        C.parse(["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(root / "o"), *flags])
    assert any(p.startswith(problem) for p in e.value.problems), e.value.problems


def test_each_method_gets_its_own_defaults(job, tmp_path):
    """--beta is DPO's, SimPO's and ORPO's (TRL's name): each method's default where it is not given."""
    from finetune import config as C

    _, model, data = job
    base = ["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(tmp_path / "o")]
    s = C.parse(base + ["--method", "simpo"], check_paths=False).objective
    assert (type(s), s.beta, s.simpo_gamma, s.label_smoothing) == (simpo.SimPOConfig, 2.0, 0.5, 0.0)
    o = C.parse(base + ["--method", "orpo", "--beta", "0.25"], check_paths=False).objective
    assert (type(o), o.beta) == (orpo.ORPOConfig, 0.25)
    assert C.parse(base + ["--method", "dpo"], check_paths=False).objective.beta == 0.1


def test_plan_holds_no_reference(tmp_path):
    from finetune.plan import planner as plan

    folder = tmp_path / "tiny"
    folder.mkdir()
    shape = dict(vocab_size=301, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(shape))
    base = ["--model_name_or_path", str(folder), "--accelerator", "cpu", "--host_memory", "64GB",
            "--max_seq_length", "128", "--per_device_train_batch_size", "2"]
    dpo_pre = plan.make_plan(base + ["--method", "dpo", "--precompute_ref_log_probs"])
    for method in ("simpo", "orpo", "cpo"):
        p = plan.make_plan(base + ["--method", method])
        assert "reference model" not in p["per_device"] and "no reference model" in p["job"]["method"]
        # Two rows per pair, as DPO without its reference: the same memory.
        assert p["per_device_total"] == dpo_pre["per_device_total"]


# ----------------------------------------------------------------------------------------------
# Slow: 2 processes against 1, per step (tests/test_dpo_train.py's 8 pairs; global batch 4: 2 steps per epoch, 4
# steps), on the Trainer path under ZeRO-2 and ZeRO-3 and on the loop under ZeRO-3. No reference: nothing but the
# policy is partitioned. The engine path refuses the methods by name (test_engine_path_refuses_by_name).
# CI runs SimPO on the Trainer under ZeRO-2 (ORPO and CPO share its reference-free step, each against TRL in one
# process); FINETUNE_FULL_MATRIX=1 runs all nine.

MULTI = [(m, p, c) for m in ("simpo", "orpo", "cpo") for p, c in (("trainer", "zero2"), ("trainer", "zero3"),
                                                                  ("loop", "zero3"))]
MULTI_CASES = matrix(MULTI, [("simpo", "trainer", "zero2")])


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    from finetune.models import tiny
    from tests.test_dpo_train import MORE_PAIRS

    root = tmp_path_factory.mktemp("pref-multi")
    model = tiny.build(root / "model", style="chatml")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in MORE_PAIRS))
    return root, model, data


@pytest.mark.slow
@pytest.mark.parametrize("method, path, preset", MULTI_CASES, ids=["-".join(c) for c in MULTI_CASES])
def test_two_processes_equal_one(multi, method, path, preset):
    from concurrent.futures import ThreadPoolExecutor

    from tests.launch import LOOP, TRAIN, launcher, run, unexpected_warnings

    root, model, data = multi
    script = {"trainer": TRAIN, "loop": LOOP}[path]
    name = f"{method}-{path}-{preset}"

    def history(job: str, cmd: list[str], micro: int) -> list[dict]:
        out = root / f"{name}-{job}"
        result = run(cmd + ["--config", preset, "--method", method, *FLAGS[method], "--model_name_or_path", str(model),
                            "--dataset", str(data), "--output_dir", str(out), "--dataset_cache_dir", str(root / "cache"),
                            "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", "2",
                            "--max_steps", "4", "--lr_scheduler_type", "constant", "--learning_rate", "0.05",
                            "--seed", "3", "--disable_tqdm", "true"], timeout=600).check()
        assert not unexpected_warnings(result.output), unexpected_warnings(result.output)
        assert "no reference model" in result.output
        return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]

    with ThreadPoolExecutor(2) as pool:  # independent jobs side by side (the data cache is shared under its lock)
        one = pool.submit(history, "1", [sys.executable, script], 2)
        two = pool.submit(history, "2", launcher("accelerate", 2, script=script), 1)
        one, two = one.result(), two.result()
    assert [e["step"] for e in two] == [e["step"] for e in one] == [1, 2, 3, 4]
    assert one[-1]["loss"] < one[0]["loss"]
    keys = ("loss", "grad_norm", *METHOD[method][0].metrics)
    for a, b in zip(one, two):
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), (k, one, two)
    diff = max(abs(a[k] - b[k]) / max(1.0, abs(a[k])) for a, b in zip(one, two) for k in keys)
    curve = lambda logs: " ".join(f"{e['loss']:.6f}" for e in logs)  # noqa: E731
    print(f"\n{method} parity | {path} | {preset} | 1 process: {curve(one)} | 2 processes: {curve(two)} | "
          f"max diff (loss, grad norm, metrics; relative above 1) {diff:.1e}")
