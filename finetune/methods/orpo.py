"""ORPO (--method orpo, docs/preference.md): the chosen answer's NLL plus an odds-ratio preference term, no reference
model and no SFT stage before it (Hong et al. 2024; TRL's ORPOTrainer).

With a = the chosen completion's mean token log-probability, b = the rejected one's and β = --beta (ORPO's λ), per
pair:

    log_odds = (a - b) - (log(1 - e^a) - log(1 - e^b))
    loss     = -a - β log σ(log_odds)

-a is the chosen completion's NLL averaged over its tokens. TRL's ORPOTrainer differs on purpose in that term only:
its NLL covers the prompt's tokens too and is a token mean over the micro-batch; here it is the completion's, as
SFT trains it (completion_only_loss), per pair, so the step is the global batch's mean whatever the split. The
rewards logged are β a and β b, as TRL's; also TRL's nll_loss, log_odds_ratio (log σ(log_odds)) and log_odds_chosen
(log_odds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.methods.dpo import METRICS
from finetune.methods.reference_free import ReferenceFree, ReferenceFreeConfig, reward_values


@dataclass
class ORPOConfig(ReferenceFreeConfig):
    """ORPO's flags (--method orpo; docs/preference.md)"""

    beta: float = field(default=0.1, metadata={
        "help": "ORPO: lambda, the weight of the odds-ratio term beside the chosen answer's NLL (TRL's beta)."})


def log1mexp(x):
    """log(1 - e^x) for x < 0 without cancellation (TRL's, branching at -ln 2)."""
    import torch

    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen, rejected, beta: float):
    """(per-pair losses, log_odds) of the pairs' length-normalized log-probabilities."""
    import torch.nn.functional as F

    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return -chosen - beta * F.logsigmoid(log_odds), log_odds


class ORPO(ReferenceFree):
    name = "orpo"
    title = "ORPO"
    summary = "ORPO: NLL of the chosen answer plus an odds-ratio preference term, no reference model (docs/preference.md)"
    config = ORPOConfig
    metrics = METRICS + ("nll_loss", "log_odds_ratio", "log_odds_chosen")

    def pair_losses(self, options: ORPOConfig, chosen, rejected):
        import torch
        import torch.nn.functional as F

        losses, log_odds = orpo_loss(chosen, rejected, options.beta)
        extra = torch.stack([-chosen.detach(), F.logsigmoid(log_odds.detach()), log_odds.detach()], dim=1)
        return losses, torch.cat([reward_values(options.beta, chosen, rejected), extra], dim=1)
