"""GRPO and RLOO (finetune.methods.grpo, rloo, generation, rewards): the advantages and the loss against TRL 1.16's
own code on the same tensors, the rewards' refusals, the seeding of sampling."""

from __future__ import annotations

import inspect
import json
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from finetune.methods import rewards
from finetune.methods.generation import weighted_rewards
from finetune.methods.grpo import GRPO, GRPOConfig, group_advantages
from finetune.methods.rloo import RLOO, RLOOConfig, leave_one_out_advantages

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL (the bench extra) is the reference")
from trl.trainer import rloo_trainer as trl_rloo
from trl.trainer.utils import nanstd

G, PROMPTS, T = 4, 3, 7  # generations per prompt, prompts, completion width
N = G * PROMPTS


def fixed(seed: int = 0):
    """Per-token log-probs (policy, as generated, reference), a completion mask of varied lengths, rewards of two
    functions with a NaN (unscored) and a group whose rewards are all equal."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)  # ratios well outside 1 ± 0.2
    ref = logps + 0.2 * torch.randn(N, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    per_func = torch.rand(N, 2, generator=g, dtype=torch.float64)
    per_func[3, 0] = math.nan
    per_func[G:2 * G] = 0.5  # a group with no spread
    return logps, old, ref, mask, per_func


def trl_block(method, start: str, end: str) -> str:
    """The lines of a TRL method from the one starting with `start` through the one starting with `end`, dedented:
    TRL's own code, run below on our tensors (the advantages are computed inline in TRL's rollout, not by a
    function of their own)."""
    lines = inspect.getsource(method).splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip().startswith(start))
    last = next(i for i in range(first, len(lines)) if lines[i].strip().startswith(end))
    return textwrap.dedent("\n".join(lines[first:last + 1]))


def trl_grpo_advantages(per_func, weights, scale_rewards: str):
    code = trl_block(trl_grpo.GRPOTrainer._generate_and_score_completions,
                     'if self.multi_objective_aggregation == "sum_then_normalize"',
                     "advantages = torch.nan_to_num(advantages")
    self = SimpleNamespace(multi_objective_aggregation="sum_then_normalize", scale_rewards=scale_rewards,
                           reward_weights=weights)
    scope = {"self": self, "torch": torch, "nanstd": nanstd, "rewards_per_func": per_func, "num_generations": G,
             "device": "cpu", "unscorable_mask": torch.isnan(per_func).all(dim=1)}
    exec(code, vars(trl_grpo) | scope, scope)
    return scope["advantages"]


def trl_rloo_advantages(per_func, weights, old, ref, mask, beta: float, normalize: bool):
    code = trl_block(trl_rloo.RLOOTrainer._generate_and_score_completions,
                     "rewards = (rewards_per_func * self.reward_weights", "advantages = torch.nan_to_num(advantages")
    self = SimpleNamespace(reward_weights=weights, reward_clip_range=None, beta=beta, normalize_advantages=normalize)
    scope = {"self": self, "torch": torch, "nanstd": nanstd, "rewards_per_func": per_func, "num_generations": G,
             "device": "cpu", "unscorable_mask": torch.isnan(per_func).all(dim=1), "gather": lambda t: t,
             "old_per_token_logps": old, "ref_per_token_logps": ref, "completion_mask": mask}
    exec(code, vars(trl_rloo) | scope, scope)
    return scope["advantages"]


def fake_trainer(cls, loss_type: str, beta: float, eps_low: float, eps_high: float, logps):
    """What TRL's _compute_loss reads of its trainer, for one process, one micro-batch, no accumulation: the policy's
    per-token log-probs are `logps` (the forward is not what is compared)."""
    accelerator = SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t,
                                  gather_for_metrics=lambda t: t)
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1), loss_type=loss_type,
        epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False, vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, max_completion_length=T,
        accelerator=accelerator, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)))


def trl_inputs(old, ref, mask, advantages, n: int = N):
    return {"prompt_ids": torch.zeros(n, 2, dtype=torch.long), "prompt_mask": torch.ones(n, 2, dtype=torch.long),
            "completion_ids": torch.zeros(n, T, dtype=torch.long), "completion_mask": mask.long(),
            "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
            "old_logps": (old * mask).sum(1), "num_items_in_batch": mask.sum()}


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trl(scale_rewards):
    *_, per_func = fixed()
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    ours, _ = group_advantages(weighted_rewards(per_func, weights), G, scale_rewards)
    theirs = trl_grpo_advantages(per_func, weights, scale_rewards)
    diff = (ours - theirs).abs().max().item()
    print(f"grpo advantages, scale_rewards={scale_rewards}: max |ours - TRL| = {diff:.2e}")
    assert diff < 1e-5 and ours.abs().sum() > 1  # and not all zero


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_equals_trl(loss_type, beta):
    """The loss and its gradient with respect to the policy's log-probs, clipping active (old log-probs differ)."""
    logps, old, ref, mask, per_func = fixed(1)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    advantages, _ = group_advantages(weighted_rewards(per_func, weights), G, "group")
    options = GRPOConfig(method="grpo", loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
                         max_completion_length=T)
    ours_in = logps.clone().requires_grad_(True)
    numerator, ratio, _ = GRPO().completion_loss(options, ours_in, old, ref, advantages, mask)
    count = mask.sum() if GRPO().loss_normalizer(options) == "tokens" else N
    ours = numerator / count
    ours.backward()
    theirs_in = logps.clone().requires_grad_(True)
    trainer = fake_trainer(trl_grpo.GRPOTrainer, loss_type, beta, 0.2, 0.28, theirs_in)
    theirs = trl_grpo.GRPOTrainer._compute_loss(trainer, None, trl_inputs(old, ref, mask, advantages))
    theirs.backward()
    clipped = ((ratio < 0.8) | (ratio > 1.28)).double().mul(mask).sum().item()
    diff, grad_diff = abs(ours.item() - theirs.item()), (ours_in.grad - theirs_in.grad).abs().max().item()
    print(f"grpo loss_type={loss_type} beta={beta}: ours {ours.item():.8f} TRL {theirs.item():.8f} |diff| {diff:.2e}, "
          f"grad max |diff| {grad_diff:.2e} ({clipped:.0f} clipped tokens)")
    assert clipped > 0 and diff < 1e-5 and grad_diff < 1e-5


def ranks(parts: list, fn) -> list:
    """fn(part, all_sum) on each part in a thread of its own, `all_sum` summing a tensor over the threads as an
    all-reduce over processes does: a batch split over ranks, in one process."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    barrier, slots = threading.Barrier(len(parts)), [None] * len(parts)

    def run(i):
        def all_sum(t):
            slots[i] = t.clone()
            barrier.wait()
            total = sum(slots)
            barrier.wait()
            return total

        return fn(parts[i], all_sum)

    with ThreadPoolExecutor(len(parts)) as pool:
        return list(pool.map(run, range(len(parts))))


@pytest.mark.parametrize("split", [[N], [2 * G, G], [G, G, G]])
def test_batch_scaled_advantages_are_the_whole_batch_as_trl(split):
    """--scale_rewards batch over a step's batch split over 1, 2 or 3 ranks (each its own prompts' groups): each
    rank's advantages are its slice of TRL's, whose std is the gathered generation batch's; the micro-batch's own
    std (what it was) would differ."""
    *_, per_func = fixed()
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    rewards = weighted_rewards(per_func, weights)
    parts = list(torch.split(rewards, split))
    ours = torch.cat([a for a, _ in ranks(parts, lambda r, all_sum: group_advantages(r, G, "batch", all_sum))])
    theirs = trl_grpo_advantages(per_func, weights, "batch")
    diff = (ours - theirs).abs().max().item()
    local = torch.cat([group_advantages(r, G, "batch")[0] for r in parts])
    print(f"grpo batch-scaled advantages over {len(split)} ranks: max |ours - TRL| = {diff:.2e} "
          f"(each rank's own std: {(local - theirs).abs().max().item():.2e})")
    assert diff < 1e-5 and ours.abs().sum() > 1
    if len(split) > 1:
        assert (local - theirs).abs().max() > 1e-3


def test_rloo_normalized_over_the_whole_batch_as_trl():
    """RLOO's --normalize_advantages over a batch split over 2 ranks: TRL's normalization of the gathered batch."""
    logps, old, ref, mask, per_func = fixed(2)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    options = RLOOConfig(method="rloo", beta=0.0, normalize_advantages=True, num_generations=G)
    method = RLOO()
    parts = list(torch.split(method.weighted(options, per_func, weights), [G, 2 * G]))
    ours = torch.cat([a for a, _ in ranks(parts, lambda r, all_sum: method.advantages(options, r, all_sum))])
    theirs = trl_rloo_advantages(per_func, weights, old, ref, mask, 0.0, True)
    diff = (ours - theirs).abs().max().item()
    print(f"rloo normalized advantages over 2 ranks: max |ours - TRL| = {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_num_iterations_equals_trl(loss_type):
    """--num_iterations 2 over a batch of generations in 2 micro-batches (TRL: steps_per_generation = gradient
    accumulation = 2, so TRL scores old_per_token_logps at generation). Step 1 trains with the generating model
    (log-probs = p_old, ratio 1), step 2 on the same completions, advantages and p_old with the model moved (ratios
    clipped): each step's loss (the sum over its micro-batches, each over the step's count) and gradient equal TRL's
    _compute_loss summed over the same micro-batches with its accumulation normalizers. (bnpo is left out: TRL's
    divides by each micro-batch's own tokens, ours by the step's; docs/grpo.md.)"""
    moved, old, ref, mask, per_func = fixed(3)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    advantages, _ = group_advantages(weighted_rewards(per_func, weights), G, "group")
    options = GRPOConfig(method="grpo", loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28,
                         max_completion_length=T, num_iterations=2)
    assert GRPO().needs_old_logps(options) and GRPO().repeats(options) == 2
    halves = [slice(0, N // 2), slice(N // 2, N)]
    count = mask.sum() if GRPO().loss_normalizer(options) == "tokens" else N
    for step, logps in ((1, old), (2, moved)):
        ours_in = logps.clone().requires_grad_(True)
        ours = sum(GRPO().completion_loss(options, ours_in[h], old[h], ref[h], advantages[h], mask[h])[0] / count
                   for h in halves)
        ours.backward()
        theirs_in = logps.clone().requires_grad_(True)
        theirs = 0.0
        for h in halves:
            trainer = fake_trainer(trl_grpo.GRPOTrainer, loss_type, 0.04, 0.2, 0.28, theirs_in[h])
            trainer.args.steps_per_generation = trainer.current_gradient_accumulation_steps = 2
            inputs = trl_inputs(old[h], ref[h], mask[h], advantages[h], n=N // 2)
            inputs["num_items_in_batch"] = mask.sum()  # TRL's count is the whole generation batch's
            theirs = theirs + trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
        theirs.backward()
        ratio = torch.exp(logps - old)
        clipped = (((ratio < 0.8) | (ratio > 1.28)).double() * mask).sum().item()
        diff, grad_diff = abs(ours.item() - theirs.item()), (ours_in.grad - theirs_in.grad).abs().max().item()
        print(f"num_iterations 2, loss_type={loss_type}, step {step}: ours {ours.item():.8f} TRL {theirs.item():.8f} "
              f"|diff| {diff:.2e}, grad max |diff| {grad_diff:.2e} ({clipped:.0f} clipped tokens)")
        assert diff < 1e-5 and grad_diff < 1e-5 and (clipped > 0) == (step == 2)


@pytest.mark.parametrize("beta,normalize", [(0.0, False), (0.05, True)])
def test_rloo_equals_trl(beta, normalize):
    logps, old, ref, mask, per_func = fixed(2)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    options = RLOOConfig(method="rloo", beta=beta, normalize_advantages=normalize, epsilon=0.2, epsilon_high=0.28,
                         num_generations=G)
    kl = ((old - ref) * mask).sum(-1)
    method = RLOO()
    ours_adv, _ = method.advantages(options, method.weighted(options, per_func, weights, kl))
    theirs_adv = trl_rloo_advantages(per_func, weights, old, ref, mask, beta, normalize)
    adv_diff = (ours_adv - theirs_adv).abs().max().item()
    ours_in = logps.clone().requires_grad_(True)
    numerator, _, _ = method.completion_loss(options, ours_in, old, None, ours_adv, mask)
    ours = numerator / N
    ours.backward()
    theirs_in = logps.clone().requires_grad_(True)
    trainer = fake_trainer(trl_rloo.RLOOTrainer, "rloo", beta, 0.2, 0.28, theirs_in)
    theirs = trl_rloo.RLOOTrainer._compute_loss(trainer, None, trl_inputs(old, ref, mask, theirs_adv))
    theirs.backward()
    diff, grad_diff = abs(ours.item() - theirs.item()), (ours_in.grad - theirs_in.grad).abs().max().item()
    print(f"rloo beta={beta} normalize={normalize}: advantages max |diff| {adv_diff:.2e}; loss ours "
          f"{ours.item():.8f} TRL {theirs.item():.8f} |diff| {diff:.2e}; grad max |diff| {grad_diff:.2e}")
    assert adv_diff < 1e-5 and diff < 1e-5 and grad_diff < 1e-5


def test_leave_one_out_by_hand():
    rewards_ = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    adv, _ = leave_one_out_advantages(rewards_, 4)
    assert torch.allclose(adv, torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 2.0], dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# Rewards.


def test_builtin_rewards():
    ref = json.dumps({"name": "Ana", "city": "Oslo", "item": "lamp", "quantity": 2})
    completions = [ref, '{"name": "Ana", "city": "Rome", "item": "lamp", "quantity": 3}', "not json", " " + ref + "\n"]
    refs = [ref] * 4
    assert rewards.json_valid(None, completions) == [1.0, 1.0, 0.0, 1.0]
    assert rewards.json_fields(None, completions, reference=refs) == [1.0, 0.5, 0.0, 1.0]
    assert rewards.exact_match(None, completions, reference=refs) == [1.0, 0.0, 0.0, 1.0]
    assert rewards.regex(r"^\{.*\}$")(None, completions) == [1.0, 1.0, 0.0, 0.0]
    assert rewards.length_penalty(None, completions, completion_ids=[[1] * 4, [1] * 8, [], [1]],
                                  max_completion_length=8) == [-0.5, -1.0, 0.0, -0.125]


def test_user_reward_and_weights(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("def shout(prompts, completions, level, **kw):\n    return [float(c.isupper()) * l for c, l in "
                 "zip(completions, level)]\n\ndef broken(prompts, completions, **kw):\n    raise KeyError('x')\n\n"
                 "def short(prompts, completions, **kw):\n    return [1.0]\n\ndef words(prompts, completions, **kw):\n"
                 "    return ['a' for _ in completions]\n")
    r = rewards.Rewards.of([f"{f}:shout", "json_valid"], [2.0, 1.0])
    table = r.score(["p", "q"], ["ABC", "{}"], [{"level": 3}, {"level": 1}])
    assert table == [[3.0, 0.0], [0.0, 1.0]]
    assert r.names == ["shout", "json_valid"]
    for name, message in (("broken", f"reward {f}:broken raised KeyError: 'x'"),
                          ("short", f"reward {f}:short returned 1 values for 2 completions"),
                          ("words", f"reward {f}:words returned a str ('a'), not a number")):
        with pytest.raises(rewards.RewardError) as e:
            rewards.Rewards.of([f"{f}:{name}"], None).score(["p", "q"], ["a", "b"], [{}, {}])
        assert str(e.value) == message and "\n" not in str(e.value)
    with pytest.raises(rewards.RewardError, match="has no function 'nope'"):
        rewards.load(f"{f}:nope")
    with pytest.raises(rewards.RewardError, match="no such file"):
        rewards.load(f"{tmp_path}/absent.py:x")
    with pytest.raises(rewards.RewardError, match="is not a built-in"):
        rewards.load("json_feilds")


# ----------------------------------------------------------------------------------------------
# Sampling.


def test_sampling_does_not_depend_on_the_batch(tmp_path):
    """A completion is the same sampled alone or beside other prompts (its own generator, positions from the mask)."""
    from transformers import AutoModelForCausalLM

    from finetune.methods.generation import PromptCollator, sample, step_seed
    from finetune.models import tiny

    model = AutoModelForCausalLM.from_pretrained(tiny.build(tmp_path / "m", style="chatml")).eval()
    prompts = [{"prompt_ids": [5, 6, 7, 8, 9, 10], "prompt_index": 0}, {"prompt_ids": [11, 12], "prompt_index": 1}]
    collate = PromptCollator(0)

    def run(features):
        b = collate(features)
        seeds = [step_seed(3, 1, int(i), 0) for i in b["prompt_index"]]
        return sample(model, b["prompt_ids"], b["prompt_mask"], seeds, max_new=12, temperature=1.0, top_p=0.9,
                      stop_ids={2}, pad_id=0)

    both, both_mask = run(prompts)
    for row, f in enumerate(prompts):
        alone, alone_mask = run([f])
        n = int(alone_mask.sum())
        assert n == int(both_mask[row].sum()) and torch.equal(alone[0, :n], both[row, :n])
    assert not torch.equal(both[0], both[1])


# ----------------------------------------------------------------------------------------------
# Prompts.


def test_prompts_from_the_formats(tmp_path):
    """The prompt part of messages / sharegpt / alpaca records, rendered with the generation prompt; the answer is
    the column `reference`, the record's other keys columns too; a text record is refused by its line."""
    from finetune.config import ModelConfig
    from finetune.data.errors import DataError
    from finetune.data.prompts import prompt_rows
    from finetune.models import tiny
    from finetune.models.load import load_tokenizer

    t = load_tokenizer(ModelConfig(model_name_or_path=str(tiny.build(tmp_path / "m", style="chatml"))))
    records = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}], "level": 3},
        {"conversations": [{"from": "human", "value": "capital of France?"}, {"from": "gpt", "value": "Paris"}]},
        {"instruction": "Copy", "input": "red cat", "output": "red cat"},
    ]
    rows, stats = prompt_rows(t, records, ["d:1", "d:2", "d:3"], None, 512)
    assert stats.kept == 3 and stats.tokens == sum(len(r["prompt_ids"]) for r in rows)
    for row in rows:
        assert row["prompt"].endswith("<|im_start|>assistant\n")
        assert row["prompt_ids"] == t(row["prompt"], add_special_tokens=False)["input_ids"]
    assert "Be brief." in rows[0]["prompt"] and "4" not in rows[0]["prompt"].split("2+2?")[1]
    assert [json.loads(r["columns"]) for r in rows] == [{"level": 3, "reference": "4"}, {"reference": "Paris"},
                                                        {"reference": "red cat"}]
    with pytest.raises(DataError, match="d:9: a 'text' record has no prompt"):
        prompt_rows(t, [{"text": "hello"}], ["d:9"], None, 512)
    longest = max(len(r["prompt_ids"]) for r in rows)
    rows, stats = prompt_rows(t, records, ["d:1", "d:2", "d:3"], None, longest - 1)
    assert stats.dropped_long == 3 - len(rows) >= 1 and stats.longest < longest
    with pytest.raises(DataError, match="no prompt is left"):
        prompt_rows(t, records, ["d:1", "d:2", "d:3"], None, 4)
