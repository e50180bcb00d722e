"""Mistral (MistralForCausalLM): Llama's layout under its own model_type; sliding_window (4096 in Mistral-7B-v0.1,
null from v0.2) changes attention, not parameters. llama.cpp writes Mistral checkpoints in its "llama"
architecture (Q/K permuted as Llama's) and ignores the window, as this export does: the file equals the HF model
on inputs up to the window. A "llama" GGUF file is imported as Llama (the same weights): transformers' loader
reads it as Mistral only when general.name is exactly "mistral"."""

from __future__ import annotations

from finetune.models.families.llama import LLAMA, LlamaFamily

MISTRAL = LlamaFamily(
    name="mistral",
    model_types=("mistral",),
    hf_classes=("MistralForCausalLM",),
    gguf_arch="llama",
    gguf_required=LLAMA.gguf_required,
    chat_templates=("mistral",),  # Mistral-7B-Instruct's [INST] format
)
