"""`finetune export`: a trained model written as one of the export types of finetune.convert.writers (--to, default hf).

    finetune export --adapter OUT --output_dir merged            # merge a LoRA adapter into its base
    finetune export --adapter OUT --model_name_or_path BASE --output_dir merged
    finetune export --zero_checkpoint OUT/checkpoint-500 --output_dir consolidated   # DeepSpeed ZeRO checkpoint
    finetune export --to gguf --model_name_or_path merged model.gguf --gguf_type q8_0   # GGUF for llama.cpp / Ollama
    finetune export --to gguf --adapter OUT model.gguf                               # merged first, then GGUF
    python -m finetune.convert.export ...                                            # the same

Every export is verified before it is moved into place: hf: no empty or non-finite tensors, the folder reloads with
from_pretrained, and the reloaded model's logits on a fixed input match the in-memory model within --atol
(1e-5; fp32); a merge must also match base + adapter within --atol times the largest |logit|. gguf: the file loads
back to the weights written and to logits within its type's bound. A failed check is an error (exit 1), and the
output is not written. See finetune/convert/writers/ and docs/export.md.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import fields
from pathlib import Path

from finetune.config.ship import hub_problems
from finetune.convert import writers
from finetune.convert.messages import ExportError
from finetune.convert.writers.base import EXPORT_DTYPES, SOURCES, ExportArgs
from finetune.errors import did_you_mean
from finetune.models.verify import VerificationError
from finetune.ship.hub import HubFlags


def command():
    from finetune.config.parser import Command

    own = {w.name: w.flags for w in writers.WRITERS.values() if w.flags is not None}
    return Command("finetune export", {"type": writers.ExportType, "args": ExportArgs, **own, "hub": HubFlags},
                   description="Merge a LoRA adapter or consolidate a ZeRO checkpoint into a plain HF folder, or write a GGUF file "
                               "for llama.cpp and Ollama (--to gguf).",
                   epilog=__doc__.split("\n\n", 1)[1])


def _one_of(items: list[str], last: str) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])}{last}{items[-1]}"


def check_args(parsed) -> list[str]:
    args: ExportArgs = parsed.args
    to = parsed.type.to
    problems = []
    writer = writers.get(to)
    if writer is None:
        problems.append(f"--to: '{to}' is not one of {', '.join(writers.names())}{did_you_mean(to, writers.names())}")
    if args.output and args.output_dir and args.output != args.output_dir:
        problems.append(f"OUTPUT and --output_dir: give one ({args.output!r} or {args.output_dir!r})")
    if not (args.output or args.output_dir):
        problems.append("--output_dir (or OUTPUT): required: where the export is written")
    if writer is not None:
        if args.source not in writer.sources:
            flags = [SOURCES[s][0] for s in writer.sources]
            what = [SOURCES[s][1] for s in writer.sources]
            problem = f"{_one_of(flags, ' and ')}: give exactly one ({_one_of(what, ', or ')})"
            if args.source == "model":
                problem += f"; --model_name_or_path alone is a model folder, which --to {to} does not take"
            problems.append(problem)
        for other in writers.WRITERS.values():
            if other is not writer and other.flags is not None:
                problems += [f"--{f.name}: goes with --to {other.name}" for f in fields(other.flags)
                             if f.name in parsed.sources]
        problems += writer.check(args, parsed.sections.get(to))
    if args.torch_dtype not in EXPORT_DTYPES:
        problems.append(f"--torch_dtype: '{args.torch_dtype}' is not one of {', '.join(EXPORT_DTYPES)}")
    if not args.atol >= 0:
        problems.append(f"--atol: must not be negative, got {args.atol}")
    dest = args.output or args.output_dir
    if dest:
        from finetune.config.training import writable_problem

        # Every writer stages its result beside the destination and renames it into place.
        if problem := writable_problem("OUTPUT" if args.output else "--output_dir", Path(dest).resolve().parent):
            problems.append(problem)
    model = Path(args.model_name_or_path) if args.model_name_or_path else None
    if model and not (model / "config.json").is_file() and (model / "adapter_config.json").is_file():
        base = json.loads((model / "adapter_config.json").read_text()).get("base_model_name_or_path") or "BASE"
        problems.append(f"--model_name_or_path {model}: a LoRA adapter, not a model; give it as --adapter {model} "
                        f"and its base as --model_name_or_path {base}")
    if args.tag and not args.zero_checkpoint:
        problems.append("--tag: names a ZeRO checkpoint tag; it goes with --zero_checkpoint")
    problems += hub_problems(vars(parsed.hub), parsed.sources, prefix="--")
    return problems


def _resolve_model(args: ExportArgs) -> str | None:
    """A Hub model (given, or the base recorded in adapter_config.json) -> its snapshot folder in the HF cache."""
    from finetune.models.hub import HubError, looks_like_repo_id, resolve_model

    model, revision = args.model_name_or_path, args.model_revision
    if model is None and args.adapter and (Path(args.adapter) / "adapter_config.json").is_file():
        cfg = json.loads((Path(args.adapter) / "adapter_config.json").read_text())
        if looks_like_repo_id(cfg.get("base_model_name_or_path")):
            model, revision = cfg["base_model_name_or_path"], revision or cfg.get("revision")
    if not looks_like_repo_id(model):
        return args.model_name_or_path
    try:
        return resolve_model(model, revision or "main", flag="--model_name_or_path").folder
    except HubError as e:
        raise ExportError(str(e)) from None


def main(argv: list[str] | None = None) -> None:
    parsed = command().parse_or_exit(argv, check_args)
    args: ExportArgs = parsed.args
    writer = writers.get(parsed.type.to)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.output_dir = args.output_dir or args.output
    try:
        args.model_name_or_path = _resolve_model(args)
        written = writer.write(args, parsed.sections.get(writer.name))
    except ExportError as e:
        print(f"finetune export: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except VerificationError as e:
        print(f"finetune export: verification failed: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(args.output_dir if written is None else written)
    if parsed.hub.push_to_hub:
        push(args, parsed, Path(args.output_dir if written is None else written))


def push(args: ExportArgs, parsed, written: Path) -> None:
    """--push_to_hub: the verified export in one commit with a model card made from the run it came from (the
    adapter's folder, the ZeRO checkpoint's run folder, the model folder); a failure exits 1, the export intact."""
    from finetune.ship import hub

    if written.is_dir():
        files = hub.run_files(written)
        what = ("model (a LoRA adapter merged into its base)" if args.source == "adapter" else
                "model (consolidated from a ZeRO checkpoint)" if args.source == "zero_checkpoint" else "model")
    else:  # a GGUF file, with the Modelfile written beside it
        files = {written.name: written}
        if (written.parent / "Modelfile").is_file():
            files["Modelfile"] = written.parent / "Modelfile"
        flags = parsed.sections.get(parsed.type.to)
        what = f"GGUF file ({getattr(flags, 'gguf_type', '')})"
    if args.adapter:
        run = Path(args.adapter)
    elif args.zero_checkpoint:
        checkpoint = Path(args.zero_checkpoint)
        run = checkpoint.parent if (checkpoint.parent / "finetune_config.yaml").is_file() else checkpoint
    else:
        run = Path(args.model_name_or_path) if args.model_name_or_path else None
    files.update({k: v for k, v in hub.report_files(run).items() if k not in files})
    flags = parsed.hub
    hub.push_or_exit(written, files, run_folder=run, what=what, repo_id=flags.hub_model_id,
                     private=flags.hub_private_repo, token=flags.hub_token)


if __name__ == "__main__":
    main()
