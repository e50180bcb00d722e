"""`finetune export` and the save verification: a merged LoRA model equals base + adapter (logits within 1e-5), a
ZeRO-3 checkpoint from a real 2-process run converts to the model the Trainer saved, and a folder that does not
reload to the saved model is an error."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.convert import export as E
from finetune.models import tiny
from finetune.models.verify import VerificationError, fixed_input, logits_of, verify_saved
from launch import launcher, run

# Tiny models: one thread avoids OpenMP spin-waiting when the 2 cores are shared.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    model = tiny.build(root / "model", style="llama3", hidden=64, layers=2)
    other = tiny.build(root / "other", style="llama3", hidden=32, layers=2)
    out = {"root": root, "model": model, "other": other}
    for name, base in (("adapter", model), ("other_adapter", other)):
        out[name] = tiny.save_random_adapter(base, root / name, r=8, seed=2)
    return out


def base_plus_adapter(model_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def test_merge_round_trip(files, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = tmp_path / "merged"
    E.main(["--adapter", str(files["adapter"]), "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert f"verified model {out}:" in err and "merged vs base+adapter logits max diff" in err

    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.startswith("adapter_") for n in names) and not any(n.startswith(".") for n in names)
    assert not list(tmp_path.glob(".merged.staging-*"))

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert merged.config.use_cache is True
    assert not any("lora" in k for k in merged.state_dict())
    reference = base_plus_adapter(files["model"], files["adapter"])
    ids = fixed_input(merged.config.vocab_size, batch=3, length=32, seed=7)
    diff = (logits_of(merged, ids) - logits_of(reference, ids)).abs().max().item()
    assert diff <= 1e-5, diff
    base = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32)
    assert (logits_of(base, ids) - logits_of(merged, ids)).abs().max().item() > 1e-2  # the adapter is in there
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|eot_id|>" and tok.chat_template
    assert GenerationConfig.from_pretrained(out).eos_token_id == tok.eos_token_id


def test_merge_to_bfloat16(files, tmp_path, capsys):
    """Merged (and checked against base + adapter) in fp32, written in bf16, verified against the bf16 model."""
    from safetensors.torch import load_file

    out = tmp_path / "merged_bf16"
    E.main(["--adapter", str(files["adapter"]), "--output_dir", str(out), "--torch_dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert "logits max diff 0 (limit 1e-05)" in err and "written as bfloat16" in err
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_merge_refuses_adapter_for_another_base_and_existing_output(files, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        E.main(["--adapter", str(files["other_adapter"]), "--model_name_or_path", str(files["model"]), "--output_dir", str(tmp_path / "x")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"was trained on base model {files['other']}, which differs from {files['model']}: hidden_size 32 vs 64" in err
    assert not (tmp_path / "x").exists()

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit):
        E.main(["--adapter", str(files["adapter"]), "--output_dir", str(taken)])
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert (taken / "keep.txt").read_text() == "mine"


# ----------------------------------------------------------------------------------------------
# ZeRO-3 checkpoint -> HF folder, from a real 2-process run


@pytest.fixture(scope="module")
def zero3_run(files):
    root = files["root"]
    data = tiny.write_jsonl(root / "data.jsonl", tiny.synthetic_records(32, seed=4))
    out = root / "zero3"
    cmd = launcher("accelerate", 2) + [
        "--config", "zero3_no_offload", "--model_name_or_path", str(files["model"]), "--dataset", str(data),
        "--output_dir", str(out), "--dataset_cache_dir", str(root / "cache"), "--max_steps", "3",
        "--save_strategy", "steps", "--save_steps", "3", "--per_device_train_batch_size", "4",
        "--learning_rate", "1e-2", "--seed", "3", "--disable_tqdm", "true",
    ]
    result = run(cmd, timeout=400).check()
    assert "x 2 processes" in result.output and "partitioned across ranks at load (ZeRO-3)" in result.output
    ckpt = out / "checkpoint-3"
    assert (ckpt / "latest").is_file() and len(list((ckpt / "global_step3").glob("*_optim_states.pt"))) == 2
    # The Trainer also wrote a gathered copy into the checkpoint: remove it, so the conversion can only use the partitions.
    (ckpt / "model.safetensors").unlink()
    return out, ckpt


@pytest.mark.slow
def test_zero3_checkpoint_converts_to_the_trainers_model(files, zero3_run, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, ckpt = zero3_run
    converted = tmp_path / "converted"
    E.main(["--zero_checkpoint", str(ckpt), "--output_dir", str(converted)])
    err = capsys.readouterr().err
    assert f"verified model {converted}:" in err and "max tensor diff 0" in err

    mine, trainers = load_file(converted / "model.safetensors"), load_file(out / "model.safetensors")
    assert mine.keys() == trainers.keys()
    tensor_diff = max((mine[k] - trainers[k]).abs().max().item() for k in mine)
    assert tensor_diff == 0.0, tensor_diff
    initial = load_file(files["model"] / "model.safetensors")
    assert max((mine[k] - initial[k]).abs().max().item() for k in mine) > 1e-3  # training moved the weights

    a = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = fixed_input(a.config.vocab_size)
    assert (logits_of(a, ids) - logits_of(b, ids)).abs().max().item() <= 1e-5
    assert (converted / "tokenizer.json").is_file() and (converted / "generation_config.json").is_file()

    # The global_stepN folder itself, or an explicit --tag, name the same weights.
    for args in (["--zero_checkpoint", str(ckpt / "global_step3")], ["--zero_checkpoint", str(ckpt), "--tag", "global_step3"]):
        again = tmp_path / f"again{len(args)}"
        E.main([*args, "--output_dir", str(again)])
        assert load_file(again / "model.safetensors").keys() == mine.keys()

    # --to gguf: consolidated into a temporary folder first, then written as GGUF; it computes the Trainer's model.
    gguf_file = tmp_path / "gguf" / "zero3.gguf"
    E.main(["--to", "gguf", "--zero_checkpoint", str(ckpt), str(gguf_file)])
    assert sorted(p.name for p in gguf_file.parent.iterdir()) == ["Modelfile", "zero3.gguf"]
    g = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    assert (logits_of(g, ids) - logits_of(b, ids)).abs().max().item() <= 1e-5


def test_zero_checkpoint_bad_input(files, tmp_path, capsys):
    with pytest.raises(SystemExit):
        E.main(["--zero_checkpoint", str(files["model"]), "--output_dir", str(tmp_path / "o")])
    assert "not a DeepSpeed checkpoint folder (no 'latest' file)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        E.main(["--zero_checkpoint", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "o")])
    assert "no such folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# verify_saved: what makes a save fail


@pytest.fixture
def saved(files, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32)
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    return model, folder


def _rewrite(folder, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_verify_accepts_a_faithful_save(saved):
    model, folder = saved
    for reference in (model, model.state_dict()):
        report = verify_saved(folder, reference)
        assert report.max_logit_diff == 0.0 and report.kind == "model" and report.tensors > 0


def test_verify_rejects_empty_tensors(saved):
    """What a ZeRO-3 model writes when its weights were not gathered."""
    model, folder = saved
    _rewrite(folder, lambda t: t.__setitem__("model.norm.weight", torch.empty(0)))
    with pytest.raises(VerificationError, match=r"1 empty tensor\(s\) written: model.norm.weight \[0\]"):
        verify_saved(folder, model)


def test_verify_rejects_nan(saved):
    model, folder = saved

    def poison(t):
        t["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")

    _rewrite(folder, poison)
    with pytest.raises(VerificationError, match="NaN or inf values: model.layers.0.mlp.up_proj.weight"):
        verify_saved(folder, model)


def test_verify_rejects_missing_weights(saved):
    """from_pretrained would silently initialise a missing weight at random."""
    model, folder = saved
    _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"))
    with pytest.raises(VerificationError, match="missing keys: model.layers.1.self_attn.o_proj.weight"):
        verify_saved(folder, model)


def test_verify_rejects_different_weights(saved):
    model, folder = saved
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    reference["model.norm.weight"] += 1e-3
    with pytest.raises(VerificationError, match=r"logits differ by up to .* \(limit 1e-05\).*tensors differ from the reference by up to 0.001"):
        verify_saved(folder, reference)
    with torch.no_grad():
        model.model.norm.weight += 1e-3
    with pytest.raises(VerificationError, match="does not match the saved one"):
        verify_saved(folder, model)


def test_verify_adapter_against_peft_model_and_state_dicts(files):
    from peft import get_peft_model_state_dict

    peft = base_plus_adapter(files["model"], files["adapter"])
    for reference in (peft, peft.state_dict(), get_peft_model_state_dict(peft)):
        report = verify_saved(files["adapter"], reference)
        assert report.kind == "adapter" and report.max_logit_diff == 0.0
    # An adapter-only state dict with one LoRA weight off is caught.
    bad = {k: v.clone() for k, v in get_peft_model_state_dict(peft).items()}
    key = next(k for k in bad if "lora_B" in k)
    bad[key] += 0.05
    with pytest.raises(VerificationError):
        verify_saved(files["adapter"], bad)


def test_verify_quantized_reference(files, tmp_path):
    """A QLoRA adapter is verified on a base reloaded with the same quantization (logits equal)."""
    from finetune.config import ModelConfig
    from finetune.models.load import load_model

    model = load_model(ModelConfig(model_name_or_path=str(files["model"]), use_peft=True, load_in_4bit=True, lora_r=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "qlora")
    cfg = json.loads((tmp_path / "qlora" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(files["model"])
    assert verify_saved(tmp_path / "qlora", model).max_logit_diff == 0.0
