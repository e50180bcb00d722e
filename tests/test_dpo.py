"""finetune.methods.dpo: one batch's DPO loss and gradients against a reference written here in plain torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from finetune.data import preference as PR
from finetune.methods import dpo

RECORDS = [
    {"prompt": "copy: red cat", "chosen": "red cat", "rejected": "cat red"},
    {"prompt": "count: one two three", "chosen": "3", "rejected": "three, I think"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "capital of France?"}],
     "chosen": "Paris", "rejected": "It is Lyon."},
]


def pair_features(tokenizer, records):
    out = []
    for i, r in enumerate(records):
        p, c, cl, rj, rl = PR.tokenize_pair(tokenizer, r, f"test:{i}")
        out.append({"prompt_ids": p, "chosen_ids": c, "chosen_labels": cl, "rejected_ids": rj, "rejected_labels": rl})
    return out


def reference_logps(model, input_ids, attention_mask, labels):
    """Plain torch: every position's full log-softmax, then a loop over the rows' scored tokens."""
    logp = torch.log_softmax(model(input_ids=input_ids, attention_mask=attention_mask).logits.float(), dim=-1)
    out = []
    for i in range(input_ids.shape[0]):
        total = logp.new_zeros(())
        for t in range(input_ids.shape[1] - 1):
            if labels[i, t + 1] != -100:
                total = total + logp[i, t, labels[i, t + 1]]
        out.append(total)
    return torch.stack(out)


def reference_loss(policy, ref, batch, beta, eps):
    args = batch["input_ids"], batch["attention_mask"], batch["labels"]
    pol = reference_logps(policy, *args)
    with torch.no_grad():
        rf = reference_logps(ref, *args)
    n = pol.shape[0] // 2
    d = (pol[:n] - rf[:n]) - (pol[n:] - rf[n:])
    return (-(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)).mean()


@pytest.fixture(scope="module")
def tiny(tiny_chatml, one_thread):
    from transformers import AutoModelForCausalLM

    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(tiny_chatml)))
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_chatml, dtype=torch.float32)
    ref = copy.deepcopy(policy).eval()
    with torch.no_grad():  # a reference that differs from the policy, so the log-ratios are not zero
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return tokenizer, policy, ref


@pytest.mark.parametrize("beta, eps", [(0.1, 0.0), (0.5, 0.2)])
def test_loss_and_gradients_equal_plain_torch(tiny, beta, eps):
    tokenizer, policy, ref = tiny
    batch = PR.PairCollator(tokenizer.pad_token_id)(pair_features(tokenizer, RECORDS))
    policy.zero_grad()
    expected = reference_loss(policy, ref, batch, beta, eps)
    expected.backward()
    want = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    metrics = dpo.Metrics()
    got = dpo.micro_batch_loss(policy, batch, lambda b: dpo.sequence_logps(ref, b), dpo.DPOConfig(beta=beta, label_smoothing=eps), 3, metrics)
    got.backward()
    assert abs(got.item() - expected.item()) < 1e-5
    assert got.item() != pytest.approx(0.6931, abs=1e-3)  # not the loss of a policy equal to its reference
    for n, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-5)
    logged = metrics.pop()
    assert logged["rewards/margins"] == pytest.approx(logged["rewards/chosen"] - logged["rewards/rejected"])
    assert 0.0 <= logged["rewards/accuracies"] <= 1.0


def test_global_batch_normalization(tiny):
    """Pairs split over micro-batches (or ranks), each micro-batch over the global pair count: the gradient of the
    whole batch's mean, whatever the split."""
    tokenizer, policy, ref = tiny
    features = pair_features(tokenizer, RECORDS)
    reference = lambda b: dpo.sequence_logps(ref, b)  # noqa: E731
    policy.zero_grad()
    whole = dpo.micro_batch_loss(policy, PR.PairCollator(0)(features), reference, dpo.DPOConfig(), 3)
    whole.backward()
    want = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    parts = [dpo.micro_batch_loss(policy, PR.PairCollator(0)(f), reference, dpo.DPOConfig(), 3)
             for f in (features[:1], features[1:])]
    sum(parts).backward()
    assert abs(sum(p.item() for p in parts) - whole.item()) < 1e-6
    for n, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-6, rtol=1e-5)


def test_equal_policy_and_reference_give_log_2(tiny):
    tokenizer, _, ref = tiny
    batch = PR.PairCollator(0)(pair_features(tokenizer, RECORDS))
    with torch.no_grad():
        loss = dpo.micro_batch_loss(ref, batch, lambda b: dpo.sequence_logps(ref, b), dpo.DPOConfig(), 3)
    assert loss.item() == pytest.approx(0.693147, abs=1e-6)


def f64_loss(policy, ref, batch, loss_type: str, beta: float, eps: float):
    """The mean over the pairs in float64, each loss type written from its paper (docs/preference.md): a per-sequence
    loop over the scored tokens of a float64 copy of both models."""
    args = batch["input_ids"], batch["attention_mask"], batch["labels"]
    pol, rf = copy.deepcopy(policy).double(), copy.deepcopy(ref).double()
    logp = lambda m: torch.stack([  # noqa: E731
        sum(lp[t, args[2][i, t + 1]] for t in range(args[0].shape[1] - 1) if args[2][i, t + 1] != -100)
        for i, lp in enumerate(torch.log_softmax(m(input_ids=args[0], attention_mask=args[1]).logits.double(), -1))])
    with torch.no_grad():
        ratio = logp(pol) - logp(rf)
    n = ratio.shape[0] // 2
    tokens = (args[2][:, 1:] != -100).sum(1).double()
    d = ratio[:n] - ratio[n:]
    if loss_type == "ipo":
        d_avg = ratio[:n] / tokens[:n] - ratio[n:] / tokens[n:]
        return ((d_avg - 1 / (2 * beta)) ** 2).mean().item()
    if loss_type == "hinge":
        return torch.clamp(1 - beta * d, min=0).mean().item()
    p = torch.sigmoid(beta * d)  # the probability the model gives the label; robust's ε: the flip rate
    if loss_type == "robust":
        return (((1 - eps) * -torch.log(p) - eps * -torch.log(1 - p)) / (1 - 2 * eps)).mean().item()
    return ((1 - eps) * -torch.log(p) + eps * -torch.log(1 - p)).mean().item()


# (loss type, beta, label smoothing): TRL 1.16's --loss_type names; robust reads label_smoothing as TRL's does.
TRL_CASES = [("sigmoid", 0.3, 0.0), ("hinge", 0.3, 0.0), ("hinge", 2.0, 0.0), ("ipo", 0.3, 0.0), ("ipo", 2.0, 0.0),
             ("robust", 0.3, 0.1), ("robust", 0.5, 0.3)]


@pytest.fixture(scope="module")
def trl_pair(tiny_plain, tmp_path_factory, one_thread):
    from transformers import AutoModelForCausalLM

    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    def models():
        """A fresh policy and reference for each TRL trainer (a DPOTrainer patches the models it is given)."""
        policy = AutoModelForCausalLM.from_pretrained(tiny_plain, dtype=torch.float32)
        ref = copy.deepcopy(policy).eval()
        torch.manual_seed(1)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.02 * torch.randn_like(p))
        return policy, ref

    return load_tokenizer(ModelConfig(model_name_or_path=str(tiny_plain))), models, tmp_path_factory.mktemp("trl")


def trl_dpo(trl_pair, loss_type, beta, eps):
    """TRL's DPOTrainer on our string records: (its loss and gradients, our loss and gradients, the float64 loss)."""
    trl = pytest.importorskip("trl")
    import datasets

    tokenizer, models, tmp = trl_pair
    policy, ref = models()
    records = [r for r in RECORDS if isinstance(r["prompt"], str)]
    args = trl.DPOConfig(output_dir=str(tmp), beta=beta, loss_type=[loss_type], label_smoothing=eps, report_to="none",
                         use_cpu=True, per_device_train_batch_size=len(records), max_length=None)
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(records),
                             processing_class=tokenizer)
    ours = pair_features(tokenizer, records)
    theirs = [trainer.train_dataset[i] for i in range(len(records))]
    for o, t in zip(ours, theirs):  # TRL's tokens are ours: the prompt with BOS, each answer then EOS, all scored
        assert (o["prompt_ids"], o["chosen_ids"], o["rejected_ids"]) == (t["prompt_ids"], t["chosen_ids"], t["rejected_ids"])
        assert o["chosen_labels"] == o["chosen_ids"] and o["rejected_labels"] == o["rejected_ids"]
    policy.zero_grad()
    expected = trainer.compute_loss(policy, trainer.data_collator(theirs))
    expected.backward()
    want = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    batch = PR.PairCollator(tokenizer.pad_token_id)(ours)
    options = dpo.DPOConfig(beta=beta, loss_type=loss_type, label_smoothing=eps)
    got = dpo.micro_batch_loss(policy, batch, lambda b: dpo.sequence_logps(ref, b), options, len(records))
    got.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    return expected.item(), want, got.item(), grads, f64_loss(policy, ref, batch, loss_type, beta, eps)


@pytest.mark.parametrize("loss_type, beta, eps", TRL_CASES, ids=[f"{t}-{b}-{e}" for t, b, e in TRL_CASES])
def test_equal_to_trl(trl_pair, isolated, loss_type, beta, eps):
    """TRL's DPOTrainer (the bench extra) on the same pairs, each --loss_type: the same tokens, loss and gradients;
    the float64 loss decides, both within 1e-5 of it."""
    theirs, want, ours, got, f64 = trl_dpo(trl_pair, loss_type, beta, eps)
    grad_diff = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"\ndpo {loss_type} beta {beta} eps {eps}: ours {ours:.8f} TRL {theirs:.8f} float64 {f64:.8f} | ours-TRL "
          f"{abs(ours - theirs):.1e} ours-f64 {abs(ours - f64):.1e} TRL-f64 {abs(theirs - f64):.1e} | max grad diff "
          f"{grad_diff:.1e}")
    assert abs(ours - f64) < 1e-5 and abs(theirs - f64) < 1e-5 and abs(ours - theirs) < 1e-5
    if loss_type in ("sigmoid", "robust"):
        assert abs(ours - 0.6931) > 1e-3  # not the loss of a policy equal to its reference
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-5)


def test_sigmoid_label_smoothing_differs_from_trl_on_purpose(trl_pair, isolated):
    """TRL 1.16's "sigmoid" ignores label_smoothing (its DPOConfig: "used in Robust DPO and EXO"); ours applies it,
    conservative DPO, as TRL's earlier versions did: equal to the float64 cDPO loss. TRL's loss at ε = 0.2 is its
    loss at ε = 0, and ours at ε = 0 is TRL's."""
    theirs, _, ours, _, f64 = trl_dpo(trl_pair, "sigmoid", 0.3, 0.2)
    theirs0, _, ours0, _, _ = trl_dpo(trl_pair, "sigmoid", 0.3, 0.0)
    print(f"\ndpo sigmoid eps 0.2: ours (cDPO) {ours:.8f} float64 cDPO {f64:.8f} | TRL {theirs:.8f} = TRL at eps 0 "
          f"{theirs0:.8f} = ours at eps 0 {ours0:.8f}")
    assert abs(ours - f64) < 1e-5 and abs(theirs - theirs0) < 1e-7 and abs(ours0 - theirs0) < 1e-5
    assert abs(ours - theirs) > 1e-3
