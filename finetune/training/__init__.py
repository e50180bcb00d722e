"""Training: the three paths (HF Trainer, accelerate loop, DeepSpeed engine), what they share, checkpoints and saves."""

from finetune import compat as _compat

_compat.default_deepspeed_accelerator()  # before any training module imports DeepSpeed
_compat.quiet_collective_deprecations()
