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
