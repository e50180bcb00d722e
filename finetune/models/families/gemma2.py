"""Gemma-2 (Gemma2ForCausalLM): Llama's projections with four RMSNorms per layer (input, post-attention,
pre- and post-feedforward), a head_dim of its own (256 in every published size, the config's default), tied
embeddings (the config's default), soft-capped attention logits (attn_logit_softcapping 50.0) and final logits
(final_logit_softcapping 30.0; the chunked loss applies it inside its chunks, finetune.training.loss).

Attention: transformers has no sdpa kernel for Gemma-2 (its soft-capped attention), so a run under the default
`--attn_implementation sdpa` is refused before any model loads, naming eager; finetune does not switch kernels behind
a flag the user set (or left at its default)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import ModelShape
from finetune.models.families.llama import LlamaFamily

HEAD_DIM = 256  # Gemma2Config's and Gemma3TextConfig's default head_dim
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class Gemma2Family(LlamaFamily):
    def shape(self, d: dict[str, Any]) -> ModelShape:
        sh = super().shape(d)
        d = d.get("text_config", d) if "hidden_size" not in d else d
        return dataclasses.replace(sh, head_dim=int(d.get("head_dim") or HEAD_DIM))

    def layer_norms(self, sh: ModelShape) -> tuple[str, ...]:
        return NORMS

    def attention_problem(self, attn_implementation: str) -> str | None:
        if attn_implementation == "sdpa":
            return (f"attn_implementation: sdpa: transformers has no sdpa kernel for {self.name} (its attention logits "
                    "are soft-capped); use --attn_implementation eager (or flash_attention_2 on a GPU)")
        return None



GEMMA2 = Gemma2Family(
    name="gemma2",
    model_types=("gemma2",),
    hf_classes=("Gemma2ForCausalLM",),
    tied_default=True,
)
