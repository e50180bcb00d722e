"""The HF export type (`finetune export --to hf`, the default): a plain Hugging Face folder (safetensors, config,
tokenizer, generation config) from a LoRA adapter merged into its base or a DeepSpeed ZeRO checkpoint consolidated.

Merge: the base is loaded in full precision (--torch_dtype, default float32), also when the adapter was trained
on a 4-bit or 8-bit base (QLoRA): merging into quantized weights would round the update away.
ZeRO: the fp32 master weights are rebuilt from the DeepSpeed partitions (deepspeed.utils.zero_to_fp32), whatever
the training precision; config and tokenizer come from the checkpoint folder (or --model_name_or_path).

Verified before it is moved into place: no empty or non-finite tensors, the folder reloads with from_pretrained,
and the reloaded model's logits on a fixed input match the in-memory model within --atol (1e-5; fp32). A merge
must also match base + adapter within --atol times the largest |logit|. Other export types start from this
folder (`hf_folder`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from finetune import compat
from finetune.convert.messages import ExportError, log
from finetune.convert.writers.base import ExportArgs, Writer
from finetune.models.verify import DEFAULT_ATOL, VerificationError, fixed_input, logits_of, verify_saved


# ----------------------------------------------------------------------------------------------
# Staging and moving into place


def _staging(output_dir: Path) -> Path:
    staging = output_dir.parent / f".{output_dir.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _check_output(output_dir: Path, overwrite: bool) -> None:
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())) and not overwrite:
        raise ExportError(f"--output_dir {output_dir} exists and is not empty; pass --overwrite to replace it")


def _move_into_place(staging: Path, output_dir: Path) -> None:
    """The verified folder replaces the output folder in one rename (a crash leaves the old one or the new one)."""
    old = None
    if output_dir.exists():
        old = output_dir.parent / f".{output_dir.name}.old-{os.getpid()}"
        os.replace(output_dir, old)
    os.replace(staging, output_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def copy_tokenizer(sources: list[Path], dest: Path, vision: bool = False) -> Path | None:
    """Save the tokenizer of the first source folder that has one (through AutoTokenizer, so it is loadable); a
    vision-language model's whole processor (image processor, tokenizer, chat template: load_processor), verified to
    render as its source's (verify_processor)."""
    from transformers import AutoTokenizer

    if vision:
        from finetune.models.load import PROCESSOR_FILES, WeightsError, load_processor
        from finetune.models.verify import verify_processor

        for src in sources:
            if src is not None and any((src / f).is_file() for f in PROCESSOR_FILES):
                try:
                    load_processor(src).save_pretrained(str(dest))
                except WeightsError as e:
                    raise ExportError(str(e)) from None
                tokens = verify_processor(dest, src)
                log(f"processor of {src} saved and verified (a conversation with an image: {tokens} tokens alike)")
                return src
        raise ExportError(f"no processor in {', '.join(str(s) for s in sources if s is not None)}: a vision-language "
                          "model's folder needs its processor files (processor_config.json or preprocessor_config.json, "
                          "the tokenizer, chat_template.jinja); copy them from the model it was trained from")
    for src in sources:
        if src is not None and (src / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(src))
            tokenizer.save_pretrained(str(dest))
            return src
    return None


# ----------------------------------------------------------------------------------------------
# LoRA merge


def merge_adapter(
    adapter: str | Path, output_dir: str | Path, *, base_model: str | None = None, torch_dtype: str = "float32",
    atol: float = DEFAULT_ATOL, overwrite: bool = False, max_shard_size: str = "5GB",
) -> dict:
    """Merge a LoRA adapter into its base, save a plain HF folder, verify it. Returns the measured numbers."""
    import torch
    import transformers
    from peft import PeftModel

    from finetune.models.adapter import AdapterError, check_adapter
    from finetune.models.load import (WeightsError, check_loading_info, empty_model, is_vision, model_class,
                                      new_head_keys, resolve_dtype, saved_task)

    adapter, output_dir = Path(adapter), Path(output_dir)
    if not (adapter / "adapter_config.json").is_file():
        raise ExportError(f"--adapter {adapter}: no adapter_config.json (is it a PEFT adapter folder?)")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    base_path = base_model or cfg.get("base_model_name_or_path")
    if not base_path or not (Path(base_path) / "config.json").is_file():
        raise ExportError(
            f"--adapter {adapter}: its base model {base_path!r} is not a local model folder; pass --model_name_or_path"
        )
    _check_output(output_dir, overwrite)
    dtype = resolve_dtype(torch_dtype)
    try:
        check_adapter(str(adapter), base_path, empty_model(base_path, torch.float32))
    except AdapterError as e:
        raise ExportError(str(e)) from None

    # Merge in fp32, where merged vs base + adapter is checked to --atol; cast to --torch_dtype afterwards.
    # A reward model's adapter (task SEQ_CLS) merges into its base with the score head it trained (modules_to_save).
    task, head_kwargs = saved_task(adapter)
    base_config = transformers.AutoConfig.from_pretrained(base_path)
    base, info = model_class(base_config, task).from_pretrained(base_path, dtype=torch.float32,
                                                                output_loading_info=True, **head_kwargs)
    try:
        check_loading_info(new_head_keys(info, task)[0], base_path, flag="base model")
    except WeightsError as e:
        raise ExportError(str(e)) from None
    with compat.quiet_checkpointing_alias():
        model = PeftModel.from_pretrained(base, str(adapter), is_trainable=False).eval()
    ids = fixed_input(model.get_base_model().config.get_text_config().vocab_size)
    with_adapter = logits_of(model, ids)
    merged = model.merge_and_unload()
    merged.eval()
    merged_logits = logits_of(merged, ids)
    merge_diff = (merged_logits - with_adapter).abs().max().item()
    # W + s*B@A rounded to fp32 moves each logit by fp32 rounding of its own size: the bound scales with the largest
    # |logit| (the quickstart's SmolLM2 adapter: 8.4e-5 at |logit| 35, 2.4e-6 relative). A wrong merge is off by >1%.
    merge_limit = atol * max(1.0, with_adapter.abs().max().item())
    if not merge_diff <= merge_limit:
        raise VerificationError(
            f"merging {adapter} into {base_path} changed the logits by {merge_diff:.3g} (limit {merge_limit:.3g}: "
            f"--atol {atol:g} x the largest |logit|)"
        )
    merged.config.use_cache = True  # training saves use_cache=False; an exported model is for inference
    if dtype != torch.float32:
        # Cast the weights only: `.to(dtype)` would also cast buffers such as the rotary inv_freq, which
        # from_pretrained(dtype=...) keeps in fp32, and the in-memory model would differ from every reload.
        for param in merged.parameters():
            param.data = param.data.to(dtype)
    staging = _staging(output_dir)
    try:
        merged.save_pretrained(str(staging), safe_serialization=True, max_shard_size=max_shard_size)
        copy_tokenizer([adapter, Path(base_path)], staging, vision=is_vision(base_config))
        report = HF().verify(staging, merged, atol=atol, input_ids=ids)
        _move_into_place(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(str(report).replace(str(staging), str(output_dir)))
    log(f"merged {adapter} into {base_path}: merged vs base+adapter logits max diff {merge_diff:.3g} (fp32)"
        + ("" if dtype == torch.float32 else f"; written as {str(dtype).replace('torch.', '')}"))
    return {"merge_diff": merge_diff, "reload_diff": report.max_logit_diff, "output_dir": str(output_dir)}


# ----------------------------------------------------------------------------------------------
# DeepSpeed ZeRO checkpoint -> HF folder


def _find_zero_checkpoint(path: Path, tag: str | None) -> tuple[Path, str | None]:
    """Accept the Trainer's checkpoint-N folder (with a `latest` file) or the global_stepN folder itself."""
    if not path.is_dir():
        raise ExportError(f"--zero_checkpoint {path}: no such folder")
    if list(path.glob("*_model_states.pt")):
        return path.parent, tag or path.name
    if tag is not None:
        if not (path / tag).is_dir():
            raise ExportError(f"--zero_checkpoint {path}: no {tag} folder inside")
        return path, tag
    if (path / "latest").is_file():
        return path, None
    steps = sorted(p.name for p in path.glob("global_step*") if p.is_dir())
    if len(steps) == 1:
        return path, steps[0]
    hint = f" (found {', '.join(steps)}; pick one with --tag)" if steps else ""
    raise ExportError(f"--zero_checkpoint {path}: not a DeepSpeed checkpoint folder (no 'latest' file){hint}")


def zero_state_dict(checkpoint: str | Path, tag: str | None = None) -> dict:
    """The consolidated fp32 state dict of a ZeRO-1/2/3 checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt_dir, tag = _find_zero_checkpoint(Path(checkpoint), tag)
    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    # The rebuilt tensors can be views of one flat buffer; safetensors wants each tensor on its own.
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def convert_zero_checkpoint(
    checkpoint: str | Path, output_dir: str | Path, *, tag: str | None = None, base_model: str | None = None,
    torch_dtype: str = "float32", atol: float = DEFAULT_ATOL, overwrite: bool = False, max_shard_size: str = "5GB",
) -> dict:
    """Write a ZeRO checkpoint's weights as a plain HF folder and verify it against the consolidated state dict."""
    import torch
    from transformers import AutoConfig, GenerationConfig

    from finetune.models.load import is_vision, model_class, resolve_dtype

    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    ckpt_dir, _ = _find_zero_checkpoint(checkpoint, tag)
    config_src = Path(base_model) if base_model else ckpt_dir
    if not (config_src / "config.json").is_file():
        raise ExportError(
            f"{config_src}: no config.json to describe the model; pass --model_name_or_path with the folder training started from"
        )
    _check_output(output_dir, overwrite)
    state = zero_state_dict(checkpoint, tag)
    if any("lora_" in k for k in state):
        raise ExportError(
            f"{checkpoint} holds a LoRA model: its adapter is already consolidated in the checkpoint folder "
            f"(adapter_model.safetensors); merge it with: finetune export --adapter {ckpt_dir} --output_dir DIR"
        )
    dtype = resolve_dtype(torch_dtype)
    if dtype != torch.float32:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    config = AutoConfig.from_pretrained(str(config_src))
    with torch.device("meta"):
        skeleton = model_class(config).from_config(config, dtype=dtype)
    expected = set(skeleton.state_dict())
    tied = {k for k in expected if k not in state and _is_tied(skeleton, k)}
    missing = sorted(expected - set(state) - tied)
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ExportError(
            f"{checkpoint}: its weights do not match {config_src}/config.json "
            f"(missing: {', '.join(missing[:3]) or 'none'}; unexpected: {', '.join(unexpected[:3]) or 'none'})"
        )
    skeleton.config.use_cache = True
    staging = _staging(output_dir)
    try:
        skeleton.save_pretrained(str(staging), state_dict=dict(state), safe_serialization=True, max_shard_size=max_shard_size)
        if (config_src / "generation_config.json").is_file():
            GenerationConfig.from_pretrained(str(config_src)).save_pretrained(str(staging))
        copy_tokenizer([ckpt_dir, Path(base_model) if base_model else None], staging, vision=is_vision(config))
        report = HF().verify(staging, state, atol=atol)
        _move_into_place(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(str(report).replace(str(staging), str(output_dir)))
    return {"reload_diff": report.max_logit_diff, "tensor_diff": report.max_tensor_diff, "output_dir": str(output_dir)}


def _is_tied(model, key: str) -> bool:
    """Whether `key` is a tied alias (e.g. lm_head.weight when tie_word_embeddings is set)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return key in tied or bool(getattr(model.config, "tie_word_embeddings", False) and key == "lm_head.weight")


# ----------------------------------------------------------------------------------------------
# The export type


class HF(Writer):
    name = "hf"
    summary = "a model folder (safetensors)"

    def write(self, args: ExportArgs, flags) -> Path:
        _write(args, Path(args.output_dir), torch_dtype=args.torch_dtype, overwrite=args.overwrite)
        return Path(args.output_dir)

    def verify(self, written: Path, reference, *, atol: float = DEFAULT_ATOL, input_ids=None):
        """The folder reloads with from_pretrained to REFERENCE's weights (a model or a state dict) and logits."""
        return verify_saved(written, reference, atol=atol, input_ids=input_ids)


@contextmanager
def hf_folder(args: ExportArgs, near: Path) -> Iterator[Path]:
    """The export's source as an HF folder, for the export types that write from one: a model folder as it is; an
    adapter merged or a ZeRO checkpoint consolidated (fp32, verified as for --to hf) into a temporary folder next
    to NEAR when that folder exists (same disk as the result), else in the system temp folder; removed afterwards."""
    if args.source == "model":
        yield Path(args.model_name_or_path)
        return
    with tempfile.TemporaryDirectory(prefix=".finetune-export-", dir=near.parent if near.parent.is_dir() else None) as tmp:
        folder = Path(tmp) / "hf"
        _write(args, folder, torch_dtype="float32", overwrite=False)
        yield folder


def _write(args: ExportArgs, output_dir: Path, *, torch_dtype: str, overwrite: bool) -> dict:
    common = {"base_model": args.model_name_or_path, "torch_dtype": torch_dtype, "atol": args.atol,
              "overwrite": overwrite, "max_shard_size": args.max_shard_size}
    if args.adapter:
        return merge_adapter(args.adapter, output_dir, **common)
    return convert_zero_checkpoint(args.zero_checkpoint, output_dir, tag=args.tag, **common)
