"""`finetune tiny OUT_DIR`: the command that builds a tiny random Llama and its tokenizer (finetune.models.tiny)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from finetune.config.parser import Command
from finetune.errors import did_you_mean
from finetune.models.tiny import STYLES, build


@dataclass
class TinyArgs:
    """The tiny model to build"""

    out_dir: str | None = field(default=None, metadata={"help": "Folder to write the model and tokenizer to.",
                                                        "positional": True, "required": True})
    style: str = field(default="chatml", metadata={"help": f"Tokenizer and chat template style: {', '.join(STYLES)}."})
    hidden: int = field(default=64, metadata={"help": "Hidden size."})
    layers: int = field(default=2, metadata={"help": "Decoder layers."})
    seed: int = field(default=0, metadata={"help": "Seed of the random weights."})
    overwrite: bool = field(default=False, metadata={"help": "Replace what OUT_DIR holds (else a non-empty folder "
                                                             "is refused: it may be a trained run)."})


def check_args(parsed) -> list[str]:
    args: TinyArgs = parsed.args
    problems = []
    if args.style not in STYLES:
        problems.append(f"--style: '{args.style}' is not one of {', '.join(STYLES)}{did_you_mean(args.style, list(STYLES))}")
    if args.hidden < 8 or args.hidden % 8:
        # 4 attention heads, and rotary embeddings need an even head size.
        problems.append(f"--hidden: must be a positive multiple of 8, got {args.hidden}")
    if args.layers < 1:
        problems.append(f"--layers: must be at least 1, got {args.layers}")
    if args.out_dir is None:
        return problems  # the parser says OUT_DIR is required
    out = Path(args.out_dir)
    if out.is_file():
        problems.append(f"OUT_DIR {out}: is a file; give a folder")
    elif out.is_dir() and any(out.iterdir()) and not args.overwrite:
        problems.append(f"OUT_DIR {out}: not empty (it may hold a trained model); give an empty or new folder, or "
                        "--overwrite to replace its contents")
    return problems


def main(argv: list[str] | None = None) -> None:
    cmd = Command("finetune tiny", {"args": TinyArgs},
                  description="Build a tiny random Llama with a local tokenizer (no downloads).")
    args: TinyArgs = cmd.parse_or_exit(argv, check_args).args
    if args.overwrite and Path(args.out_dir).is_dir():
        shutil.rmtree(args.out_dir)  # checkpoints of an earlier run must not outlive the weights they belong to
    build(args.out_dir, args.style, args.seed, args.hidden, args.layers)
    print(args.out_dir)


if __name__ == "__main__":
    main()
