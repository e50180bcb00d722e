"""Bad inputs a careful user tries (issue 17): each ends in one clear message naming the file or key and the fix,
exit status 2, no traceback, and nothing left behind (no output folder, no finetune_config.yaml, no partial
checkpoint). A full disk at a checkpoint or at the final save says "no space left on <mount>" and keeps what was saved
before. Every case runs the real command line (`finetune.cli.main`) in this process, on tiny models.

Read-only folders and full disks are real: a tmpfs mounted read-only or small (root), or a folder without write
permission (other users)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from finetune.models import tiny

LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE")
ROOT = os.geteuid() == 0


def cli(argv, tmp_path, monkeypatch, capfd) -> tuple[int, str]:
    """`finetune ARGV` in this process -> (exit status, stderr); an uncaught exception is printed as the interpreter
    would (a traceback, status 1)."""
    from finetune.cli import main

    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "finetune-cache"))
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        traceback.print_exc()
        code = 1
    out, err = capfd.readouterr()
    return code, err + out


def mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    assert proc.returncode == 0, f"mount -t tmpfs -o {options}: {proc.stderr} (this test needs root to mount)"


@pytest.fixture
def mounts():
    """mount(where, options): a tmpfs, unmounted at the end of the test."""
    done = []

    def mount(where: Path, options: str) -> Path:
        mount_tmpfs(where, options)
        done.append(where)
        return where

    yield mount
    for where in reversed(done):
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def read_only(mounts):
    """read_only(path) -> a folder nobody here can write to: a read-only tmpfs (root) or mode 0555."""
    made = []

    def make(path: Path) -> Path:
        if ROOT:
            return mounts(path, "ro,size=1m")
        path.mkdir(parents=True)
        path.chmod(0o555)
        made.append(path)
        return path

    yield make
    for path in made:
        path.chmod(0o755)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tiny.write_jsonl(tmp_path_factory.mktemp("bad-inputs") / "data.jsonl", tiny.synthetic_records(8))


def train_args(model, data, out, *extra, steps: int = 2):
    return ["train", "--model_name_or_path", model, "--dataset", data, "--output_dir", out, "--max_steps", str(steps),
            "--per_device_train_batch_size", "2", "--max_seq_length", "64", "--disable_tqdm", "true", *extra]


def model_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _ds(tmp, body) -> Path:
    (tmp / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                             "gradient_accumulation_steps": "auto", **body}))
    return tmp / "ds.json"


def _truncate(m: Path) -> None:
    f = m / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _no_tokenizer(m: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (m / name).unlink(missing_ok=True)


def _small_vocab(m: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(m)
    config.vocab_size = 100  # the tokenizer has about 530
    AutoModelForCausalLM.from_config(config).save_pretrained(m)


def _t5(m: Path) -> None:
    (m / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 64, "vocab_size": 600}))


# case id -> (how to break the model folder, or None; extra train flags given tmp; what the message must name)
MODEL_CASES = {
    "t5-config": (_t5, "config.json: model_type 't5' is not a causal"),
    "truncated-safetensors": (_truncate, "model.safetensors: cut off"),
    "empty-safetensors": (lambda m: (m / "model.safetensors").write_bytes(b""), "model.safetensors: empty"),
    "no-tokenizer": (_no_tokenizer, "no tokenizer"),
    "config-not-json": (lambda m: (m / "config.json").write_text("{model_type: llama"), "config.json:1: not valid JSON"),
    "tokenizer-config-not-json": (lambda m: (m / "tokenizer_config.json").write_text("{oops"),
                                  "tokenizer_config.json:1: not valid JSON"),
    "tokenizer-json-not-json": (lambda m: (m / "tokenizer.json").write_text('{"version": '),
                                "tokenizer.json:1: not valid JSON"),
    "index-names-missing-shard": (lambda m: (m / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})),
        "names shard(s) not in the folder: model-00002-of-00002.safetensors"),
    "vocab-smaller-than-tokenizer": (_small_vocab, "vocab_size 100 is smaller than the tokenizer's"),
}

# case id -> (train flags given tmp (and the read_only factory), what the message must name)
FLAG_CASES = {
    "ds-unknown-zero-key": (lambda t, ro: ["--config", _ds(t, {"zero_optimization": {"stage": 2, "overlap_com": True}})],
                            "zero_optimization.overlap_com: unknown key; did you mean 'overlap_comm'?"),
    "ds-unknown-nested-key": (lambda t, ro: ["--config", _ds(t, {"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_mem": True}}})],
        "zero_optimization.offload_optimizer.pin_mem: unknown key; did you mean 'pin_memory'?"),
    "ds-misspelt-section": (lambda t, ro: ["--config", _ds(t, {"zero_optimisation": {"stage": 2}})],
                            "unknown key 'zero_optimisation'; did you mean 'zero_optimization'?"),
    "ds-batch-conflict": (lambda t, ro: ["--config", _ds(t, {"train_batch_size": 7, "zero_optimization": {"stage": 2}})],
                          "train_batch_size is 7 but"),
    "ds-micro-batch-conflict": (lambda t, ro: ["--config", _ds(t, {"train_micro_batch_size_per_gpu": 3,
                                                                   "zero_optimization": {"stage": 1}})],
                                "train_micro_batch_size_per_gpu is 3 but --per_device_train_batch_size gives 2"),
    "lora-target-modules": (lambda t, ro: ["--use_peft", "--lora_target_modules", "q_prj"],
                            "--lora_target_modules: 'q_prj'; did you mean 'q_proj'?"),
    "attn-implementation-unknown": (lambda t, ro: ["--attn_implementation", "flash"],
                                    "attn_implementation: 'flash' is not an attention kernel"),
    "attn-implementation-flash2": (lambda t, ro: ["--attn_implementation", "flash_attention_2"],
                                   "attn_implementation: flash_attention_2"),
    "output-dir-read-only": (lambda t, ro: ["--output_dir", ro(t / "ro") / "out"], "--output_dir"),
    "output-dir-is-a-file": (lambda t, ro: ["--output_dir", _file(t / "a-file")], "is a file, not a folder"),
    "output-dir-under-a-file": (lambda t, ro: ["--output_dir", _file(t / "a-file") / "out"],
                                "a-file is a file, so the folder cannot be made"),
    "cache-dir-read-only": (lambda t, ro: ["--dataset_cache_dir", ro(t / "ro-cache") / "tok"], "--dataset_cache_dir"),
    "logging-dir-read-only": (lambda t, ro: ["--logging_dir", ro(t / "ro-logs")], "--logging_dir"),
}


def _file(path: Path) -> Path:
    path.write_text("not a folder\n")
    return path


def assert_clear(code: int, err: str, *needles: str) -> None:
    report = f"exit {code}\n{err[-4000:]}"
    assert code == 2, report
    assert "Traceback" not in err, report
    lines = [line for line in err.splitlines() if any(n in line for n in needles)]
    for needle in needles:
        assert any(needle in line for line in lines), f"no line names {needle!r}\n{report}"


def assert_no_debris(tmp_path: Path, *also: Path) -> None:
    """No output folder, and no finetune_config.yaml outside the folders a test trained into on purpose."""
    left = [p for p in tmp_path.rglob("finetune_config.yaml") if not {"lora", "run"} & set(p.parts)]
    left += [p for p in (tmp_path / "out", *also) if p.exists()]
    assert not left, f"left behind: {left}"


@pytest.mark.parametrize("case", MODEL_CASES)
def test_bad_model_folder(case, tiny_chatml, data, tmp_path, monkeypatch, capfd, isolated, one_thread):
    breaks, needle = MODEL_CASES[case]
    model = model_copy(tiny_chatml, tmp_path / "model")
    breaks(model)
    code, err = cli(train_args(model, data, tmp_path / "out"), tmp_path, monkeypatch, capfd)
    assert_clear(code, err, needle)
    assert_no_debris(tmp_path)


@pytest.mark.parametrize("case", FLAG_CASES)
def test_bad_flag_or_folder(case, tiny_chatml, data, tmp_path, monkeypatch, capfd, isolated, one_thread, read_only):
    flags, needle = FLAG_CASES[case]
    extra = flags(tmp_path, read_only)
    code, err = cli(train_args(tiny_chatml, data, tmp_path / "out", *extra), tmp_path, monkeypatch, capfd)
    assert_clear(code, err, needle)
    assert_no_debris(tmp_path)


@pytest.mark.parametrize("path", ["engine", "loop"])
def test_ds_json_on_other_paths(path, tiny_chatml, data, tmp_path, monkeypatch, capfd, isolated, one_thread):
    ds = _ds(tmp_path, {"train_batch_size": 7, "zero_optimization": {"stage": 2, "overlap_com": True}})
    argv = [path, *train_args(tiny_chatml, data, tmp_path / "out", "--config", ds)[1:]]
    code, err = cli(argv, tmp_path, monkeypatch, capfd)
    assert_clear(code, err, "train_batch_size is 7 but", "zero_optimization.overlap_com: unknown key")
    assert_no_debris(tmp_path)


# ----------------------------------------------------------------------------------------------
# Checkpoints: garbled files, a LoRA checkpoint under a full run.


def _train(argv, tmp_path, monkeypatch, capfd):
    code, err = cli(argv, tmp_path, monkeypatch, capfd)
    assert code == 0, err[-4000:]
    return err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_garbled_checkpoint_named_before_resume(tiny_chatml, data, tmp_path, monkeypatch, capfd, isolated, one_thread):
    out = tmp_path / "run"
    _train(train_args(tiny_chatml, data, out, "--save_steps", "1"), tmp_path, monkeypatch, capfd)  # checkpoint-1, model
    argv = train_args(tiny_chatml, data, out, "--save_steps", "1", steps=3)
    from finetune.training import checkpoint

    weights = checkpoint.latest(out) / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0x01  # one bit of the last tensor: same size, so a size check cannot see it
    weights.write_bytes(bytes(raw))
    before = snapshot(out)
    code, err = cli(argv + ["--resume_from_checkpoint", "latest"], tmp_path, monkeypatch, capfd)
    assert_clear(code, err, f"{weights} is not the file the checkpoint saved")
    assert snapshot(out) == before  # nothing trained, nothing written


def test_lora_checkpoint_resumed_by_full_run(tiny_chatml, data, tmp_path, monkeypatch, capfd, isolated, one_thread):
    lora = tmp_path / "lora"
    _train(train_args(tiny_chatml, data, lora, "--use_peft", "--save_steps", "1"), tmp_path, monkeypatch, capfd)
    code, err = cli(train_args(tiny_chatml, data, tmp_path / "out", "--resume_from_checkpoint",
                               lora / "checkpoint-1"), tmp_path, monkeypatch, capfd)
    assert_clear(code, err, "trained a LoRA adapter (--use_peft); this run trains every weight")
    assert_no_debris(tmp_path)


# ----------------------------------------------------------------------------------------------
# finetune generate, finetune quickstart.


def test_generate_non_utf8_prompts(tiny_chatml, tmp_path, monkeypatch, capfd, isolated, one_thread):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "hello"}\n{"prompt": "caf\xe9"}\n')
    code, err = cli(["generate", "--model", tiny_chatml, "--prompts", prompts, "--max_new_tokens", "2", "--output",
                     tmp_path / "out" / "gen.jsonl"], tmp_path, monkeypatch, capfd)
    assert_clear(code, err, f"--prompts {prompts}:2: not UTF-8 text (byte 0xe9)")
    assert_no_debris(tmp_path)


@pytest.mark.parametrize("flag", ["--offload_folder", "--output"])
def test_generate_read_only_folder(flag, tiny_chatml, tmp_path, monkeypatch, capfd, isolated, one_thread, read_only):
    target = read_only(tmp_path / "ro") / ("offload" if flag == "--offload_folder" else "gen.jsonl")
    code, err = cli(["generate", "--model", tiny_chatml, "--prompt", "hi", "--max_new_tokens", "2", "--device_map",
                     "auto", "--max_memory", "cpu=20KB,disk=1GB", flag, target], tmp_path, monkeypatch, capfd)
    assert_clear(code, err, flag)
    assert not target.exists()


def test_quickstart_bad_data_before_evaluation(tiny_chatml, tmp_path, monkeypatch, capfd, isolated, one_thread):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}\n'
                   '{"messages": [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "ok"}]}\n')
    started = time.time()
    code, err = cli(["quickstart", "--model_dir", tiny_chatml, "--train_file", bad, "--output_dir", tmp_path / "out",
                     "--max_steps", "1", "--eval_examples", "2", "--processes", "1"], tmp_path, monkeypatch, capfd)
    assert_clear(code, err, f"--train_file: {bad}:2")
    assert "base:" not in err and time.time() - started < 30, err  # stopped before the base evaluation
    assert_no_debris(tmp_path)


# ----------------------------------------------------------------------------------------------
# A full disk.


def _fill(folder: Path, leave: int) -> None:
    """Fill the file system of `folder` up to `leave` free bytes."""
    free = shutil.disk_usage(folder).free
    with open(folder / "filler", "wb") as f:
        f.write(b"\0" * max(free - leave, 0))


def test_disk_full_at_checkpoint(tiny_chatml, data, tmp_path, monkeypatch, capfd, isolated, one_thread, mounts):
    disk = mounts(tmp_path / "disk", "size=8m")
    out = disk / "run"
    _train(train_args(tiny_chatml, data, out, "--save_steps", "1"), tmp_path, monkeypatch, capfd)  # checkpoint-1, model
    argv = train_args(tiny_chatml, data, out, "--save_steps", "1", steps=4)
    from finetune.training import checkpoint

    kept, newest = snapshot(out), checkpoint.latest(out)
    one_checkpoint = sum(len(v) for k, v in kept.items() if k.startswith(f"{newest.name}/"))
    _fill(disk, one_checkpoint // 2)  # room for half a checkpoint
    code, err = cli(argv + ["--resume_from_checkpoint", "latest"], tmp_path, monkeypatch, capfd)
    assert_clear(code, err, f"no space left on {disk}", "checkpoint-3 was not saved")
    assert snapshot(out) == kept  # the earlier checkpoint and model, byte for byte; no partial checkpoint-2
    (disk / "filler").unlink()
    code, err = cli(argv + ["--resume_from_checkpoint", "latest"], tmp_path, monkeypatch, capfd)
    assert code == 0 and f"resume: from {newest}\n" in err, err[-3000:]  # the kept checkpoint resumes


def test_disk_full_at_final_save(tiny_chatml, data, tmp_path, monkeypatch, capfd, isolated, one_thread, mounts):
    disk = mounts(tmp_path / "disk", "size=8m")
    out = disk / "run"
    _train(train_args(tiny_chatml, data, out, "--save_steps", "1"), tmp_path, monkeypatch, capfd)  # checkpoint-1, model
    kept = snapshot(out)
    model = sum(len(v) for k, v in kept.items() if "/" not in k)
    _fill(disk, model // 2)
    # Raising --max_steps continues the same run from checkpoint-1; no checkpoints now: only the final save writes.
    code, err = cli(train_args(tiny_chatml, data, out, "--resume_from_checkpoint", "latest", steps=3),
                    tmp_path, monkeypatch, capfd)
    assert_clear(code, err, f"no space left on {disk}", "the final model was not saved")
    assert snapshot(out) == kept  # the previous model and checkpoint untouched, no staging folder left


@pytest.mark.slow
def test_quickstart_launcher_failing_rank_no_traceback(tiny_chatml, tmp_path):
    """The quickstart's 2-process launch (accelerate launch via quickstart_worker): a rank that exits 2 with its own
    message ends the launcher with status 2 and that message, without torch elastic's traceback."""
    from finetune import testing

    missing = tmp_path / "no-such-data.jsonl"
    cmd = [sys.executable, "-m", "finetune.apps.quickstart_worker", "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip",
           "127.0.0.1", "--main_process_port", str(testing.free_port()), "-m", "finetune.apps.quickstart_worker",
           *train_args(tiny_chatml, missing, tmp_path / "out")[1:]]
    result = testing.run(cmd, timeout=240)
    assert result.returncode == 2, result.output[-4000:]
    assert f"dataset: {missing}: no such file or folder" in result.output, result.output[-4000:]
    assert "Traceback" not in result.output and "ChildFailedError" not in result.output, result.output[-4000:]
    assert "unknown key" not in result.output, result.output[-4000:]  # the launch flags went to the launcher
