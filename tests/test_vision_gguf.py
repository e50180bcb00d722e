"""GGUF export of the vision-language families llama.cpp's converter writes (SmolVLM, Gemma-3): the language model's
file loads back (finetune's reader, transformers' GGUF loader underneath) to the multimodal model's text-only logits,
and the mmproj file beside it reads back with the gguf package as llama.cpp's convert_hf_to_gguf.py writes one for
mtmd: general.architecture "clip", general.type "mmproj", the projector type, the vision keys, every tensor of the
tower and projector under clip.cpp's names (TN_* in tools/mtmd/clip-impl.h) with the converter's types and the
checkpoint's values (Gemma-3's projector norm as 1 + weight, its input projection in f16)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from finetune.convert import export as E

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = ("attn_q", "attn_k", "attn_v", "attn_out", "ln1", "ln2", "ffn_up", "ffn_down")
# clip.cpp's tensor names for a 2-layer tower, then the family's projector: (name, GGML type in an f32 export).
TOWER = ([("v.patch_embd.weight", "F32"), ("v.patch_embd.bias", "F32"), ("v.position_embd.weight", "F32")]
         + [(f"v.blk.{i}.{t}.{p}", "F32") for i in range(2) for t in BLOCK for p in ("weight", "bias")]
         + [("v.post_ln.weight", "F32"), ("v.post_ln.bias", "F32")])
EXPECTED = {
    "smolvlm": dict(tensors=TOWER + [("mm.model.fc.weight", "F32")], projector="idefics3",
                    keys={"clip.vision.projector.scale_factor": 2, "clip.vision.preproc_image_size": 64,
                          "clip.vision.image_size": 32, "clip.vision.patch_size": 16,
                          "clip.vision.attention.layer_norm_epsilon": 1e-6}),
    "gemma3": dict(tensors=TOWER + [("mm.input_projection.weight", "F16"), ("mm.soft_emb_norm.weight", "F32")],
                   projector="gemma3",
                   # (28 // 14) patches a side pooled to 2 tokens a side: scale 1, written (llama.cpp's default is 4)
                   keys={"clip.vision.projector.scale_factor": 1, "clip.vision.image_size": 28,
                         "clip.vision.patch_size": 14, "clip.vision.attention.layer_norm_epsilon": 1e-6}),
}
# Each GGUF tensor's checkpoint tensor (safetensors names as transformers 5 saves them).
SOURCES = {
    "smolvlm": dict({"v.patch_embd": "model.vision_model.embeddings.patch_embedding",
                     "v.position_embd": "model.vision_model.embeddings.position_embedding",
                     "v.post_ln": "model.vision_model.post_layernorm",
                     "mm.model.fc": "model.connector.modality_projection.proj"},
                    **{f"v.blk.{i}.{t}": f"model.vision_model.encoder.layers.{i}.{hf}" for i in range(2)
                       for t, hf in zip(BLOCK, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                "self_attn.out_proj", "layer_norm1", "layer_norm2", "mlp.fc1",
                                                "mlp.fc2"))}),
    "gemma3": dict({"v.patch_embd": "vision_tower.embeddings.patch_embedding",
                    "v.position_embd": "vision_tower.embeddings.position_embedding",
                    "v.post_ln": "vision_tower.post_layernorm",
                    "mm.input_projection": "multi_modal_projector.mm_input_projection",
                    "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm"},
                   **{f"v.blk.{i}.{t}": f"vision_tower.encoder.layers.{i}.{hf}" for i in range(2)
                      for t, hf in zip(BLOCK, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                               "self_attn.out_proj", "layer_norm1", "layer_norm2", "mlp.fc1",
                                               "mlp.fc2"))}),
}


def field(reader, key):
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0].name == "STRING" else value.tolist()[0]


@pytest.mark.parametrize("name", ["smolvlm", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_gguf_and_mmproj_read_back_as_llama_cpp_writes_them(name, tiny_vlm, tmp_path, capsys):
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from finetune.convert.gguf_import import load_gguf
    from finetune.models.verify import fixed_input, logits_of

    folder = tiny_vlm(name)
    out = tmp_path / "gguf" / "model.gguf"
    E.main(["--to", "gguf", "--model_name_or_path", str(folder), str(out)])
    err = capsys.readouterr().err
    assert "the vision tower and projector are not included (llama.cpp reads them from a separate mmproj file)" in err
    mmproj = out.parent / "mmproj-model.gguf"
    assert f"wrote {mmproj}" in err and sorted(p.name for p in out.parent.iterdir()) == [
        "Modelfile", "mmproj-model.gguf", "model.gguf"]

    # The language model: its text-only logits, through the GGUF file.
    vlm = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    loaded, _ = load_gguf(out)
    ids = fixed_input(vlm.config.get_text_config().vocab_size)
    lm_diff = (logits_of(loaded, ids) - logits_of(vlm, ids)).abs().max().item()
    assert lm_diff <= 1e-5, lm_diff

    reader = gguf.GGUFReader(str(mmproj))
    expected = EXPECTED[name]
    assert (field(reader, "general.architecture"), field(reader, "general.type"),
            field(reader, "clip.projector_type")) == ("clip", "mmproj", expected["projector"])
    assert field(reader, "clip.has_vision_encoder") is True and field(reader, "clip.use_gelu") is True
    v = json.loads((folder / "config.json").read_text())["vision_config"]
    keys = {"clip.vision.projection_dim": 32, "clip.vision.embedding_length": v["hidden_size"],
            "clip.vision.feed_forward_length": v["intermediate_size"], "clip.vision.block_count": 2,
            "clip.vision.attention.head_count": v["num_attention_heads"], **expected["keys"]}
    for key, value in keys.items():
        assert field(reader, key) == pytest.approx(value), key
    tensors = {t.name: t for t in reader.tensors}
    assert sorted((n, t.tensor_type.name) for n, t in tensors.items()) == sorted(expected["tensors"])
    state = load_file(str(folder / "model.safetensors"))
    for gguf_name, t in tensors.items():
        stem, _, suffix = gguf_name.rpartition(".")
        key = SOURCES[name][stem] + ("_weight" if stem == "mm.input_projection" else "." + suffix)
        want = state[key].float().numpy()
        if stem == "mm.soft_emb_norm":
            want = want + 1  # Gemma3RMSNorm's (1 + weight), stored as llama.cpp's norm weight
        if t.tensor_type.name == "F16":
            want = want.astype(np.float16)
        got = np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist())))
        assert got.shape == want.shape and np.array_equal(got, want), gguf_name
    print(f"{name}: language model file logits vs the VLM's text-only logits {lm_diff:.2g}; mmproj "
          f"{len(tensors)} tensors ({expected['projector']}) read back: names, types, values and "
          f"{len(keys) + 5} metadata keys as llama.cpp's converter writes them")
