"""Phi-3 (Phi3ForCausalLM): fused projections: self_attn.qkv_proj (q, k, v rows stacked) and mlp.gate_up_proj
(gate, up rows stacked), registered after o_proj and before down_proj; no biases, untied embeddings (Phi-3-mini).
LoRA targets the fused modules by their own names (qkv_proj, gate_up_proj), as peft sees them.

GGUF (llama.cpp's "phi3"): the fused tensors as they are (attn_qkv; gate_up as ffn_up, which llama.cpp's SwiGLU
splits gate first, as HF does), Q/K rows in HF's order (NEOX rope), an output tensor always. A sliding window is
the attention.sliding_window key, which transformers' loader does not read for phi3 (gguf_config sets it, and the
padding id from the file, not Phi3Config's default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import Family, Linear, ModelShape, Saving, rope_parameters
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

    def gguf_refusal(self, config) -> str | None:
        partial = float(rope_parameters(config).get("partial_rotary_factor") or 1.0)
        if partial != 1.0:
            # transformers' loader reads no rope.dimension_count for phi3, so a partial rotary could not be verified.
            return (f"partial_rotary_factor {partial}: transformers' GGUF loader reads phi3 "
                    "files with a full rotary only, so the file could not be verified")
        if config.tie_word_embeddings:
            return "tied embeddings: llama.cpp's phi3 needs an output tensor of its own"
        return super().gguf_refusal(config)

    def gguf_metadata(self, config) -> list[tuple[str, Any]]:
        head_dim = config.hidden_size // config.num_attention_heads
        meta = self.gguf_size_metadata(config) + [
            ("add_rope_dimension_count", head_dim),
            ("add_rope_freq_base", float(rope_parameters(config)["rope_theta"])),
        ]
        if getattr(config, "original_max_position_embeddings", None):
            meta.append(("add_rope_scaling_orig_ctx_len", config.original_max_position_embeddings))
        if getattr(config, "sliding_window", None):
            meta.append(("add_sliding_window", config.sliding_window))
        return meta

    def gguf_config(self, meta: dict[str, Any]) -> dict[str, Any]:
        # pad_token_id: Phi3Config's default (32000) is outside a smaller vocabulary, where transformers refuses it.
        return {"sliding_window": meta.get(f"{self.gguf_arch}.attention.sliding_window"),
                "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}

    # No Q/K permutation: the file holds HF's layout.
    to_gguf = Family.to_gguf
    from_gguf = Family.from_gguf

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
    gguf_arch="phi3",
    gguf_required=("model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                   "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight"),
    chat_templates=("phi3",),
)
