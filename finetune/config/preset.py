"""A parallelism preset as one value: the DeepSpeed (or FSDP2) configuration a run uses, read once.

`--config NAME` (or DeepSpeed's `--deepspeed FILE`) and the launcher's environment (accelerate's ACCELERATE_*
variables) become one `Preset`, once per process (`Preset.resolve`); validation, the three training paths, the
planner and the resume checks read it, never the file. The JSON is read in one place, `_read`. A launcher that
names another DeepSpeed file than the flag is an error naming both, never a silent choice of one.

The FSDP2 presets (`fsdp2`, `fsdp2_offload`) have no DeepSpeed JSON: their file is the accelerate launch file
(accelerate_configs/fsdp2.yaml), whose `fsdp_config` section is the preset (`Preset.fsdp`, read in `_read_fsdp`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.config.parser import ConfigError, did_you_mean

# Package data, so an installed finetune finds its presets; the repository's top-level ds_configs/ and
# accelerate_configs/ link here.
PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
DS_CONFIG_DIR = PRESET_DIR / "ds_configs"
ACCELERATE_CONFIG_DIR = PRESET_DIR / "accelerate_configs"

# Parallelism presets: the name a user types -> the DeepSpeed JSON it stands for (None = plain DDP).
# `zero3` means ZeRO-3 with parameters and optimizer offloaded to CPU, the preset that fits the most.
PRESETS: dict[str, str | None] = {
    "ddp": None,
    "zero1": "zero1.json",
    "zero2": "zero2.json",
    "zero3": "zero3_offload.json",
    "zero3_no_offload": "zero3_no_offload.json",
    "zero3_nvme": "zero3_nvme.json",  # ZeRO-Infinity: parameters and optimizer states swapped to --nvme_path
    # FSDP2 (torch's fully_shard through accelerate): no DeepSpeed JSON; the preset is its accelerate file's
    # fsdp_config section (ACCELERATE_FILES). fsdp2_offload: parameters, gradients and the optimizer step on CPU.
    "fsdp2": None,
    "fsdp2_offload": None,
}
# The accelerate launch file shipped for a preset (`accelerate launch --config_file accelerate_configs/zero2.yaml`).
ACCELERATE_FILES: dict[str, str] = {"ddp": "ddp.yaml", "zero2": "zero2.yaml", "zero3": "zero3.yaml",
                                    "fsdp2": "fsdp2.yaml", "fsdp2_offload": "fsdp2_offload.yaml"}
# Where a preset's JSON wants --nvme_path (zero3_nvme.json): filled in when the preset is resolved.
NVME_PLACEHOLDER = "NVME_PATH"


def preset_file(name: str) -> Path | None:
    """The DeepSpeed JSON a --config value names: a preset's file, or the path given; None for ddp. Not read."""
    if name in PRESETS:
        file = PRESETS[name]
        return DS_CONFIG_DIR / file if file else None
    return Path(name)


def same_file(a: str, b: str) -> bool:
    """Do two --config / --deepspeed values name the same DeepSpeed configuration (a preset or its file)?"""
    def where(name: str) -> str:
        path = preset_file(str(name))
        return str(path.resolve()) if path is not None else str(name)

    return where(a) == where(b)


def _read(path: Path) -> dict:
    """The one read of a DeepSpeed JSON file; its problems as the --config flag's."""
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such DeepSpeed JSON file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--config {path}:{e.lineno}: not valid JSON: {e.msg}") from None
    if not isinstance(data, dict) or not isinstance(data.get("zero_optimization", {}), dict):
        raise ConfigError(f"--config {path}: expected a DeepSpeed config object with a zero_optimization section")
    return data


def _read_fsdp(path: Path) -> dict | None:
    """The fsdp_config section of an accelerate launch file whose distributed_type is FSDP (keys without their
    `fsdp_` prefix, as transformers' TrainingArguments takes them); None for any other launch file."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if data.get("distributed_type") != "FSDP":
        return None
    return {k.removeprefix("fsdp_"): v for k, v in (data.get("fsdp_config") or {}).items()}


def _fill(value: Any, folder: str) -> Any:
    """`value` with every NVME_PATH placeholder string replaced by the swap folder."""
    if isinstance(value, dict):
        return {k: _fill(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, folder) for v in value]
    return folder if value == NVME_PLACEHOLDER else value


def _has_placeholder(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_placeholder(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_placeholder(v) for v in value)
    return value == NVME_PLACEHOLDER


@dataclass(frozen=True)
class Preset:
    """The parallelism a run uses. `ds_config` is the JSON as read ("auto" values left for TrainingArguments to
    fill) with the swap folder filled in: copy it before changing it (transformers and DeepSpeed get copies)."""

    name: str  # the --config value: a preset name, or a DeepSpeed JSON path
    path: Path | None = None  # the DeepSpeed JSON; None for ddp
    stage: int = 0  # ZeRO stage; 0 for ddp
    offload_optimizer: str | None = None  # "cpu", "nvme" or None
    offload_param: str | None = None  # "cpu", "nvme" or None
    ds_config: dict | None = field(default=None, compare=False, repr=False)
    accelerate_config: Path | None = None  # the shipped accelerate launch file for this preset, if there is one
    own_optimizer: bool = False  # the JSON names an optimizer: DeepSpeed builds it (one parameter group)
    own_scheduler: bool = False  # the JSON names a scheduler: DeepSpeed steps it
    needs_nvme_path: bool = False  # the JSON holds the NVME_PATH placeholder: --nvme_path is required
    nvme_path: str | None = None  # the swap folder filled in (absolute), where one was needed and given
    # FSDP2: the accelerate file's fsdp_config section (`version`, `offload_params`, `state_dict_type`, ...); None
    # for DDP and DeepSpeed.
    fsdp: dict | None = field(default=None, compare=False, repr=False)

    @property
    def is_deepspeed(self) -> bool:
        return self.path is not None

    @property
    def is_fsdp(self) -> bool:
        return self.fsdp is not None

    @property
    def sharded(self) -> bool:
        """Each rank holds a shard of the model state (ZeRO or FSDP): a checkpoint belongs to one world size."""
        return self.stage > 0 or self.is_fsdp

    def fsdp_training_arguments(self) -> dict:
        """TrainingArguments' `fsdp_config` for this FSDP preset (transformers turns it into accelerate's
        FullyShardedDataParallelPlugin arguments, `args.fsdp_plugin_args`, for the Trainer and the loop alike)."""
        f = self.fsdp or {}
        return {"version": int(f.get("version", 2)), "auto_wrap_policy": f.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"),
                "reshard_after_forward": bool(f.get("reshard_after_forward", True)),
                "cpu_offload": bool(f.get("offload_params", False)),
                "state_dict_type": f.get("state_dict_type", "SHARDED_STATE_DICT"),
                "cpu_ram_efficient_loading": bool(f.get("cpu_ram_efficient_loading", False)),
                "activation_checkpointing": bool(f.get("activation_checkpointing", False))}

    @property
    def zero3(self) -> bool:
        return self.stage == 3

    @property
    def uses_nvme(self) -> bool:
        """Something is offloaded to NVMe (ZeRO-Infinity): DeepSpeed's async I/O and swap files."""
        return "nvme" in (self.offload_optimizer, self.offload_param)

    @classmethod
    def resolve(cls, config: str, nvme_path: str | None = None, *, given: bool = True,
                environ: Mapping[str, str] | None = None) -> "Preset":
        """The preset of this process, from --config (`given`: typed or from a recipe, not the default) and the
        launcher's environment (os.environ; None: no launcher to agree with, as for `finetune plan`).
        Raises ConfigError with every problem."""
        problems: list[str] = []
        preset = None
        try:
            preset = cls.named(config, nvme_path)
        except ConfigError as e:
            problems += e.problems
        if environ is not None:
            problems[:0] = launcher_problems(config, given, environ)
        if problems:
            raise ConfigError(problems)
        return preset

    @classmethod
    def named(cls, config: str, nvme_path: str | None = None) -> "Preset":
        """A preset name or DeepSpeed JSON path as a Preset (the file read here, once); ConfigError if it is neither."""
        if config not in PRESETS and not config.endswith(".json"):
            raise ConfigError(f"--config: unknown preset '{config}'{did_you_mean(config, list(PRESETS))} "
                              f"(presets: {', '.join(PRESETS)}; or give a path to a DeepSpeed .json)")
        accelerate = ACCELERATE_CONFIG_DIR / ACCELERATE_FILES[config] if config in ACCELERATE_FILES else None
        path = preset_file(config)
        if path is None:
            fsdp = _read_fsdp(accelerate) if accelerate is not None else None
            offload = "cpu" if fsdp and fsdp.get("offload_params") else None
            return cls(config, accelerate_config=accelerate, offload_optimizer=offload, offload_param=offload, fsdp=fsdp)
        data = _read(path)
        zero = data.get("zero_optimization") or {}
        try:
            stage = int(zero.get("stage", 0))
        except (TypeError, ValueError):
            raise ConfigError(f"--config {path}: zero_optimization.stage must be 0, 1, 2 or 3, "
                              f"got {zero.get('stage')!r}") from None

        def device(key: str) -> str | None:
            section = zero.get(key)
            where = str(section.get("device", "none")).lower() if isinstance(section, dict) else "none"
            return where if where in ("cpu", "nvme") else None

        needs_nvme = _has_placeholder(data)
        folder = str(Path(nvme_path).resolve()) if needs_nvme and nvme_path else None
        return cls(config, path, stage, device("offload_optimizer"), device("offload_param"),
                   _fill(data, folder) if folder else data, accelerate, "optimizer" in data, "scheduler" in data,
                   needs_nvme, folder)

    def describe(self) -> str:
        """The --config value and, when it is a preset name, its file: `zero2 (/.../ds_configs/zero2.json)`."""
        if self.is_fsdp:
            return f"{self.name} (FSDP{self.fsdp.get('version', 2)}, {self.accelerate_config})"
        return self.name + (f" ({self.path})" if self.path is not None and str(self.path) != self.name else "")


def launcher_problems(config: str, given: bool, environ: Mapping[str, str]) -> list[str]:
    """`accelerate launch --config_file accelerate_configs/zero3.yaml` names a DeepSpeed file too; it must be the
    one --config names (with --config left at its default too: the flag is the one source of the preset). Likewise
    accelerate_configs/fsdp2.yaml (FSDP in the launcher's environment) goes with --config fsdp2 only."""
    if environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return _fsdp_launcher_problems(config, given, environ)
    if environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return []  # the flags form (`--multi_gpu ... --config zero3`) or no accelerate: the flag alone decides
    launcher_file = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not launcher_file or launcher_file.lower() == "none":
        return ["accelerate launch was configured for DeepSpeed without a deepspeed_config_file; launch with "
                "accelerate_configs/zero2.yaml or zero3.yaml (each names its DeepSpeed file), or without DeepSpeed "
                "in the accelerate config and choose the preset with --config"]
    ours = preset_file(config)
    if ours is not None and ours.resolve() == Path(launcher_file).resolve():
        return []
    theirs = next((name for name, file in PRESETS.items()
                   if file and (DS_CONFIG_DIR / file).resolve() == Path(launcher_file).resolve()), launcher_file)
    flag = f"--config {config}" + ("" if given else " (the default)")
    other = (f"accelerate_configs/{ACCELERATE_FILES[config]}" if config in ACCELERATE_FILES
             else "an accelerate config that names the same file (or the flags form, --multi_gpu --num_processes N)")
    return [f"{flag} disagrees with the accelerate config, which uses DeepSpeed file {launcher_file}: pass "
            f"--config {theirs} to train with that file, or launch with {other} for --config {config}"]


FSDP_PRESETS = ("fsdp2", "fsdp2_offload")


def _fsdp_launcher_problems(config: str, given: bool, environ: Mapping[str, str]) -> list[str]:
    """An accelerate launch configured for FSDP: --config must name the FSDP2 preset with the same offload."""
    version = environ.get("FSDP_VERSION", "1")
    offload = environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
    theirs = "fsdp2_offload" if offload else "fsdp2"
    if config == theirs and version == "2":
        return []
    flag = f"--config {config}" + ("" if given else " (the default)")
    if version != "2":
        return [f"accelerate launch was configured for FSDP version {version}; finetune trains FSDP2 only: launch with "
                f"accelerate_configs/{theirs}.yaml (fsdp_version: 2) and --config {theirs}"]
    other = (f"accelerate_configs/{ACCELERATE_FILES[config]}" if config in ACCELERATE_FILES
             else "the flags form (--multi_gpu --num_processes N)")
    return [f"{flag} disagrees with the accelerate config, which uses FSDP2"
            f"{' with parameters offloaded to CPU' if offload else ''}: pass --config {theirs} to train with it, or "
            f"launch with {other} for --config {config}"]


def nvme_problems(preset: Preset, nvme_path: str | None) -> list[str]:
    """What a ZeRO-Infinity preset needs on this machine: a swap folder, and DeepSpeed's async I/O (libaio)."""
    if not preset.uses_nvme and not preset.needs_nvme_path:
        return []
    problems = []
    if preset.needs_nvme_path and not nvme_path:
        problems.append(f"--config {preset.name}: needs --nvme_path FOLDER (a fast local disk for the swap files)")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        aio_ok = AsyncIOBuilder().is_compatible(verbose=False)
    except Exception:
        aio_ok = False
    if not aio_ok:
        problems.append(
            f"--config {preset.name}: DeepSpeed's async I/O cannot be built here: install libaio "
            "(Debian/Ubuntu: apt-get install libaio-dev; RHEL/Fedora: dnf install libaio-devel), or use --config zero3"
        )
    return problems


# Top-level DeepSpeed keys besides deepspeed.runtime.constants' (sections read by other modules).
_DS_SECTIONS = ("zero_optimization", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb",
                "csv_monitor", "comet", "aio", "amp", "compression_training", "data_efficiency", "autotuning",
                "nebula", "elasticity", "comms_logger", "pipeline", "compile", "sparse_attention", "hybrid_engine",
                "timers", "tensor_parallel", "sequence_parallel_size", "weight_quantization", "datastates",
                "expert_parallel", "zenflow", "torch_autocast")
# Batch keys of a DeepSpeed JSON -> what finetune fills "auto" with.
_DS_BATCH = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def value_problems(preset: Preset, training: dict[str, Any]) -> list[str]:
    """What DeepSpeed itself would stop on with a traceback once the run has started: an unknown key in a section
    it validates (zero_optimization, bf16, fp16), a misspelt top-level key (silently ignored by DeepSpeed), batch
    sizes that contradict each other or the flags."""
    data, path = preset.ds_config or {}, preset.path
    problems = []
    try:
        import deepspeed.runtime.constants as ds_constants
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from pydantic import ValidationError
    except ImportError:  # no DeepSpeed: the launch says so
        return []
    known = {v for k, v in vars(ds_constants).items() if k.isupper() and isinstance(v, str)} | set(_DS_SECTIONS)
    for key in data:
        if key not in known and did_you_mean(key, sorted(known)):
            problems.append(f"--config {path}: unknown key '{key}'{did_you_mean(key, sorted(known))} "
                            "(DeepSpeed would ignore it)")
    for section, model in (("zero_optimization", DeepSpeedZeroConfig), ("bf16", DeepSpeedBF16Config),
                           ("fp16", DeepSpeedFP16Config)):
        if not isinstance(data.get(section), dict):
            continue
        try:
            model(**data[section])
        except ValidationError as e:
            for err in e.errors():
                where = ".".join(map(str, (section, *err["loc"])))
                if err["type"] == "extra_forbidden":
                    fields = list(_pydantic_fields(model, err["loc"][:-1]))
                    problems.append(f"--config {path}: {where}: unknown key"
                                    f"{did_you_mean(str(err['loc'][-1]), fields)}")
                else:
                    problems.append(f"--config {path}: {where}: {err['msg']} (got {err.get('input')!r})")
    # Batch sizes: "auto" takes finetune's flags; a number must agree with them (and train_batch_size with the
    # world size this launch starts).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = int(training.get("per_device_train_batch_size", 8))
    accum = int(training.get("gradient_accumulation_steps", 1))
    ours = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "train_batch_size": micro * accum * world}
    flags = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
             "gradient_accumulation_steps": "--gradient_accumulation_steps",
             "train_batch_size": "--per_device_train_batch_size x --gradient_accumulation_steps x world size "
                                 f"({micro} x {accum} x {world})"}
    for key in _DS_BATCH:
        value = data.get(key, "auto")
        if value == "auto":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"--config {path}: {key} must be a positive integer or \"auto\", got {value!r}")
        elif value != ours[key]:
            problems.append(f"--config {path}: {key} is {value} but {flags[key]} gives {ours[key]}; set it to "
                            "\"auto\" (filled from the flags) or make them agree")
    return problems


def _pydantic_fields(model, loc) -> list[str]:
    """The field names (and aliases) of the pydantic model at `loc` inside `model`, for did-you-mean."""
    for part in loc:
        field_info = model.model_fields.get(part) if isinstance(part, str) else None
        sub = getattr(field_info, "annotation", None)
        sub = next((a for a in getattr(sub, "__args__", ()) if hasattr(a, "model_fields")), sub)
        if not hasattr(sub, "model_fields"):
            return []
        model = sub
    return [f.alias or name for name, f in model.model_fields.items()]
