"""What the vision-language families share: a checkpoint that holds a vision tower and a projector beside a language
model (transformers' *ForConditionalGeneration, loaded with AutoModelForImageTextToText and an AutoProcessor).

A family here is its language model's family (Llama's, Qwen2's, ...) with `VisionFamily` first in its bases: the
decoder's tensors sit under `language` (model.language_model. in most), the tower and projector come before them
(`vision_tensors`, each family's own, in named_parameters() order), LoRA's default targets are the language model's
projections only (the towers have q_proj, fc1, ... of their own, which a bare name would also wrap), and the tower
and projector are what `vision_prefixes` names, frozen by default."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from finetune.models.families.base import Images, ModelShape, Saving, Tensor


class VisionFamily:
    """The mixin, placed before the language model's family class. Class attributes (the same for every checkpoint
    of the family): `language`, the decoder's prefix; `towers`, the vision tower's and projector's module prefixes;
    `text_defaults`, the text config keys a published config.json leaves to transformers' config class."""

    vision = True
    language = "model.language_model."
    towers = ("model.vision_tower", "model.multi_modal_projector")
    text_defaults: dict[str, Any] = {}
    vision_defaults: dict[str, Any] = {}
    # Why --packing / --padding_free cannot put this family's image records in one row exactly, or "" where they can
    # (each record its own positions and attention, its images in order: tests/test_vision_packing.py).
    packing_refusal = "finetune does not pack its image inputs per record"

    # On image records the language model's attention takes a mask in every layer, padded or not (Gemma-3's image
    # tokens attend to each other both ways).
    image_mask = False

    def vision_prefixes(self, config) -> tuple[str, ...]:
        return self.towers

    # ---- image records, for the planner ----

    def image_input(self, config: dict[str, Any], processor: dict[str, Any], size: tuple[int, int] | None,
                    max_tokens: int | None = None) -> tuple[Images, int]:
        """(one image as the tower takes it, the tokens it becomes in the language model's sequence), as the image
        processor (its saved settings, PROCESSOR) resizes and tiles an image of SIZE (height, width) pixels; None: the
        largest input it makes, the worst case (where the resolution is dynamic, the largest of at most MAX_TOKENS
        tokens: a larger image's record does not fit and is dropped)."""
        raise NotImplementedError

    def vision_saved(self, sh: ModelShape, run: Saving, images: Images, tower_trains: bool) -> dict[str, int]:
        """Bytes saved for backward on a micro-batch's IMAGES, by name. A frozen tower and projector save nothing (no
        gradient flows into them); the image features are scattered into the token embeddings (masked_scatter), which
        keeps its boolean mask where a gradient flows through it (the embeddings train, or the tower does)."""
        out = {}
        if run.trains_weights or tower_trains:
            out["image tokens: the embeddings' scatter mask"] = run.tokens
        if tower_trains:
            out.update(self.tower_saved(sh, run, images, self.vision_dict(sh.config)))
        return out

    def tower_saved(self, sh: ModelShape, run: Saving, images: Images, v: dict[str, Any]) -> dict[str, int]:
        """What the trained tower and projector save, by part (V: vision_config over the defaults)."""
        raise NotImplementedError
    def unused_tower(self, config) -> tuple[str, ...]:
        """Module prefixes of the tower that the model's forward never uses (no gradient ever reaches them): kept
        frozen even when the tower trains, as DDP refuses trained parameters without a gradient."""
        return ()

    def text_dict(self, d: dict[str, Any]) -> dict[str, Any]:
        """The language model's config keys: text_config (older configs keep them at the top level), over the
        config class's defaults."""
        text = d.get("text_config", d) if "hidden_size" not in d else d
        return {**self.text_defaults, **text}

    def vision_dict(self, d: dict[str, Any]) -> dict[str, Any]:
        return {**self.vision_defaults, **(d.get("vision_config") or {})}

    def shape(self, d: dict[str, Any]) -> ModelShape:
        text = self.text_dict(d)
        sh = super().shape(text)  # type: ignore[misc]
        # The LM head is tied by the top-level key (transformers' tie_weights reads the model's own config).
        tied = d.get("tie_word_embeddings", text.get("tie_word_embeddings", self.tied_default))  # type: ignore[attr-defined]
        full = dict(d, text_config=text) if "hidden_size" not in d else dict(d, **text)
        return dataclasses.replace(sh, prefix=self.language, tie_word_embeddings=bool(tied), config=full)

    def front(self, sh: ModelShape) -> list[Tensor]:
        return self.vision_tensors(sh, self.vision_dict(sh.config))

    def vision_tensors(self, sh: ModelShape, v: dict[str, Any]) -> list[Tensor]:
        """The tower's and projector's parameters, in named_parameters() order (V: vision_config over defaults)."""
        raise NotImplementedError

    def dummy_image(self, config) -> dict[str, Any]:
        """get_image_features' arguments for one blank image of the tower's own size: what each rank's tower runs on
        when its micro-batch has no image (finetune.models.freeze.run_tower_on_every_batch)."""
        import torch

        v = config.vision_config
        s = int(v.image_size)
        return {"pixel_values": torch.zeros(1, int(getattr(v, "num_channels", 3)), s, s)}

    def peft_target_modules(self, config, names: list[str]) -> list[str] | str:
        """The names under the language model only (peft matches a regular expression against the whole name)."""
        return rf"{re.escape(self.language)}.*\.({'|'.join(map(re.escape, names))})"

    def gguf_refusal(self, config) -> str | None:
        return super().gguf_refusal(config.get_text_config())  # type: ignore[misc]

    def gguf_model(self, model) -> tuple[Any, str | None]:
        """The language model as its text family's causal LM over the same modules (no copy): the decoder and the LM
        head, as llama.cpp's converter writes a multimodal checkpoint's text file; the tower and projector go to the
        mmproj file (MmprojTower) where llama.cpp reads this family's, else nowhere (the line says which)."""
        import copy

        import torch
        from transformers import AutoModelForCausalLM

        text_config = copy.deepcopy(model.config.get_text_config())
        # The multimodal model ties its head by its own top-level key (transformers' tie_weights reads model.config).
        text_config.tie_word_embeddings = bool(getattr(model.config, "tie_word_embeddings", False))
        with torch.device("meta"):  # no weights allocated: both modules are replaced by the checkpoint's
            lm = AutoModelForCausalLM.from_config(text_config)
        lm.model, lm.lm_head = model.get_submodule(self.language.rstrip(".")), model.lm_head
        where = ("llama.cpp reads them from a separate mmproj file" if isinstance(self, MmprojTower)
                 else "llama.cpp's converter has no projector of this family")
        return lm.eval(), f"the file holds the language model only: the vision tower and projector are not included ({where})"


# ---- the towers' saved tensors (sdpa, no dropout), by building block ----

# Tensors of the MLP's width its activation saves: its input (GELU), also its sigmoid (CLIP's quick_gelu).
ACTIVATION_SAVES = {"quick_gelu": 2, "gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1}
F32 = 4


def layer_norm_saved(a: int, tokens: int, h: int) -> int:
    """A LayerNorm: its input, and an fp32 mean and reciprocal deviation per position."""
    return tokens * (a * h + 2 * F32)


def encoder_layer_saved(a: int, tokens: int, v: dict[str, Any]) -> int:
    """A CLIP-ordered encoder layer (CLIP, SigLIP, Idefics3): layer_norm1; q/k/v's input (the norm's output); SDPA's
    q, k, v, output (out_proj's input, a view) and fp32 log-sum-exp per head; layer_norm2; fc1's input; what the
    activation keeps; fc2's input."""
    h, i, heads = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_attention_heads"])
    act = ACTIVATION_SAVES.get(str(v.get("hidden_act", "gelu_pytorch_tanh")), 1)
    return (2 * layer_norm_saved(a, tokens, h) + tokens * (a * h * (1 + 4 + 1) + F32 * heads)
            + tokens * a * i * (act + 1))


def tile_pixels(v: dict[str, Any]) -> int:
    """pixel_values elements of one square tile of the tower's image_size."""
    return int(v.get("num_channels", 3)) * int(v["image_size"]) ** 2


def patches_per_side(v: dict[str, Any]) -> int:
    return int(v["image_size"]) // int(v["patch_size"])


def qwen_image_input(v: dict[str, Any], processor: dict[str, Any], size: tuple[int, int] | None,
                     max_tokens: int | None = None) -> tuple[Images, int]:
    """Qwen2-VL's image processor: the image resized to multiples of patch_size x spatial_merge_size (smart_resize)
    within [min_pixels, max_pixels] (size.shortest_edge, size.longest_edge), one frame padded to temporal_patch_size;
    each spatial_merge_size squared patches one token. None: the most patches max_pixels allows (and MAX_TOKENS)."""
    p, m = int(v["patch_size"]), int(v["spatial_merge_size"])
    factor = p * m
    limits = processor.get("size") or {}
    most = int(processor.get("max_pixels") or limits.get("longest_edge") or 28 * 28 * 1280)
    least = int(processor.get("min_pixels") or limits.get("shortest_edge") or 56 * 56)
    if size is None:
        units = most // factor ** 2 if max_tokens is None else min(most // factor ** 2, max_tokens)
    else:
        h, w = size
        hb, wb = round(h / factor) * factor, round(w / factor) * factor
        if hb * wb > most:
            beta = math.sqrt(h * w / most)
            hb, wb = max(factor, math.floor(h / beta / factor) * factor), max(factor, math.floor(w / beta / factor) * factor)
        elif hb * wb < least:
            beta = math.sqrt(least / (h * w))
            hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
        units = (hb // factor) * (wb // factor)
    patches = units * m * m
    channels = int(v.get("in_chans", v.get("in_channels", 3)))
    return Images(1, patches, patches * channels * int(v["temporal_patch_size"]) * p * p), units


def qwen_attention_saved(a: int, tokens: int, v: dict[str, Any]) -> int:
    """A Qwen-VL block's attention over TOKENS patches, one SDPA call per image (or window): qkv's input, the rotated q
    and k, qkv's output (v is a view of it), the calls' outputs and fp32 log-sum-exp per head, and proj's input (the
    outputs joined, a copy)."""
    h, heads = int(v["hidden_size"]), int(v.get("num_heads", v.get("num_attention_heads", 16)))
    return tokens * (a * h * (1 + 2 + 3 + 1 + 1) + F32 * heads)
def patch_grid_image(config) -> dict[str, Any]:
    """Qwen's towers' blank image: one spatial_merge_size-square grid of patches, flattened as their processors give
    pixel values (a row per patch of in_channels x temporal_patch_size x patch_size^2 values)."""
    import torch

    v = config.vision_config
    m, p, t = int(v.spatial_merge_size), int(v.patch_size), int(v.temporal_patch_size)
    return {"pixel_values": torch.zeros(m * m, int(getattr(v, "in_channels", 3)) * t * p * p),
            "image_grid_thw": torch.tensor([[1, m, m]])}


# ---- the towers' building blocks, as transformers names them ----

def ln(name: str, h: int) -> list[Tensor]:
    """A LayerNorm (weight and bias)."""
    return [Tensor(name + ".weight", (h,), "norm"), Tensor(name + ".bias", (h,), "bias")]


def dense(name: str, out: int, inp: int, bias: bool = True) -> list[Tensor]:
    """A Linear (weight, and bias where it has one)."""
    return [Tensor(name + ".weight", (out, inp), "linear")] + ([Tensor(name + ".bias", (out,), "bias")] if bias else [])


def clip_layers(p: str, v: dict[str, Any]) -> list[Tensor]:
    """A CLIP-ordered encoder's layers under P (encoder.layers.N.; CLIP, Idefics3): self_attn (k, v, q, out), layer_norm1,
    mlp (fc1, fc2), layer_norm2, all with biases."""
    h, i = int(v["hidden_size"]), int(v["intermediate_size"])
    out = []
    for layer in range(int(v["num_hidden_layers"])):
        q = f"{p}encoder.layers.{layer}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            out += dense(q + "self_attn." + proj, h, h)
        out += ln(q + "layer_norm1", h) + dense(q + "mlp.fc1", i, h) + dense(q + "mlp.fc2", h, i)
        out += ln(q + "layer_norm2", h)
    return out


class MmprojTower:
    """The vision tower and projector as llama.cpp's multimodal tool (mtmd) reads them: a second GGUF file (mmproj,
    general.architecture "clip") beside the language model's, written as llama.cpp's convert_hf_to_gguf.py (its
    MmprojModel and the family's subclass) writes it from the checkpoint's safetensors. Mixed into a VisionFamily
    whose projector llama.cpp's converter supports; `projector` is its clip.projector_type."""

    projector = ""
    layer_norm_eps = 1e-6  # clip.vision.attention.layer_norm_epsilon when the vision config has none

    def mmproj_source(self, name: str) -> str | None:
        """The checkpoint tensor NAME as llama.cpp's table (the gguf package's MMPROJ TensorNameMap) knows it, or None
        when the converter leaves it out of the mmproj file (the language model's)."""
        raise NotImplementedError

    def mmproj_parts(self, name: str, array) -> list[tuple[str, Any]]:
        """[(table name, array)] of one kept tensor: itself (a fused or 3-d weight is split by the family)."""
        return [(name, array)]

    def mmproj_force(self, source: str, gguf_name: str, f16: bool) -> str | None:
        """The type llama.cpp's converter forces on a tensor ("F16", "F32"), or None (the file's type): the patch
        embedding follows the file (F16 in an f16 file, F32 otherwise)."""
        if ".patch_embd.weight" in gguf_name or ".patch_merger.weight" in gguf_name:
            return "F16" if f16 else "F32"
        return None

    def mmproj_metadata(self, config: dict[str, Any], preprocessor: dict[str, Any], f16: bool) -> list[tuple[str, Any]]:
        """[(GGUFWriter adder, value)]: MmprojModel.set_gguf_parameters' keys, then the family's."""
        text = {**config, **(config.get("text_config") or {})}
        v = self.mmproj_vision(config)
        return [("add_file_type", 1 if f16 else 0), ("add_clip_has_vision_encoder", True),
                ("add_vision_projection_dim", int(text["hidden_size"])),
                ("add_vision_image_size", int(v["image_size"])), ("add_vision_patch_size", int(v["patch_size"])),
                ("add_vision_embedding_length", int(v["hidden_size"])),
                ("add_vision_feed_forward_length", int(v["intermediate_size"])),
                ("add_vision_block_count", int(v["num_hidden_layers"])),
                ("add_vision_head_count", int(v["num_attention_heads"])),
                ("add_vision_image_mean", list(preprocessor["image_mean"])),
                ("add_vision_image_std", list(preprocessor["image_std"])),
                ("add_clip_projector_type", self.projector),
                ("add_vision_attention_layernorm_eps", float(v.get("layer_norm_eps", self.layer_norm_eps)))]

    def mmproj_vision(self, config: dict[str, Any]) -> dict[str, Any]:
        """The vision config as the converter reads it (its defaults for keys config.json leaves out)."""
        return {**self.vision_defaults, **(config.get("vision_config") or {})}  # type: ignore[attr-defined]
