"""`finetune chat`: talk to a model (and a LoRA adapter) in the terminal.

    finetune chat --model_name_or_path BASE [--adapter outputs/run/model] [--system "You answer in JSON."]
    finetune chat ... --load_in_8bit | --device_map auto --max_memory cpu=2GiB,disk=20GiB   # as finetune generate

Each reply is streamed as it is generated, through the model's chat template and up to its stop token; the
conversation is kept, so the model sees every earlier turn. Commands: `/reset` starts the conversation again (the
system message stays), `/system TEXT` sets the system message (`/system` alone removes it) and starts again,
`/exit` (or Ctrl-D) leaves. Ctrl-C during a reply stops it there (the interrupted reply is left out of the
conversation); at the prompt it clears the line. Decoding is greedy unless --do_sample.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

from finetune.inference.generate import GenerationError, ModelArgs, _flag

PROMPT, REPLY = "you> ", "model> "


@dataclass
class ChatArgs(ModelArgs):
    """The model, the adapter, and how replies are decoded"""

    adapter: str | None = _flag(help="LoRA adapter folder (from finetune train --use_peft) to attach.")
    system: str | None = _flag(help="The system message the conversation starts with.")
    max_new_tokens: int = _flag(512, help="Tokens per reply, at most.")
    do_sample: bool = _flag(False, help="Sample instead of greedy decoding.")
    temperature: float = _flag(0.7, help="Sampling temperature (with --do_sample).")
    top_p: float = _flag(0.9, help="Nucleus sampling (with --do_sample).")
    seed: int = _flag(0, help="Seed for sampling.")


def command():
    from finetune.config.parser import Command

    return Command("finetune chat", {"args": ChatArgs}, description="Chat with a model in the terminal.",
                   epilog=__doc__.split("\n\n", 1)[1])


def check_args(parsed) -> list[str]:
    from pathlib import Path

    from finetune.inference.generate import model_problems

    args: ChatArgs = parsed.args
    problems = model_problems(args)
    if args.max_new_tokens < 1:
        problems.append(f"--max_new_tokens: must be at least 1, got {args.max_new_tokens}")
    if args.adapter and not Path(args.adapter).is_dir():
        problems.append(f"--adapter {args.adapter}: no such folder")
    if args.do_sample and args.temperature <= 0:
        problems.append(f"--temperature: must be above 0 when sampling (--do_sample), got {args.temperature}")
    if args.do_sample and not 0 < args.top_p <= 1:
        problems.append(f"--top_p: must be in (0, 1] when sampling, got {args.top_p}")
    return problems


class Conversation:
    """The turns so far, and the system message."""

    def __init__(self, system: str | None):
        self.system, self.turns = system, []

    def messages(self, user: str | None = None) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns + ([{"role": "user", "content": user}] if user is not None else [])


def reply(model, tokenizer, messages: list[dict], args: ChatArgs, out) -> tuple[str, bool]:
    """Generate and print a reply token by token; returns (text, finished). Ctrl-C stops it (finished False)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

    from finetune import compat
    from finetune.inference.generate import eos_ids, input_device, render

    text = render(tokenizer, messages, True, "the conversation").text
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(input_device(model))
    stop = threading.Event()

    class Interrupted(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return stop.is_set()

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                  do_sample=args.do_sample, eos_token_id=eos_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id,
                  streamer=streamer, stopping_criteria=StoppingCriteriaList([Interrupted()]),
                  **compat.generation_kwargs(model))
    kwargs.update(dict(temperature=args.temperature, top_p=args.top_p) if args.do_sample else
                  dict(temperature=None, top_p=None, top_k=None))
    failure: list[BaseException] = []

    def run():
        try:
            with torch.no_grad():
                model.generate(**kwargs)
        except BaseException as e:  # noqa: BLE001 - shown in the main thread
            failure.append(e)
            streamer.end()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    pieces: list[str] = []
    finished = True
    try:
        for piece in streamer:
            pieces.append(piece)
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        finished = False
        stop.set()
    while worker.is_alive():  # the stopping criterion ends it at the next token
        try:
            worker.join(0.1)
        except KeyboardInterrupt:
            stop.set()
    if failure:
        raise failure[0]
    return "".join(pieces), finished


def repl(model, tokenizer, args: ChatArgs, read=input, out=sys.stdout) -> None:
    if args.do_sample:
        from transformers import set_seed

        set_seed(args.seed)
    conversation = Conversation(args.system)
    out.write("finetune chat: /reset starts again, /system TEXT sets the system message, /exit or Ctrl-D leaves; "
              "Ctrl-C stops a reply.\n")
    out.flush()
    while True:
        try:
            line = read(PROMPT)
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:  # at the prompt: a new line, as a shell does
            out.write("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            conversation.turns = []
            out.write("(conversation reset)\n")
            continue
        if text == "/system" or text.startswith("/system "):
            conversation.system = text[len("/system"):].strip() or None
            conversation.turns = []
            out.write(f"(system message {'set' if conversation.system else 'removed'}; conversation reset)\n")
            continue
        if text.startswith("/"):
            out.write(f"(unknown command {text.split()[0]}: /reset, /system TEXT, /exit)\n")
            continue
        out.write(REPLY)
        out.flush()
        try:
            answer, finished = reply(model, tokenizer, conversation.messages(line), args, out)
        except GenerationError as e:
            out.write(f"\n(error: {e})\n")
            continue
        if finished:
            conversation.turns += [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]
            out.write("\n")
        else:
            out.write(" (interrupted)\n")
        out.flush()


def main(argv: list[str] | None = None) -> None:
    args = command().parse_or_exit(argv, check_args).args
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from finetune.inference.generate import _quiet_libraries, load_for_inference, load_options

    _quiet_libraries()
    try:
        model, tokenizer, _ = load_for_inference(load_options(args, args.adapter))
        if not getattr(tokenizer, "chat_template", None):
            raise GenerationError(f"{args.model_name_or_path}: the tokenizer has no chat template; finetune chat needs "
                                  "one (finetune generate takes plain text prompts)")
    except GenerationError as e:
        print(f"finetune chat: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    repl(model, tokenizer, args)


if __name__ == "__main__":
    main()
