"""Image records through a vision-language model's processor: the `vision` format's conversations rendered with the
chat template, tokenized by the processor (its image-token expansion), loss masks moved onto the expanded tokens,
and the collator that gives the model what its processor makes (pixel values, grids, token types).

The processor rides on the tokenizer (`attach`), so the data pipeline, the methods and the paths pass one object as
before. Only assistant turns' content and their end-of-turn token are trained (finetune.data.prepare's spans, moved by
the processor's own `text_replacement_offsets`), never an image's tokens. The tokenize-once cache keeps each example's
tokens, labels, rendered text and images; the collator runs the processor on the text and images again (images are
not cached as pixels: they are large) and checks that its tokens are the cached ones.
"""

from __future__ import annotations

import io
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from finetune.constants import IGNORE_INDEX
from finetune.data import formats
from finetune.data.errors import DataError
from finetune.data.formats.base import text_only
from finetune.data.formats.vision import image_refs

ATTRIBUTE = "finetune_processor"
URL_TIMEOUT_S = 30.0


def attach(tokenizer, processor) -> None:
    """Give the data pipeline the model's processor through its tokenizer (processor.tokenizer). The processor's chat
    template, where it has one, is the one rendered (it places the image parts)."""
    setattr(tokenizer, ATTRIBUTE, processor)
    template = getattr(processor, "chat_template", None)
    if template:
        tokenizer.chat_template = template


def processor_of(tokenizer):
    return getattr(tokenizer, ATTRIBUTE, None)


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
# Records to examples.


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    text: str  # the rendered text the processor expands (placeholders, not image tokens)
    images: list  # what the cache stores per image (open_image)
    image_end: int  # one past the last image token (0: none); truncation must not cut before it


def _image_token_ids(processor) -> set[int]:
    ids = set()
    for name in ("image_token_ids", "image_token_id"):
        value = getattr(processor, name, None)
        for v in value if isinstance(value, (list, tuple, set)) else [value]:
            if isinstance(v, int):
                ids.add(v)
    return ids


def _shift(char: int, replacements: list[dict]) -> int:
    """A character position of the rendered text in the processor's expanded text."""
    return char + sum(len(r["replacement"]) - (r["span"][1] - r["span"][0]) for r in replacements if r["span"][1] <= char)


def encode(tokenizer, processor, text: str, spans: list[tuple[int, int]], images: list, stored: list,
           completion_only: bool, where: str, special: set[int]) -> Example:
    """One rendered text through the processor: its tokens, the spans' tokens trained (through their last special
    token), every image token masked."""
    from finetune.data import prepare as P

    try:
        enc = processor(text=[text], images=[images] if images else None, return_offsets_mapping=True,
                        return_text_replacement_offsets=True, add_special_tokens=False)
    except (ValueError, TypeError) as e:  # e.g. a placeholder written in the text, or an image it cannot read
        raise DataError(f"{where}: the processor ({type(processor).__name__}) refused the record: "
                        f"{str(e).strip().splitlines()[0][:300]}") from None
    ids, offsets = list(enc["input_ids"][0]), [tuple(o) for o in enc["offset_mapping"][0]]
    replacements = (enc.get("text_replacement_offsets") or [[]])[0]
    expanded = _shift(len(text), replacements)
    moved = [(_shift(a, replacements), _shift(b, replacements)) for a, b in spans]
    ids, labels = P._span_labels(tokenizer, ids, offsets, expanded, moved, completion_only, special)
    if len(ids) > len(offsets):  # EOS appended by the masking (a template that ends a turn with no special token)
        text += tokenizer.eos_token
    image_ids, inside = _image_token_ids(processor), [r["new_span"] for r in replacements]
    image_end = 0
    for t, (s, e) in enumerate(offsets):
        if ids[t] in image_ids or any(a <= s < b for a, b in inside):
            labels[t] = IGNORE_INDEX
            image_end = t + 1
    return Example(ids, labels, text, stored, image_end)


def tokenize_many(tokenizer, records: Iterable[tuple[dict, str]], fmt: str, completion_only: bool,
                  base: Path | None = None) -> list[list[Example]]:
    """The examples of each (record, where): one per conversation, or one per assistant turn where the template
    rewrites earlier turns (finetune.data.prepare.chat_layout), each with the images its text places."""
    from finetune.data import prepare as P

    processor = processor_of(tokenizer)
    renderer, special = P.ChatRenderer(tokenizer), P._special_ids(tokenizer)
    placeholder = getattr(processor, "image_token", None)
    out = []
    for record, where in records:
        messages, tools = formats.get(fmt).conversation(record, where)
        refs = image_refs(record)
        if refs and processor is None:
            raise text_only(where, len(refs), tokenizer.name_or_path)
        if processor is None:  # text records of the vision format, for a text-only model
            examples = P.encode_chats(tokenizer, [P.chat_layout(tokenizer, messages, where, tools, renderer)], completion_only)[0]
            out.append([Example(ids, labels, "", [], 0) for ids, labels in examples])
            continue
        opened = [open_image(ref, where, k, base) for k, ref in enumerate(refs)]
        full, spans = P.chat_layout(tokenizer, messages, where, tools, renderer)
        if full is not None:
            pieces = [(full, spans)]
        else:  # per assistant turn: the turn after its context, trained alone
            pieces = [(through, [(len(context), len(through))]) for context, through in spans]
        examples = []
        for text, piece_spans in pieces:
            n = text.count(placeholder) if placeholder and full is None else len(opened)
            examples.append(encode(tokenizer, processor, text, piece_spans, [i for i, _ in opened[:n]],
                                   [s for _, s in opened[:n]], completion_only, where, special))
        out.append(examples)
    return out


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
