"""`finetune COMMAND ...`: one entry point for the project's commands."""

from __future__ import annotations

import sys

COMMANDS = {
    "train": ("finetune.training.trainer", "fine-tune with the HF Trainer (same as finetune/train.py)"),
    "loop": ("finetune.training.loop", "fine-tune with a plain accelerate loop (same as finetune/loop.py)"),
    "engine": ("finetune.training.engine", "fine-tune driving the DeepSpeed engine directly (same as scripts/sft.py)"),
    "plan": ("finetune.plan.planner", "predict per-device memory (no weights loaded) and pick the preset that fits"),
    "generate": ("finetune.inference.generate", "generate completions (LoRA adapter, 8/4-bit, device_map sharding and disk offload)"),
    "serve": ("finetune.inference.serve", "serve a model and its LoRA adapters over an OpenAI-compatible HTTP API (streaming, batched requests)"),
    "chat": ("finetune.inference.chat", "chat with a model (and an adapter) in the terminal: streamed replies, /reset, /system"),
    "eval": ("finetune.inference.eval", "run lm-evaluation-harness tasks on a model, base and fine-tuned side by side"),
    "score": ("finetune.inference.score", "print a reward model's rewards of completions, or of preference pairs with the accuracy"),
    "export": ("finetune.convert.export", "merge a LoRA adapter or consolidate a ZeRO checkpoint into a verified HF folder, or a GGUF file"),
    "import-gguf": ("finetune.convert.gguf_import", "turn a GGUF file of a Llama-style model into a plain HF folder (safetensors)"),
    "report": ("finetune.apps.report", "write OUTPUT_DIR/report/: loss, learning-rate and tokens/s curves (PNG), final metrics (markdown, JSON)"),
    "quickstart": ("finetune.apps.quickstart", "fine-tune SmolLM2-135M-Instruct on the bundled data and report before/after"),
    "nodes": ("finetune.apps.nodes", "start a multi-node launch line once every node is there (says what it waits for every 30 s, gives up after --timeout)"),
    "tiny": ("finetune.apps.tiny", "build a tiny random Llama with a local tokenizer (tests, demos)"),
    "ui": ("finetune.apps.ui", "a local web page to plan, launch, watch, chat with and export runs (127.0.0.1:7860)"),
}
# The commands that run finetune's workarounds for other libraries' internals (finetune.compat).
CHECKS_VERSIONS = ("train", "loop", "engine", "generate", "export", "quickstart", "ui")
TRAINING = ("train", "loop", "engine")
# Former command names, still run: each says its new name once. (`sft` is a training method, --method sft.)
RENAMED = {"sft": "engine"}


def main(argv: list[str] | None = None) -> None:
    program, argv = argv is None, sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-V", "--version"):
        from finetune import __version__

        print(f"finetune {__version__}")
        return
    if argv and argv[0] in RENAMED:
        print(f"finetune: `finetune {argv[0]}` is now `finetune {RENAMED[argv[0]]}`", file=sys.stderr)
        argv = [RENAMED[argv[0]], *argv[1:]]
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: finetune [--version] COMMAND [flags]\n\ncommands:\n" + "\n".join(lines)
              + "\n\n`finetune COMMAND --help` lists a command's flags.", file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            import difflib

            close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            print(f"\nfinetune: unknown command '{argv[0]}'{hint}", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(0 if argv else 2)
    import importlib

    if argv[0] in CHECKS_VERSIONS:
        from finetune import compat

        compat.check_versions()
    module = importlib.import_module(COMMANDS[argv[0]][0])
    from finetune import process

    # A training command run as the program (argv from the command line, not a caller) ends without the interpreter
    # shutdown once done, as a launched rank does (finetune.process).
    process.run_rank(module.main, argv[1:], own_process=program and argv[0] in TRAINING,
                     resume_hint=argv[0] in TRAINING)


if __name__ == "__main__":  # python -m finetune.cli COMMAND, as launchers given a module run it
    main()
