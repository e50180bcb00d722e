"""--tiled_mlp and --offload_activations (docs/long-context.md): the tiled MLP's loss and gradients against the
untiled model on the dense families (Llama, Gemma-2's GELU MLP, Phi-3's fused gate_up), what autograd saves against
the planner (the MLP's interior gone, its input kept), a mixture-of-experts model refused by name; the activation
offload's refusals and what it sets, and the planner's terms for it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from family_configs import tiny_config, tiny_model
from test_plan import SHAPES, _saved_bytes
from test_loss import assert_same

from finetune import config as C
from finetune.config.training import offload_activations
from finetune.models import tiled
from finetune.plan import planner as plan


def run(model, ids, lora: bool):
    out = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(float(ids.numel())))
    (out.loss * 3.0).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def lora(model, dropout: float):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear"))
    for name, p in model.named_parameters():  # B starts at zero: make the adapters' gradients reach A
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


# One thread: the comparison is the tiling's only (two threads split the untiled GEMMs' sums otherwise).
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family,method", [("llama", "full"), ("llama", "lora"), ("gemma2", "full"), ("phi3", "full")])
def test_same_loss_and_gradients(family, method):
    """2 rows x 200 positions over hidden 64: 4 tiles a row (the last one short); dropout off, so the runs draw nothing."""
    torch.manual_seed(0)
    base = tiny_model(family, vocab_size=96, attn_implementation="eager" if family == "gemma2" else "sdpa")
    base.config.use_cache = False
    if method == "lora":
        base = lora(base, 0.0)
    base.train()
    other = copy.deepcopy(base)
    assert tiled.enable(other, 64) == 2
    ids = torch.randint(0, 96, (2, 200), generator=torch.Generator().manual_seed(1))
    reference, got = run(base, ids, method == "lora"), run(other, ids, method == "lora")
    assert_same(reference, got)
    # ...and the MLP really ran tiled: nothing of its interior saved ([tokens, intermediate] tensors) 
    assert _saved_bytes(other, ids) < _saved_bytes(base, ids)


@pytest.mark.parametrize("method", ["full", "lora", "lora-no-dropout"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["", "ckpt"])
def test_saved_bytes_are_the_plans(method, ckpt):
    """At 2 x 1024 positions, what autograd saves with the tiled MLP equals the planner's count, and full
    fine-tuning saves layers x tokens x 4 x intermediate x 4 bytes less (gate, up, silu(gate), their product)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d = SHAPES["gqa"]
    b, s = 2, 1024
    model = LlamaForCausalLM(LlamaConfig(**d, tie_word_embeddings=False))
    model.config.use_cache = False
    dropout = 0.0 if method == "lora-no-dropout" else 0.05
    if method != "full":
        model = lora(model, dropout)
    if ckpt:
        model.gradient_checkpointing_enable()
        if method != "full":
            model.enable_input_require_grads()
    model.train()
    ids = torch.randint(0, d["vocab_size"], (b, s))
    plain = _saved_bytes(model, ids)
    tiled.enable(model, d["hidden_size"])
    saved = _saved_bytes(model, ids)
    job = plan.Workload(plan.model_shape(d), plan.Strategy("ddp", 0), micro_batch=b, seq_len=s, grad_ckpt=ckpt,
                        use_peft=method != "full", lora_r=4, lora_dropout=dropout, padding_mask=False)
    assert plan.activations(job).saved == plain
    assert plan.activations(job.replace(tiled_mlp=True)).saved == saved
    if method == "full" and not ckpt:
        assert plain - saved == d["num_hidden_layers"] * b * s * 4 * d["intermediate_size"] * 4
    if ckpt:
        assert saved == plain  # checkpointed layers keep only their inputs either way


def test_plan_tiled_backward_holds_one_tile():
    """The planner's backward with the tiled MLP: an 8B Llama at 32k positions, checkpointed, bf16 on one GPU: the
    layer's recompute holds a tile's intermediates, not the sequence's (the peak drops by GBs)."""
    shape = plan.model_shape(dict(LLAMA_8B))
    job = plan.Workload(shape, plan.Strategy("ddp", 0), micro_batch=1, seq_len=32768, grad_ckpt=True,
                        accelerator="gpu", weight_dtype="bfloat16", mixed_precision="bf16", padding_mask=False,
                        loss_chunk=1024)
    plain, tiled_pred = plan.predict(job), plan.predict(job.replace(tiled_mlp=True))
    # the recompute of one layer saved 4 x 14336 x 2 bytes a token of MLP interior: 3.8 GB at 32k
    assert plain.device_total - tiled_pred.device_total > 3.5e9


LLAMA_8B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                torch_dtype="bfloat16")


def test_moe_is_refused_by_name(tmp_path):
    from finetune.models import tiny

    folder = tmp_path / "moe"
    tiny_model("qwen3_moe").save_pretrained(folder)
    tiny.build_tokenizer(folder, vocab_size=96)
    with pytest.raises(C.ConfigError) as e:
        C.parse(["--model_name_or_path", str(folder), "--tiled_mlp", "--output_dir", str(tmp_path / "o")],
                check_paths=True)
    (problem,) = [p for p in e.value.problems if p.startswith("tiled_mlp")]
    assert "mixture-of-experts model (model_type 'qwen3_moe')" in problem and "leave --tiled_mlp out" in problem


def test_offload_activations_refusals_and_setting(tmp_path):
    with pytest.raises(C.ConfigError) as e:
        C.parse(["--offload_activations", "--output_dir", str(tmp_path / "o")], check_paths=False)
    assert e.value.problems == ["offload_activations: moves the layer inputs that gradient checkpointing keeps; "
                                "without --gradient_checkpointing there are none to move: add --gradient_checkpointing"]
    if not torch.cuda.is_available():
        with pytest.raises(C.ConfigError) as e:
            C.parse(["--offload_activations", "--gradient_checkpointing", "--output_dir", str(tmp_path / "o")],
                    check_paths=False)
        assert e.value.problems == ["offload_activations: moves checkpointed activations from the GPU to pinned host "
                                    "memory; this run has no CUDA device (its activations are in host memory "
                                    "already): leave --offload_activations out"]
    model = C.ModelConfig(offload_activations=True)
    values = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    assert offload_activations(model, values, cuda=True) == []
    # transformers' Trainer and finetune.training.core read `offload` there (activation_checkpointing_enable)
    assert values["gradient_checkpointing_kwargs"] == {"use_reentrant": False, "offload": True}


def test_plan_offload_moves_the_layer_inputs_to_the_host():
    shape = plan.model_shape(dict(LLAMA_8B))
    job = plan.Workload(shape, plan.Strategy("ddp", 0), micro_batch=1, seq_len=131072, grad_ckpt=True,
                        accelerator="gpu", weight_dtype="bfloat16", mixed_precision="bf16", padding_mask=False,
                        loss_chunk=1024)
    off = job.replace(offload_activations=True)
    inputs = 2 * 131072 * 4096 * 32  # bf16 layer inputs of 32 layers: 34.4 GB
    assert plan.activations(off).offloaded == inputs
    assert plan.activations(job).saved - plan.activations(off).saved == inputs
    pred = plan.predict(off)
    assert pred.host["offloaded activations"] == inputs
    # at the backward's peak one layer's input is back on the device (for its recompute)
    assert plan.predict(job).device["activations"] - pred.device["activations"] == inputs - 2 * 131072 * 4096


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"])
def test_saved_bytes_are_the_plans_on_every_dense_family(family):
    """Each dense family's tiny model (its own MLP: Gemma's GELU, Phi-3's fused gate_up; Gemma's extra norms), 2 x 200
    positions, full fine-tuning: the saved bytes tiled and not equal the planner's (Gemma-3: 10,767,308 -> 8,924,108
    bytes)."""
    torch.manual_seed(0)
    model = tiny_model(family, vocab_size=96, attn_implementation="eager" if family.startswith("gemma") else "sdpa")
    model.config.use_cache = False
    model.train()
    ids = torch.randint(0, 96, (2, 200))
    job = plan.Workload(plan.model_shape(model.config.to_dict()), plan.Strategy("ddp", 0), micro_batch=2, seq_len=200,
                        padding_mask=False)
    assert _saved_bytes(model, ids) == plan.activations(job).saved
    tiled.enable(model, model.config.hidden_size)
    assert _saved_bytes(model, ids) == plan.activations(job.replace(tiled_mlp=True)).saved < plan.activations(job).saved
