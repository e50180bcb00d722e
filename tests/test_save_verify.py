"""The training save is verified before it is committed: a save that does not reload to the trained model is an
error (exit 2, nothing committed), not a warning."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from finetune import train

pytestmark = pytest.mark.usefixtures("one_thread")


def _argv(model, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"one two three {i}"}) + "\n" for i in range(8)))
    return ["--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(tmp_path / "out"),
            "--dataset_cache_dir", str(tmp_path / "cache"), "--max_steps", "2", "--per_device_train_batch_size", "2"]


def test_good_save_is_verified(tiny_chatml, tmp_path, capsys):
    train.main(_argv(tiny_chatml, tmp_path))
    out = capsys.readouterr().out
    assert f"verified model {tmp_path / 'out' / '.staging-final'}" in out
    assert "logits max diff 0" in out
    assert (tmp_path / "out" / "config.json").is_file()


def test_corrupted_save_is_an_error_and_not_committed(tiny_chatml, tmp_path, monkeypatch, capsys):
    save_model = transformers.Trainer.save_model

    def corrupting_save(self, output_dir=None, _internal_call=False):
        save_model(self, output_dir, _internal_call)
        path = f"{output_dir}/model.safetensors"
        tensors = load_file(path)
        tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3  # a silent bit of damage
        save_file(tensors, path, metadata={"format": "pt"})

    monkeypatch.setattr(transformers.Trainer, "save_model", corrupting_save)
    with pytest.raises(SystemExit) as exit_info:
        train.main(_argv(tiny_chatml, tmp_path))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "the final save failed verification and was not committed" in err and "logits differ by up to" in err
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert not (tmp_path / "out" / "config.json").exists()
