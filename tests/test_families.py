"""Model families (finetune.models.families): Llama's counts equal the real model's tensors at Llama-3.2-1B's and
Llama-3-8B's shapes, its GGUF names are the ones transformers' GGUF loader reads back (every tensor, Q/K layout
included), its LoRA default is peft's all-linear; a model_type or GGUF architecture no family covers is refused by name. The
other families, each one module and a registry line, are tested in test_families_qwen_mistral.py."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from finetune.models import families
from finetune.models.families.llama import LLAMA
from finetune.models.load import lora_target_modules
from finetune.plan import planner as plan

# The published config.json of meta-llama/Llama-3.2-1B and meta-llama/Meta-Llama-3-8B (shapes and the keys that
# change them), with the parameter totals of their safetensors files.
LLAMA_32_1B = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
    attention_bias=False, mlp_bias=False, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
)
LLAMA_3_8B = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
)
# A GPT-NeoX config: a family finetune does not cover.
GPT_NEOX = dict(
    model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], vocab_size=50432, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=8,
)


def meta_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def write_config(folder, config: dict):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ----------------------------------------------------------------------------------------------
# Llama's shapes against the real model's tensors.


@pytest.mark.parametrize("config, total", [(LLAMA_32_1B, 1_235_814_400), (LLAMA_3_8B, 8_030_261_248)],
                         ids=["llama-3.2-1b", "llama-3-8b"])
def test_llama_parameter_count_equals_the_model(config, total, tmp_path):
    model = meta_model(config)
    assert type(model).__name__ == LLAMA.hf_classes[0]
    expected = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # a tied lm_head is listed once, as saved
    assert sum(np.prod(s) for _, s in expected) == total

    family = families.family_of(config)
    assert family is LLAMA and families.family_of("llama") is LLAMA
    shape = family.shape(config)
    assert [(t.name, t.shape) for t in shape.tensors()] == expected
    assert shape.num_params == total
    assert plan.model_shape(config).num_params == total
    # The planner's own report, from the config file alone.
    data = plan.make_plan(["--model_name_or_path", str(write_config(tmp_path / "m", config)), "--accelerator", "gpu",
                           "--device_memory", "80GB", "--host_memory", "1TB"])
    assert data["model"]["parameters"] == total


def test_unknown_family_is_refused_by_name(tmp_path):
    with pytest.raises(families.FamilyError, match=r"no model family for model_type 'gpt_neox' "
                                                   r"\(known: llama, qwen2, qwen3, mistral, gemma2, gemma3_text, "
                                                   r"phi3, qwen3_moe, mixtral, gemma3, qwen2_5_vl, qwen3_vl, smolvlm, "
                                                   r"idefics3, llava, llava_next\)"):
        families.family_of({"model_type": "gpt_neox", "hidden_size": 8})
    with pytest.raises(families.FamilyError, match=r"no model family for GGUF architecture 'falcon' "
                                                   r"\(known: llama, qwen2, qwen3, gemma2, gemma3, phi3, qwen3moe, qwen2vl\)"):
        families.by_gguf_arch("falcon")
    assert families.by_gguf_arch("llama") is LLAMA
    with pytest.raises(plan.PlanError, match="no model family for model_type 'gpt_neox'"):
        plan.make_plan(["--model_name_or_path", str(write_config(tmp_path / "m", GPT_NEOX))])


# ----------------------------------------------------------------------------------------------
# GGUF: the names and layout the exporter writes are what transformers' GGUF loader reads back.


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_names_round_trip_every_tensor(tied):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (LlamaTensorProcessor, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    shape = LLAMA.shape(config.to_dict())
    export_names = LLAMA.gguf_names(shape)
    params = [n for n, _ in model.named_parameters()]
    assert sorted(export_names) == sorted(params)  # every tensor has a GGUF name ...
    assert len(set(export_names.values())) == len(params)  # ... of its own
    assert ("output.weight" in export_names.values()) == (not tied)
    import_names = get_gguf_hf_weights_map(model, TensorProcessor(), "llama")  # GGUF name -> HF name, as loaded
    assert {hf: import_names[g] for hf, g in export_names.items()} == {hf: hf for hf in params}

    # Q/K: what the file holds (to_gguf) is what the loader turns back into the HF weight; from_gguf inverts it.
    loader = LlamaTensorProcessor(config=config.to_dict())
    for hf_name, weight in model.state_dict().items():
        if hf_name not in export_names:
            continue
        w = weight.numpy()
        stored = LLAMA.to_gguf(hf_name, w, shape)
        assert np.array_equal(loader.process(stored, export_names[hf_name]).weights, w), hf_name
        assert np.array_equal(LLAMA.from_gguf(hf_name, stored, shape), w), hf_name
        assert np.array_equal(stored, w) == ("q_proj" not in hf_name and "k_proj" not in hf_name), hf_name
    assert LLAMA.gguf_required_names() == ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight")


# ----------------------------------------------------------------------------------------------
# LoRA's default targets.


def test_lora_default_is_the_family_linears_and_peft_all_linear():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)

    def wrapped(targets):
        model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=targets, task_type="CAUSAL_LM"))
        return sorted(n for n, p in model.named_parameters() if p.requires_grad)

    ours = lora_target_modules(config, ["all-linear"])
    assert ours == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert wrapped(ours) == wrapped("all-linear")
    assert lora_target_modules(config, ["q_proj"]) == ["q_proj"]
    assert lora_target_modules(SimpleConfig("gpt_neox"), ["all-linear"]) == "all-linear"  # no family: peft's rule
    with pytest.raises(ValueError, match="'qkv_proj' is not a linear projection of a llama model"):
        LLAMA.lora_targets(["qkv_proj"])


@dataclasses.dataclass
class SimpleConfig:
    model_type: str
