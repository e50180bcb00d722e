"""bitsandbytes-quantized bases on CPU: 8-bit LoRA under 2-process DDP and 4-bit QLoRA through the real training
pipeline (losses fall), the 4-bit CPU repacking trap guarded (LoRA learns after a `generate` call, with the very
same losses as without it), the compute-dtype flag, and the combinations that cannot work refused at start."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from finetune.models import tiny
from finetune.config import ConfigError, ModelConfig, parse
from finetune.models.load import load_model, quantization_config
from launch import launcher, losses, run

# Tiny models: one thread avoids OpenMP spin-waiting when the 2 cores are shared.
pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    model = tiny.build(root / "model", style="llama3", hidden=64, layers=2)
    data = tiny.write_jsonl(root / "data.jsonl", tiny.synthetic_records(48, seed=3, fmt="alpaca"))
    return root, model, data


def train(setup, name, kind, nproc, micro, *flags):
    root, model, data = setup
    out = root / name
    cmd = launcher(kind, nproc) + [
        "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
        "--dataset_cache_dir", str(root / "cache"), "--use_peft", "--lora_r", "8", "--lora_alpha", "16",
        "--lora_dropout", "0", "--max_steps", str(STEPS), "--per_device_train_batch_size", str(micro),
        "--learning_rate", "1e-2", "--seed", "5", "--disable_tqdm", "true", *flags,
    ]
    result = run(cmd, timeout=400).check()
    return out, result.output


@pytest.mark.slow
def test_8bit_lora_under_ddp_each_rank_holds_its_copy_and_loss_falls(setup):
    out, output = train(setup, "lora8_ddp", "accelerate", 2, 4, "--load_in_8bit")
    assert "x 2 processes = global batch 8" in output
    for rank in (0, 1):
        assert f"rank {rank}: base loaded in 8-bit (LLM.int8) by bitsandbytes on cpu: 14 quantized linear layers" in output
    curve = losses(out)
    assert len(curve) == STEPS
    assert curve[-1] < curve[0] - 0.1, curve
    assert (out / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_4bit_qlora_nf4_double_quant_loss_falls(setup):
    out, output = train(
        setup, "qlora4", "python", 1, 8, "--load_in_4bit", "--bnb_4bit_quant_type", "nf4", "--use_bnb_nested_quant",
        "--gradient_checkpointing",
    )
    assert "rank 0: base loaded in 4-bit nf4 + double quant, compute float32 by bitsandbytes on cpu: 14 quantized" in output
    curve = losses(out)
    assert len(curve) == STEPS
    assert curve[-1] < curve[0] - 0.1, curve


# ----------------------------------------------------------------------------------------------
# LoRA must keep learning after an inference pass on a quantized base.


def _lora_model(model_dir, bits: int):
    cfg = ModelConfig(
        model_name_or_path=str(model_dir), torch_dtype="float32", use_peft=True, lora_r=8, lora_alpha=16,
        lora_dropout=0.0, load_in_8bit=bits == 8, load_in_4bit=bits == 4, use_bnb_nested_quant=bits == 4,
    )
    return load_model(cfg)


def _linear4(model):
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _packed(model) -> int:
    return sum(bool(getattr(m.weight.quant_state, "packing_format_for_cpu", False)) for m in _linear4(model))


def _generate(model, batch):
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=batch[:, :6], attention_mask=torch.ones_like(batch[:, :6]), max_new_tokens=4, do_sample=False,
            pad_token_id=0,
        )
    assert out.shape[1] == 10


def _train(model, batch, steps=6):
    """A few AdamW steps; returns the losses, the LoRA weights before/after, and the number of gemv_4bit autograd
    warnings (the trap's only symptom: gradients routed through a kernel without autograd)."""
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    curve = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
    after = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    trap_warnings = sum("gemv_4bit" in str(w.message) and "autograd" in str(w.message) for w in caught)
    return curve, lora, after, trap_warnings


@pytest.fixture(scope="module")
def batch(setup):
    return torch.randint(3, 400, (4, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def reference_4bit(setup, batch):
    """The same LoRA training on a 4-bit base that never ran inference."""
    curve, _, _, warned = _train(_lora_model(setup[1], 4), batch)
    assert warned == 0
    return curve


def test_4bit_lora_learns_after_generate(setup, batch, reference_4bit):
    """The trap: on CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights into an inference-only layout during
    the first no-grad eval forward, and gradients stop flowing. Reproduced on any CPU by turning bitsandbytes'
    own switch (`support_avx512bf16_for_cpu`) back on after the guard turned it off: `generate` then packs every
    layer through bitsandbytes' own code, and the guard must restore the trainable layout exactly."""
    model = _lora_model(setup[1], 4)
    layers = _linear4(model)
    assert len(layers) == 14 and all(not m.support_avx512bf16_for_cpu for m in layers)  # guard: no repacking
    for m in layers:
        m.support_avx512bf16_for_cpu = True  # what bitsandbytes sets on an AVX512-BF16 CPU
    _generate(model, batch)
    assert _packed(model) == 14  # generate repacked every 4-bit layer: the trap is armed

    curve, before, after, warned = _train(model, batch)
    assert _packed(model) == 0
    assert warned == 0
    assert curve[-1] < curve[0] - 0.1, curve
    for name in before:
        assert (after[name] - before[name]).abs().max().item() > 0, f"{name} did not change"
    # Not just "it learns": exactly the losses of the run that never generated.
    assert max(abs(a - b) for a, b in zip(curve, reference_4bit)) == 0.0, (curve, reference_4bit)


def test_4bit_generate_with_default_guard_keeps_training_identical(setup, batch, reference_4bit):
    model = _lora_model(setup[1], 4)
    _generate(model, batch)
    assert _packed(model) == 0
    curve, _, _, warned = _train(model, batch)
    assert warned == 0
    assert curve == reference_4bit


def test_without_the_guard_the_trap_is_real(setup, batch):
    """Control: the same packed model with the guard's hooks removed sends gradients through gemv_4bit, which has
    no autograd kernel (torch warns on every backward)."""
    model = _lora_model(setup[1], 4)
    for m in _linear4(model):
        m.support_avx512bf16_for_cpu = True
        m._finetune_4bit_guard.remove()
    _generate(model, batch)
    assert _packed(model) == 14
    _, _, _, warned = _train(model, batch, steps=1)
    assert warned > 0


def test_8bit_lora_learns_after_generate(setup, batch):
    reference, _, _, _ = _train(_lora_model(setup[1], 8), batch)
    model = _lora_model(setup[1], 8)
    _generate(model, batch)
    curve, before, after, _ = _train(model, batch)
    assert curve[-1] < curve[0] - 0.1, curve
    assert all((after[n] - before[n]).abs().max().item() > 0 for n in before)
    assert curve == reference


# ----------------------------------------------------------------------------------------------
# Flags and refusals


def test_4bit_compute_dtype_flag(setup):
    flags = dict(load_in_8bit=False, load_in_4bit=True, bnb_4bit_quant_type="fp4", use_bnb_nested_quant=False)
    assert quantization_config(SimpleNamespace(**flags), torch.float32).bnb_4bit_compute_dtype == torch.float32
    q = quantization_config(SimpleNamespace(**flags, bnb_4bit_compute_dtype="bfloat16"), torch.float32)
    assert q.bnb_4bit_compute_dtype == torch.bfloat16 and q.bnb_4bit_quant_type == "fp4"
    with pytest.raises(ValueError, match="bnb_4bit_compute_dtype: 'fp8' is not one of"):
        quantization_config(SimpleNamespace(**flags, bnb_4bit_compute_dtype="fp8"), torch.float32)
    with pytest.raises(ValueError, match="bnb_4bit_quant_type: 'int4' is not one of nf4, fp4"):
        quantization_config(SimpleNamespace(**{**flags, "bnb_4bit_quant_type": "int4"}), torch.float32)

    cfg = ModelConfig(model_name_or_path=str(setup[1]), torch_dtype="float32", use_peft=True, load_in_4bit=True)
    cfg.bnb_4bit_compute_dtype = "bfloat16"  # the ModelConfig field to come; read with getattr meanwhile
    model = load_model(cfg)
    layers = _linear4(model)
    assert layers and all(m.compute_dtype == torch.bfloat16 for m in layers)
    ids = torch.arange(3, 20).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("preset", ["zero3", "zero3_no_offload"])
def test_quantized_base_under_zero3_is_refused_with_the_alternative(setup, preset, tmp_path):
    _, model, data = setup
    argv = ["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(tmp_path),
            "--use_peft", "--load_in_4bit", "--config", preset]
    with pytest.raises(ConfigError) as err:
        parse(argv)
    assert f"--config {preset}: a bitsandbytes-quantized base cannot be partitioned by ZeRO-3; use --config ddp or zero2" in str(err.value)


def test_load_model_refuses_quantized_under_zero3_from_python(setup):
    """Python callers that skip the config check get the same refusal from load_model, before any weight loads."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    ds = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        cfg = ModelConfig(model_name_or_path=str(setup[1]), use_peft=True, load_in_8bit=True)
        with pytest.raises(ValueError, match="cannot be partitioned by ZeRO-3; use --config ddp or zero2"):
            load_model(cfg)
    finally:
        del ds
        unset_hf_deepspeed_config()


def test_one_set_of_quantization_rules(tmp_path):
    """finetune.models.quant holds the rules; training's validation, `finetune generate` and load_model all use them."""
    from finetune.inference import generate as G
    from finetune.models import quant

    bad = dict(load_in_8bit=True, load_in_4bit=True, bnb_4bit_quant_type="int4", bnb_4bit_compute_dtype="fp8")
    expected = [
        "load_in_8bit and load_in_4bit: choose one",
        "bnb_4bit_quant_type: 'int4' is not one of nf4, fp4",
        "bnb_4bit_compute_dtype: 'fp8' is not one of auto, float32, bfloat16, float16",
    ]
    assert quant.problems(SimpleNamespace(**bad)) == expected
    flags = ["--load_in_8bit", "--load_in_4bit", "--bnb_4bit_quant_type", "int4", "--bnb_4bit_compute_dtype", "fp8"]
    with pytest.raises(ConfigError) as err:
        parse([*flags, "--config", "zero3"], check_paths=False)
    assert err.value.problems == expected + [quant.NEEDS_LORA, f"--config zero3: {quant.NOT_UNDER_ZERO3}"]
    with pytest.raises(ConfigError) as err:
        G.command().parse(["--model", "m", "--prompt", "hi", *flags], G.check_args)
    assert err.value.problems == expected  # inference: no LoRA needed, no ZeRO
    with pytest.raises(ValueError, match="load_in_8bit and load_in_4bit: choose one"):
        quant.quantization_config(SimpleNamespace(**bad), torch.float32)
    assert quant.quantization_config(SimpleNamespace(load_in_8bit=False, load_in_4bit=False), torch.float32) is None
    assert quant.problems(SimpleNamespace(load_in_4bit=True, use_peft=False), training=True) == [quant.NEEDS_LORA]
    assert quant.problems(SimpleNamespace(load_in_4bit=True, use_peft=True), training=True) == []


# ----------------------------------------------------------------------------------------------
# The compute dtype: a quantized base computes in bf16, within a stated bound of the unquantized bf16 model.

BF16_LOSS_RTOL = 1e-3  # |loss(quantized) - loss(bf16)| / loss(bf16); measured 1.2e-4 (nf4), 2e-5 (int8)
BF16_LOGIT_RTOL = {"4": 0.25, "8": 0.05}  # ||logits(quantized) - logits(bf16)|| / ||logits(bf16) - their mean||;
# measured 0.104 (nf4), 0.0094 (int8)


def _bf16_model(model_dir, **quant):
    cfg = ModelConfig(model_name_or_path=str(model_dir), torch_dtype="bfloat16", use_peft=True, lora_r=8,
                      lora_alpha=16, lora_dropout=0.0, **quant)
    return load_model(cfg)


@pytest.mark.parametrize("bits", ["4", "8"])
def test_quantized_base_computes_in_bf16_near_the_bf16_model(setup, batch, bits):
    """Embeddings, norms and the LM head stay bf16 (peft's prepare_model_for_kbit_training made them fp32), the
    quantized layers compute in bf16, the LoRA weights are fp32 and the only trainable ones; the loss (and the
    logits) of the quantized base are within a bound of the unquantized bf16 model's, and not equal to them."""
    import bitsandbytes as bnb

    reference = _bf16_model(setup[1])
    model = _bf16_model(setup[1], load_in_4bit=bits == "4", load_in_8bit=bits == "8")
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    base = {n: d for n, d in dtypes.items() if "lora_" not in n and d.is_floating_point}
    assert base and set(base.values()) == {torch.bfloat16}, base
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    if bits == "4":
        layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(layers) == 14 and all(m.compute_dtype == torch.bfloat16 for m in layers)
    out = {}
    for name, m in (("bf16", reference), ("quantized", model)):
        m.train()
        result = m(input_ids=batch, labels=batch)
        result.loss.backward()  # gradients reach the adapters through the quantized layers
        # B starts at zero (so A's gradient is zero): B's gradient is what the quantized layers pass on.
        assert all(p.grad.abs().sum() > 0 for n, p in m.named_parameters() if "lora_B" in n)
        out[name] = (result.loss.item(), result.logits.detach().float())
    (ref_loss, ref_logits), (loss, logits) = out["bf16"], out["quantized"]
    assert 0 < abs(loss - ref_loss) / ref_loss <= BF16_LOSS_RTOL, (loss, ref_loss)
    spread = (ref_logits - ref_logits.mean()).norm()
    assert 0 < (logits - ref_logits).norm() / spread <= BF16_LOGIT_RTOL[bits]
