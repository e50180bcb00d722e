"""Qwen3-VL (Qwen3VLForConditionalGeneration, model_type qwen3_vl): Qwen3's decoder (per-head q/k RMSNorms, head_dim
128) under model.language_model., with interleaved multimodal rope (rope_scaling.mrope_section, mrope_interleaved),
after a ViT under model.visual: a 3-d patch embedding with a bias, a learned position embedding
(num_position_embeddings, interpolated to the image's grid), LayerNorm blocks with a fused qkv and a GELU MLP
(linear_fc1, linear_fc2), the merger (LayerNorm, two linears over spatial_merge_size squared patches) and one more
merger per deepstack_visual_indexes entry (its LayerNorm after the merge), whose outputs are added to the first
decoder layers' hidden states. model.visual is the tower and projectors: frozen by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import Images, ModelShape, Saving, Tensor
from finetune.models.families.qwen3 import Qwen3Family
from finetune.models.families.vision import (F32, VisionFamily, dense, layer_norm_saved, ln, patch_grid_image,
                                             qwen_attention_saved, qwen_image_input)


@dataclass(frozen=True)
class Qwen3VLFamily(VisionFamily, Qwen3Family):
    towers = ("model.visual",)
    packing_refusal = ("its mrope positions are 3-D, computed by the model from the image grids of the whole row, "
                       "not restarted per record")

    def dummy_image(self, config) -> dict[str, Any]:
        return patch_grid_image(config)

    def model_saved_extra(self, sh: ModelShape, run: Saving) -> dict[str, int]:
        """Interleaved mrope's cos and sin, gathered from the three position rows: one more [rows, seq, head_dim]
        copy than a 1-d rope's, kept for backward."""
        return {**super().model_saved_extra(sh, run), "mrope: sections gathered": run.a * run.tokens * sh.head_dim}
    # Qwen3VLTextConfig's and Qwen3VLVisionConfig's defaults for keys a config.json leaves out.
    text_defaults = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=128)
    vision_defaults = dict(depth=27, hidden_size=1152, intermediate_size=4304, in_channels=3, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                           num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])

    def image_input(self, config: dict[str, Any], processor: dict[str, Any], size: tuple[int, int] | None,
                    max_tokens: int | None = None) -> tuple[Images, int]:
        return qwen_image_input(self.vision_dict(config), processor, size, max_tokens)

    def vision_saved(self, sh: ModelShape, run: Saving, images: Images, tower_trains: bool) -> dict[str, int]:
        """The deepstack features are added into the first decoder layers' hidden states at the image positions (an
        indexed add, keeping the image mask, one storage with the embeddings' scatter mask), which need a gradient
        under LoRA too."""
        out = super().vision_saved(sh, run, images, tower_trains)
        if self.vision_dict(sh.config).get("deepstack_visual_indexes"):
            out.setdefault("image tokens: the embeddings' scatter mask", run.tokens)
        return out

    def tower_saved(self, sh: ModelShape, run: Saving, images: Images, v: dict[str, Any]) -> dict[str, int]:
        """The patch embedding's input (the batch's pixel_values), the position embedding's bilinear interpolation (four
        indices and weights per patch), the rotary cos and sin (fp32, shared by the blocks), each block (two LayerNorms,
        its attention, fc1's input, the GELU's, fc2's), each deepstack merger (its LayerNorm's statistics over the merged
        patches, whose input is its layer's output, kept already; both linears' inputs and the GELU's), and the merger
        (its LayerNorm, both linears' inputs and the GELU's)."""
        a, t = run.a, images.patches
        h, i = int(v["hidden_size"]), int(v["intermediate_size"])
        heads = int(v.get("num_heads", 16))
        merged = t // int(v["spatial_merge_size"]) ** 2
        block = (2 * layer_norm_saved(a, t, h) + qwen_attention_saved(a, t, v) + a * t * h + 2 * a * t * i)
        deepstack = len(v.get("deepstack_visual_indexes") or ()) * (2 * F32 * merged + 3 * a * t * h)
        return {"vision tower: patch embedding input": a * images.pixels,
                "vision tower: position interpolation": 4 * t * (8 + a),
                "vision tower: rotary cos/sin": 2 * F32 * t * (h // heads),
                "vision tower: layers": int(v["depth"]) * block,
                "projector": deepstack + layer_norm_saved(a, t, h) + 3 * a * t * h}

    def vision_tensors(self, sh: ModelShape, v: dict[str, Any]) -> list[Tensor]:
        h, i, p, t = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["patch_size"]), int(v["temporal_patch_size"])
        merged, out_h = h * int(v["spatial_merge_size"]) ** 2, int(v["out_hidden_size"])
        vt = "model.visual."
        out = [Tensor(vt + "patch_embed.proj.weight", (h, int(v["in_channels"]), t, p, p), "linear"),
               Tensor(vt + "patch_embed.proj.bias", (h,), "bias"),
               Tensor(vt + "pos_embed.weight", (int(v["num_position_embeddings"]), h), "embed")]
        for layer in range(int(v["depth"])):
            b = f"{vt}blocks.{layer}."
            out += ln(b + "norm1", h) + ln(b + "norm2", h) + dense(b + "attn.qkv", 3 * h, h) + dense(b + "attn.proj", h, h)
            out += dense(b + "mlp.linear_fc1", i, h) + dense(b + "mlp.linear_fc2", h, i)
        out += ln(vt + "merger.norm", h) + dense(vt + "merger.linear_fc1", merged, merged)
        out += dense(vt + "merger.linear_fc2", out_h, merged)
        for k in range(len(v["deepstack_visual_indexes"])):
            m = f"{vt}deepstack_merger_list.{k}."
            out += ln(m + "norm", merged) + dense(m + "linear_fc1", merged, merged) + dense(m + "linear_fc2", out_h, merged)
        return out


QWEN3_VL = Qwen3VLFamily(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    hf_classes=("Qwen3VLForConditionalGeneration",),
    chat_templates=("chatml",),
)
