"""Mistakes that used to be taken silently or ended in a traceback (issue 36): each now ends with exit 2 and one line
naming the flag, file or line and the fix, before any model loads where the flags show it, and leaves nothing
behind. Ctrl-C ends with one line and exit 130. Every case runs the real command line (`finetune.cli.main`), in this
process, on tiny models; Ctrl-C runs in a process of its own."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.models import tiny
from finetune.testing import _in_child
from launch import env
from test_bad_inputs import assert_clear, assert_no_debris, cli, model_copy, mounts, train_args  # noqa: F401


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tiny.write_jsonl(tmp_path_factory.mktemp("refusals") / "data.jsonl", tiny.synthetic_records(8))


def _saved_dataset(t: Path) -> Path:
    from datasets import Dataset

    Dataset.from_list([{"text": "hello world"}] * 4).save_to_disk(str(t / "ds"))
    return t / "ds"


def _recipe(t: Path) -> Path:
    (t / "base.yaml").write_text("max_steps: 1\n")
    (t / "r.yaml").write_text("learning_rate: 1.0e-4\nrecipe: base.yaml\n")
    return t / "r.yaml"


# case id -> (extra train flags given tmp and the data file, the flags replacing --output_dir or None, needles)
TRAIN_CASES = {
    "revision-of-a-local-folder": (lambda t, d: ["--model_revision", "v2"],
                                   ["model_revision: v2 selects a revision of a Hub repo id", "drop --model_revision"]),
    "nested-recipe": (lambda t, d: ["--recipe", _recipe(t)],
                      ["r.yaml:2: recipe: base.yaml: a recipe cannot name another recipe"]),
    "eval-steps-negative": (lambda t, d: ["--eval_dataset", d, "--eval_steps", "-1"],
                            ["eval_steps: must be a positive number of steps", "got -1"]),
    "save-steps-zero": (lambda t, d: ["--save_steps", "0"], ["save_steps: must be a positive number of steps"]),
    "eval-dataset-missing": (lambda t, d: ["--eval_dataset", t / "nope.jsonl"],
                             ["eval_dataset: ", "nope.jsonl: no such file or folder"]),
    "early-stopping-without-eval-set": (lambda t, d: ["--early_stopping_patience", "2",
                                                      "--load_best_model_at_end", "true"],
                                        ["early_stopping_patience: needs an eval set",
                                         "load_best_model_at_end: needs an eval set"]),
    "weights-not-finite": (lambda t, d: ["--dataset", d, "--dataset_weights", "inf", "nan"],
                           ["dataset_weights: every weight must be a finite number, got inf, nan"]),
    "chat-template-is-a-folder": (lambda t, d: ["--chat_template", t],
                                  ["is a folder; give the Jinja file itself"]),
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_flag_refused(case, tiny_chatml, data, tmp_path, monkeypatch, capfd, isolated, one_thread):
    flags, needles = TRAIN_CASES[case]
    code, err = cli(train_args(tiny_chatml, data, tmp_path / "out", *flags(tmp_path, data)), tmp_path, monkeypatch,
                    capfd)
    assert_clear(code, err, *needles)
    assert "Loading weights" not in err  # refused before any model loads
    assert_no_debris(tmp_path)


def test_output_dir_inside_a_saved_data_set(tiny_chatml, tmp_path, monkeypatch, capfd, isolated, one_thread):
    ds = _saved_dataset(tmp_path)
    before = sorted(p.name for p in ds.iterdir())
    code, err = cli(train_args(tiny_chatml, ds, ds / "out"), tmp_path, monkeypatch, capfd)
    assert_clear(code, err, "is (inside) the data set folder")
    assert sorted(p.name for p in ds.iterdir()) == before
    code, err = cli(train_args(tiny_chatml, ds, ds), tmp_path, monkeypatch, capfd)
    assert_clear(code, err, "is (inside) the data set folder")


def test_remote_code_named_without_running_it(tiny_chatml, data, tmp_path, monkeypatch, capfd, isolated, one_thread):
    model = model_copy(tiny_chatml, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="custom_lm", auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                   "AutoModelForCausalLM": "modeling_custom.CustomLM"})
    (model / "config.json").write_text(json.dumps(config))
    ran = tmp_path / "code-ran"
    for name in ("configuration_custom.py", "modeling_custom.py"):
        (model / name).write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    code, err = cli(train_args(model, data, tmp_path / "out"), tmp_path, monkeypatch, capfd)
    assert_clear(code, err, "configuration_custom.py, modeling_custom.py", "--trust_remote_code true")
    assert not ran.exists(), "the model's code ran"
    assert_no_debris(tmp_path)


def _pairs(t: Path, role: str = "user") -> Path:
    return tiny.write_jsonl(t / "pairs.jsonl", [{"prompt": [{"role": role, "content": "hi"}],
                                                 "chosen": [{"role": "assistant", "content": "yes"}],
                                                 "rejected": [{"role": "assistant", "content": "no"}]}] * 4)


def test_preference_data_given_to_sft_names_the_method(tiny_chatml, tmp_path, monkeypatch, capfd, isolated,
                                                       one_thread):
    code, err = cli(train_args(tiny_chatml, _pairs(tmp_path), tmp_path / "out"), tmp_path, monkeypatch, capfd)
    # Found from the first record with the flag problems, before anything loads (finetune/data/formats/shapes.py).
    assert_clear(code, err, "pairs.jsonl:1: a preference pair (prompt, chosen, rejected), which --method sft does not "
                 "train on", "--method dpo, simpo, orpo, cpo or reward does")
    assert "--dataset_format" not in err
    assert_no_debris(tmp_path)


def test_sharegpt_role_in_a_pair_is_named_in_the_prompt(tiny_chatml, tmp_path, monkeypatch, capfd, isolated,
                                                        one_thread):
    code, err = cli(train_args(tiny_chatml, _pairs(tmp_path, "human"), tmp_path / "out", "--method", "dpo"),
                    tmp_path, monkeypatch, capfd)
    assert_clear(code, err, "pairs.jsonl:1 (prompt): messages[0].role is 'human'", "did you mean 'user'?")
    assert "(chosen)" not in err
    assert_no_debris(tmp_path)


def test_sampling_at_temperature_zero(tiny_chatml, tmp_path, monkeypatch, capfd, isolated, one_thread):
    code, err = cli(["generate", "--model_name_or_path", tiny_chatml, "--prompt", "hi", "--do_sample",
                     "--temperature", "0"], tmp_path, monkeypatch, capfd)
    assert_clear(code, err, "--temperature: must be above 0 when sampling", "drop --do_sample")
    assert "Loading weights" not in err


def test_tiny_keeps_a_non_empty_folder(tmp_path, monkeypatch, capfd, isolated, one_thread):
    run = tmp_path / "run"
    code, err = cli(["tiny", run], tmp_path, monkeypatch, capfd)
    assert code == 0, err
    (run / "checkpoint-5").mkdir()
    weights = (run / "model.safetensors").read_bytes()
    code, err = cli(["tiny", run, "--seed", "1"], tmp_path, monkeypatch, capfd)
    assert_clear(code, err, "OUT_DIR", "not empty", "--overwrite")
    assert (run / "model.safetensors").read_bytes() == weights and (run / "checkpoint-5").is_dir()
    code, err = cli(["tiny", run, "--seed", "1", "--overwrite"], tmp_path, monkeypatch, capfd)
    assert code == 0, err
    assert (run / "model.safetensors").read_bytes() != weights and not (run / "checkpoint-5").exists()


PLAN_CASES = {
    "device-memory-zero": (["--device_memory", "0"], "--device_memory: must be a positive size"),
    "devices-per-node-absurd": (["--devices_per_node", "10000000"], "--devices_per_node: 10000000 is more than"),
    "cluster-absurd": (["--devices_per_node", "8", "--num_nodes", "1000000"],
                       "--num_nodes x --devices_per_node: 8,000,000 devices is beyond any cluster"),
    "flag-named-once": (["--devices_per_node", "1e7"], "--devices_per_node: expected an integer"),
}


@pytest.mark.parametrize("case", PLAN_CASES)
def test_plan_machine_flags(case, tiny_chatml, tmp_path, monkeypatch, capfd, isolated, one_thread):
    flags, needle = PLAN_CASES[case]
    code, err = cli(["plan", "--model_name_or_path", tiny_chatml, *flags], tmp_path, monkeypatch, capfd)
    assert_clear(code, err, needle)
    assert "devices_per_node: devices_per_node" not in err
    assert "use more devices" not in err


@pytest.fixture
def ro(mounts, tmp_path):
    """A folder nobody here can write to (a tmpfs remounted read-only as root, else mode 0555), holding what `fill`
    put there first."""
    made = []

    def make(name: str, fill=None) -> Path:
        where = mounts(tmp_path / name, "size=20m") if os.geteuid() == 0 else tmp_path / name
        where.mkdir(exist_ok=True)
        if fill:
            fill(where)
        if os.geteuid() == 0:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        else:
            where.chmod(0o555)
            made.append(where)
        return where

    yield make
    for where in made:
        where.chmod(0o755)


def _gguf(tiny_chatml, tmp_path, monkeypatch, capfd) -> Path:
    code, err = cli(["export", "--to", "gguf", "--model_name_or_path", tiny_chatml, tmp_path / "m.gguf"], tmp_path,
                    monkeypatch, capfd)
    assert code == 0, err
    return tmp_path / "m.gguf"


def test_read_only_targets(tiny_chatml, tmp_path, monkeypatch, capfd, isolated, one_thread, ro):
    gguf = _gguf(tiny_chatml, tmp_path, monkeypatch, capfd)
    target = ro("ro")
    for argv, flag in ((["export", "--to", "gguf", "--model_name_or_path", tiny_chatml, target / "x.gguf"], "OUTPUT"),
                       (["import-gguf", gguf, target / "imported"], "OUT_DIR")):
        code, err = cli(argv, tmp_path, monkeypatch, capfd)
        assert_clear(code, err, f"{flag} {target}: cannot write in {target}")
    run = ro("run", lambda w: (w / "trainer_state.json").write_text(json.dumps({"log_history": []})))
    code, err = cli(["report", run], tmp_path, monkeypatch, capfd)
    assert_clear(code, err, f"OUTPUT_DIR {run}: cannot write in {run}")


def test_cut_off_gguf(tiny_chatml, tmp_path, monkeypatch, capfd, isolated, one_thread):
    gguf = _gguf(tiny_chatml, tmp_path, monkeypatch, capfd)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    code, err = cli(["import-gguf", cut, tmp_path / "imported"], tmp_path, monkeypatch, capfd)
    assert_clear(code, err, "cut.gguf: a damaged or cut-off GGUF file", "an incomplete download?")
    assert not (tmp_path / "imported").exists()


def test_adapter_given_as_the_model(tiny_chatml, tmp_path, monkeypatch, capfd, isolated, one_thread):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_chatml),
                                                             "peft_type": "LORA"}))
    code, err = cli(["export", "--to", "gguf", "--model_name_or_path", adapter, tmp_path / "x.gguf"], tmp_path,
                    monkeypatch, capfd)
    assert_clear(code, err, f"a LoRA adapter, not a model; give it as --adapter {adapter} and its base as "
                            f"--model_name_or_path {tiny_chatml}")


@pytest.mark.slow
@pytest.mark.parametrize("num_proc", [1, 2])
def test_ctrl_c_while_tokenizing(num_proc, tiny_chatml, tmp_path):
    """SIGINT to the process group (what Ctrl-C sends) during tokenization: one line, exit 130, no traceback, no
    output folder, within seconds."""
    big = tiny.write_jsonl(tmp_path / "big.jsonl", tiny.synthetic_records(100_000))
    log = tmp_path / "log.txt"
    e = {**env(), "FINETUNE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "finetune", "train", "--model_name_or_path", str(tiny_chatml),
                                 "--dataset", str(big), "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
                                 "--dataset_num_proc", str(num_proc)], stdout=out, stderr=subprocess.STDOUT,
                                env=e, cwd=tmp_path, start_new_session=True, preexec_fn=_in_child)
    try:
        # The bar's first count above 0: the forked tokenizing processes are at work too.
        deadline = time.monotonic() + 120
        while not re.search(r"tokenizing .*\| *[1-9][0-9]*/100000", log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, f"no tokenizing progress:\n{log.read_text()}"
            time.sleep(0.2)
        time.sleep(0.5)
        masks = _signal_masks(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        code = proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 130, f"signal dispositions when SIGINT was sent: {masks}\n{text[-3000:]}"
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert [line for line in text.splitlines() if line.startswith("finetune:")] == [
        "finetune: interrupted; resume with the same command and --resume_from_checkpoint latest (the checkpoints "
        "saved so far are kept)"]
    assert took < 20, f"took {took:.1f} s to end"
    assert not (tmp_path / "out").exists()


def _signal_masks(pid: int) -> dict[int, str]:
    """Per process of the group: SIGINT blocked, ignored or caught (from /proc), for the failure message."""
    import psutil

    out = {}
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            fields = dict(line.split(":\t") for line in Path(f"/proc/{p.pid}/status").read_text().splitlines()
                          if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
        except (OSError, ValueError):
            continue
        out[p.pid] = " ".join(f"{k}={'y' if int(v, 16) & (1 << (signal.SIGINT - 1)) else 'n'}" for k, v in fields.items())
    return out


FINALIZER_CTRL_C = """
import gc, os, signal, sys, time
from finetune import process
if sys.argv[1] == "finetune":
    process.interrupt_outside_finalizers()
class Garbage:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(200_000):  # the handler runs here, in the finalizer
            pass
g = Garbage()
g.cycle = g  # the collector runs the finalizer, as it ran regex's in the tokenizing processes
start = time.monotonic()
try:
    del g
    gc.collect()
    while time.monotonic() - start < 3:
        time.sleep(0.01)
    print("ran on")
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.2f} s")
"""


@pytest.mark.parametrize("handler", ["python", "finetune"])
def test_ctrl_c_in_a_finalizer_is_not_lost(handler):
    """Python's own handler raises KeyboardInterrupt inside the finalizer, which swallows it ("Exception ignored"):
    the program runs on. finetune's sends the signal again 50 ms later, outside it."""
    proc = subprocess.run([sys.executable, "-c", FINALIZER_CTRL_C, handler], capture_output=True, text=True, timeout=60,
                          env=env(), preexec_fn=_in_child)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if handler == "python":
        assert proc.stdout.strip() == "ran on" and "Exception ignored" in proc.stderr, (proc.stdout, proc.stderr)
    else:
        line = proc.stdout.strip()
        assert line.startswith("interrupted after") and float(line.split()[2]) < 1.0, (line, proc.stderr)
        assert "Exception ignored" not in proc.stderr, proc.stderr


def test_a_passed_on_message_is_prefixed_once(capfd, monkeypatch):
    from finetune import process

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        process.exit_with("finetune: data error: d.jsonl:3: bad")
    assert e.value.code == 2
    assert capfd.readouterr().err == "finetune: data error: d.jsonl:3: bad\n"
