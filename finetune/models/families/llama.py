"""Llama (LlamaForCausalLM): grouped-query attention (q, k, v, o), SwiGLU MLP (gate, up, down), two RMSNorms per
layer, optional biases (attention_bias, mlp_bias), optional tied embeddings. llama.cpp's "llama" architecture
stores Q and K rows permuted (its convert_hf_to_gguf.py LlamaModel.permute); it writes Mistral checkpoints in
this architecture too, so a GGUF file that says "llama" may hold one (the same layout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import Family, Linear, ModelShape, rope_parameters


def permute(weights, n_head: int, n_head_kv: int | None = None):
    """llama.cpp's LlamaModel.permute: HF's rotate-half layout of Q/K rows -> GGML's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def unpermute(weights, n_head: int, n_head_kv: int):
    """The inverse of permute (numpy arrays or torch tensors)."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    dim = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


@dataclass(frozen=True)
class LlamaFamily(Family):
    def linears(self, sh: ModelShape) -> tuple[Linear, ...]:
        h, q, kv, i = sh.hidden_size, sh.q_dim, sh.kv_dim, sh.intermediate_size
        a, m = sh.attention_bias, sh.mlp_bias
        return (
            Linear("q_proj", "self_attn", q, h, a, "attn_in"),
            Linear("k_proj", "self_attn", kv, h, a, "attn_in"),
            Linear("v_proj", "self_attn", kv, h, a, "attn_in"),
            Linear("o_proj", "self_attn", h, q, a, "attn_out"),
            Linear("gate_proj", "mlp", i, h, m, "mlp_in"),
            Linear("up_proj", "mlp", i, h, m, "mlp_in"),
            Linear("down_proj", "mlp", h, i, m, "mlp_act"),
        )

    def layer_norms(self, sh: ModelShape) -> tuple[str, ...]:
        return ("input_layernorm", "post_attention_layernorm")

    def gguf_refusal(self, config) -> str | None:
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            return "attention_bias/mlp_bias are set; finetune's GGUF export writes bias-free Llama only"
        rope = rope_parameters(config)
        if rope.get("rope_type", "default") not in ("default", None):
            return (f"rope scaling '{rope.get('rope_type')}' is not supported by finetune's GGUF export "
                    "(transformers' GGUF loader does not read it back for llama, so the file could not be verified)")
        return None

    def gguf_metadata(self, config) -> list[tuple[str, Any]]:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        meta = self.gguf_size_metadata(config) + [
            ("add_rope_freq_base", float(rope_parameters(config)["rope_theta"])),
            ("add_rope_dimension_count", head_dim),
        ]
        if head_dim != config.hidden_size // config.num_attention_heads:
            meta += [("add_key_length", head_dim), ("add_value_length", head_dim)]
        return meta

    def to_gguf(self, hf_name: str, array, sh: ModelShape):
        return _qk_rows(permute, hf_name, array, sh)

    def from_gguf(self, hf_name: str, array, sh: ModelShape):
        return _qk_rows(unpermute, hf_name, array, sh)


def _qk_rows(change, hf_name: str, array, sh: ModelShape):
    """`change` (permute, or its inverse) applied to the weights llama.cpp stores permuted: Q's rows by the attention
    heads, K's by the key/value heads; every other weight as it is."""
    if hf_name.endswith("self_attn.q_proj.weight"):
        return change(array, sh.num_heads, sh.num_heads)
    if hf_name.endswith("self_attn.k_proj.weight"):
        return change(array, sh.num_heads, sh.num_kv_heads)
    return array


LLAMA = LlamaFamily(
    name="llama",
    model_types=("llama",),
    hf_classes=("LlamaForCausalLM",),
    gguf_arch="llama",
    gguf_required=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                   "model.layers.0.mlp.down_proj.weight"),
    chat_templates=("chatml", "llama3"),
)
