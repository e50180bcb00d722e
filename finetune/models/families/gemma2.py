"""Gemma-2 (Gemma2ForCausalLM): Llama's projections with four RMSNorms per layer (input, post-attention,
pre- and post-feedforward), a head_dim of its own (256 in every published size, the config's default), tied
embeddings (the config's default), soft-capped attention logits (attn_logit_softcapping 50.0) and final logits
(final_logit_softcapping 30.0; the chunked loss applies it inside its chunks, finetune.training.loss).

Attention: transformers has no sdpa kernel for Gemma-2 (its soft-capped attention), so a run under the default
`--attn_implementation sdpa` is refused before any model loads, naming eager; finetune does not switch kernels behind
a flag the user set (or left at its default).

GGUF (llama.cpp's "gemma2"): HF's Gemma norms compute x * (1 + weight); llama.cpp's x * weight, so every norm
weight is stored plus one (its convert_hf_to_gguf.py Gemma2Model; transformers' loader subtracts it). Q and K stay in
HF's order (NEOX rope), the head is always the embedding (no output tensor), the embedding scale sqrt(hidden_size)
and the sliding window on every other layer are llama.cpp's fixed behaviour, the soft-caps are metadata keys
(gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) that transformers' loader does not read (gguf_config
sets them), and the query scale is llama.cpp's rule (1/sqrt(head_dim), or 1/sqrt(hidden/heads) in the 27B layout),
not a key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import ModelShape, Saving, rope_parameters
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

    # ---- GGUF ----

    # llama.cpp's layer count of the size whose query scale is 1/sqrt(hidden/heads) (Gemma-2-27B: 46 layers); every
    # other size scales by 1/sqrt(head_dim) (llama-model.cpp, f_attention_scale).
    big_layers: int = 46
    swa_pattern: int = 2  # llama.cpp's fixed sliding-window pattern: every layer but each swa_pattern-th slides

    def query_scalar(self, layers: int, hidden: int, heads: int, head_dim: int) -> int:
        """query_pre_attn_scalar as llama.cpp computes it (not stored in the file)."""
        return hidden // heads if layers == self.big_layers else head_dim

    def layer_types(self, layers: int) -> list[str]:
        return ["sliding_attention" if (i + 1) % self.swa_pattern else "full_attention" for i in range(layers)]

    def gguf_refusal(self, config) -> str | None:
        scalar = self.query_scalar(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                                   config.head_dim)
        if config.query_pre_attn_scalar != scalar:
            return (f"query_pre_attn_scalar {config.query_pre_attn_scalar}: llama.cpp's {self.gguf_arch} scales queries "
                    f"by 1/sqrt({scalar}) for this shape (it stores no scale), so the file would compute another model")
        if list(getattr(config, "layer_types", None) or []) != self.layer_types(config.num_hidden_layers):
            return (f"layer_types: llama.cpp's {self.gguf_arch} slides the window on every layer but each "
                    f"{self.swa_pattern}th, fixed; this model's layers differ")
        if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
            return f"hidden_activation {config.hidden_activation}: llama.cpp's {self.gguf_arch} uses gelu_pytorch_tanh"
        return self.softcap_refusal(config) or super().gguf_refusal(config)

    def softcap_refusal(self, config) -> str | None:
        if not config.tie_word_embeddings:
            return "untied embeddings: llama.cpp's gemma2 has no output tensor (the head is the token embedding)"
        if config.attn_logit_softcapping is None or config.final_logit_softcapping is None:
            return "a soft-cap is None: llama.cpp's gemma2 always soft-caps attention and final logits"
        return None

    def gguf_metadata(self, config) -> list[tuple[str, Any]]:
        meta = self.gguf_size_metadata(config) + [
            ("add_key_length", config.head_dim),
            ("add_value_length", config.head_dim),
            ("add_rope_freq_base", float(self.rope_theta(config))),
            ("add_sliding_window", config.sliding_window),
        ]
        return meta + self.softcap_metadata(config)

    def rope_theta(self, config) -> float:
        return rope_parameters(config)["rope_theta"]

    def softcap_metadata(self, config) -> list[tuple[str, Any]]:
        return [("add_attn_logit_softcapping", float(config.attn_logit_softcapping)),
                ("add_final_logit_softcapping", float(config.final_logit_softcapping))]

    def gguf_config(self, meta: dict[str, Any]) -> dict[str, Any]:
        a = self.gguf_arch
        layers, hidden, heads = (meta[f"{a}.block_count"], meta[f"{a}.embedding_length"],
                                 meta[f"{a}.attention.head_count"])
        head_dim = meta.get(f"{a}.attention.key_length", hidden // heads)
        out = {"query_pre_attn_scalar": self.query_scalar(layers, hidden, heads, head_dim)}
        # llama.cpp's defaults when the keys are absent (llama-model.cpp LLM_ARCH_GEMMA2).
        out["attn_logit_softcapping"] = float(meta.get(f"{a}.attn_logit_softcapping", 50.0))
        out["final_logit_softcapping"] = float(meta.get(f"{a}.final_logit_softcapping", 30.0))
        return out

    def to_gguf(self, hf_name: str, array, sh: ModelShape):
        return array + 1 if hf_name.endswith("norm.weight") else array

    def from_gguf(self, hf_name: str, array, sh: ModelShape):
        return array - 1 if hf_name.endswith("norm.weight") else array


GEMMA2 = Gemma2Family(
    name="gemma2",
    model_types=("gemma2",),
    hf_classes=("Gemma2ForCausalLM",),
    tied_default=True,
    gguf_arch="gemma2",
    gguf_required=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                   "model.layers.0.post_feedforward_layernorm.weight", "model.layers.0.mlp.down_proj.weight"),
    chat_templates=("gemma",),
)
