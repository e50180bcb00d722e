"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama's layout with a bias on the q, k and v projections (always: Qwen2's
config has no switch for it; o_proj and the MLP have none). llama.cpp's "qwen2" architecture stores the biases as
attn_q.bias, attn_k.bias, attn_v.bias and keeps Q and K rows in HF's order (its Qwen2Model does not permute)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from finetune.models.families.base import Family, Linear, ModelShape
from finetune.models.families.llama import LlamaFamily

QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class Qwen2Family(LlamaFamily):
    def linears(self, sh: ModelShape) -> tuple[Linear, ...]:
        return tuple(dataclasses.replace(lin, bias=lin.name in QKV) for lin in super().linears(sh))

    def gguf_refusal(self, config) -> str | None:
        # Sliding-window layers: neither llama.cpp's qwen2 nor transformers' GGUF loader reads the window back, so
        # the file would compute another model on long inputs.
        if getattr(config, "use_sliding_window", False):
            return "use_sliding_window is set; the GGUF qwen2 architecture has no sliding window"
        return super().gguf_refusal(config)

    # No Q/K permutation: the file holds HF's layout.
    to_gguf = Family.to_gguf
    from_gguf = Family.from_gguf


QWEN2 = Qwen2Family(
    name="qwen2",
    model_types=("qwen2",),
    hf_classes=("Qwen2ForCausalLM",),
    gguf_arch="qwen2",
    gguf_required=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                   "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.weight"),
    chat_templates=("chatml",),
)
