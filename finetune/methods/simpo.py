"""SimPO (--method simpo, docs/preference.md): a preference loss of length-normalized log-probabilities, with a
target margin and no reference model (Meng et al. 2024; TRL's CPOTrainer with loss_type="simpo", cpo_alpha=0).

With a = the chosen completion's mean token log-probability, b = the rejected one's, β = --beta, γ = --simpo_gamma
and ε = --label_smoothing, per pair:

    z    = β (a - b) - γ
    loss = -(1 - ε) log σ(z) - ε log σ(-z)

(TRL writes z as β (a - b - γ/β)); the rewards logged are β a and β b, as TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.methods.reference_free import ReferenceFree, ReferenceFreeConfig, reward_values


@dataclass
class SimPOConfig(ReferenceFreeConfig):
    """SimPO's flags (--method simpo; docs/preference.md)"""

    beta: float = field(default=2.0, metadata={
        "help": "SimPO: the scale of the length-normalized log-probability margin (the SimPO paper's 2.0 by "
                "default; TRL's CPOConfig defaults to 0.1)."})
    simpo_gamma: float = field(default=0.5, metadata={
        "help": "SimPO: the target reward margin gamma the chosen answer should win by (TRL's simpo_gamma)."})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "SimPO: the share of pairs assumed mislabelled, in [0, 0.5)."})


def simpo_loss(chosen, rejected, beta: float, gamma: float, label_smoothing: float = 0.0):
    """Per-pair losses of the pairs' length-normalized log-probabilities."""
    import torch.nn.functional as F

    z = beta * (chosen - rejected) - gamma
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


class SimPO(ReferenceFree):
    name = "simpo"
    title = "SimPO"
    summary = "SimPO: length-normalized preference loss with a margin, no reference model (docs/preference.md)"
    config = SimPOConfig

    def validate(self, options: SimPOConfig, data, training: dict, evaluation) -> list[str]:
        problems = super().validate(options, data, training, evaluation)
        if not 0.0 <= options.label_smoothing < 0.5:
            problems.append(f"label_smoothing: must be in [0, 0.5), got {options.label_smoothing}")
        return problems

    def pair_losses(self, options: SimPOConfig, chosen, rejected):
        losses = simpo_loss(chosen, rejected, options.beta, options.simpo_gamma, options.label_smoothing)
        return losses, reward_values(options.beta, chosen, rejected)

    def describe(self, options: SimPOConfig) -> str:
        return (f"simpo: beta {options.beta}, gamma {options.simpo_gamma}, label smoothing "
                f"{options.label_smoothing}; no reference model")
