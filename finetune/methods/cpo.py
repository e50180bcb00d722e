"""CPO (--method cpo, docs/preference.md): Contrastive Preference Optimization, DPO's sigmoid loss without a reference
model plus a behaviour-cloning NLL on the chosen answer (Xu et al. 2024; TRL's CPOTrainer with its default
loss_type="sigmoid").

With s_c, s_r = the chosen and rejected completions' summed token log-probabilities, a = the chosen one's mean,
β = --beta, α = --cpo_alpha and ε = --label_smoothing, per pair:

    z    = β (s_c - s_r)
    loss = -(1 - ε) log σ(z) - ε log σ(-z) - α a

-a is the chosen completion's NLL averaged over its tokens. TRL's CPOTrainer differs on purpose in that term only:
its NLL is a token mean over the micro-batch's chosen completions; here it is per pair, so the step is the global
batch's mean whatever the split over ranks and accumulation (as ORPO's). The rewards logged are β s_c and β s_r, as
TRL's; also TRL's nll_loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.methods.dpo import METRICS
from finetune.methods.reference_free import ReferenceFree, ReferenceFreeConfig, reward_values


@dataclass
class CPOConfig(ReferenceFreeConfig):
    """CPO's flags (--method cpo; docs/preference.md)"""

    beta: float = field(default=0.1, metadata={
        "help": "CPO: the scale of the summed log-probability margin (TRL's CPOConfig default)."})
    cpo_alpha: float = field(default=1.0, metadata={
        "help": "CPO: the weight of the chosen answer's NLL (TRL's cpo_alpha; 0 leaves the preference term alone)."})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "CPO: the share of pairs assumed mislabelled, in [0, 0.5)."})


def cpo_loss(chosen_sum, rejected_sum, chosen_mean, beta: float, alpha: float, label_smoothing: float = 0.0):
    """Per-pair losses of the pairs' summed log-probabilities and the chosen ones' means."""
    import torch.nn.functional as F

    z = beta * (chosen_sum - rejected_sum)
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z) - alpha * chosen_mean


class CPO(ReferenceFree):
    name = "cpo"
    title = "CPO"
    summary = ("CPO: DPO's sigmoid loss without a reference model plus the chosen answer's NLL (--cpo_alpha) "
               "(docs/preference.md)")
    config = CPOConfig
    metrics = METRICS + ("nll_loss",)

    def validate(self, options: CPOConfig, data, training: dict, evaluation) -> list[str]:
        problems = super().validate(options, data, training, evaluation)
        if not 0.0 <= options.label_smoothing < 0.5:
            problems.append(f"label_smoothing: must be in [0, 0.5), got {options.label_smoothing}")
        if options.cpo_alpha < 0:
            problems.append(f"cpo_alpha: must be 0 or more, got {options.cpo_alpha}")
        return problems

    def pair_terms(self, options: CPOConfig, sums, tokens):
        """The summed log-probabilities (TRL's CPO: average_log_prob off) and the chosen ones' means."""
        import torch

        chosen, rejected = sums.chunk(2)
        chosen_mean = (sums / tokens).chunk(2)[0]
        losses = cpo_loss(chosen, rejected, chosen_mean, options.beta, options.cpo_alpha, options.label_smoothing)
        extra = (-chosen_mean.detach())[:, None]
        return losses, torch.cat([reward_values(options.beta, chosen, rejected), extra], dim=1)

    def describe(self, options: CPOConfig) -> str:
        return (f"cpo: beta {options.beta}, cpo_alpha {options.cpo_alpha}, label smoothing "
                f"{options.label_smoothing}; no reference model")
