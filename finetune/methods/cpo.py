"""CPO (--method cpo, docs/preference.md): Contrastive Preference Optimization, a preference loss without a reference
model plus a behaviour-cloning NLL on the chosen answer (Xu et al. 2024; TRL's CPOTrainer, its --loss_type variants
in LOSSES below).

With s_c, s_r = the chosen and rejected completions' summed token log-probabilities, a, b = their means over the
completion's trained tokens, β = --beta, α = --cpo_alpha, γ = --simpo_gamma and ε = --label_smoothing, per pair:

    sigmoid (default)  z = β (s_c - s_r);      -(1 - ε) log σ(z) - ε log σ(-z)
    hinge              max(0, 1 - β (s_c - s_r))                                (SLiC)
    ipo                (a - b - 1 / (2β))²                                      (IPO, β its τ)
    simpo              z = β (a - b) - γ;      -(1 - ε) log σ(z) - ε log σ(-z)  (SimPO's term; with α > 0 CPO-SimPO)

    loss = that - α a

(DPO's loss types with the reference's log-probabilities at 0: TRL's "we ignore the reference model"; ipo and
simpo read the means, as TRL's average_log_prob.) -a is the chosen completion's NLL averaged over its tokens. TRL's
CPOTrainer differs on purpose in that term only: its NLL is a token mean over the micro-batch's chosen completions;
here it is per pair, so the step is the global batch's mean whatever the split over ranks and accumulation (as
ORPO's). The rewards logged are β × the log-probabilities the loss type reads (sums, or means for ipo and simpo),
and logps/* those, as TRL's; also TRL's nll_loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.methods import dpo
from finetune.methods.reference_free import ReferenceFree, ReferenceFreeConfig, reward_values
from finetune.methods.simpo import simpo_loss


@dataclass
class CPOConfig(ReferenceFreeConfig):
    """CPO's flags (--method cpo; docs/preference.md)"""

    beta: float = field(default=0.1, metadata={
        "help": "CPO: the scale of the log-probability margin (TRL's CPOConfig default)."})
    cpo_alpha: float = field(default=1.0, metadata={
        "help": "CPO: the weight of the chosen answer's NLL (TRL's cpo_alpha; 0 leaves the preference term alone)."})
    # A plain string: --loss_type is one flag shared with DPO and GRPO, whose names differ; validate() checks CPO's.
    loss_type: str = field(default="sigmoid", metadata={
        "help": "CPO: the preference term, as TRL's CPOConfig names it: sigmoid (CPO), hinge (SLiC), ipo (IPO, "
                "length-normalized), simpo (SimPO's, length-normalized, with --simpo_gamma)."})
    simpo_gamma: float = field(default=0.5, metadata={
        "help": "CPO with --loss_type simpo: the target reward margin gamma (TRL's simpo_gamma)."})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "CPO: the share of pairs assumed mislabelled, in [0, 0.5) (--loss_type sigmoid or simpo)."})


# The preference terms (--loss_type, TRL's CPOConfig.loss_type names): per-pair losses of the chosen and rejected
# log-probabilities the type reads (NORMALIZED: the means, else the sums) and the options.


def sigmoid_term(chosen, rejected, options: CPOConfig):
    return dpo.sigmoid_loss(chosen, rejected, None, options.beta, options.label_smoothing)


def hinge_term(chosen, rejected, options: CPOConfig):
    return dpo.hinge_loss(chosen, rejected, None, options.beta, 0.0)


def ipo_term(chosen, rejected, options: CPOConfig):
    """IPO (eq. 17) of the means: DPO's ipo without the reference."""
    return (chosen - rejected - 1 / (2 * options.beta)) ** 2


def simpo_term(chosen, rejected, options: CPOConfig):
    return simpo_loss(chosen, rejected, options.beta, options.simpo_gamma, options.label_smoothing)


LOSSES = {"sigmoid": sigmoid_term, "hinge": hinge_term, "ipo": ipo_term, "simpo": simpo_term}
NORMALIZED = ("ipo", "simpo")  # TRL's average_log_prob
SMOOTHED = ("sigmoid", "simpo")  # the types that read --label_smoothing (the others refuse it)


class CPO(ReferenceFree):
    name = "cpo"
    title = "CPO"
    summary = ("CPO: a preference loss without a reference model (--loss_type sigmoid, hinge, ipo, simpo) plus the "
               "chosen answer's NLL (--cpo_alpha) (docs/preference.md)")
    config = CPOConfig
    metrics = dpo.METRICS + ("nll_loss",)

    def validate(self, options: CPOConfig, data, training: dict, evaluation) -> list[str]:
        problems = super().validate(options, data, training, evaluation)
        problems += dpo.loss_type_problems(options.loss_type, options.label_smoothing, LOSSES, SMOOTHED)
        if options.cpo_alpha < 0:
            problems.append(f"cpo_alpha: must be 0 or more, got {options.cpo_alpha}")
        if options.simpo_gamma != CPOConfig.simpo_gamma and options.loss_type in LOSSES and options.loss_type != "simpo":
            problems.append(f"simpo_gamma: --loss_type {options.loss_type} does not use it; leave it out or use "
                            "--loss_type simpo")
        return problems

    def pair_terms(self, options: CPOConfig, sums, tokens):
        """The loss type's log-probabilities (summed, TRL's CPO default; the means for ipo and simpo, TRL's
        average_log_prob) and the chosen ones' means for the NLL."""
        import torch

        means = sums / tokens
        chosen, rejected = (means if options.loss_type in NORMALIZED else sums).chunk(2)
        chosen_mean = means.chunk(2)[0]
        losses = LOSSES[options.loss_type](chosen, rejected, options) - options.cpo_alpha * chosen_mean
        extra = (-chosen_mean.detach())[:, None]
        return losses, torch.cat([reward_values(options.beta, chosen, rejected), extra], dim=1)

    def describe(self, options: CPOConfig) -> str:
        gamma = f", gamma {options.simpo_gamma}" if options.loss_type == "simpo" else ""
        return (f"cpo: loss {options.loss_type}, beta {options.beta}{gamma}, cpo_alpha {options.cpo_alpha}, label "
                f"smoothing {options.label_smoothing}; no reference model")
