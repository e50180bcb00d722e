"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, head_dim 128)
with a sparse MLP of num_experts experts of moe_intermediate_size, num_experts_per_tok routed per token, the router
registered after the experts; a layer in mlp_only_layers (or off the decoder_sparse_step) has a dense MLP of
intermediate_size. The router's auxiliary loss (output_router_logits) is added to the chunked loss as transformers
adds it (finetune.training.loss)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import ModelShape, Saving, Tensor
from finetune.models.families.moe import MoeFamily
from finetune.models.families.qwen3 import HEAD_DIM, qk_norms_saved


@dataclass(frozen=True)
class Qwen3MoeFamily(MoeFamily):
    def shape(self, d: dict[str, Any]) -> ModelShape:
        sh = super().shape(d)
        step = int(d.get("decoder_sparse_step", 1) or 1)
        only = set(d.get("mlp_only_layers") or [])
        dense = tuple(k for k in range(sh.num_layers) if k in only or (k + 1) % step != 0)
        return dataclasses.replace(sh, head_dim=int(d.get("head_dim") or HEAD_DIM),
                                   num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 128),  # v5 writes the latter
                                   experts_per_tok=int(d.get("num_experts_per_tok", 8)),
                                   moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
                                   dense_layers=dense)

    def layer_tensors(self, sh: ModelShape, layer: int, p: str) -> list[Tensor]:
        out = super().layer_tensors(sh, layer, p)
        at = len(self.linears(sh))  # the q/k norms come after the attention's projections
        return out[:at] + [Tensor(p + "self_attn.q_norm.weight", (sh.head_dim,), "norm"),
                           Tensor(p + "self_attn.k_norm.weight", (sh.head_dim,), "norm")] + out[at:]

    def layer_saved_extra(self, sh: ModelShape, run: Saving) -> int:
        return super().layer_saved_extra(sh, run) + qk_norms_saved(sh, run.a, run.trains_weights)


QWEN3_MOE = Qwen3MoeFamily(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    hf_classes=("Qwen3MoeForCausalLM",),
)
