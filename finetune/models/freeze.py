"""A vision-language model's vision tower and projector (Family.vision_prefixes), frozen by default
(--freeze_vision_tower): full fine-tuning trains the language model only, and LoRA's default adapters go on the
language model's linear layers only (the family's peft_target_modules)."""

from __future__ import annotations

from finetune.models import families


def vision_prefixes(model) -> tuple[str, ...]:
    """The module names (model.named_modules()) the vision tower and projector are under; () for a text model."""
    family = families.find(model.config)
    return tuple(family.vision_prefixes(model.config)) if family is not None and family.vision else ()


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
