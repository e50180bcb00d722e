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
from finetune.models.families.vision import VisionFamily, clip_layers, dense, ln


@dataclass(frozen=True)
class SmolVLMFamily(VisionFamily, LlamaFamily):
    language = "model.text_model."
    towers = ("model.vision_model", "model.connector")
    # LlamaConfig's defaults (the text_config class of both configs) and SmolVLMVisionConfig's.
    text_defaults = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32)
    vision_defaults = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_channels=3,
                           image_size=224, patch_size=32)

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
)
