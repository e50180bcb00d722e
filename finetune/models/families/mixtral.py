"""Mixtral (MixtralForCausalLM: Mixtral-8x7B, 8x22B): Mistral's attention with a sparse MLP in every layer:
num_local_experts experts of intermediate_size, num_experts_per_tok routed per token, the router registered before
the experts. The router's auxiliary loss (output_router_logits) is added to the chunked loss as transformers adds
it (finetune.training.loss).

GGUF: llama.cpp writes Mixtral as its "llama" architecture (convert_hf_to_gguf.py's LlamaModel): Q/K rows permuted
as Llama's, the router as ffn_gate_inp, the experts stacked (moe.py: gate_up split gate first), and
llama.expert_count / llama.expert_used_count; its llama graph routes by softmax and renormalises the top-k weights,
as transformers' Mixtral does. A "llama" file with experts is claimed by this family. transformers' GGUF loader
cannot read it (no Mixtral in its GGUF tables, and it reads a "llama" file as a dense Llama), so the family builds
the model from the file's metadata and weights itself. llama.cpp's llama has no sliding window: a config with one
is refused (the published Mixtral configs have none)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import ModelShape
from finetune.models.families.llama import LLAMA
from finetune.models.families.moe import MoeFamily


@dataclass(frozen=True)
class MixtralFamily(MoeFamily):
    def shape(self, d: dict[str, Any]) -> ModelShape:
        sh = super().shape(d)
        return dataclasses.replace(sh, num_experts=int(d.get("num_local_experts", 8)),
                                   experts_per_tok=int(d.get("num_experts_per_tok", 2)),
                                   moe_intermediate_size=sh.intermediate_size)

    # ---- GGUF ----

    def gguf_refusal(self, config) -> str | None:
        if getattr(config, "sliding_window", None) is not None:
            return (f"sliding_window {config.sliding_window}: llama.cpp's llama architecture attends to every earlier "
                    "position, so the file would compute otherwise past the window")
        return super().gguf_refusal(config)

    def gguf_metadata(self, config) -> list[tuple[str, Any]]:
        return super().gguf_metadata(config) + [("add_expert_count", config.num_local_experts),
                                                ("add_expert_used_count", config.num_experts_per_tok)]

    def gguf_claim(self, meta: dict[str, Any]) -> int:
        return 2 if meta.get(f"{self.gguf_arch}.expert_count") else 0

    def load_gguf(self, path, meta: dict[str, Any]):
        import gguf
        import torch
        from transformers import AutoModelForCausalLM, MixtralConfig

        reader = gguf.GGUFReader(str(path))
        shapes = {t.name: t.shape.tolist() for t in reader.tensors}
        a = self.gguf_arch + "."
        hidden, heads = int(meta[a + "embedding_length"]), int(meta[a + "attention.head_count"])
        config = MixtralConfig(
            vocab_size=int(meta.get(a + "vocab_size") or shapes["token_embd.weight"][1]),
            hidden_size=hidden, intermediate_size=int(meta[a + "feed_forward_length"]),
            num_hidden_layers=int(meta[a + "block_count"]), num_attention_heads=heads,
            num_key_value_heads=int(meta.get(a + "attention.head_count_kv") or heads),
            head_dim=int(meta.get(a + "attention.key_length") or hidden // heads),
            max_position_embeddings=int(meta[a + "context_length"]),
            rms_norm_eps=float(meta[a + "attention.layer_norm_rms_epsilon"]),
            rope_parameters={"rope_type": "default", "rope_theta": float(meta.get(a + "rope.freq_base", 10000.0))},
            num_local_experts=int(meta[a + "expert_count"]), num_experts_per_tok=int(meta[a + "expert_used_count"]),
            tie_word_embeddings="output.weight" not in shapes, sliding_window=None,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
        state = self.gguf_state_dict(path, self.shape(config.to_dict()))
        # Built without weights and given the file's (assign): one float32 copy of the model in memory, not two, and
        # no random initialisation of 46.7B parameters to overwrite.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected or [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]:
            raise ValueError(f"the GGUF weights do not fit a Mixtral model: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}")
        # The rotary embedding's frequencies are computed, not stored: computed again off the meta device.
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
        model.tie_weights()
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"the GGUF file left {', '.join(left[:3])} unset")
        return model


MIXTRAL = MixtralFamily(
    name="mixtral",
    model_types=("mixtral",),
    hf_classes=("MixtralForCausalLM",),
    router_first=True,
    gguf_arch="llama",
    gguf_required=LLAMA.gguf_required[:2] + ("model.layers.0.mlp.experts.down_proj",),
    chat_templates=("mistral",),  # Mixtral-8x7B-Instruct's [INST] format
)
