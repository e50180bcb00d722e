"""User mistakes on the command line: exit status 2 and a message that says what to fix, never a traceback.

Each test runs twice: in this process (the console script's `main()` or the launcher file run as `__main__`,
sys.argv, cwd and environment as a shell would set them: fast), and, marked slow, as a real process
(`finetune train ...` or `python finetune/train.py ...`); config mistakes are tested in depth by test_config.py.
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from launch import matrix, side_by_side

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120
LAUNCH_ENV = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE",
)
SCRIPTS = {"script": "finetune/train.py", "loop": "finetune/loop.py", "engine": "scripts/sft.py"}


def _finetune_script() -> str:
    script = Path(sys.executable).parent / "finetune"
    if script.is_file():
        return str(script)
    found = shutil.which("finetune")
    if not found:
        pytest.fail("the `finetune` console script is not installed (pip install -e .)")
    return found


def _environ(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", FINETUNE_CACHE=str(tmp_path / "finetune-cache"),
               PYTHONPATH=str(REPO))
    return env


def _command(how: str, args: list, tmp_path: Path) -> tuple[list[str], Path]:
    """(command line, working folder) of entry point `how` on `args`."""
    args = [str(a) for a in args]
    if how == "cli":
        return [_finetune_script(), "train", *args], tmp_path
    return [sys.executable, SCRIPTS[how], *args], REPO


def in_a_process(how: str, args: list, tmp_path: Path) -> subprocess.CompletedProcess:
    """how: 'cli' runs `finetune train ARGS` from tmp_path; 'script' runs `python finetune/train.py ARGS` from the repo;
    'loop' and 'engine' run `python finetune/loop.py` and `python scripts/sft.py` the same way."""
    cmd, cwd = _command(how, args, tmp_path)
    return subprocess.run(cmd, cwd=cwd, env=_environ(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)


def in_processes(how: str, argvs: list[list], tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """Independent commands as in_a_process, started together and each awaited to its end (anything still running
    at TIMEOUT, or on any way out, is killed)."""
    cwd = _command(how, [], tmp_path)[1]
    return side_by_side([_command(how, args, tmp_path)[0] for args in argvs], TIMEOUT, cwd=cwd, env=_environ(tmp_path))


def in_this_process(how: str, args: list, tmp_path: Path, monkeypatch, capfd) -> subprocess.CompletedProcess:
    """The same entry points, run here: exit status from SystemExit, and an uncaught exception printed as the
    interpreter would (a traceback on stderr, status 1)."""
    args = [str(a) for a in args]
    for key in LAUNCH_ENV:
        # Not monkeypatch.delenv: a second run here would record the first run's world of one, and monkeypatch's
        # undo (after `isolated` restored the environment) would put it back for the tests after this one.
        os.environ.pop(key, None)
    for key, value in _environ(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the launcher files set sys.path[0]
    if how == "cli":
        from finetune.cli import main

        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", ["finetune", "train", *args])
        entry = main
    else:
        monkeypatch.chdir(REPO)
        monkeypatch.setattr(sys, "argv", [SCRIPTS[how], *args])
        entry = lambda: runpy.run_path(str(REPO / SCRIPTS[how]), run_name="__main__")  # noqa: E731
    capfd.readouterr()
    code = 0
    try:
        entry()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        traceback.print_exc()
        code = 1
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(sys.argv, code, out, err)


@pytest.fixture(params=["here", pytest.param("process", marks=pytest.mark.slow)])
def run(request, tmp_path, monkeypatch, capfd, isolated):
    """run(how, args) -> CompletedProcess: `how` as in in_a_process; in this process, or (slow) in a new one."""
    if request.param == "process":
        return lambda how, args: in_a_process(how, args, tmp_path)
    request.getfixturevalue("one_thread")
    return lambda how, args: in_this_process(how, args, tmp_path, monkeypatch, capfd)


def assert_user_error(proc: subprocess.CompletedProcess, *messages: str) -> None:
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2, report
    for message in messages:
        assert message in proc.stderr, f"missing {message!r}\n{report}"
    assert "Traceback" not in proc.stderr, report


def test_help_lists_flags(tmp_path, run):
    proc = run("cli", ["--help"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for flag in ("--model_name_or_path", "--per_device_train_batch_size", "--config", "--recipe", "--dataset"):
        assert flag in proc.stdout, flag


def test_unknown_key_cli(tmp_path, run):
    proc = run("cli", ["--learning_rat", "1e-3", "--model_name_or_path", tmp_path, "--dataset", tmp_path])
    assert_user_error(
        proc,
        "finetune: ",
        "configuration problem(s)",
        "--learning_rat: unknown key 'learning_rat'; did you mean 'learning_rate'?",
    )


def test_unknown_preset_and_missing_model_script(tmp_path, run):
    # Both problems in one run: configuration problems are reported together.
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    missing = tmp_path / "no-such-model"
    proc = run("script", ["--config", "zero4", "--model_name_or_path", missing, "--dataset", data,
                          "--output_dir", tmp_path / "out"])
    assert_user_error(
        proc,
        "finetune: 2 configuration problem(s):",
        "--config: unknown preset 'zero4'; did you mean 'zero3'?",
        f"model_name_or_path: {missing}: no such folder",
    )
    assert not (tmp_path / "out").exists()


def _data_run(run, how: str, tiny_model: Path, data: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return run(how, [
        "--model_name_or_path", tiny_model, "--dataset", data, "--dataset_cache_dir", tmp_path / "cache",
        "--output_dir", tmp_path / "out", "--max_steps", "1", *extra,
    ])


def test_malformed_json_line(tiny_chatml, tmp_path, run):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one two"}\n{"text": "three four"}\n{"text": "five" six}\n')
    proc = _data_run(run, "cli", tiny_chatml, data, tmp_path)
    assert_user_error(proc, f"finetune: data error: {data}:3: invalid JSON")
    assert not (tmp_path / "out").exists()


def test_empty_data_file(tiny_chatml, tmp_path, run):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    proc = _data_run(run, "script", tiny_chatml, data, tmp_path)
    assert_user_error(proc, f"finetune: data error: {data}: the file holds no records")


def test_missing_field(tiny_chatml, tmp_path, run):
    data = tmp_path / "alpaca.jsonl"
    data.write_text('{"instruction": "copy: cat", "output": "cat"}\n{"instruction": "copy: dog"}\n')
    proc = _data_run(run, "cli", tiny_chatml, data, tmp_path, "--dataset_format", "alpaca")
    assert_user_error(proc, f"finetune: data error: {data}:2: missing field 'output' (format alpaca)")


def test_wrong_type(tiny_chatml, tmp_path, run):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 42}]}\n')
    proc = _data_run(run, "script", tiny_chatml, data, tmp_path)
    assert_user_error(proc, f"finetune: data error: {data}:1: messages[1].content must be a string, got int")


@pytest.mark.parametrize("how", ["loop", "engine"])
def test_plan_check_is_on_every_path(how, tiny_chatml, tmp_path, run):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one two"}\n')
    huge = ["--per_device_train_batch_size", "100000", "--max_seq_length", "100000", "--plan_check"]
    proc = _data_run(run, how, tiny_chatml, data, tmp_path, *huge)
    assert_user_error(proc, "finetune: --plan_check: predicted memory does not fit", "--force")
    assert not (tmp_path / "out").exists()


def test_plan_check_refuses_a_run_that_cannot_fit(tiny_chatml, tmp_path, run):
    # A batch whose activations alone need far more than this machine has: refused before the model loads.
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one two"}\n')
    huge = ["--per_device_train_batch_size", "100000", "--max_seq_length", "100000", "--plan_check"]
    proc = _data_run(run, "cli", tiny_chatml, data, tmp_path, *huge)
    assert_user_error(proc, "finetune: --plan_check: predicted memory does not fit", "--force")
    assert not (tmp_path / "out").exists()
    # The same run with a batch that fits passes the check and trains.
    ok = _data_run(run, "cli", tiny_chatml, data, tmp_path, "--plan_check")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def _renamed_weights(tiny_model: Path, out: Path) -> Path:
    """The tiny model with every tensor name prefixed by 'module.' (a DDP / DeepSpeed state dict saved as is)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, out)
    weights = load_file(out / "model.safetensors")
    save_file({f"module.{k}": v.contiguous() for k, v in weights.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def _wrong_config(tiny_model: Path, out: Path) -> Path:
    """The tiny Llama's weights under a GPT-2 config.json of the same vocabulary."""
    import json

    from transformers import GPT2Config

    shutil.copytree(tiny_model, out)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256).save_pretrained(out)
    return out


def _weights_cases() -> list:
    """Every case x path in this process; in a real process (slow) CI's cover takes one path per case, every path
    with FINETUNE_FULL_MATRIX=1."""
    every = [(c, h, m) for m in ("here", "process") for c in ("module_prefix", "gpt2_config") for h in ("cli", "loop", "engine")]
    cover = [x for x in every if x[2] == "here"] + [("module_prefix", "engine", "process"), ("gpt2_config", "cli", "process")]
    return [pytest.param(c, h, m, id=f"{m}-{c}-{h}", marks=[pytest.mark.slow] if m == "process" else [])
            for c, h, m in matrix(every, cover)]


@pytest.mark.parametrize("case, how, run", _weights_cases(), indirect=["run"])
def test_weights_that_do_not_match_the_config_are_refused(case, how, tiny_chatml, tmp_path, run):
    """Before: every weight MISSING, a randomly initialised model trained, exit 0, its save 'verified'."""
    model = (_renamed_weights if case == "module_prefix" else _wrong_config)(tiny_chatml, tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one two"}\n{"text": "three four"}\n')
    proc = _data_run(run, how, model, data, tmp_path)
    assert_user_error(proc, f"finetune: --model_name_or_path {model}: the weights in {model / 'model.safetensors'} "
                            "do not match its config.json", "missing keys:")
    if case == "module_prefix":
        assert "unexpected keys: module.lm_head.weight, module.model.embed_tokens.weight" in proc.stderr, proc.stderr
        assert "'module.'" in proc.stderr
    else:
        assert "transformer.h.0.attn.c_attn.weight" in proc.stderr or "transformer.wte.weight" in proc.stderr, proc.stderr
    assert "{'loss'" not in proc.stdout and not (tmp_path / "out" / "model.safetensors").exists()


def test_tied_lm_head_is_not_a_missing_weight(tmp_path, tiny_chatml, one_thread):
    """A tied lm_head (not in the file) and non-persistent buffers (rotary inv_freq) load without complaint."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from safetensors import safe_open

    from finetune import config as C
    from finetune.models.load import load_model

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tied")
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    shutil.copy(tiny_chatml / "tokenizer.json", tmp_path / "tied")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    cfg = C.parse(["--model_name_or_path", str(tmp_path / "tied"), "--dataset", str(data),
                   "--output_dir", str(tmp_path / "o")])
    model = load_model(cfg.model, cfg.training)
    assert model.lm_head.weight is model.model.embed_tokens.weight


SHAREGPT_LINE = '{"conversations": [{"from": "human", "value": "copy: red cat"}, {"from": "gpt", "value": "red cat"}]}\n'
INST_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def test_chat_data_needs_a_chat_template(tiny_plain, tmp_path, run):
    data = tmp_path / "share.jsonl"
    data.write_text(SHAREGPT_LINE)
    proc = _data_run(run, "cli", tiny_plain, data, tmp_path)
    assert_user_error(proc, f"finetune: data error: {data}: 'sharegpt' records are rendered with the tokenizer's chat "
                            "template, and this tokenizer has none (a base model); pass --chat_template FILE.jinja")
    assert not (tmp_path / "out").exists()


def test_bad_chat_template_file(tiny_plain, tmp_path, run):
    data = tmp_path / "share.jsonl"
    data.write_text(SHAREGPT_LINE)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    proc = _data_run(run, "script", tiny_plain, data, tmp_path, "--chat_template", bad, "--dataset_format", "sharegtp")
    assert_user_error(proc, "finetune: 2 configuration problem(s):",
                      f"chat_template: {bad}:2: not a valid Jinja template: unexpected '}}'",
                      "dataset_format: 'sharegtp' is not one of auto, text, alpaca, messages, sharegpt, vision; did you mean 'sharegpt'?")


def test_chat_template_file_trains_a_base_model(tiny_plain, tmp_path, run):
    """--chat_template gives a base model a chat format; the trained model's tokenizer keeps it."""
    from transformers import AutoTokenizer

    data, template = tmp_path / "share.jsonl", tmp_path / "inst.jinja"
    data.write_text(SHAREGPT_LINE)
    template.write_text(INST_TEMPLATE)
    proc = _data_run(run, "cli", tiny_plain, data, tmp_path, "--chat_template", template)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"data: 1 records (sharegpt) from {data}" in proc.stdout + proc.stderr
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == INST_TEMPLATE
