"""What every export type is: a Writer (its name for --to, its own flags, its checks, write, verify), and the flags
all of them share (ExportArgs: what is exported, where, how closely it is checked)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from finetune.models.verify import DEFAULT_ATOL

EXPORT_DTYPES = ("float32", "bfloat16", "float16")
# What an export can start from: the flag that names it and what it is (the messages of `finetune export` say both).
SOURCES = {
    "model": ("--model_name_or_path", "a model folder"),
    "adapter": ("--adapter", "a LoRA adapter to merge"),
    "zero_checkpoint": ("--zero_checkpoint", "a ZeRO or FSDP2 checkpoint"),
}


@dataclass
class ExportArgs:
    """What to export (--adapter, --zero_checkpoint or a model folder), where, and how it is checked"""

    output: str | None = field(
        default=None, metadata={"help": "The file or folder to write; the same as --output_dir.", "positional": True})
    adapter: str | None = field(default=None, metadata={"help": "LoRA adapter folder to merge into its base."})
    zero_checkpoint: str | None = field(
        default=None, metadata={"help": "DeepSpeed checkpoint folder (the Trainer's checkpoint-N, or global_stepN), or "
                                        "an FSDP2 run's checkpoint-N (sharded weights; give --model_name_or_path)."})
    output_dir: str | None = field(
        default=None, metadata={"help": "Where the export is written (required): the HF folder, or with --to gguf the "
                                        ".gguf file."})
    model_name_or_path: str | None = field(
        default=None, metadata={
            "help": "The model, as for training: with --adapter, its base (default: the adapter's base_model_name_or_path); "
                    "with --zero_checkpoint, the folder with config.json and tokenizer when the checkpoint lacks them; "
                    "alone (--to gguf), the HF model folder to write. A folder or a Hub repo id.",
            "old_aliases": ("model_dir", "base_model")})
    model_revision: str | None = field(
        default=None, metadata={"help": "Branch, tag or commit of a Hub --model_name_or_path (default: the adapter's "
                                        "recorded revision, else main).",
                                "old_aliases": ("base_model_revision",)})
    tag: str | None = field(default=None, metadata={"help": "ZeRO checkpoint tag (global_stepN; default: the 'latest' file)."})
    torch_dtype: str = field(default="float32", metadata={"help": "Dtype of the written weights: float32, bfloat16, float16."})
    atol: float = field(default=DEFAULT_ATOL, metadata={"help": "Largest logit difference verification accepts."})
    max_shard_size: str = field(default="5GB", metadata={"help": "Largest safetensors shard written."})
    overwrite: bool = field(default=False, metadata={"help": "Replace a non-empty --output_dir (or an existing file)."})

    @property
    def source(self) -> str | None:
        """Which of SOURCES this export starts from (a --model_name_or_path beside --adapter is the adapter's base)."""
        if self.adapter and self.zero_checkpoint:
            return None
        return "adapter" if self.adapter else "zero_checkpoint" if self.zero_checkpoint else \
            "model" if self.model_name_or_path else None


class Writer:
    """One export type: `finetune export --to NAME`. A subclass sets the class attributes, and writes and verifies.

    name      the --to value (one line in finetune/convert/writers/__init__.py's WRITERS makes it one)
    summary   what it writes, for --to's help
    flags     a dataclass of its own flags (a section of the command), or None; another type's flag is refused
    sources   which of SOURCES it exports ("model": a model folder as it is)
    suffix    what its output's name ends with ("": a folder)
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    flags: ClassVar[type | None] = None
    sources: ClassVar[tuple[str, ...]] = ("adapter", "zero_checkpoint")
    suffix: ClassVar[str] = ""

    def check(self, args: ExportArgs, flags: Any) -> list[str]:
        """Problems with its flags and the shared ones, before anything loads (exit 2 with the parser's others)."""
        return []

    def write(self, args: ExportArgs, flags: Any) -> Path:
        """Write the export of ARGS to args.output_dir, verified (self.verify) before it is moved into place;
        return where it is. A user mistake raises ExportError, a failed check VerificationError; either way the
        output is left as it was."""
        raise NotImplementedError

    def verify(self, written: Path, reference: Any, **limits) -> Any:
        """Read WRITTEN back and compare it with REFERENCE (what was written from); return the measured numbers,
        raise VerificationError on a mismatch."""
        raise NotImplementedError
