"""Phi-3 (Phi3ForCausalLM): fused projections: self_attn.qkv_proj (q, k, v rows stacked) and mlp.gate_up_proj
(gate, up rows stacked), registered after o_proj and before down_proj; no biases, untied embeddings (Phi-3-mini).
LoRA targets the fused modules by their own names (qkv_proj, gate_up_proj), as peft sees them."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.models.families.base import Family, Linear, ModelShape, Saving
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

    def attention_saved(self, sh: ModelShape, run: Saving, layer: int) -> int:
        """Llama's, but v is a slice of qkv_proj's output: where SDPA saves v unrepeated (no mask, or as many key/value
        heads as heads) it keeps the whole fused output alive (q + 2 kv, not kv). q is rotated from a slice, so the
        kernel's output comes back in head-major order and o_proj's input is a copy, kept where o_proj saves its
        input. (The MLP's gate and up are halves of gate_up_proj's output: the same 2 x intermediate as Llama's.)"""
        out = Family.attention_saved(self, sh, run, layer)
        repeated = self.attention_masked(sh, run, layer) and sh.num_kv_heads != sh.num_heads
        per_token = (0 if repeated else run.a * (sh.q_dim + sh.kv_dim)) + (run.a * sh.q_dim if run.o_input_kept else 0)
        return out + run.tokens * per_token



PHI3 = Phi3Family(
    name="phi3",
    model_types=("phi3",),
    hf_classes=("Phi3ForCausalLM",),
)
