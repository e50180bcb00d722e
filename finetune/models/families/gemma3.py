"""Gemma-3: the text models (Gemma3ForCausalLM, model_type gemma3_text: gemma-3-1b and 270m) and the multimodal
checkpoints of 4B and up (Gemma3ForConditionalGeneration, model_type gemma3), whose language model is the same
decoder under model.language_model. after a SigLIP vision tower and a projector. The decoder is Gemma-2's (four
norms per layer, head_dim 256 by default, tied embeddings) with Qwen3's per-head q/k RMSNorms (after o_proj), and no
logit soft-caps; sdpa works.

The multimodal checkpoints are their own family (gemma3_mm, a VisionFamily: finetune.models.families.vision): LoRA's
default targets are the language model's projections only (the vision tower has q_proj, k_proj and v_proj of its
own, which a bare name would also wrap), the tower and projector frozen by default.

GGUF (llama.cpp's "gemma3", the text model): Gemma-2's layout (norms stored plus one, the q/k norms too) with an
output tensor when untied and no soft-caps; llama.cpp fixes the sliding window on five layers of six, the sliding
layers' rope base at 10000 and the query scale by its rule (Gemma2Family.query_scalar); a linear rope scaling of the
global layers (Gemma-3 4B and up) is rope.scaling.type/factor, which transformers' loader does not read (gguf_config
sets it). A multimodal checkpoint's file is its language model (text_config's sizes, model.language_model.'s weights
and the LM head), as llama.cpp's converter writes it; the vision tower goes to a separate file in llama.cpp (mmproj),
which finetune writes beside it (Gemma3VisionFamily, MmprojTower)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.models.families.base import Family, Images, ModelShape, Saving, Tensor
from finetune.models.families.gemma2 import Gemma2Family
from finetune.models.families.vision import (F32, MmprojTower, VisionFamily, dense, encoder_layer_saved,
                                             layer_norm_saved, ln, patches_per_side, tile_pixels)

LOCAL_THETA = 10000.0  # llama.cpp's rope base of Gemma-3's sliding layers (fixed: not read from the file)
from finetune.models.families.llama import LlamaFamily
from finetune.models.families.qwen3 import qk_norms_saved


@dataclass(frozen=True)
class Gemma3Family(Gemma2Family):
    def attention_problem(self, attn_implementation: str) -> str | None:
        return LlamaFamily.attention_problem(self, attn_implementation)

    # sdpa (no attention soft-cap), with Qwen3's per-head q/k norms in Gemma's (1 + weight) form.
    attention_saved = Family.attention_saved

    def layer_saved_extra(self, sh: ModelShape, run: Saving) -> int:
        return super().layer_saved_extra(sh, run) + qk_norms_saved(sh, run.a, run.trains_weights)

    def layer_saved_per_batch(self, sh: ModelShape, run: Saving, first: bool = False) -> int:
        return super().layer_saved_per_batch(sh, run, first) + 2 * 4 * sh.head_dim  # the q/k norms' (1 + weight)

    def model_saved_extra(self, sh: ModelShape, run: Saving) -> dict[str, int]:
        """Gemma-2's, and where both kinds of layer are present (6 layers and more), the second rope's (the global
        layers' base) position embedding: one more [rows, seq, head_dim] tensor kept for backward (measured: 12,288
        bytes at 2 x 48 tokens, head_dim 32, fp32)."""
        out = super().model_saved_extra(sh, run)
        if len({self.sliding_window(sh, layer) is None for layer in range(sh.num_layers)}) == 2:
            out["rope of the other layer kind"] = run.a * run.tokens * sh.head_dim
        return out

    def layer_tensors(self, sh: ModelShape, layer: int, p: str) -> list[Tensor]:
        out = []
        for t in super().layer_tensors(sh, layer, p):
            if t.name.endswith(".mlp.gate_proj.weight"):  # the q/k norms come after the attention's projections
                attn = t.name[: -len("mlp.gate_proj.weight")] + "self_attn."
                out += [Tensor(attn + "q_norm.weight", (sh.head_dim,), "norm"),
                        Tensor(attn + "k_norm.weight", (sh.head_dim,), "norm")]
            out.append(t)
        return out

    # ---- GGUF ----

    def gguf_refusal(self, config) -> str | None:
        config = config.get_text_config()  # a multimodal checkpoint's file is its language model (gguf_model)
        if getattr(config, "use_bidirectional_attention", False):
            return "use_bidirectional_attention is set; llama.cpp's gemma3 is causal"
        rope = config.rope_parameters
        local, full = rope["sliding_attention"], rope["full_attention"]
        if local.get("rope_type", "default") != "default" or float(local["rope_theta"]) != LOCAL_THETA:
            return (f"the sliding layers' rope ({local}): llama.cpp's gemma3 fixes them at the default rope, "
                    f"base {LOCAL_THETA:g}")
        if full.get("rope_type", "default") not in ("default", "linear"):
            return f"rope scaling '{full.get('rope_type')}': llama.cpp's gemma3 reads linear scaling only"
        return super().gguf_refusal(config)

    def gguf_model(self, model) -> tuple[Any, str | None]:
        """A multimodal checkpoint's language model as a Gemma3ForCausalLM over the same modules (no copy): its
        decoder (a Gemma3TextModel) and LM head; a text model as it is."""
        config = model.config
        if getattr(config, "model_type", None) != "gemma3":
            return model, None
        import copy

        import torch
        from transformers import Gemma3ForCausalLM

        text_config = copy.deepcopy(config.text_config)
        # The multimodal model ties its head by its own top-level key (transformers' tie_weights reads model.config).
        text_config.tie_word_embeddings = bool(config.tie_word_embeddings)
        with torch.device("meta"):  # no weights allocated: both modules are replaced by the checkpoint's
            lm = Gemma3ForCausalLM(text_config)
        lm.model, lm.lm_head = model.model.language_model, model.lm_head
        return lm.eval(), ("the file holds the language model only: the vision tower and projector are not included "
                           "(llama.cpp reads them from a separate mmproj file)")

    def softcap_refusal(self, config) -> str | None:
        if config.attn_logit_softcapping is not None or config.final_logit_softcapping is not None:
            return "a logit soft-cap is set; llama.cpp's gemma3 has none"
        return None

    def rope_theta(self, config) -> float:
        return config.rope_parameters["full_attention"]["rope_theta"]

    def softcap_metadata(self, config) -> list[tuple[str, Any]]:
        full = config.rope_parameters["full_attention"]
        # The sliding layers' rope base (gguf_refusal: always LOCAL_THETA), as llama.cpp's converter writes it.
        meta: list[tuple[str, Any]] = [("add_rope_freq_base_swa", LOCAL_THETA)]
        if full.get("rope_type", "default") == "linear":
            from gguf import RopeScalingType

            meta += [("add_rope_scaling_type", RopeScalingType.LINEAR),
                     ("add_rope_scaling_factor", float(full["factor"]))]
        return meta

    def gguf_config(self, meta: dict[str, Any]) -> dict[str, Any]:
        a = self.gguf_arch
        layers, hidden, heads = (meta[f"{a}.block_count"], meta[f"{a}.embedding_length"],
                                 meta[f"{a}.attention.head_count"])
        full = {"rope_type": "default", "rope_theta": float(meta.get(f"{a}.rope.freq_base", 1e6))}
        if meta.get(f"{a}.rope.scaling.type") == "linear":
            full = dict(full, rope_type="linear", factor=float(meta[f"{a}.rope.scaling.factor"]))
        return {"query_pre_attn_scalar": self.query_scalar(layers, hidden, heads,
                                                           meta.get(f"{a}.attention.key_length", hidden // heads)),
                "rope_parameters": {"full_attention": full,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA}}}



@dataclass(frozen=True)
class Gemma3VisionFamily(VisionFamily, MmprojTower, Gemma3Family):
    packing_refusal = ("an image's tokens attend to each other both ways (token_type_ids), which a packed row's "
                       "per-record causal attention, found from its positions, does not keep")
    """The multimodal checkpoints (Gemma3ForConditionalGeneration): the same decoder under model.language_model.,
    after the SigLIP tower (model.vision_tower) and the projector (model.multi_modal_projector: an RMSNorm of the
    tower's width, average-pooled to mm_tokens_per_image per image, then one matrix into the decoder's width)."""

    # Gemma3TextConfig's and Gemma3Config's vision tower (SiglipVisionConfig as Gemma-3 sets it) defaults, for keys
    # a config.json leaves out (gemma-3-4b-it's names neither its vocabulary nor its heads).
    text_defaults = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256)
    vision_defaults = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, image_size=896,
                           patch_size=14, num_channels=3, num_attention_heads=16)

    projector = "gemma3"
    image_mask = True  # token_type_ids: an image's tokens attend to each other both ways, in every layer

    def image_input(self, config: dict[str, Any], processor: dict[str, Any], size: tuple[int, int] | None,
                    max_tokens: int | None = None) -> tuple[Images, int]:
        """One image resized to the tower's image_size (896 pixels in the published checkpoints; pan-and-scan off),
        mm_tokens_per_image tokens (256)."""
        v = self.vision_dict(config)
        side = patches_per_side(v)
        return Images(1, side * side, tile_pixels(v)), int(config.get("mm_tokens_per_image", 256))

    def tower_saved(self, sh: ModelShape, run: Saving, images: Images, v: dict[str, Any]) -> dict[str, int]:
        """SigLIP: the patch embedding's input, the position ids of one image, every encoder layer, the post-LayerNorm;
        the projector: the average pool's input (the positions as a grid, a copy), its RMSNorm (the fp32 input, the
        reciprocal deviation, 1 + weight, the normalized value) on mm_tokens_per_image positions per image, and the
        projection's input."""
        a, n, t = run.a, images.tiles, images.patches
        h = int(v["hidden_size"])
        pooled = n * int(sh.config.get("mm_tokens_per_image", 256))
        return {"vision tower: patch embedding input": a * n * tile_pixels(v),
                "vision tower: position ids": 8 * (t // max(n, 1)),
                "vision tower: layers": int(v["num_hidden_layers"]) * encoder_layer_saved(a, t, v)
                + layer_norm_saved(a, t, h),
                "projector": a * t * h + pooled * h * (2 * F32 + a) + F32 * pooled + F32 * h}

    def mmproj_source(self, name: str) -> str | None:
        # Gemma3VisionModel.filter_tensors: the tower and projector, not SigLIP's unused head; "_weight" -> ".weight".
        # transformers 5 saves the tower without the vision_model level the published checkpoints (and llama.cpp's
        # table) have: put back.
        if not name.startswith(("multi_modal_projector.", "vision_tower.")) or "vision_model.head." in name:
            return None
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        return name.replace("_weight", ".weight")

    def mmproj_parts(self, name: str, array) -> list[tuple[str, Any]]:
        # Gemma3VisionModel.modify_tensors: the projector's RMSNorm stored as 1 + weight (Gemma3RMSNorm's scale).
        return [(name, array + 1 if "soft_emb_norm.weight" in name else array)]

    def mmproj_force(self, source: str, gguf_name: str, f16: bool) -> str | None:
        if "input_projection" in source:
            return "F16"  # llama.cpp's converter: always (ggml-org/llama.cpp#13025)
        if ".embeddings." in source:
            return "F32"
        return super().mmproj_force(source, gguf_name, f16)

    def mmproj_metadata(self, config: dict[str, Any], preprocessor: dict[str, Any], f16: bool) -> list[tuple[str, Any]]:
        v = self.mmproj_vision(config)
        meta = super().mmproj_metadata(config, preprocessor, f16) + [("add_vision_use_gelu", True)]
        per_side = int(int(preprocessor.get("image_seq_length", 256)) ** 0.5)
        scale = (int(v["image_size"]) // int(v["patch_size"])) // per_side
        if scale > 0 and scale != 4:  # written only where it is not llama.cpp's default
            meta.append(("add_vision_projector_scale_factor", scale))
        return meta

    def vision_tensors(self, sh: ModelShape, v: dict[str, Any]) -> list[Tensor]:
        """The SigLIP vision tower (with SigLIP's pooling head only where vision_use_head is set, which Gemma-3's
        checkpoints do not) and the projector into the language model's width."""
        h, i, patch, ch = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["patch_size"]), int(v["num_channels"])
        vt = "model.vision_tower."
        out = [Tensor(vt + "embeddings.patch_embedding.weight", (h, ch, patch, patch), "linear"),
               Tensor(vt + "embeddings.patch_embedding.bias", (h,), "bias"),
               Tensor(vt + "embeddings.position_embedding.weight", ((int(v["image_size"]) // patch) ** 2, h), "embed")]
        for layer in range(int(v["num_hidden_layers"])):
            p = f"{vt}encoder.layers.{layer}."
            out += ln(p + "layer_norm1", h)
            for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
                out += dense(p + "self_attn." + proj, h, h)
            out += ln(p + "layer_norm2", h)
            out += dense(p + "mlp.fc1", i, h) + dense(p + "mlp.fc2", h, i)
        out += ln(vt + "post_layernorm", h)
        if v.get("vision_use_head", True):  # SigLIP's pooling head (Gemma-3's checkpoints turn it off)
            out += [Tensor(vt + "head.probe", (1, 1, h), "embed"),
                    Tensor(vt + "head.attention.in_proj_weight", (3 * h, h), "linear"),
                    Tensor(vt + "head.attention.in_proj_bias", (3 * h,), "bias")]
            out += dense(vt + "head.attention.out_proj", h, h) + ln(vt + "head.layernorm", h)
            out += dense(vt + "head.mlp.fc1", i, h) + dense(vt + "head.mlp.fc2", h, i)
        return out + [Tensor("model.multi_modal_projector.mm_input_projection_weight", (h, sh.hidden_size), "linear"),
                      Tensor("model.multi_modal_projector.mm_soft_emb_norm.weight", (h,), "norm")]


GEMMA3 = Gemma3Family(
    name="gemma3",
    sliding_pattern=6,  # Gemma3TextConfig's sliding_window_pattern: five sliding layers, then a global one
    model_types=("gemma3_text",),
    hf_classes=("Gemma3ForCausalLM",),
    tied_default=True,
    gguf_arch="gemma3",
    gguf_required=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                   "model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.down_proj.weight"),
    chat_templates=("gemma",),
    big_layers=62,  # Gemma-3-27B
    swa_pattern=6,
)
GEMMA3_MM = Gemma3VisionFamily(
    name="gemma3_mm",
    sliding_pattern=6,
    model_types=("gemma3",),
    hf_classes=("Gemma3ForConditionalGeneration",),
    tied_default=True,
    gguf_arch="gemma3",
    gguf_required=GEMMA3.gguf_required,
    chat_templates=("gemma",),
    big_layers=62,
    swa_pattern=6,
)
