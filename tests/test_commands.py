"""Every `finetune COMMAND` parses its flags with finetune.config.parser: --help, did-you-mean and exit 2 for an
unknown flag, every bad value reported in one run, recipe YAML, and --deepspeed as --config.

In-process through finetune.cli.main (the code `finetune COMMAND` runs); no command gets past its flags here,
except the recipe runs, which generate with / build a tiny model."""

from __future__ import annotations

import json
import os

import pytest

from finetune.cli import COMMANDS, main

pytestmark = pytest.mark.usefixtures("one_thread")

LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


def finetune(capsys, *argv) -> tuple[int, str, str]:
    """Run `finetune ARGV` in-process: (exit code, stdout, stderr)."""
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# command, its arguments with one misspelled flag, the flag, what it should suggest
TYPOS = [
    ("train", ["--learning_rat", "1e-3"], "learning_rate"),
    ("loop", ["--per_device_train_batch_sise", "2"], "per_device_train_batch_size"),
    ("engine", ["--gradient_acumulation_steps", "2"], "gradient_accumulation_steps"),
    ("plan", ["--devices_per_nod", "8"], "devices_per_node"),
    ("generate", ["--max_new_token", "5"], "max_new_tokens"),
    ("score", ["--batch_sise", "2"], "batch_size"),
    ("serve", ["--max_concurent", "2"], "max_concurrent"),
    ("chat", ["--sytem", "hi"], "system"),
    ("eval", ["--taks", "x"], "tasks"),
    ("export", ["--zero_checkpont", "x"], "zero_checkpoint"),
    ("import-gguf", ["a.gguf", "out", "--overwrit"], "overwrite"),
    ("quickstart", ["--max_step", "3"], "max_steps"),
    ("tiny", ["out", "--layer", "3"], "layers"),
    ("report", ["run", "--report_dri", "x"], "report_dir"),
    ("nodes", ["--timout", "9", "torchrun"], "timeout"),
    ("ui", ["--tokn", "x"], "token"),
]


def test_every_command_is_covered():
    assert sorted(c for c, _, _ in TYPOS) == sorted(COMMANDS)


@pytest.mark.parametrize("command, argv, suggestion", TYPOS, ids=[t[0] for t in TYPOS])
def test_unknown_flag_gets_did_you_mean_and_exit_2(command, argv, suggestion, capsys):
    code, _, err = finetune(capsys, command, *argv)
    typo = next(a for a in argv if a.startswith("--"))
    assert code == 2, err
    assert f"{typo}: unknown key '{typo[2:]}'; did you mean '{suggestion}'?" in err, err
    assert "configuration problem(s):" in err and "Traceback" not in err


def test_the_former_name_of_the_engine_command_still_runs_it(capsys):
    """`finetune sft` (the engine path's former name; sft is also a training method) runs `finetune engine`, saying so
    in one line."""
    code, _, err = finetune(capsys, "sft", "--gradient_acumulation_steps", "2")
    assert code == 2, err
    assert err.splitlines()[0] == "finetune: `finetune sft` is now `finetune engine`"
    assert "did you mean 'gradient_accumulation_steps'?" in err


# command, flags with two bad values, the two messages (both must be in one run's output)
TWO_BAD = [
    ("train", ["--max_steps", "x", "--lora_r", "0"], ["max_steps: expected an integer, got 'x'", "lora_r: must be positive"]),
    ("loop", ["--learning_rate", "fast", "--max_seq_length", "1"],
     ["learning_rate: expected a number, got 'fast'", "max_seq_length: must be at least 2"]),
    ("engine", ["--deepspeed", "zero4", "--use_peft", "maybe"],
     ["--config: unknown preset 'zero4'; did you mean 'zero3'?", "use_peft: expected true or false, got 'maybe'"]),
    ("plan", ["--num_nodes", "0", "--device_memory", "lots"],
     ["--num_nodes: must be at least 1, got 0", "--device_memory: not a size: 'lots'"]),
    ("generate", ["--model", "m", "--prompt", "hi", "--batch_size", "0", "--max_new_tokens", "x"],
     ["--batch_size: must be at least 1, got 0", "--max_new_tokens: expected an integer, got 'x'"]),
    ("score", ["--model", "m", "--dataset", "d.jsonl", "--batch_size", "0", "--torch_dtype", "fp8"],
     ["--batch_size: must be at least 1, got 0", "--torch_dtype: 'fp8' is not one of float32, bfloat16, float16"]),
    ("serve", ["--model", "m", "--port", "70000", "--batching", "continous"],
     ["--port: 70000 is not a port (1-65535)", "--batching: 'continous' is not one of auto, continuous, queue; did you "
      "mean 'continuous'?"]),
    ("chat", ["--model", "m", "--max_new_tokens", "0", "--adapter", "/nowhere"],
     ["--max_new_tokens: must be at least 1, got 0", "--adapter /nowhere: no such folder"]),
    ("eval", ["--model", "m", "--tasks", ",", "--limit", "0"],
     ["--tasks: give at least one task name (comma-separated)", "--limit: must be at least 1, got 0"]),
    ("export", ["--adapter", "a", "--output_dir", "o", "--torch_dtype", "fp8", "--atol", "x"],
     ["--torch_dtype: 'fp8' is not one of float32, bfloat16, float16", "--atol: expected a number, got 'x'"]),
    ("import-gguf", ["--overwrite=maybe", "a.gguf", "out", "extra"],
     ["--overwrite: expected true or false, got 'maybe'", "unexpected argument 'extra'"]),
    ("quickstart", ["--method", "qlora", "--max_steps", "0"],
     ["--method: 'qlora' is not one of sft, dpo, orpo, kto, grpo; did you mean 'lora'?", "--max_steps: must be at least 1, got 0"]),
    ("tiny", ["out", "--hidden", "30", "--style", "chatm"],
     ["--hidden: must be a positive multiple of 8, got 30", "--style: 'chatm' is not one of chatml, llama3, plain; did you mean 'chatml'?"]),
    ("report", ["--report_dir"], ["--report_dir: needs a value", "OUTPUT_DIR: required"]),
    ("nodes", ["--timeout", "x", "mpirun"], ["--timeout: expected a number of seconds, got 'x'", "unknown launcher 'mpirun'"]),
    ("ui", ["--port", "x", "--root", "/nonexistent-root"], ["--port: expected an integer, got 'x'",
                                                             "--root /nonexistent-root: no such folder"]),
]


def test_two_bad_covers_every_command():
    assert sorted(c for c, _, _ in TWO_BAD) == sorted(COMMANDS)


@pytest.mark.parametrize("command, argv, messages", TWO_BAD, ids=[t[0] for t in TWO_BAD])
def test_two_bad_values_are_both_reported(command, argv, messages, capsys, tmp_path):
    code, _, err = finetune(capsys, command, *argv)
    assert code == 2, err
    for message in messages:
        assert message in err, (message, err)
    assert "Traceback" not in err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help(command, capsys):
    code, out, _ = finetune(capsys, command, "--help")
    assert code == 0
    assert out.startswith("usage: ")
    # Every flag of the command is listed, with its help line.
    flags = {
        "train": ["--model_name_or_path", "--config, --deepspeed, --deepspeed_config", "--learning_rate", "--recipe"],
        "loop": ["--dataset", "--per_device_train_batch_size"],
        "engine": ["--config, --deepspeed, --deepspeed_config", "--save_steps"],
        "plan": ["--devices_per_node", "--device_memory", "--host_memory", "--accelerator", "--json", "--use_peft"],
        "generate": ["--model_name_or_path, --model", "--prompt", "(repeatable)", "--device_map", "--load_in_4bit"],
        "score": ["--model_name_or_path, --model", "--dataset", "--batch_size", "--max_seq_length"],
        "serve": ["--model_name_or_path, --model", "--adapter", "(repeatable)", "--api_key", "--host", "--load_in_8bit"],
        "chat": ["--model_name_or_path, --model", "--adapter", "--system", "--device_map"],
        "eval": ["--model_name_or_path, --model", "--adapter", "--tasks", "--include_path", "--limit"],
        "export": ["--adapter", "--zero_checkpoint", "--output_dir", "(required)", "--atol"],
        "import-gguf": ["[GGUF_FILE] OUTPUT_DIR", "--smollm2", "--overwrite"],
        "quickstart": ["--model_dir", "--config, --deepspeed, --deepspeed_config", "--max_minutes", "[-- ARGS]"],
        "tiny": ["OUT_DIR", "--style", "--hidden"],
        "report": ["OUTPUT_DIR", "--report_dir"],
        "nodes": ["--timeout SECONDS", "LAUNCHER"],
        "ui": ["--host", "--port", "--root", "(repeatable)", "--runs_dir", "--token"],
    }[command]
    for flag in flags:
        assert flag in out, (flag, out[:2000])


# ----------------------------------------------------------------------------------------------
# --deepspeed is --config wherever a preset is taken (train, loop and engine: tests/test_config.py).


def test_plan_takes_deepspeed_as_config(tmp_path):
    from finetune.plan import planner

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}))
    common = ["--model_name_or_path", str(model), "--accelerator", "cpu", "--devices_per_node", "2",
              "--host_memory", "8GB"]
    assert planner.make_plan([*common, "--deepspeed", "zero2"])["job"]["config"] == "zero2"
    assert planner.make_plan([*common, "--deepspeed_config", "zero3"])["job"]["config"] == "zero3"
    with pytest.raises(planner.PlanError) as e:
        planner.make_plan([*common, "--config", "zero2", "--deepspeed", "zero3"])
    assert "--config zero2 and --deepspeed zero3: these name different DeepSpeed configurations; give one" in str(e.value)


def test_quickstart_takes_deepspeed_as_config():
    from finetune.apps import quickstart as Q

    assert Q.parse(["--deepspeed", "zero2"]).config == "zero2"
    assert Q.parse(["--deepspeed", "--deepspeed_config", "zero3"]).config == "zero3"
    cfg = Q.parse(["--deepspeed", "zero2", "--", "--lora_r", "8"])
    assert cfg.config == "zero2" and cfg.extra_train_args == ["--lora_r", "8"]
    with pytest.raises(Q.QuickstartError) as e:
        Q.parse(["--config", "zero2", "--deepspeed", "zero3", "--max_steps", "0"])
    assert len(e.value.problems) == 2 and "these name different DeepSpeed configurations" in e.value.problems[0]


# ----------------------------------------------------------------------------------------------
# Recipe YAML for commands other than train.


def test_generate_recipe_equals_flags(tiny_chatml, tmp_path, capsys):
    by_flags = tmp_path / "flags.jsonl"
    code, _, err = finetune(capsys, "generate", "--model", tiny_chatml, "--prompt", "count: red blue", "--prompt", "hi",
                            "--max_new_tokens", "6", "--with_ids", "--output", by_flags)
    assert code == 0, err
    recipe = tmp_path / "generate.yaml"
    recipe.write_text(f"model: {tiny_chatml}\nprompt:\n  - 'count: red blue'\n  - hi\nmax_new_tokens: 6\nwith_ids: true\n")
    by_recipe = tmp_path / "recipe.jsonl"
    code, _, err = finetune(capsys, "generate", "--recipe", recipe, "--output", by_recipe)
    assert code == 0, err
    records = [json.loads(line) for line in by_recipe.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["count: red blue", "hi"]
    assert [r["completion_ids"] for r in records] == [json.loads(x)["completion_ids"] for x in by_flags.read_text().splitlines()]
    assert all(len(r["completion_ids"]) <= 6 for r in records)
    # The command line wins over the recipe.
    code, _, err = finetune(capsys, "generate", "--recipe", recipe, "--max_new_tokens", "2", "--output", by_recipe)
    assert code == 0 and all(len(json.loads(x)["completion_ids"]) <= 2 for x in by_recipe.read_text().splitlines())


def test_generate_recipe_problems_name_file_and_line(tmp_path, capsys):
    recipe = tmp_path / "generate.yaml"
    recipe.write_text("model: /nowhere\nmax_new_token: 5\nbatch_size: many\n")
    code, _, err = finetune(capsys, "generate", "--recipe", recipe, "--prompt", "hi")
    assert code == 2
    assert f"{recipe}:2: unknown key 'max_new_token'; did you mean 'max_new_tokens'?" in err
    assert f"{recipe}:3: batch_size: expected an integer, got 'many'" in err


def test_tiny_recipe(tmp_path, capsys):
    import transformers

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text("style: plain\nhidden: 32\nlayers: 1\n")
    code, out, err = finetune(capsys, "tiny", tmp_path / "m", "--recipe", recipe)
    assert code == 0, err
    config = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    assert (config.hidden_size, config.num_hidden_layers) == (32, 1)
    assert not (tmp_path / "m" / "chat_template.jinja").exists()  # style plain: no chat template


def test_rank_0_prints_the_problems_and_every_rank_exits_2(capsys, monkeypatch):
    monkeypatch.setitem(os.environ, "RANK", "1")
    code, out, err = finetune(capsys, "generate", "--max_new_token", "5")
    assert code == 2 and err == "" and out == ""


# ----------------------------------------------------------------------------------------------
# The parser's forms: positionals, repeatable flags, aliases, required flags.


def test_positionals_and_switches():
    from finetune.config.parser import ConfigError
    from finetune.convert import gguf_import

    cmd = gguf_import.command()
    args = cmd.parse(["--smollm2", "out"]).args  # a switch does not swallow the positional after it
    assert (args.smollm2, args.gguf_file, args.output_dir) == (True, None, "out")
    args = cmd.parse(["m.gguf", "out", "--overwrite"]).args
    assert (args.gguf_file, args.output_dir, args.overwrite) == ("m.gguf", "out", True)
    args = cmd.parse(["--overwrite", "false", "m.gguf", "--output_dir", "out"]).args  # a positional given as a flag
    assert (args.gguf_file, args.output_dir, args.overwrite) == ("m.gguf", "out", False)
    with pytest.raises(ConfigError) as e:
        cmd.parse([])
    assert e.value.problems == ["OUTPUT_DIR: required (The Hugging Face folder to write (must not exist unless --overwrite))"]


def test_repeatable_flag_and_alias():
    from finetune.config.parser import ConfigError
    from finetune.inference import generate

    cmd = generate.command()
    args = cmd.parse(["--model", "m", "--prompt", "a b", "--prompt", "c", "--no_chat", "--with_ids"]).args
    assert (args.model_name_or_path, args.prompt, args.chat, args.with_ids) == ("m", ["a b", "c"], False, True)
    with pytest.raises(ConfigError) as e:
        cmd.parse(["--model", "m", "--prompt", "a", "b"])
    assert e.value.problems == ["unexpected argument 'b': options look like --key value"]
    with pytest.raises(ConfigError) as e:
        cmd.parse(["--model", "m", "--model_name_or_path", "n", "--prompt", "a"])
    assert e.value.problems == ["--model m and --model_name_or_path n: both set 'model_name_or_path'; give one"]
    with pytest.raises(ConfigError) as e:
        cmd.parse(["--prompt", "a"])
    assert e.value.problems == ["--model_name_or_path: required (Local base model folder or Hub repo id (org/name))"]


def test_old_alias_works_and_says_the_new_name_once(capsys, monkeypatch, tmp_path):
    """metadata "old_aliases": a former flag name still sets the field, and the first use in a process prints one
    line with the new name (command line or recipe key); rank 1 stays quiet; --help shows it as "formerly"."""
    from dataclasses import dataclass, field

    from finetune.config import parser

    @dataclass
    class Args:
        model_name_or_path: str | None = field(default=None, metadata={"help": "The model.",
                                                                       "old_aliases": ("model_dir", "base_model")})

    monkeypatch.setattr(parser, "_NOTED", set())
    cmd = parser.Command("finetune x", {"args": Args})
    assert cmd.parse(["--model_dir", "m"]).args.model_name_or_path == "m"
    assert cmd.parse(["--model_dir", "n"]).args.model_name_or_path == "n"
    assert capsys.readouterr().err == "finetune x: --model_dir is now --model_name_or_path (the old spelling still works)\n"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("base_model: b\n")
    assert cmd.parse(["--recipe", str(recipe)]).args.model_name_or_path == "b"
    assert capsys.readouterr().err == f"finetune x: {recipe}:1: base_model is now model_name_or_path (the old spelling still works)\n"
    with pytest.raises(parser.ConfigError) as e:
        cmd.parse(["--base_model", "a", "--model_name_or_path", "b"])
    assert e.value.problems == ["--base_model a and --model_name_or_path b: both set 'model_name_or_path'; give one"]
    monkeypatch.setattr(parser, "_NOTED", set())
    monkeypatch.setitem(os.environ, "RANK", "1")
    cmd.parse(["--base_model", "m"])
    assert capsys.readouterr().err == ""
    assert "--model_name_or_path STR" in cmd.help() and "(formerly --model_dir, --base_model)" in cmd.help()


def test_version_and_unknown_command(capsys):
    from finetune import __version__

    main(["--version"])
    assert capsys.readouterr().out.strip() == f"finetune {__version__}"
    with pytest.raises(SystemExit) as info:
        main(["trian"])
    assert info.value.code == 2
    assert "unknown command 'trian'; did you mean 'train'?" in capsys.readouterr().err
