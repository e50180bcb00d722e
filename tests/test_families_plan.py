"""`finetune plan` for every family against the real published config.json of a checkpoint of each (the keys that
set its shapes): the parameter total equals the sum of the real model's tensor sizes, built by transformers on the
meta device, tensor for tensor; the LoRA tensors are peft's own (names and shapes, experts included); the plan says
which family it read; a mixture-of-experts full fine-tune that cannot fit says so."""

from __future__ import annotations

import json

import pytest
import torch
from family_configs import TINY, tiny_model
from launch import matrix

from finetune.models import families
from finetune.plan import planner as plan

# The published config.json values (shape keys) of each checkpoint.
REAL = {
    "Qwen3-8B": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        tie_word_embeddings=False, attention_bias=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000),
    "Qwen2.5-7B": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=131072, max_window_layers=28),
    "Qwen3-30B-A3B": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.001,
        tie_word_embeddings=False, attention_bias=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0),
    "Mixtral-8x7B-v0.1": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=False,
        tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
        sliding_window=None),
    "gemma-3-12b-it": dict(
        architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", boi_token_index=255999,
        eoi_token_index=256000, image_token_index=262144, mm_tokens_per_image=256,
        text_config=dict(model_type="gemma3_text", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                         num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                         query_pre_attn_scalar=256, sliding_window=1024, rope_theta=1000000.0,
                         rope_local_base_freq=10000.0, rope_scaling={"factor": 8.0, "rope_type": "linear"},
                         final_logit_softcapping=None, attn_logit_softcapping=None),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                           num_hidden_layers=27, num_attention_heads=16, image_size=896, patch_size=14,
                           vision_use_head=False)),
    "Phi-3-mini-4k-instruct": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32064, hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        tie_word_embeddings=False, max_position_embeddings=4096, original_max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=2047, pad_token_id=32000, bos_token_id=1,
        eos_token_id=32000),
    "Mistral-7B-v0.1": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=4096),
}
FAMILY = {"Qwen3-8B": "qwen3", "Qwen2.5-7B": "qwen2", "Qwen3-30B-A3B": "qwen3_moe", "Mixtral-8x7B-v0.1": "mixtral",
          "gemma-3-12b-it": "gemma3_mm", "Phi-3-mini-4k-instruct": "phi3", "Mistral-7B-v0.1": "mistral"}


def meta_model(d: dict):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = {k: v for k, v in d.items() if k != "architectures"}
    cfg = AutoConfig.for_model(**kwargs)
    auto = AutoModelForImageTextToText if "text_config" in d else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(cfg)


def planned(folder, *flags):
    return plan.make_plan(["--model_name_or_path", str(folder), "--accelerator", "gpu", "--device_memory", "80GB",
                           "--host_memory", "1TB", *flags])


def write(tmp_path, d):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return folder


@pytest.mark.parametrize("name", list(REAL))
def test_plan_counts_equal_the_real_model(name, tmp_path):
    d = REAL[name]
    model = meta_model(d)
    assert type(model).__name__ == d["architectures"][0]
    expected = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # a tied lm_head is listed once
    total = sum(p.numel() for p in model.parameters())
    family = families.family_of(d)
    assert family.name == FAMILY[name]
    assert [(t.name, t.shape) for t in family.shape(d).tensors()] == expected  # every tensor, in order
    data = planned(write(tmp_path, d))
    assert data["model"]["parameters"] == total and data["model"]["family"] == family.name
    text = plan.render(data)
    assert f"(family {family.name})" in text
    print(f"{name}: plan {data['model']['parameters']:,} = meta-device model {total:,} ({family.name})")


def test_phi3_lora_count_and_its_own_module_names(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj at r=16: the planner's LoRA total is peft's on the real shapes;
    --lora_target_modules qkv_proj (Phi-3's real module) is planned as training accepts it."""
    from peft import LoraConfig, get_peft_model

    d = REAL["Phi-3-mini-4k-instruct"]
    folder = write(tmp_path, d)
    data = planned(folder, "--use_peft", "--lora_r", "16")
    peft_model = get_peft_model(meta_model(d), LoraConfig(r=16, target_modules=["qkv_proj", "o_proj", "gate_up_proj",
                                                                              "down_proj"]))
    want = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert data["model"]["trainable_parameters"] == want == 25_165_824
    qkv = planned(folder, "--use_peft", "--lora_r", "16", "--lora_target_modules", "qkv_proj")
    assert qkv["model"]["trainable_parameters"] == 32 * 16 * (3072 + 3 * 3072)
    print(f"Phi-3-mini LoRA r=16: plan {data['model']['trainable_parameters']:,} = peft {want:,}; qkv_proj only "
          f"{qkv['model']['trainable_parameters']:,}")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("fam", TINY)
def test_plan_lora_tensors_are_peft_s(fam):
    """The default targets (all-linear, and the experts for MoE) as peft makes them, name for name; the multimodal
    checkpoint's vision tower is left alone."""
    import types

    from finetune.models.load import add_lora

    model = tiny_model(fam)
    d = model.config.to_dict()
    cfg = types.SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.05, lora_target_modules=["all-linear"],
                                _hub=None)
    peft_model = add_lora(model, cfg, seed=0)
    want = [(n, tuple(p.shape)) for n, p in peft_model.named_parameters() if p.requires_grad]
    got = [(t.name, t.shape) for t in plan.lora_tensors(families.family_of(d).shape(d), 4, ["all-linear"])]
    assert got == want
    assert not any("vision_tower" in n for n, _ in want)


def test_moe_full_fine_tune_that_cannot_fit_says_so(tmp_path):
    """Qwen3-30B-A3B full on 80 GB cards: 30.5B parameters' weights, gradients and Adam states (16 bytes each,
    488 GB) cannot sit on one card, so ddp is not what the plan recommends."""
    folder = write(tmp_path, REAL["Qwen3-30B-A3B"])
    default = planned(folder)
    assert default["recommendation"]["config"] != "ddp", default["recommendation"]
    data = planned(folder, "--config", "ddp")
    assert not data["fits"] and data["does_not_fit_because"]
    assert data["recommendation"]["config"] != "ddp"
    print(f"Qwen3-30B-A3B full, ddp: fits {data['fits']}: {data['does_not_fit_because']}; recommended "
          f"{data['recommendation']['config']}: {data['recommendation']['reason']}")


def test_the_docs_table_is_the_registry_and_its_tests_exist():
    """docs/families.md: one row per registered family (its model_types), and every test it cites exists."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    text = (repo / "docs" / "families.md").read_text()
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [(name.strip(), types.strip()) for name, types in rows] == [
        (f.name, ", ".join(f.model_types)) for f in families.FAMILIES]
    cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert cited
    for path, test in cited:
        assert re.search(rf"^def {test}\(", (repo / path).read_text(), re.M), f"{path}::{test}"


# Variants of one training forward: (use_peft, LoRA targets or "default", LoRA dropout, padded batch, loss chunk).
SAVED_VARIANTS = {
    "full": (False, None, 0.05, False, 0),
    "full-padded": (False, None, 0.05, True, 0),  # a mask: k/v repeated (Phi-3's qkv slice let go), Gemma's eager adds it
    "full-chunked": (False, None, 0.05, False, 16),  # the chunked loss (Gemma-2's final soft-cap inside the chunks)
    "lora": (True, "attention", 0.05, False, 0),
    "lora-no-dropout": (True, "attention", 0.0, False, 0),  # lora_A keeps o_proj's input (Phi-3's and Gemma-2's copy)
    "lora-default": (True, "default", 0.05, False, 0),  # all-linear, and the experts with their adapted copies
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", list(SAVED_VARIANTS))
@pytest.mark.parametrize("fam", TINY)
def test_activation_bytes_equal_saved_tensors(fam, variant):
    """The planner's saved activations are the bytes autograd saves in one forward, exactly (unique storages, the
    parameters left out), for every family's tiny model: what its layer keeps beyond Llama's comes from the family
    (Qwen3's q/k norms; Gemma-2's eager soft-capped attention, four (1 + weight) norms, embedding scale and final
    soft-cap; Gemma-3's q/k norms and sliding-window masks; Phi-3's fused qkv slice and o_proj copy; the MoE router,
    experts, expert adapters and load-balancing loss)."""
    import types

    from peft import LoraConfig, get_peft_model
    from test_plan import _saved_bytes

    from finetune.models.load import add_lora
    from finetune.training import loss

    use_peft, targets, dropout, padded, chunk = SAVED_VARIANTS[variant]
    model = tiny_model(fam)  # the MoE configs with output_router_logits: the load-balancing loss counted too
    model.config.use_cache = False
    d = model.config.to_dict()
    family = families.family_of(d)
    if targets == "default":  # all-linear (and the experts), as finetune's --use_peft sets it up
        targets = ("all-linear",)
        model = add_lora(model, types.SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=dropout,
                                                      lora_target_modules=list(targets), _hub=None), seed=0)
    elif targets == "attention":
        targets = tuple(n for n in family.linear_names() if n in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"))
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=list(targets)))
    else:
        targets = ("all-linear",)
    if chunk:
        assert loss.install(model, chunk)
    model.train()
    b, s = 2, 48  # longer than the tiny Gemmas' sliding window (16): their sliding layers get a mask
    ids = torch.randint(3, 90, (b, s), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)  # the collator passes one always (all ones here: no kernel gets it)
    if padded:
        mask[1, 38:] = 0
    job = plan.Workload(plan.model_shape(d), plan.Strategy("ddp", 0), micro_batch=b, seq_len=s, grad_ckpt=False,
                        use_peft=use_peft, lora_r=4, lora_dropout=dropout, padding_mask=padded, lora_targets=targets,
                        loss_chunk=chunk)
    want, got = plan.activations(job).saved, _saved_bytes(model, ids, mask)
    print(f"{fam} {variant}: planner {want:,} bytes saved, measured {got:,}")
    assert want == got


def test_plan_code_names_no_family():
    """The planner reads what differs from the family (finetune.models.families), never a family's name."""
    from registry_check import comparisons_outside

    names = {f.name for f in families.FAMILIES} | {t for f in families.FAMILIES for t in f.model_types}
    assert [o for o in comparisons_outside(names, "models/families") if o.startswith("plan/")] == []


# Each family's tiny model grown so that activations are a fifth or more of the peak (the process overhead, 511 MB,
# is the rest): a Llama layer counted for Gemma-2 would be 17% low here, beyond the 5% bound.
RSS_DIMS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4)
RSS_VOCAB, RSS_MICRO, RSS_SEQ = 8192, 4, 512
RSS_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral")


@pytest.mark.slow
# CI's cover: two families whose layers save what Llama's do not (Gemma-2's eager soft-capped attention, Qwen3-MoE's
# router); the saved bytes of all ten are test_activation_bytes_equal_saved_tensors'
# (fast); every family's RSS with FINETUNE_FULL_MATRIX=1.
@pytest.mark.parametrize("fam", matrix(list(RSS_FAMILIES), ["gemma2", "qwen3_moe"]))
def test_predicted_peak_within_5_percent_of_measured_rss(fam, tmp_path):
    """Full fine-tuning, one process, the default chunked loss: bench/memory.py's worker (the project's config ->
    load_model -> HF Trainer pipeline) trains 2 steps on full-length random records; the planner's per-device total is
    within 5% of the process's peak RSS (ru_maxrss), as the planner's Llama rows are (bench/RESULTS.md), and the
    activations autograd saved are the planner's to the byte."""
    from family_configs import ATTENTION
    from test_plan import _bench

    bench = _bench()
    folder = tmp_path / "model"
    model = tiny_model(fam, vocab_size=RSS_VOCAB, **RSS_DIMS)
    model.config.use_cache = False
    model.save_pretrained(folder)
    del model
    flags = ["--per_device_train_batch_size", str(RSS_MICRO), "--max_seq_length", str(RSS_SEQ), "--seed", "0",
             "--attn_implementation", ATTENTION.get(fam, "sdpa")]
    (rank,) = bench.measure(folder, "ddp", 1, tmp_path / "run", flags, steps=bench.MEASURE_STEP, timeout=600)
    job = bench.job_for(folder, "ddp", 1, micro=RSS_MICRO, seq=RSS_SEQ)
    pred = plan.predict(job)
    error = pred.device_total / rank["maxrss"] - 1
    print(f"{fam}: peak RSS predicted {pred.device_total / 1e6:,.0f} MB, measured {rank['maxrss'] / 1e6:,.0f} MB "
          f"({error * 100:+.1f}%); saved activations predicted {pred.act.saved:,}, measured "
          f"{rank['saved_for_backward']:,}; peak moment {pred.peak_moment}; {rank['seconds']:.0f} s")
    assert rank["saved_for_backward"] == pred.act.saved
    assert abs(error) <= 0.05, (pred.device, rank["phase_peaks"])
