"""Check what a save wrote: no empty or non-finite tensors, the folder reloads with `from_pretrained`, and the reloaded
model's logits on a fixed input match the model that was saved.

    from finetune.models.verify import verify_saved
    report = verify_saved(folder, model)              # the in-memory model (full model or PeftModel)
    report = verify_saved(folder, state_dict)         # or its consolidated state dict (ZeRO-3: the gathered one)
    print(report)                                     # raises VerificationError when anything is off

A failed verification is an error, never a warning: a folder that does not reload to the same model is not a
model. Used after `finetune export` and, through finetune.training's final saves (lifecycle.save_final_trainer,
core.save_final_module), after training.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import compat

DEFAULT_ATOL = 1e-5


class VerificationError(Exception):
    """The saved folder is not the model that was saved."""


@dataclass
class VerifyReport:
    folder: str
    kind: str  # "model" or "adapter"
    tensors: int
    parameters: int
    max_logit_diff: float
    atol: float
    max_tensor_diff: float | None = None

    def __str__(self) -> str:
        tensor = "" if self.max_tensor_diff is None else f", max tensor diff {self.max_tensor_diff:.3g}"
        return (
            f"verified {self.kind} {self.folder}: {self.tensors} tensors ({self.parameters:,} values), none empty or "
            f"non-finite; reloads with from_pretrained; logits max diff {self.max_logit_diff:.3g} (limit {self.atol:g}){tensor}"
        )


def fixed_input(vocab_size: int, batch: int = 2, length: int = 16, seed: int = 0):
    """The fixed probe: token ids drawn with a fixed seed (the same on every call and machine)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def weight_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def check_tensors(folder: str | Path) -> tuple[int, int]:
    """Every tensor in every safetensors file has at least one element and only finite values.

    Returns (tensors, values). An empty tensor is what a ZeRO-3 partitioned model writes when its weights were not
    gathered before saving.
    """
    import torch
    from safetensors import safe_open

    files = weight_files(folder)
    if not files:
        raise VerificationError(f"{folder}: no *.safetensors weights were written")
    empty, bad, count, values = [], [], 0, 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                count += 1
                n = 1
                for d in shape:
                    n *= d
                if n == 0:
                    empty.append(f"{key} {list(shape)}")
                    continue
                values += n
                tensor = f.get_tensor(key)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    bad.append(key)
    if empty:
        raise VerificationError(
            f"{folder}: {len(empty)} empty tensor(s) written: {', '.join(empty[:5])} "
            "(a ZeRO-3 model writes empty tensors when its weights were not gathered before saving)"
        )
    if bad:
        raise VerificationError(f"{folder}: {len(bad)} tensor(s) with NaN or inf values: {', '.join(bad[:5])}")
    return count, values


def _first_device(model):
    import torch

    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _float_dtype(model):
    import torch

    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def logits_of(model, input_ids):
    """Logits of `model` on `input_ids` in eval mode without gradients (the model's mode is restored)."""
    import torch

    was_training = model.training
    model.eval()
    # Under --bf16/--fp16, accelerate replaces model.forward with an autocast wrapper (keeping the plain one as
    # _original_forward); the reference must run in the weights' own dtype, as the reloaded copy does.
    forward = getattr(model, "_original_forward", None) or model
    device = _first_device(model)
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            return forward(input_ids=input_ids.to(device), use_cache=False).logits.float().cpu()
    finally:
        model.train(was_training)


def _strip(key: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while key.startswith(prefix):
            key = key[len(prefix) :]
    return key


def _load_reference_into(model, reference: Mapping, kind: str) -> float:
    """Load a reference state dict into the reloaded model (after its own logits were taken); every weight of the
    model must be covered, or the comparison would prove nothing. Returns the max |saved - reference| tensor diff."""
    import torch

    ref = {_strip(k): v for k, v in reference.items()}
    state = model.state_dict()
    if kind == "adapter" and not any(".default." in k for k in ref) and any("lora_" in k for k in ref):
        # An adapter-only dict (get_peft_model_state_dict format): name the adapter.
        ref = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v for k, v in ref.items()}
    wanted = [k for k in state if "lora_" in k] if kind == "adapter" else list(state)
    tied = _tied_keys(model)
    missing = [k for k in wanted if k not in ref and k not in tied]
    if missing:
        raise VerificationError(
            f"the reference state dict lacks {len(missing)} of the model's weights (e.g. {', '.join(missing[:3])}); "
            "pass the full consolidated state dict"
        )
    diff = 0.0
    with torch.no_grad():
        for k in wanted:
            if k not in ref:
                continue
            value = ref[k]
            if tuple(value.shape) != tuple(state[k].shape):
                raise VerificationError(f"{k}: saved shape {list(state[k].shape)}, reference shape {list(value.shape)}")
            if state[k].is_floating_point():
                diff = max(diff, (state[k].float().cpu() - value.float().cpu()).abs().max().item() if value.numel() else 0.0)
    result = model.load_state_dict({k: ref[k] for k in wanted if k in ref}, strict=False)
    if result.unexpected_keys:
        raise VerificationError(f"reference weights the model does not have: {', '.join(result.unexpected_keys[:3])}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return diff


def _adapter_dtypes_of(model, reference) -> None:
    """Hold the reloaded adapter's weights in the dtypes the in-memory adapter computes in.

    peft reloads 16-bit adapter weights as fp32 (PeftModel.from_pretrained's autocast_adapter_dtype) and then runs
    the LoRA branch in fp32. A model whose adapters are 16-bit in memory (DeepSpeed's bf16/fp16 engine casts every
    parameter, adapters included: --config zero1/zero2 --use_peft --bf16) computes the branch in 16 bits, so its
    logits and the reload's differed by bf16 rounding (2.9e-3 to 3.9e-3 on the tiny test models) although the saved
    values are exactly the in-memory ones. Each reloaded adapter weight is cast to its reference's dtype (the saved
    16-bit values go to fp32 and back exactly), so the comparison is of the weights, not of two compute dtypes."""
    import torch

    wanted = {_strip(n): p.dtype for n, p in reference.named_parameters() if "lora_" in n and p.is_floating_point()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            dtype = wanted.get(_strip(name))
            if dtype is not None and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)


def _tied_keys(model) -> set[str]:
    """State-dict names that alias another weight (e.g. lm_head.weight tied to the embeddings)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.device.type == "meta":
            continue
        ptr = tensor.data_ptr()
        if ptr in seen and ptr != 0:
            tied.add(name)
        else:
            seen[ptr] = name
    return tied


def _quantization_of(model):
    """The BitsAndBytesConfig a quantized reference was loaded with, to reload its base the same way."""
    base = model
    if hasattr(model, "get_base_model"):
        base = model.get_base_model()
    config = getattr(getattr(base, "config", None), "quantization_config", None)
    if config is None:
        return None
    from transformers import BitsAndBytesConfig

    if isinstance(config, BitsAndBytesConfig):
        return config
    if isinstance(config, dict):
        return BitsAndBytesConfig.from_dict(config)
    return config


def reload(folder: str | Path, *, base_model: str | None = None, dtype=None, device=None, quantization=None):
    """from_pretrained on the folder: a full model, or an adapter on its base (from adapter_config.json unless
    `base_model` is given). Missing or unexpected weights are errors (from_pretrained would initialise missing
    ones randomly and only log it)."""
    import torch
    import transformers

    from finetune.models.load import model_class, saved_task

    folder = Path(folder)
    task, head_kwargs = saved_task(folder)  # a reward model's sequence-classification head, or the causal LM
    kwargs: dict[str, Any] = {"dtype": dtype or torch.float32}
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        on_gpu = device is not None and getattr(device, "type", str(device)) == "cuda"
        kwargs["device_map"] = {"": (device.index or 0) if on_gpu else "cpu"}
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        cfg = json.loads((folder / "adapter_config.json").read_text())
        base_path = base_model or cfg.get("base_model_name_or_path")
        if not base_path or not Path(base_path).is_dir():
            raise VerificationError(
                f"{folder}: cannot reload the adapter: its base model {base_path!r} is not a local folder (pass base_model)"
            )
        from finetune.models.load import quiet_load_report

        auto = model_class(transformers.AutoConfig.from_pretrained(base_path), task)
        with quiet_load_report():  # a reward model's base has no score head: the adapter's (modules_to_save) replaces it
            base = auto.from_pretrained(base_path, **head_kwargs, **kwargs)
        if quantization is None and device is not None:
            base.to(device)
        try:
            with compat.quiet_checkpointing_alias():
                model = PeftModel.from_pretrained(base, str(folder), is_trainable=False)
        except Exception as e:  # noqa: BLE001 - any failure to reload is the verification failing
            raise VerificationError(f"{folder}: the adapter does not reload onto {base_path}: {e}") from e
        return model.eval(), "adapter"
    if not (folder / "config.json").is_file():
        raise VerificationError(f"{folder}: neither config.json nor adapter_config.json was written")
    try:
        auto = model_class(transformers.AutoConfig.from_pretrained(str(folder)), task)
        model, info = auto.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise VerificationError(f"{folder}: from_pretrained failed: {type(e).__name__}: {e}") from e
    problems = []
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(map(str, info.get(what) or []))
        if keys:
            problems.append(f"{what.replace('_', ' ')}: {', '.join(keys[:5])}")
    if problems:
        raise VerificationError(f"{folder}: the saved weights do not match the model's architecture ({'; '.join(problems)})")
    if quantization is None and device is not None:
        model.to(device)
    return model.eval(), "model"


def _weights_diff(model, reference, folder) -> float:
    """The largest difference between the reloaded model's parameters and the reference's, name for name."""
    mine = dict(model.named_parameters())
    theirs = {_strip(k): v for k, v in reference.named_parameters()}
    if set(mine) != set(theirs):
        missing = sorted(set(theirs) ^ set(mine))
        raise VerificationError(f"{folder}: the reloaded model's parameters are not the saved one's ({', '.join(missing[:3])})")
    diff = max((mine[k].detach().float().cpu() - theirs[k].detach().float().cpu()).abs().max().item() for k in mine)
    if not diff == 0.0:
        raise VerificationError(f"{folder}: the reloaded weights differ from the saved ones by up to {diff:.3g}")
    return diff


def verify_processor(written: str | Path, source: str | Path) -> int:
    """A vision-language model folder's processor reloads to the source's: both render and tokenize a fixed
    conversation with a fixed image alike (every tensor equal: token ids with the image's tokens, pixel values,
    grids). The number of token ids, for the log; VerificationError names the difference."""
    import numpy as np
    import torch
    from PIL import Image

    from finetune.models.load import WeightsError, load_processor

    image = Image.fromarray(np.random.RandomState(0).randint(0, 255, (48, 80, 3), dtype=np.uint8))
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]}]
    outputs = []
    for folder in (source, written):
        try:
            processor = load_processor(folder)
        except WeightsError as e:
            raise VerificationError(str(e)) from None
        text = processor.apply_chat_template(conversation, tokenize=False)
        outputs.append(processor(text=[text], images=[[image]], return_tensors="pt"))
    want, got = outputs
    if set(want) != set(got) or not all(torch.equal(torch.as_tensor(want[k]), torch.as_tensor(got[k])) for k in want):
        differ = sorted(k for k in set(want) | set(got) if k not in want or k not in got
                        or not torch.equal(torch.as_tensor(want[k]), torch.as_tensor(got[k])))
        raise VerificationError(f"{written}: its processor renders a conversation with an image differently from "
                                f"{source}'s ({', '.join(differ)})")
    return int(want["input_ids"].shape[1])


def verify_saved(
    folder: str | Path,
    reference,
    *,
    base_model: str | None = None,
    atol: float = DEFAULT_ATOL,
    input_ids=None,
) -> VerifyReport:
    """Verify a saved model or adapter folder against what was saved.

    reference: the in-memory model (a transformers model, or a PeftModel for an adapter folder; on any device,
    quantized or not: the reload uses the same device, dtype and quantization), or a consolidated state dict of it
    (name -> tensor; under ZeRO-3 the in-memory model is partitioned, so pass the gathered state dict).
    base_model: the base folder for an adapter (default: adapter_config.json's base_model_name_or_path).
    Raises VerificationError; returns a VerifyReport with the numbers.
    """
    import torch

    folder = Path(folder)
    tensors, values = check_tensors(folder)
    is_module = isinstance(reference, torch.nn.Module)
    if not is_module and not isinstance(reference, Mapping):
        raise TypeError("reference must be a torch.nn.Module or a state dict (Mapping of name -> tensor)")
    if is_module:
        dtype, device, quant = _float_dtype(reference), _first_device(reference), _quantization_of(reference)
    else:
        floats = [v.dtype for v in reference.values() if hasattr(v, "is_floating_point") and v.is_floating_point()]
        dtype, device, quant = (floats[0] if floats else torch.float32), None, None
    with compat.outside_zero3():
        model, kind = reload(folder, base_model=base_model, dtype=dtype, device=device, quantization=quant)
    if quant is not None:
        compat.same_4bit_layout(model, reference)
    if is_module and kind == "adapter":
        _adapter_dtypes_of(model, reference)
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else model.config.vocab_size
    ids = input_ids if input_ids is not None else fixed_input(int(vocab))
    reloaded = logits_of(model, ids)
    tensor_diff = None
    if is_module:
        expected = logits_of(reference, ids)
    else:
        tensor_diff = _load_reference_into(model, reference, kind)
        expected = logits_of(model, ids)
    if is_module and kind == "model" and getattr(model.config, "vision_config", None) is not None:
        # A vision-language model: the text-only input above leaves its vision tower and projector out; their
        # weights are compared one by one.
        tensor_diff = _weights_diff(model, reference, folder)
    if expected.shape != reloaded.shape:
        raise VerificationError(f"{folder}: reloaded logits have shape {list(reloaded.shape)}, expected {list(expected.shape)}")
    diff = (expected - reloaded).abs().max().item()
    if not diff <= atol:  # also catches NaN
        tensors_note = "" if tensor_diff is None else f"; saved tensors differ from the reference by up to {tensor_diff:.3g}"
        raise VerificationError(
            f"{folder}: the reloaded {kind} does not match the saved one: logits differ by up to {diff:.3g} "
            f"(limit {atol:g}) on the fixed input{tensors_note}"
        )
    del model
    return VerifyReport(str(folder), kind, tensors, values, diff, atol, tensor_diff)
