"""Qwen3 (Qwen3ForCausalLM): Llama's layout plus a per-head RMSNorm on queries and keys (self_attn.q_norm and
k_norm, a weight of head_dim each, registered after o_proj), a head_dim of its own (128 in every published size,
also the config's default, whatever hidden_size / num_attention_heads is), tied embeddings in the small sizes.
llama.cpp's "qwen3" architecture stores the norms as attn_q_norm / attn_k_norm and keeps Q and K rows in HF's
order (no permutation)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import Family, ModelShape, Saving, Tensor
from finetune.models.families.llama import LlamaFamily

HEAD_DIM = 128  # Qwen3Config's default head_dim


@dataclass(frozen=True)
class Qwen3Family(LlamaFamily):
    def shape(self, d: dict[str, Any]) -> ModelShape:
        sh = super().shape(d)
        d = d.get("text_config", d) if "hidden_size" not in d else d
        return dataclasses.replace(sh, head_dim=int(d.get("head_dim", HEAD_DIM)))

    def tensors(self, sh: ModelShape) -> list[Tensor]:
        out = []
        for t in super().tensors(sh):
            if t.name.endswith(".mlp.gate_proj.weight"):  # the q/k norms come after the attention's projections
                attn = t.name[: -len("mlp.gate_proj.weight")] + "self_attn."
                out += [Tensor(attn + "q_norm.weight", (sh.head_dim,), "norm"),
                        Tensor(attn + "k_norm.weight", (sh.head_dim,), "norm")]
            out.append(t)
        return out

    def layer_saved_extra(self, sh: ModelShape, run: Saving) -> int:
        return qk_norms_saved(sh, run.a, run.trains_weights)

    def gguf_refusal(self, config) -> str | None:
        if getattr(config, "attention_bias", False):
            return "attention_bias is set; llama.cpp's qwen3 architecture has no attention biases"
        if config.head_dim != HEAD_DIM:
            # transformers' GGUF loader does not read attention.key_length for qwen3 (it takes the default), so a
            # file of another head_dim could not be verified (llama.cpp itself would read it).
            return (f"head_dim {config.head_dim}: transformers' GGUF loader reads qwen3 files with head_dim "
                    f"{HEAD_DIM} only, so the file could not be verified")
        return super().gguf_refusal(config)

    # No Q/K permutation: the file holds HF's layout.
    to_gguf = Family.to_gguf
    from_gguf = Family.from_gguf


def qk_norms_saved(sh: ModelShape, a: int, trains_weights: bool) -> int:
    """The per-head q/k RMSNorms (measured on CPU): each keeps its fp32 input and 1/rms per head, and the normalized
    value when its weight trains."""
    f32 = 4
    qk = sh.q_dim + sh.kv_dim
    return f32 * qk + f32 * (sh.num_heads + sh.num_kv_heads) + (a * qk if trains_weights else 0)


QWEN3 = Qwen3Family(
    name="qwen3",
    model_types=("qwen3",),
    hf_classes=("Qwen3ForCausalLM",),
    gguf_arch="qwen3",
    gguf_required=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                   "model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.down_proj.weight"),
    chat_templates=("chatml",),
)
