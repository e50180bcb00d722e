"""Every place finetune relies on another library's internals, with the upstream versions it was written for.

Each workaround below names the versions it was measured on. `check_versions()` runs when a command starts and
warns, once per package, when an installed version is outside the tested range (TESTED). One workaround refuses
instead of warning: the DeepSpeed NVMe-offload restore (restore_after_load), which reads DeepSpeed's swap files by
their name and layout and, should those change, would resume with wrong Adam moments and no error. Set
FINETUNE_ALLOW_UNTESTED=1 to run it anyway. torch's JIT-extension build lock (guard_extension_builds, torch 2.13 as
DeepSpeed 0.19.8 uses it) is not version-checked: should torch rename that file, the guard finds no lock and
changes nothing.

Also relied on, outside this module: finetune.training.hf_trainer overrides transformers.Trainer's private
`_save_checkpoint`, `_save` and `_load_optimizer_and_scheduler` (covered by the transformers range); and
finetune.training.loss relies on a causal LM's forward calling its output embeddings once on the final hidden
states and computing the loss only when `labels` is given (tests/test_loss.py holds it to transformers' loss); and
finetune.models.attention relies on a model's forward passing the batch's keyword arguments (the collator's
`cu_seq_lens_q/k`, `max_length_q/k`, `seq_bounds`) down to its attention function, on `create_causal_mask` returning
a 4-D mask it is given as it is (its hook skips the mask of a batch with boundaries), and calls transformers' private
`_flash_attention_forward` where flash-attn is installed (all covered by the transformers range; tests/test_attention.py
holds them).

Worked around outside this module, which every entry point's end needs below the compat layer: torch 2.13.0's gloo
worker threads abort a finished rank in CPython 3.11's shutdown (a worker drops the last collective's work, whose
tensors need the GIL, after Py_FinalizeEx began: pthread_exit through a noexcept destructor, std::terminate;
pytorch/pytorch#190489). finetune.process.end_finished_process ends a finished rank without that shutdown; the cause
and the counts are at its comment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from finetune.errors import ResumeError

ALLOW_UNTESTED = "FINETUNE_ALLOW_UNTESTED"


@dataclass(frozen=True)
class Tested:
    spec: str  # a PEP 440 specifier: the versions the workarounds were measured on
    risk: str  # what may misbehave outside it


TESTED: dict[str, Tested] = {
    "deepspeed": Tested(
        ">=0.19.8,<0.20",
        "resuming a DeepSpeed checkpoint (the NVMe-offload restore and the CPU Adam replay call private ZeRO-3 "
        "optimizer methods and read its swap files) and the consolidated ZeRO-3 save of `finetune engine`",
    ),
    "bitsandbytes": Tested(
        ">=0.50,<0.51",
        "4-bit training on CPUs with AVX512-BF16: the guard against bitsandbytes' inference-only weight repacking "
        "(without it LoRA silently stops learning) and the exact-layout comparison when a 4-bit save is verified; "
        "its import deferred to first use (defer_bitsandbytes_import)",
    ),
    "transformers": Tested(
        ">=5.23,<5.25",
        "the Trainer path's checkpoint hooks (private Trainer methods), reloading for verification inside a ZeRO-3 "
        "run, `finetune generate --device_map auto|balanced|sequential`, and the fast chat-template rendering of "
        "data preparation (it calls transformers' private chat-template helpers), and vision-language processors "
        "without torchvision (processors_without_video)",
    ),
    "accelerate": Tested(
        ">=1.15,<1.16",
        "`finetune generate --adapter` on a model with offloaded layers (it rewires accelerate's offload hooks), and "
        "the FSDP2 presets on a machine without GPU (fsdp_on_cpu sets accelerate's distributed type)",
    ),
}


def untested(package: str) -> str | None:
    """The message for `package` if its installed version is outside TESTED, else None (also when not installed)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    tested = TESTED[package]
    try:
        installed = metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
    try:
        inside = Version(installed) in SpecifierSet(tested.spec)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    return (f"{package} {installed} is outside the range finetune was tested with ({package}{tested.spec}); "
            f"what may misbehave: {tested.risk}")


def check_versions(stream=None) -> list[str]:
    """Warn (rank 0 only) about every installed package outside its tested range; returns the messages."""
    messages = [m for m in map(untested, TESTED) if m]
    if messages and os.environ.get("RANK", "0") == "0":
        stream = stream or sys.stderr
        for message in messages:
            print(f"finetune: warning: {message}", file=stream, flush=True)
    return messages


def _refuse_untested(package: str, what: str) -> None:
    message = untested(package)
    if message and os.environ.get(ALLOW_UNTESTED) != "1":
        raise ResumeError(f"{message}. {what} would silently give wrong results if that changed; install a tested "
                          f"version, or set {ALLOW_UNTESTED}=1 to run it anyway")


# ----------------------------------------------------------------------------------------------
# DeepSpeed 0.19.8: what load_checkpoint leaves out.


def restore_after_load(engine, folder: str | Path) -> None:
    """After a DeepSpeed engine loaded `folder`: finish what its load leaves out, so the run continues exactly.

    1. NVMe optimizer offload (zero3_nvme). DeepSpeed 0.19.8's load_checkpoint then only copies the swap files
       back and skips the ZeRO optimizer file, which loses (measured): each group's learning rate (the next step
       ran at the optimizer's initial lr), every Adam step count, the Adam moments of swapped partitions (a fresh
       optimizer does not know their files), and all of any partition under 1 MiB (never swapped: its weights
       and moments live only in zero_pp_rank_*_optim_states.pt). All are restored here. That file is a pickle,
       as every DeepSpeed checkpoint is; it is the user's own checkpoint, which DeepSpeed has just unpickled.
    2. DeepSpeed CPU Adam's own bias-correction state (replay_cpu_adam).
    """
    _restore_nvme_offloaded(engine, Path(folder))
    replay_cpu_adam(engine)


def _restore_nvme_offloaded(engine, folder: Path) -> None:
    import torch
    import torch.distributed as dist

    opt = getattr(engine, "optimizer", None)
    if not getattr(opt, "swap_optimizer", False):
        return
    _refuse_untested("deepspeed", "Restoring NVMe-offloaded optimizer state (it reads DeepSpeed's swap files directly)")
    rank = dist.get_rank(group=opt.dp_process_group)
    files = sorted(folder.rglob(f"zero_pp_rank_{rank}_mp_rank_*_optim_states.pt"))
    if len(files) != 1:
        raise ResumeError(f"{folder}: expected one ZeRO optimizer file for rank {rank}, found {len(files)}")
    saved = torch.load(files[0], map_location="cpu", weights_only=False)["optimizer_state_dict"]
    saved_fp32, saved_states = saved["fp32_flat_groups"], saved["optimizer_state_dict"]["state"]
    # The saved optimizer state is indexed in the order DeepSpeed lists the fp32 sub-groups when it saves.
    opt._set_fp32_optimizer_param_groups()
    try:
        index = {id(p): i for i, p in enumerate(p for g in opt.optimizer.param_groups for p in g["params"])}
    finally:
        opt._clear_fp32_optimizer_param_groups()
    # Hyperparameters of each group as saved (the learning rate of the next step: a scheduler's load_state_dict
    # does not set it on the optimizer).
    for group, saved_group in zip(opt.optimizer.param_groups, saved["optimizer_state_dict"]["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    opt.checkpoint_event_prologue()
    for sub_group, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        state, saved_state = opt.optimizer.state[fp32], saved_states.get(index[id(fp32)], {})
        if opt._swappable_optimizer_subgroup(sub_group):
            _restore_swapped_state(opt, sub_group, fp32, saved_state)
            continue
        with torch.no_grad():
            fp32.data.copy_(saved_fp32[sub_group])
            for key, value in saved_state.items():
                if torch.is_tensor(value) and torch.is_tensor(state.get(key)) and state[key].shape == value.shape:
                    state[key].copy_(value)
                else:
                    state[key] = value.clone() if torch.is_tensor(value) else value
        opt._reassign_or_swap_out_partitioned_parameters(sub_group)  # fp32 master -> the 16-bit partition
    opt.checkpoint_event_epilogue()


def _restore_swapped_state(opt, sub_group: int, fp32, saved_state: dict) -> None:
    """A swapped sub-group: DeepSpeed copied its files back (weights and Adam moments), but a fresh optimizer
    has no state entries for them, so it would swap in the weights only and start the moments at zero. Create
    the entries from the files and let the swapper adopt them (written back unchanged on swap-out)."""
    import torch

    opt._prepare_sub_group(sub_group, set())  # swaps the fp32 weights in
    state = opt.optimizer.state[fp32]
    folder = Path(opt.optimizer_swapper.swap_folder)
    for key, value in saved_state.items():
        if not torch.is_tensor(value):
            state[key] = value  # the step count
            continue
        path = folder / f"{key}-{fp32.ds_id}.tensor.swp"
        if not path.is_file():
            raise ResumeError(f"NVMe offload: {path} is missing; the checkpoint's offloaded_tensors are incomplete")
        # The file holds the tensor's values, padded to the I/O alignment.
        raw = bytearray(path.read_bytes()[: fp32.numel() * value.element_size()])
        state[key] = torch.frombuffer(raw, dtype=value.dtype).view_as(fp32)
    opt._release_sub_group(sub_group, set())  # the swapper now tracks the moments too


def replay_cpu_adam(engine) -> int:
    """Make a resumed DeepSpeedCPUAdam (DeepSpeed 0.19.8) compute the same bias correction as an uninterrupted run.

    The C++ kernel keeps beta1^t, beta2^t itself and advances them by one multiplication per step; a
    loaded optimizer restarts that state at step 0, and its first step computes them with pow() instead,
    which differs in the last float bits (enough to drift past 1e-6 in a few steps). Replaying the
    increments 1..t on empty tensors rebuilds exactly the uninterrupted products and changes no weight.
    Returns the step replayed to (0 when there is no CPU Adam).
    """
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    optimizer = getattr(engine, "optimizer", None)
    while optimizer is not None and not isinstance(optimizer, DeepSpeedCPUAdam):
        optimizer = getattr(optimizer, "optimizer", None)
    if optimizer is None:
        return 0
    steps = [int(s["step"]) for s in optimizer.state.values() if isinstance(s, dict) and "step" in s]
    step = max(steps) if steps else int(getattr(engine, "global_steps", 0))
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    empty = torch.empty(0, dtype=torch.float32)
    for t in range(1, step + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, t, group["lr"], beta1, beta2, group["eps"],
                                          group["weight_decay"], group["bias_correction"], empty, empty, empty, empty)
    return step


def zero3_consolidated_state_dict(engine, *, exclude_frozen_parameters: bool):
    """The whole 16-bit state dict of a ZeRO-3 engine on rank 0 (None elsewhere); collective. DeepSpeed 0.19.8's
    public save_16bit_model writes a file; this private method is what it calls to build the dict."""
    return engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)


def retie_state_dict(model, state_dict: dict) -> dict:
    """Point the tied aliases of `model` (lm_head.weight on the embeddings) at the same tensor again in a state dict
    that lost the tie. accelerate 1.15's get_state_dict clones every tensor under DeepSpeed ZeRO-1/2
    (clone_tensors_for_torch_save), so transformers 5.23's save_pretrained, which finds ties by shared storage,
    would write lm_head.weight as a tensor of its own: a bigger file that reloads untied."""
    first: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in first and name in state_dict and first[key] in state_dict:
            state_dict[name] = state_dict[first[key]]
        first.setdefault(key, name)
    return state_dict


# ----------------------------------------------------------------------------------------------
# bitsandbytes 0.50.2: CPU repacking of 4-bit weights.


def _is_cpu_packed(module) -> bool:
    state = getattr(module.weight, "quant_state", None)
    return bool(state is not None and getattr(state, "packing_format_for_cpu", False))


def _unpack_4bit(module) -> None:
    """Back to the standard 4-bit layout: exactly, from the copy kept when bitsandbytes packed the weight; otherwise
    with bitsandbytes' inverse, whose scales stay in bf16 (and, for non-nested weights, in the packed order:
    fixed here)."""
    import torch

    stash = getattr(module, "_finetune_4bit_original", None)
    if stash is not None:
        data, state = stash
        module._finetune_4bit_original = None
    else:
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        nested = getattr(module.weight.quant_state, "original_nested", False)
        data, state = _convert_weight_packed_for_cpu_inverse(module.weight.data, module.weight.quant_state)
        if not nested and state.absmax.dim() == 2:
            state.absmax = state.absmax.T.reshape(-1).to(torch.float32)
    module.weight.data = data
    module.weight.quant_state = state
    if getattr(module, "quant_state", None) is not None:
        module.quant_state = state


def _guard_pre_forward(module, args):
    import torch

    x = args[0] if args else None
    needs_grad = module.training or (torch.is_grad_enabled() and getattr(x, "requires_grad", False))
    if _is_cpu_packed(module):
        # The packed CPU layout is served by bitsandbytes' gemv_4bit, which has no autograd kernel: gradients stop at
        # this layer (LoRA stops learning, with only a UserWarning). Restore the standard layout first.
        if needs_grad:
            _unpack_4bit(module)
    elif (
        not needs_grad
        and getattr(module, "support_avx512bf16_for_cpu", False)
        and getattr(x, "device", None) is not None
        and x.device.type == "cpu"
    ):
        # bitsandbytes is about to pack this weight (it mutates the quant state in place): keep the original.
        import copy

        module._finetune_4bit_original = (module.weight.data, copy.copy(module.weight.quant_state))


def guard_4bit_training(model) -> int:
    """Guard bitsandbytes' 4-bit CPU repacking (bitsandbytes 0.50): on CPUs with AVX512-BF16, the first no-grad
    forward in eval mode (one `generate` is enough) repacks every Linear4bit weight into an inference-only layout,
    and from then on gradients no longer flow through the base layers, so LoRA stops learning.

    For a model that will be trained: turn the repacking off (bitsandbytes' own per-module switch), and, should a
    weight get packed all the same (the switch turned back on, weights packed before this call), restore the
    standard layout before any forward that needs gradients (exactly, from a copy kept at packing time).
    Idempotent; returns the number of 4-bit layers guarded.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        count += 1
        if _is_cpu_packed(module):
            _unpack_4bit(module)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
        if getattr(module, "_finetune_4bit_guard", None) is None:
            module._finetune_4bit_guard = module.register_forward_pre_hook(_guard_pre_forward)
    return count


def same_4bit_layout(*models) -> None:
    """Before comparing 4-bit models' logits: keep them on the layout training uses. On AVX512-BF16 CPUs
    bitsandbytes 0.50 serves eval-mode 4-bit forwards from a repacked bf16 layout (up to ~3e-2 off the fp32
    path) unless guarded."""
    for model in models:
        guard_4bit_training(model)


# bitsandbytes 0.50.2, on a CPU with AVX512-BF16, tries at import to fetch a 4-bit GEMM kernel from the Hub through the
# `kernels` package and logs "Failed to load CPU gemm_4bit_forward from kernels-community" on every process where it is
# not installed (installing it would mean downloading code at run time). Its own CPU kernel is used instead.
BNB_CPU_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"


def quiet_bnb_cpu_kernel_notice() -> None:
    import logging

    logging.getLogger(BNB_CPU_KERNEL_LOGGER).setLevel(logging.ERROR)


# bitsandbytes logs its per-call CPU warnings under this (private) module's logger.
BNB_WARNINGS_LOGGER = "bitsandbytes.autograd._functions"


# peft 0.21 imports bitsandbytes at `import peft` (peft/helpers.py), and transformers 5.24 imports peft with its
# TrainingArguments: every process paid bitsandbytes 0.50's import (it compiles its default ops with torch.compile
# at import; 1.5-2 s of a 7-9 s start on 2 CPU cores) though only 4-bit/8-bit models and bnb optimizers use it.
# Until then `bitsandbytes` is a stand-in module: the import succeeds, find_spec and metadata still see the package,
# and the first attribute read (bnb.nn, bnb.optim, __version__, a submodule import reading __path__) imports it for
# real. __name__, __file__ and __spec__ are answered without the import, since torch and inspect read them while
# scanning every loaded module.


class _Deferred(type(sys)):
    def __getattr__(self, name: str):
        return getattr(_import_deferred(self), name)


def _import_deferred(stand_in):
    import importlib

    name = stand_in.__name__
    if sys.modules.get(name) is stand_in:
        del sys.modules[name]
    real = importlib.import_module(name)
    stand_in.__dict__.update(real.__dict__)  # later reads through the stand-in (peft's `bnb`) find it here
    return real


def defer_bitsandbytes_import() -> bool:
    """Install the stand-in unless bitsandbytes is already imported or not installed; True if installed."""
    import importlib.util

    if "bitsandbytes" in sys.modules:
        return False
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or spec.origin is None:
        return False
    stand_in = _Deferred("bitsandbytes")
    stand_in.__file__, stand_in.__spec__, stand_in.__loader__ = spec.origin, spec, spec.loader
    stand_in.__package__ = "bitsandbytes"
    sys.modules["bitsandbytes"] = stand_in
    return True


# ----------------------------------------------------------------------------------------------
# transformers 5.23-5.24 and accelerate 1.15.


def fill_zero_sizes(plugin, model) -> None:
    """accelerate 1.15's prepare() fills a DeepSpeed config's "auto" ZeRO sizes (reduce_bucket_size,
    stage3_prefetch_bucket_size, stage3_param_persistence_threshold) from model.config.hidden_size or hidden_sizes and
    raises on a config with neither: a multimodal checkpoint (Gemma3ForConditionalGeneration) keeps its sizes in
    text_config, which transformers 5.24's Trainer reads (HfTrainerDeepSpeedConfig.trainer_config_finalize). The
    values accelerate would set, from the text config, before prepare(); a config with its own size is left to it."""
    config = getattr(model, "config", None)
    if config is None or hasattr(config, "hidden_size") or hasattr(config, "hidden_sizes"):
        return
    hidden = getattr(config.get_text_config(), "hidden_size", None)
    if hidden is None:
        return
    for key, value in (("zero_optimization.reduce_bucket_size", hidden * hidden),
                       ("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
                       ("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)):
        if plugin.is_auto(key):
            plugin.fill_match(key, must_match=False, **{key: value})


# Qwen2.5-VL's and Qwen3-VL's *ForConditionalGeneration in transformers 5.23-5.24 say accepts_loss_kwargs = False
# (copied from Gemma-3's inner model, transformers #37208), yet their forward hands **kwargs, num_items_in_batch
# among them, to the loss function. The Trainer then averages each micro-batch's mean over gradient accumulation
# (and ranks) instead of taking the global batch's token mean: a tiny Qwen2.5-VL's first step was 4.5e-3 off in
# 2 x 2 micro-batches, exact in one of 4. The models whose forward passes the count on are told so.
LOSS_KWARGS_MISDECLARED = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")


def declare_loss_kwargs(model) -> bool:
    """The model's accepts_loss_kwargs set to True where transformers misdeclares it; True when it was."""
    import inspect

    if type(model).__name__ not in LOSS_KWARGS_MISDECLARED or getattr(model, "accepts_loss_kwargs", True):
        return False
    kinds = [p.kind for p in inspect.signature(type(model).forward).parameters.values()]
    if inspect.Parameter.VAR_KEYWORD not in kinds:  # a release that no longer passes kwargs on: left as declared
        return False
    model.accepts_loss_kwargs = True
    return True


# transformers 5.23-5.24's Trainer resumes a full model's checkpoint with model.load_state_dict(state_dict,
# strict=False) on the file save_pretrained wrote, whose names are the checkpoint format's (revert_weight_conversion):
# for a model with a conversion mapping (the vision-language models: language_model.model.* on disk,
# model.language_model.* in the module) no name matches, nothing is loaded, and training resumes from the base
# weights with a warning only (a tiny Gemma-3's resumed step 3 was its step 1's loss). The file is loaded again here
# under the module's names, strictly.
def reload_converted_checkpoint(model, folder) -> bool:
    """Load `folder`'s model.safetensors (or its shards) into `model` by the module's own names where save_pretrained
    renamed them; True when it did. ValueError naming the weights it could not place."""
    import json as _json

    from safetensors.torch import load_file
    from transformers.core_model_loading import revert_weight_conversion

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(_json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"] if (folder / "model.safetensors").is_file() else [])
    if not files:
        return False
    runtime = model.state_dict(keep_vars=True)  # the parameters themselves: a tied pair is one object
    ids = {}
    for name, tensor in runtime.items():
        ids.setdefault(id(tensor), name)
    names = {saved: ids[id(t)] for saved, t in revert_weight_conversion(model, dict(runtime)).items() if id(t) in ids}
    if all(saved == name for saved, name in names.items()):
        return False  # saved under the module's names: the Trainer's own load was right
    state = {}
    for f in files:
        state.update(load_file(str(folder / f), device="cpu"))
    unplaced = sorted(k for k in state if k not in names)
    if unplaced:
        raise ValueError(f"{folder}: {len(unplaced)} saved weights have no place in the model ({', '.join(unplaced[:3])})")
    result = model.load_state_dict({names[k]: v for k, v in state.items()}, strict=False)
    loaded = {id(runtime[names[k]]) for k in state}  # a tied weight (the LM head) is loaded through its twin
    missing = [k for k in result.missing_keys if k in runtime and id(runtime[k]) not in loaded]
    if missing:
        raise ValueError(f"{folder}: {len(missing)} of the model's weights are not in the checkpoint ({', '.join(missing[:3])})")
    return True


@contextmanager
def outside_zero3():
    """Reload as a plain model even inside a ZeRO-3 run: with the Trainer's DeepSpeed config registered,
    from_pretrained would partition the reloaded copy with collectives that only rank 0 runs (a hang, or gloo's
    "Received data size doesn't match expected size"). transformers keeps that registration in a private global."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def preset_device_map(model, spec: str, max_memory: dict | None) -> dict:
    """transformers' own resolution of a device_map preset (auto, balanced, balanced_low_0, sequential) to an
    explicit map: the private function from_pretrained uses, so the map printed is the map from_pretrained makes."""
    from transformers.integrations.accelerate import _get_device_map

    return dict(_get_device_map(model, spec, max_memory, None))


def offload_hooks(model):
    """(module name, module, accelerate AlignDevicesHook) for every module whose weights are fetched at forward
    time. accelerate keeps a module's hook in its `_hf_hook` attribute (a SequentialHook holds several)."""
    out = []
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            if getattr(h, "offload", False) and getattr(h, "weights_map", None) is not None:
                out.append((name, module, h))
    return out


# ----------------------------------------------------------------------------------------------
# transformers 5.23-5.24 without torchvision: a vision-language processor with a video processor (Qwen2.5-VL,
# Qwen3-VL, SmolVLM) cannot be built or loaded. Its video processor class needs torchvision (the name resolves to a
# dummy), and ProcessorMixin.check_argument_for_proper_class, looking for the base class VideoProcessorMixin, reads
# VIDEO_PROCESSOR_MAPPING._extra_content from that dummy: "type object 'VIDEO_PROCESSOR_MAPPING' has no attribute
# '_extra_content'". The image processors fall back to their ...Pil classes by themselves. finetune passes images
# only, so without torchvision a processor is built without its video processor: ProcessorMixin.get_attributes
# leaves video_processor out (the constructors pass their video_processor on positionally, which then goes
# unused), and from_args_and_dict gives a constructor that requires one (SmolVLMProcessor) None. A processor saved
# so has no video processor in processor_config.json; transformers with torchvision loads the default one of its
# model type beside it. Where torchvision imports, nothing is changed.


class _NoVideoProcessor:
    """What a processor built without torchvision holds as its video processor: no defaults (SmolVLMProcessor's
    apply_chat_template reads num_frames and fps, and passes them on unused when there is no video); anything else
    says why there is none."""

    num_frames = None
    fps = None

    def __getattr__(self, name):
        raise AttributeError(f"video_processor.{name}: this processor has no video processor (torchvision is not "
                             "installed; finetune passes images only)")

    def __call__(self, *args, **kwargs):
        raise RuntimeError("videos need the model's video processor, which needs torchvision (not installed)")


def processors_without_video() -> bool:
    """Build and load vision-language processors without torchvision (above): True where the patch is in place
    (torchvision missing), False where torchvision is installed and processors need no help."""
    import inspect

    from transformers import processing_utils
    from transformers.utils import is_torchvision_available

    mixin = processing_utils.ProcessorMixin
    if is_torchvision_available():
        return False
    if getattr(mixin, "_finetune_without_video", False):
        return True
    get_attributes = mixin.get_attributes.__func__
    from_args_and_dict = mixin.from_args_and_dict.__func__

    def attributes(cls):
        return [a for a in get_attributes(cls) if a != "video_processor"]

    def from_args(cls, args, processor_dict, **kwargs):
        if "video_processor" in inspect.signature(cls.__init__).parameters:
            kwargs.setdefault("video_processor", None)
        return from_args_and_dict(cls, args, processor_dict, **kwargs)

    init = mixin.__init__

    def init_without_video(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if "video_processor" in get_attributes(type(self)) and getattr(self, "video_processor", None) is None:
            self.video_processor = _NoVideoProcessor()  # read for its defaults (SmolVLM's apply_chat_template)

    to_dict = mixin.to_dict

    def to_dict_without_video(self):
        out = to_dict(self)
        if isinstance(out.get("video_processor"), _NoVideoProcessor):
            del out["video_processor"]  # nothing to save: the folder keeps no video processor
        return out

    mixin.get_attributes = classmethod(attributes)
    mixin.from_args_and_dict = classmethod(from_args)
    mixin.__init__ = init_without_video
    mixin.to_dict = to_dict_without_video
    mixin._finetune_without_video = True
    return True


def keep_direct_tensors_in_memory(model) -> list[str]:
    """accelerate 1.15's disk offload loads a module's own tensors when its forward runs (AlignDevicesHook with
    offload, place_submodules off). transformers 5.24's generate reads some of a vision-language model's outside any
    forward: its image-feature pre-pass (_prepare_multimodal_encoder_kwargs_for_generation) calls get_image_features
    directly, and LLaVA-NeXT's reads model.image_newline, a parameter of the container module, still on the meta
    device there ("Cannot copy out of meta tensor"). Those tensors of a module with children (a few vectors) are
    loaded once into memory on the hook's device and the hook stops offloading them. Their names, for the log."""
    from accelerate.utils import set_module_tensor_to_device

    kept = []
    for name, module, hook in offload_hooks(model):
        # A container (a child with weights of its own), not a leaf with an activation child (a MoE's experts).
        if hook.place_submodules or not any(next(c.parameters(), None) is not None for c in module.children()):
            continue
        own = [n for n, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
               if t.device.type == "meta"]
        if not own:
            continue
        device = hook.execution_device if hook.execution_device is not None else "cpu"
        for tensor in own:
            set_module_tensor_to_device(module, tensor, device, value=hook.weights_map[tensor])
            kept.append(f"{name}.{tensor}" if name else tensor)
        hook.offload = False  # its only tensors are the ones now in memory
    return kept


# ----------------------------------------------------------------------------------------------
# transformers 5.23-5.24 (transformers.utils.chat_template_utils) and jinja2 3.1 (jinja2.runtime): a chat template
# rendered without apply_chat_template's per-call work, for data preparation (finetune.data.prepare.ChatRenderer;
# tests/test_formats.py compares it with apply_chat_template). Where transformers lacks these helpers, ChatRenderer
# calls apply_chat_template itself.


def chat_template_helpers():
    """(compile, alias_reasoning_fields, reasoning field names, plain_template_data): the private helpers
    apply_chat_template renders with, or None where this transformers has not all of them."""
    try:
        from transformers.utils.chat_template_utils import (_REASONING_FIELDS, _alias_reasoning_fields,
                                                            _compile_jinja_template, _plain_template_data)
    except ImportError:
        return None
    return _compile_jinja_template, _alias_reasoning_fields, frozenset(_REASONING_FIELDS), _plain_template_data


def template_pieces(template, template_globals: dict, merged: dict):
    """The text pieces a compiled jinja2 template yields, given its globals as a plain dict and `merged`, the globals
    updated with the variables: what Template.render concatenates (jinja2's new_context and the template's
    root_render_func), without the merge of its ChainMap of globals that Template.render does on every call (about
    the cost of rendering a two-exchange chat)."""
    from jinja2.runtime import new_context

    context = new_context(template.environment, template.name, template.blocks, merged, True, template_globals)
    return template.root_render_func(context)


def render_template(template, template_globals: dict, merged: dict) -> str:
    """template.render(variables), from template_pieces."""
    if template.environment.is_async:
        return template.render(merged)  # the globals given again as variables: the same values
    try:
        return template.environment.concat(template_pieces(template, template_globals, merged))
    except Exception:
        template.environment.handle_exception()  # raises the error, its traceback pointing into the template


# ----------------------------------------------------------------------------------------------
# torch 2.13 (torch.utils.cpp_extension, FileBaton), as DeepSpeed 0.19.8 uses it to JIT-build its ops (cpu_adam,
# deepspeed_shm_comm, ...): the build is guarded by an empty file `lock` in the op's build folder, created with
# O_EXCL and removed when the build ends; every later load of the op waits while that file exists, polling
# forever and printing nothing. A build that was killed (Ctrl-C, `timeout`, kill -9) leaves it behind, and every
# later DeepSpeed run on the machine sleeps with no output. And all virtualenvs share ~/.cache/torch_extensions,
# so two of them rebuild each other's ops (their build files differ in include paths) on every switch.
#
# Here: (1) each virtualenv gets its own extensions folder (unless TORCH_EXTENSIONS_DIR is set); (2) every build
# or load of an op runs under a kernel file lock (flock) beside its folder, which dies with its holder and records
# who holds it, so a process that waits says for whom; (3) under that lock, a `lock` file that no process has
# open and no compiler is working in is a dead build's: it is removed, with a message, and the op is built again;
# (4) the ops are compiled without debug information (without_debug_info).

BUILD_WAIT_REPORT = 30.0  # seconds: how long any wait here stays silent


def extensions_dir() -> Path:
    """This virtualenv's folder for torch's JIT-built extensions (TORCH_EXTENSIONS_DIR if set)."""
    import hashlib

    import torch

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    accelerator = (f"rocm{torch.version.hip}" if torch.version.hip else
                   f"cu{torch.version.cuda}" if torch.version.cuda else "cpu").replace(".", "")
    venv = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}-venv{venv}"


def guard_extension_builds() -> None:
    """Point TORCH_EXTENSIONS_DIR at this virtualenv's folder and wrap torch.utils.cpp_extension.load (which
    DeepSpeed's OpBuilder.jit_load calls at each op's first use) in build_lock. Idempotent."""
    import torch.utils.cpp_extension as ext

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    if getattr(ext.load, "_finetune_guarded", False):
        return
    original = ext.load

    def load(name, *args, **kwargs):
        if kwargs.get("extra_cflags"):
            kwargs["extra_cflags"] = without_debug_info(kwargs["extra_cflags"])
        with build_lock(name):
            return original(name, *args, **kwargs)

    load._finetune_guarded = True
    load.__wrapped__ = original
    ext.load = load


def without_debug_info(cflags: list[str]) -> list[str]:
    """DeepSpeed 0.19.8 compiles its CPU ops with -g (OpBuilder.cxx_args): debug information for every template of
    torch's headers, which no user reads, costs a quarter of the compile (one async_io source: 41 s with -g, 31 s
    without, on 2 cores; a cold build of cpu_adam, shm_comm and async_io took 634 s of CPU).
    The same flags with -g0 last."""
    return [f for f in cflags if f != "-g"] + ["-g0"]


def cache_cpu_info() -> None:
    """py-cpuinfo 9.0's get_cpu_info() starts two Python processes on every call (0.6 s of CPU, 1.4 s of wall
    on 2 busy cores), and DeepSpeed 0.19.8 calls it twice for every op it loads (OpBuilder.cpu_arch and simd_width,
    for the compile flags, built or not) and again in DeepSpeedCPUAdam: several calls per rank. A process's CPU does
    not change: here it is asked once per process, and each caller gets its own copy. Idempotent."""
    import copy
    import functools

    try:
        import cpuinfo
        import cpuinfo.cpuinfo as impl
    except ImportError:  # DeepSpeed then falls back to lscpu
        return
    if getattr(cpuinfo.get_cpu_info, "_finetune_cached", False):
        return
    once = functools.cache(impl.get_cpu_info)

    def get_cpu_info():
        return copy.deepcopy(once())

    get_cpu_info._finetune_cached = True
    get_cpu_info.__wrapped__ = impl.get_cpu_info
    cpuinfo.get_cpu_info = impl.get_cpu_info = get_cpu_info


def _holder_text(guard: Path) -> str:
    try:
        info = json.loads(guard.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "a process that recorded no details"
    return f"pid {info.get('pid')} on {info.get('host')} ({info.get('command', '?')}, since {info.get('since', '?')})"


@contextmanager
def build_lock(name: str, *, log=None, report_after: float = BUILD_WAIT_REPORT):
    """Hold the kernel lock of extension `name`'s build folder, then clear a dead build's `lock` file (see above)."""
    import fcntl
    import socket
    import time

    from torch.utils.cpp_extension import _get_build_directory

    log = log or (lambda message: print(f"finetune: {message}", file=sys.stderr, flush=True))
    folder = Path(_get_build_directory(name, verbose=False))
    guard = folder.parent / f".{folder.name}.finetune-lock"
    fd = os.open(guard, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, next_report = time.monotonic(), report_after
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= next_report:
                    log(f"waiting {waited:.0f} s for the build lock {guard} of the {name} op, held by "
                        f"{_holder_text(guard)}; it is building or loading {folder}")
                    next_report += 60
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%H:%M:%S"),
                                  "command": " ".join(sys.argv[:2])[:200]}).encode(), 0)
        _clear_dead_baton(folder / "lock", name, log, report_after)
        yield
    finally:
        os.close(fd)  # releases the flock


def _baton_users(lock: Path, folder: Path) -> list[str]:
    """Processes (of any program) that hold `lock` open, or work inside `folder` (ninja, the compiler)."""
    import psutil

    try:
        inode = os.stat(lock).st_ino
    except FileNotFoundError:
        return []
    users, me, folder = [], os.getpid(), os.path.realpath(folder)
    for p in psutil.process_iter(["pid", "cwd", "cmdline"]):
        if p.pid == me:
            continue
        try:
            cwd = p.info.get("cwd") or ""
            holds = any(f.path.endswith(os.sep + lock.name) and _same_inode(f.path, inode) for f in p.open_files())
        except psutil.Error:
            continue
        if holds or cwd == folder or cwd.startswith(folder + os.sep):
            users.append(f"pid {p.pid} ({' '.join((p.info.get('cmdline') or [])[:3])[:120]})")
    return users


def _same_inode(path: str, inode: int) -> bool:
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def _clear_dead_baton(lock: Path, name: str, log, report_after: float) -> None:
    """Under build_lock no finetune process builds `name`. A `lock` file left in its folder then belongs to another
    program's build (wait for it, saying so) or to a dead one (remove it: the op is then built again)."""
    import time

    start, next_report = time.monotonic(), report_after
    while lock.exists():
        users = _baton_users(lock, lock.parent)
        if not users:
            try:
                lock.unlink()
            except FileNotFoundError:
                return
            log(f"removed the stale build lock {lock}: no process holds it or works in its folder (a build of the "
                f"{name} op was interrupted); building or loading {name} now")
            return
        waited = time.monotonic() - start
        if waited >= next_report:
            log(f"waiting {waited:.0f} s for the build lock {lock} of the {name} op, held by {', '.join(users)}")
            next_report += 60
        time.sleep(1.0)


@contextmanager
def quiet_checkpointing_alias():
    """peft 0.21 asks the model for `is_gradient_checkpointing` (get_peft_model, prepare_model_for_kbit_training),
    a name transformers 5.23 deprecated with a FutureWarning the user cannot act on. Silenced for those calls only."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def quiet_collective_deprecations() -> None:
    """torch 2.13 deprecates `all_gather_into_tensor` and `reduce_scatter_tensor` (FutureWarning, once per call site
    and rank), which DeepSpeed 0.19.8's ZeRO-1/2/3 call inside every step; nothing a user can act on. Silenced by
    message for this process; other FutureWarnings still show."""
    import warnings

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=f"`torch.distributed.{name}` is deprecated", category=FutureWarning)


def default_deepspeed_accelerator() -> None:
    """DeepSpeed 0.19 warns at import, on every rank, when it finds no accelerator and falls back to its CPU one
    ("Setting accelerator to CPU"). On a machine with none of the devices it looks for, name the CPU accelerator
    (DS_ACCELERATOR=cpu, DeepSpeed's own setting): the same choice, without the warning. A user's value is kept.
    Decided just before DeepSpeed is first imported: the check imports torch, which a command stopping at a flag
    mistake never needs."""
    if "DS_ACCELERATOR" not in os.environ:
        before_deepspeed(_choose_deepspeed_accelerator)


def before_deepspeed(action: Callable[[], None]) -> None:
    """Run `action` once, just before DeepSpeed is first imported or looked for (transformers and accelerate look
    for it as they are imported), or now if it has been imported."""
    if "deepspeed" in sys.modules:
        action()
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _BeforeDeepSpeed)), None)
    if finder is None:
        finder = _BeforeDeepSpeed()
        sys.meta_path.insert(0, finder)
    if action not in finder.actions:
        finder.actions.append(action)


class _BeforeDeepSpeed:
    """A meta path finder that finds nothing: it runs its actions at the first look-up of `deepspeed`."""

    def __init__(self):
        self.actions: list[Callable[[], None]] = []

    def find_spec(self, name, path=None, target=None):
        if name == "deepspeed" and self in sys.meta_path:
            sys.meta_path.remove(self)
            for action in self.actions:
                action()
        return None


# deepspeed 0.19.8: deepspeed/autotuning/autotuner.py imports mlflow at module level when it is installed (for the
# autotuner's run tracking, which finetune never starts), and `import deepspeed` imports the autotuner. With
# mlflow-skinny installed (the trackers extra) every process importing DeepSpeed paid for mlflow's import: 1.4 of a
# 1-step run's 20 s on 2 loaded cores, in every rank of every run, DDP ones too (transformers' Trainer imports
# DeepSpeed when it is installed). While DeepSpeed itself is imported, mlflow reads as not installed; `--report_to
# mlflow` imports it afterwards as usual.

def deepspeed_import_without_mlflow() -> None:
    """Install (once) the finder that imports DeepSpeed with mlflow hidden."""
    import importlib.machinery

    if "deepspeed" in sys.modules or any(isinstance(f, _DeepSpeedWithoutMlflow) for f in sys.meta_path):
        return
    # Just before the path finder, which would find DeepSpeed itself; after any finder placed first (before_deepspeed).
    where = next((i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder), len(sys.meta_path))
    sys.meta_path.insert(where, _DeepSpeedWithoutMlflow())


class _DeepSpeedWithoutMlflow:
    """A meta path finder for `deepspeed` alone: the path finder's spec, its loader wrapped (_WithoutMlflow)."""

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery

        if name != "deepspeed" or "mlflow" in sys.modules or "deepspeed" in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithoutMlflow(spec.loader)
        return spec


class _WithoutMlflow:
    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # is_package, get_resource_reader, ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        hidden = "mlflow" not in sys.modules
        if hidden:
            sys.modules["mlflow"] = None  # `import mlflow` raises ImportError, which the autotuner catches
        try:
            self.loader.exec_module(module)
        finally:
            if hidden and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
                del sys.modules["mlflow"]
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader


deepspeed_import_without_mlflow()  # at import: whichever module of finetune imports DeepSpeed first


def _choose_deepspeed_accelerator() -> None:
    import importlib.util

    if "DS_ACCELERATOR" in os.environ or importlib.util.find_spec("deepspeed") is None:
        return
    import torch

    others = ("intel_extension_for_pytorch", "torch_npu", "torch_mlu", "torch_sdaa", "habana_frameworks")
    if torch.cuda.is_available() or torch.backends.mps.is_available() or any(
            importlib.util.find_spec(name) is not None for name in others):
        return
    os.environ["DS_ACCELERATOR"] = "cpu"



# ----------------------------------------------------------------------------------------------
# transformers 5.24: a mixture-of-experts model (Mixtral, Qwen3-MoE) whose config has output_router_logits=True (as
# training with the router's auxiliary loss saves it) computes that loss in every forward, from the router logits
# and the attention mask; decoding with a cache hands it one new token's router logits against the whole mask, and a
# padded batch fails ("The size of tensor a (2) must match the size of tensor b (28)"). Sampling never needs that
# loss: every generating forward asks for no router logits.

def generation_kwargs(model) -> dict[str, Any]:
    """Extra keyword arguments for a forward (or generate) that samples from `model`."""
    config = getattr(model, "config", None)
    return {"output_router_logits": False} if getattr(config, "output_router_logits", False) else {}


# ----------------------------------------------------------------------------------------------
# datasets 5.2 (pyarrow 26) reads a data set's Arrow files through memory maps: every page a map over the whole data
# set reads stays in the process's RSS as a clean file page until the process ends or memory runs short (1M
# conversations: RSS +500 MB of source text by the end of tokenization, its anonymous memory flat). Dropping our
# page-table entries for those files (madvise MADV_DONTNEED) every few batches keeps RSS bounded by the batch; the
# pages stay in the page cache, and a later read maps them again. Linux only (elsewhere: nothing done).

MADV_DONTNEED = 4


def release_mapped_pages(files) -> int:
    """Drop this process's resident pages of read-only memory maps of `files` (paths); returns the bytes of the
    mappings released (0 where /proc/self/maps cannot be read)."""
    import ctypes

    wanted = {str(f) for f in files}
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    released = 0
    for line in lines:
        parts = line.split(maxsplit=5)
        # Read-only only: MADV_DONTNEED would discard a private mapping's written pages.
        if len(parts) == 6 and parts[5] in wanted and "w" not in parts[1]:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if libc.madvise(start, end - start, MADV_DONTNEED) == 0:
                released += end - start
    return released


# ----------------------------------------------------------------------------------------------
# DeepSpeed 0.19.8 on CPU: when every rank is on one machine (LOCAL_SIZE == world size), its shm_comm op creates
# one 66 MiB POSIX shared-memory buffer per rank (/dev/shm/deepspeed_allreduce_buffer_UID_ADDR_PORT_RANK) and never
# unlinks it (shm.cpp's shared_close is never called): every such run, finished or killed, leaves world x 66 MiB of
# RAM in /dev/shm until reboot (188 buffers, 13 GB, after one day of this project's tests). Once every rank has
# mapped every other rank's buffer (shm_initialize returns only then; a barrier after it), the names can go: the
# mappings live on until the processes end, however they end.


SHM_DIR, SHM_BUFFER = Path("/dev/shm"), "deepspeed_allreduce_buffer"  # shm.cpp's SHM_BUFFER_NAME


# A job killed before that barrier (during start-up) still leaves its buffers: local rank 0 of the next job removes
# the ones no process maps any more (sweep_stale_shm_buffers).
STALE_AFTER_S = 120  # younger buffers may belong to a job still starting (created, not yet mapped)


def sweep_stale_shm_buffers(min_age: float = STALE_AFTER_S) -> list[str]:
    """Unlink this user's DeepSpeed shm buffers that no process maps and that are older than `min_age` seconds;
    returns their names. A buffer another job still uses is mapped by its ranks (its name is in their /proc/PID/maps)."""
    now, uid = time.time(), os.getuid()
    candidates = []
    for path in SHM_DIR.glob(f"{SHM_BUFFER}_{uid}_*"):
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_uid == uid and now - st.st_mtime > min_age:
            candidates.append(path)
    if not candidates:
        return []
    names = {str(p) for p in candidates}
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's process (unlinking a name leaves existing mappings intact)
            continue
        names -= {n for n in names if n in text}
        if not names:
            return []
    removed = []
    for name in sorted(names):
        try:
            size = Path(name).stat().st_size
            Path(name).unlink()
        except OSError:
            continue
        removed.append(f"{Path(name).name} ({size / 2**20:.0f} MiB)")
    return removed


def init_deepspeed_distributed() -> None:
    """deepspeed.init_distributed, then unlink this rank's shared-memory buffer name (see above)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    if os.environ.get("LOCAL_RANK", "0") == "0" and (removed := sweep_stale_shm_buffers()):
        print(f"finetune: removed {len(removed)} DeepSpeed shared-memory buffer(s) that killed jobs left in "
              f"{SHM_DIR} (mapped by no process): {', '.join(removed)}", file=sys.stderr, flush=True)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    from deepspeed.comm import comm as ds_comm

    world = dist.get_world_size()
    if getattr(ds_comm.cdb, "shm_comm_op", None) is None or os.environ.get("LOCAL_SIZE") != str(world):
        return  # no buffers were made: the same answer on every rank (one launcher's environment)
    dist.barrier()
    shm_buffer_path(dist.get_rank()).unlink(missing_ok=True)


def shm_buffer_path(rank: int, addr: str | None = None, port: str | None = None) -> Path:
    """The file DeepSpeed's shm_comm op makes for a rank of the job at addr:port (default MASTER_ADDR:MASTER_PORT)."""
    addr = os.environ.get("MASTER_ADDR", "") if addr is None else addr
    port = os.environ.get("MASTER_PORT", "") if port is None else port
    return SHM_DIR / f"{SHM_BUFFER}_{os.getuid()}_{addr}_{port}_{rank}"


# ----------------------------------------------------------------------------------------------
# accelerate 1.15: AcceleratorState takes an fsdp_plugin only on a GPU-type distributed type (MULTI_GPU, MULTI_XPU,
# ...); on CPU processes (MULTI_CPU, gloo) it silently drops the plugin and trains plain DDP; and its CPU offload
# policy pins memory, which fails without a GPU ("Cannot access accelerator device"). torch's fully_shard
# itself runs on CPU with gloo (a 2-process run equals one process to 1e-6: tests/test_fsdp.py). fsdp_on_cpu makes
# a state built with an FSDP plugin on MULTI_CPU an FSDP state, in both shared states (PartialState's is copied
# into every AcceleratorState built later, and accelerate reads the type from either).


def fsdp_on_cpu() -> None:
    """Let accelerate's FSDP (fully_shard) run on CPU processes. Idempotent; a no-op where CUDA is available."""
    import torch

    if torch.cuda.is_available():
        return
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__
    if getattr(init, "finetune_fsdp_on_cpu", False):
        return

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        from torch.distributed.fsdp import CPUOffloadPolicy

        if isinstance(getattr(fsdp_plugin, "cpu_offload", None), CPUOffloadPolicy) and fsdp_plugin.cpu_offload.pin_memory:
            # torch pins the offloaded shards (page-locked for GPU copies), which needs a GPU: unpinned on CPU.
            fsdp_plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    patched.finetune_fsdp_on_cpu = True
    state.AcceleratorState.__init__ = patched


# ----------------------------------------------------------------------------------------------
# transformers 5.24 (modeling_gguf_pytorch_utils.load_gguf_checkpoint) with gguf 0.19: every from_pretrained with a
# gguf_file parses the file's whole metadata again (a tokenizer alone reads it twice), and gguf's reader parses each
# vocabulary entry as its own numpy view: about 2.5 s per read of a 32k-token file on one core, 4 reads per loaded
# model. Within shared_gguf_reader() a file is parsed once; the readers are dropped (their maps closed) at its end.


@contextmanager
def shared_gguf_reader():
    import gguf

    real = gguf.GGUFReader
    if getattr(real, "finetune_shared", False):  # an outer scope's readers serve this one
        yield
        return
    made: dict[tuple, Any] = {}

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, mode)
        if mode != "r":  # a writable map is the caller's own
            return real(path, mode)
        if key not in made:
            made[key] = real(path, mode)
        return made[key]

    reader.finetune_shared = True
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real
        made.clear()
