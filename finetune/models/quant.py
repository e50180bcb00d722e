"""bitsandbytes quantization (--load_in_8bit / --load_in_4bit): the BitsAndBytesConfig and every rule about it.

One place for the rules, used by the training flags' validation (finetune.config), by load_model and by
`finetune generate`: 8-bit and 4-bit are exclusive, the 4-bit quant type and compute dtype are known names,
quantized weights are trained only through LoRA, and ZeRO-3 cannot partition a quantized base.
`cfg` is anything with the ModelConfig attribute names (ModelConfig, generate's flags, a SimpleNamespace).
"""

from __future__ import annotations

from typing import Any

QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")

NEEDS_LORA = "load_in_8bit/load_in_4bit: quantized weights cannot be trained directly; add --use_peft (LoRA/QLoRA)"
NOT_UNDER_ZERO3 = "a bitsandbytes-quantized base cannot be partitioned by ZeRO-3; use --config ddp or zero2"
# Measured (bitsandbytes 0.50, accelerate 1.15, torch 2.13): fully_shard turns Int8Params into plain parameters, and
# the first forward fails with "'Parameter' object has no attribute 'CB'".
NOT_8BIT_UNDER_FSDP = ("load_in_8bit: bitsandbytes' 8-bit weights cannot be sharded by FSDP2 (fully_shard replaces them "
                       "with plain parameters, losing their scales); use --load_in_4bit (QLoRA, sharded), or --config "
                       "ddp or zero2 for 8-bit")


def is_quantized(cfg: Any) -> bool:
    return bool(getattr(cfg, "load_in_8bit", False) or getattr(cfg, "load_in_4bit", False))


def _compute_dtype_name(cfg: Any) -> str:
    value = getattr(cfg, "bnb_4bit_compute_dtype", None)
    return "auto" if value in (None, "") else value


def problems(cfg: Any, *, training: bool = False, zero3: bool = False, config: str | None = None,
             fsdp: bool = False) -> list[str]:
    """Every quantization problem of `cfg`. training: the weights will be trained (needs LoRA); zero3: the run is
    partitioned by ZeRO-3 (config: the --config value that says so, for the message)."""
    out = []
    if getattr(cfg, "load_in_8bit", False) and getattr(cfg, "load_in_4bit", False):
        out.append("load_in_8bit and load_in_4bit: choose one")
    quant_type = getattr(cfg, "bnb_4bit_quant_type", "nf4")
    if quant_type not in QUANT_TYPES:
        out.append(f"bnb_4bit_quant_type: '{quant_type}' is not one of {', '.join(QUANT_TYPES)}")
    compute = _compute_dtype_name(cfg)
    if compute not in COMPUTE_DTYPES:
        out.append(f"bnb_4bit_compute_dtype: '{compute}' is not one of {', '.join(COMPUTE_DTYPES)}")
    if training and is_quantized(cfg) and not getattr(cfg, "use_peft", False):
        out.append(NEEDS_LORA)
    if zero3 and is_quantized(cfg):
        out.append(f"--config {config}: {NOT_UNDER_ZERO3}" if config else NOT_UNDER_ZERO3)
    if fsdp and getattr(cfg, "load_in_8bit", False):
        out.append(f"--config {config}: {NOT_8BIT_UNDER_FSDP}" if config else NOT_8BIT_UNDER_FSDP)
    return out


def quantization_config(cfg: Any, dtype, *, sharded: bool = False):
    """The BitsAndBytesConfig for --load_in_8bit / --load_in_4bit, or None; ValueError on a bad combination.

    4-bit compute dtype: `bnb_4bit_compute_dtype` (float32, bfloat16, float16; "auto" or unset = the model dtype).
    sharded (FSDP2): the packed 4-bit weights are stored in the compute dtype (bnb_4bit_quant_storage), so that
    fully_shard can shard them like the float parameters around them (with the default uint8 storage accelerate
    leaves them out of sharding, and every rank holds the whole quantized base).
    """
    if not is_quantized(cfg):
        return None
    found = problems(cfg)
    if found:
        raise ValueError(found[0])
    from transformers import BitsAndBytesConfig

    if cfg.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    import torch

    compute = _compute_dtype_name(cfg)
    compute_dtype = dtype if compute == "auto" else getattr(torch, compute)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=bool(getattr(cfg, "use_bnb_nested_quant", False)),
        bnb_4bit_compute_dtype=compute_dtype,
        **({"bnb_4bit_quant_storage": compute_dtype} if sharded else {}),
    )


def check_quantized_setup(cfg: Any) -> None:
    """Raise ValueError for a quantized base under a ZeRO-3 run in progress (config validation catches it earlier
    for the command line; this guards Python callers)."""
    if not is_quantized(cfg):
        return
    from transformers.integrations import is_deepspeed_zero3_enabled

    # transformers: "DeepSpeed Zero-3 is not compatible with passing a `device_map`."; without a device_map every
    # rank still loads the whole quantized base (nothing is partitioned at load), so ZeRO-3 buys nothing.
    found = problems(cfg, zero3=is_deepspeed_zero3_enabled())
    if found:
        message = found[0]
        if message == NOT_UNDER_ZERO3:
            message += " (each rank then holds its own quantized copy)"
        raise ValueError(message)


def prepare_for_training(model):
    """A quantized base made ready for LoRA: every base parameter frozen. What peft's prepare_model_for_kbit_training
    does besides is left out: it casts every unquantized 16-bit parameter (embeddings, norms, the LM head) to fp32,
    which doubles their memory (an 8B Llama-3's embedding and head: 2.1 GB more) and makes the head's matmul and the
    norms fp32 while the quantized layers compute in bf16. Here they stay in the dtype they were loaded in (bf16 on a
    GPU that has it), and so compute in it. The LoRA weights peft adds stay fp32 (a bf16 weight would round small
    updates away); under bf16 mixed precision, the default on such a GPU, their matmuls run in bf16 too. Gradient
    checkpointing's input gradients and the checkpointing itself are the training paths' (finetune.models.load,
    finetune.training.core)."""
    for param in model.parameters():
        param.requires_grad_(False)
    return model
