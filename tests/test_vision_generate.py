"""`finetune generate --image` on the vision-language families: greedy tokens equal transformers' own `generate` on
the inputs the model folder's processor makes from the same conversation (apply_chat_template with the image's path),
for the base in one piece, placed by a device_map that sends modules to disk, and with a LoRA adapter (peft's own
PeftModel as the reference) in one piece and offloaded; a text model refuses images by name, and so does a prompt whose image is missing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from finetune.inference import generate as G
from finetune.models import families
from finetune.models.tiny import VLMS

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "What is in this picture?"
NEW = 8


def write_image(path, h=60, w=100, seed=0):
    from PIL import Image

    Image.fromarray(np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def reference(folder, image, adapter=None) -> list[int]:
    """transformers alone: the processor's chat template and tokenization from the image's path, the model's
    generate (peft's PeftModel for an adapter), greedy, cut at the first end-of-sequence token."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetune.compat import processors_without_video

    processors_without_video()
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    messages = [{"role": "user", "content": [{"type": "image", "path": str(image)}, {"type": "text", "text": PROMPT}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    row = out[0, inputs["input_ids"].shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos]) | {processor.tokenizer.eos_token_id}
    return next((row[:i] for i, t in enumerate(row) if t in stop), row)


def finetune_generate(folder, image, tmp_path, *flags) -> tuple[list[int], list[str]]:
    out = tmp_path / "out.jsonl"
    G.run(G.parse_args(["--model_name_or_path", str(folder), "--prompt", PROMPT, "--image", str(image),
                        "--max_new_tokens", str(NEW), "--with_ids", "--torch_dtype", "float32", "--output", str(out),
                        *flags]))
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    return line["completion_ids"], line


def random_adapter(folder, out, seed=1):
    """A LoRA adapter with random A and B on the language model's projections (the family's default targets)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from finetune.models.load import lora_target_modules

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    targets = lora_target_modules(model.config, ["all-linear"])
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)) \
        .save_pretrained(out)
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "llava" else pytest.mark.slow) for n in VLMS])
def test_generate_with_an_image_equals_transformers(name, tiny_vlm, tmp_path, capsys):
    folder = tiny_vlm(name)
    image = write_image(tmp_path / "picture.png")
    want = reference(folder, image)
    got, line = finetune_generate(folder, image, tmp_path)
    assert got == want and line["prompt"] == PROMPT, (got, want)
    # A device map that leaves a third of the weights in memory: the rest goes to disk; the same tokens.
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    placed, _ = finetune_generate(folder, image, tmp_path, "--device_map", "sequential", "--max_memory",
                                  f"cpu={weights // 3},disk=1GB")
    assert "-> disk" in capsys.readouterr().err
    assert placed == want
    adapter = random_adapter(folder, tmp_path / "adapter")
    with_adapter = reference(folder, image, adapter)
    got_adapter, _ = finetune_generate(folder, image, tmp_path, "--adapter", str(adapter))
    assert got_adapter == with_adapter
    placed_adapter, _ = finetune_generate(folder, image, tmp_path, "--adapter", str(adapter), "--device_map",
                                          "sequential", "--max_memory", f"cpu={weights // 3},disk=1GB")
    assert placed_adapter == with_adapter
    print(f"{name}: greedy {len(want)} tokens = transformers' ({want}); on a disk-offloading device map the same; "
          f"with a LoRA adapter {with_adapter} = peft's, offloaded too")


def test_images_are_refused_where_they_cannot_go(tiny_vlm, tiny_chatml, tmp_path):
    folder = tiny_vlm("llava")
    image = write_image(tmp_path / "picture.png")
    with pytest.raises(G.GenerationError, match="--image: this model is a text model"):
        G.run(G.parse_args(["--model_name_or_path", str(tiny_chatml), "--prompt", "hi", "--image", str(image)]))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi", "images": ["missing.png"]}) + "\n")
    with pytest.raises(G.GenerationError, match=r"prompts.jsonl:1: image 'missing.png' not found"):
        G.run(G.parse_args(["--model_name_or_path", str(folder), "--prompts", str(prompts)]))
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                                             {"type": "text", "text": "hi"}]}],
                                   "images": ["picture.png"]}) + "\n")
    with pytest.raises(G.GenerationError, match=r"prompts.jsonl:1: 2 image part\(s\) in the messages but 1 image"):
        G.run(G.parse_args(["--model_name_or_path", str(folder), "--prompts", str(prompts)]))
    assert families.family_of(json.loads((folder / "config.json").read_text())).vision
