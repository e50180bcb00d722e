"""Conversions between formats: LoRA merge and ZeRO consolidation (export), GGUF import."""

from finetune import compat as _compat

_compat.default_deepspeed_accelerator()  # before anything here imports DeepSpeed (through transformers or peft)
