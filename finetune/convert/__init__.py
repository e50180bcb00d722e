"""Conversions between formats: LoRA merge and ZeRO consolidation (export), GGUF import."""
