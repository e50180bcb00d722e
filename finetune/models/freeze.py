"""A vision-language model's vision tower and projector, frozen by default (--freeze_vision_tower): full fine-tuning
trains the language model only, and LoRA's default adapters go on the language model's linear layers only."""

from __future__ import annotations

from finetune.models import families

# The modules transformers' image-text-to-text models keep their vision tower and projector under (Gemma-3 and LLaVA:
# vision_tower + multi_modal_projector, LLaVA-NeXT's image_newline; Qwen2.5-VL and Qwen3-VL: visual, its merger
# included; Idefics3 / SmolVLM: vision_model + connector), for a model whose family does not name them itself.
VISION_NAMES = ("vision_tower", "multi_modal_projector", "image_newline", "visual", "vision_model", "connector")


def is_vision(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def vision_prefixes(model) -> tuple[str, ...]:
    """The names (in model.named_modules() / named_parameters()) the vision tower and projector are under."""
    family = families.find(model.config)
    if family is not None and getattr(family, "vision", False) and hasattr(family, "vision_prefixes"):
        return tuple(family.vision_prefixes(model.config))
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    found = {n for n in names if n.rsplit(".", 1)[-1] in VISION_NAMES}
    # The outermost of each: model.visual, not model.visual.merger.
    return tuple(sorted(n for n in found if not any(n.startswith(o + ".") for o in found)))


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def freeze_vision(model) -> int:
    """requires_grad off for the vision tower's and projector's parameters; returns how many values were frozen."""
    prefixes, frozen = vision_prefixes(model), 0
    for name, p in model.named_parameters():
        if under(name, prefixes):
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen
