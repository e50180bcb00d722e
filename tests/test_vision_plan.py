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

from launch import matrix

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
# LLaVA in the fast subset; the other families build their tiny model first (Gemma-3's 262k-token embeddings: ~40 s).
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "llava" else pytest.mark.slow) for n in VLMS])
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


# CI's cover: LLaVA's three variants in the fast subset; every other family's trained tower (its own layers and
# projector), Gemma-3's frozen one (its mask in every layer) and Qwen3-VL's LoRA (its deepstack mask) as slow tests;
# the rest with FINETUNE_FULL_MATRIX=1.
SAVED_COVER = ([("llava", v) for v in VARIANTS] + [(n, "full-tower") for n in VLMS if n != "llava"]
               + [("gemma3", "full"), ("qwen3_vl", "lora")])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name,variant", [
    pytest.param(n, v, id=f"{n}-{v}", marks=[] if n == "llava" else pytest.mark.slow)
    for n, v in matrix([(n, v) for n in VLMS for v in VARIANTS], SAVED_COVER)])
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


# Each tiny model with its tower grown (128 wide, 6 layers) and larger pictures, so that what the tower saves is a
# sizeable share of the peak: (vision_config, config, image processor settings, picture size, pictures per record).
GROW = dict(hidden_size=128, intermediate_size=256)
PINPOINTS = [[112, 224], [224, 112], [224, 224], [336, 112], [112, 336]]
GROWN = {
    "qwen2_5_vl": (dict(GROW, depth=6, num_heads=4, window_size=112, fullatt_block_indexes=[5]), {},
                   dict(size={"shortest_edge": 56 * 56, "longest_edge": 224 * 224}), (224, 224), 4),
    "qwen3_vl": (dict(GROW, depth=6, num_heads=4, num_position_embeddings=256, deepstack_visual_indexes=[1, 3]), {},
                 dict(size={"shortest_edge": 64 * 64, "longest_edge": 256 * 256}), (256, 256), 4),
    "gemma3": (dict(GROW, num_hidden_layers=6, num_attention_heads=4, image_size=224), dict(mm_tokens_per_image=16),
               dict(size={"height": 224, "width": 224}), (224, 224), 4),
    "llava": (dict(GROW, num_hidden_layers=6, num_attention_heads=4, image_size=224), {},
              dict(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}), (224, 224), 1),
    "llava_next": (dict(GROW, num_hidden_layers=6, num_attention_heads=4, image_size=112),
                   dict(image_grid_pinpoints=PINPOINTS),
                   dict(size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112},
                        image_grid_pinpoints=PINPOINTS), (224, 224), 1),
    "smolvlm": (dict(GROW, num_hidden_layers=6, num_attention_heads=4, image_size=128), {},
                dict(size={"longest_edge": 256}, max_image_size={"longest_edge": 128}), (256, 256), 4),
}
RSS_MICRO, RSS_SEQ = 2, 512


def grown_vlm(name: str, tiny, out):
    """The tiny model of NAME with GROWN's tower (random weights) and its processor set for GROWN's pictures."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.models.load import load_processor

    vision, top, settings, _, _ = GROWN[name]
    config = AutoConfig.from_pretrained(tiny)
    for key, value in vision.items():
        setattr(config.vision_config, key, value)
    for key, value in top.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(out)
    processor = load_processor(tiny)
    for key, value in settings.items():
        setattr(processor.image_processor, key, value)
    if "mm_tokens_per_image" in top:  # Gemma-3: the image's tokens in the text, as many as the projector pools to
        old = processor.image_seq_length
        processor.image_seq_length = top["mm_tokens_per_image"]
        processor.full_image_sequence = processor.full_image_sequence.replace(
            processor.image_token * old, processor.image_token * processor.image_seq_length)
    if hasattr(processor, "image_seq_len"):  # SmolVLM: a tile's tokens, its patches pixel-shuffled by scale_factor
        processor.image_seq_len = (config.vision_config.image_size // config.vision_config.patch_size
                                   // config.scale_factor) ** 2
    processor.save_pretrained(out)
    return out


@pytest.mark.slow
# CI's cover: Qwen2.5-VL (dynamic patches, window attention, the merger); every family with FINETUNE_FULL_MATRIX=1.
@pytest.mark.parametrize("name", matrix(list(VLMS), ["qwen2_5_vl"]))
def test_predicted_peak_on_image_records_within_5_percent_of_measured_rss(name, tiny_vlm, tmp_path):
    """Full fine-tuning with the tower trained (--freeze_vision_tower false) on image records, one process:
    bench/memory.py's worker (config -> load_model -> the vision collator -> HF Trainer) trains 2 steps on records of
    exactly --max_seq_length tokens with GROWN's pictures; the planner's per-device total, its pictures taken from the
    processor's settings for that picture size, is within 5% of the process's peak RSS, and the bytes autograd saved
    are the planner's to the byte."""
    from test_plan import _bench

    bench = _bench()
    folder = grown_vlm(name, tiny_vlm(name), tmp_path / "model")
    _, _, _, size, pictures = GROWN[name]
    flags = ["--per_device_train_batch_size", str(RSS_MICRO), "--max_seq_length", str(RSS_SEQ), "--seed", "0",
             "--attn_implementation", "sdpa", "--freeze_vision_tower", "false"]
    (rank,) = bench.measure(folder, "ddp", 1, tmp_path / "run", flags, steps=bench.MEASURE_STEP, timeout=600,
                            images=(pictures, *size))
    config = json.loads((folder / "config.json").read_text())
    one, _ = families.family_of(config).image_input(config, processor_settings(folder), size)
    job = bench.job_for(folder, "ddp", 1, micro=RSS_MICRO, seq=RSS_SEQ).replace(
        images=one.times(pictures), tower_trains=True, processor_bytes=plan.processor_memory(folder))
    pred = plan.predict(job)
    error = pred.device_total / rank["maxrss"] - 1
    tower = sum(v for k, v in pred.act.detail.items() if k.startswith(("vision tower", "projector")))
    print(f"{name}: peak RSS predicted {pred.device_total / 1e6:,.0f} MB, measured {rank['maxrss'] / 1e6:,.0f} MB "
          f"({error * 100:+.1f}%); saved activations predicted {pred.act.saved:,} ({tower:,} the tower's and "
          f"projector's), measured {rank['saved_for_backward']:,}; peak moment {pred.peak_moment}; "
          f"{rank['seconds']:.0f} s")
    if name.startswith("llava"):
        # The tower's layers past vision_feature_layer (-2: the last) run; with the model's outputs dropped, as the
        # Trainer drops them, part of that layer's MLP goes before the forward's end (two [positions, intermediate]
        # tensors: 1.05 MB of LLaVA's 33.1 MB, 1.33 MB of LLaVA-NeXT's 39.5 MB), which the planner keeps (it counts
        # what the in-process test above measures, the outputs held).
        assert 0 <= pred.act.saved - rank["saved_for_backward"] <= 0.04 * pred.act.saved
    else:
        assert rank["saved_for_backward"] == pred.act.saved
    assert abs(error) <= 0.05, (pred.device, rank["phase_peaks"])


def test_plan_flags_for_image_records(tiny_vlm, tiny_chatml):
    """`finetune plan` on the tiny LLaVA: one image per record by default (its crop: 5 tower positions, 4 tokens),
    the frozen tower out of the trainable parameters and its activations out of the plan, --freeze_vision_tower false
    adds them, --images_per_record scales them; the mistakes are refused naming the flag."""
    folder = tiny_vlm("llava")

    def planned(*flags):
        return plan.make_plan(["--model_name_or_path", str(folder), "--accelerator", "cpu", "--host_memory", "64GB",
                               "--max_seq_length", "64", "--per_device_train_batch_size", "2", *flags])

    config = json.loads((folder / "config.json").read_text())
    job = plan.Workload(plan.model_shape(config), plan.Strategy("ddp", 0))
    tower = sum(t.numel for t in plan.tower_tensors(job))
    frozen = planned()
    assert frozen["model"]["trainable_parameters"] == frozen["model"]["parameters"] - tower and tower > 0
    assert "1 image(s) per record (the largest the processor makes): 1 tile(s), 5 tower positions and 4 tokens" in (
        frozen["job"]["method"])
    assert not any(k.startswith(("vision tower", "projector")) for k in frozen["activations_detail"])
    trained = planned("--freeze_vision_tower", "false")
    assert trained["model"]["trainable_parameters"] == trained["model"]["parameters"]
    one = {k: v for k, v in trained["activations_detail"].items() if k.startswith(("vision tower", "projector"))}
    three = planned("--freeze_vision_tower", "false", "--images_per_record", "3", "--image_size", "30x40")
    assert {k: v for k, v in three["activations_detail"].items() if k in one and k != "vision tower: position ids"} == {
        k: 3 * v for k, v in one.items() if k != "vision tower: position ids"}
    assert "text records" in planned("--images_per_record", "0")["job"]["method"]
    for flags, message in ((["--images_per_record", "20"], "exceed --max_seq_length 64"),
                           (["--image_size", "big"], "--image_size: 'big' is not HEIGHTxWIDTH"),
                           (["--images_per_record", "-1"], "--images_per_record: must be 0 or more")):
        with pytest.raises(plan.PlanError, match=message):
            planned(*flags)
    with pytest.raises(plan.PlanError, match="--images_per_record: .* is a text model"):
        plan.make_plan(["--model_name_or_path", str(tiny_chatml), "--accelerator", "cpu", "--images_per_record", "1"])


def test_published_qwen2_5_vl_pictures_follow_the_image_size():
    """Qwen2.5-VL-7B's processor (patch 14, merge 2, max_pixels 12,845,056): a 448 x 448 image is 1,024 patches and 256
    tokens; with no size, the most patches whose tokens fit the sequence; the tower's saved bytes grow with them."""
    from test_families_vision import PUBLISHED

    config = PUBLISHED["Qwen2.5-VL-7B-Instruct"]
    family = families.family_of(config)
    settings = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    one, tokens = family.image_input(config, settings, (448, 448))
    assert (one.patches, tokens, one.pixels) == (1024, 256, 1024 * 3 * 2 * 14 * 14)
    worst, worst_tokens = family.image_input(config, settings, None, max_tokens=2048)
    assert (worst.patches, worst_tokens) == (8192, 2048)
    shape = plan.model_shape(config)
    job = plan.Workload(shape, plan.Strategy("ddp", 0), micro_batch=1, seq_len=2048, accelerator="gpu",
                        weight_dtype="bfloat16", images=one, tower_trains=True)
    small = plan.activations(job).detail["vision tower: layers"]
    big = plan.activations(job.replace(images=worst)).detail["vision tower: layers"]
    assert big == 8 * small > 0
    print(f"Qwen2.5-VL-7B, tower trained, bf16: a 448x448 image's tower layers save {small / 1e9:.2f} GB, the largest "
          f"image that fits 2,048 tokens {big / 1e9:.2f} GB")
