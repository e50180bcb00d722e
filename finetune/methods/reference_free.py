"""What the preference methods without a reference model share (SimPO, ORPO, CPO; docs/preference.md): DPO's pairs
and collator, and a loss of each pair's completion log-probabilities (length-normalized, or summed for CPO).

A micro-batch holds whole pairs, rows [chosen of pair 0..n-1, rejected of pair 0..n-1] (DPO's PairCollator), scored
in one forward at the completions' positions only (DPO's sequence scoring). A row's length-normalized log-probability
is the mean over its completion's trained tokens (labels != -100) of log p(token | everything before it). A
subclass turns those means into per-pair losses (`pair_losses`; one that reads the sums too overrides `pair_terms`); a step minimizes the mean over the pairs of the
GLOBAL batch, as DPO's does: each micro-batch contributes its pairs' loss sum over that count, so the split over
ranks and accumulation does not change the step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from finetune.methods import dpo
from finetune.methods.base import Context, Examples, Method, MethodConfig, PlannerTerms, Session, Window


@dataclass
class ReferenceFreeConfig(MethodConfig):
    beta: float = field(default=0.1, metadata={"help": "The scale of the preference term."})


class ReferenceFree(Method):
    """A preference loss of the pairs' length-normalized log-probabilities alone (no reference model)."""

    config = ReferenceFreeConfig
    paths = ("trainer", "loop")  # the engine path (scripts/sft.py) is not written for pairs yet, as for DPO
    own_evaluation = True
    metrics = dpo.METRICS
    unit = "pairs"

    def pair_losses(self, options, chosen, rejected) -> tuple:
        """(per-pair losses, [pairs, len(metrics)] detached per-pair metric values) of the pairs' length-normalized
        log-probabilities `chosen` and `rejected` (float32, with grad)."""
        raise NotImplementedError

    def pair_terms(self, options, sums, tokens) -> tuple:
        """pair_losses of the rows' completion log-probability `sums` ([chosen..., rejected...]) over their trained
        `tokens`: the length-normalized ones (TRL's average_log_prob)."""
        chosen, rejected = (sums / tokens).chunk(2)
        return self.pair_losses(options, chosen, rejected)

    def validate(self, options, data, training: dict, evaluation) -> list[str]:
        """The scale; what the pair data path does not support yet is refused by name, as for DPO."""
        problems = []
        if options.beta <= 0:
            problems.append(f"beta: must be positive, got {options.beta}")
        return problems + dpo.pair_data_problems(self.name, data, training, evaluation)

    def eval_metrics(self, evaluation) -> list[str]:
        return ["loss", *self.metrics]

    # DPO's pairs: the same records, tokens, cache and collator.
    def prepare(self, data, tokenizer, *, local_rank: int, log, seed: int = 42):
        return dpo.DPO().prepare(data, tokenizer, local_rank=local_rank, log=log, seed=seed)

    def collator(self, cfg, tokenizer):
        return dpo.DPO().collator(cfg, tokenizer)

    def count(self, batches: list[dict]):
        """The pairs (a step's loss is the mean over the pairs of the global batch)."""
        import torch

        return torch.tensor(dpo.pair_count(batches))

    def setup(self, options, model, tokenizer, examples: list[Examples | None], collator,
              context: Context) -> Session:
        return PairSession(self, options, context, collator)

    def planner_terms(self, options, *, use_peft: bool) -> PlannerTerms:
        return PlannerTerms(pairs=True, note=f"; {self.title}: 2 rows per pair, no reference model")

    def describe(self, options) -> str:
        return f"{self.name}: beta {options.beta}; no reference model"


def sums_and_tokens(model, batch: dict):
    """Per row of a pair batch: the sum of its completion's trained tokens' log-probabilities (grad where enabled),
    and how many they are."""
    from finetune.data.prepare import IGNORE_INDEX

    sums = dpo.sequence_logps(model, batch)
    # A pair's completions keep trained tokens through truncation (finetune.data.preference keeps half of
    # max_seq_length for them); the floor keeps a row without any at 0, as DPO's sum is, not NaN.
    tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1).clamp(min=1)
    return sums, tokens.to(sums.dtype)


def mean_logps(model, batch: dict):
    """Per row of a pair batch: the mean log-probability of its completion's trained tokens (grad where enabled)."""
    sums, tokens = sums_and_tokens(model, batch)
    return sums / tokens


def micro_batch_loss(method: ReferenceFree, options, model, batch: dict, n_pairs, window: Window | None = None):
    """This micro-batch's pairs' loss sum over `n_pairs` (the pairs of the global batch)."""
    import torch

    from finetune.data.preference import SCORED_INDEX, SCORED_POSITIONS

    batch = {k: batch[k] for k in ("input_ids", "attention_mask", "labels", SCORED_POSITIONS, SCORED_INDEX)
             if k in batch}
    losses, values = method.pair_terms(options, *sums_and_tokens(model, batch))
    if window is not None:
        n = torch.full((values.shape[0], 1), 1.0, dtype=torch.float64, device=values.device)
        window.add(torch.cat([values.double(), n], dim=1).sum(0))
    return losses.sum() / n_pairs


class PairSession(Session):
    def __init__(self, method: ReferenceFree, options, context: Context, collator):
        self.method, self.options, self.context, self.collator = method, options, context, collator
        self.window = Window(method.metrics)

    def loss(self, model, batch: dict, n_items, *, autocast=contextlib.nullcontext):
        return micro_batch_loss(self.method, self.options, model, batch, n_items, self.window)

    def metrics(self, reduce=None) -> dict:
        return self.window.pop(reduce)

    def evaluate(self, model, examples: Examples, batch_size: int, *, prefix: str = "eval") -> dict:
        """The loss and metrics over every eval pair, each exactly once over the ranks (every rank runs as many
        forwards, as ZeRO-3 needs): {eval_loss, eval_rewards/..., eval_samples, eval_runtime}."""
        import math
        import time

        import torch

        context, names = self.context, self.method.metrics
        start, n, world, rank = time.time(), len(examples.dataset), context.world(), context.rank()
        mine = list(range(rank, n, world))
        sums = torch.zeros(len(names) + 3, dtype=torch.float64)  # loss, index sum, metrics..., pairs
        model.eval()
        try:
            with torch.no_grad():
                for b in range(math.ceil(math.ceil(n / world) / batch_size)):
                    idx = mine[b * batch_size:(b + 1) * batch_size]
                    batch = self.collator([examples.dataset[i] for i in (idx or [0])])  # out of pairs: a forward for nothing
                    batch = {k: v.to(context.device) for k, v in batch.items()}
                    window = Window(names)
                    loss = micro_batch_loss(self.method, self.options, model, batch, 1, window)
                    if idx:
                        sums += torch.cat([torch.stack([loss.double().cpu(), torch.tensor(float(sum(idx)),
                                                                                          dtype=torch.float64)]),
                                           window.sums.cpu()])
        finally:
            model.train()
        return pair_eval_result(context, sums, n, names, prefix, start)

    def describe(self) -> str:
        return self.method.describe(self.options)


def pair_eval_result(context: Context, sums, n: int, names, prefix: str, start: float) -> dict[str, float]:
    """An evaluation's metrics from each rank's sums [loss, sum of pair indices, metrics..., pairs]: summed over
    the ranks, checked to cover every pair once, averaged per pair."""
    import time

    sums = context.all_sum(sums.to(context.device)).cpu()
    if float(sums[-1]) != n or float(sums[1]) != n * (n - 1) / 2:
        raise RuntimeError(f"evaluation covered {float(sums[-1]):.0f} of {n} pairs: a pair was counted twice or "
                           "lost")
    out = {"loss": float(sums[0]) / n}
    out.update({k: float(v) / n for k, v in zip(names, sums[2:-1].tolist())})
    out.update(samples=n, runtime=round(time.time() - start, 4))
    return {f"{prefix}_{k}": v for k, v in out.items()}


def reward_values(beta: float, chosen, rejected):
    """TRL's rewards of a method without a reference (CPO, SimPO, ORPO): β × the length-normalized log-probability;
    the per-pair values of dpo.METRICS (detached)."""
    import torch

    rc, rr = beta * chosen.detach(), beta * rejected.detach()
    return torch.stack([rc, rr, rc - rr, (rc > rr).to(rc.dtype), chosen.detach(), rejected.detach()], dim=1)
