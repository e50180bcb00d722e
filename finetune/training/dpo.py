"""DPO (--method dpo): the sigmoid preference loss over the pairs of finetune.data.preference.

A micro-batch holds whole pairs: rows [chosen of pair 0..n-1, rejected of pair 0..n-1] (PairCollator), scored in
one forward. A sequence's log-probability is the sum over its completion's trained tokens (labels != -100) of
log p(token | everything before it). With β = --beta and ε = --label_smoothing, per pair:

    d    = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    loss = -(1 - ε) log σ(β d) - ε log σ(-β d)

and a step minimizes the mean over the pairs of the GLOBAL batch (all ranks, all micro-batches): each micro-batch
contributes its pairs' loss sum over that count, as the SFT loss divides token sums by the global token count.
The reference is the LoRA model with its adapters disabled, a frozen copy of the model (full fine-tuning), or
log-probabilities computed once before training (--precompute_ref_log_probs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from finetune.data.prepare import IGNORE_INDEX

# Logged per logging window: TRL's names, so dashboards read them alike.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def scored_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions whose logits predict a trained token (label at p + 1), as one range for every row: the
    model's logits_to_keep, so prompts get no logits."""
    trained = (labels[:, 1:] != IGNORE_INDEX).any(0).nonzero().squeeze(1)
    return torch.arange(int(trained.min()), int(trained.max()) + 1, device=labels.device)


def completion_logps(logits: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per row: the sum of log p(label[p + 1]) over `positions` p (the logits' columns) with a trained label."""
    targets = labels[:, positions + 1]
    keep = targets != IGNORE_INDEX
    rows = logits[keep].float()  # only the scored positions in float32
    picked = rows.gather(1, targets[keep][:, None]).squeeze(1) - torch.logsumexp(rows, dim=-1)
    out = torch.zeros(labels.shape[0], dtype=picked.dtype, device=picked.device)
    return out.index_add(0, keep.nonzero()[:, 0], picked)


def sequence_logps(model, batch: dict) -> torch.Tensor:
    """The completion log-probability of every row of a pair batch under `model` (grad where enabled)."""
    positions = scored_positions(batch["labels"])
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=positions,
                use_cache=False)
    return completion_logps(out.logits, batch["labels"], positions)


def sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float = 0.0):
    """(per-pair losses, chosen rewards, rejected rewards); rewards are β × log-ratio to the reference, detached."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    d = beta * (chosen_ratio - rejected_ratio)
    losses = -(1 - label_smoothing) * F.logsigmoid(d) - label_smoothing * F.logsigmoid(-d)
    return losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()


@dataclass
class Options:
    beta: float = 0.1
    label_smoothing: float = 0.0


class Metrics:
    """Sums of the window's rewards, margins, accuracies and log-probs (this rank), reduced and averaged at log time."""

    def __init__(self):
        self.sums = None

    def add(self, chosen, rejected, reward_chosen, reward_rejected) -> None:
        values = torch.stack([reward_chosen.sum(), reward_rejected.sum(), (reward_chosen - reward_rejected).sum(),
                              (reward_chosen > reward_rejected).sum().to(reward_chosen.dtype),
                              chosen.detach().sum(), rejected.detach().sum(),
                              torch.tensor(float(len(chosen)), device=chosen.device, dtype=reward_chosen.dtype)])
        values = values.double()
        self.sums = values if self.sums is None else self.sums + values

    def pop(self, reduce=None) -> dict:
        """The window's means over every rank's pairs (`reduce` sums a tensor over ranks); the window restarts.
        Every rank must call it together when `reduce` is collective."""
        sums = self.sums if self.sums is not None else torch.zeros(7, dtype=torch.float64)
        self.sums = None
        if reduce is not None:
            sums = reduce(sums)
        n = max(float(sums[-1]), 1.0)
        return {name: float(v) / n for name, v in zip(METRICS, sums[:-1].tolist())}


def pair_count(batches: list[dict]) -> int:
    return sum(int(b["input_ids"].shape[0]) // 2 for b in batches)


def reference_context(model):
    """What makes `model` the reference: its LoRA adapters disabled (no second copy). A plain model has none."""
    if hasattr(model, "disable_adapter") and getattr(model, "peft_config", None):
        return model.disable_adapter()
    return contextlib.nullcontext()


def micro_batch_loss(policy, batch: dict, reference, options: Options, n_pairs, metrics: Metrics | None = None,
                     autocast=contextlib.nullcontext):
    """This micro-batch's pairs' loss sum over `n_pairs` (the pairs of the global batch). `policy` is the (wrapped)
    model trained; `reference` computes the reference log-probs of the batch (a callable), unless the batch carries
    them (`ref_logps`, precomputed)."""
    logps = sequence_logps(policy, batch)
    if "ref_logps" in batch:
        ref = batch["ref_logps"].to(logps.device, logps.dtype)
    else:
        with torch.no_grad(), autocast():
            ref = reference(batch).to(logps.dtype)
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    losses, reward_chosen, reward_rejected = sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected,
                                                          options.beta, options.label_smoothing)
    if metrics is not None:
        metrics.add(chosen, rejected, reward_chosen, reward_rejected)
    return losses.sum() / n_pairs
