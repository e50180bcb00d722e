"""Mixtral (MixtralForCausalLM: Mixtral-8x7B, 8x22B): Mistral's attention with a sparse MLP in every layer:
num_local_experts experts of intermediate_size, num_experts_per_tok routed per token, the router registered before
the experts. The router's auxiliary loss (output_router_logits) is added to the chunked loss as transformers adds
it (finetune.training.loss)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import ModelShape
from finetune.models.families.moe import MoeFamily


@dataclass(frozen=True)
class MixtralFamily(MoeFamily):
    def shape(self, d: dict[str, Any]) -> ModelShape:
        sh = super().shape(d)
        return dataclasses.replace(sh, num_experts=int(d.get("num_local_experts", 8)),
                                   experts_per_tok=int(d.get("num_experts_per_tok", 2)),
                                   moe_intermediate_size=sh.intermediate_size)


MIXTRAL = MixtralFamily(
    name="mixtral",
    model_types=("mixtral",),
    hf_classes=("MixtralForCausalLM",),
    router_first=True,
)
