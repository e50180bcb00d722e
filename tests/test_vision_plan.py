"""`finetune plan` on image records of the six vision-language families: the pictures the planner derives from the
processor's saved settings are the ones the real processor makes (tiles, patches, image tokens), and the bytes autograd
saves in one training forward of the tiny model on an image batch are the planner's to the byte, with the vision tower
frozen (it saves nothing; the image tokens' merge into the embeddings keeps its mask) and trained
(--freeze_vision_tower false: every tower layer, the projector, the pixels), full fine-tuning and LoRA."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from finetune.models import families
from finetune.models.tiny import VLMS
from finetune.plan import planner as plan

# Two pictures per record, of different sizes and aspects (Qwen's patches, SmolVLM's and LLaVA-NeXT's tiles differ).
SIZES = ((60, 100), (80, 50))
CONVERSATION = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "The first one."}]}]
# (use_peft, the tower trains)
VARIANTS = {"full": (False, False), "full-tower": (False, True), "lora": (True, False)}


def image(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8))


def processor_settings(folder) -> dict:
    return json.loads((folder / "processor_config.json").read_text())["image_processor"]


def image_batch(folder, rows: int = 2):
    """ROWS identical records of CONVERSATION with the two SIZES images, through the model's own processor."""
    from finetune.models.load import load_processor

    processor = load_processor(folder)
    text = processor.apply_chat_template(CONVERSATION, tokenize=False)
    pictures = [image(h, w, k) for k, (h, w) in enumerate(SIZES)]
    return processor(text=[text] * rows, images=[pictures] * rows, return_tensors="pt", padding=True)


def record_images(family, config: dict, folder) -> tuple[families.Images, int]:
    """One record's pictures and image tokens, as the planner derives them from the processor's settings."""
    settings = processor_settings(folder)
    parts = [family.image_input(config, settings, size) for size in SIZES]
    return parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", VLMS)
def test_planned_pictures_are_the_processor_s(name, tiny_vlm):
    """Tiles and image tokens from the processor's saved settings equal what the processor makes of the two images
    (LLaVA-NeXT's tokens: at most, its unpadding drops the rows and columns of padding); the worst case (no size) is at
    least as large."""
    folder = tiny_vlm(name)
    config = json.loads((folder / "config.json").read_text())
    family = families.family_of(config)
    inputs = image_batch(folder, rows=1)
    images, tokens = record_images(family, config, folder)
    image_id = config.get("image_token_id", config.get("image_token_index"))
    made = int((inputs["input_ids"] == image_id).sum())
    pixels = inputs["pixel_values"]
    if "image_grid_thw" in inputs:  # Qwen: patches per image, one row each
        assert images.patches == int(inputs["image_grid_thw"].prod(-1).sum()) == pixels.shape[0]
        assert images.pixels == pixels.numel()
    elif pixels.dim() == 5 and "image_sizes" in inputs:  # LLaVA-NeXT: the tiles of each image, padded to the most
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        settings = processor_settings(folder)
        tiles = sum(image_size_to_num_patches(s.tolist(), config["image_grid_pinpoints"], settings["crop_size"]["height"])
                    for s in inputs["image_sizes"])
        assert images.tiles == tiles
    elif pixels.dim() == 5:  # SmolVLM: the tiles of every image of the record (padding tiles are all zeros)
        assert images.tiles == int((inputs["pixel_attention_mask"].flatten(2).any(-1)).sum())
    else:
        assert images.tiles == pixels.shape[0]
    assert tokens >= made if name == "llava_next" else tokens == made
    worst, worst_tokens = family.image_input(config, processor_settings(folder), None)
    assert worst.patches * 2 >= images.patches and worst_tokens * 2 >= tokens
    print(f"{name}: record of {SIZES}: {images.tiles} tiles, {images.patches} tower positions, {tokens} tokens planned, "
          f"{made} made; largest image: {worst.tiles} tiles, {worst.patches} positions, {worst_tokens} tokens")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", VLMS)
def test_image_record_activations_are_the_planners(name, variant, tiny_vlm):
    """One training forward on two image records: the distinct storages autograd saves (the parameters left out) are
    the planner's activations, tower, projector and language model together, to the byte."""
    import types

    from test_plan import _saved_bytes
    from transformers import AutoModelForImageTextToText

    from finetune.models.freeze import freeze_vision
    from finetune.models.load import add_lora

    use_peft, tower_trains = VARIANTS[variant]
    folder = tiny_vlm(name)
    config = json.loads((folder / "config.json").read_text())
    family = families.family_of(config)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if use_peft:
        model = add_lora(model, types.SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.05,
                                                      lora_target_modules=["all-linear"], _hub=None), seed=0)
    elif not tower_trains:
        freeze_vision(model)
    model.train()
    inputs = image_batch(folder)
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    assert bool(mask.all())  # identical rows: no padding
    images, _ = record_images(family, config, folder)
    job = plan.Workload(plan.model_shape(config), plan.Strategy("ddp", 0), micro_batch=ids.shape[0],
                        seq_len=ids.shape[1], grad_ckpt=False, use_peft=use_peft, lora_r=4, lora_dropout=0.05,
                        padding_mask=False, lora_targets=("all-linear",), loss_chunk=0, images=images,
                        tower_trains=tower_trains)
    act = plan.activations(job)
    got = _saved_bytes(model, ids, mask, **inputs)
    tower = sum(v for k, v in act.detail.items() if k.startswith(("vision tower", "projector", "image tokens")))
    print(f"{name} {variant}: planner {act.saved:,} bytes saved ({tower:,} of them the images'), measured {got:,}")
    assert act.saved == got
    if not tower_trains:
        assert not any(k.startswith(("vision tower", "projector")) for k in act.detail)
