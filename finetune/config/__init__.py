"""Configuration: typed flags (defaults < recipe YAML < command line), presets, validation."""

from finetune.config.training import *  # noqa: F401,F403
