"""The training flags: defaults < YAML recipe < command line, validated in one pass.

All three training paths (the Trainer script, the DeepSpeed launcher script and the accelerate
loop) and `finetune plan` parse their flags here, so a flag means the same thing everywhere. The
generic machinery (types, flag forms, recipes, did-you-mean, help) is finetune.config.parser; this
module adds the sections, presets, validation and the TrainingArguments built from them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.config.parser import (Command, ConfigError, Setting, convert, did_you_mean, exit_with_problems,  # noqa: F401
                                    read_recipe, wants_help)
from finetune.config.parser import _plain
from finetune.config.preset import DS_CONFIG_DIR, NVME_PLACEHOLDER, PRESETS, Preset, nvme_problems, same_file  # noqa: F401
from finetune.config.preset import value_problems
from finetune.config import ship
from finetune.data import formats
from finetune.data.formats import shapes
from finetune.data.sources import looks_like_dataset_id
from finetune import methods
from finetune.methods import ObjectiveConfig
from finetune.methods.base import MethodConfig, own_flags

DTYPES = ("auto", "float32", "bfloat16", "float16")


# Field metadata for every --config flag that takes a preset: DeepSpeed's own `--deepspeed FILE` and
# `--deepspeed_config FILE` are the same flag (its tutorials pass `--deepspeed --deepspeed_config ds.json`: the bare
# switch names nothing), and two spellings naming different configurations are refused.
CONFIG_ALIASES: dict[str, Any] = {
    "aliases": ("deepspeed", "deepspeed_config"), "bare_aliases_ignored": True,
    "same": same_file, "conflict": "these name different DeepSpeed configurations",
}


@dataclass
class ModelConfig:
    """Which model to load and how (flag names follow TRL's ModelConfig)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Local folder of a Llama-style causal LM (config.json + safetensors), or a Hugging Face Hub "
                          "repo id (org/name), fetched into the HF cache (HF_HOME; HF_HUB_OFFLINE=1 reads the cache only)."},
    )
    model_revision: str = field(
        default="main",
        metadata={"help": "Branch, tag or commit of a Hub model (--model_name_or_path org/name); the commit it resolves "
                          "to is recorded in the saved config.json (finetune_base_revision)."},
    )
    torch_dtype: str = field(
        default="auto",
        metadata={"help": "Weight dtype: auto (float32 on CPU, bfloat16 on GPUs that support it), float32, bfloat16, float16."},
    )
    attn_implementation: str = field(default="sdpa", metadata={"help": "Attention kernel: sdpa, eager, flash_attention_2."})
    chat_template: str | None = field(
        default=None,
        metadata={"help": "A Jinja chat template file (.jinja) for the tokenizer: gives a base model without one a chat "
                          "format for 'messages'/'sharegpt' data (or replaces the one it has); saved with the model."},
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Run Python code shipped with the model folder. Off by default."})
    allow_pickle: bool = field(
        default=False, metadata={"help": "Allow loading pickle (*.bin) weights. Off by default: only safetensors are read."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scaling = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "Modules that get LoRA adapters; 'all-linear' = every linear projection except the LM head."},
    )
    freeze_vision_tower: bool = field(
        default=True,
        metadata={"help": "Vision-language models: keep the vision tower and its projector frozen (the default), training "
                          "the language model only. false: full fine-tuning trains them too, and --use_peft puts LoRA "
                          "adapters on their linear layers as well (docs/vision.md). A text-only model refuses false."},
    )
    loss_chunk_size: int = field(
        default=1024,
        metadata={"help": "Tokens per chunk of the cross-entropy: the LM head's logits are computed (and their "
                          "gradients taken) a chunk at a time, never for the whole micro-batch at once; positions "
                          "without a label get none. Same loss and gradients; 0: transformers' own loss. See "
                          "docs/training.md."},
    )
    tiled_mlp: bool = field(
        default=False,
        metadata={"help": "Long records: each decoder layer's MLP computed over tiles of hidden_size positions, each "
                          "recomputed in backward, so only one tile's intermediates live at once (ALST's tiled MLP). "
                          "Same loss and gradients, one more MLP forward per step; dense MLPs only (a mixture-of-"
                          "experts family refuses it). See docs/long-context.md."},
    )
    offload_activations: bool = field(
        default=False,
        metadata={"help": "With --gradient_checkpointing on a GPU: the layer inputs checkpointing keeps wait in pinned "
                          "host memory instead of on the device, each copied back for its layer's recompute "
                          "(transformers' activation-checkpointing offload). Refused without CUDA, where activations "
                          "are already in host memory. See docs/long-context.md."},
    )
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the base weights in 8-bit (bitsandbytes)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "Load the base weights in 4-bit (bitsandbytes)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit quantization type: nf4 or fp4."})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Double quantization for 4-bit weights."})
    bnb_4bit_compute_dtype: str = field(
        default="auto",
        metadata={"help": "Dtype 4-bit matmuls compute in: auto (the model dtype), float32, bfloat16, float16."},
    )


@dataclass
class DataConfig:
    """Where the training data is and how records become tokens."""

    dataset: str | list[str] | None = field(
        default=None,
        metadata={"help": "Local .jsonl/.json/.csv/.parquet file, a folder written by datasets.save_to_disk, or a Hugging "
                          "Face Hub data set id (org/name), read with datasets.load_dataset. Repeat it (or give a recipe "
                          "list) to mix several; see --dataset_weights and docs/data.md.", "repeat": True},
    )
    dataset_weights: list[float] | None = field(
        default=None,
        metadata={"help": "One weight per --dataset: each one's share of the mixed set (as many examples as the sets "
                          "together; a set with too few is repeated, one with more is subsampled, by --seed). "
                          "Default: every set whole."},
    )
    dataset_num_proc: int | None = field(
        default=None,
        metadata={"help": "Processes that tokenize the data set (default: the cores this process may use)."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration (subset) name of a Hub data set, where it has several."}
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of a Hub data set to train on."})
    dataset_revision: str | None = field(
        default=None, metadata={"help": "Branch, tag or commit of a Hub data set (default: its main branch)."}
    )
    dataset_format: str = field(
        default="auto",
        metadata={"help": "auto (detect), text ('text'), alpaca ('instruction', 'input', 'output'), messages ('messages', "
                          "with tool_calls and tool turns) or sharegpt ('conversations' of from/value: human, gpt, system, "
                          "tool). See docs/formats.md."},
    )
    max_seq_length: int = field(default=1024, metadata={"help": "Longest tokenized record, in tokens."})
    drop_long_sequences: bool = field(
        default=False, metadata={"help": "Drop records longer than max_seq_length instead of truncating them."}
    )
    completion_only_loss: bool = field(
        default=True,
        metadata={"help": "Train only on completion / assistant tokens (and their EOS). False trains on every token."},
    )
    dataset_cache_dir: str | None = field(
        default=None, metadata={"help": "Where tokenized data is cached (default: ~/.cache/finetune/tokenized)."}
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Pack records into rows of max_seq_length (best-fit decreasing); records never see each other "
                          "(attention split and position_ids reset at each record boundary). See docs/packing.md."},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Send each micro-batch as one flattened row without padding (records kept apart as with "
                          "--packing). Same records per step as the padded run; pays off with flash_attention_2."},
    )
    eval_dataset: str | None = field(
        default=None,
        metadata={"help": "Evaluation data: a local file or folder, or a Hub data set id, in the formats --dataset takes "
                          "(same --dataset_format, max_seq_length and masks). Turns on --eval_strategy steps."},
    )
    eval_dataset_split: str = field(default="validation", metadata={"help": "Split of a Hub --eval_dataset."})
    eval_split_size: float = field(
        default=0.0,
        metadata={"help": "Hold out part of the training data for evaluation instead: a fraction (0.05) or a number of "
                          "records (200); a seeded split (--data_seed or --seed), disjoint from training, recorded in "
                          "OUTPUT_DIR/eval_split.json. Turns on --eval_strategy steps."},
    )

    def __post_init__(self):
        # `--dataset a.jsonl` once is the plain string it always was; repeated, a list.
        if isinstance(self.dataset, list) and len(self.dataset) == 1:
            self.dataset = self.dataset[0]

    def datasets(self) -> list[str]:
        """Every --dataset, in order."""
        if not self.dataset:
            return []
        return list(self.dataset) if isinstance(self.dataset, list) else [self.dataset]


@dataclass
class EvalConfig:
    """Evaluation while training (finetune.training.evaluate); its schedule is TrainingArguments' --eval_strategy,
    --eval_steps, and the best model --load_best_model_at_end / --metric_for_best_model."""

    eval_generate: int = field(
        default=0,
        metadata={"help": "At every evaluation, complete the first N eval records greedily and log eval_exact_match "
                          "(the completion equals the record's answer after trimming whitespace)."},
    )
    eval_max_new_tokens: int = field(
        default=0, metadata={"help": "Longest --eval_generate completion (0: the reference answer's length + 16)."}
    )
    eval_metric: str | None = field(
        default=None,
        metadata={"help": "A metric over the --eval_generate completions: 'package.module:function', called as "
                          "function(predictions, references) -> float or {name: float}; logged as eval_<name>."},
    )
    early_stopping_patience: int = field(
        default=0,
        metadata={"help": "Stop when --metric_for_best_model has not improved for N evaluations (0: never); needs "
                          "--load_best_model_at_end, so the model saved is the best one."},
    )
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "How much the metric must improve to count as an improvement for early stopping."}
    )


@dataclass
class LaunchConfig:
    """How the job is run."""

    config: str = field(
        default="ddp",
        metadata={
            "help": f"Parallelism preset ({', '.join(PRESETS)}) or a path to a DeepSpeed JSON file. "
                    "--deepspeed FILE and --deepspeed_config FILE (DeepSpeed's own flags) are the same flag.",
            **CONFIG_ALIASES,
        },
    )
    recipe: str | None = field(default=None, metadata={"help": "YAML file with any of these keys; the command line wins."})
    nvme_path: str | None = field(
        default=None,
        metadata={"help": "Folder on a fast local disk for --config zero3_nvme (ZeRO-Infinity swaps parameters and optimizer states there)."},
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "Split each record's tokens over this many processes (DeepSpeed Ulysses), data parallel over "
                          "the rest: the world size must be a multiple of it. The engine path (scripts/sft.py) and "
                          "the loop (finetune/loop.py) on a DeepSpeed preset; see docs/sequence-parallel.md."},
    )
    plan_check: bool = field(
        default=False,
        metadata={"help": "Predict this run's memory first (as `finetune plan` does) and refuse to start if it does not fit."},
    )
    force: bool = field(default=False, metadata={"help": "Start even when --plan_check predicts that memory does not fit."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an --output_dir that holds another run's final model or checkpoints: its "
                          "checkpoints are removed at start and its model replaced at the end (refused without this)."},
    )


# Our defaults for TrainingArguments fields, applied under the recipe and the command line.
TRAINING_DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/run",
    "logging_steps": 1,
    "report_to": "none",
    "save_strategy": "no",
    "lr_scheduler_type": "linear",
    "average_tokens_across_devices": True,
    "remove_unused_columns": False,
    "dataloader_num_workers": 0,
    # DDP's default (find unused parameters) costs an extra pass over the autograd graph every step and warns about
    # it; every parameter of a Llama-style model (and of its LoRA adapters) gets a gradient in every step.
    "ddp_find_unused_parameters": False,
    # Real (non-padding) input tokens seen, and tokens per second, in every log entry (finetune report plots them).
    # Counted where the batch is and read only when an entry is logged (finetune.training: no sync in other steps).
    "include_num_input_tokens_seen": "non_padding",
    # The Trainer's check of every step's loss for nan/inf is a host-device sync in every step (and it hides a nan
    # from the log, which should show it).
    "logging_nan_inf_filter": False,
}

# Defaults on a CUDA device, under the recipe and the command line (device_defaults).
# - logging_steps: a logged step reads its loss (and grad norm, token count) from the device: the host waits for the
#   GPU to drain, then the GPU waits while the host writes the entry and queues the next step; about 2-5 ms. At 20
#   steps apart that is at most 1% of a step of 25 ms and more (a 135M model's 16k-token step on an H100 is ~30 ms;
#   1B and up, 100 ms and more). On a CPU a read costs nothing: every step is logged (the default above).
# - dataloader workers and pinned memory: batches are collated in 2 worker processes ahead of the step and copied
#   to the GPU from pinned memory without blocking; persistent, so no epoch starts them again.
# - bf16 mixed precision where the GPU supports it (compute capability 8.0 and up): autocast, as --bf16 true.
GPU_DEFAULTS: dict[str, Any] = {
    "logging_steps": 20,
    "dataloader_num_workers": 2,
    "dataloader_pin_memory": True,
    "dataloader_persistent_workers": True,
    # Batches copied from pinned memory without blocking the host (a blocking copy waits for the GPU's queue).
    "accelerator_config": {"non_blocking": True},
}


def device_defaults(training: dict[str, Any], sources: dict[str, str], *, cuda: bool | None = None,
                    bf16: bool | None = None) -> dict[str, Any]:
    """The GPU_DEFAULTS (and bf16 where supported) for the keys neither the recipe nor the command line gave, on a
    CUDA device; nothing on a CPU (or with --use_cpu). `cuda`, `bf16`: the device's answers (asked when None)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda or training.get("use_cpu"):
        return {}
    out = dict(GPU_DEFAULTS)
    if bf16 is None:
        import torch

        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)  # the capability only: no CUDA context made
    if bf16 and not training.get("fp16"):
        out["bf16"] = True
    if training.get("dataloader_num_workers", 0) == 0 and "dataloader_num_workers" in sources:
        out.pop("dataloader_persistent_workers")  # workers asked off: nothing to keep
    return {k: v for k, v in out.items() if k not in sources}

# Keys the project sets itself; a user value would break an invariant, so they are refused.
# (TrainingArguments' `deepspeed` is not among them: --deepspeed FILE is an alias of --config.)
RESERVED_TRAINING_KEYS = {
    "fsdp": "use --config fsdp2 (or fsdp2_offload): FSDP2 is a preset",
    "fsdp_config": "use --config fsdp2 (or fsdp2_offload); the preset's settings are in accelerate_configs/fsdp2.yaml",
}


@dataclass
class FinetuneConfig:
    model: ModelConfig
    data: DataConfig
    launch: LaunchConfig
    training: Any  # transformers.TrainingArguments
    preset: Preset  # the parallelism: --config resolved once (finetune.config.preset)
    sources: dict[str, str]  # key -> "default" | "recipe" | "cli"
    fingerprint: dict | None = None  # set by finetune.training.lifecycle.guard_output_dir before training
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    objective: MethodConfig = field(default_factory=ObjectiveConfig)  # the method's config (finetune.methods)

    def resolved(self) -> dict[str, Any]:
        """The flat dict of every key that is not at the HF default, reusable as a --recipe."""
        out: dict[str, Any] = {}
        # An SFT run's recipe (and so its run fingerprint) leaves the method keys out, as before they existed.
        sections = (self.launch, self.model, self.data, self.evaluation)
        sections += (self.objective,) if self.objective.method != methods.DEFAULT else ()
        for section in sections:
            for f in dataclasses.fields(section):
                if f.name != "recipe":
                    out[f.name] = _plain(getattr(section, f.name))
        if out.get("sequence_parallel_size") == 1:  # off: the recipe (and fingerprint) as before the flag existed
            del out["sequence_parallel_size"]
        hub = getattr(self.model, "_hub", None)
        if hub is not None:
            # The repo id and the exact commit, not the cache folder: the recipe reruns on another machine.
            out["model_name_or_path"], out["model_revision"] = hub.repo_id, hub.commit
        # Absolute paths, so the saved recipe works from any directory.
        for key in ("model_name_or_path", "dataset", "eval_dataset", "dataset_cache_dir", "config", "nvme_path"):
            if isinstance(out.get(key), list):
                out[key] = [str(Path(v).resolve()) if Path(v).exists() else v for v in out[key]]
            elif out.get(key) and Path(out[key]).exists():
                out[key] = str(Path(out[key]).resolve())
        from transformers import TrainingArguments

        hf_default = _training_field_defaults(TrainingArguments)
        skip = {"local_rank", "deepspeed", "use_cpu", "hub_token"} | set(RESERVED_TRAINING_KEYS)
        for name, value in self.training.to_dict().items():
            if name in skip or name not in hf_default or not _is_plain(value):
                continue  # derived or object-valued fields (e.g. accelerator_config) are not recipe keys
            if value != _plain(hf_default[name]) or name in TRAINING_DEFAULTS or name in self.sources:
                out[name] = str(Path(value).resolve()) if name in ("output_dir", "logging_dir") and value else value
        return out


def _is_plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return value is None or isinstance(value, (str, int, float, bool))


def _training_field_defaults(cls) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
        else:
            out[f.name] = None
    return out


def command(prog: str = "finetune train", extra: dict[str, type] | None = None, description: str | None = None) -> Command:
    """The training flags: LaunchConfig, ModelConfig, DataConfig and TrainingArguments (its `deepspeed` field is
    --config's alias here, so DeepSpeed's own `--deepspeed ds.json` works), plus a command's `extra` sections.
    TrainingArguments' flags come from finetune.config.hf_fields: a mistake is reported before torch is imported."""
    from finetune.config.hf_fields import training_arguments

    sections = {"launch": LaunchConfig, "model": ModelConfig, "data": DataConfig, "evaluation": EvalConfig,
                "objective": ObjectiveConfig}
    # Each method's own flags, a section per method (a flag two methods share is parsed once; method_options gives
    # it to the method run).
    sections.update({name: m.config for name, m in methods.METHODS.items() if own_flags(m)})
    # A command's own flags come before TrainingArguments' (a name in both is the command's).
    sections.update(extra or {})
    sections["training"] = training_arguments()
    return Command(
        prog, sections,
        description=description or "Fine-tune a Llama-style causal LM. Flags: defaults < --recipe YAML < command line.",
        defaults=TRAINING_DEFAULTS, reserved=RESERVED_TRAINING_KEYS,
    )


def help_text(prog: str = "finetune train") -> str:
    return command(prog).help()


def load_or_exit(argv: list[str] | None = None, prog: str = "finetune train", *,
                 before_arguments: Callable[[Preset], None] | None = None) -> FinetuneConfig:
    """parse() for a training entry point: --help prints the flags; a ConfigError exits 2 with every problem."""
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(help_text(prog))
        raise SystemExit(0)
    try:
        return parse(argv, before_arguments=before_arguments)
    except ConfigError as e:
        exit_with_problems(e)


def parse_sections(argv: list[str] | None = None, prog: str = "finetune train", extra: dict[str, type] | None = None):
    """The training flags converted and merged, before any check: (model, data, launch, training values, sources,
    problems, extra) where extra holds the instances of EvalConfig ("evaluation") and of the command's `extra`
    sections. For commands that take the training flags and check them their own way (`finetune plan`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    got = command(prog, extra).collect(argv)
    values, sources, problems = got.values, got.sources, got.problems
    training = values["training"]
    if "save_steps" in sources and "save_strategy" not in sources:
        # Asking for a checkpoint every N steps is asking for step checkpoints (our default save_strategy is no).
        training["save_strategy"] = "steps"
    if (values["data"].get("eval_dataset") or values["data"].get("eval_split_size")) and "eval_strategy" not in sources:
        training["eval_strategy"] = "steps"  # an eval set is given to be evaluated on
    if _plain(training.get("eval_strategy")) == "steps" and "eval_steps" not in sources:
        # transformers would evaluate every --logging_steps (every step here); the best model needs an evaluation at
        # every checkpoint, so evaluate where it saves, else ten times per run.
        training["eval_steps"] = training.get("save_steps") if "save_steps" in sources else 0.1
    model = ModelConfig(**values["model"])
    data = DataConfig(**values["data"])
    launch = LaunchConfig(**values["launch"])
    extras = {name: cls(**values[name]) for name, cls in {"evaluation": EvalConfig, **(extra or {})}.items()}
    extras["objective"], more = method_options(values)
    return model, data, launch, training, sources, problems + more, extras


def method_options(values: dict[str, dict[str, Any]]) -> tuple[MethodConfig, list[str]]:
    """The run's method config (--method and that method's own flags) from the parsed sections; an unknown method,
    or another method's flag set away from its default, is a problem."""
    name = values["objective"].get("method", methods.DEFAULT)
    given = {k: v for section in methods.METHODS if section in values for k, v in values[section].items()}
    method = methods.get(name)
    problems = []
    if method is None:
        problems.append(f"method: '{name}' is not one of {', '.join(methods.names())}"
                        f"{did_you_mean(name, methods.names())}")
    own = set(own_flags(method)) if method is not None else set()
    for key, value in given.items():
        owners = [m for m in methods.METHODS.values() if key in own_flags(m)]
        if key in own or method is None or all(value == getattr(m.config(), key) for m in owners):
            continue
        if len(owners) == 1:
            problems.append(f"{key}: a {owners[0].title} option; add --method {owners[0].name}")
        else:  # a flag several methods share (each with its own default)
            problems.append(f"{key}: an option of {', '.join(m.title for m in owners)}; add --method "
                            f"{' or '.join(m.name for m in owners)}")
    if method is None:
        return ObjectiveConfig(method=name), problems
    return method.config(method=name, **{k: v for k, v in given.items() if k in own}), problems


def parse(argv: list[str] | None = None, *, check_paths: bool = True,
          before_arguments: Callable[[Preset], None] | None = None) -> FinetuneConfig:
    """Parse and validate. Raises ConfigError listing every problem found.

    `before_arguments(preset)` runs once everything is valid, just before TrainingArguments is built: the training
    paths start their process group there (finetune.training.core.start), which a DeepSpeed preset needs first."""
    model, data, launch, training_values, sources, problems, extras = parse_sections(argv)
    evaluation = extras["evaluation"]
    # The preset, once per process: --config, which the launcher's environment (accelerate's) must agree with.
    preset, more = resolve_preset(launch, given="config" in sources, environ=os.environ)
    problems += more
    problems += validate(model, data, launch, training_values, check_paths=check_paths, preset=preset)
    problems += validate_evaluation(data, evaluation, training_values, check_paths=check_paths,
                                    method=extras["objective"].method)
    problems += validate_method(extras["objective"], data, training_values, evaluation)
    problems += ship.tracker_problems(training_values.get("report_to")) + ship.hub_problems(training_values, sources)

    training = None
    if not problems:
        if before_arguments is not None:
            before_arguments(preset)
        training_values.update(device_defaults(training_values, sources))
        problems += offload_activations(model, training_values)
    if not problems:
        training, more = build_training_arguments(training_values, preset)
        problems += more
    if problems:
        raise ConfigError(problems)
    return FinetuneConfig(model, data, launch, training, preset, sources, evaluation=evaluation,
                          objective=extras["objective"])


def offload_activations(model: ModelConfig, training: dict[str, Any], *, cuda: bool | None = None) -> list[str]:
    """--offload_activations: transformers' activation-checkpointing offload (`offload` in the checkpointing
    kwargs, which the Trainer and finetune.training.core both read), on a CUDA device only. Without one the
    activations are in host memory already, and torch's pinned copies need an accelerator: refused by name."""
    if not model.offload_activations:
        return []
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda or training.get("use_cpu"):
        return ["offload_activations: moves checkpointed activations from the GPU to pinned host memory; this run has "
                "no CUDA device (its activations are in host memory already): leave --offload_activations out"]
    key = "activation_checkpointing_kwargs" if training.get("activation_checkpointing_kwargs") else \
        "gradient_checkpointing_kwargs"
    training[key] = {**(training.get(key) or {}), "offload": True}
    return []


def validate_method(options: MethodConfig, data: DataConfig, training: dict[str, Any],
                    evaluation: EvalConfig | None = None) -> list[str]:
    """The method's own checks (finetune.methods): its flags, and what it does not support, refused by name. An
    unknown method is reported by method_options."""
    method = methods.get(options.method)
    if method is None:
        return []
    # Data of another method's shape, from its first record: before the model loads (finetune.data.formats.shapes).
    shape = [p for name in (data.datasets() if data.dataset else [])
             if (p := shapes.first_record_problem(name, method.name, data.dataset_format))]
    return method.validate(options, data, training, evaluation) + shape[:1]


def validate_evaluation(data: DataConfig, ev: EvalConfig, training: dict[str, Any], *, check_paths: bool,
                        method: str = methods.DEFAULT) -> list[str]:
    """The evaluation flags: an eval set for every evaluation asked for, a metric that will exist."""
    problems = []
    has_eval = bool(data.eval_dataset or data.eval_split_size)
    if data.eval_dataset and data.eval_split_size:
        problems.append("eval_dataset / eval_split_size: give one of them (an eval file, or a share of the training data)")
    size = data.eval_split_size
    if size < 0 or (size >= 1 and size != int(size)):
        problems.append(f"eval_split_size: a fraction below 1 (0.05) or a whole number of records (200), got {size}")
    strategy = _plain(training.get("eval_strategy", "no"))
    if strategy != "no" and not has_eval:
        problems.append(f"eval_strategy: '{strategy}' needs an eval set: --eval_dataset FILE or --eval_split_size 0.05")
    if ev.eval_generate < 0:
        problems.append(f"eval_generate: must not be negative, got {ev.eval_generate}")
    elif ev.eval_generate and not has_eval:
        problems.append("eval_generate: needs an eval set: --eval_dataset FILE or --eval_split_size 0.05")
    elif ev.eval_generate and not data.completion_only_loss:
        problems.append("eval_generate: needs prompt/answer records trained on the answer only (completion_only_loss "
                        "true): the prompt is what comes before the last trained span")
    if ev.eval_metric and not ev.eval_generate:
        problems.append("eval_metric: scores --eval_generate completions; add --eval_generate N")
    elif ev.eval_metric and check_paths:
        try:
            load_metric(ev.eval_metric)
        except ValueError as e:
            problems.append(f"eval_metric: {e}")
    if ev.early_stopping_patience < 0:
        problems.append(f"early_stopping_patience: must not be negative, got {ev.early_stopping_patience}")
    elif ev.early_stopping_patience and not training.get("load_best_model_at_end"):
        problems.append("early_stopping_patience: needs --load_best_model_at_end true (the run keeps and saves the "
                        "best model it found), with an eval set")
    elif ev.early_stopping_patience and not has_eval:
        problems.append("early_stopping_patience: needs an eval set to stop on: --eval_dataset FILE or "
                        "--eval_split_size 0.05")
    if training.get("load_best_model_at_end") and not has_eval:
        problems.append("load_best_model_at_end: needs an eval set to pick the best model: --eval_dataset FILE or "
                        "--eval_split_size 0.05")
    metric = training.get("metric_for_best_model")
    if metric and (training.get("load_best_model_at_end") or ev.early_stopping_patience) and not ev.eval_metric:
        known = (methods.get(method) or methods.METHODS[methods.DEFAULT]).eval_metrics(ev)
        name = metric[len("eval_"):] if metric.startswith("eval_") else metric
        if name not in known:
            problems.append(f"metric_for_best_model: '{metric}' is not logged{did_you_mean(name, known)} (logged: "
                            f"{', '.join('eval_' + k for k in known)}; --eval_metric adds its own)")
    return problems


def load_metric(spec: str):
    """'package.module:function' (or 'package.module.function') -> the function; ValueError naming what is missing."""
    import importlib

    module_name, sep, name = spec.partition(":")
    if not sep:
        module_name, _, name = spec.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"'{spec}' is not 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name} ({e}); is it on PYTHONPATH?") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise ValueError(f"{module_name} has no function '{name}'{did_you_mean(name, public)}")
    return fn


def resolve_preset(launch: LaunchConfig, *, given: bool = True,
                   environ: Mapping[str, str] | None = None) -> tuple[Preset | None, list[str]]:
    """(the Preset of --config, []) or (None, its problems); `environ` is the launcher's to agree with (None: none)."""
    try:
        return Preset.resolve(launch.config, launch.nvme_path, given=given, environ=environ), []
    except ConfigError as e:
        return None, e.problems


def validate(model: ModelConfig, data: DataConfig, launch: LaunchConfig, training: dict[str, Any], *, check_paths: bool,
             preset: Preset | None) -> list[str]:
    """Every semantic check on the parsed values; returns all problems at once. `preset` is resolve_preset's (None:
    it has problems of its own, reported by resolve_preset)."""
    problems = []
    if preset is not None:
        problems += nvme_problems(preset, launch.nvme_path)
    problems += sequence_parallel_problems(launch.sequence_parallel_size, data, training, preset)
    if model.torch_dtype not in DTYPES:
        problems.append(f"torch_dtype: '{model.torch_dtype}' is not one of {', '.join(DTYPES)}")
    known_formats = ("auto", *formats.names())
    if data.dataset_format not in known_formats:
        problems.append(
            f"dataset_format: '{data.dataset_format}' is not one of {', '.join(known_formats)}"
            f"{did_you_mean(data.dataset_format, list(known_formats))}"
        )
    if data.dataset_weights is not None:
        n = len(data.datasets())
        if len(data.dataset_weights) != n:
            problems.append(f"dataset_weights: {len(data.dataset_weights)} weights for {n} data set(s); give one per --dataset")
        elif not all(math.isfinite(w) for w in data.dataset_weights):
            problems.append(f"dataset_weights: every weight must be a finite number, got "
                            f"{', '.join(map(str, data.dataset_weights))}")
        elif any(w <= 0 for w in data.dataset_weights):
            problems.append(f"dataset_weights: every weight must be positive, got {', '.join(map(str, data.dataset_weights))}")
    if data.dataset_num_proc is not None and data.dataset_num_proc < 1:
        problems.append(f"dataset_num_proc: must be at least 1, got {data.dataset_num_proc}")
    if data.max_seq_length < 2:
        problems.append(f"max_seq_length: must be at least 2, got {data.max_seq_length}")
    if model.loss_chunk_size < 0:
        problems.append(f"loss_chunk_size: must be 0 (off) or a number of tokens, got {model.loss_chunk_size}")
    if model.offload_activations and not (training.get("gradient_checkpointing") or training.get("activation_checkpointing")):
        problems.append("offload_activations: moves the layer inputs that gradient checkpointing keeps; without "
                        "--gradient_checkpointing there are none to move: add --gradient_checkpointing")
    if model.lora_r <= 0:
        problems.append(f"lora_r: must be positive, got {model.lora_r}")
    if not 0.0 <= model.lora_dropout < 1.0:
        problems.append(f"lora_dropout: must be in [0, 1), got {model.lora_dropout}")
    from finetune.models import quant

    zero3 = quant.is_quantized(model) and preset is not None and preset.zero3
    problems += quant.problems(model, training=True, zero3=zero3, config=launch.config,
                               fsdp=preset is not None and preset.is_fsdp)
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if key in training and training[key] < 1:
            problems.append(f"{key}: must be at least 1, got {training[key]}")
    for key in ("eval_steps", "save_steps", "logging_steps"):
        # transformers reads a value below 1 as a share of the run; zero or less would be taken and mean nothing.
        if isinstance(training.get(key), (int, float)) and training[key] <= 0:
            problems.append(f"{key}: must be a positive number of steps (or a share of the run below 1, e.g. 0.1), "
                            f"got {training[key]}")
    if training.get("learning_rate", 1.0) < 0:
        problems.append(f"learning_rate: must not be negative, got {training['learning_rate']}")
    problems += attn_problems(model.attn_implementation)
    if preset is not None and preset.is_deepspeed and launch.config not in PRESETS and not problems:
        problems += value_problems(preset, training)
    if check_paths:
        if not model.model_name_or_path:
            problems.append("model_name_or_path: required (a local model folder)")
        else:
            found = resolve_model_or_problems(model)
            problems += found or family_problems(model, data)
        if model.model_name_or_path and training.get("output_dir") and \
                Path(training["output_dir"]).resolve() == Path(model.model_name_or_path).resolve():
            problems.append(f"output_dir: {training['output_dir']} is the model folder (--model_name_or_path); the run "
                            "would write over the base weights. Choose another --output_dir")
        if model.model_name_or_path and model.model_revision != "main" and getattr(model, "_hub", None) is None \
                and Path(model.model_name_or_path).exists():
            problems.append(f"model_revision: {model.model_revision} selects a revision of a Hub repo id, but "
                            f"{model.model_name_or_path} is a local folder, which has no revisions; drop "
                            "--model_revision (or give the repo id)")
        if model.chat_template:
            problems += chat_template_problems(model.chat_template)
        if not data.dataset:
            problems.append("dataset: required (a local data file or save_to_disk folder)")
        for name in data.datasets():
            if not Path(name).exists() and not looks_like_dataset_id(name):
                problems.append(f"dataset: {name}: no such file or folder")
        if data.eval_dataset and not Path(data.eval_dataset).exists() and not looks_like_dataset_id(data.eval_dataset):
            problems.append(f"eval_dataset: {data.eval_dataset}: no such file or folder")
        if training.get("output_dir"):
            out = Path(training["output_dir"]).resolve()
            for name in [*data.datasets(), *([data.eval_dataset] if data.eval_dataset else [])]:
                if Path(name).is_dir() and (out == Path(name).resolve() or Path(name).resolve() in out.parents):
                    problems.append(f"output_dir: {training['output_dir']} is (inside) the data set folder {name}; the "
                                    "run would write the model into the data set. Choose another --output_dir")
        from finetune.data.prepare import cache_root

        for flag, folder in (("output_dir", training.get("output_dir")), ("logging_dir", training.get("logging_dir")),
                             ("dataset_cache_dir", cache_root(data)), ("nvme_path", launch.nvme_path)):
            if folder and (problem := writable_problem(f"--{flag}", folder)):
                problems.append(problem)
    return problems


def sequence_parallel_problems(size: int, data: DataConfig, training: dict[str, Any], preset: Preset | None) -> list[str]:
    """--sequence_parallel_size: what every path refuses (the path's own refusals: finetune.training.core)."""
    if size == 1:
        return []
    if size < 1:
        return [f"sequence_parallel_size: must be at least 1 (1: off), got {size}"]
    problems = []
    if preset is not None and preset.is_fsdp:
        # torch 2.13's context_parallel (ring attention) has no sharding rule for the CPU's sdpa kernel
        # (aten._scaled_dot_product_flash_attention_for_cpu), and FSDP2 has no Ulysses: nothing splits a record there.
        problems.append(f"sequence_parallel_size: not supported with --config {preset.name} (FSDP2 has no sequence "
                        "parallelism here: torch's context_parallel does not run on the CPU's attention kernel and is "
                        "not wired in); use a DeepSpeed preset (--config zero3, zero2) on the engine path "
                        "(scripts/sft.py) or the loop (finetune/loop.py), which split records with DeepSpeed Ulysses")
    if training.get("per_device_train_batch_size", 1) != 1:
        problems.append(f"sequence_parallel_size: needs --per_device_train_batch_size 1 (one record, or one packed row "
                        f"with --packing, per micro-batch is split over the {size} processes), got "
                        f"{training.get('per_device_train_batch_size')}; use --gradient_accumulation_steps for more "
                        "records per step")
    for key, why in (("torch_compile", "the Ulysses attention's all-to-all is not compiled"),
                     ("use_liger_kernel", "Liger's patched forward computes the loss without the split labels")):
        if training.get(key):
            problems.append(f"sequence_parallel_size: not supported with --{key} ({why}); drop --{key}")
    return problems


def chat_template_problems(path: str) -> list[str]:
    """--chat_template: a readable Jinja file that parses (its syntax error named by line)."""
    p = Path(path)
    if p.is_dir():
        inside = sorted(x.name for x in p.glob("*.jinja"))
        return [f"chat_template: {path} is a folder; give the Jinja file itself"
                + (f", e.g. {p / inside[0]}" if inside else " (e.g. chatml.jinja)")]
    if not p.is_file():
        return [f"chat_template: {path}: no such file (give a Jinja chat template file, e.g. chatml.jinja)"]
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return [f"chat_template: {path}: cannot read it as UTF-8 text ({e})"]
    import jinja2
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}  # transformers' {% generation %} block (assistant masks); parsed, never run here

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols", Generation]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        return [f"chat_template: {path}:{e.lineno}: not a valid Jinja template: {e.message}"]
    if not text.strip():
        return [f"chat_template: {path}: the file is empty"]
    return []


def resolve_model_or_problems(model: ModelConfig, *, config_only: bool = False) -> list[str]:
    """A Hub repo id becomes its snapshot folder in the HF cache; then the local-folder checks apply to whatever
    model_name_or_path now names. `model._hub` (an attribute, not a flag: finetune.models.hub.HubModel) keeps the
    repo id and the commit for the saved config and recipe."""
    from finetune.models.hub import HubError, looks_like_repo_id, resolve_model

    if getattr(model, "_hub", None) is None and looks_like_repo_id(model.model_name_or_path):
        try:
            model._hub = resolve_model(model.model_name_or_path, model.model_revision,
                                       allow_pickle=model.allow_pickle, config_only=config_only)
        except HubError as e:
            return [str(e)]
        model.model_name_or_path = model._hub.folder
    if config_only:
        ok = (Path(model.model_name_or_path) / "config.json").is_file()
        return [] if ok else [f"model_name_or_path: {model.model_name_or_path}: no such folder with a config.json"]
    problems = check_model_folder(model.model_name_or_path, model.allow_pickle,
                                  trust_remote_code=getattr(model, "trust_remote_code", False))
    hub = getattr(model, "_hub", None)
    if problems and hub is not None:
        # A snapshot can hold part of a repo (e.g. the config.json alone that `finetune plan` fetched).
        problems = [f"{problems[0]} (the cached snapshot of {hub.repo_id} at {hub.revision}; go online, without "
                    "HF_HUB_OFFLINE, to fetch the rest)"]
    return problems


def writable_problem(flag: str, folder) -> str | None:
    """Why `folder` (made if absent) cannot hold our outputs, or None. Checked before anything is loaded: a file in its
    place, or a read-only or unwritable place, would otherwise stop the run at its first save."""
    import tempfile

    p = Path(folder)
    if p.exists() and not p.is_dir():
        return f"{flag} {p}: is a file, not a folder; choose a folder (new or existing)"
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{flag} {p}: {existing} is a file, so the folder cannot be made there; choose another path"
    try:  # an unnamed file, gone when closed: nothing is left behind
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        return (f"{flag} {p}: cannot write in {existing} ({e.strerror}); choose a folder you can write to, "
                "or fix its permissions or mount")
    return None


# Attention kernels that need a package and a GPU, with the package to install.
_FLASH = {"flash_attention_2": "flash-attn", "flash_attention_3": "flash-attn-3 (flash_attn_interface)",
          "flash_attention_4": "flash-attn-4"}


def attn_problems(name: str | None, flag: str = "attn_implementation") -> list[str]:
    """An attention kernel transformers does not know, or a flash kernel that cannot run here."""
    if not name or "/" in name:  # a Hub kernel (org/repo): transformers fetches and checks it
        return []
    if name in ("sdpa", "eager"):  # transformers' own, always known: no need to import it (seconds) to ask
        return []
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if name not in known:
        shown = [k for k in known if "|" not in k]
        return [f"{flag}: '{name}' is not an attention kernel{did_you_mean(name, shown)} (one of {', '.join(shown)})"]
    if name in _FLASH:
        import importlib.util

        import torch

        module = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}.get(name, "flash_attn")
        if not torch.cuda.is_available():
            return [f"{flag}: {name} runs on CUDA GPUs only and none is visible; use sdpa (the default) or eager"]
        if importlib.util.find_spec(module) is None:
            return [f"{flag}: {name} needs the {_FLASH[name]} package (pip install {_FLASH[name].split()[0]}); "
                    "or use sdpa (the default)"]
    return []


def family_problems(model: ModelConfig, data=None) -> list[str]:
    """What the model's family cannot run with these flags (an attention kernel it lacks, packing of its image
    records), from its config.json."""
    import json

    from finetune.models import families

    try:
        d = json.loads((Path(model.model_name_or_path) / "config.json").read_text())
    except (OSError, ValueError):
        return []  # the load reports an unreadable config.json itself
    family = families.find(d if isinstance(d, dict) else {})
    problem = family.attention_problem(model.attn_implementation) if family is not None else None
    problems = [f"{problem} ({model.model_name_or_path}/config.json: model_type '{d.get('model_type')}')"] if problem else []
    problems += tiled_mlp_problems(model, family, d)
    if not getattr(model, "freeze_vision_tower", True) and isinstance(d, dict) and "vision_config" not in d:
        problems.append(f"freeze_vision_tower: false trains a vision tower, and {model.model_name_or_path} is a "
                        "text-only model (its config.json has no vision_config); leave the flag out")
    flag = next((f for f in ("packing", "padding_free") if getattr(data, f, False)), None)
    if flag and family is not None and family.vision and family.packing_refusal:
        problems.append(f"{flag}: the {family.name} family's records are not packed: {family.packing_refusal} "
                        f"({model.model_name_or_path}/config.json: model_type '{d.get('model_type')}'); leave "
                        f"--{flag} out")
    return problems + lora_target_problems(model, family, d)


def tiled_mlp_problems(model: ModelConfig, family, d: dict) -> list[str]:
    """--tiled_mlp on a mixture-of-experts model: refused (finetune.models.tiled: its blocks route per token and
    record router logits for the load-balancing loss, which tiles would split)."""
    if not getattr(model, "tiled_mlp", False) or family is None:
        return []
    try:
        shape = family.shape(d)
    except Exception:  # noqa: BLE001 - an unusual config.json: the family's load decides
        return []
    if any(shape.is_sparse(k) for k in range(shape.num_layers)):
        return [f"tiled_mlp: {model.model_name_or_path} is a mixture-of-experts model (model_type "
                f"'{d.get('model_type')}'), whose expert blocks route each token and record router logits for the "
                "load-balancing loss: tiling covers dense MLPs only; leave --tiled_mlp out"]
    return []


def lora_target_problems(model: ModelConfig, family, d: dict) -> list[str]:
    """--lora_target_modules naming no module of the family's model (its parameter tensors' paths, read from
    config.json, as models/load.py's check_lora_targets finds them on the built model, later): the same line, before
    the data or the model loads. A config the family cannot shape (a vision tower's modules) is left to that check."""
    targets = list(getattr(model, "lora_target_modules", None) or [])  # (generate's flags have none)
    if not getattr(model, "use_peft", False) or family is None or not targets or targets == ["all-linear"]:
        return []
    try:
        tensors = family.shape(d).tensors()
    except Exception:  # noqa: BLE001 - an unusual config.json: the load-time check on the built model decides
        return []
    modules = {"lm_head"} | {t.name.rsplit(".", i)[0] for t in tensors for i in range(1, t.name.count(".") + 1)}
    linear = sorted({t.name.split(".")[-2] for t in tensors if t.kind == "linear"} | {"lm_head"})
    missing = [t for t in targets if not any(m == t or m.endswith("." + t) for m in modules)]
    if not missing or "vision_config" in d:
        return []
    hints = "; ".join(f"'{t}'{did_you_mean(t, linear)}" for t in missing)
    return [f"--lora_target_modules: {hints}: no such module in {model.model_name_or_path} (its linear layers: "
            f"{', '.join(linear)}; or all-linear)"]


def check_model_folder(path: str, allow_pickle: bool, *, trust_remote_code: bool = False) -> list[str]:
    p = Path(path)
    if not p.is_dir():
        hint = " (not a local folder, nor a Hub repo id org/name)" if "/" in path and not p.exists() else ""
        return [f"model_name_or_path: {path}: no such folder{hint}"]
    if not (p / "config.json").is_file():
        return [f"model_name_or_path: {path}: no config.json in this folder; is it a Hugging Face model folder?"]
    has_safetensors = any(p.glob("*.safetensors"))
    has_pickle = any(p.glob("*.bin")) or any(p.glob("*.pt"))
    if not has_safetensors and has_pickle and not allow_pickle:
        return [
            f"model_name_or_path: {path} holds only pickle weights (*.bin); loading pickle can run arbitrary code. "
            "Convert to safetensors, or pass --allow_pickle if you trust the files"
        ]
    if not has_safetensors and not has_pickle:
        return [f"model_name_or_path: {path}: no weights (*.safetensors) in this folder"]
    from finetune.models.files import folder_problems

    return [f"model_name_or_path: {problem}" for problem in folder_problems(p, trust_remote_code=trust_remote_code)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_training_arguments(values: dict[str, Any], preset: Preset | None):
    """Build TrainingArguments; with DeepSpeed this must happen before the model loads (ZeRO-3 zero.Init), and
    under a launcher after the process group has started (parse's `before_arguments`)."""
    import torch
    from transformers import TrainingArguments

    kwargs = dict(values)
    # --gradient_checkpointing (the name users, TRL and our docs know) is transformers 5's deprecated alias of
    # --activation_checkpointing: pass it under the new name, so it means the same without a FutureWarning.
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if old in kwargs:
            value = kwargs.pop(old)
            if kwargs.get(new) is None:
                kwargs[new] = value
    if not torch.cuda.is_available():
        kwargs["use_cpu"] = True
    if preset is not None and preset.is_deepspeed:
        if preset.nvme_path:
            Path(preset.nvme_path).mkdir(parents=True, exist_ok=True)
        # The dict, not the file: the JSON is read once per process (finetune.config.preset), and transformers
        # fills its "auto" values into a copy of its own.
        kwargs["deepspeed"] = copy.deepcopy(preset.ds_config)
    if preset is not None and preset.is_fsdp:
        # TrainingArguments turns these into accelerate's FSDP plugin arguments (args.fsdp_plugin_args): the Trainer
        # builds its plugin from them, and so does the loop.
        kwargs["fsdp"], kwargs["fsdp_config"] = True, preset.fsdp_training_arguments()
    try:
        return TrainingArguments(**kwargs), []
    except (ValueError, TypeError) as e:
        return None, [f"training arguments: {e}"]


def save_resolved(cfg: FinetuneConfig, output_dir: str | Path) -> Path:
    """Write the resolved config as a recipe (atomically); `--recipe` on this file reproduces the run."""
    import yaml

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "finetune_config.yaml"
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(yaml.safe_dump(cfg.resolved(), sort_keys=False))
    os.replace(tmp, target)
    return target
