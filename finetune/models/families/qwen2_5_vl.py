"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration, model_type qwen2_5_vl): Qwen2's decoder (biases on q, k, v) under
model.language_model., with multimodal rope (mrope: the rotary dimensions split in three sections, temporal, height
and width, rope_scaling.mrope_section), after a ViT under model.visual: a 3-d patch embedding (temporal_patch_size
frames of patch_size squared, no bias), RMSNorm blocks with a fused qkv and a SwiGLU MLP (windowed attention but on
fullatt_block_indexes), and the merger (the projector, also under model.visual): an RMSNorm, then an MLP over
spatial_merge_size squared neighbouring patches into the language model's width. model.visual is the tower and
projector: frozen by default.

GGUF, as llama.cpp's convert_hf_to_gguf.py writes this family (its Qwen2VLModel and Qwen2VLVisionModel): the language
model as llama.cpp's "qwen2vl" architecture (Qwen2's tensors; rope.dimension_sections, the mrope sections padded to
four), and the tower and projector as an mmproj file (projector qwen2.5vl_merger: the 3-d patch embedding split into
its two frames, the fused qkv into q, k and v, the merger's norm and MLP as v.post_ln, mm.0, mm.2; the window
attention pattern from fullatt_block_indexes). transformers cannot read a "qwen2vl" file: finetune reads it back
itself as the text model it computes for text (Qwen2ForCausalLM: text positions are the same on mrope's three
axes, so mrope is Qwen2's rope)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.models.families.base import Images, ModelShape, Saving, Tensor
from finetune.models.families.qwen2 import QWEN2, Qwen2Family
from finetune.models.families.vision import (F32, MmprojTower, VisionFamily, dense, patch_grid_image, qwen_attention_saved,
                                             qwen_image_input)


def window_pattern(vision: dict[str, Any]) -> int | None:
    """n, where every n-th vision block attends fully (fullatt_block_indexes n-1, 2n-1, ...: llama.cpp's n_wa_pattern),
    or None for another pattern."""
    full = list(vision.get("fullatt_block_indexes") or [])
    if not full or any(b - a != full[0] + 1 for a, b in zip(full, full[1:])):
        return None
    return full[0] + 1


@dataclass(frozen=True)
class Qwen2VLTextFamily(Qwen2Family):
    """The language model of a Qwen2.5-VL checkpoint as llama.cpp's "qwen2vl" file holds it: Qwen2's tensors and
    keys, plus the mrope sections. Not in FAMILIES (a Qwen2 config is Qwen2's): a "qwen2vl" file's family is
    Qwen2.5-VL's, which hands its language model and its reading to this one."""

    def gguf_metadata(self, config) -> list[tuple[str, Any]]:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sections = list(config.mrope_section)[:4]
        meta = [m for m in super().gguf_metadata(config) if m[0] not in ("add_rope_dimension_count", "add_vocab_size")]
        # As llama.cpp's converter writes them: four sections (the fourth 0) and the head's width, always.
        return meta + [("add_rope_dimension_sections", sections + [0] * (4 - len(sections))),
                       ("add_key_length", head_dim), ("add_value_length", head_dim)]

    def gguf_config(self, meta: dict[str, Any]) -> dict[str, Any]:
        return {}

    def load_gguf(self, path, meta: dict[str, Any]):
        """The text model (Qwen2ForCausalLM in float32) of a "qwen2vl" file, built from the file's keys and tensors
        (gguf_state_dict), which transformers' loader does not read."""
        import torch
        from gguf import GGUFReader
        from transformers import Qwen2Config, Qwen2ForCausalLM

        a = self.gguf_arch
        layers, hidden, heads = (int(meta[f"{a}.block_count"]), int(meta[f"{a}.embedding_length"]),
                                 int(meta[f"{a}.attention.head_count"]))
        reader = GGUFReader(str(path))
        names = {t.name: t for t in reader.tensors}
        config = Qwen2Config(
            vocab_size=int(names["token_embd.weight"].shape[1]), hidden_size=hidden, num_hidden_layers=layers,
            intermediate_size=int(meta[f"{a}.feed_forward_length"]), num_attention_heads=heads,
            num_key_value_heads=int(meta.get(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{a}.attention.key_length", hidden // heads)),
            max_position_embeddings=int(meta[f"{a}.context_length"]),
            rms_norm_eps=float(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
            rope_parameters={"rope_type": "default", "rope_theta": float(meta.get(f"{a}.rope.freq_base", 1e6))},
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
        state = self.gguf_state_dict(path, self.shape(config.to_dict()))
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config)
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        # The rotary frequencies are a non-persistent buffer: computed again on the CPU, not left on meta.
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
        return model.float().eval()

    def load_gguf_tokenizer(self, path):
        """transformers' GGUF tokenizer without its config reader (which refuses "qwen2vl"): the same converter
        from the file's tokenizer.ggml keys."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)


QWEN2VL_TEXT = Qwen2VLTextFamily(
    name="qwen2vl",
    model_types=("qwen2",),  # the model it reads back as (Qwen2ForCausalLM)
    hf_classes=("Qwen2ForCausalLM",),
    gguf_arch="qwen2vl",
    gguf_required=QWEN2.gguf_required,
    chat_templates=("chatml",),
)


@dataclass(frozen=True)
class Qwen25VLFamily(VisionFamily, MmprojTower, Qwen2Family):
    towers = ("model.visual",)
    projector = "qwen2.5vl_merger"

    # ---- GGUF: the language model ("qwen2vl", QWEN2VL_TEXT) ----

    def gguf_model(self, model) -> tuple[Any, str | None]:
        """The language model as a Qwen2ForCausalLM over the checkpoint's decoder and head (no copy), written and read
        back as QWEN2VL_TEXT (its `gguf_family`)."""
        if getattr(model, "gguf_family", None) is QWEN2VL_TEXT:
            return model, None
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        text = model.config.get_text_config().to_dict()
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "hidden_act",
                "bos_token_id", "eos_token_id", "pad_token_id")
        config = Qwen2Config(**{k: text[k] for k in keep if k in text},
                             rope_parameters={"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 1e6))},
                             tie_word_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)))
        config.mrope_section = list(rope["mrope_section"])
        with torch.device("meta"):
            lm = Qwen2ForCausalLM(config)
        lm.model, lm.lm_head = model.model.language_model, model.lm_head
        lm.gguf_family = QWEN2VL_TEXT
        return lm.eval(), ("the file holds the language model only: the vision tower and projector are not included "
                           "(llama.cpp reads them from a separate mmproj file)")

    def gguf_refusal(self, config) -> str | None:
        text = config.get_text_config()
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        if not rope.get("mrope_section"):
            return "text_config.rope_parameters has no mrope_section: llama.cpp's qwen2vl needs the mrope sections"
        v = config.vision_config
        if int(v.temporal_patch_size) != 2:
            return f"vision_config.temporal_patch_size {v.temporal_patch_size}: llama.cpp's qwen2.5vl_merger reads 2"
        if window_pattern(v.to_dict()) is None:
            return (f"vision_config.fullatt_block_indexes {v.fullatt_block_indexes}: llama.cpp's qwen2.5vl_merger reads "
                    "full attention on every n-th block only (n-1, 2n-1, ...)")
        return super().gguf_refusal(config)

    def gguf_required_names(self) -> tuple[str, ...]:
        return QWEN2VL_TEXT.gguf_required_names()

    def load_gguf(self, path, meta: dict[str, Any]):
        return QWEN2VL_TEXT.load_gguf(path, meta)

    def load_gguf_tokenizer(self, path):
        return QWEN2VL_TEXT.load_gguf_tokenizer(path)

    # ---- GGUF: the mmproj file (MmprojTower) ----

    def mmproj_source(self, name: str) -> str | None:
        # Qwen2VLVisionModel.filter_tensors: the tensors under visual. (the tower and the merger).
        return name if name.startswith("visual.") else None

    def mmproj_parts(self, name: str, array) -> list[tuple[str, Any]]:
        # Qwen2VLVisionModel.modify_tensors: the fused qkv split in three; the 3-d patch embedding's two frames as two
        # 2-d ones (the second under the name plus ".1", which clip.cpp reads).
        if ".qkv." in name:
            third = array.shape[0] // 3
            return [(name.replace("qkv", part), array[k * third:(k + 1) * third]) for k, part in enumerate("qkv")]
        if "patch_embed.proj.weight" in name:  # temporal_patch_size 2 (gguf_refusal)
            return [(name, array[:, :, 0]), (name + ".1", array[:, :, 1])]
        return [(name, array)]

    def mmproj_force(self, source: str, gguf_name: str, f16: bool) -> str | None:
        return "F32" if ".position_embd." in gguf_name else super().mmproj_force(source, gguf_name, f16)

    def mmproj_vision(self, config: dict[str, Any]) -> dict[str, Any]:
        # Qwen2VLVisionModel.__init__: the converter's names for the keys (image_size 560 when the config has none).
        v = super().mmproj_vision(config)
        return dict(v, image_size=v.get("image_size", 560), num_attention_heads=v.get("num_heads"),
                    num_hidden_layers=v.get("depth"))

    def mmproj_metadata(self, config: dict[str, Any], preprocessor: dict[str, Any], f16: bool) -> list[tuple[str, Any]]:
        # The window-attention pattern: every n-th block attends fully (fullatt_block_indexes n-1, 2n-1, ...).
        pattern = window_pattern(self.mmproj_vision(config))
        meta = [m for m in super().mmproj_metadata(config, preprocessor, f16)
                if m[0] != "add_vision_attention_layernorm_eps"]
        return meta + [("add_vision_use_silu", True), ("add_vision_n_wa_pattern", pattern),
                       ("add_vision_attention_layernorm_eps", float(config.get("rms_norm_eps", 1e-6)))]
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

    def image_input(self, config: dict[str, Any], processor: dict[str, Any], size: tuple[int, int] | None,
                    max_tokens: int | None = None) -> tuple[Images, int]:
        return qwen_image_input(self.vision_dict(config), processor, size, max_tokens)

    def tower_saved(self, sh: ModelShape, run: Saving, images: Images, v: dict[str, Any]) -> dict[str, int]:
        """The patch embedding's input (the batch's pixel_values), the window order and its inverse (one index per
        merged patch), the rotary cos and sin (fp32, shared by the blocks), each block (two RMSNorms: the fp32 input,
        the reciprocal deviation, the normalized value; its attention, windowed or not alike; the SwiGLU MLP's input,
        gate, SiLU and up outputs, down's input), and the merger (its RMSNorm, both linears' inputs and the GELU's)."""
        a, t = run.a, images.patches
        h, i = int(v["hidden_size"]), int(v["intermediate_size"])
        heads = int(v.get("num_heads", 16))
        merged = t // int(v["spatial_merge_size"]) ** 2
        norm = t * (h * (F32 + a) + F32)
        block = 2 * norm + qwen_attention_saved(a, t, v) + a * t * h + 4 * a * t * i
        return {"vision tower: patch embedding input": a * images.pixels,
                "vision tower: window order": 2 * 8 * merged,
                "vision tower: rotary cos/sin": 2 * F32 * t * (h // heads),
                "vision tower: layers": int(v["depth"]) * block,
                "projector": norm + 3 * a * t * h}

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
    gguf_arch="qwen2vl",
    gguf_required=QWEN2.gguf_required,
    chat_templates=("chatml",),
)
