"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration, model_type qwen2_5_vl): Qwen2's decoder (biases on q, k, v) under
model.language_model., with multimodal rope (mrope: the rotary dimensions split in three sections, temporal, height
and width, rope_scaling.mrope_section), after a ViT under model.visual: a 3-d patch embedding (temporal_patch_size
frames of patch_size squared, no bias), RMSNorm blocks with a fused qkv and a SwiGLU MLP (windowed attention but on
fullatt_block_indexes), and the merger (the projector, also under model.visual): an RMSNorm, then an MLP over
spatial_merge_size squared neighbouring patches into the language model's width. model.visual is the tower and
projector: frozen by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import ModelShape, Saving, Tensor
from finetune.models.families.qwen2 import Qwen2Family
from finetune.models.families.vision import VisionFamily, dense, patch_grid_image


@dataclass(frozen=True)
class Qwen25VLFamily(VisionFamily, Qwen2Family):
    towers = ("model.visual",)
    packing_refusal = ("its mrope positions are 3-D, computed by the model from the image grids of the whole row, "
                       "not restarted per record")

    def dummy_image(self, config) -> dict[str, Any]:
        return patch_grid_image(config)

    def model_saved_extra(self, sh: ModelShape, run: Saving) -> dict[str, int]:
        """mrope's cos and sin are gathered per section from the three position rows (temporal, height, width): one
        more [rows, seq, head_dim] copy than a 1-d rope's, kept for backward."""
        return {**super().model_saved_extra(sh, run), "mrope: sections gathered": run.a * run.tokens * sh.head_dim}
    # Qwen2_5_VLVisionConfig's defaults for keys a config.json leaves out.
    vision_defaults = dict(depth=32, hidden_size=3584, intermediate_size=3420, in_channels=3, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584)

    def vision_tensors(self, sh: ModelShape, v: dict[str, Any]) -> list[Tensor]:
        h, i, p, t = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["patch_size"]), int(v["temporal_patch_size"])
        ch = int(v.get("in_chans", v.get("in_channels", 3)))
        merged = h * int(v["spatial_merge_size"]) ** 2
        vt = "model.visual."
        out = [Tensor(vt + "patch_embed.proj.weight", (h, ch, t, p, p), "linear")]
        for layer in range(int(v["depth"])):
            b = f"{vt}blocks.{layer}."
            out += [Tensor(b + "norm1.weight", (h,), "norm"), Tensor(b + "norm2.weight", (h,), "norm")]
            out += dense(b + "attn.qkv", 3 * h, h) + dense(b + "attn.proj", h, h)
            out += dense(b + "mlp.gate_proj", i, h) + dense(b + "mlp.up_proj", i, h) + dense(b + "mlp.down_proj", h, i)
        out.append(Tensor(vt + "merger.ln_q.weight", (h,), "norm"))
        return out + dense(vt + "merger.mlp.0", merged, merged) + dense(vt + "merger.mlp.2", int(v["out_hidden_size"]), merged)


QWEN2_5_VL = Qwen25VLFamily(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    hf_classes=("Qwen2_5_VLForConditionalGeneration",),
    chat_templates=("chatml",),
)
