"""A LoRA adapter folder checked against the base model it is put on, before any weight loads (finetune generate
and finetune export both refuse an adapter trained for another base with the same message)."""

from __future__ import annotations

import json
import re
from pathlib import Path


class AdapterError(ValueError):
    """The adapter folder is not a LoRA adapter, or does not fit the base model; the message names what differs."""


def check_adapter(adapter: str, base_path: str, meta_model) -> dict:
    """An adapter trained for another base model is an error before anything loads: every LoRA matrix must fit
    the base module it targets (shape), and a recorded local base folder must describe the same architecture."""
    from safetensors import safe_open

    folder = Path(adapter)
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"--adapter {adapter}: no adapter_config.json (is it a PEFT adapter folder?)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"--adapter {adapter}: peft_type {cfg.get('peft_type')} is not supported (LoRA only)")
    recorded = cfg.get("base_model_name_or_path")
    if recorded and Path(recorded).is_dir() and (Path(recorded) / "config.json").is_file():
        ours = json.loads((Path(base_path) / "config.json").read_text())
        theirs = json.loads((Path(recorded) / "config.json").read_text())
        keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size")
        diff = [f"{k} {theirs.get(k)} vs {ours.get(k)}" for k in keys if theirs.get(k) != ours.get(k)]
        if diff:
            raise AdapterError(
                f"--adapter {adapter} was trained on base model {recorded}, which differs from {base_path}: "
                + "; ".join(diff)
            )
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterError(f"--adapter {adapter}: no adapter_model.safetensors")
    modules = dict(meta_model.named_modules())
    problems = []
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            m = re.match(r"^(?:base_model\.model\.)?(.*)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight$", key)
            if not m:
                continue
            target, kind = m.group(1), m.group(2)
            module = modules.get(target)
            shape = tuple(f.get_slice(key).get_shape())
            if not hasattr(module, "in_features") and (wrapped := _wrapped_parameter(target, modules, cfg)) is not None:
                module = wrapped  # a 3-d expert parameter under peft's target_parameters
            if module is None or not hasattr(module, "in_features"):
                problems.append(f"{target}: no such linear layer in the base model")
            elif kind == "lora_A" and shape[1] != module.in_features:
                problems.append(f"{target}: adapter expects {shape[1]} input features, the base layer has {module.in_features}")
            elif kind == "lora_B" and shape[0] != module.out_features:
                problems.append(f"{target}: adapter expects {shape[0]} output features, the base layer has {module.out_features}")
    if problems:
        shown = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        origin = f" (it was trained on {recorded})" if recorded else ""
        raise AdapterError(f"--adapter {adapter} does not fit base model {base_path}{origin}: {shown}")
    return cfg


class _ParamShape:
    """The in/out features peft's lora.ParamWrapper reads from a [experts, a, b] parameter: in b, out a (a, b when
    the experts module says is_transposed), each times the experts in the LoRA matrices (lora_A [r x experts, in],
    lora_B [out, r x experts])."""

    def __init__(self, shape, transposed: bool):
        e, a, b = shape if len(shape) == 3 else (1, *shape)
        self.in_features, self.out_features = (a, b) if transposed and len(shape) == 3 else (b, a)


def _wrapped_parameter(target: str, modules: dict, cfg: dict):
    """The parameter a target_parameters adapter's key names: peft wraps a module's targeted parameters in the order
    the module registers them (not the config's, a set), the first innermost: of Qwen3-MoE's experts,
    `experts.base_layer` is gate_up_proj's adapter and `experts` down_proj's."""
    base, depth = target, 0
    while base.endswith(".base_layer"):
        base, depth = base[: -len(".base_layer")], depth + 1
    module = modules.get(base)
    if module is None:
        return None
    targets = cfg.get("target_parameters") or []
    params = [(n, p) for n, p in module.named_parameters(recurse=False)
              if any(f"{base}.{n}" == t or f"{base}.{n}".endswith("." + t) for t in targets)]
    if depth >= len(params):
        return None
    return _ParamShape(tuple(params[len(params) - 1 - depth][1].shape), getattr(module, "is_transposed", False))
