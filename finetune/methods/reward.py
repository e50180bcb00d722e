"""Reward modelling (--method reward, docs/preference.md "Reward models"): a sequence-classification head of one
output on the model (transformers' *ForSequenceClassification, num_labels=1: the reward is the head's output at each
sequence's last non-pad token) trained on DPO's pairs with the Bradley-Terry loss (TRL's RewardTrainer).

With r_c and r_r the rewards of a pair's chosen and rejected sequences (prompt + completion, tokenized as DPO
tokenizes them), m its optional `margin` column (0 where the record has none) and c = --center_rewards_coefficient,
per pair:

    loss = -log σ(r_c - r_r - m) + c (r_c + r_r)²

and a step minimizes the mean over the pairs of the GLOBAL batch, as DPO's does. TRL's compute_loss takes the same
mean over one batch (its centering term is the batch mean of (r_c + r_r)², the same sum over the same pairs).
Logged: accuracy (r_c > r_r), margin (r_c - r_r), mean_reward (TRL's names), rewards/chosen, rewards/rejected.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from finetune.methods import dpo
from finetune.methods.base import Context, Examples, Method, MethodConfig, PlannerTerms, Session, Window
from finetune.methods.reference_free import pair_eval_result

METRICS = ("accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected")


@dataclass
class RewardConfig(MethodConfig):
    """Reward modelling's flags (--method reward; docs/preference.md)"""

    center_rewards_coefficient: float = field(default=0.0, metadata={
        "help": "reward: the weight of the term c (r_chosen + r_rejected)^2 that keeps the rewards centred on zero "
                "(TRL's center_rewards_coefficient; 0, TRL's None, leaves it out; 0.01 is the value of Eisenstein "
                "et al. 2023 that TRL suggests)."})


def pair_losses(rewards, margin, center: float):
    """Per-pair losses of the rewards of a pair batch (rows: chosen..., rejected...), float32."""
    import torch.nn.functional as F

    chosen, rejected = rewards.chunk(2)
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center:
        losses = losses + center * (chosen + rejected) ** 2
    return losses


def rewards_of(model, batch: dict):
    """The reward of every row of a pair batch (grad where enabled): the head's output at its last non-pad token."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return out.logits.squeeze(-1).float()


def micro_batch_loss(options: RewardConfig, model, batch: dict, n_pairs, window: Window | None = None):
    """This micro-batch's pairs' loss sum over `n_pairs` (the pairs of the global batch)."""
    import torch

    rewards = rewards_of(model, batch)
    n = rewards.shape[0] // 2
    margin = batch["margin"].to(rewards) if "margin" in batch else torch.zeros(n, dtype=rewards.dtype,
                                                                                device=rewards.device)
    losses = pair_losses(rewards, margin, options.center_rewards_coefficient)
    if window is not None:
        chosen, rejected = rewards.detach().double().chunk(2)
        values = torch.stack([(chosen > rejected).double(), chosen - rejected, (chosen + rejected) / 2, chosen,
                              rejected, torch.ones_like(chosen)], dim=1)
        window.add(values.sum(0))
    return losses.sum() / n_pairs


class Reward(Method):
    name = "reward"
    title = "reward modelling"
    summary = ("reward model: a one-output sequence-classification head trained on {prompt, chosen, rejected} pairs "
               "with the Bradley-Terry loss (docs/preference.md)")
    config = RewardConfig
    paths = ("trainer", "loop")  # the engine path (scripts/sft.py) is not written for pairs yet, as for DPO
    own_evaluation = True
    metrics = METRICS
    unit = "pairs"
    task = "SEQ_CLS"

    def validate(self, options: RewardConfig, data, training: dict, evaluation) -> list[str]:
        problems = []
        if options.center_rewards_coefficient < 0:
            problems.append(f"center_rewards_coefficient: must be 0 or more, got {options.center_rewards_coefficient}")
        return problems + dpo.pair_data_problems(self.name, data, training, evaluation)

    def eval_metrics(self, evaluation) -> list[str]:
        return ["loss", *self.metrics]

    def prepare(self, data, tokenizer, *, local_rank: int, log, seed: int = 42):
        """DPO's pairs (the same records, tokens and truncation), with each pair's margin."""
        from finetune.data.preference import prepare_pairs

        return prepare_pairs(data, tokenizer, local_rank=local_rank, log=log, margin=True)

    def collator(self, cfg, tokenizer):
        from finetune.data.preference import PairCollator

        return PairCollator(tokenizer.pad_token_id)

    def count(self, batches: list[dict]):
        import torch

        return torch.tensor(dpo.pair_count(batches))

    def setup(self, options: RewardConfig, model, tokenizer, examples: list[Examples | None], collator,
              context: Context) -> Session:
        # The head reads each row's reward at its last token that is not the pad id (transformers'
        # *ForSequenceClassification): the config carries the tokenizer's pad id, saved with it, so batched scoring
        # after training reads the same token.
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        return RewardSession(options, context, collator)

    def planner_terms(self, options: RewardConfig, *, use_peft: bool) -> PlannerTerms:
        return PlannerTerms(pairs=True, head_outputs=1,
                            note="; reward model: 2 rows per pair, a score head of 1 output in place of the LM head")


class RewardSession(Session):
    def __init__(self, options: RewardConfig, context: Context, collator):
        self.options, self.context, self.collator = options, context, collator
        self.window = Window(METRICS)

    def loss(self, model, batch: dict, n_items, *, autocast=contextlib.nullcontext):
        return micro_batch_loss(self.options, model, batch, n_items, self.window)

    def metrics(self, reduce=None) -> dict:
        return self.window.pop(reduce)

    def evaluate(self, model, examples: Examples, batch_size: int, *, prefix: str = "eval") -> dict:
        """The loss and metrics over every eval pair, each exactly once over the ranks (every rank runs as many
        forwards, as ZeRO-3 needs): {eval_loss, eval_accuracy, eval_margin, ..., eval_samples, eval_runtime}."""
        import math
        import time

        import torch

        context = self.context
        start, n, world, rank = time.time(), len(examples.dataset), context.world(), context.rank()
        mine = list(range(rank, n, world))
        sums = torch.zeros(len(METRICS) + 3, dtype=torch.float64)  # loss, index sum, metrics..., pairs
        model.eval()
        try:
            with torch.no_grad():
                for b in range(math.ceil(math.ceil(n / world) / batch_size)):
                    idx = mine[b * batch_size:(b + 1) * batch_size]
                    batch = self.collator([examples.dataset[i] for i in (idx or [0])])  # out of pairs: a forward for nothing
                    batch = {k: v.to(context.device) for k, v in batch.items()}
                    window = Window(METRICS)
                    loss = micro_batch_loss(self.options, model, batch, 1, window)
                    if idx:
                        sums += torch.cat([torch.stack([loss.double().cpu(),
                                                        torch.tensor(float(sum(idx)), dtype=torch.float64)]),
                                           window.sums.cpu()])
        finally:
            model.train()
        return pair_eval_result(context, sums, n, METRICS, prefix, start)

    def describe(self) -> str:
        return (f"reward: Bradley-Terry loss, margin column where the data has one, center_rewards_coefficient "
                f"{self.options.center_rewards_coefficient}")
