"""Loading tokenizers, processors and models (text, and vision-language: Family.vision): dtype, quantization, LoRA.
Shared by every training path."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

# The bitsandbytes 4-bit CPU repacking guard (a workaround for bitsandbytes internals); load_model applies it.
from finetune.compat import declare_loss_kwargs, guard_4bit_training, outside_zero3, quiet_checkpointing_alias  # noqa: F401
from finetune.models import families
from finetune.models.freeze import freeze_unused_tower, freeze_vision, run_tower_on_every_batch


class WeightsError(ValueError):
    """The weights file does not hold the weights the config describes; the message names keys and file."""


DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(model_cfg):
    """The folder's tokenizer, right-padded; WeightsError when it holds ids past the model's vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    from finetune.models.files import vocabulary_problem

    folder = model_cfg.model_name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError) as e:
        # The folder's files passed finetune.models.files' checks; what is left is a tokenizer transformers cannot
        # build (e.g. a class it does not know), which it words as a missing sentencepiece or tiktoken install.
        raise WeightsError(f"--model_name_or_path {folder}: its tokenizer cannot be loaded "
                           f"({str(e).strip().splitlines()[0][:300]}); copy the tokenizer files of the model it was "
                           "trained from (tokenizer.json, tokenizer_config.json) into the folder") from None
    if getattr(model_cfg, "chat_template", None):
        # --chat_template: a base model gets a chat format; saved with the tokenizer, so generate and export use it too.
        tokenizer.chat_template = Path(model_cfg.chat_template).read_text(encoding="utf-8")
    tokenizer.padding_side = "right"
    ensure_pad_token(tokenizer)
    if not (Path(folder) / "config.json").is_file():
        return tokenizer  # a tokenizer-only folder: no vocabulary to check against
    config = AutoConfig.from_pretrained(folder, trust_remote_code=model_cfg.trust_remote_code)
    if problem := vocabulary_problem(folder, tokenizer, getattr(config, "get_text_config", lambda: config)()):
        raise WeightsError(f"--model_name_or_path {problem}")
    return tokenizer


def ensure_pad_token(tokenizer) -> None:
    """Give the tokenizer a pad token without resizing the model.

    Prefer an existing pad, then unk. Otherwise reuse EOS as the pad *id*: this is safe here because
    the collator masks padding by position, never by `input_ids == pad_token_id`, so EOS stays trained.
    """
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id != tokenizer.eos_token_id:
        tokenizer.pad_token = tokenizer.unk_token
    else:
        tokenizer.pad_token = tokenizer.eos_token


def resolve_dtype(name: str) -> torch.dtype:
    if name != "auto":
        return DTYPE_NAMES[name]
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


# The quantization config and its rules live in finetune.models.quant; these names stay importable from here.
from finetune.models.quant import QUANT_TYPES, check_quantized_setup, is_quantized, quantization_config  # noqa: E402,F401


def empty_model(model_path: str, dtype, trust_remote_code: bool = False):
    """The model's modules with parameters on the meta device (no memory, no weights read)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return model_class(config).from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def is_vision(config) -> bool:
    """Whether CONFIG (a transformers config or a config.json dict) is a vision-language family's (Family.vision)."""
    family = families.find(config)
    return bool(family is not None and family.vision)


def model_class(config, task: str = "CAUSAL_LM"):
    """transformers' Auto class that builds CONFIG's model for TASK (TASKS): a vision-language family's
    AutoModelForImageTextToText (its *ForConditionalGeneration: tower, projector and language model) for the causal
    LM; TASKS' class otherwise (a text model loads exactly as it always has)."""
    import transformers

    if task == "CAUSAL_LM" and is_vision(config):
        return transformers.AutoModelForImageTextToText
    return getattr(transformers, TASKS[task][0])


# The files a saved processor adds to a tokenizer's (transformers 5 writes processor_config.json; published folders
# of older releases hold preprocessor_config.json).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def load_processor(folder, trust_remote_code: bool = False):
    """A vision-language model folder's processor (AutoProcessor: its image processor, tokenizer and chat template),
    built without torchvision where it is missing (finetune.compat.processors_without_video); WeightsError naming the
    folder when it holds none."""
    from transformers import AutoProcessor

    from finetune.compat import processors_without_video

    processors_without_video()
    try:
        processor = AutoProcessor.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError) as e:
        raise WeightsError(f"--model_name_or_path {folder}: its processor cannot be loaded "
                           f"({str(e).strip().splitlines()[0][:300]}); a vision-language model folder needs the "
                           "processor files of the model it was trained from (processor_config.json or "
                           "preprocessor_config.json, the tokenizer files, chat_template.jinja)") from None
    if not hasattr(processor, "image_processor"):  # AutoProcessor's fallback for a folder with a tokenizer only
        raise WeightsError(f"--model_name_or_path {folder}: it holds a tokenizer but no image processor "
                           "(processor_config.json or preprocessor_config.json); copy the processor files of the model "
                           "it was trained from into the folder")
    return processor


def quantized_device_map() -> dict:
    """Under DDP each rank keeps its own quantized copy on its own device (GPU LOCAL_RANK, or the CPU)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return {"": local_rank if torch.cuda.is_available() else "cpu"}


# The model a method trains, by its peft task type (finetune.methods.base.Method.task): (transformers' Auto class,
# its from_pretrained arguments, the weights a causal-LM checkpoint lacks (a new head, initialized here) and holds
# that this model has not (the LM head it drops)).
TASKS = {
    "CAUSAL_LM": ("AutoModelForCausalLM", {}, (), ()),
    # A reward model: a score head of one output on the last non-pad token (transformers' *ForSequenceClassification).
    "SEQ_CLS": ("AutoModelForSequenceClassification", {"num_labels": 1}, ("score.",), ("lm_head.",)),
}


def saved_task(folder) -> tuple[str, dict]:
    """(task of TASKS, from_pretrained arguments of the base) a saved folder loads with: a reward model ("SEQ_CLS":
    a *ForSequenceClassification config, or a SEQ_CLS adapter, whose base gets the score head of one output and the
    pad id of the folder's tokenizer, as training set them) or the causal LM."""
    import json

    folder = Path(folder)
    adapter = folder / "adapter_config.json"
    if adapter.is_file():
        task = json.loads(adapter.read_text()).get("task_type")
        if task not in TASKS or not TASKS[task][1]:  # the causal LM (a task without a head of its own)
            return "CAUSAL_LM", {}
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        ensure_pad_token(tokenizer)
        return task, {**TASKS[task][1], "pad_token_id": tokenizer.pad_token_id}
    config = folder / "config.json"
    architectures = json.loads(config.read_text()).get("architectures") or [] if config.is_file() else []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return "SEQ_CLS", {}
    return "CAUSAL_LM", {}


def new_head_keys(info: dict, task: str) -> tuple[dict, list[str]]:
    """(from_pretrained's loading info without what a causal-LM checkpoint loaded as `task` lacks and holds by design:
    the new head's weights and the LM head; the new head's weight names, initialized by from_pretrained)."""
    _, _, new_keys, dropped_keys = TASKS[task]
    if not new_keys:
        return info, []
    info = dict(info)
    fresh = [str(k) for k in info.get("missing_keys") or [] if str(k).startswith(new_keys)]
    info["missing_keys"] = [k for k in info.get("missing_keys") or [] if str(k) not in fresh]
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys") or [] if not str(k).startswith(dropped_keys)]
    return info, fresh


def load_model(model_cfg, training_args=None, task: str = "CAUSAL_LM"):
    """Load the model; with ZeRO-3 the TrainingArguments must already exist so weights load partitioned. `task`: the
    model class the method trains (TASKS)."""
    from transformers import AutoConfig

    _, head_kwargs, new_keys, _ = TASKS[task]
    check_quantized_setup(model_cfg)
    if model_cfg.use_peft:
        check_lora_targets(model_cfg)
    dtype = resolve_dtype(model_cfg.torch_dtype)
    # Under FSDP2 (TrainingArguments.fsdp) a 4-bit base is stored in its compute dtype, so fully_shard shards it.
    quant = quantization_config(model_cfg, dtype, sharded=bool(getattr(training_args, "fsdp", None)))
    kwargs = {}
    if quant is not None:
        # Each rank keeps its own quantized copy on its own device.
        kwargs["device_map"] = quantized_device_map()
        kwargs["quantization_config"] = quant
    if new_keys:
        # A head the checkpoint lacks is drawn from the global RNG: seeded, so every rank (and a rerun) draws it alike.
        torch.manual_seed(training_args.seed if training_args else 0)
    auto = model_class(AutoConfig.from_pretrained(model_cfg.model_name_or_path,
                                                  trust_remote_code=model_cfg.trust_remote_code), task)
    with quiet_load_report():
        model, info = auto.from_pretrained(
            model_cfg.model_name_or_path,
            dtype=dtype,
            attn_implementation=model_cfg.attn_implementation,
            trust_remote_code=model_cfg.trust_remote_code,
            use_safetensors=not model_cfg.allow_pickle,
            output_loading_info=True,
            **head_kwargs,
            **kwargs,
        )
    info, fresh = new_head_keys(info, task)
    if fresh and int(os.environ.get("RANK", "0")) == 0:
        print(f"model: {', '.join(fresh)} not in {model_cfg.model_name_or_path}: a new {type(model).__name__} head, "
              f"initialized (seed {training_args.seed if training_args else 0})", flush=True)
    check_loading_info(info, model_cfg.model_name_or_path)
    declare_loss_kwargs(model)  # the Trainer's global-batch token mean for Qwen's VLMs (finetune.compat)
    if is_vision(model.config) and getattr(model_cfg, "freeze_vision_tower", True) and not model_cfg.use_peft:
        freeze_vision(model)  # full fine-tuning of the language model (LoRA freezes everything but its adapters)
    if is_vision(model.config):
        run_tower_on_every_batch(model)  # ZeRO-3's gathers and DDP's reductions on every rank's micro-batch
    from finetune.models.hub import stamp_config

    stamp_config(model.config, getattr(model_cfg, "_hub", None))
    gradient_checkpointing = bool(training_args and training_args.activation_checkpointing)
    if quant is not None:
        from finetune.models.quant import prepare_for_training

        model = prepare_for_training(model)  # frozen, in its own dtype (peft's would cast to fp32)
        guard_4bit_training(model)
        print(describe_quantization(model, model_cfg, quant), flush=True)
    if model_cfg.use_peft:
        model = add_lora(model, model_cfg, seed=training_args.seed if training_args else 0, task=task)
        if gradient_checkpointing:
            model.enable_input_require_grads()
    if is_vision(model.config):
        freeze_unused_tower(model)  # --freeze_vision_tower false: what no image reaches gets no gradient, DDP's refusal
    # The KV cache is useless in training and breaks gradient checkpointing; with one, transformers also skips
    # finding packed records from their positions (a vision-language model's decoder reads its text_config's).
    set_use_cache(model.config, False)
    return model


def set_use_cache(config, value: bool) -> None:
    """use_cache on the config and on its text config (a vision-language model's decoder reads that one)."""
    config.use_cache = value
    config.get_text_config().use_cache = value


@contextlib.contextmanager
def quiet_load_report():
    """from_pretrained logs a table of missing / unexpected keys as a warning; check_loading_info turns any such key
    into one error message instead, so the table would only bury it."""
    import logging

    # tensor_parallel: with unexpected keys it also lists "layers not sharded", which means nothing here.
    loggers = [logging.getLogger(f"transformers.{name}") for name in ("modeling_utils", "distributed.tensor_parallel")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def weight_files(folder) -> str:
    from pathlib import Path

    folder = Path(folder)
    names = sorted(p.name for p in folder.glob("*.safetensors*")) or sorted(p.name for p in folder.glob("*.bin*"))
    return ", ".join(str(folder / n) for n in names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "") \
        if names else str(folder)


def check_loading_info(info: dict, folder, flag: str = "--model_name_or_path") -> None:
    """from_pretrained initialises weights it did not find at random and only logs it; for a full-model load any
    missing, unexpected or mis-shaped weight means the file is not this config's model: refuse it. transformers has
    already dropped tied weights (lm_head) and the patterns a model declares ignorable (non-persistent buffers)."""
    problems = []
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(map(str, info.get(what) or []))
        if keys:
            more = f" (and {len(keys) - 5} more)" if len(keys) > 5 else ""
            problems.append(f"{len(keys)} {what.replace('_', ' ')}: {', '.join(keys[:5])}{more}")
    if problems:
        raise WeightsError(
            f"{flag} {folder}: the weights in {weight_files(folder)} do not match its config.json "
            f"({'; '.join(problems)}); from_pretrained would give the missing ones random values. Check that config.json belongs to "
            "these weights and that the tensor names carry no extra prefix (such as 'module.' from a DDP or "
            "DeepSpeed state dict): rename them, or save the model with save_pretrained")


def describe_quantization(model, model_cfg, quant) -> str:
    """One line per rank: which quantized copy this process holds, and where."""
    import bitsandbytes as bnb

    layers = sum(isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)) for m in model.modules())
    if model_cfg.load_in_8bit:
        kind = "8-bit (LLM.int8)"
    else:
        kind = (f"4-bit {quant.bnb_4bit_quant_type}{' + double quant' if quant.bnb_4bit_use_double_quant else ''}, "
                f"compute {str(quant.bnb_4bit_compute_dtype).replace('torch.', '')}")
    device = next(iter(getattr(model, "hf_device_map", {"": "cpu"}).values()))
    rank = os.environ.get("RANK", "0")
    return f"rank {rank}: base loaded in {kind} by bitsandbytes on {device}: {layers} quantized linear layers"


def check_lora_targets(model_cfg) -> None:
    """--lora_target_modules naming no module of the model: WeightsError with the names there are, before any weight
    is read (the model is built on the meta device, which costs no memory)."""
    from transformers import AutoConfig

    from finetune.errors import did_you_mean

    targets = list(model_cfg.lora_target_modules or [])
    if not targets or targets == ["all-linear"]:
        return
    config = AutoConfig.from_pretrained(model_cfg.model_name_or_path, trust_remote_code=model_cfg.trust_remote_code)
    # Outside ZeRO-3: under it from_config would partition the meta copy and re-initialize it, which fails on meta
    # tensors (and would gather with collectives); the names are all this check needs.
    with torch.device("meta"), outside_zero3():
        model = model_class(config).from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    names = [name for name, _ in model.named_modules() if name]
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        hints = "; ".join(f"'{t}'{did_you_mean(t, linear)}" for t in missing)
        raise WeightsError(f"--lora_target_modules: {hints}: no such module in {model_cfg.model_name_or_path} "
                           f"(its linear layers: {', '.join(linear)}; or all-linear)")


def lora_target_modules(config, targets: list[str]) -> list[str] | str:
    """peft's target_modules: 'all-linear' is the model family's linear projections (finetune.models.families),
    or peft's own rule (every linear but the LM head) for a model_type no family covers; other names as given."""
    if targets != ["all-linear"]:
        return targets
    family = families.find(config)
    return family.peft_target_modules(config, family.lora_targets("all-linear")) if family is not None else "all-linear"


def lora_target_parameters(config, targets: list[str]) -> list[str] | None:
    """peft's target_parameters: a mixture-of-experts family's expert parameters under 'all-linear'."""
    family = families.find(config)
    if targets != ["all-linear"] or family is None or not family.expert_parameters():
        return None
    return list(family.expert_parameters())


def _dropout_on_linears(model, p: float) -> None:
    """--lora_dropout on the LoRA adapters of linear layers, where the experts' (peft's ParamWrapper, which cannot
    apply dropout: x is not factored out of lora_B(lora_A(dropout(x))) per expert) were made without it."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for module in model.modules():
        if isinstance(module, LoraLinear):
            for name in module.lora_dropout:
                module.lora_dropout[name] = torch.nn.Dropout(p)


def add_lora(model, model_cfg, seed: int, task: str = "CAUSAL_LM"):
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    experts = lora_target_parameters(model.config, model_cfg.lora_target_modules)
    config = LoraConfig(
        r=model_cfg.lora_r,
        lora_alpha=model_cfg.lora_alpha,
        # The experts' adapters take no dropout (ParamWrapper refuses any); the linears get it after, below. The
        # saved adapter_config.json says 0, so the adapter loads for inference, where dropout does nothing.
        lora_dropout=0.0 if experts else model_cfg.lora_dropout,
        # --freeze_vision_tower false: the vision tower's and projector's linear layers get adapters too.
        target_modules=("all-linear" if is_vision(model.config) and not getattr(model_cfg, "freeze_vision_tower", True)
                        and model_cfg.lora_target_modules == ["all-linear"]
                        else lora_target_modules(model.config, model_cfg.lora_target_modules)),
        target_parameters=experts,
        # SEQ_CLS: peft trains and saves the score head whole beside the adapters (modules_to_save).
        task_type=task,
    )
    # Seed here: LoRA's A matrices are drawn at creation, and every rank (and every resumed run) must draw the same.
    set_seed(seed)
    hub = getattr(model_cfg, "_hub", None)
    # A Hub base: adapter_config.json records the commit (base_model_name_or_path is the snapshot folder).
    with quiet_checkpointing_alias():
        model = get_peft_model(model, config, revision=hub.commit if hub else None)
    if experts and model_cfg.lora_dropout > 0:
        _dropout_on_linears(model, model_cfg.lora_dropout)
    return model
