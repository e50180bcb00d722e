"""Models: loading tokenizers and Llama-style models (dtype, quantization, LoRA), verifying saves, tiny test models."""
