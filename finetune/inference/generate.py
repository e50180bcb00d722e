"""Generate completions from a base model (optionally with a LoRA adapter), sharded over devices with a device_map.

    finetune generate --model_name_or_path MODEL --prompt "Hello" [--prompt ...] [--chat]
    finetune generate --model_name_or_path MODEL --adapter ADAPTER --prompts prompts.jsonl --output out.jsonl
    finetune generate ... --device_map auto --max_memory cpu=2GiB,disk=20GiB --offload_folder /tmp/offload
    finetune generate ... --device_map my_map.json          # {"model.embed_tokens": "cpu", "model.layers.0": 0, ...}
    python -m finetune.inference.generate ...               # the same

Prompts: `--prompt TEXT` (repeatable; `--chat` sends each through the chat template as one user message) or
`--prompts FILE.jsonl`, one record a line: {"prompt": TEXT} or {"text": TEXT} (plain text, `--chat` applies),
{"messages": [{"role": ..., "content": ...}, ...]} (always through the chat template), or a bare JSON string.
An "id" field is copied to the output. Output: one JSON line per prompt, in input order, with `prompt` and
`completion` (plus `finish_reason`: eos or length, and `completion_tokens`), to `--output FILE` or stdout.
Greedy decoding unless `--do_sample`; generation stops at EOS or after `--max_new_tokens`.

A vision-language model (docs/families.md) takes images: `--image PATH` (repeatable) puts them, in order, before the
text of every `--prompt`; a prompts file's record names its own ({"prompt": TEXT, "images": [PATH, ...]}, or
{"messages": [...], "images": [...]} with one {"type": "image"} part per image in TRL's format), paths relative to
the file. The model folder's processor renders and tokenizes them (its chat template, its image-token expansion),
so a prompt with images always goes through the chat template.

Where each block of the model landed (device map) and the peak memory are printed to stderr. Greedy output
does not depend on the placement: a sharded or disk-offloaded model produces the same tokens as the model in
one piece (tests/test_generate.py checks it token for token).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from finetune import compat
from finetune.process import peak_rss_bytes

PRESET_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


class GenerationError(Exception):
    """A user mistake (bad device map, impossible memory limits, wrong adapter, bad prompt file): one clear message."""


# ----------------------------------------------------------------------------------------------
# Devices and memory limits


def available_devices() -> list[int | str]:
    """Devices a device map may name on this machine: GPU indices, mps, cpu, disk."""
    import torch

    devices: list[int | str] = list(range(torch.cuda.device_count()))
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    return devices + ["cpu", "disk"]


def _describe_devices(devices: list[int | str]) -> str:
    gpus = [d for d in devices if isinstance(d, int)]
    text = ", ".join(str(d) for d in devices)
    return text + ("" if gpus else " (no GPU on this machine)")


def normalize_device(value: Any, where: str) -> int | str:
    """`0`, `"0"`, `"cuda:0"` -> 0; `"cpu"`, `"disk"`, `"mps"` as they are. Unknown names raise GenerationError."""
    devices = available_devices()
    device: int | str
    if isinstance(value, bool) or value is None:
        raise GenerationError(f"{where}: {value!r} is not a device (available: {_describe_devices(devices)})")
    if isinstance(value, int):
        device = value
    elif isinstance(value, str):
        text = value.strip().lower()
        if re.fullmatch(r"\d+", text):
            device = int(text)
        elif re.fullmatch(r"cuda:\d+", text):
            device = int(text.split(":")[1])
        elif text == "cuda":
            device = 0
        else:
            device = text
    else:
        raise GenerationError(f"{where}: {value!r} is not a device (available: {_describe_devices(devices)})")
    if device not in devices:
        raise GenerationError(
            f"{where}: device {value!r} does not exist on this machine (available: {_describe_devices(devices)})"
        )
    return device


def parse_size(text: str, where: str) -> int:
    from accelerate.utils import convert_file_size_to_int

    text = text.strip()
    try:
        size = int(text) if text.isdigit() else convert_file_size_to_int(text)
    except (ValueError, TypeError):
        size = -1
    if size < 0:
        raise GenerationError(f"{where}: '{text}' is not a size (use bytes or a unit: 500MB, 2GiB, 20GB)")
    return size


def parse_max_memory(text: str | None) -> dict[int | str, int] | None:
    """`cpu=2GiB,disk=20GiB,0=20GiB` -> {"cpu": ..., "disk": ..., 0: ...} in bytes."""
    if not text:
        return None
    out: dict[int | str, int] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise GenerationError(f"--max_memory: '{part}' should look like DEVICE=SIZE (e.g. cpu=2GiB,disk=20GiB,0=20GiB)")
        device = normalize_device(key, f"--max_memory {part}")
        out[device] = parse_size(value, f"--max_memory {part}")
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


# ----------------------------------------------------------------------------------------------
# Device maps


def module_sizes(model) -> dict[str, int]:
    """Bytes of parameters and buffers under every module name ("" = the whole model)."""
    sizes: dict[str, int] = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        nbytes = tensor.numel() * tensor.element_size()
        parts = name.split(".")
        for i in range(len(parts)):
            key = ".".join(parts[:i])
            sizes[key] = sizes.get(key, 0) + nbytes
    return sizes


def _placement_of(name: str, device_map: dict[str, Any]) -> Any:
    """The device map entry that covers `name` (the longest matching prefix), or None."""
    best, best_len = None, -1
    for key, device in device_map.items():
        if key == "" or name == key or name.startswith(key + "."):
            if len(key) > best_len:
                best, best_len = device, len(key)
    return best


def read_device_map_file(path: str, model) -> dict[str, int | str]:
    """A JSON object {module name: device}; every module name must exist and every weight must be placed."""
    p = Path(path)
    if not p.is_file():
        raise GenerationError(f"--device_map {path}: no such file (or use one of: {', '.join(PRESET_MAPS)})")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise GenerationError(f"--device_map {path}:{e.lineno}: not valid JSON: {e.msg}") from None
    if not isinstance(raw, dict) or not raw:
        raise GenerationError(f"--device_map {path}: expected a JSON object of module name -> device")
    names = {name for name, _ in model.named_modules()} | {name for name, _ in model.named_parameters()}
    device_map: dict[str, int | str] = {}
    for key, value in raw.items():
        if key not in names:
            import difflib

            close = difflib.get_close_matches(key, sorted(n for n in names if n), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise GenerationError(f"--device_map {path}: the model has no module '{key}'{hint}")
        device_map[key] = normalize_device(value, f"--device_map {path}: '{key}'")
    unplaced = [n for n, _ in model.named_parameters() if _placement_of(n, device_map) is None]
    if unplaced:
        shown = ", ".join(unplaced[:5]) + (f" and {len(unplaced) - 5} more" if len(unplaced) > 5 else "")
        raise GenerationError(f"--device_map {path}: these weights are not placed on any device: {shown}")
    # Tied weights are one tensor, stored once (under the first name): placed apart, the disk side finds nothing to
    # read and accelerate fails in the first forward (KeyError: 'lm_head.weight').
    from accelerate.utils import find_tied_parameters

    for group in find_tied_parameters(model):
        where = {name: _placement_of(name, device_map) for name in group}
        if len({str(d) for d in where.values()}) > 1:
            shown = ", ".join(f"{name} on {d}" for name, d in where.items())
            raise GenerationError(f"--device_map {path}: {' and '.join(group)} are one tensor (tied weights) placed "
                                  f"apart ({shown}); place their modules on the same device")
    return device_map


def plan_device_map(model, spec: str, max_memory: dict[int | str, int] | None) -> dict[str, int | str]:
    """Resolve a preset (auto, balanced, balanced_low_0, sequential) or a JSON file to an explicit map, and check it
    against the memory limits; the result is what from_pretrained receives, so what is printed is what is used."""
    if spec not in PRESET_MAPS:
        device_map = read_device_map_file(spec, model)
    else:
        import psutil

        from finetune import compat

        limits: dict[int | str, int] | None = None
        if max_memory is not None:
            limits = dict(max_memory)
            limits.setdefault("cpu", psutil.virtual_memory().available)
        device_map = compat.preset_device_map(model, spec, limits)
    check_memory(model, device_map, max_memory)
    return device_map


def bytes_per_device(model, device_map: dict[str, Any]) -> dict[Any, int]:
    out: dict[Any, int] = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        device = _placement_of(name, device_map)
        out[device] = out.get(device, 0) + tensor.numel() * tensor.element_size()
    return out


def check_memory(model, device_map: dict[str, Any], max_memory: dict[int | str, int] | None) -> None:
    """Memory limits that cannot hold the model are an error, not a silent spill to disk.

    With --max_memory, the CPU may always be used (up to its limit, default: the free RAM); GPUs and the disk only
    when named (e.g. disk=20GiB allows offloading to disk). No device may get more than its limit.
    """
    if max_memory is None:
        return
    import psutil

    allowed = dict(max_memory)
    allowed.setdefault("cpu", psutil.virtual_memory().available)
    used = bytes_per_device(model, device_map)
    total = module_sizes(model).get("", 0)
    limits = ",".join(f"{d}={_fmt_bytes(v).replace(' ', '')}" for d, v in max_memory.items())
    for device, nbytes in used.items():
        if device not in allowed:
            if device == "disk":
                raise GenerationError(
                    f"--max_memory {limits} cannot hold the model ({_fmt_bytes(total)} of weights): "
                    f"{_fmt_bytes(nbytes)} would have to go to disk, which --max_memory does not allow. "
                    "Raise the limits, or add disk=SIZE to offload to disk"
                )
            raise GenerationError(f"--max_memory {limits}: the device map puts weights on {device}, which --max_memory does not list")
        if nbytes > allowed[device]:
            raise GenerationError(
                f"--max_memory {limits} cannot hold the model ({_fmt_bytes(total)} of weights): "
                f"{_fmt_bytes(nbytes)} would go to {device}, over its limit of {_fmt_bytes(allowed[device])}"
            )


def expand_blocks(device_map: dict[str, Any], model) -> dict[str, Any]:
    """The map with every entry that covers a list of blocks (e.g. `model.layers`) written out block by block."""
    import torch.nn as nn

    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    for key, device in device_map.items():
        module = modules.get(key)
        if isinstance(module, nn.ModuleList):
            out.update({f"{key}.{i}": device for i in range(len(module))})
        else:
            out[key] = device
    return out


def describe_device_map(device_map: dict[str, Any], model=None) -> str:
    """Where each block landed: one line per entry (lists of blocks written out), in module order, then the bytes
    of weights per device."""
    lines = ["device map (module -> device):"]
    entries = dict(device_map)
    order: dict[str, int] = {}
    if model is not None:
        entries = expand_blocks(entries, model)
        order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    width = max((len(k) for k in entries), default=0)
    for key in sorted(entries, key=lambda k: order.get(k, len(order))):
        lines.append(f"  {key or '(whole model)':<{width}} -> {entries[key]}")
    if model is not None:
        per_device = bytes_per_device(model, device_map)
        lines.append("weights per device: " + ", ".join(f"{d}: {_fmt_bytes(b)}" for d, b in per_device.items()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Loading


@dataclass
class LoadOptions:
    model_name_or_path: str
    adapter: str | None = None
    device_map: str | None = None
    max_memory: dict[int | str, int] | None = None
    offload_folder: str | None = None
    torch_dtype: str = "auto"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "nf4"
    use_bnb_nested_quant: bool = False
    bnb_4bit_compute_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def load_for_inference(opts: LoadOptions, log=None):
    """Load tokenizer + model (+ adapter) placed by `opts.device_map`; returns (model, tokenizer, device_map used).

    Every user mistake raises GenerationError before the weights are read.
    """
    import torch
    from transformers import AutoTokenizer

    from finetune.config import check_model_folder
    from finetune.models.adapter import AdapterError, check_adapter
    from finetune.models.load import (PROCESSOR_FILES, WeightsError, check_loading_info, empty_model,
                                       ensure_pad_token, is_vision, load_processor, model_class, quiet_load_report,
                                       resolve_dtype)
    from finetune.models.quant import quantization_config

    log = log or (lambda *a: print(*a, file=sys.stderr, flush=True))
    problems = check_model_folder(opts.model_name_or_path, allow_pickle=False, trust_remote_code=opts.trust_remote_code)
    if problems:
        raise GenerationError(problems[0])
    try:
        dtype = resolve_dtype(opts.torch_dtype)
    except KeyError:
        raise GenerationError(f"--torch_dtype: '{opts.torch_dtype}' is not one of auto, float32, bfloat16, float16") from None
    try:
        quant = quantization_config(opts, dtype)  # the same rules as training's (finetune.models.quant)
    except ValueError as e:
        raise GenerationError(str(e)) from None

    meta = empty_model(opts.model_name_or_path, dtype, opts.trust_remote_code)
    if opts.adapter:
        try:
            check_adapter(opts.adapter, opts.model_name_or_path, meta)
        except AdapterError as e:
            raise GenerationError(str(e)) from None

    kwargs: dict[str, Any] = dict(opts.extra)
    device_map: dict[str, Any] | str
    if quant is not None:
        kwargs["quantization_config"] = quant
        if opts.device_map not in (None, *PRESET_MAPS):
            device_map = read_device_map_file(opts.device_map, meta)
            if "disk" in device_map.values():
                raise GenerationError(
                    "bitsandbytes-quantized layers cannot be offloaded to disk; drop --load_in_8bit/--load_in_4bit "
                    "(disk offload works for unquantized weights) or keep every layer on cpu/GPUs"
                )
        elif opts.device_map is None and opts.max_memory is None:
            from finetune.models.load import quantized_device_map

            device_map = quantized_device_map()
        else:
            # Quantized layer sizes are only known to transformers' quantizer: it plans the preset itself.
            device_map = opts.device_map or "auto"
            kwargs["max_memory"] = opts.max_memory
    elif opts.device_map is not None or opts.max_memory is not None:
        device_map = plan_device_map(meta, opts.device_map or "auto", opts.max_memory)
    else:
        device_map = {"": 0 if torch.cuda.is_available() else "cpu"}  # default: the whole model on one device
    kwargs["device_map"] = device_map
    offload_tmp = None
    if isinstance(device_map, dict) and "disk" in device_map.values():
        if not opts.offload_folder:
            offload_tmp = tempfile.TemporaryDirectory(prefix="finetune-offload-")
            opts.offload_folder = offload_tmp.name
        Path(opts.offload_folder).mkdir(parents=True, exist_ok=True)
        kwargs["offload_folder"] = opts.offload_folder
        log(f"disk offload folder: {opts.offload_folder}")

    processor = None
    if is_vision(meta.config):
        # The adapter's own processor files where training saved them beside it, else the base folder's.
        saved = opts.adapter and any((Path(opts.adapter) / f).is_file() for f in PROCESSOR_FILES)
        try:
            processor = load_processor(opts.adapter if saved else opts.model_name_or_path, opts.trust_remote_code)
        except WeightsError as e:
            raise GenerationError(str(e)) from None
        tokenizer = processor.tokenizer
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            opts.adapter if opts.adapter and (Path(opts.adapter) / "tokenizer_config.json").is_file() else opts.model_name_or_path,
            trust_remote_code=opts.trust_remote_code,
        )
    ensure_pad_token(tokenizer)
    tokenizer.padding_side = "left"
    try:
        with quiet_load_report():
            model, info = model_class(meta.config).from_pretrained(
                opts.model_name_or_path, dtype=dtype, attn_implementation=opts.attn_implementation,
                trust_remote_code=opts.trust_remote_code, use_safetensors=True, output_loading_info=True, **kwargs,
            )
        check_loading_info(info, opts.model_name_or_path)
    except WeightsError as e:
        raise GenerationError(str(e)) from None
    except ValueError as e:
        if quant is not None and "dispatched on the CPU or the disk" in str(e):
            raise GenerationError(
                "the memory limits leave no room for the quantized model on one device; bitsandbytes layers "
                f"cannot be offloaded to disk (transformers: {str(e).splitlines()[0]})"
            ) from None
        raise
    model._finetune_offload_tmp = offload_tmp  # keep the temporary offload folder alive with the model
    model._finetune_processor = processor  # a vision-language model's processor (processor_of)
    if processor is not None and (kept := compat.keep_direct_tensors_in_memory(model)):
        log(f"kept in memory (read outside the forward of their offloaded module): {', '.join(kept)}")
    placed = dict(getattr(model, "hf_device_map", None) or {"": _single_device(model)})
    if opts.adapter:
        try:
            model = attach_adapter(model, opts.adapter)
        except (RuntimeError, ValueError, KeyError) as e:
            raise GenerationError(f"--adapter {opts.adapter} could not be applied to {opts.model_name_or_path}: {e}") from None
    model.eval()
    return model, tokenizer, placed


def processor_of(model):
    """The processor load_for_inference loaded with a vision-language model (None for a text model)."""
    return getattr(model, "_finetune_processor", None)


def _offload_hooks(model):
    """(module name, module, accelerate AlignDevicesHook) for every module whose weights are fetched at forward time."""
    from finetune import compat

    return compat.offload_hooks(model)


class _AdapterWeightsMap(Mapping):
    """The weights an offloading hook loads before each forward, once LoRA layers sit inside its module: base
    weights moved under `.base_layer` are read from their original place (disk or CPU), LoRA weights from memory."""

    def __init__(self, base_map, lora: dict):
        self.base_map, self.lora = base_map, lora

    @staticmethod
    def _base_name(key: str) -> str:
        return re.sub(r"(^|\.)base_layer\.", r"\1", key)

    def __getitem__(self, key):
        if key in self.lora:
            return self.lora[key]
        return self.base_map[self._base_name(key)]

    def __contains__(self, key) -> bool:
        return key in self.lora or self._base_name(key) in self.base_map

    def __iter__(self):
        yield from self.lora
        yield from self.base_map

    def __len__(self) -> int:
        return len(self.lora) + len(self.base_map)


def attach_adapter(model, adapter: str):
    """Attach a LoRA adapter for inference. A model in one piece gets PeftModel.from_pretrained. A model with
    offloaded modules (disk, or CPU under a GPU) keeps its accelerate hooks: LoRA layers are injected in place and
    each offloading hook learns where the renamed base weights and the LoRA weights are. (PeftModel.from_pretrained
    re-dispatches such a model and fails on weights left on the meta device; transformers' load_adapter leaves the
    LoRA weights of disk-offloaded layers on the meta device and silently computes without them.)"""
    from peft import PeftConfig, PeftModel, inject_adapter_in_model
    import torch
    from safetensors.torch import load_file

    hooks = _offload_hooks(model)
    if not hooks:
        with compat.quiet_checkpointing_alias():
            return PeftModel.from_pretrained(model, adapter, is_trainable=False)
    config = PeftConfig.from_pretrained(adapter)
    config.inference_mode = True
    weights = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    weights = {k[len("base_model.model."):] if k.startswith("base_model.model.") else k: v for k, v in weights.items()}
    inject_adapter_in_model(config, model, adapter_name="default", low_cpu_mem_usage=True)
    # peft 0.21's LoRA on a MoE's expert parameters (ParamWrapper) parametrizes the experts' tensors as it runs, and
    # an offloaded module's tensors are on the meta device then ("unsupported scalarType" in the first forward).
    from peft.tuners.lora.layer import ParamWrapper

    wrapped = [n for n, m in model.named_modules() if isinstance(m, ParamWrapper)]
    apart = sorted({w for w in wrapped for n, _, _ in hooks if w == n or w.startswith(n + ".")})
    if apart:
        raise ValueError(f"its LoRA on the experts' parameters ({apart[0]}{' and more' if len(apart) > 1 else ''}) "
                         "cannot run with those layers offloaded: give them room in memory (--max_memory, or a "
                         "--device_map keeping them on cpu or a GPU), or merge the adapter first (finetune export)")
    # Set the LoRA weights ourselves: PEFT's loader moves them to the device of the base weight, which is the meta
    # device for offloaded layers (their weights are read at forward time), and they would be lost.
    from accelerate.utils import set_module_tensor_to_device

    used = set()
    lora_params = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    for name, param in lora_params:
        key = name.replace(".default.", ".")
        if key not in weights:
            raise ValueError(f"the adapter has no weight for {key}")
        used.add(key)
        module_name = name.rsplit(".", 3)[0]  # ...q_proj . lora_A . default . weight
        # A linear layer's weight, or (a MoE's experts, LoRA on their parameters) the first of the module's own.
        base = model.get_submodule(module_name).get_base_layer()
        ref = next(base.parameters(), None)
        device = ref.device if ref is not None and ref.device.type != "meta" else "cpu"
        dtype = ref.dtype if ref is not None and ref.dtype.is_floating_point else torch.float32
        set_module_tensor_to_device(model, name, device, value=weights[key].to(dtype))
    unused = sorted(set(k for k in weights if "lora_" in k) - used)
    if unused or not lora_params:
        raise ValueError(f"adapter weights that match no LoRA layer: {unused[:3]}")
    for name, module, hook in hooks:
        lora = {k: t.detach() for k, t in _module_tensors(module, hook.place_submodules) if "lora_" in k}
        if lora:
            hook.weights_map = _AdapterWeightsMap(hook.weights_map, lora)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model


def use_adapter(model, adapter: str | None) -> None:
    """Every LoRA layer of `model` on, with `adapter` active, or (None) off: the base model's function. A PeftModel's
    layers and those attach_adapter injects into an offloaded model alike."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.enable_adapters(adapter is not None)
            if adapter is not None:
                module.set_adapter(adapter)


def _module_tensors(module, recurse: bool):
    from accelerate.utils import named_module_tensors

    return list(named_module_tensors(module, include_buffers=False, recurse=recurse))


def _single_device(model) -> str:
    try:
        return str(next(model.parameters()).device)
    except StopIteration:
        return "cpu"


# ----------------------------------------------------------------------------------------------
# Prompts and generation


@dataclass
class Prompt:
    original: Any  # what the user gave: a string or a list of messages
    text: str  # what the model sees (after the chat template)
    chat: bool
    id: Any = None
    images: list = field(default_factory=list)  # PIL images, in the order of the prompt's image parts


def open_images(paths: list[str], where: str, base: Path | None = None) -> list:
    """The images at PATHS (relative to BASE), as RGB PIL images; GenerationError naming WHERE and the path."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for path in paths:
        if not isinstance(path, str):
            raise GenerationError(f"{where}: an image path must be a string, got {path!r}")
        if re.match(r"^[a-z][a-z0-9+.-]*://", path):
            raise GenerationError(f"{where}: image '{path}' is a URL; give a local file (finetune generate reads no "
                                  "network)")
        file = (base / path) if base is not None and not Path(path).is_absolute() else Path(path)
        if not file.is_file():
            raise GenerationError(f"{where}: image '{path}' not found ({file})")
        try:
            with Image.open(file) as im:
                out.append(im.convert("RGB"))
        except (UnidentifiedImageError, OSError) as e:
            raise GenerationError(f"{where}: image '{path}' cannot be read ({e})") from None
    return out


def render_vision(processor, original: Any, images: list, where: str) -> Prompt:
    """A prompt for a vision-language model, through its processor's chat template: a string is one user message
    whose images come first; a message list may carry {"type": "image"} parts, one per image."""
    if isinstance(original, list):
        messages = []
        for i, msg in enumerate(original):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise GenerationError(f"{where}: message {i} should be {{'role': str, 'content': str or list}}")
            content = msg.get("content")
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            if not isinstance(content, list) or not all(isinstance(c, dict) and c.get("type") in ("text", "image")
                                                        for c in content):
                raise GenerationError(f"{where}: message {i}'s content should be a string or a list of "
                                      "{'type': 'text', 'text': ...} and {'type': 'image'} parts")
            messages.append({**msg, "content": content})
        parts = sum(c["type"] == "image" for m in messages for c in m["content"])
        if parts != len(images):
            raise GenerationError(f"{where}: {parts} image part(s) in the messages but {len(images)} image(s) given")
    else:
        messages = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": original}]}]
    if not getattr(processor, "chat_template", None):
        raise GenerationError(f"{where}: a vision-language prompt needs the processor's chat template, and it has none")
    last_is_assistant = messages[-1]["role"] == "assistant"
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=not last_is_assistant,
                                         continue_final_message=last_is_assistant)
    return Prompt(original, text, True, images=images)


def render(tokenizer, original: Any, as_chat: bool, where: str) -> Prompt:
    if isinstance(original, list) or as_chat:
        messages = original if isinstance(original, list) else [{"role": "user", "content": original}]
        if not getattr(tokenizer, "chat_template", None):
            raise GenerationError(f"{where}: chat messages need a chat template, and this tokenizer has none")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
                raise GenerationError(f"{where}: message {i} should be {{'role': str, 'content': str}}")
        last_is_assistant = messages[-1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not last_is_assistant, continue_final_message=last_is_assistant,
        )
        return Prompt(original, text, True)
    return Prompt(original, original, False)


def read_prompts(tokenizer, prompts: list[str] | None, prompts_file: str | None, chat: bool,
                 images: list[str] | None = None, processor=None) -> list[Prompt]:
    """The prompts, rendered; IMAGES (--image) go with every --prompt. PROCESSOR: a vision-language model's, which
    renders every prompt (images or not); without one, images are refused."""
    out: list[Prompt] = []
    if images and processor is None:
        raise GenerationError("--image: this model is a text model; images need a vision-language model "
                              "(docs/families.md lists them)")
    opened = open_images(images or [], "--image")
    for i, text in enumerate(prompts or []):
        where = f"--prompt #{i + 1}"
        out.append(render_vision(processor, text, opened, where) if processor is not None
                   else render(tokenizer, text, chat, where))
    if prompts_file:
        p = Path(prompts_file)
        if problem := prompts_file_problem(prompts_file):
            raise GenerationError(problem)
        for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{prompts_file}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise GenerationError(f"{where}: invalid JSON ({e.msg})") from None
            rid = None
            if isinstance(rec, dict) and processor is not None:
                rid = rec.get("id")
                paths = rec.get("images") or []
                if not isinstance(paths, list):
                    raise GenerationError(f"{where}: 'images' should be a list of image paths")
                record_images = open_images(paths, where, p.parent)
                original = rec["messages"] if isinstance(rec.get("messages"), list) and rec["messages"] else (
                    rec.get("prompt") if isinstance(rec.get("prompt"), str) else rec.get("text"))
                if not isinstance(original, (str, list)):
                    raise GenerationError(f"{where}: expected a 'prompt' or 'text' string, or a non-empty 'messages' list")
                prompt = render_vision(processor, original, record_images, where)
            elif isinstance(rec, dict) and rec.get("images"):
                raise GenerationError(f"{where}: 'images' given, but this model is a text model; images need a "
                                      "vision-language model (docs/families.md lists them)")
            elif isinstance(rec, dict):
                rid = rec.get("id")
                if isinstance(rec.get("messages"), list) and rec["messages"]:
                    prompt = render(tokenizer, rec["messages"], True, where)
                elif isinstance(rec.get("prompt"), str):
                    prompt = render(tokenizer, rec["prompt"], chat, where)
                elif isinstance(rec.get("text"), str):
                    prompt = render(tokenizer, rec["text"], chat, where)
                else:
                    raise GenerationError(f"{where}: expected a 'prompt' or 'text' string, or a non-empty 'messages' list")
            elif isinstance(rec, str):
                prompt = render_vision(processor, rec, [], where) if processor is not None else render(tokenizer, rec, chat, where)
            else:
                raise GenerationError(f"{where}: expected a JSON object or string")
            prompt.id = rid
            out.append(prompt)
    if not out:
        raise GenerationError("no prompts: give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    return out


def input_device(model) -> Any:
    """Where token ids go in: the first GPU in the map, else the CPU (accelerate's hooks move them along)."""
    import torch

    device_map = getattr(model, "hf_device_map", None) or {}
    gpus = sorted(d for d in device_map.values() if isinstance(d, int))
    if gpus:
        return torch.device("cuda", gpus[0])
    try:
        device = next(p.device for p in model.parameters() if p.device.type != "meta")
    except StopIteration:
        return torch.device("cpu")
    return device


def eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


def generate(
    model, tokenizer, prompts: list[Prompt], *, batch_size: int = 8, max_new_tokens: int = 64, do_sample: bool = False,
    temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None, on_result=None,
    token_ids: list[list[int]] | None = None, logits_processor=None, stopping_criteria=None, streamer=None,
) -> list[dict]:
    """Generate in batches (left padding); returns one dict per prompt, in order, with the completion token ids.
    `token_ids`: the prompts already tokenized (one list per prompt), used instead of tokenizing their text;
    `logits_processor`, `stopping_criteria` and `streamer` go to transformers' generate as they are."""
    import torch

    if seed is not None:
        from transformers import set_seed

        set_seed(seed)
    stop = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id
    device = input_device(model)
    gen_kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, do_sample=do_sample, eos_token_id=stop, pad_token_id=pad, use_cache=True,
        **compat.generation_kwargs(model),
    )
    if logits_processor is not None:
        gen_kwargs["logits_processor"] = logits_processor
    if stopping_criteria is not None:
        gen_kwargs["stopping_criteria"] = stopping_criteria
    if streamer is not None:
        gen_kwargs["streamer"] = streamer
    if do_sample:
        gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    else:
        gen_kwargs.update(temperature=None, top_p=None, top_k=None)
    processor = processor_of(model)
    results: list[dict] = []
    for start, batch in batches(prompts, batch_size, by_images=processor is not None):
        if processor is not None:
            inputs = vision_inputs(processor, batch, device)
            width = inputs["input_ids"].shape[1]
        else:
            encoded = (token_ids[start : start + len(batch)] if token_ids is not None
                       else [tokenizer(p.text, add_special_tokens=not p.chat)["input_ids"] for p in batch])
            for k, ids in enumerate(encoded):
                if not ids:
                    raise GenerationError(f"prompt #{start + k + 1} is empty (no tokens to continue from)")
            width = max(len(ids) for ids in encoded)
            inputs = {"input_ids": torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], dtype=torch.long,
                                                device=device),
                      "attention_mask": torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded],
                                                     dtype=torch.long, device=device)}
        with torch.no_grad():
            out = model.generate(**inputs, **gen_kwargs)
        for prompt, row in zip(batch, out[:, width:].tolist()):
            finish = "length"
            for i, token in enumerate(row):
                if token in stop:
                    row, finish = row[:i], "eos"
                    break
            result = {"prompt": prompt.original, "completion": tokenizer.decode(row, skip_special_tokens=True),
                      "finish_reason": finish, "completion_tokens": len(row), "completion_ids": row}
            if prompt.id is not None:
                result = {"id": prompt.id, **result}
            results.append(result)
            if on_result:
                on_result(result)
    return results


def batches(prompts: list[Prompt], size: int, by_images: bool):
    """(index of the first, prompts) in order, SIZE at most; BY_IMAGES: a batch holds prompts with images or prompts
    without, not both (a processor takes images for every text of a call or for none)."""
    start = 0
    while start < len(prompts):
        end = start + 1
        while end < len(prompts) and end - start < size and (
                not by_images or bool(prompts[end].images) == bool(prompts[start].images)):
            end += 1
        yield start, prompts[start:end]
        start = end


def vision_inputs(processor, batch: list[Prompt], device) -> dict:
    """The processor's tensors for BATCH (left-padded token ids, pixel values and whatever the model takes with them:
    image grids, token types), on DEVICE. The tokenizer adds its special tokens unless the rendered text begins with
    the BOS token, as transformers' own processor apply_chat_template decides (LLaVA's template writes no BOS: its
    tokenizer adds it; Gemma-3's writes it)."""
    images = [p.images for p in batch] if batch[0].images else None
    bos = processor.tokenizer.bos_token
    inputs = processor(text=[p.text for p in batch], images=images, padding=True, return_tensors="pt",
                       add_special_tokens=not (bos is not None and batch[0].text.startswith(bos)))
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}


# ----------------------------------------------------------------------------------------------
# Command line


def _flag(default: Any = None, help: str = "", **meta: Any) -> Any:
    factory = {"default_factory": default} if callable(default) else {"default": default}
    return field(metadata={"help": help, **meta}, **factory)


@dataclass
class ModelArgs:
    """The model to load and how it is placed: the flags `finetune generate`, `serve`, `chat` and `eval` share"""

    model_name_or_path: str | None = _flag(help="Local base model folder or Hub repo id (org/name)",
                                           required=True, aliases=("model",))
    model_revision: str = _flag(default="main", help="Branch, tag or commit of a Hub model.")
    device_map: str | None = _flag(help=f"{', '.join(PRESET_MAPS)}, or a JSON file of module -> device (devices: GPU "
                                        "index, cpu, disk). Default: the whole model on one device.")
    max_memory: str | None = _flag(help="Per-device limits, e.g. cpu=2GiB,disk=20GiB or 0=20GiB,cpu=30GiB. Only the "
                                        "devices listed are used (name disk to allow disk offload).")
    offload_folder: str | None = _flag(help="Folder for weights offloaded to disk (default: a temporary folder).")
    torch_dtype: str = _flag("auto", help="auto, float32, bfloat16, float16.")
    attn_implementation: str = _flag("sdpa", help="Attention kernel: sdpa, eager, flash_attention_2.")
    trust_remote_code: bool = _flag(False, help="Run Python code shipped with the model folder.")
    load_in_8bit: bool = _flag(False, help="Quantize the base to 8-bit (bitsandbytes).")
    load_in_4bit: bool = _flag(False, help="Quantize the base to 4-bit (bitsandbytes).")
    bnb_4bit_quant_type: str = _flag("nf4", help="nf4 or fp4.")
    use_bnb_nested_quant: bool = _flag(False, help="Double quantization for 4-bit.")
    bnb_4bit_compute_dtype: str = _flag("auto", help="auto (the model dtype), float32, bfloat16, float16.")


@dataclass
class GenerateArgs(ModelArgs):
    """What to load, the prompts, and how to decode"""

    adapter: str | None = _flag(help="LoRA adapter folder (from finetune train --use_peft) to attach.")
    prompt: list[str] = _flag(list, help="A prompt.", repeat=True)
    prompts: str | None = _flag(help="JSONL file of prompts: {'prompt': ...}, {'text': ...} or {'messages': [...]} "
                                     "(a vision-language model's may add 'images': [PATH, ...], relative to the file).")
    image: list[str] = _flag(list, help="An image for every --prompt, before its text (repeatable; a vision-language "
                                        "model only).", repeat=True)
    chat: bool = _flag(False, help="Send plain-text prompts through the chat template as a user message.")
    output: str | None = _flag(help="Write JSON lines here (default: stdout).")
    with_ids: bool = _flag(False, help="Add the completion token ids to each output line.")
    batch_size: int = _flag(8, help="Prompts per generate call.")
    max_new_tokens: int = _flag(64, help="Tokens generated per prompt, at most.")
    do_sample: bool = _flag(False, help="Sample instead of greedy decoding.")
    temperature: float = _flag(1.0, help="Sampling temperature.")
    top_p: float = _flag(1.0, help="Nucleus sampling: keep the smallest set of tokens with this much probability.")
    top_k: int = _flag(0, help="Sample from the k most likely tokens (0: all).")
    seed: int = _flag(0, help="Seed for sampling.")


def command():
    from finetune.config.parser import Command

    return Command("finetune generate", {"args": GenerateArgs},
                   description="Generate completions, optionally sharded with a device_map.",
                   epilog=__doc__.split("\n\n", 1)[1])


def model_problems(args: ModelArgs) -> list[str]:
    """The model flags' own problems (dtype, quantization, attention kernel, offload folder), before anything loads."""
    from finetune.config.training import family_problems, writable_problem
    from finetune.models import quant

    problems = []
    if args.torch_dtype not in ("auto", "float32", "bfloat16", "float16"):
        problems.append(f"--torch_dtype: '{args.torch_dtype}' is not one of auto, float32, bfloat16, float16")
    problems += quant.problems(args)
    if args.model_name_or_path and Path(args.model_name_or_path).is_dir():
        problems += family_problems(args)  # an attention kernel the model's family lacks (Gemma-2's sdpa)
    if args.offload_folder and (problem := writable_problem("--offload_folder", args.offload_folder)):
        problems.append(problem)
    return problems


def load_options(args: ModelArgs, adapter: str | None = None) -> LoadOptions:
    """The model flags as load_for_inference takes them; a Hub repo id resolved to its snapshot folder first (before
    any weights are read: the folder is then loaded like any local one)."""
    from finetune.models.hub import HubError, looks_like_repo_id, resolve_model

    if looks_like_repo_id(args.model_name_or_path):
        try:
            args.model_name_or_path = resolve_model(args.model_name_or_path, args.model_revision).folder
        except HubError as e:
            raise GenerationError(str(e)) from None
    return LoadOptions(
        model_name_or_path=args.model_name_or_path, adapter=adapter, device_map=args.device_map,
        max_memory=parse_max_memory(args.max_memory), offload_folder=args.offload_folder, torch_dtype=args.torch_dtype,
        attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code,
        load_in_8bit=args.load_in_8bit, load_in_4bit=args.load_in_4bit, bnb_4bit_quant_type=args.bnb_4bit_quant_type,
        use_bnb_nested_quant=args.use_bnb_nested_quant, bnb_4bit_compute_dtype=args.bnb_4bit_compute_dtype,
    )


def check_args(parsed) -> list[str]:
    """The flags' own problems, all at once (what needs the model or the machine is checked when loading)."""
    args: GenerateArgs = parsed.args
    problems = []
    for key in ("batch_size", "max_new_tokens"):
        if getattr(args, key) < 1:
            problems.append(f"--{key}: must be at least 1, got {getattr(args, key)}")
    problems += model_problems(args)
    if args.do_sample and args.temperature <= 0:
        problems.append(f"--temperature: must be above 0 when sampling (--do_sample), got {args.temperature}; for "
                        "greedy decoding drop --do_sample")
    if args.do_sample and not 0 < args.top_p <= 1:
        problems.append(f"--top_p: must be in (0, 1] when sampling, got {args.top_p}")
    if not args.prompt and not args.prompts:
        problems.append("no prompts: give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    if args.image and not args.prompt:
        problems.append("--image: goes with --prompt (a prompts file names each record's own 'images')")
    for path in args.image:
        if not re.match(r"^[a-z][a-z0-9+.-]*://", path) and not Path(path).is_file():
            problems.append(f"--image {path}: no such file")
    if args.adapter and not Path(args.adapter).is_dir():
        problems.append(f"--adapter {args.adapter}: no such folder")
    if args.prompts and (problem := prompts_file_problem(args.prompts)):
        problems.append(problem)
    from finetune.config.training import writable_problem

    if args.output and (problem := writable_problem("--output", Path(args.output).parent)):
        problems.append(problem)
    if args.output and Path(args.output).is_dir():
        problems.append(f"--output {args.output}: is a folder; give a file name for the JSON lines")
    return problems


def prompts_file_problem(path: str) -> str | None:
    """Checked before the model loads: a prompts file that is missing or not UTF-8 text (named with its line)."""
    p = Path(path)
    if not p.is_file():
        return f"--prompts {path}: no such file"
    raw = p.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        return f"--prompts {path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); save the file as UTF-8"
    return None


def parse_args(argv: list[str] | None = None) -> GenerateArgs:
    """The command line -> GenerateArgs; --help exits 0, problems exit 2 with every one of them."""
    return command().parse_or_exit(argv, check_args).args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _quiet_libraries()
    try:
        run(args)
    except GenerationError as e:
        print(f"finetune generate: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run(args: GenerateArgs) -> list[dict]:
    problems = check_args(SimpleNamespace(args=args))
    if problems:
        raise GenerationError("; ".join(problems))
    opts = load_options(args, args.adapter)
    model, tokenizer, placed = load_for_inference(opts)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    print(describe_device_map(placed, base), file=sys.stderr, flush=True)
    prompts = read_prompts(tokenizer, args.prompt, args.prompts, args.chat, args.image, processor_of(model))

    out = open(args.output, "w") if args.output else sys.stdout

    def emit(result: dict) -> None:
        line = dict(result)
        if not args.with_ids:
            line.pop("completion_ids")
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        out.flush()

    try:
        results = generate(
            model, tokenizer, prompts, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, on_result=emit,
        )
    finally:
        if args.output:
            out.close()
    print(f"generated {len(results)} completion(s); peak RSS {_fmt_bytes(peak_rss_bytes())}", file=sys.stderr, flush=True)
    return results


class _OnceFilter:
    """Let each distinct bitsandbytes CPU notice through once (it logs one line per 8-bit matmul on CPU)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def filter(self, record) -> bool:
        key = str(record.msg)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def _quiet_libraries() -> None:
    import logging

    from finetune import compat

    logger = logging.getLogger(compat.BNB_WARNINGS_LOGGER)
    if not any(isinstance(f, _OnceFilter) for f in logger.filters):
        logger.addFilter(_OnceFilter())


if __name__ == "__main__":
    main()
