"""A vision-language model's vision tower and projector (Family.vision_prefixes), frozen by default
(--freeze_vision_tower): full fine-tuning trains the language model only, and LoRA's default adapters go on the
language model's linear layers only (the family's peft_target_modules). The tower also runs on every micro-batch,
a blank image's features times zero where the batch has no image (run_tower_on_every_batch)."""

from __future__ import annotations

from finetune.models import families


def vision_prefixes(model) -> tuple[str, ...]:
    """The module names (model.named_modules()) the vision tower and projector are under; () for a text model."""
    family = families.find(model.config)
    return tuple(family.vision_prefixes(model.config)) if family is not None and family.vision else ()


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def freeze_unused_tower(model) -> int:
    """requires_grad off for the tower's parameters that the forward never uses (Family.unused_tower: LLaVA's layers
    after its feature layer), LoRA's adapters on them included; returns how many values were frozen."""
    family = families.find(model.config)
    prefixes = tuple(family.unused_tower(model.config)) if family is not None and family.vision else ()
    frozen = 0
    for name, p in model.named_parameters():
        # peft names the base model's parameters under base_model.model.
        if prefixes and under(name.removeprefix("base_model.model."), prefixes) and p.requires_grad:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def freeze_vision(model) -> int:
    """requires_grad off for the vision tower's and projector's parameters; returns how many values were frozen."""
    prefixes, frozen = vision_prefixes(model), 0
    for name, p in model.named_parameters():
        if under(name, prefixes):
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


class _TowerOnEveryBatch:
    """The hooks of run_tower_on_every_batch: the inner model's forward notes whether its call has pixels; where it
    has none, the language model's inputs_embeds get 0 x the blank image's features as it starts. The tower runs
    where its images' would (after the token embedding, before the language model), so ZeRO-3 records the same
    module order on every rank, and its backward comes first, as an image's does (DeepSpeed checks both orders
    across ranks)."""

    def __init__(self, model, family):
        self.model, self.family, self.has_pixels, self.blank = model, family, True, None

    def note(self, module, args, kwargs):
        self.has_pixels = any(kwargs.get(k) is not None for k in ("pixel_values", "pixel_values_videos"))

    def add(self, module, args, kwargs):
        import torch
        import torch.distributed as dist

        embeds = kwargs.get("inputs_embeds")
        if self.has_pixels or embeds is None:
            return None
        # A generation on one process pays nothing; training, and anything on several ranks, runs the tower.
        if not torch.is_grad_enabled() and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return None
        if self.blank is None:
            self.blank = self.family.dummy_image(self.model.config)
        blank = {k: v.to(embeds.device, dtype=embeds.dtype if v.is_floating_point() else v.dtype)
                 if isinstance(v, torch.Tensor) else v for k, v in self.blank.items()}
        features = self.model.model.get_image_features(**blank)
        # What the model takes from an image's forward (the projected features; Qwen3-VL's deepstack features too),
        # so the same tower parameters get gradients as from a real image (LLaVA's last layer gets none).
        used = [getattr(features, "pooler_output", None), getattr(features, "deepstack_features", None)]
        total = sum(t.float().sum() for t in _tensors(used))
        # x + 0 is x (features of a blank image are finite): the loss and every gradient are unchanged, bit for bit.
        kwargs["inputs_embeds"] = embeds + (total * 0).to(embeds.dtype)
        return args, kwargs


def _tensors(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def run_tower_on_every_batch(model) -> None:
    """Run the vision tower and projector on every micro-batch: where a batch has no image, on a blank image whose
    features are multiplied by zero and added to the language model's input embeddings. Under ZeRO-3 the tower's
    forward (and backward, when it trains) gathers its partitioned weights from every rank together, so a rank whose
    micro-batch had no image would skip collectives its peers wait in; DDP with a trained tower likewise needs every
    rank's gradients for it. Each family gives its blank image (VisionFamily.dummy_image)."""
    family = families.find(model.config)
    if family is None or not family.vision:
        return
    hooks = _TowerOnEveryBatch(model, family)
    model.model.register_forward_pre_hook(hooks.note, with_kwargs=True)
    model.get_submodule(family.language.rstrip(".")).register_forward_pre_hook(hooks.add, with_kwargs=True)
