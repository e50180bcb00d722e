"""SmolVLM (SmolVLMForConditionalGeneration, model_type smolvlm; the first releases, SmolVLM-256M/500M/2B, are
Idefics3ForConditionalGeneration, model_type idefics3, the same modules): a Llama decoder (SmolLM2) under
model.text_model., after a SigLIP-style encoder under model.vision_model (patch embedding with a bias, a position
embedding of (image_size / patch_size)^2, CLIP-ordered layers, a final LayerNorm; no class token) and the connector
(model.connector): a pixel shuffle of scale_factor^2 patches into one, then one bias-free linear into the language
model's width. The tower and connector are frozen by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import ModelShape, Tensor
from finetune.models.families.llama import LlamaFamily
from finetune.models.families.vision import MmprojTower, VisionFamily, clip_layers, dense, ln


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
