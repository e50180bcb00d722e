"""Inference: generation with adapters, quantized bases and device_map sharding."""
