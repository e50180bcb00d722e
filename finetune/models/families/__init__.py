"""The model families finetune knows, one module each (llama.py, ...), and how a config or a GGUF file finds its
own. A new family is one module here and one entry in FAMILIES."""

from __future__ import annotations

from typing import Any

from finetune.models.families.base import Family, Images, Linear, ModelShape, Saving, Tensor
from finetune.models.families.gemma2 import GEMMA2
from finetune.models.families.gemma3 import GEMMA3, GEMMA3_MM
from finetune.models.families.llava import LLAVA, LLAVA_NEXT
from finetune.models.families.llama import LLAMA
from finetune.models.families.mistral import MISTRAL
from finetune.models.families.mixtral import MIXTRAL
from finetune.models.families.phi3 import PHI3
from finetune.models.families.qwen2 import QWEN2
from finetune.models.families.qwen2_5_vl import QWEN2_5_VL
from finetune.models.families.qwen3 import QWEN3
from finetune.models.families.qwen3_moe import QWEN3_MOE
from finetune.models.families.qwen3_vl import QWEN3_VL
from finetune.models.families.smolvlm import SMOLVLM

# The first family of a GGUF architecture is the one its files import as (Mistral is written as "llama").
FAMILIES: tuple[Family, ...] = (LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA2, GEMMA3, PHI3, QWEN3_MOE, MIXTRAL,
                                # vision-language (Family.vision): a vision tower and projector beside the decoder
                                GEMMA3_MM, QWEN2_5_VL, QWEN3_VL, SMOLVLM, LLAVA, LLAVA_NEXT)

# The family of a config.json without model_type (transformers needs the key; configs written by hand for
# `finetune plan` may leave it out, and were always read as Llama).
UNNAMED = LLAMA

__all__ = ["FAMILIES", "Family", "FamilyError", "Images", "Linear", "ModelShape", "Saving", "Tensor", "by_gguf_arch", "family_of",
           "find"]


class FamilyError(ValueError):
    """A model_type or GGUF architecture no family covers; the message names it and the known ones."""


def find(config_or_model_type: Any) -> Family | None:
    """The family of a model_type, a config.json dict or a transformers config; None when no family covers it. A
    multimodal config is its own model_type's family (llava, not its language model's llama) where one covers it."""
    model_type = _model_type(config_or_model_type)
    if model_type is None:
        return UNNAMED
    top = config_or_model_type.get("model_type") if isinstance(config_or_model_type, dict) else None
    for kind in dict.fromkeys(k for k in (top, model_type) if k):
        family = next((f for f in FAMILIES if kind in f.model_types), None)
        if family is not None:
            return family
    return None


def family_of(config_or_model_type: Any) -> Family:
    """The family of a model_type, a config.json dict or a transformers config; FamilyError names an unknown one."""
    family = find(config_or_model_type)
    if family is None:
        known = ", ".join(t for f in FAMILIES for t in f.model_types)
        raise FamilyError(f"no model family for model_type '{_model_type(config_or_model_type)}' (known: {known})")
    return family


def by_gguf_arch(name: str, meta: dict[str, Any] | None = None) -> Family:
    """The family whose GGUF files say general.architecture NAME, the one claiming the file surely (META: its
    metadata; Family.gguf_claim) among several; FamilyError names an unknown one."""
    claims = [(f.gguf_claim(meta or {}), -k, f) for k, f in enumerate(FAMILIES) if f.gguf_arch == name]
    best = max(claims, key=lambda c: c[:2], default=None)
    if best is None or best[0] <= 0:
        raise FamilyError(f"no model family for GGUF architecture '{name}' (known: {', '.join(gguf_archs())})")
    return best[2]


def gguf_archs() -> list[str]:
    return list(dict.fromkeys(f.gguf_arch for f in FAMILIES if f.gguf_arch is not None))


def _model_type(config: Any) -> str | None:
    if isinstance(config, str):
        return config
    if isinstance(config, dict):
        # A multimodal config whose top level has no sizes: its language model's type.
        d = config.get("text_config", config) if "hidden_size" not in config and "text_config" in config else config
        return d.get("model_type") or config.get("model_type")
    return getattr(config, "model_type", None)
