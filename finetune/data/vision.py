"""Image records through a vision-language model's processor (finetune.data.images): the `vision` format's
conversations rendered with the chat template, tokenized by the processor (its image-token expansion), loss masks
moved onto the expanded tokens.

Only assistant turns' content and their end-of-turn token are trained (finetune.data.prepare's spans, moved by
the processor's own `text_replacement_offsets`), never an image's tokens. The tokenize-once cache keeps each example's
tokens, labels, rendered text and images; the collator runs the processor on the text and images again (images are
not cached as pixels: they are large) and checks that its tokens are the cached ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from finetune.constants import IGNORE_INDEX
from finetune.data import formats
from finetune.data import prepare as P
from finetune.data.errors import DataError
from finetune.data.formats.base import text_only
from finetune.data.formats.vision import image_refs
from finetune.data.images import open_image, processor_of


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
    try:
        enc = processor(text=[text], images=[images] if images else None, return_offsets_mapping=True,
                        return_text_replacement_offsets=True, add_special_tokens=False)
    except (ValueError, TypeError) as e:  # e.g. a placeholder written in the text, or an image it cannot read
        raise DataError(f"{where}: the processor ({type(processor).__name__}) refused the record: "
                        f"{str(e).strip().splitlines()[0][:300]}") from None
    ids, offsets = list(enc["input_ids"][0]), [tuple(o) for o in enc["offset_mapping"][0]]
    replacements = (enc.get("text_replacement_offsets") or [[]])[0]
    expanded = _shift(len(text), replacements)
    # A turn the template ends with no special token before more text (LLaVA-1.5's "answer USER: ...") ends at its
    # last character, not its trailing space: SentencePiece folds that space into the next word ("▁USER").
    spans = [(a, b if b == len(text) else a + len(text[a:b].rstrip())) for a, b in spans]
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


def as_parts(message: dict) -> dict:
    """A string content as one text part, as TRL gives processors' templates every message (SmolVLM's, LLaVA's
    iterate the content as parts; Gemma-3's and Qwen's render both alike)."""
    content = message.get("content")
    return {**message, "content": [{"type": "text", "text": content}]} if isinstance(content, str) else message


def tokenize_many(tokenizer, records: Iterable[tuple[dict, str]], fmt: str, completion_only: bool,
                  base: Path | None = None) -> list[list[Example]]:
    """The examples of each (record, where): one per conversation, or one per assistant turn where the template
    rewrites earlier turns (finetune.data.prepare.chat_layout), each with the images its text places."""
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
        messages = [as_parts(m) for m in messages]
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


