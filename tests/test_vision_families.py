"""Every vision-language family (finetune.models.tiny.tiny_vlm: a tiny random model with its real processor) trains
on image records: the first step's loss on the Trainer path equals the float64 loss of the same records made with
transformers' processor and model alone, its labels found by each chat template's own turn markers (written here by
hand from the templates, independent of finetune's span masking). CI runs Gemma-3 (token types, pooled image
tokens) and Qwen2.5-VL (mrope positions, dynamic image grids); FINETUNE_FULL_MATRIX=1 runs all six."""

from __future__ import annotations

import json

import pytest
import torch
from launch import matrix
from vision_data import RECORDS, token_mean_nll, write_images, write_jsonl

from finetune.constants import IGNORE_INDEX
from finetune.models import tiny

pytestmark = pytest.mark.slow

# family -> (the text before an assistant turn's content, the token that ends it, text that ends a turn the template
# closes with no token (LLaVA-1.5's next "USER:"), or None).
MARKERS = {
    "gemma3": ("<start_of_turn>model\n", "<end_of_turn>", None),
    "qwen2_5_vl": ("<|im_start|>assistant\n", "<|im_end|>", None),
    "qwen3_vl": ("<|im_start|>assistant\n", "<|im_end|>", None),
    "smolvlm": ("Assistant:", "<end_of_utterance>", None),
    "llava": ("ASSISTANT:", "</s>", "USER:"),
    "llava_next": ("[/INST]", "</s>", None),
}
# LLaVA-1.5's template ends the last assistant turn with no token at all: finetune appends EOS there and trains it
# (docs/data.md), so the reference text gets it too.
APPEND_EOS = {"llava"}


def find(row: list[int], seq: list[int], start: int) -> int:
    for t in range(start, len(row) - len(seq) + 1):
        if row[t:t + len(seq)] == seq:
            return t
    return -1


def reference_labels(tokenizer, ids: torch.Tensor, attention: torch.Tensor, family: str) -> torch.Tensor:
    """After each header, every token through the end token (or up to the stop text); nothing else."""
    header, end, stop = MARKERS[family]
    head = tokenizer(header, add_special_tokens=False)["input_ids"]
    end_id = tokenizer.convert_tokens_to_ids(end)
    stop_ids = tokenizer(stop, add_special_tokens=False)["input_ids"] if stop else None
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r in range(ids.shape[0]):
        row = ids[r][attention[r].bool()].tolist()
        t = find(row, head, 0)
        while t >= 0:
            t += len(head)
            while t < len(row) and not (stop_ids and row[t:t + len(stop_ids)] == stop_ids):
                labels[r, t] = row[t]
                if row[t] == end_id:
                    break
                t += 1
            t = find(row, head, t)
    return labels


def as_parts(messages: list[dict]) -> list[dict]:
    """TRL's form for processors' templates: every content a list of parts."""
    return [dict(m, content=[{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"])
            for m in messages]


def float64_loss(folder, family: str, records: list[dict], base) -> float:
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetune.compat import processors_without_video

    processors_without_video()
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64).train()  # as trained (no dropout)
    texts = [processor.apply_chat_template(as_parts(r["messages"]), tokenize=False) for r in records]
    if family in APPEND_EOS:
        texts = [t + processor.tokenizer.eos_token for t in texts]
    images = [[Image.open(base / p) for p in r.get("images", [])] for r in records]
    enc = processor(text=texts, images=images, padding=True, padding_side="right", add_special_tokens=False,
                    return_tensors="pt")
    labels = reference_labels(processor.tokenizer, enc["input_ids"], enc["attention_mask"], family)
    for key in ("pixel_values",):
        enc[key] = enc[key].double()
    return token_mean_nll(model, enc, labels)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-families")
    write_images(root)
    write_jsonl(root / "data.jsonl", RECORDS)
    return root


@pytest.mark.parametrize("family", matrix(list(tiny.VLMS), ["gemma3", "qwen2_5_vl"]))
def test_first_step_loss_equals_float64(root, family, isolated, one_thread):
    from finetune.training import trainer

    folder = tiny.tiny_vlm(family, root / family)
    out = root / f"out-{family}"
    trainer.main(["--model_name_or_path", str(folder), "--dataset", str(root / "data.jsonl"), "--output_dir", str(out),
                  "--dataset_cache_dir", str(root / f"cache-{family}"), "--per_device_train_batch_size", "2",
                  "--gradient_accumulation_steps", "2", "--max_steps", "1", "--logging_steps", "1",
                  "--max_seq_length", "1024", "--disable_tqdm", "true", "--seed", "3"])
    got = [e["loss"] for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e][0]
    want = float64_loss(folder, family, RECORDS, root)
    print(f"\n{family}: first-step loss {got:.8f}, float64 {want:.8f}, diff {abs(got - want):.1e}")
    assert abs(got - want) < 1e-5


# CI: the two families built above, Qwen3-VL (its deepstack features) and LLaVA 1.5 (a tower layer its features skip).
@pytest.mark.parametrize("family", matrix(list(tiny.VLMS), ["gemma3", "qwen2_5_vl", "qwen3_vl", "llava"]))
def test_blank_image_changes_nothing_but_runs_the_tower(root, family, one_thread):
    """A micro-batch without images runs the tower on the family's blank image, times zero
    (finetune.models.freeze.run_tower_on_every_batch: what keeps ZeRO-3's gathers in step across ranks): the loss and
    every language-model gradient equal the plain model's bit for bit, every tower parameter that an image's forward
    reaches gets a gradient (zero), and those are the tower parameters --freeze_vision_tower false trains; a batch
    with images is left as it is."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetune.compat import processors_without_video
    from finetune.models.freeze import run_tower_on_every_batch, under, vision_prefixes

    processors_without_video()
    folder = tiny.tiny_vlm(family, root / family)
    processor = AutoProcessor.from_pretrained(folder)
    texts = [processor.apply_chat_template(as_parts(r["messages"]), tokenize=False) for r in RECORDS]
    pictures = [[Image.open(root / p) for p in r.get("images", [])] for r in RECORDS]
    text_only = processor.tokenizer([texts[1]], return_tensors="pt", add_special_tokens=False)
    with_images = processor(text=texts[:1], images=pictures[:1], return_tensors="pt", add_special_tokens=False)

    def run(model, batch):
        model.zero_grad()
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}

    plain = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).train()
    hooked = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).train()
    run_tower_on_every_batch(hooked)
    prefixes = vision_prefixes(plain)
    (loss, grads), (loss_h, grads_h) = run(plain, text_only), run(hooked, text_only)
    assert torch.equal(loss, loss_h)
    tower = [n for n in grads if under(n, prefixes)]
    for n in (n for n in grads if n not in tower):
        assert (grads[n] is None) == (grads_h[n] is None) and (grads[n] is None or torch.equal(grads[n], grads_h[n])), n
    assert all(grads[n] is None for n in tower)  # the plain model never runs its tower on text
    # The same tower parameters as an image's forward reaches, each with an all-zero gradient.
    _, image_grads = run(plain, with_images)
    reached = {n for n in tower if image_grads[n] is not None}
    assert reached and reached == {n for n in tower if grads_h[n] is not None}
    assert all(not grads_h[n].any() for n in reached)
    # --freeze_vision_tower false trains exactly those (DDP refuses a trained parameter that gets no gradient).
    from finetune.config import ModelConfig
    from finetune.models.load import load_model

    loaded = load_model(ModelConfig(model_name_or_path=str(folder), freeze_vision_tower=False))
    assert {n for n, p in loaded.named_parameters() if under(n, prefixes) and p.requires_grad} == reached
    (a, ga), (b, gb) = run(plain, with_images), run(hooked, with_images)
    assert torch.equal(a, b) and all(torch.equal(ga[n], gb[n]) for n in ga if ga[n] is not None)
    print(f"\n{family}: text-only loss {loss.item():.8f} with and without the blank image; {len(reached)} of "
          f"{len(tower)} tower tensors reached, gradients zero")
