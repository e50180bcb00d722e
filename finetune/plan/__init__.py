"""Memory planning: predict per-device memory from config.json alone and pick what fits."""
