"""Training: the three paths (HF Trainer, accelerate loop, DeepSpeed engine), what they share, checkpoints and saves."""
