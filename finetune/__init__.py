"""finetune: fine-tune Llama-style models on the Hugging Face stack, from one CPU to many GPUs."""

__version__ = "0.1.0"
