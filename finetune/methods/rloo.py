"""RLOO (--method rloo, docs/grpo.md): REINFORCE Leave-One-Out (Ahmadian et al. 2024), as TRL 1.16's RLOOTrainer.
GRPO's rollouts (finetune.methods.grpo), with another advantage and loss:

    reward_i    = Σ_f w_f r_f(i) - β Σ_t (log p_old(t) - log ref(t))      (the KL as a reward penalty, per sequence)
    advantage_i = reward_i - mean of the other completions of its prompt  (the leave-one-out baseline)

optionally normalized over the step's whole batch of generations, every rank's (--normalize_advantages), and the clipped surrogate of the sequence's
log-probability ratio, averaged over the completions of the global batch:

    loss_i = -min(ρ_i A_i, clip(ρ_i, 1 - ε_low, 1 + ε_high) A_i),   ρ_i = exp(Σ_t log p(t) - Σ_t log p_old(t))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.methods.generation import weighted_rewards
from finetune.methods.grpo import GRPO, GRPOConfig, batch_stats, generation_problems, nanstd


@dataclass
class RLOOConfig(GRPOConfig):
    """RLOO's flags (--method rloo; docs/grpo.md), named as TRL 1.16's RLOOConfig names them"""

    beta: float = field(default=0.05, metadata={
        "help": "RLOO: the KL penalty's coefficient in the reward (TRL's RLOO default 0.05; 0: no reference)."})
    normalize_advantages: bool = field(default=False, metadata={
        "help": "RLOO: normalize the advantages over the step's batch, every process's (mean 0, std 1)."})


def leave_one_out_advantages(rewards, num_generations: int, normalize: bool = False, all_sum=None):
    """TRL's RLOO advantages: each reward less the mean of its group's other (scored) rewards; NaN rewards left out
    and given advantage 0; normalized over every rank's batch (`all_sum`). Returns (advantages, each group's std)
    for the logs."""
    import torch

    grouped = rewards.view(-1, num_generations)
    std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)
    advantages = rewards - baselines.view(-1)
    if normalize:
        mean, std_all = batch_stats(advantages, all_sum)
        advantages = (advantages - mean) / (std_all + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), std


def sequence_loss(logps, old_logps, advantages, mask, epsilon_low: float, epsilon_high: float):
    """(sum over the completions of the clipped sequence-ratio surrogate, the ratio [n])."""
    import torch

    ratio = torch.exp((logps * mask).sum(1) - (old_logps * mask).sum(1))
    per_sequence = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages)
    return per_sequence.sum(), ratio


class RLOO(GRPO):
    name = "rloo"
    title = "RLOO"
    summary = "REINFORCE Leave-One-Out: GRPO's rollouts with a leave-one-out baseline (docs/grpo.md)"
    config = RLOOConfig

    def validate(self, options, data, training: dict, evaluation) -> list[str]:
        problems = generation_problems(self.name, options, data, training, evaluation)
        for flag, default in (("loss_type", "dapo"), ("scale_rewards", "group")):
            if getattr(options, flag) != default:
                problems.append(f"{flag}: a GRPO option; RLOO's loss is per sequence (--normalize_advantages scales)")
        return problems

    def loss_normalizer(self, options) -> str:
        return "completions"

    def weighted(self, options, per_func, weights, kl=None):
        rewards = weighted_rewards(per_func, weights)
        return rewards - options.beta * kl if kl is not None and options.beta != 0 else rewards

    def advantages(self, options, rewards, all_sum=None):
        return leave_one_out_advantages(rewards, options.num_generations, options.normalize_advantages, all_sum)

    def needs_old_logps(self, options) -> bool:
        return options.beta > 0 or options.num_iterations > 1

    def reference_in_loss(self, options) -> bool:
        return False

    def completion_loss(self, options, logps, old_logps, ref_logps, advantages, mask):
        eps_high = options.epsilon if options.epsilon_high is None else options.epsilon_high
        total, ratio = sequence_loss(logps, old_logps, advantages, mask, options.epsilon, eps_high)
        return total, ratio, None
