"""Inference: generation with adapters, quantized bases and device_map sharding."""

from finetune import compat as _compat

_compat.default_deepspeed_accelerator()  # before anything here imports DeepSpeed (through transformers or peft)
