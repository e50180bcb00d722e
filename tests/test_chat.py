"""`finetune chat` in a pseudo-terminal (a real process, as a user's terminal runs it): each reply equals transformers'
greedy `generate` on the conversation so far through the chat template (the conversation is kept), `/system` and
`/reset` change what the model sees, and Ctrl-C stops a streamed reply without leaving."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time

import pytest

from finetune.models import tiny
from launch import BIN, REPO, env

pytestmark = pytest.mark.usefixtures("one_thread")


class Terminal:
    """A process on the slave side of a pty; bytes in, text out, every wait bounded."""

    def __init__(self, cmd: list[str]):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, start_new_session=True,
                                     env=env(TERM="dumb", COLUMNS="4000"),
                                     # the pty is the controlling terminal: its Ctrl-C is the process's SIGINT
                                     preexec_fn=lambda: __import__("fcntl").ioctl(0, __import__("termios").TIOCSCTTY, 0))
        os.close(slave)
        self.buffer = ""

    def read_until(self, pattern: str, timeout: float = 120, start: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            found = re.compile(pattern, re.S).search(self.buffer, start)
            if found:
                return found
            left = deadline - time.monotonic()
            assert left > 0 and self.proc.poll() is None, f"waited for {pattern!r}; the terminal shows:\n{self.buffer[-3000:]}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.buffer += os.read(self.master, 65536).decode("utf-8", errors="replace").replace("\r\n", "\n")
                except OSError:
                    pass

    def send(self, text: str) -> int:
        start = len(self.buffer)
        os.write(self.master, text.encode())
        return start

    def say(self, line: str, timeout: float = 120) -> str:
        """Type a line; return the reply printed after `model> ` up to the next prompt."""
        start = self.send(line + "\n")
        found = self.read_until(r"model> (.*?)\nyou> ", timeout, start)
        return found.group(1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    model = tiny.build(root / "model", style="chatml", hidden=64, layers=2)
    return dict(model=model, adapter=tiny.save_random_adapter(model, root / "adapter", r=4, seed=3))


def greedy(files, messages: list[dict], max_new_tokens: int) -> str:
    """transformers' own generate on the chat template's rendering (base + adapter), decoded as the terminal shows it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(files["model"])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(files["model"]), str(files["adapter"])).eval()
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False,
              return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[tok.eos_token_id],
                             pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).replace("\r\n", "\n")


def test_chat_keeps_the_conversation_commands_and_ctrl_c(files, capsys):
    term = Terminal([str(BIN / "finetune"), "chat", "--model_name_or_path", str(files["model"]), "--adapter",
                     str(files["adapter"]), "--max_new_tokens", "12"])
    try:
        term.read_until(r"you> ", timeout=240)
        first, second = "count: red blue", "again, reversed"
        a1 = term.say(first)
        assert a1 == greedy(files, [{"role": "user", "content": first}], 12)
        a2 = term.say(second)  # the model sees the first turn too
        conversation = [{"role": "user", "content": first}, {"role": "assistant", "content": a1},
                        {"role": "user", "content": second}]
        assert a2 == greedy(files, conversation, 12)
        assert a2 != greedy(files, conversation[2:], 12)

        term.send("/system You count words.\n")
        term.read_until(r"system message set")
        with_system = term.say(first)
        assert with_system == greedy(files, [{"role": "system", "content": "You count words."},
                                             {"role": "user", "content": first}], 12)
        assert with_system != a1
        term.send("/system\n")
        term.read_until(r"system message removed")
        assert term.say(first) == a1  # removed: the template's default system message again
        term.say(second)
        term.send("/reset\n")
        term.read_until(r"conversation reset\)\n")
        assert term.say(second) == greedy(files, [{"role": "user", "content": second}], 12)
        term.send("/exit\n")
        assert term.proc.wait(60) == 0
    finally:
        term.close()

    # Ctrl-C during a long reply: the reply stops after streaming part of it, and the chat goes on.
    term = Terminal([str(BIN / "finetune"), "chat", "--model_name_or_path", str(files["model"]), "--adapter",
                     str(files["adapter"]), "--max_new_tokens", "900"])
    try:
        term.read_until(r"you> ", timeout=240)
        start = term.send(first + "\n")
        term.read_until(r"model> .{20}", start=start)  # streamed: part of the reply shows before it ends
        t = time.monotonic()
        term.send("\x03")
        # (the terminal echoes the key as ^C where it was pressed)
        interrupted = term.read_until(r"model> (.*?)(?:\^C)? \(interrupted\)\nyou> ", 60, start)
        took = time.monotonic() - t
        whole = greedy(files, [{"role": "user", "content": first}], 900)
        assert whole.startswith(interrupted.group(1)) and len(interrupted.group(1)) < len(whole)
        with capsys.disabled():
            print(f"\nfinetune chat: Ctrl-C stopped a reply after {len(interrupted.group(1))} of {len(whole)} "
                  f"characters, {took:.3f} s after the key")
        start = term.send("/reset\n")  # still chatting
        term.read_until(r"conversation reset\)\nyou> ", 60, start)
        os.write(term.master, b"\x04")  # Ctrl-D leaves
        assert term.proc.wait(60) == 0
    finally:
        term.close()
