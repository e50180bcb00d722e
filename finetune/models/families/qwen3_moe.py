"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, head_dim 128)
with a sparse MLP of num_experts experts of moe_intermediate_size, num_experts_per_tok routed per token, the router
registered after the experts; a layer in mlp_only_layers (or off the decoder_sparse_step) has a dense MLP of
intermediate_size. The router's auxiliary loss (output_router_logits) is added to the chunked loss as transformers
adds it (finetune.training.loss).

GGUF (llama.cpp's "qwen3moe"): Qwen3's tensors, the router as ffn_gate_inp and the experts stacked, one tensor per
projection: transformers 5's fused experts.gate_up_proj [experts, 2 x width, hidden] is split into ffn_gate_exps and
ffn_up_exps (gate first), experts.down_proj is ffn_down_exps as it is. The expert width is
expert_feed_forward_length, which transformers' loader does not read (gguf_config sets it). llama.cpp's qwen3moe
has no dense layers and always renormalises the top-k weights: other models are refused."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import Family, ModelShape, Saving, Tensor
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

    # ---- GGUF ----

    def gguf_refusal(self, config) -> str | None:
        sh = self.shape(config.to_dict())
        if sh.dense_layers:
            return (f"dense MLP layers {list(sh.dense_layers)} (mlp_only_layers / decoder_sparse_step): llama.cpp's "
                    "qwen3moe has experts in every layer")
        if not config.norm_topk_prob:
            return "norm_topk_prob is off: llama.cpp's qwen3moe always renormalises the top-k routing weights"
        if getattr(config, "attention_bias", False):
            return "attention_bias is set; llama.cpp's qwen3moe has no attention biases"
        return super().gguf_refusal(config)

    def gguf_metadata(self, config) -> list[tuple[str, Any]]:
        sh = self.shape(config.to_dict())
        meta = [m for m in super().gguf_metadata(config) if m[0] not in ("add_key_length", "add_value_length")]
        # Always the head size (transformers' loader reads key_length as head_dim, else takes its own default).
        return meta + [("add_key_length", sh.head_dim), ("add_value_length", sh.head_dim),
                       ("add_expert_count", sh.num_experts), ("add_expert_used_count", sh.experts_per_tok),
                       ("add_expert_feed_forward_length", sh.moe_intermediate_size)]

    def gguf_config(self, meta: dict[str, Any]) -> dict[str, Any]:
        return {"moe_intermediate_size": meta[f"{self.gguf_arch}.expert_feed_forward_length"]}

    # No Q/K permutation: the file holds HF's layout.
    to_gguf = Family.to_gguf
    from_gguf = Family.from_gguf


QWEN3_MOE = Qwen3MoeFamily(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    hf_classes=("Qwen3MoeForCausalLM",),
    gguf_arch="qwen3moe",
    gguf_required=("model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight",
                   "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.down_proj"),
    chat_templates=("chatml",),
)
