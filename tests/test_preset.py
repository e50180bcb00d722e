"""finetune.config.preset: one value per preset, built once per process from --config and the launcher's environment.

Each shipped preset resolves to its stage, offload targets and file; a custom JSON the same way; the NVMe swap folder
is filled in; a launcher that names another DeepSpeed file than the flag stops the run (exit 2) naming both; and the
JSON is read once per process, whoever asks what it says (counted at every open of the file).
"""

from __future__ import annotations

import builtins
import io
import json
import sys
from pathlib import Path

import pytest

from finetune import config as C
from finetune.config.preset import NVME_PLACEHOLDER, Preset, launcher_problems
from launch import REPO, run, tiny_job

LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch, isolated):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


# name -> (file, stage, offload_optimizer, offload_param, own optimizer, accelerate file)
SHIPPED = {
    "ddp": (None, 0, None, None, False, "ddp.yaml"),
    "zero1": ("zero1.json", 1, None, None, False, None),
    "zero2": ("zero2.json", 2, None, None, False, "zero2.yaml"),
    "zero3": ("zero3_offload.json", 3, "cpu", "cpu", True, "zero3.yaml"),
    "zero3_no_offload": ("zero3_no_offload.json", 3, None, None, False, None),
    "zero3_nvme": ("zero3_nvme.json", 3, "nvme", "nvme", True, None),
    # FSDP2: no DeepSpeed JSON; the accelerate file's fsdp_config is the preset (tests/test_fsdp.py)
    "fsdp2": (None, 0, None, None, False, "fsdp2.yaml"),
    "fsdp2_offload": (None, 0, "cpu", "cpu", False, "fsdp2_offload.yaml"),
}


def test_every_shipped_preset_is_described():
    assert set(SHIPPED) == set(C.PRESETS)


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_preset(name):
    file, stage, opt, param, own_optimizer, accelerate = SHIPPED[name]
    p = Preset.named(name)
    assert (p.name, p.stage, p.offload_optimizer, p.offload_param, p.own_optimizer) == (name, stage, opt, param,
                                                                                         own_optimizer)
    assert p.is_deepspeed == (file is not None) and p.zero3 == (stage == 3) and p.uses_nvme == (opt == "nvme")
    assert p.is_fsdp == name.startswith("fsdp")
    assert p.own_scheduler is False  # no shipped preset brings a scheduler: the Trainer's schedule runs
    assert p.accelerate_config == (C.preset.ACCELERATE_CONFIG_DIR / accelerate if accelerate else None)
    if file is None:
        assert p.path is None and p.ds_config is None
        return
    assert p.path == C.DS_CONFIG_DIR / file
    assert p.ds_config == json.loads(p.path.read_text())  # as read: "auto" values left for TrainingArguments
    assert p.needs_nvme_path == (name == "zero3_nvme")
    assert Preset.resolve(name) == p  # no launcher: the flag alone


def test_accelerate_files_name_their_presets_file():
    """accelerate_configs/NAME.yaml names ds_configs/<NAME's file> (the pairing the disagreement check relies on)."""
    import yaml

    for name, yaml_file in C.preset.ACCELERATE_FILES.items():
        launch = yaml.safe_load((C.preset.ACCELERATE_CONFIG_DIR / yaml_file).read_text())
        named = (launch.get("deepspeed_config") or {}).get("deepspeed_config_file")
        expected = C.PRESETS[name]
        assert (Path(named).name if named else None) == expected, (yaml_file, named)


def test_custom_json(tmp_path):
    ds = tmp_path / "mine.json"
    ds.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "none"}},
    }))
    p = Preset.named(str(ds))
    assert (p.name, p.path, p.stage, p.offload_optimizer, p.offload_param) == (str(ds), ds, 3, None, "cpu")
    assert p.own_optimizer and p.own_scheduler and p.zero3 and not p.uses_nvme and p.accelerate_config is None
    assert p.describe() == str(ds)  # a path given is shown once
    assert Preset.named("zero2").describe() == f"zero2 ({C.DS_CONFIG_DIR / 'zero2.json'})"
    # Its problems, as --config's (unchanged messages).
    with pytest.raises(C.ConfigError) as e:
        Preset.named(str(tmp_path / "missing.json"))
    assert e.value.problems == [f"--config {tmp_path / 'missing.json'}: no such DeepSpeed JSON file"]
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(C.ConfigError, match="expected a DeepSpeed config object with a zero_optimization section"):
        Preset.named(str(tmp_path / "list.json"))
    with pytest.raises(C.ConfigError, match=r"unknown preset 'zero4'; did you mean 'zero3'\?"):
        Preset.named("zero4")


def test_nvme_path_is_filled_in(tmp_path):
    raw = json.loads((C.DS_CONFIG_DIR / "zero3_nvme.json").read_text())
    placeholders = json.dumps(raw).count(f'"{NVME_PLACEHOLDER}"')
    assert placeholders == 2  # offload_optimizer.nvme_path and offload_param.nvme_path
    folder = tmp_path / "swap"
    p = Preset.named("zero3_nvme", str(folder))
    assert p.nvme_path == str(folder.resolve())
    text = json.dumps(p.ds_config)
    assert NVME_PLACEHOLDER not in text and text.count(json.dumps(str(folder.resolve()))) == placeholders
    zero = p.ds_config["zero_optimization"]
    assert zero["offload_optimizer"]["nvme_path"] == zero["offload_param"]["nvme_path"] == str(folder.resolve())
    assert not folder.exists()  # resolving makes nothing; the run makes the folder when it builds its arguments
    # Without --nvme_path the placeholder stays, and the flag check asks for the folder.
    bare = Preset.named("zero3_nvme")
    assert bare.nvme_path is None and NVME_PLACEHOLDER in json.dumps(bare.ds_config)
    assert C.nvme_problems(bare, None)[0] == "--config zero3_nvme: needs --nvme_path FOLDER (a fast local disk for the swap files)"


def test_nvme_folder_reaches_training_arguments(tmp_path):
    folder = tmp_path / "swap"
    cfg = C.parse(["--config", "zero3_nvme", "--nvme_path", str(folder), "--output_dir", str(tmp_path / "o")],
                  check_paths=False)
    assert cfg.preset.nvme_path == str(folder.resolve()) and folder.is_dir()
    assert cfg.training.deepspeed["zero_optimization"]["offload_param"]["nvme_path"] == str(folder.resolve())


# ----------------------------------------------------------------------------------------------
# The launcher's environment: it must agree with the flag; it never replaces it.

ZERO2_ENV = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero2.json"}


def test_launcher_that_agrees(monkeypatch):
    monkeypatch.chdir(REPO)  # accelerate's file names its DeepSpeed file relative to the repository root
    assert Preset.resolve("zero2", environ=ZERO2_ENV) == Preset.named("zero2")
    assert Preset.resolve(str(C.DS_CONFIG_DIR / "zero2.json"), environ=ZERO2_ENV).stage == 2  # the file itself
    # No DeepSpeed in the accelerate config (ddp.yaml, or the flags form): the flag alone decides.
    assert Preset.resolve("zero3", environ={"ACCELERATE_USE_DEEPSPEED": "false"}) == Preset.named("zero3")
    assert launcher_problems("zero3", True, {}) == []


def test_launcher_that_disagrees(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(C.ConfigError) as e:
        Preset.resolve("zero3", environ=ZERO2_ENV)
    assert e.value.problems == [
        "--config zero3 disagrees with the accelerate config, which uses DeepSpeed file ds_configs/zero2.json: pass "
        "--config zero2 to train with that file, or launch with accelerate_configs/zero3.yaml for --config zero3"]
    # --config left at its default is no exception: the launcher's file is not taken in its place.
    (problem,) = launcher_problems("ddp", False, ZERO2_ENV)
    assert problem.startswith("--config ddp (the default) disagrees with the accelerate config, which uses DeepSpeed "
                              "file ds_configs/zero2.json: pass --config zero2 to train with that file, or launch "
                              "with accelerate_configs/ddp.yaml for --config ddp")
    (problem,) = launcher_problems("zero3", True, {"ACCELERATE_USE_DEEPSPEED": "true"})
    assert problem.startswith("accelerate launch was configured for DeepSpeed without a deepspeed_config_file")
    # Reported with the preset's own problems, the launcher's first.
    with pytest.raises(C.ConfigError) as e:
        Preset.resolve("zero4", environ=ZERO2_ENV)
    assert [p.split(" ")[:2] for p in e.value.problems] == [["--config", "zero4"], ["--config:", "unknown"]]


def test_disagreement_exits_2_at_the_flags(monkeypatch, capsys, tmp_path):
    """Through the entry point's loader: exit 2 with the one message, the flag left as given."""
    monkeypatch.chdir(REPO)
    for key, value in ZERO2_ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as e:
        C.load_or_exit(["--output_dir", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "configuration problem(s):\n  - --config ddp (the default) disagrees" in err  # the first one named
    assert "--config ddp (the default) disagrees with the accelerate config" in err and "--config zero2" in err
    cfg = C.parse(["--config", "zero2", "--output_dir", str(tmp_path / "o")], check_paths=False)
    assert cfg.launch.config == "zero2" and cfg.preset == Preset.named("zero2")


# ----------------------------------------------------------------------------------------------
# Read once per process.


@pytest.fixture
def opens(monkeypatch):
    """opens(path) -> how many times the file was opened since the fixture started (builtins.open and io.open,
    which Path.read_text, json.load(open(...)) and transformers' and DeepSpeed's readers all go through)."""
    seen: list[str] = []

    def counting(real):
        def open_(file, *args, **kwargs):
            if isinstance(file, (str, Path)):
                seen.append(str(Path(file).resolve()))
            return real(file, *args, **kwargs)
        return open_

    monkeypatch.setattr(builtins, "open", counting(builtins.open))
    monkeypatch.setattr(io, "open", counting(io.open))
    return lambda path: seen.count(str(Path(path).resolve()))


def test_the_json_is_read_once(tmp_path, opens, monkeypatch):
    """A custom JSON (the path with the most checks: structure, DeepSpeed's own value checks) and a preset, through
    the flag checks, TrainingArguments, the hand-written paths' flag check, the planner (its job, and a
    recommendation that tries every preset) and the resume check's facts: one read of the run's file."""
    from finetune.plan import planner
    from finetune.training import core

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 256, "tie_word_embeddings": False}))
    ds = tmp_path / "mine.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    zero3 = C.DS_CONFIG_DIR / "zero3_offload.json"
    for config, path in ((str(ds), ds), ("zero3", zero3)):
        before = opens(path)
        cfg = C.parse(["--config", config, "--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"),
                       "--optim", "sgd"], check_paths=False)
        assert cfg.training.hf_deepspeed_config.config["zero_optimization"]["stage"] == 3
        assert "names its own optimizer" in core.refused_flags(cfg, "finetune/loop.py")[0]
        job = planner.workload_from_config(cfg, world_size=2, devices_per_node=2, accelerator="cpu")
        assert job.strategy.stage == 3 and job.strategy.offload_optimizer and job.strategy.ds_optimizer
        rejected = planner.recommend(job, planner.Limits(1, 1)).rejected  # fits nowhere: every preset tried
        assert set(rejected) == set(C.PRESETS)
        assert (cfg.preset.stage, cfg.preset.uses_nvme) == (3, False)  # what resume_or_exit hands the checks
        assert opens(path) - before == 1, f"{path} read {opens(path) - before} times"


@pytest.mark.slow
@pytest.mark.parametrize("path", ["trainer", "loop", "engine"])
def test_a_run_reads_its_json_once(path, tmp_path):
    """A real one-step run on each path, ZeRO-2 without a launcher (a world of one): every open of the JSON in the
    process is reported by an audit hook as it happens (the process ends by os._exit, after any atexit)."""
    root, model, data = tiny_job(tmp_path, records=8)
    file = C.DS_CONFIG_DIR / "zero2.json"
    code = (
        "import sys\n"
        f"target = {str(file.resolve())!r}\n"
        "def hook(event, args):\n"
        "    if event == 'open' and isinstance(args[0], str) and __import__('os').path.realpath(args[0]) == target:\n"
        "        print('PRESET-JSON-OPENED', flush=True)\n"
        "sys.addaudithook(hook)\n"
        f"from finetune.training import {path} as entry\n"
        "entry.main(sys.argv[1:])\n"
    )
    result = run([sys.executable, "-c", code, "--config", "zero2", "--model_name_or_path", str(model),
                  "--dataset", str(data), "--output_dir", str(root / "out"), "--dataset_cache_dir", str(root / "cache"),
                  "--max_steps", "1", "--per_device_train_batch_size", "2", "--disable_tqdm", "true"],
                 timeout=600).check()
    assert f"parallelism: zero2 ({file})" in result.output, result.output[-3000:]
    assert result.output.count("PRESET-JSON-OPENED") == 1, result.output[-3000:]
