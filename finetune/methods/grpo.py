"""GRPO (--method grpo, docs/grpo.md): online reinforcement learning with rewards the run computes, as TRL 1.16's
GRPOTrainer (Shao et al. 2024; the loss aggregations of Dr. GRPO and DAPO).

A micro-batch is a batch of prompts (finetune.data.prompts). At each optimizer step, the model being trained
samples --num_generations completions of every prompt (finetune.methods.generation), the reward functions score
them (finetune.methods.rewards, weighted and summed), and each completion's advantage is its reward less its
group's mean (the completions of one prompt), over the group's std (--scale_rewards group), the std of the step's
whole batch of generations, every rank's (batch: TRL's generation batch), or not scaled (none). With
r = exp(log p(token) - log p_old(token)), p_old the model as it generated the completions, A the advantage, ε_low = --epsilon, ε_high = --epsilon_high (ε_low if unset) and β = --beta, per completion token:

    loss_t = -min(r A, clip(r, 1 - ε_low, 1 + ε_high) A) + β (exp(ref - logp) - (ref - logp) - 1)

and --loss_type aggregates them over the GLOBAL batch (all ranks, all micro-batches):

    grpo     each completion's token mean, then the mean over completions
    dr_grpo  the token sum over (completions x --max_completion_length)
    dapo     the token sum over the completion tokens (TRL's default)
    bnpo     as dapo (TRL's bnpo divides by one micro-batch's tokens; over the global batch the two coincide)

The step's completions are made where a path first holds every micro-batch of the step, Method.count (TRL's
generation batch): the dapo/bnpo normalizer is the number of completion tokens, known only once they exist.
--num_iterations μ > 1 trains μ optimizer steps in a row on one batch of generations, as TRL: the data order repeats
each step's prompts μ times (Method.repeats), the first of the μ steps generates and keeps the completions with their
advantages and p_old (scored once, at generation), and the next μ - 1 steps reuse them (r moves away from 1 and
the clip acts). With μ = 1, p_old is the model being trained, detached (r = 1), as TRL.
Sampling is seeded per (--seed, step, prompt, generation index), so the completions do not depend on how the
prompts are split over processes. The reference (--beta > 0) is DPO's: the LoRA model with its adapters disabled,
or a frozen copy of full fine-tuning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from finetune.errors import did_you_mean
from finetune.methods.base import (
    Context,
    Examples,
    Method,
    MethodConfig,
    PlannerTerms,
    Session,
)
from finetune.methods.generation import weighted_rewards

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALES = ("group", "batch", "none")
# Logged per logging window (TRL's names); per reward function also rewards/<name>/mean and rewards/<name>/std.
METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
           "clip_ratio/region_mean", "kl")


@dataclass
class GRPOConfig(MethodConfig):
    """GRPO's flags (--method grpo; docs/grpo.md), named as TRL 1.16's GRPOConfig names them"""

    reward_funcs: list[str] = field(default_factory=list, metadata={
        "help": "GRPO/RLOO: the reward functions, one or more: json_valid, json_fields, exact_match, length_penalty, "
                "regex:PATTERN, or path/to/file.py:name (a function of yours: the file is imported, so its code RUNS; "
                "docs/grpo.md)."})
    reward_weights: list[float] | None = field(default=None, metadata={
        "help": "GRPO/RLOO: one weight per reward function (default 1 each); the reward is the weighted sum."})
    num_generations: int = field(default=8, metadata={
        "help": "GRPO/RLOO: completions sampled per prompt (a group); each micro-batch of P prompts trains P x this."})
    temperature: float = field(default=1.0, metadata={"help": "GRPO/RLOO: the sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "GRPO/RLOO: nucleus sampling's probability mass, in (0, 1]."})
    max_completion_length: int = field(default=256, metadata={
        "help": "GRPO/RLOO: the longest completion, in tokens (sampling stops earlier at EOS / end of turn)."})
    epsilon: float = field(default=0.2, metadata={"help": "GRPO/RLOO: the ratio's lower clip, 1 - epsilon."})
    epsilon_high: float | None = field(default=None, metadata={
        "help": "GRPO/RLOO: the ratio's upper clip, 1 + epsilon_high (default: epsilon; DAPO recommends 0.28)."})
    num_iterations: int = field(default=1, metadata={
        "help": "GRPO/RLOO: optimizer steps per batch of generations (TRL's μ): each step's prompts train this many "
                "steps in a row, on the same completions, the ratio to the model that generated them clipped."})
    beta: float = field(default=0.0, metadata={
        "help": "GRPO: the KL coefficient to the reference (0: no reference; LoRA: the adapters disabled, full "
                "fine-tuning: a frozen copy)."})
    scale_rewards: str = field(default="group", metadata={
        "help": "GRPO: advantages over the group's reward std (group), the whole step's, every process's (batch), or "
                "unscaled (none)."})
    loss_type: str = field(default="dapo", metadata={"help": "GRPO: the loss aggregation: grpo, dr_grpo, dapo, bnpo."})
    nonfinite_rewards: str = field(default="stop", metadata={
        "help": "GRPO/RLOO: a reward of NaN or ±inf: stop the run naming the reward and the record (stop), or leave "
                "it out as not scored and report the share at every logging step, rewards/<name>/nonfinite (skip)."})


def generation_problems(method: str, options, data, training: dict, evaluation) -> list[str]:
    """The checks GRPO and RLOO share: their flags, and what the prompt data path does not support."""
    from finetune.methods import rewards

    problems = []
    if not options.reward_funcs:
        problems.append(f"reward_funcs: --method {method} needs at least one, e.g. --reward_funcs json_fields "
                        "(built-ins: " + ", ".join(rewards.BUILTINS) + ", regex:PATTERN, path/to/file.py:name)")
    for spec in options.reward_funcs:
        try:
            rewards.load(spec)
        except rewards.RewardError as e:
            problems.append(str(e))
    if options.reward_weights is not None and len(options.reward_weights) != len(options.reward_funcs):
        problems.append(f"reward_weights: {len(options.reward_weights)} weights for {len(options.reward_funcs)} "
                        "reward functions; give one per function")
    elif options.reward_weights is not None and not all(math.isfinite(w) for w in options.reward_weights):
        problems.append(f"reward_weights: every weight must be a finite number, got "
                        f"{', '.join(f'{w:g}' for w in options.reward_weights)}")
    if options.nonfinite_rewards not in rewards.NONFINITE:
        problems.append(f"nonfinite_rewards: one of {', '.join(rewards.NONFINITE)}, got '{options.nonfinite_rewards}'"
                        f"{did_you_mean(options.nonfinite_rewards, list(rewards.NONFINITE))}")
    if options.num_generations < 2:
        problems.append(f"num_generations: at least 2 (a group's baseline needs two completions), got "
                        f"{options.num_generations}")
    if options.temperature <= 0:
        problems.append(f"temperature: must be positive, got {options.temperature}")
    if not 0 < options.top_p <= 1:
        problems.append(f"top_p: must be in (0, 1], got {options.top_p}")
    if options.max_completion_length < 1:
        problems.append(f"max_completion_length: must be positive, got {options.max_completion_length}")
    if options.epsilon < 0 or (options.epsilon_high is not None and options.epsilon_high < 0):
        problems.append("epsilon / epsilon_high: must not be negative")
    if options.num_iterations < 1:
        problems.append(f"num_iterations: at least 1, got {options.num_iterations}")
    elif options.num_iterations > 1:
        problems += checkpoint_problems(options.num_iterations, training)
    if options.beta < 0:
        problems.append(f"beta: must not be negative, got {options.beta}")
    for flag, on in (("packing", data.packing), ("padding_free", data.padding_free),
                     ("eval_generate", bool(evaluation and evaluation.eval_generate)),
                     ("use_liger_kernel", bool(training.get("use_liger_kernel"))),
                     ("remove_unused_columns", bool(training.get("remove_unused_columns")))):
        if on:
            problems.append(f"{flag}: not supported with --method {method}")
    if isinstance(data.dataset, list):
        problems.append(f"dataset: --method {method} takes one --dataset (mixing data sets is not supported yet)")
    return problems


def checkpoint_problems(mu: int, training: dict) -> list[str]:
    """Checkpoints only where a batch of generations is used up: a checkpoint in the middle of its --num_iterations
    steps would resume without the completions (and p_old) the next steps train on, and could not repeat the run."""
    strategy = getattr(training.get("save_strategy"), "value", training.get("save_strategy"))
    key = {"steps": "save_steps", "best": "eval_steps"}.get(strategy)
    every = training.get(key) if key else None
    if every is None or (float(every) >= 1 and float(every) % mu == 0):
        return []
    return [f"{key}: a multiple of --num_iterations ({mu}) with it, got {every:g} (a checkpoint between the steps of one "
            f"batch of generations could not resume it exactly)"]


# ----------------------------------------------------------------------------------------------
# The numbers: advantages and the loss (tests/test_grpo.py compares them with TRL's own code).


def group_advantages(rewards, num_generations: int, scale_rewards: str = "group", all_sum=None):
    """TRL's sum_then_normalize: the reward less its group's mean, over the std (group's or batch's, unbiased) + 1e-4,
    NaN rewards (no function scored it) left out of the baseline and given advantage 0. `rewards`: [n] float, this
    rank's share of the batch; `all_sum` sums a tensor over the ranks (the batch's std is every rank's)."""
    import torch

    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = batch_stats(rewards, all_sum)[1].expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), std


def batch_stats(x, all_sum=None):
    """(NaN-ignoring mean, unbiased std) of `x` [n] over every rank's x (`all_sum`: a sum over the ranks; None: this
    rank's only): TRL's nanmean and nanstd of the gathered batch, by sums (two all-reduces, no gather). The std of
    fewer than two values is 0, as TRL's."""
    import torch

    def summed(t):
        return t if all_sum is None else all_sum(t)

    totals = summed(torch.stack([torch.nansum(x), (~torch.isnan(x)).sum().to(x.dtype)]))
    mean = totals[0] / totals[1]
    squares = summed(torch.nansum((x - mean) ** 2).reshape(1))[0]
    std = torch.sqrt(squares / (totals[1] - 1)) if totals[1] > 1 else torch.zeros((), dtype=x.dtype)
    return mean, std


def nanstd(x, dim=None):
    """The unbiased std ignoring NaN (TRL's trl.trainer.utils.nanstd)."""
    import torch

    if dim is None:
        mean = torch.nanmean(x)
        var = torch.nanmean((x - mean) ** 2)
        count = torch.sum(~torch.isnan(x))
    else:
        mean = torch.nanmean(x, dim=dim, keepdim=True)
        var = torch.nanmean((x - mean) ** 2, dim=dim)
        count = torch.sum(~torch.isnan(x), dim=dim)
    return torch.sqrt(var * count / (count - 1))


def token_loss(logps, old_logps, ref_logps, advantages, epsilon_low: float, epsilon_high: float, beta: float):
    """(per-token loss [n, T], the ratio [n, T], per-token KL or None) of the clipped surrogate plus β KL."""
    import torch

    ratio = torch.exp(logps - old_logps)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * a)
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl
    return per_token, ratio, kl


def aggregate(per_token, mask, loss_type: str, max_completion_length: int):
    """The numerator of the loss over the global batch: divided by Method.count's normalizer of `loss_type`
    (completions for grpo and dr_grpo, completion tokens for dapo and bnpo)."""
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type == "dr_grpo":
        return masked.sum() / max_completion_length
    return masked.sum()  # dapo, bnpo


# ----------------------------------------------------------------------------------------------
# The method.


class GRPO(Method):
    name = "grpo"
    title = "GRPO"
    summary = "Group Relative Policy Optimization: generates, scores with reward functions, trains (docs/grpo.md)"
    config = GRPOConfig
    paths = ("trainer", "loop")  # the engine path (scripts/sft.py) does not generate
    own_evaluation = True
    generates = True
    metrics = METRICS
    unit = "prompts"

    def validate(self, options, data, training: dict, evaluation) -> list[str]:
        problems = generation_problems(self.name, options, data, training, evaluation)
        if options.loss_type not in LOSS_TYPES:
            problems.append(f"loss_type: one of {', '.join(LOSS_TYPES)}, got '{options.loss_type}'")
        if options.scale_rewards not in SCALES:
            problems.append(f"scale_rewards: one of {', '.join(SCALES)}, got '{options.scale_rewards}'")
        return problems

    def eval_metrics(self, evaluation) -> list[str]:
        # loss: minus the reward (the default best-model metric is the loss, lower better).
        return ["loss", "reward", "completions/mean_length"]

    def prepare(self, data, tokenizer, *, local_rank: int, log, seed: int = 42):
        from finetune.data.prompts import prepare_prompts

        dataset, stats = prepare_prompts(data, tokenizer)
        return dataset, stats, None

    def examples(self, dataset, key: str | None) -> Examples:
        """The prompts numbered (`prompt_index`: their columns, and their sampling seeds)."""
        return Examples(dataset.add_column("prompt_index", list(range(len(dataset)))), key)

    def collator(self, cfg, tokenizer):
        from finetune.methods.generation import PromptCollator

        return PromptCollator(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

    def count(self, batches: list[dict]):
        """The step's completions are made here (module docstring); then the loss's normalizer: completions (grpo,
        dr_grpo) or completion tokens (dapo, bnpo) of `batches`."""
        import torch

        session = self.session
        session.rollouts(batches)
        return torch.tensor(sum(session.normalizer(batch) for batch in batches))

    def repeats(self, options) -> int:
        return options.num_iterations

    def loss_normalizer(self, options) -> str:
        return "tokens" if options.loss_type in ("dapo", "bnpo") else "completions"

    def setup(self, options, model, tokenizer, examples, collator, context: Context) -> Session:
        from finetune.methods.generation import RolloutSession

        self.session = RolloutSession(self, options, model, tokenizer, examples, context)
        return self.session

    def planner_terms(self, options, *, use_peft: bool) -> PlannerTerms:
        copy = options.beta > 0 and not use_peft
        ref = ("; reference: a frozen copy of the model" if copy else
               "; reference: the base, adapters disabled" if options.beta > 0 else "")
        return PlannerTerms(reference_copy=copy, generations=options.num_generations,
                            completion_length=options.max_completion_length,
                            note=f"; {self.title}: {options.num_generations} completions per prompt of up to "
                                 f"{options.max_completion_length} tokens, KV cache of each{ref}")

    # -- what RLOO changes -----------------------------------------------------------------------

    def weighted(self, options, per_func, weights, kl=None):
        """[n] the reward each completion is trained on: the weighted sum of the functions' rewards."""
        return weighted_rewards(per_func, weights)

    def advantages(self, options, rewards, all_sum=None):
        """(advantages [n], the std each was scaled by [n]) of this rank's rewards [n] of a step (`all_sum`: a sum
        over the ranks, for what is computed over the whole batch)."""
        return group_advantages(rewards, options.num_generations, options.scale_rewards, all_sum)

    def needs_old_logps(self, options) -> bool:
        """Whether the rollout scores its completions under the model as it generated them (p_old): for the steps
        that reuse them (--num_iterations > 1); RLOO's KL reward too."""
        return options.num_iterations > 1

    def completion_loss(self, options, logps, old_logps, ref_logps, advantages, mask):
        """(numerator over the count, ratio, per-token KL or None) of one micro-batch's completions."""
        eps_high = options.epsilon if options.epsilon_high is None else options.epsilon_high
        per_token, ratio, kl = token_loss(logps, old_logps, ref_logps, advantages, options.epsilon, eps_high,
                                          options.beta)
        return aggregate(per_token, mask, options.loss_type, options.max_completion_length), ratio, kl

    def reference_in_loss(self, options) -> bool:
        """Whether the loss needs the reference's per-token log-probabilities (GRPO's KL term)."""
        return options.beta > 0
