"""Conversions between formats: `finetune export` and its export types (writers/: HF folder, GGUF), GGUF import."""

from finetune import compat as _compat

_compat.default_deepspeed_accelerator()  # before anything here imports DeepSpeed (through transformers or peft)
