"""LLaVA 1.5 (LlavaForConditionalGeneration, model_type llava) and LLaVA-NeXT (LlavaNextForConditionalGeneration,
model_type llava_next, "LLaVA 1.6"): a Llama-layout decoder (Vicuna/Llama, or Mistral in llava-v1.6-mistral) under
model.language_model., after a CLIP vision tower (model.vision_tower: a class embedding, a bias-free patch
embedding, a position embedding of (image_size / patch_size)^2 + 1, the pre-LayerNorm, the encoder, a final
LayerNorm; its vision_feature_layer's output is taken, -2 in the published checkpoints) and a two-layer GELU
projector (model.multi_modal_projector). LLaVA-NeXT tiles the image over image_grid_pinpoints and adds one learned
vector (model.image_newline, a parameter, not a module) at the end of each row of patches; it is part of the
projector: frozen by default with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import Images, ModelShape, Saving, Tensor
from finetune.models.families.llama import LlamaFamily
from finetune.models.families.vision import (VisionFamily, clip_layers, dense, encoder_layer_saved, layer_norm_saved, ln,
                                             patches_per_side, tile_pixels)

# The language models whose layout is Llama's (the text_config model_types of the published LLaVA checkpoints).
LLAMA_LAYOUT = ("llama", "mistral")


@dataclass(frozen=True)
class LlavaFamily(VisionFamily, LlamaFamily):
    # Packs exactly: its images are one flat [images, channels, height, width] tensor scattered over the image tokens
    # in order, its positions 1-D (finetune.data.images.PackedVisionCollator).
    packing_refusal = ""
    # LlamaConfig's defaults (LlavaConfig's text_config class when config.json names none) and LlavaConfig's vision
    # tower (CLIP ViT-L/14 at 336 pixels).
    text_defaults = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32)
    vision_defaults = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_channels=3,
                           image_size=336, patch_size=14, projection_dim=768)

    def text_dict(self, d: dict[str, Any]) -> dict[str, Any]:
        text = super().text_dict(d)
        kind = text.get("model_type", "llama")
        if kind == "mistral":  # MistralConfig's defaults differ from Llama's in the MLP width and the kv heads
            text = {**self.text_defaults, "intermediate_size": 14336, "num_key_value_heads": 8,
                    **(d.get("text_config") or {})}
        if kind not in LLAMA_LAYOUT:
            raise ValueError(f"text_config.model_type '{kind}': finetune's {self.name} family reads a Llama-layout "
                             f"language model ({', '.join(LLAMA_LAYOUT)})")
        return text

    def vision_tensors(self, sh: ModelShape, v: dict[str, Any]) -> list[Tensor]:
        h, p = int(v["hidden_size"]), int(v["patch_size"])
        vt = "model.vision_tower."
        out = self.newline(sh)
        out += [Tensor(vt + "embeddings.class_embedding", (h,), "embed"),
                Tensor(vt + "embeddings.patch_embedding.weight", (h, int(v["num_channels"]), p, p), "linear"),
                Tensor(vt + "embeddings.position_embedding.weight", ((int(v["image_size"]) // p) ** 2 + 1, h), "embed")]
        out += ln(vt + "pre_layrnorm", h) + clip_layers(vt, v) + ln(vt + "post_layernorm", h)
        pr = "model.multi_modal_projector."
        return out + dense(pr + "linear_1", sh.hidden_size, h) + dense(pr + "linear_2", sh.hidden_size, sh.hidden_size)

    def newline(self, sh: ModelShape) -> list[Tensor]:
        """Parameters registered before the tower: none in LLaVA 1.5."""
        return []

    def image_input(self, config: dict[str, Any], processor: dict[str, Any], size: tuple[int, int] | None,
                    max_tokens: int | None = None) -> tuple[Images, int]:
        """One crop of the tower's image_size whatever the image: its patches and the class position; the patches
        become tokens (vision_feature_select_strategy "default" drops the class position)."""
        v = self.vision_dict(config)
        side = patches_per_side(v)
        full = config.get("vision_feature_select_strategy", "default") == "full"
        return Images(1, side * side + 1, tile_pixels(v)), side * side + full

    def tower_saved(self, sh: ModelShape, run: Saving, images: Images, v: dict[str, Any]) -> dict[str, int]:
        """CLIP: the patch embedding's input (the pixels of each tile), the position ids of one tile, the pre-LayerNorm,
        every encoder layer (those past vision_feature_layer run too, and their saved tensors stay until the forward's
        end: measured), no post-LayerNorm; the projector: linear_1's input (the selected positions, a copy), its
        GELU's input and linear_2's."""
        a, n, t = run.a, images.tiles, images.patches
        h = int(v["hidden_size"])
        selected = t if sh.config.get("vision_feature_select_strategy", "default") == "full" else t - n
        return {"vision tower: patch embedding input": a * n * tile_pixels(v),
                "vision tower: position ids": 8 * (t // max(n, 1)),
                "vision tower: layers": layer_norm_saved(a, t, h) + int(v["num_hidden_layers"]) * encoder_layer_saved(a, t, v),
                "projector": a * selected * (h + 2 * sh.hidden_size)}
    def unused_tower(self, config) -> tuple[str, ...]:
        """The CLIP layers after vision_feature_layer (-2 in the published checkpoints: the last layer) and the final
        LayerNorm (CLIP applies it to the pooled output only): the features are hidden_states[k], layer k-1's output."""
        n = int(config.vision_config.num_hidden_layers)
        layers = config.vision_feature_layer
        k = max(int(x) % (n + 1) for x in (layers if isinstance(layers, (list, tuple)) else [layers]))
        return tuple(f"model.vision_tower.encoder.layers.{i}" for i in range(k, n)) + ("model.vision_tower.post_layernorm",)

    def dummy_image(self, config) -> dict[str, Any]:
        # get_image_features takes the feature layer and selection as arguments (the model's forward passes its config's).
        return {**super().dummy_image(config), "vision_feature_layer": config.vision_feature_layer,
                "vision_feature_select_strategy": config.vision_feature_select_strategy}


@dataclass(frozen=True)
class LlavaNextFamily(LlavaFamily):
    towers = ("model.image_newline", "model.vision_tower", "model.multi_modal_projector")
    packing_refusal = ""  # its images' tiles and sizes, in order (PackedVisionCollator), and 1-D positions

    def newline(self, sh: ModelShape) -> list[Tensor]:
        return [Tensor("model.image_newline", (sh.hidden_size,), "embed")]

    def dummy_image(self, config) -> dict[str, Any]:
        """One square image of the tower's size: the tiles its grid pinpoints give it, each a tower-sized image."""
        import torch
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        out = super().dummy_image(config)
        s = int(config.vision_config.image_size)
        tiles = image_size_to_num_patches((s, s), config.image_grid_pinpoints, s)
        return dict(out, pixel_values=out["pixel_values"].expand(tiles, -1, -1, -1)[None].contiguous(),
                    image_sizes=torch.tensor([[s, s]]))
    def image_input(self, config: dict[str, Any], processor: dict[str, Any], size: tuple[int, int] | None,
                    max_tokens: int | None = None) -> tuple[Images, int]:
        """anyres: the image's best grid of image_grid_pinpoints (LlavaNextImageProcessor's select_best_resolution; the
        largest grid when no size is given) in tiles of the tower's image_size, plus the resized whole image; tokens:
        the whole image's patches, the grid's (unpadded to the image's aspect at most all of them) and one newline per
        row of the grid's patches."""
        v = self.vision_dict(config)
        s, side = int(v["image_size"]), patches_per_side(v)
        pinpoints = [tuple(map(int, p)) for p in (config.get("image_grid_pinpoints") or processor.get("image_grid_pinpoints")
                                                   or [[s, s]])]
        grid = max(pinpoints, key=lambda p: p[0] * p[1]) if size is None else best_resolution(size, pinpoints)
        tiles = 1 + (grid[0] // s) * (grid[1] // s)
        rows, cols = grid[0] // s * side, grid[1] // s * side
        return Images(tiles, tiles * (side * side + 1), tiles * tile_pixels(v)), side * side + rows * cols + rows


def best_resolution(size: tuple[int, int], pinpoints: list[tuple[int, int]]) -> tuple[int, int]:
    """transformers' select_best_resolution: the (height, width) keeping the most of the image's resolution once it is
    fitted inside, then the least wasted area."""
    h, w = size
    best, best_fit, best_waste = pinpoints[0], -1, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        dh, dw = int(h * scale), int(w * scale)
        fit = min(dh * dw, h * w)
        waste = ph * pw - fit
        if fit > best_fit or (fit == best_fit and waste < best_waste):
            best, best_fit, best_waste = (ph, pw), fit, waste
    return best


LLAVA = LlavaFamily(
    name="llava",
    model_types=("llava",),
    hf_classes=("LlavaForConditionalGeneration",),
)
LLAVA_NEXT = LlavaNextFamily(
    name="llava_next",
    model_types=("llava_next",),
    hf_classes=("LlavaNextForConditionalGeneration",),
)
