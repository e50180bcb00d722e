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

from finetune.models.families.base import ModelShape, Saving
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

    # ---- activations, for the planner (measured on CPU: tests/test_families_plan.py) ----

    # Layers alternate sliding and global attention (Gemma2Config's layer_types when a config.json leaves them out).
    sliding_pattern: int = 2

    def sliding_window(self, sh: ModelShape, layer: int) -> int | None:
        d = sh.text_config
        if d.get("layer_types"):
            return super().sliding_window(sh, layer)
        pattern = int(d.get("sliding_window_pattern") or self.sliding_pattern)
        return d.get("sliding_window") if (layer + 1) % pattern else None

    def attention_saved(self, sh: ModelShape, run: Saving, layer: int) -> int:
        """Eager attention (Gemma-2 has no sdpa kernel; flash_attention_2 on a GPU saves less): the rotated q, k and v
        repeated to all heads (copies), the probabilities, the soft-cap's tanh output (same size) when the attention
        logits are capped; o_proj's input is a copy (the heads' outputs transposed back), kept where o_proj saves its
        input. The mask is added, not saved."""
        a, q = run.a, sh.q_dim
        capped = sh.text_config.get("attn_logit_softcapping") is not None
        per_token = a * 3 * q + a * sh.num_heads * run.seq_len * (2 if capped else 1) + (a * q if run.o_input_kept else 0)
        return run.tokens * per_token

    def layer_saved_extra(self, sh: ModelShape, run: Saving) -> int:
        """The pre- and post-feedforward norms beside Llama's two: post_attention_layernorm and
        post_feedforward_layernorm normalize a block's output before the residual add (their output is not saved;
        their fp32 input and 1/rms are, and the normalized value when the weight trains)."""
        f32, h = 4, sh.hidden_size
        return 2 * (f32 * h + f32 + (run.a * h if run.trains_weights else 0))

    def layer_saved_per_batch(self, sh: ModelShape, run: Saving, first: bool = False) -> int:
        """Each of the four norms multiplies by (1 + weight) in fp32, a tensor of its own that the product keeps
        (but for layer 0's input norm under LoRA, whose input needs no gradient)."""
        return 4 * sh.hidden_size * (len(self.layer_norms(sh)) - (1 if first else 0))

    def model_saved_extra(self, sh: ModelShape, run: Saving) -> dict[str, int]:
        """The embedding's scale (sqrt(hidden), a scalar kept when the embedding trains), the final norm's (1 + weight),
        the final soft-cap's tanh output over the logits (fp32 before the loss upcasts them)."""
        out = {"final norm: (1 + weight)": 4 * sh.hidden_size}
        if run.trains_weights:
            out["embedding scale"] = run.a
        if self.logit_softcap(sh) is not None and run.logit_rows:
            out["final logit soft-cap: tanh output"] = run.a * run.logit_rows * (sh.head_outputs or sh.vocab_size)
        return out

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
