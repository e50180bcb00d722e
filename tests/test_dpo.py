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


def test_equal_to_trl(tiny_plain, tmp_path, one_thread, isolated):
    """TRL's DPOTrainer (the bench extra) on the same pairs: the same tokens, loss and gradients."""
    trl = pytest.importorskip("trl")
    import datasets
    from transformers import AutoModelForCausalLM

    from finetune.config import ModelConfig
    from finetune.models.load import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(model_name_or_path=str(tiny_plain)))
    policy = AutoModelForCausalLM.from_pretrained(tiny_plain, dtype=torch.float32)
    ref = copy.deepcopy(policy).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    records = [r for r in RECORDS if isinstance(r["prompt"], str)]
    args = trl.DPOConfig(output_dir=str(tmp_path), beta=0.3, report_to="none", use_cpu=True,
                         per_device_train_batch_size=len(records), max_length=None)
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
    got = dpo.micro_batch_loss(policy, PR.PairCollator(tokenizer.pad_token_id)(ours),
                               lambda b: dpo.sequence_logps(ref, b), dpo.DPOConfig(beta=0.3), len(records))
    got.backward()
    assert abs(got.item() - expected.item()) < 1e-5 and abs(got.item() - 0.6931) > 1e-3
    for n, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-5)
