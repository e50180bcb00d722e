"""Sampling with a seed per request, inside one batched greedy `generate` call (used by `finetune serve`).

transformers samples every row of a batch from one random generator (`torch.multinomial` on the batch's
probabilities), so a row's sample depends on the rows beside it, and its continuous batching does the same across
the running requests. Here each row has its own `torch.Generator` seeded with its request's seed: a logits processor
warps the row's scores as transformers' sampling does (temperature, then nucleus top_p), draws the row's token with
`torch.multinomial` from that generator, and leaves only that token possible, so the greedy step of `generate` picks
it. One `torch.multinomial` call on one row of probabilities draws what transformers' `generate(do_sample=True)`
draws for a batch of one after `torch.manual_seed(seed)` (or `transformers.set_seed(seed)`): a request's tokens
equal that reference's on the same prompt, alone or batched with others. Rows without sampling stay greedy.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    """A request's sampling: temperature above 0, nucleus top_p in (0, 1], and the seed of its generator."""

    temperature: float
    top_p: float = 1.0
    seed: int | None = None  # None: a random seed, drawn when the request is generated


SEED_LIMIT = 2**63  # torch's generators take 64-bit seeds; OpenAI's `seed` is a 64-bit signed integer


class RowSampler:
    """A LogitsProcessor for a batch: row i sampled by `samplings[i]` with its own generator, or left greedy (None)."""

    def __init__(self, samplings: list[Sampling | None]):
        import torch
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.rows = []
        for s in samplings:
            if s is None:
                self.rows.append(None)
                continue
            seed = s.seed if s.seed is not None else secrets.randbelow(SEED_LIMIT)
            # The warpers transformers' generate(do_sample=True) adds, in its order, under the same conditions.
            warpers = ([TemperatureLogitsWarper(s.temperature)] if s.temperature != 1.0 else []) + (
                [TopPLogitsWarper(top_p=s.top_p, min_tokens_to_keep=1)] if s.top_p < 1.0 else [])
            self.rows.append([seed, None, warpers])  # the generator is made on the scores' device

    def __call__(self, input_ids, scores):
        import torch

        scores = scores.clone()
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            seed, generator, warpers = row
            if generator is None:
                generator = row[1] = torch.Generator(device=scores.device)
                generator.manual_seed(seed)
            s = scores[i : i + 1]
            for warp in warpers:
                s = warp(input_ids[i : i + 1], s)
            probs = torch.nn.functional.softmax(s, dim=-1)
            token = torch.multinomial(probs, num_samples=1, generator=generator).item()
            scores[i] = float("-inf")
            scores[i, token] = 0.0
        return scores
