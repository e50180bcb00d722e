"""finetune.config: precedence default < recipe < command line, error reporting, presets, round trip.

In-process and fast: parse() builds a transformers.TrainingArguments but never loads a model.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from finetune import config as C

LAUNCH_ENV = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE",
)


@pytest.fixture(autouse=True)
def single_process(monkeypatch, isolated):
    """parse() builds TrainingArguments: keep it single-process, whatever launched pytest, and leave no state behind
    (with a DeepSpeed preset it may describe a world of one in os.environ and start a gloo process group: `isolated`
    undoes both)."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    yield


def parse(argv, **kw):
    kw.setdefault("check_paths", False)
    return C.parse([str(a) for a in argv], **kw)


def problems_of(argv, **kw) -> list[str]:
    with pytest.raises(C.ConfigError) as info:
        parse(argv, **kw)
    return info.value.problems


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "out"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A folder that passes the model-folder checks (they read headers only: an empty safetensors file, a stub
    tokenizer.json)."""
    import struct

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    (d / "tokenizer.json").write_text("{}")
    return d


# ----------------------------------------------------------------------------------------------
# Precedence: dataclass default < TRAINING_DEFAULTS < recipe < command line.


def test_defaults(out):
    cfg = parse(["--output_dir", out])
    assert cfg.training.learning_rate == 5e-5  # TrainingArguments' own default
    assert cfg.training.max_steps == -1
    assert cfg.training.logging_steps == 1  # finetune's TRAINING_DEFAULTS
    assert cfg.training.lr_scheduler_type.value == "linear"
    assert cfg.training.report_to == []  # report_to: none
    assert cfg.training.remove_unused_columns is False
    assert cfg.model.lora_r == 16 and cfg.model.use_peft is False
    assert cfg.model.lora_target_modules == ["all-linear"]
    assert cfg.data.max_seq_length == 1024 and cfg.data.completion_only_loss is True
    assert cfg.launch.config == "ddp" and cfg.preset == C.Preset("ddp", accelerate_config=cfg.preset.accelerate_config)
    assert not cfg.preset.is_deepspeed and cfg.training.deepspeed is None
    assert cfg.sources == {"output_dir": "cli"}


def test_recipe_over_defaults(tmp_path, out):
    recipe = write(tmp_path / "recipe.yaml", f"""
        output_dir: {out}
        learning_rate: 2.0e-4
        max_steps: 10
        lr_scheduler_type: cosine
        logging_steps: 5
        lora_r: 8
        use_peft: true
        lora_target_modules: [q_proj, k_proj]
        max_seq_length: 256
        completion_only_loss: false
        dataset_format: alpaca
    """)
    cfg = parse(["--recipe", recipe])
    assert cfg.training.learning_rate == 2e-4
    assert cfg.training.max_steps == 10
    assert cfg.training.lr_scheduler_type.value == "cosine"  # over a TRAINING_DEFAULTS value
    assert cfg.training.logging_steps == 5
    assert cfg.model.lora_r == 8 and cfg.model.use_peft is True
    assert cfg.model.lora_target_modules == ["q_proj", "k_proj"]
    assert cfg.data.max_seq_length == 256 and cfg.data.completion_only_loss is False
    assert cfg.data.dataset_format == "alpaca"
    assert cfg.sources["learning_rate"] == "recipe" and cfg.sources["lora_r"] == "recipe"
    assert "recipe" not in cfg.resolved()


def test_cli_over_recipe(tmp_path, out):
    recipe = write(tmp_path / "recipe.yaml", f"""
        output_dir: {out}
        learning_rate: 2.0e-4
        max_steps: 10
        lr_scheduler_type: cosine
        lora_r: 8
        use_peft: true
        lora_target_modules: q_proj,k_proj
        max_seq_length: 256
        completion_only_loss: true
        logging_first_step: false
        dataset_format: alpaca
    """)
    cfg = parse([
        "--recipe", recipe,
        "--learning_rate", "3e-4",          # --key value
        "--max_steps=20",                   # --key=value
        "--lora_r=4",
        "--max-seq-length", "128",          # dashes mean underscores
        "--lr_scheduler_type", "constant",
        "--no_use_peft",                    # --no_flag over a recipe true
        "--no_completion_only_loss",
        "--logging_first_step",            # bare bool flag over a recipe false
        "--lora_target_modules", "q_proj", "v_proj", "o_proj",  # list flag
    ])
    t = cfg.training
    assert (t.learning_rate, t.max_steps, t.lr_scheduler_type.value, t.logging_first_step) == (3e-4, 20, "constant", True)
    assert (cfg.model.lora_r, cfg.model.use_peft) == (4, False)
    assert cfg.model.lora_target_modules == ["q_proj", "v_proj", "o_proj"]
    assert (cfg.data.max_seq_length, cfg.data.completion_only_loss) == (128, False)
    assert cfg.data.dataset_format == "alpaca"  # from the recipe, untouched by the command line
    assert cfg.sources["learning_rate"] == "cli" and cfg.sources["dataset_format"] == "recipe"
    assert cfg.sources["use_peft"] == "cli" and cfg.sources["lora_target_modules"] == "cli"


def test_bool_and_list_forms(out):
    cfg = parse(["--output_dir", out, "--use_peft=true", "--bf16", "false", "--drop_long_sequences=yes",
                 "--lora_target_modules=q_proj", "--report_to", "none"])
    assert cfg.model.use_peft is True
    assert cfg.training.bf16 is False
    assert cfg.data.drop_long_sequences is True
    assert cfg.model.lora_target_modules == ["q_proj"]
    assert cfg.training.report_to == []
    cfg = parse(["--output_dir", out, "--use_peft", "--lora_r", "8"])  # a bare flag does not swallow the next flag
    assert cfg.model.use_peft is True and cfg.model.lora_r == 8


def test_negative_numbers_are_values(out):
    cfg = parse(["--output_dir", out, "--max_steps", "-1", "--seed", "-3", "--learning_rate", "1e-4"])
    assert (cfg.training.max_steps, cfg.training.seed, cfg.training.learning_rate) == (-1, -3, 1e-4)


# ----------------------------------------------------------------------------------------------
# Unknown keys and bad values.


def test_unknown_cli_key():
    problems = problems_of(["--learning_rat", "1e-3"])
    assert len(problems) == 1
    assert "--learning_rat" in problems[0]
    assert "unknown key 'learning_rat'" in problems[0]
    assert "did you mean 'learning_rate'" in problems[0]


def test_unknown_recipe_key_names_file_and_line(tmp_path):
    recipe = write(tmp_path / "recipe.yaml", """
        learning_rate: 2.0e-4
        max_steps: 10

        # a comment
        lora_rank: 8
        per_device_train_batch_sise: 2
    """)
    problems = problems_of(["--recipe", recipe])
    assert len(problems) == 2, problems
    assert f"{recipe}:5: unknown key 'lora_rank'" in problems[0]
    assert f"{recipe}:6: unknown key 'per_device_train_batch_sise'" in problems[1]
    assert "did you mean 'per_device_train_batch_size'" in problems[1]
    # The message as the user sees it names recipe.yaml:LINE.
    with pytest.raises(C.ConfigError) as info:
        parse(["--recipe", recipe])
    assert "recipe.yaml:5" in str(info.value) and "recipe.yaml:6" in str(info.value)


def test_recipe_bad_value_names_line(tmp_path):
    recipe = write(tmp_path / "recipe.yaml", """
        max_steps: ten
        use_peft: maybe
    """)
    problems = problems_of(["--recipe", recipe])
    assert problems == [
        f"{recipe}:1: max_steps: expected an integer, got 'ten'",
        f"{recipe}:2: use_peft: expected true or false, got 'maybe'",
    ]


def test_recipe_keys_yaml_reads_as_non_strings(tmp_path):
    # `1:` and `on:` are an int and a bool to YAML; they are unknown keys, never a crash.
    recipe = write(tmp_path / "recipe.yaml", """
        max_steps: 3
        1: 2
        on: true
    """)
    problems = problems_of(["--recipe", recipe])
    assert problems == [f"{recipe}:2: unknown key '1'", f"{recipe}:3: unknown key 'on'"]


def test_recipe_file_problems(tmp_path):
    assert problems_of(["--recipe", tmp_path / "nope.yaml"]) == [f"--recipe {tmp_path / 'nope.yaml'}: no such file"]
    bad = write(tmp_path / "bad.yaml", "max_steps: [3\n")
    assert "not valid YAML" in problems_of(["--recipe", bad])[0]
    seq = write(tmp_path / "seq.yaml", "- max_steps\n- 3\n")
    assert "a recipe is a mapping of key: value" in problems_of(["--recipe", seq])[0]
    empty = write(tmp_path / "empty.yaml", "# nothing\n")
    assert parse(["--recipe", empty]).training.max_steps == -1


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--max_steps", "abc"], "--max_steps: expected an integer, got 'abc'"),
        (["--max_steps", "1.5"], "--max_steps: expected an integer, got '1.5'"),
        (["--learning_rate", "x"], "--learning_rate: expected a number, got 'x'"),
        (["--use_peft", "maybe"], "--use_peft: expected true or false, got 'maybe'"),
        (["--max_seq_length"], "--max_seq_length: needs a value"),
        (["--lora_r", "4", "8"], "--lora_r takes one value, got 2: 4 8"),
        (["model_dir"], "unexpected argument 'model_dir': options look like --key value"),
        (["--fsdp", "full_shard"], "--fsdp: 'fsdp' is set by finetune; use --config fsdp2 (or fsdp2_offload): FSDP2 is a preset"),
        (["--max_seq_length", "1"], "max_seq_length: must be at least 2, got 1"),
        (["--lora_r", "0"], "lora_r: must be positive, got 0"),
        (["--lora_dropout", "1"], "lora_dropout: must be in [0, 1), got 1.0"),
        (["--per_device_train_batch_size", "0"], "per_device_train_batch_size: must be at least 1, got 0"),
        (["--learning_rate", "-1e-4"], "learning_rate: must not be negative, got -0.0001"),
        (["--torch_dtype", "fp16"], "torch_dtype: 'fp16' is not one of auto, float32, bfloat16, float16"),
    ],
)
def test_bad_values(argv, expected):
    assert problems_of(argv) == [expected]


def test_enum_typo_is_reported_with_the_other_problems():
    # TrainingArguments would reject these too, but only after every other problem was fixed.
    problems = problems_of(["--lr_scheduler_type", "cosin", "--optim", "adamw_torchh", "--max_steps", "x"])
    assert len(problems) == 3, problems
    assert any(p.startswith("--lr_scheduler_type: 'cosin' is not one of: linear, cosine") for p in problems)
    assert any(p.startswith("--optim: 'adamw_torchh' is not one of:") for p in problems)


def test_all_problems_in_one_error(tmp_path):
    argv = [
        "--learning_rat", "1e-3",                                  # unknown key
        "--max_steps", "abc",                                      # bad int
        "--dataset_format", "alpacca",                             # bad choice
        "--model_name_or_path", tmp_path / "no-such-model",        # missing folder
        "--config", "zero4",                                       # unknown preset
        "--dataset", tmp_path / "no-such-data.jsonl",              # missing data
    ]
    with pytest.raises(C.ConfigError) as info:
        parse(argv, check_paths=True)
    problems = info.value.problems
    assert len(problems) == 6, problems
    expect = [
        "--learning_rat: unknown key 'learning_rat'; did you mean 'learning_rate'?",
        "--max_steps: expected an integer, got 'abc'",
        "dataset_format: 'alpacca' is not one of auto, text, alpaca, messages, sharegpt, vision; did you mean 'alpaca'?",
        f"model_name_or_path: {tmp_path / 'no-such-model'}: no such folder",
        "--config: unknown preset 'zero4'; did you mean 'zero3'?",
        f"dataset: {tmp_path / 'no-such-data.jsonl'}: no such file or folder",
    ]
    for e in expect:
        assert sum(e in p for p in problems) == 1, (e, problems)
    text = str(info.value)
    assert text.startswith("finetune: 6 configuration problem(s):")
    assert all(f"  - {p}" in text for p in problems)


# ----------------------------------------------------------------------------------------------
# Parallelism presets and DeepSpeed JSON files.


@pytest.mark.parametrize("preset", [p for p in C.PRESETS if C.PRESETS[p]])
def test_presets_resolve_to_existing_files(preset, out):
    path = C.preset.preset_file(preset)
    assert path == C.DS_CONFIG_DIR / C.PRESETS[preset] and path.is_file()
    extra = ["--nvme_path", str(Path(out) / "nvme")] if preset == "zero3_nvme" else []
    cfg = parse(["--config", preset, "--output_dir", out, *extra])
    assert cfg.preset.path == path
    # TrainingArguments gets the preset's dict (the file is read once, by the preset), not the path.
    assert cfg.training.deepspeed == cfg.preset.ds_config and cfg.training.deepspeed is not cfg.preset.ds_config
    if preset == "zero3_nvme":  # the swap folder is filled in
        assert cfg.training.deepspeed["zero_optimization"]["offload_param"]["nvme_path"] == str((Path(out) / "nvme").resolve())
    else:
        assert cfg.training.deepspeed == json.loads(path.read_text())


def test_preset_names():
    assert C.PRESETS["ddp"] is None and C.preset.preset_file("ddp") is None
    assert C.PRESETS["zero3"] == "zero3_offload.json"
    assert C.PRESETS["zero3_no_offload"] == "zero3_no_offload.json"
    assert {p.name for p in C.DS_CONFIG_DIR.glob("*.json")} == {f for f in C.PRESETS.values() if f}


def test_json_path_config(tmp_path, out):
    ds = tmp_path / "my_ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}))
    cfg = parse(["--config", ds, "--output_dir", out])
    assert cfg.preset.path == ds and cfg.training.deepspeed == json.loads(ds.read_text())
    assert problems_of(["--config", tmp_path / "missing.json"]) == [f"--config {tmp_path / 'missing.json'}: no such DeepSpeed JSON file"]
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "zero_optimization": {\n    "stage": 2,\n  }\n}\n')
    (problem,) = problems_of(["--config", broken])
    assert problem.startswith(f"--config {broken}:4: not valid JSON")


ZERO3_FILE = str(C.DS_CONFIG_DIR / "zero3_offload.json")


@pytest.mark.parametrize("argv, config, training", [
    (["--deepspeed", "ds_configs/zero2.json", "--seed", "1"], "ds_configs/zero2.json", {"seed": 1}),
    (["--deepspeed=ds_configs/zero2.json"], "ds_configs/zero2.json", {}),
    (["--deepspeed_config", "x.json"], "x.json", {}),
    (["--deepspeed", "--deepspeed_config", "x.json"], "x.json", {}),  # DeepSpeed tutorials' flag pair
    (["--config", "zero3", "--local_rank=1"], "zero3", {"local_rank": 1}),
    (["--config", "zero3", "--deepspeed", ZERO3_FILE], ZERO3_FILE, {}),  # the preset and its own file agree
    (["--local_rank=0", "--lr_scheduler_type", "cosine"], "ddp", {"local_rank": 0, "lr_scheduler_type": "cosine"}),
])
def test_deepspeed_flag_is_config(argv, config, training):
    model, data, launch, values, sources, problems, _ = C.parse_sections(argv)
    assert problems == []
    assert launch.config == config
    assert {k: values[k] for k in training} == training
    assert "deepspeed" not in values  # never TrainingArguments' own field: the preset is resolved by finetune


def test_deepspeed_flag_is_config_end_to_end(tmp_path, out):
    cfg = parse(["--deepspeed", "zero2", "--output_dir", out])
    assert cfg.launch.config == "zero2" and cfg.preset == C.Preset.named("zero2")
    assert cfg.training.deepspeed == C.Preset.named("zero2").ds_config
    recipe = write(tmp_path / "recipe.yaml", "deepspeed: zero2\n")
    assert parse(["--recipe", recipe, "--output_dir", out]).launch.config == "zero2"


def test_conflicting_deepspeed_and_config_are_refused():
    problems = problems_of(["--config", "zero2", "--deepspeed", ZERO3_FILE, "--max_steps", "x"])
    assert problems[0] == (f"--config zero2 and --deepspeed {ZERO3_FILE}: these name different DeepSpeed "
                           "configurations; give one")
    assert any("max_steps: expected an integer" in p for p in problems)  # with the other problems, in one run
    (problem,) = problems_of(["--deepspeed_config", "zero2", "--deepspeed", "zero3"])
    assert "--deepspeed_config zero2 and --deepspeed zero3: these name different DeepSpeed configurations" in problem


def test_unknown_preset():
    (problem,) = problems_of(["--config", "zero4"])
    assert problem.startswith("--config: unknown preset 'zero4'; did you mean 'zero3'?")
    assert "presets: ddp, zero1, zero2, zero3, zero3_no_offload" in problem


DS_FILES = sorted(C.DS_CONFIG_DIR.glob("*.json"))


@pytest.mark.parametrize("path", DS_FILES, ids=[p.stem for p in DS_FILES])
def test_ds_configs_leave_training_values_to_training_arguments(path):
    ds = json.loads(path.read_text())
    # Values TrainingArguments owns must be "auto", or DeepSpeed and the Trainer can disagree silently.
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert ds.get(key) == "auto", (path.name, key)
    for section in ("bf16", "fp16"):
        if section in ds:
            assert ds[section].get("enabled") == "auto", (path.name, section)
    if "optimizer" in ds:
        params = ds["optimizer"].get("params", {})
        assert params, path.name
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in params:
                assert params[key] == "auto", (path.name, key)
    if "scheduler" in ds:
        for key, value in ds["scheduler"].get("params", {}).items():
            assert value == "auto", (path.name, key)
    zero = ds["zero_optimization"]
    if zero.get("stage") == 3:
        assert zero.get("stage3_gather_16bit_weights_on_model_save") is True, path.name


def test_zero3_preset_offloads_to_cpu():
    zero = json.loads(C.preset.preset_file("zero3").read_text())["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["device"] == "cpu"
    no_offload = json.loads(C.preset.preset_file("zero3_no_offload").read_text())["zero_optimization"]
    assert no_offload["stage"] == 3
    assert "offload_optimizer" not in no_offload and "offload_param" not in no_offload


# ----------------------------------------------------------------------------------------------
# Model folder checks and quantization rules.


def _model_problems(argv, tmp_path) -> list[str]:
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hi"}\n')
    with pytest.raises(C.ConfigError) as info:
        parse([*argv, "--dataset", data], check_paths=True)
    return info.value.problems


def test_model_folder_missing(tmp_path):
    assert _model_problems(["--model_name_or_path", tmp_path / "nope"], tmp_path) == [
        f"model_name_or_path: {tmp_path / 'nope'}: no such folder (not a local folder, nor a Hub repo id org/name)"
    ]
    assert _model_problems([], tmp_path) == ["model_name_or_path: required (a local model folder)"]


def test_model_folder_without_config_json(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    (problem,) = _model_problems(["--model_name_or_path", d], tmp_path)
    assert problem == f"model_name_or_path: {d}: no config.json in this folder; is it a Hugging Face model folder?"


def test_model_folder_without_weights(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (problem,) = _model_problems(["--model_name_or_path", d], tmp_path)
    assert problem == f"model_name_or_path: {d}: no weights (*.safetensors) in this folder"


def test_pickle_only_model_folder_needs_allow_pickle(tmp_path, out):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "tokenizer.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"")
    (problem,) = _model_problems(["--model_name_or_path", d], tmp_path)
    assert "holds only pickle weights (*.bin)" in problem and "--allow_pickle" in problem
    cfg = parse(["--model_name_or_path", d, "--dataset", tmp_path / "data.jsonl", "--allow_pickle", "--output_dir", out],
                check_paths=True)
    assert cfg.model.allow_pickle is True


def test_good_model_folder(model_dir, tmp_path, out):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hi"}\n')
    cfg = parse(["--model_name_or_path", model_dir, "--dataset", data, "--output_dir", out], check_paths=True)
    assert cfg.model.model_name_or_path == str(model_dir) and cfg.data.dataset == str(data)


def test_real_tiny_model_folder_passes(tiny_chatml, tmp_path, out):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hi"}\n')
    cfg = parse(["--model_name_or_path", tiny_chatml, "--dataset", data, "--output_dir", out], check_paths=True)
    assert cfg.model.model_name_or_path == str(tiny_chatml)


@pytest.mark.parametrize("flag", ["--load_in_4bit", "--load_in_8bit"])
def test_quantized_needs_peft(flag):
    assert problems_of([flag]) == [
        "load_in_8bit/load_in_4bit: quantized weights cannot be trained directly; add --use_peft (LoRA/QLoRA)"
    ]


def test_quantized_with_peft_is_accepted(out):
    cfg = parse(["--load_in_4bit", "--use_peft", "--config", "zero2", "--output_dir", out])
    assert cfg.model.load_in_4bit and cfg.model.use_peft


def test_both_quantizations_refused():
    assert "load_in_8bit and load_in_4bit: choose one" in problems_of(["--load_in_8bit", "--load_in_4bit", "--use_peft"])


@pytest.mark.parametrize("preset", ["zero3", "zero3_no_offload"])
def test_quantized_with_zero3_refused(preset):
    (problem,) = problems_of(["--load_in_4bit", "--use_peft", "--config", preset])
    assert problem.startswith(f"--config {preset}: a bitsandbytes-quantized base cannot be partitioned by ZeRO-3")
    assert "use --config ddp or zero2" in problem


def test_quantized_with_zero3_json_refused(tmp_path):
    ds = tmp_path / "custom.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    (problem,) = problems_of(["--load_in_8bit", "--use_peft", "--config", ds])
    assert "cannot be partitioned by ZeRO-3" in problem and "ddp or zero2" in problem


# ----------------------------------------------------------------------------------------------
# The resolved config: saved as a recipe, it reproduces the run.


def test_save_resolved_round_trip(tmp_path, out, model_dir):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hi"}\n')
    recipe = write(tmp_path / "recipe.yaml", """
        learning_rate: 2.0e-4
        lora_alpha: 64
        warmup_steps: 0.1
    """)
    argv = [
        "--recipe", recipe, "--model_name_or_path", model_dir, "--dataset", data, "--output_dir", out,
        "--config", "zero2", "--use_peft", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj",
        "--max_steps=7", "--max_seq_length", "64", "--no_completion_only_loss", "--per_device_train_batch_size", "3",
        "--gradient_accumulation_steps", "2", "--lr_scheduler_type", "cosine", "--seed", "7", "--weight_decay", "0.1",
        "--logging_first_step", "--report_to", "none", "--hub_token", "hf_SECRET_do_not_save",
    ]
    cfg = parse(argv, check_paths=True)
    saved = C.save_resolved(cfg, cfg.training.output_dir)
    assert saved == out / "finetune_config.yaml" and saved.is_file()
    assert not list(out.glob("*.tmp*"))

    text = saved.read_text()
    assert "hf_SECRET_do_not_save" not in text and "hub_token" not in text and "HUB_TOKEN" not in text
    assert "deepspeed" not in text and "local_rank" not in text and "recipe" not in text
    loaded = yaml.safe_load(text)
    assert loaded["config"] == "zero2"
    assert loaded["learning_rate"] == 2e-4 and loaded["lora_alpha"] == 64 and loaded["lora_r"] == 8
    assert loaded["max_steps"] == 7 and loaded["lora_target_modules"] == ["q_proj", "v_proj"]
    assert loaded["completion_only_loss"] is False and loaded["model_name_or_path"] == str(model_dir)

    again = parse(["--recipe", saved], check_paths=True)
    assert again.resolved() == cfg.resolved()
    assert again.preset == cfg.preset
    assert again.training.learning_rate == 2e-4 and again.training.max_steps == 7
    assert again.training.lr_scheduler_type == cfg.training.lr_scheduler_type
    assert again.model == cfg.model and again.data == cfg.data
    assert again.training.hub_token is None

    # Saving the reloaded config gives the same file: the round trip is a fixed point.
    assert C.save_resolved(again, tmp_path / "out2").read_text() == text


def test_save_resolved_round_trip_defaults(out):
    cfg = parse(["--output_dir", out])
    saved = C.save_resolved(cfg, out)
    assert parse(["--recipe", saved]).resolved() == cfg.resolved()


def test_resolved_records_every_finetune_key(out):
    resolved = parse(["--output_dir", out]).resolved()
    for cls in (C.ModelConfig, C.DataConfig):
        for f in C.dataclasses.fields(cls):
            assert f.name in resolved
    for key in C.TRAINING_DEFAULTS:
        assert key in resolved, key
    assert resolved["config"] == "ddp" and "recipe" not in resolved


def test_only_rank_0_reports_at_once(monkeypatch, capsys):
    """A launched rank other than 0 gives rank 0 time to print (its launcher would SIGTERM rank 0 on the first exit),
    then reports the problems itself: a problem only that rank sees is still printed."""
    import time

    from finetune import process
    from finetune.config import parser

    error = C.ConfigError(["--config zero2 disagrees"])
    monkeypatch.setattr(process, "PEER_REPORT_GRACE_S", 0.3)
    for rank, world, printed, waited in (("0", "2", "finetune: 1 configuration problem(s):", False),
                                         ("1", "2", "rank 1: finetune: 1 configuration problem(s):", True),
                                         ("0", "1", "finetune: 1 configuration problem(s):", False)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world)
        start = time.monotonic()
        with pytest.raises(SystemExit) as e:
            parser.exit_with_problems(error)
        assert e.value.code == 2
        assert (time.monotonic() - start >= 0.3) == waited
        assert capsys.readouterr().err.splitlines()[0] == printed


def test_gpu_defaults_leave_what_the_user_gave():
    """On a CUDA device: logging every 20 steps, pinned persistent loader workers copying without blocking, bf16
    where the GPU has it; none
    of them where the recipe or the command line set the key, and nothing on a CPU."""
    from finetune.config.training import GPU_DEFAULTS, device_defaults

    assert device_defaults({}, {}, cuda=False) == {}
    assert device_defaults({}, {}, cuda=True, bf16=True) == {**GPU_DEFAULTS, "bf16": True}
    assert "bf16" not in device_defaults({}, {}, cuda=True, bf16=False)  # a V100: no bf16
    assert device_defaults({"use_cpu": True}, {"use_cpu": "cli"}, cuda=True, bf16=True) == {}
    got = device_defaults({"fp16": True, "logging_steps": 1}, {"fp16": "cli", "logging_steps": "recipe"}, cuda=True,
                          bf16=True)
    assert "bf16" not in got and "logging_steps" not in got and got["dataloader_num_workers"] == 2
    got = device_defaults({"dataloader_num_workers": 0}, {"dataloader_num_workers": "cli"}, cuda=True, bf16=True)
    assert "dataloader_num_workers" not in got and "dataloader_persistent_workers" not in got


def test_the_start_lines_say_the_precision(tmp_path):
    from types import SimpleNamespace

    import torch

    from finetune.training.lifecycle import _precision

    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    gpu_default = SimpleNamespace(training=SimpleNamespace(bf16=True, fp16=False), sources={})
    assert _precision(gpu_default, model) == ("precision: weights bfloat16, bf16 mixed precision (autocast) (the "
                                              "default on this GPU; --bf16 false turns it off)")
    asked = SimpleNamespace(training=SimpleNamespace(bf16=True, fp16=False), sources={"bf16": "cli"})
    assert _precision(asked, model) == "precision: weights bfloat16, bf16 mixed precision (autocast)"
    cpu = SimpleNamespace(training=SimpleNamespace(bf16=False, fp16=False), sources={})
    assert _precision(cpu, torch.nn.Linear(2, 2)) == "precision: weights float32, no mixed precision"
