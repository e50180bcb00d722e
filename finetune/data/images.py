"""A vision-language model's processor in the data pipeline, and images: the processor rides on the tokenizer
(`attach`), so the pipeline, the methods and the paths pass one object as before; images are opened here (a path
relative to the data file, a URL, a datasets.Image value), every failure naming the record; the collator gives the
model what its processor makes of the cached examples' texts and images (finetune.data.vision tokenizes them)."""

from __future__ import annotations

import io
import os
import urllib.request
from pathlib import Path
from typing import Any, Iterable

from finetune.constants import IGNORE_INDEX
from finetune.data.errors import DataError

ATTRIBUTE = "finetune_processor"
PACKS = "finetune_packs_images"  # set where the model's family packs image records exactly (attach's `packs`)
URL_TIMEOUT_S = 30.0


def attach(tokenizer, processor, packs: bool = False) -> None:
    """Give the data pipeline the model's processor through its tokenizer (processor.tokenizer). The processor's chat
    template, where it has one, is the one rendered (it places the image parts). `packs`: the model's family takes
    packed rows of image records exactly (PackedVisionCollator)."""
    setattr(tokenizer, ATTRIBUTE, processor)
    setattr(tokenizer, PACKS, packs)
    template = getattr(processor, "chat_template", None)
    if template:
        tokenizer.chat_template = template


def processor_of(tokenizer):
    return getattr(tokenizer, ATTRIBUTE, None)


def packs_images(tokenizer) -> bool:
    return bool(getattr(tokenizer, PACKS, False))


def fingerprint(tokenizer) -> str:
    """What of the processor changes the tokens: its class and its image processor's settings."""
    processor = processor_of(tokenizer)
    if processor is None:
        return ""
    image_processor = getattr(processor, "image_processor", None)
    return type(processor).__name__ + (image_processor.to_json_string() if image_processor is not None else "")


def offline() -> bool:
    """HF_HUB_OFFLINE (or datasets' and transformers' own flags) set, read now (huggingface_hub reads it at import)."""
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


# ----------------------------------------------------------------------------------------------
# Images: a path relative to the data file, an absolute path, a URL, or a datasets.Image value.


def open_image(ref: Any, where: str, k: int, base: Path | None):
    """(PIL image, what the cache stores for it: an absolute path or {"bytes", "path"}); DataError naming the record
    and the image for a missing or unreadable file, a URL while offline, or a value that is no image."""
    from PIL import Image

    what = f"{where}: images[{k}]"
    if isinstance(ref, dict) and ("bytes" in ref or "path" in ref):  # a datasets.Image value, read undecoded
        if ref.get("bytes") is not None:
            return _decode(ref["bytes"], what, "its bytes"), {"bytes": ref["bytes"], "path": None}
        ref = ref.get("path")
    if isinstance(ref, Image.Image):
        return ref, ref
    if not isinstance(ref, str) or not ref:
        raise DataError(f"{what} must be a path to an image file (a string), got {type(ref).__name__}")
    if ref.startswith(("http://", "https://")):
        if offline():
            raise DataError(f"{what} is a URL ({ref[:200]}) and this run is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE "
                            "set): download the image and give its path, relative to the data file")
        try:
            with urllib.request.urlopen(ref, timeout=URL_TIMEOUT_S) as response:
                data = response.read()
        except Exception as e:  # urllib's URLError, HTTPError, socket timeouts
            raise DataError(f"{what}: cannot fetch {ref[:200]} ({type(e).__name__}: {e})") from None
        return _decode(data, what, ref[:200]), {"bytes": data, "path": None}
    path = Path(ref).expanduser()
    if not path.is_absolute():
        if base is None:
            raise DataError(f"{what} is a relative path ({ref}) in a data set with no folder to resolve it against; "
                            "give an image column (datasets.Image) or absolute paths")
        path = base / path
    if not path.is_file():
        raise DataError(f"{what}: image file '{ref}' not found (looked for {path}); paths are relative to the data "
                        "file's folder")
    try:
        image = Image.open(path)
        image.load()
    except Exception as e:  # PIL.UnidentifiedImageError, truncated files, permissions
        raise DataError(f"{what}: '{ref}' cannot be read as an image ({type(e).__name__}: {e})") from None
    return image, str(path.resolve())


def _decode(data: bytes, what: str, name: str):
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as e:
        raise DataError(f"{what}: {name} cannot be read as an image ({type(e).__name__}: {e})") from None
    return image


def as_pil(value):
    """An image as the cache gives it back (datasets decodes its Image feature to PIL) or as stored."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return Image.open(io.BytesIO(value["bytes"]))
        value = value.get("path")
    return Image.open(value)


# ----------------------------------------------------------------------------------------------
# Batches.


class VisionCollator:
    """Right-padded batches the processor makes from the cached examples' texts and images (pixel values, image
    grids, token types: whatever the model takes), with the cached labels. A truncated example keeps its first
    tokens (all its images' tokens among them: finetune.data.pipeline drops a record whose cut would lose one)."""

    def __init__(self, processor, pad_token_id: int):
        self.processor, self.pad_token_id = processor, pad_token_id

    def __call__(self, features: Iterable[dict[str, Any]]) -> dict[str, Any]:
        import torch

        features = list(features)
        texts = [f["text"] for f in features]
        images = [[as_pil(x) for x in f.get("images") or []] for f in features]
        enc = self.processor(text=texts, images=images if any(images) else None, padding=True, padding_side="right",
                             add_special_tokens=False, return_tensors="pt")
        lengths = [len(f["input_ids"]) for f in features]
        ids = enc["input_ids"]
        width = max(lengths)
        for i, (f, n) in enumerate(zip(features, lengths)):
            if ids.shape[1] < n or ids[i, :n].tolist() != list(f["input_ids"]):
                raise DataError(
                    "the processor's tokens of a cached example differ from the cache's (an image file changed size "
                    "since the data was tokenized, or the processor's settings changed): delete the tokenized data "
                    "cache (--dataset_cache_dir) and run again")
        batch = {}
        for key, value in enc.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == ids.shape[:2]:
                value = value[:, :width].clone()  # per token: input_ids, attention_mask, token types
                for i, n in enumerate(lengths):
                    value[i, n:] = self.pad_token_id if key == "input_ids" else 0
            batch[key] = value
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        for i, f in enumerate(features):
            labels[i, : lengths[i]] = torch.as_tensor(f["labels"])
        batch["labels"] = labels
        return batch


class PackedVisionCollator:
    """Packed rows (or padding-free micro-batches) of image records, for a model that scatters its images' features
    over the image tokens in order, whatever row they are in: each row's records through the processor (their tokens
    checked against the cache, as VisionCollator does), the rows' tokens laid out by
    finetune.data.packing.PackedCollator (positions restarting per record, no attention mask), and the images in the
    order of their tokens across the batch: LLaVA 1.5's [images, channels, height, width] as they come; SmolVLM's
    [records, images, ...], padded with all-zero images that its model drops, as the real images of one row;
    LLaVA-NeXT's [images, tiles, ...] with their image_sizes, padded to the batch's most tiles (its model reads an
    image's own number of tiles from its size)."""

    KEYS = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "image_sizes")  # nothing else

    def __init__(self, processor, pad_token_id: int, layout: str = "rows"):
        from finetune.data.packing import PackedCollator

        self.processor, self.packed = processor, PackedCollator(pad_token_id, layout=layout)

    def __call__(self, features: Iterable[dict[str, Any]]) -> dict[str, Any]:
        import torch

        features = [f if "texts" in f else dict(f, texts=[f["text"]], images=[f.get("images") or []],
                                                seq_lens=[len(f["input_ids"])]) for f in features]
        pixels, masks, sizes = [], [], []
        for f in features:
            images = [[as_pil(x) for x in record] for record in f["images"]]
            enc = self.processor(text=list(f["texts"]), images=images if any(images) else None, padding=True,
                                 padding_side="right", add_special_tokens=False, return_tensors="pt")
            other = sorted(set(enc) - set(self.KEYS))
            if other:
                raise DataError(f"{type(self.processor).__name__} gives {', '.join(other)}: its records cannot be packed")
            start = 0
            for r, n in enumerate(f["seq_lens"]):
                if enc["input_ids"].shape[1] < n or enc["input_ids"][r, :n].tolist() != list(f["input_ids"][start:start + n]):
                    raise DataError(
                        "the processor's tokens of a cached example differ from the cache's (an image file changed "
                        "size since the data was tokenized, or the processor's settings changed): delete the tokenized "
                        "data cache (--dataset_cache_dir) and run again")
                start += n
            if "image_sizes" in enc:
                pixels.append(enc["pixel_values"])
                sizes.append(enc["image_sizes"])
            elif "pixel_attention_mask" in enc:
                # The model's own test of a padding image (all zeros): the real ones, in order.
                real = (enc["pixel_values"] != 0).flatten(2).any(-1)
                pixels.append(enc["pixel_values"][real])
                masks.append(enc["pixel_attention_mask"][real])
            elif "pixel_values" in enc:
                pixels.append(enc["pixel_values"])
        batch = self.packed([{k: f[k] for k in ("input_ids", "labels", "seq_lens")} for f in features])
        if sizes:  # the tiles padded to the batch's most (zeros past an image's own, which its model slices off)
            most = max(p.shape[1] for p in pixels)
            pixels = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in pixels]
            batch["image_sizes"] = torch.cat(sizes)
        if pixels and len({p.shape[1:] for p in pixels}) > 1:
            raise DataError(f"{type(self.processor).__name__} gave images of different sizes to the rows of one batch "
                            f"({sorted({tuple(p.shape[1:]) for p in pixels})}): they cannot be packed together")
        if masks:
            batch["pixel_values"], batch["pixel_attention_mask"] = torch.cat(pixels)[None], torch.cat(masks)[None]
        elif pixels:
            batch["pixel_values"] = torch.cat(pixels)
        return batch
