"""Nothing silent, nothing slow to refuse: every command answers a flag mistake before torch is imported; `finetune
plan` runs train's checks of the model's family (LoRA targets); `finetune nodes` checks its launch line before it
listens; --report_to's trackers are checked before anything loads (a misspelt name, W&B without a key or a folder, a
tracking server that does not answer); and data of another method's shape names the method that reads it, for
every method of the registry and every shape of record."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from finetune import cli, methods
from finetune.data.formats import shapes
from tests.hub_server import silent
from tests.test_fast_errors import LIBRARIES, run_timed_imports

FINETUNE = [sys.executable, "-m", "finetune"]


def timed(cmd: list[str], tmp_path: Path, **env: str):
    start = time.monotonic()
    proc, imported = run_timed_imports(cmd, tmp_path, **env)
    return proc, imported, time.monotonic() - start


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_command_answers_a_flag_mistake_before_torch(command, tmp_path):
    proc, imported, seconds = timed([*FINETUNE, command, "--bogus_flag", "1"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--bogus_flag: unknown key 'bogus_flag'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not imported & set(LIBRARIES), (command, sorted(imported & set(LIBRARIES)))
    print(f"\nfinetune {command} --bogus_flag 1: exit 2 in {seconds:.2f} s, no torch")


# ----------------------------------------------------------------------------------------------
# finetune nodes: the launch line, before anything listens (and before torchrun's or accelerate's parser imports
# torch).


@pytest.mark.parametrize("line, message", [
    ("torchrun --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --master_port 70000 train.py",
     "torchrun --master_port 70000: not a port; give one from 1 to 65535"),
    ("torchrun --nnodes 2 --rdzv-endpoint 10.0.0.1:0 train.py", "torchrun --rdzv_endpoint 0: not a port"),
    ("accelerate launch --num_machines 2 --machine_rank 0 --main_process_ip h --main_process_port 0 train.py",
     "accelerate --main_process_port 0: not a port"),
    ("torchrun --nnodes 2 --node_rank 2 --master_addr 10.0.0.1 --master_port 29500 train.py",
     "torchrun --node_rank 2: not a node of the 2; give this node's rank, 0 to 1"),
    ("accelerate launch --num_machines 3 --machine_rank 5 --main_process_ip h --main_process_port 29500 train.py",
     "accelerate --machine_rank 5: not a node of the 3; give this node's rank, 0 to 2"),
    ("torchrun --nnodes 2 --node_rank 1 --master_port 29500 train.py",
     "torchrun --master_addr: missing on a 2-node line; give node 0's address"),
    ("accelerate launch --num_machines 2 --machine_rank 1 --main_process_port 29500 train.py",
     "accelerate --main_process_ip: missing on a 2-node line"),
    ("torchrun --nnodes 2 --rdzv_backend c10d train.py", "torchrun --rdzv_endpoint: missing on a 2-node line"),
    ("deepspeed --hostfile HOSTFILE --no_ssh --node_rank 1 --master_port 29500 scripts/sft.py",
     "deepspeed --master_addr: missing on a 2-node line"),
])
def test_nodes_checks_the_launch_line_before_it_listens(line, message, tmp_path, capsys):
    from finetune.apps import nodes

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        nodes.main(["--timeout", "600", *line.replace("HOSTFILE", str(hostfile)).split()])
    seconds = time.monotonic() - start
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"finetune nodes: {message}") and len(err.splitlines()) == 1, err
    assert seconds < 10, seconds  # not the 600 s wait
    print(f"\n{line}: exit 2 in {seconds:.2f} s: {err.strip()}")


def test_nodes_checks_the_line_before_torch(tmp_path):
    """torchrun's and accelerate's own parsers import torch (seconds): the line's numbers are read before them."""
    proc, imported, seconds = timed([*FINETUNE, "nodes", "torchrun", "--nnodes", "2", "--node_rank", "0",
                                     "--master_addr", "h", "--master_port", "70000", "train.py"], tmp_path)
    assert proc.returncode == 2 and "torchrun --master_port 70000: not a port" in proc.stderr, proc.stderr
    assert not imported & set(LIBRARIES), sorted(imported & set(LIBRARIES))
    print(f"\nfinetune nodes torchrun ... --master_port 70000: exit 2 in {seconds:.2f} s, no torch")


# ----------------------------------------------------------------------------------------------
# finetune plan: train's checks of the family (the LoRA targets), one line, exit 2, no traceback.


def test_plan_refuses_the_lora_targets_train_refuses(tiny_chatml, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    flags = ["--model_name_or_path", str(tiny_chatml), "--dataset", str(data), "--output_dir", str(tmp_path / "o"),
             "--use_peft", "--lora_target_modules", "q_proj", "qq_proj"]
    expected = (f"--lora_target_modules: 'qq_proj'; did you mean 'q_proj'?: no such module in {tiny_chatml} (its "
                "linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; or all-linear)")
    for command in ("plan", "train"):
        proc, imported, seconds = timed([*FINETUNE, command, *flags], tmp_path)
        assert proc.returncode == 2 and f"  - {expected}\n" in proc.stderr, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and not imported & set(LIBRARIES), sorted(imported & set(LIBRARIES))
        print(f"\nfinetune {command}: exit 2 in {seconds:.2f} s: {expected}")
    assert not (tmp_path / "o").exists()
    # A module train would adapt but the planner cannot count: one line too (before: a traceback from the planner).
    proc, imported, _ = timed([*FINETUNE, "plan", *flags[:-2], "lm_head"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not imported & set(LIBRARIES), proc.stderr[-3000:]
    assert "  - lora_target_modules: 'lm_head' is not a linear projection of a llama model" in proc.stderr


def test_the_family_model_types_are_transformers_causal_lms():
    """models/files.py passes a family's model_type without importing transformers (seconds): it must be one
    (a vision-language family's, one of transformers' image-text-to-text models)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    from finetune.models.families import FAMILIES

    assert {t for f in FAMILIES if not f.vision for t in f.model_types} <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    vision = {t for f in FAMILIES if f.vision for t in f.model_types}
    assert vision and vision <= set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


# ----------------------------------------------------------------------------------------------
# --report_to: checked before anything loads.


def test_the_trackers_named_are_transformers_own():
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    from finetune.config.ship import INTEGRATIONS

    assert sorted(INTEGRATIONS) == sorted(INTEGRATION_TO_CALLBACK)


@pytest.fixture(scope="module")
def stalled():
    url, stop = silent()
    yield url
    stop()


@pytest.mark.parametrize("case", ["misspelt", "wandb_no_key", "wandb_offline_no_folder", "mlflow_no_answer",
                                  "wandb_no_answer"])
def test_trackers_are_checked_before_anything_loads(case, tmp_path, stalled):
    from finetune.config import ship

    unwritable = tmp_path / "file"
    unwritable.write_text("")
    # HOME: a folder without a .netrc (no saved W&B key).
    env = {"HOME": str(tmp_path), "PATH": os.environ.get("PATH", "")}
    report, message = {
        "misspelt": (["wandbb"], "report_to: 'wandbb' is not a tracker; did you mean 'wandb'? (one of: azure_ml,"),
        "wandb_no_key": (["wandb"], "report_to wandb: no W&B API key; set WANDB_API_KEY (or run `wandb login`), or "
                                    "WANDB_MODE=offline to keep the run in ./wandb (`wandb sync` later)"),
        "wandb_offline_no_folder": (["wandb", "tensorboard"], f"report_to wandb: WANDB_MODE=offline writes the run under "
                                                              f"WANDB_DIR={unwritable}/wandb, which cannot be written; "
                                                              "set WANDB_DIR to a writable folder"),
        "mlflow_no_answer": (["mlflow"], f"report_to mlflow: MLFLOW_TRACKING_URI={stalled} did not answer (no answer "
                                         "within 5 s); start the tracking server or fix the URI"),
        "wandb_no_answer": (["wandb"], f"report_to wandb: {stalled} did not answer (no answer within 5 s); check the "
                                       "network or WANDB_BASE_URL, or WANDB_MODE=offline"),
    }[case]
    env.update({"wandb_offline_no_folder": {"WANDB_MODE": "offline", "WANDB_DIR": f"{unwritable}/wandb"},
                "mlflow_no_answer": {"MLFLOW_TRACKING_URI": stalled},
                "wandb_no_answer": {"WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": stalled}}.get(case, {}))
    start = time.monotonic()
    problems = ship.tracker_problems(report, env)
    seconds = time.monotonic() - start
    assert len(problems) == 1 and problems[0].startswith(message), problems
    assert seconds < 5 + 2, seconds  # the probe's 5 s
    print(f"\n{case}: {seconds:.2f} s: {problems[0]}")


def test_a_tracker_problem_stops_train_before_torch(tiny_chatml, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    proc, imported, seconds = timed([*FINETUNE, "train", "--model_name_or_path", str(tiny_chatml), "--dataset",
                                     str(data), "--output_dir", str(tmp_path / "o"), "--report_to", "wandbb"], tmp_path)
    assert proc.returncode == 2 and "  - report_to: 'wandbb' is not a tracker; did you mean 'wandb'?" in proc.stderr
    assert "Traceback" not in proc.stderr and not imported & set(LIBRARIES), sorted(imported & set(LIBRARIES))
    assert not (tmp_path / "o").exists()
    print(f"\nfinetune train --report_to wandbb: exit 2 in {seconds:.2f} s, no torch")


# ----------------------------------------------------------------------------------------------
# Data of another method's shape names the method that reads it: every method x every shape of record.

RECORDS = {
    "pairs": {"prompt": "Say hi", "chosen": "hi", "rejected": "no"},
    "unpaired": {"prompt": "Say hi", "completion": "hi", "label": True},
    "chat": {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]},
    "alpaca": {"instruction": "Say hi", "input": "", "output": "hi"},
    "text": {"text": "hello world"},
}


@pytest.mark.parametrize("method", methods.names())
def test_every_method_names_the_method_of_the_data_it_is_given(method, tiny_chatml, tmp_path, monkeypatch):
    """Each shape: the method reads it exactly when shapes.SHAPES says so (the table is the registry's truth, and
    every method reads some shape); otherwise the one-line refusal names the file's first line, and every method
    that reads the shape (and `--method` before them)."""
    from transformers import AutoTokenizer

    from finetune.config.training import DataConfig
    from finetune.data.errors import DataError

    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_chatml)
    m = methods.get(method)
    read = []
    for name, record in RECORDS.items():
        shape = shapes.shape_of(record)
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
        early = shapes.first_record_problem(str(path), method)  # the flag check's, before anything loads
        try:
            m.prepare(DataConfig(dataset=str(path), max_seq_length=512), tokenizer, local_rank=0, log=lambda *a: None)
        except DataError as e:
            text = str(e)
            assert method not in shapes.SHAPES[shape][1], (method, name, text)
            assert text.startswith(f"{path}:1: ") and "\n" not in text, text
            assert shapes.methods_phrase(shape) in text and shapes.SHAPES[shape][0] in text, (method, name, text)
            assert early == (f"dataset: {path}:1: {shapes.SHAPES[shape][0]}, which --method {method} does not train "
                             f"on; {shapes.methods_phrase(shape)} does"), early
            print(f"\n--method {method}, {name}: {text}")
        else:
            assert method in shapes.SHAPES[shape][1], (method, name, "read, but the table says it does not")
            assert early is None, early
            read.append(name)
    assert read, f"--method {method} reads none of the shapes: add its shape to finetune/data/formats/shapes.py"


def test_every_method_is_in_the_shape_table():
    assert {m for _, names in shapes.SHAPES.values() for m in names} == set(methods.names())
    # DPO given KTO's data: the case the issue names.
    assert shapes.hint(RECORDS["unpaired"], "dpo") == " (an unpaired example (prompt, completion, label): --method kto)"
    assert re.search(r"--method dpo, simpo, orpo, cpo or reward\)$", shapes.hint(RECORDS["pairs"], "kto"))


def test_data_of_another_method_is_refused_before_torch(tiny_chatml, tmp_path):
    """DPO given KTO's unpaired examples: one line naming --method kto, with the flag problems (the first record
    read), before the model or the data load."""
    data = tmp_path / "kto.jsonl"
    data.write_text(json.dumps(RECORDS["unpaired"]) + "\n")
    proc, imported, seconds = timed([*FINETUNE, "train", "--method", "dpo", "--model_name_or_path", str(tiny_chatml),
                                     "--dataset", str(data), "--output_dir", str(tmp_path / "o")], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"  - dataset: {data}:1: an unpaired example (prompt, completion, label), which --method dpo does not " \
           "train on; --method kto does\n" in proc.stderr, proc.stderr
    assert not imported & set(LIBRARIES), sorted(imported & set(LIBRARIES))
    print(f"\nfinetune train --method dpo on KTO's data: exit 2 in {seconds:.2f} s, no torch")
