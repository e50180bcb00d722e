"""What the vision tests share: a tiny Gemma-3 vision-language model with the real Gemma-3 tokenizer and processor,
small images, records in TRL's conversational vision format, and the float64 reference of a batch's loss built from
transformers' processor and model directly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from finetune.constants import IGNORE_INDEX

# Gemma-3's tokens: the real tokenizer's ids (tests/data/gemma3).
START_OF_TURN, END_OF_TURN, MODEL, NEWLINE = 105, 106, 4368, 107


def tiny_gemma3_vlm(folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Gemma3ForConditionalGeneration with a one-layer SigLIP tower (28-pixel images, 4 tokens each), the real
    Gemma-3 tokenizer, and Gemma3Processor around them."""
    from family_configs import tiny_config
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    if (folder / "config.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = tiny_config("gemma3", 262208).to_dict()
    text.update(pad_token_id=0, eos_token_id=END_OF_TURN, bos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=tokenizer.image_token_id, boi_token_index=tokenizer.convert_tokens_to_ids(tokenizer.boi_token),
                          eoi_token_index=tokenizer.convert_tokens_to_ids(tokenizer.eoi_token), pad_token_id=0,
                          eos_token_id=END_OF_TURN, bos_token_id=2)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # away from the near-uniform start, so a wrong token or mask shows in the loss
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.generation_config.eos_token_id = END_OF_TURN
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
                                tokenizer=tokenizer, chat_template=tokenizer.chat_template, image_seq_length=4)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def write_images(folder: Path, n: int = 4) -> list[str]:
    """n small RGB PNGs of different sizes (the processor resizes them), named img/K.png."""
    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    names = []
    for k in range(n):
        pixels = (np.random.RandomState(k).rand(20 + 7 * k, 30 - 3 * k, 3) * 255).astype("uint8")
        Image.fromarray(pixels).save(folder / "img" / f"{k}.png")
        names.append(f"img/{k}.png")
    return names


def user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


RECORDS = [
    {"messages": [user(None, "What colour is this?"), assistant("Mostly grey, with noise.")], "images": ["img/0.png"]},
    {"messages": [{"role": "user", "content": "Say hello."}, assistant("Hello!")]},  # text only, in the same set
    {"messages": [user("Compare", None, None), {"role": "assistant", "content": [{"type": "text", "text": "Both are noise."}]},
                  {"role": "user", "content": "Which is taller?"}, assistant("The second one.")],
     "images": ["img/1.png", "img/2.png"]},
    {"messages": [user(None, "Describe it in three words."), assistant("Random coloured dots.")], "images": ["img/3.png"]},
]
# The assistant turns' contents, in order, as the template writes them (trimmed).
ANSWERS = [["Mostly grey, with noise."], ["Hello!"], ["Both are noise.", "The second one."], ["Random coloured dots."]]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reference_labels(ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Gemma-3's trained tokens found by its turn markers alone: after each `<start_of_turn>model\\n`, every token
    through the next `<end_of_turn>`; nothing else (independent of finetune's span masking)."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r in range(ids.shape[0]):
        row = ids[r].tolist()
        t = 0
        while t < len(row) - 2:
            if row[t:t + 3] == [START_OF_TURN, MODEL, NEWLINE]:
                t += 3
                while t < len(row) and attention[r, t]:
                    labels[r, t] = row[t]
                    if row[t] == END_OF_TURN:
                        break
                    t += 1
            t += 1
    return labels


def float64_loss(folder: Path, records: list[dict], base: Path) -> float:
    """The records' mean token loss as transformers' own pieces give it: the processor's chat template and call on
    the texts and images, the model in float64, labels by reference_labels."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).train()  # as trained (no dropout)
    texts = [processor.apply_chat_template(r["messages"], tokenize=False) for r in records]
    images = [[Image.open(base / p) for p in r.get("images", [])] for r in records]
    enc = processor(text=texts, images=images, padding=True, padding_side="right", add_special_tokens=False,
                    return_tensors="pt")
    labels = reference_labels(enc["input_ids"], enc["attention_mask"])
    enc["pixel_values"] = enc["pixel_values"].double()
    return token_mean_nll(model, enc, labels)


def token_mean_nll(model, enc: dict, labels: torch.Tensor) -> float:
    """The model's float64 loss on ENC: the mean negative log-likelihood over LABELS' trained tokens (shifted)."""
    with torch.no_grad():
        logits = model(**enc).logits.double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    nll = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return float(nll[mask].sum() / mask.sum())
