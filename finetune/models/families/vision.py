"""What the vision-language families share: a checkpoint that holds a vision tower and a projector beside a language
model (transformers' *ForConditionalGeneration, loaded with AutoModelForImageTextToText and an AutoProcessor).

A family here is its language model's family (Llama's, Qwen2's, ...) with `VisionFamily` first in its bases: the
decoder's tensors sit under `language` (model.language_model. in most), the tower and projector come before them
(`vision_tensors`, each family's own, in named_parameters() order), LoRA's default targets are the language model's
projections only (the towers have q_proj, fc1, ... of their own, which a bare name would also wrap), and the tower
and projector are what `vision_prefixes` names, frozen by default."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from finetune.models.families.base import ModelShape, Tensor


class VisionFamily:
    """The mixin, placed before the language model's family class. Class attributes (the same for every checkpoint
    of the family): `language`, the decoder's prefix; `towers`, the vision tower's and projector's module prefixes;
    `text_defaults`, the text config keys a published config.json leaves to transformers' config class."""

    vision = True
    language = "model.language_model."
    towers = ("model.vision_tower", "model.multi_modal_projector")
    text_defaults: dict[str, Any] = {}
    vision_defaults: dict[str, Any] = {}

    def vision_prefixes(self, config) -> tuple[str, ...]:
        return self.towers

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

    def peft_target_modules(self, config, names: list[str]) -> list[str] | str:
        """The names under the language model only (peft matches a regular expression against the whole name)."""
        return rf"{re.escape(self.language)}.*\.({'|'.join(map(re.escape, names))})"


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
