"""`finetune COMMAND ...`: one entry point for the project's commands."""

from __future__ import annotations

import sys

COMMANDS = {
    "train": ("finetune.train", "fine-tune a model with the HF Trainer (same as finetune/train.py)"),
    "tiny": ("finetune.tiny", "build a tiny random Llama with a local tokenizer (tests, demos)"),
    "generate": ("finetune.generate", "generate completions (LoRA adapter, 8/4-bit, device_map sharding and disk offload)"),
    "export": ("finetune.export", "merge a LoRA adapter or consolidate a ZeRO checkpoint into a verified HF folder"),
    "plan": ("finetune.plan", "predict per-device memory (no weights loaded) and pick the preset that fits"),
    "import-gguf": ("finetune.gguf", "turn a GGUF file of a Llama-style model into a plain HF folder (safetensors)"),
    "quickstart": ("finetune.quickstart", "fine-tune SmolLM2-135M-Instruct on the bundled data and report before/after"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: finetune COMMAND [flags]\n\ncommands:\n" + "\n".join(lines), file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nfinetune: unknown command '{argv[0]}'", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(0 if argv else 2)
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    module.main(argv[1:])
