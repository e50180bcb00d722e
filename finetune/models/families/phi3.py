"""Phi-3 (Phi3ForCausalLM): fused projections: self_attn.qkv_proj (q, k, v rows stacked) and mlp.gate_up_proj
(gate, up rows stacked), registered after o_proj and before down_proj; no biases, untied embeddings (Phi-3-mini).
LoRA targets the fused modules by their own names (qkv_proj, gate_up_proj), as peft sees them."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.models.families.base import Linear, ModelShape
from finetune.models.families.llama import LlamaFamily


@dataclass(frozen=True)
class Phi3Family(LlamaFamily):
    def linears(self, sh: ModelShape) -> tuple[Linear, ...]:
        h, q, kv, i = sh.hidden_size, sh.q_dim, sh.kv_dim, sh.intermediate_size
        return (
            Linear("o_proj", "self_attn", h, q, False, "attn_out"),
            Linear("qkv_proj", "self_attn", q + 2 * kv, h, False, "attn_in"),
            Linear("gate_up_proj", "mlp", 2 * i, h, False, "mlp_in"),
            Linear("down_proj", "mlp", h, i, False, "mlp_act"),
        )



PHI3 = Phi3Family(
    name="phi3",
    model_types=("phi3",),
    hf_classes=("Phi3ForCausalLM",),
)
