"""`finetune export` of a vision-language model: a LoRA adapter merged into its base gives a folder that reloads
with AutoModelForImageTextToText and its processor (saved from the base's, verified to render a conversation with an
image as the base's does), whose logits on the processor's inputs for an image equal base + adapter (peft) within
1e-5; a base folder without its processor files is refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_vision_generate import random_adapter, write_image

from finetune.convert import export as E
from finetune.models.tiny import VLMS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "llava" else pytest.mark.slow) for n in VLMS])
def test_merged_folder_reloads_with_its_processor(name, tiny_vlm, tmp_path, capsys):
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from finetune.models.load import load_processor

    folder = tiny_vlm(name)
    adapter = random_adapter(folder, tmp_path / "adapter")
    out = tmp_path / "merged"
    E.main(["--adapter", str(adapter), "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert f"verified model {out}:" in err and "saved and verified" in err
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "processor_config.json", "chat_template.jinja", "tokenizer.json"} <= names
    processor, source = load_processor(out), load_processor(folder)
    assert type(processor) is type(source) and type(processor.image_processor) is type(source.image_processor)
    image = Image.open(write_image(tmp_path / "picture.png")).convert("RGB")
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    inputs = processor(text=[processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)],
                       images=[[image]], return_tensors="pt")
    want = source(text=[source.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)],
                  images=[[image]], return_tensors="pt")
    assert all(torch.equal(inputs[k], want[k]) for k in want) and set(inputs) == set(want)
    merged = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(**want).logits
        reference = PeftModel.from_pretrained(base, str(adapter)).eval()(**want).logits
        got = merged(**inputs).logits
    diff = (got - reference).abs().max().item()
    assert diff <= 1e-5, diff
    assert (got - base_logits).abs().max().item() > 1e-3  # the adapter is in there
    print(f"{name}: merged folder reloads with {type(processor).__name__}; logits on an image prompt vs base + "
          f"adapter: {diff:.2g}")


def test_a_base_without_its_processor_is_refused(tiny_vlm, tmp_path, capsys):
    folder = tmp_path / "base"
    shutil.copytree(tiny_vlm("llava"), folder)
    adapter = random_adapter(folder, tmp_path / "adapter")
    (folder / "processor_config.json").unlink()
    with pytest.raises(SystemExit) as exit_info:
        E.main(["--adapter", str(adapter), "--output_dir", str(tmp_path / "merged")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "a vision-language model's folder needs its processor files" in err and str(folder) in err
    assert not (tmp_path / "merged").exists()
