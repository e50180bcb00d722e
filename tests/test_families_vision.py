"""The vision-language families (Family.vision): Gemma-3 multimodal, Qwen2.5-VL, Qwen3-VL, SmolVLM (Idefics3), LLaVA 1.5
and LLaVA-NeXT. Their tensors from config.json equal, name for name, the model transformers builds on the meta device
from the published config.json of a checkpoint of each (vision tower and projector included), and the totals are the
published ones; LoRA's default targets are the language model's projections only, as peft makes them; the tiny
models of finetune.models.tiny.tiny_vlm load with their real processor classes (no torchvision here), which expand
each image into the number of tokens the model's own forward takes."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.models import families
from finetune.models.tiny import VLMS

# The published config.json of each checkpoint, as its Hub repository holds it.
PUBLISHED = {
    "Qwen2.5-VL-7B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
        "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
        "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                          "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                          "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                          "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064},
    "Qwen3-VL-8B-Instruct": {
        "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
        "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
                        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
                        "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 262144,
                        "model_type": "qwen3_vl_text", "num_attention_heads": 32, "num_hidden_layers": 36,
                        "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                        "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936},
        "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
        "vision_config": {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
                          "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
                          "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
                          "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
        "vision_end_token_id": 151653, "vision_start_token_id": 151652},
    "SmolVLM-256M-Instruct": {
        "architectures": ["Idefics3ForConditionalGeneration"], "image_token_id": 49190, "model_type": "idefics3",
        "scale_factor": 4, "pad_token_id": 128002, "vocab_size": 49280, "tie_word_embeddings": False,
        "text_config": {"_flash_attn_2_enabled": True, "architectures": ["VLlamaForCausalLM"], "head_dim": 64,
                        "hidden_size": 576, "intermediate_size": 1536, "is_llama_config": True,
                        "max_position_embeddings": 8192, "model_type": "llama", "neftune_noise_alpha": 0.0,
                        "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
                        "pad_token_id": 2, "perceiver_config": {"model_type": "vllama3"}, "pixel_shuffle_factor": 4,
                        "qk_layer_norms": False, "rms_norm_eps": 1e-05, "rope_interleaved": False,
                        "rope_theta": 100000, "torch_dtype": "bfloat16", "transformers.js_config": {},
                        "use_resampler": False, "vocab_size": 49280, "tie_word_embeddings": False},
        "vision_config": {"hidden_size": 768, "image_size": 512, "intermediate_size": 3072, "model_type": "idefics3",
                          "num_attention_heads": 12, "num_hidden_layers": 12, "patch_size": 16,
                          "max_image_size": {"longest_edge": 512}, "size": {"longest_edge": 2048}}},
    "SmolVLM2-2.2B-Instruct": {
        "architectures": ["SmolVLMForConditionalGeneration"], "image_token_id": 49190, "model_type": "smolvlm",
        "scale_factor": 3, "pad_token_id": 128002, "tie_word_embeddings": False, "vocab_size": 49280,
        "text_config": {"architectures": ["VLlamaForCausalLM"], "head_dim": 64, "hidden_size": 2048,
                        "intermediate_size": 8192, "max_position_embeddings": 16384, "model_type": "llama",
                        "num_attention_heads": 32, "num_hidden_layers": 24, "num_key_value_heads": 32,
                        "pad_token_id": 2, "rms_norm_eps": 1e-05, "rope_theta": 130000, "torch_dtype": "float32",
                        "vocab_size": 49280, "tie_word_embeddings": False},
        "vision_config": {"hidden_size": 1152, "image_size": 384, "intermediate_size": 4304, "model_type": "smolvlm_vision",
                          "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
                          "max_image_size": {"longest_edge": 384}, "size": {"longest_edge": 1536}}},
    "llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
        "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
        "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                        "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                        "torch_dtype": "float16", "vocab_size": 32064},
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064},
    "llava-v1.6-mistral-7b-hf": {
        "architectures": ["LlavaNextForConditionalGeneration"], "ignore_index": -100,
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        "image_token_index": 32000, "model_type": "llava_next", "projector_hidden_act": "gelu",
        "text_config": {"_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2", "architectures": ["MistralForCausalLM"],
                        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
                        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                        "sliding_window": None, "torch_dtype": "bfloat16", "vocab_size": 32064},
        "torch_dtype": "float16", "transformers_version": "4.39.0.dev0", "use_image_newline_parameter": True,
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064},
    "gemma-3-4b-it": {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
        "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False}},
}
# The totals the checkpoints' model cards and Hub pages give (safetensors parameter counts).
PUBLISHED_TOTAL = {"Qwen2.5-VL-7B-Instruct": 8_292_166_656, "Qwen3-VL-8B-Instruct": 8_767_123_696,
                   "SmolVLM-256M-Instruct": 256_484_928, "SmolVLM2-2.2B-Instruct": 2_246_784_880,
                   "llava-1.5-7b-hf": 7_063_427_072, "llava-v1.6-mistral-7b-hf": 7_566_747_648,
                   "gemma-3-4b-it": 4_300_079_472}
FAMILY = {"Qwen2.5-VL-7B-Instruct": "qwen2_5_vl", "Qwen3-VL-8B-Instruct": "qwen3_vl",
          "SmolVLM-256M-Instruct": "smolvlm", "SmolVLM2-2.2B-Instruct": "smolvlm", "llava-1.5-7b-hf": "llava",
          "llava-v1.6-mistral-7b-hf": "llava_next", "gemma-3-4b-it": "gemma3_mm"}


def meta_model(d: dict):
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    with torch.device("meta"):
        return config, AutoModelForImageTextToText.from_config(config)


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_tensors_equal_the_published_model(name, tmp_path):
    """Every tensor, in order, of the meta-device model of the published config (vision tower included); the total
    is the published one and `finetune plan`'s; the frozen prefixes cover exactly the tower and projector."""
    from finetune.plan import planner as plan

    d = PUBLISHED[name]
    config, model = meta_model(d)
    assert type(model).__name__ == d["architectures"][0]
    family = families.family_of(d)
    assert family.name == FAMILY[name] and family.vision
    assert families.family_of(config) is family  # the transformers config too (llava's text_config is a llama)
    want = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert [(t.name, t.shape) for t in family.shape(d).tensors()] == want
    total = sum(p.numel() for p in model.parameters())
    assert total == PUBLISHED_TOTAL[name]
    prefixes = family.vision_prefixes(config)
    vision = sum(p.numel() for n, p in model.named_parameters() if under(n, prefixes))
    language = sum(p.numel() for n, p in model.named_parameters() if n.startswith(family.language) or n == "lm_head.weight")
    assert vision + language == total and vision > 0
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    data = plan.make_plan(["--model_name_or_path", str(folder), "--accelerator", "gpu", "--device_memory", "80GB",
                           "--host_memory", "1TB"])
    assert data["model"]["parameters"] == total and data["model"]["family"] == family.name
    print(f"{name}: {total:,} parameters = published = plan ({family.name}); vision tower and projector "
          f"{vision:,} under {', '.join(prefixes)}")


def test_text_families_are_not_vision():
    assert [f.name for f in families.FAMILIES if f.vision] == ["gemma3_mm", "qwen2_5_vl", "qwen3_vl", "smolvlm",
                                                               "llava", "llava_next"]
    assert all(f.vision_prefixes(None) == () for f in families.FAMILIES if not f.vision)
    # A Gemma-3 text config stays the text family; the multimodal one is gemma3_mm.
    assert families.family_of({"model_type": "gemma3_text"}).name == "gemma3"
    assert families.family_of({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}).name == "gemma3_mm"


# Each tiny model's processor on one 60 x 100 (height x width) image: its class, and the image tokens it writes (each
# checked by the model's own forward, which refuses a count that is not its image features'):
# Gemma-3: mm_tokens_per_image, 4 (resized to 28 x 28: 2 x 2 patches, pooled 1:1);
# Qwen2.5-VL: sides rounded to multiples of 28 (patch 14 x merge 2), 56 x 112, grid 1 x 4 x 8, 8 tokens after the 2 x 2
# merge; Qwen3-VL: multiples of 32 (patch 16 x 2), 64 x 96, grid 1 x 4 x 6, 6 tokens;
# SmolVLM: the longest edge to 64, split into 2 x 2 tiles of 32 plus the global image, one token each (2 x 2 patches of
# 16 shuffled into one), 5; LLaVA: a 28 x 28 crop, 2 x 2 patches (the class token dropped), 4;
# LLaVA-NeXT: the 56 x 56 pinpoint (2 x 2 tiles, a 4 x 4 patch grid) unpadded to the image's 0.6 aspect, 2 rows of 4
# with a newline each, 10, after the base image's 4: 14.
PROCESSORS = {"gemma3": ("Gemma3Processor", "Gemma3ImageProcessorPil", 4),
              "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLImageProcessorPil", 8),
              "qwen3_vl": ("Qwen3VLProcessor", "Qwen2VLImageProcessorPil", 6),
              "smolvlm": ("SmolVLMProcessor", "SmolVLMImageProcessorPil", 5),
              "llava": ("LlavaProcessor", "CLIPImageProcessorPil", 4),
              "llava_next": ("LlavaNextProcessor", "LlavaNextImageProcessorPil", 14)}


def image(h: int = 60, w: int = 100, seed: int = 0):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8))


CONVERSATION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "llava" else pytest.mark.slow) for n in VLMS])
def test_tiny_vlm_loads_with_its_real_processor(name, tiny_vlm, tmp_path):
    """The tiny model's tensors are its family's; load_model gives AutoModelForImageTextToText's class with LoRA on the
    language model's projections only (peft's own tensors, as the planner counts them); load_processor gives the
    real processor class (without torchvision), whose image-token expansion the model's forward accepts; the processor
    saved again reloads to the same inputs."""
    import types

    from finetune.models.load import load_model, load_processor
    from finetune.plan import planner as plan

    folder = tiny_vlm(name)
    d = json.loads((folder / "config.json").read_text())
    family = families.family_of(d)
    assert family.vision
    cfg = types.SimpleNamespace(model_name_or_path=str(folder), use_peft=True, lora_target_modules=["all-linear"],
                                lora_r=4, lora_alpha=8, lora_dropout=0.0, torch_dtype="float32",
                                attn_implementation="sdpa", trust_remote_code=False, allow_pickle=False,
                                load_in_8bit=False, load_in_4bit=False, _hub=None)
    model = load_model(cfg)
    base = model.base_model.model
    assert type(base).__name__ in family.hf_classes
    assert [(t.name, t.shape) for t in family.shape(d).tensors()] == [
        (n.replace(".base_layer", ""), tuple(p.shape)) for n, p in base.named_parameters() if "lora_" not in n]
    trained = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    assert trained == [(t.name, t.shape) for t in plan.lora_tensors(family.shape(d), 4, ["all-linear"])]
    assert all(n.startswith("base_model.model." + family.language) for n, _ in trained)
    names = dict(base.named_modules()) | dict(base.named_parameters())
    assert all(p in names for p in family.vision_prefixes(base.config))

    processor_class, image_class, tokens = PROCESSORS[name]
    processor = load_processor(folder)
    assert (type(processor).__name__, type(processor.image_processor).__name__) == (processor_class, image_class)
    text = processor.apply_chat_template(CONVERSATION, tokenize=False)
    inputs = processor(text=[text], images=[[image()]], return_tensors="pt")
    image_id = getattr(base.config, "image_token_id", None) or base.config.image_token_index
    assert int((inputs["input_ids"] == image_id).sum()) == tokens
    with torch.no_grad():
        logits = base(**inputs).logits  # the model checks its image features against the image tokens
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()
    processor.save_pretrained(tmp_path / "again")
    again = load_processor(tmp_path / "again")(text=[text], images=[[image()]], return_tensors="pt")
    assert set(again) == set(inputs) and all(torch.equal(again[k], inputs[k]) for k in inputs)
    print(f"{name}: {processor_class} + {image_class}: {tokens} image tokens of {inputs['input_ids'].shape[1]}; "
          f"inputs {', '.join(f'{k} {tuple(v.shape)}' for k, v in inputs.items())}; LoRA {len(trained)} tensors, "
          f"all under {family.language}")


def test_text_models_load_as_before(tiny_chatml):
    """A text family's folder still loads with AutoModelForCausalLM, and has no processor of its own."""
    import transformers

    from finetune.models.load import WeightsError, load_processor, model_class

    config = transformers.AutoConfig.from_pretrained(tiny_chatml)
    assert model_class(config) is transformers.AutoModelForCausalLM
    with pytest.raises(WeightsError, match="no image processor"):
        load_processor(tiny_chatml)


def test_processors_without_torchvision_are_patched_where_it_is_missing():
    """finetune.compat.processors_without_video changes transformers only where torchvision is missing (here)."""
    from transformers.utils import is_torchvision_available

    from finetune.compat import processors_without_video

    assert processors_without_video() is (not is_torchvision_available())


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", ["full", "lora"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "llava" else pytest.mark.slow) for n in VLMS])
def test_text_activations_are_the_planners(name, variant, tiny_vlm):
    """On text (no image), the bytes autograd saves in one training forward of the tiny model are the planner's to the
    byte, full fine-tuning and the default LoRA: Qwen's mrope keeps one more [rows, seq, head_dim] tensor than a 1-d
    rope, Gemma-3 with both kinds of layer one more for its second rope. (Image records: tests/test_vision_plan.py.)"""
    import types

    from test_plan import _saved_bytes
    from transformers import AutoModelForImageTextToText

    from finetune.models.load import add_lora
    from finetune.plan import planner as plan

    folder = tiny_vlm(name)
    d = json.loads((folder / "config.json").read_text())
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if variant == "lora":
        model = add_lora(model, types.SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.05,
                                                      lora_target_modules=["all-linear"], _hub=None), seed=0)
    model.train()
    b, s = 2, 48
    ids = torch.randint(3, 1000, (b, s), generator=torch.Generator().manual_seed(0))
    job = plan.Workload(plan.model_shape(d), plan.Strategy("ddp", 0), micro_batch=b, seq_len=s, grad_ckpt=False,
                        use_peft=variant == "lora", lora_r=4, lora_dropout=0.05, padding_mask=False,
                        lora_targets=("all-linear",), loss_chunk=0)
    want, got = plan.activations(job).saved, _saved_bytes(model, ids, torch.ones_like(ids))
    print(f"{name} {variant}: planner {want:,} bytes saved, measured {got:,}")
    assert want == got


def test_gemma3_text_with_a_global_layer_saves_what_the_planner_says():
    """Gemma-3's text model with its 5:1 pattern (a global layer among sliding ones): the second rope counted."""
    from family_configs import tiny_model
    from test_plan import _saved_bytes

    from finetune.plan import planner as plan

    model = tiny_model("gemma3", num_hidden_layers=6)
    model.config.use_cache = False
    model.train()
    d = model.config.to_dict()
    assert d["layer_types"][-1] == "full_attention" and d["layer_types"][0] == "sliding_attention"
    ids = torch.randint(3, 90, (2, 48), generator=torch.Generator().manual_seed(0))
    job = plan.Workload(plan.model_shape(d), plan.Strategy("ddp", 0), micro_batch=2, seq_len=48, grad_ckpt=False,
                        use_peft=False, lora_r=4, lora_dropout=0.05, padding_mask=False, lora_targets=("all-linear",),
                        loss_chunk=0)
    assert plan.activations(job).saved == _saved_bytes(model, ids, torch.ones_like(ids)) == 4_643_980


@pytest.mark.slow
# CI's cover: LLaVA (the smallest; its activations are the planner's to the byte). All six measured on 2026-11-28 (text
# records, 4 x 512 tokens): LLaVA +0.1%, LLaVA-NeXT 0.0%, SmolVLM +0.1%, Qwen2.5-VL 0.0%, Qwen3-VL 0.0%, Gemma-3 -0.2%
# (saved activations: exact for LLaVA, LLaVA-NeXT and SmolVLM; 32,768 bytes off for the Qwens and Gemma-3 of ~30-95 MB).
@pytest.mark.parametrize("name", ["llava"])
def test_predicted_peak_within_5_percent_of_measured_rss(name, tiny_vlm, tmp_path):
    """Full fine-tuning of a tiny VLM on text records, one process, the default chunked loss: bench/memory.py's worker
    (config -> load_model -> HF Trainer) trains 2 steps at 4 x 512 tokens; the planner's per-device total (its tower
    counted in the weights, gradients and Adam states, and a vision process's imports) is within 5% of the peak RSS."""
    from test_plan import _bench

    from finetune.plan import planner as plan

    bench = _bench()
    folder = tiny_vlm(name)
    flags = ["--per_device_train_batch_size", "4", "--max_seq_length", "512", "--seed", "0", "--attn_implementation",
             "sdpa"]
    (rank,) = bench.measure(folder, "ddp", 1, tmp_path / "run", flags, steps=bench.MEASURE_STEP, timeout=600)
    pred = plan.predict(bench.job_for(folder, "ddp", 1, micro=4, seq=512))
    error = pred.device_total / rank["maxrss"] - 1
    print(f"{name}: peak RSS predicted {pred.device_total / 1e6:,.0f} MB, measured {rank['maxrss'] / 1e6:,.0f} MB "
          f"({error * 100:+.1f}%); saved activations predicted {pred.act.saved:,}, measured {rank['saved_for_backward']:,}")
    assert abs(error) <= 0.05
