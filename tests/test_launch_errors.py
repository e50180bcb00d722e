"""User mistakes under a real 2-process launch: one clear message, non-zero exit, no rank left hanging."""

from __future__ import annotations

import time

import pytest

from finetune.models import tiny
from launch import launcher, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.build(tmp_path_factory.mktemp("model"), style="chatml")


def test_bad_record_stops_every_rank(model, tmp_path):
    data = tmp_path / "train.jsonl"
    good = tiny.synthetic_records(6, seed=1)
    lines = [__import__("json").dumps(r) for r in good]
    lines.insert(3, '{"messages": [{"role": "user", "content": "hi"}')  # line 4: cut-off JSON
    data.write_text("\n".join(lines) + "\n")
    start = time.time()
    result = run(launcher("accelerate", 2) + [
        "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(tmp_path / "out"),
        "--dataset_cache_dir", str(tmp_path / "cache"), "--max_steps", "2",
    ], timeout=180)
    assert result.returncode != 0
    assert f"data error: {data}:4: invalid JSON" in result.output
    assert time.time() - start < 120  # the waiting rank saw rank 0's error instead of waiting forever
    assert not (tmp_path / "out" / "config.json").exists()


def test_accelerate_config_and_preset_must_agree(model, tmp_path):
    """The launcher's DeepSpeed file and --config name one preset, or the ranks stop at their flags (exit 2) with one
    message naming both and the fix; the launcher never silently replaces the flag, nor the flag the launcher."""
    data = tiny.write_jsonl(tmp_path / "d.jsonl", tiny.synthetic_records(16, seed=2))
    common = ["--model_name_or_path", str(model), "--dataset", str(data), "--dataset_cache_dir", str(tmp_path / "c"),
              "--max_steps", "1", "--per_device_train_batch_size", "2", "--disable_tqdm", "true"]
    bad = run(launcher("accelerate", 2, "accelerate_configs/zero3.yaml") + common
              + ["--config", "zero2", "--output_dir", str(tmp_path / "bad")], timeout=180)
    assert bad.returncode != 0 and "exitcode: 2" in bad.output, bad.output[-3000:]  # the ranks' exit 2
    assert ("--config zero2 disagrees with the accelerate config, which uses DeepSpeed file "
            "ds_configs/zero3_offload.json: pass --config zero3 to train with that file, or launch with "
            "accelerate_configs/zero2.yaml for --config zero2") in bad.output

    # --config left at its default (ddp) disagrees too: the flag is the one source of the preset.
    default = run(launcher("accelerate", 2, "accelerate_configs/zero2.yaml") + common
                  + ["--output_dir", str(tmp_path / "default")], timeout=180)
    assert default.returncode != 0 and "exitcode: 2" in default.output, default.output[-3000:]  # the ranks' exit 2
    assert "--config ddp (the default) disagrees with the accelerate config, which uses DeepSpeed file " \
           "ds_configs/zero2.json: pass --config zero2 to train with that file" in default.output

    # The two agreeing (accelerate_configs/zero2.yaml with --config zero2) train on that file: test_parity.py's zero2
    # and loop_zero2 runs.
