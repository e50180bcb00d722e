"""SmolVLM (SmolVLMForConditionalGeneration, model_type smolvlm; the first releases, SmolVLM-256M/500M/2B, are
Idefics3ForConditionalGeneration, model_type idefics3, the same modules): a Llama decoder (SmolLM2) under
model.text_model., after a SigLIP-style encoder under model.vision_model (patch embedding with a bias, a position
embedding of (image_size / patch_size)^2, CLIP-ordered layers, a final LayerNorm; no class token) and the connector
(model.connector): a pixel shuffle of scale_factor^2 patches into one, then one bias-free linear into the language
model's width. The tower and connector are frozen by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import math

from finetune.models.families.base import Images, ModelShape, Saving, Tensor
from finetune.models.families.llama import LlamaFamily
from finetune.models.families.vision import (MmprojTower, VisionFamily, clip_layers, dense, encoder_layer_saved,
                                             layer_norm_saved, ln, patches_per_side, tile_pixels)


@dataclass(frozen=True)
class SmolVLMFamily(VisionFamily, MmprojTower, LlamaFamily):
    language = "model.text_model."
    towers = ("model.vision_model", "model.connector")
    # Packs exactly: its model keeps a batch's real images (not all zeros) in order, whatever row they are in, and
    # its positions are 1-D (finetune.data.images.PackedVisionCollator).
    packing_refusal = ""
    # LlamaConfig's defaults (the text_config class of both configs) and SmolVLMVisionConfig's.
    text_defaults = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32)
    vision_defaults = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_channels=3,
                           image_size=224, patch_size=32, num_attention_heads=16)

    projector = "idefics3"

    def dummy_image(self, config) -> dict[str, Any]:
        """One image of one tile ([images, tiles, channels, height, width]), every pixel real (its mask all set)."""
        import torch

        pixels = super().dummy_image(config)["pixel_values"][None]
        return {"pixel_values": pixels, "pixel_attention_mask": torch.ones(1, 1, *pixels.shape[-2:], dtype=torch.bool)}
    layer_norm_eps = 1e-5

    def image_input(self, config: dict[str, Any], processor: dict[str, Any], size: tuple[int, int] | None,
                    max_tokens: int | None = None) -> tuple[Images, int]:
        """The image resized so that its longer edge is size.longest_edge (its edges then rounded up to max_image_size's), split into tiles of
        max_image_size plus the whole image as a global tile (do_image_splitting), each tile the tower's image_size,
        image_seq_len tokens each (its patches pixel-shuffled by scale_factor squared); None: the largest image."""
        v = self.vision_dict(config)
        side = patches_per_side(v)
        tile = int((processor.get("max_image_size") or {}).get("longest_edge", v["image_size"]))
        longest = int((processor.get("size") or {}).get("longest_edge", 4 * tile))
        h, w = size or (longest, longest)
        scale = longest / max(h, w)  # up or down
        h, w = (max(tile, math.ceil(int(h * scale) / tile) * tile), max(tile, math.ceil(int(w * scale) / tile) * tile))
        grid = (h // tile) * (w // tile)
        tiles = grid + 1 if processor.get("do_image_splitting", True) and grid > 1 else 1
        tokens = side * side // int(config.get("scale_factor", 2)) ** 2
        return Images(tiles, tiles * side * side, tiles * tile_pixels(v)), tiles * tokens

    def tower_saved(self, sh: ModelShape, run: Saving, images: Images, v: dict[str, Any]) -> dict[str, int]:
        """The patch embedding's input (the real tiles, a copy without the batch's padding tiles), the position ids of
        every tile, every encoder layer, the post-LayerNorm; the connector's input (the pixel shuffle's copy)."""
        a, n, t = run.a, images.tiles, images.patches
        h = int(v["hidden_size"])
        return {"vision tower: patch embedding input": a * n * tile_pixels(v),
                "vision tower: position ids": 8 * t,
                "vision tower: layers": int(v["num_hidden_layers"]) * encoder_layer_saved(a, t, v)
                + layer_norm_saved(a, t, h),
                "projector": a * t * h}

    def mmproj_source(self, name: str) -> str | None:
        # SmolVLMModel.filter_tensors: the tower and the connector.
        return name if ("vision_tower" in name or "vision_model" in name or "model.connector" in name) else None

    def mmproj_force(self, source: str, gguf_name: str, f16: bool) -> str | None:
        return "F32" if ".embeddings." in source else super().mmproj_force(source, gguf_name, f16)

    def mmproj_metadata(self, config: dict[str, Any], preprocessor: dict[str, Any], f16: bool) -> list[tuple[str, Any]]:
        v = self.mmproj_vision(config)
        return super().mmproj_metadata(config, preprocessor, f16) + [
            ("add_vision_projector_scale_factor", int(config.get("scale_factor", 2))),
            ("add_vision_use_gelu", True),
            ("add_vision_preproc_image_size", int((preprocessor.get("size") or {}).get("longest_edge", v["image_size"])))]

    def vision_tensors(self, sh: ModelShape, v: dict[str, Any]) -> list[Tensor]:
        h, p = int(v["hidden_size"]), int(v["patch_size"])
        vt = "model.vision_model."
        out = [Tensor(vt + "embeddings.patch_embedding.weight", (h, int(v["num_channels"]), p, p), "linear"),
               Tensor(vt + "embeddings.patch_embedding.bias", (h,), "bias"),
               Tensor(vt + "embeddings.position_embedding.weight", ((int(v["image_size"]) // p) ** 2, h), "embed")]
        out += clip_layers(vt, v) + ln(vt + "post_layernorm", h)
        scale = int(sh.config.get("scale_factor", 2))
        return out + dense("model.connector.modality_projection.proj", sh.hidden_size, h * scale ** 2, bias=False)


SMOLVLM = SmolVLMFamily(
    name="smolvlm",
    model_types=("smolvlm", "idefics3"),
    hf_classes=("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration"),
    gguf_arch="llama",  # llama.cpp writes its language model (SmolLM2) as Llama's; Q/K permuted
    gguf_required=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                   "model.layers.0.mlp.down_proj.weight"),
    chat_templates=(),
)
