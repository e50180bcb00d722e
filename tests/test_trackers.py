"""--report_to wandb (offline) and --report_to mlflow (a local file store) on the three paths, read back with the
trackers' own formats: wandb's run file (its LevelDB-style log of protobuf Records, wandb.proto's Record) and
MLflow's client on the file store. Each holds the per-step losses of trainer_state.json, --run_name, and the
run's config; a tracker that is not installed, or an MLflow store MLflow would refuse, is refused before anything
loads."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

from finetune.config import ship
from tests.launch import ENGINE, LOOP, TRAIN, losses, run, tiny_job

FLAGS = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--max_seq_length", "64",
         "--seed", "3"]
PATHS = {"trainer": TRAIN, "loop": LOOP, "engine": ENGINE}


def wandb_records(run_file: Path) -> list:
    """The Records of a .wandb file: a 7-byte header (':W&B', 0xBEE1, version 0), then 32 KiB blocks of chunks, each
    with a header (crc32 of its type byte and data, length, type: 1 full, 2 first, 3 middle, 4 last), as wandb's
    datastore writes them."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"bad checksum at {pos}"
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def read_wandb(wandb_dir: Path) -> dict:
    runs = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    records = wandb_records(runs[0])
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds[-1] == "exit", kinds[-6:]  # the run was finished, not cut off
    name = next(r.run.display_name for r in records if r.WhichOneof("record_type") == "run")
    config = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for i in r.config.update}
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    return {"name": name, "config": config, "history": history}


def read_mlflow(store: Path) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file:{store}")
    runs = client.search_runs(["0"])
    assert len(runs) == 1
    r = runs[0]
    return {"name": r.info.run_name, "status": r.info.status, "params": r.data.params,
            # transformers logs with synchronous=False: MLflow's async queue hands batches to a pool of up to 10
            # threads, so the file store's lines come in the order the writes finished, not step order
            "loss": sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, "loss"))}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return tiny_job(tmp_path_factory.mktemp("trackers"), records=24)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_wandb_and_mlflow_hold_the_logged_losses(job, tmp_path, path, monkeypatch):
    root, model, data = job
    out, wandb_dir, store = tmp_path / "out", tmp_path / "wandb", tmp_path / "mlruns"
    wandb_dir.mkdir()
    name = f"tracked-{path}"
    run([sys.executable, PATHS[path], "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir",
         str(out), *FLAGS, "--report_to", "wandb", "mlflow", "--run_name", name], timeout=300,
        WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true", MLFLOW_TRACKING_URI=f"file:{store}",
        MLFLOW_ALLOW_FILE_STORE="true", FINETUNE_CACHE=str(root / "ft-cache")).check()
    expected = losses(out)
    assert len(expected) == 3
    steps = [e["step"] for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]

    w = read_wandb(wandb_dir)
    assert w["name"] == name
    logged = [h for h in w["history"] if "train/loss" in h]
    assert [h["train/loss"] for h in logged] == expected  # the same floats, bit for bit
    assert [h["train/global_step"] for h in logged] == steps
    assert w["config"]["learning_rate"] == 1e-3 and w["config"]["max_steps"] == 3 and w["config"]["run_name"] == name

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    m = read_mlflow(store)
    assert m["name"] == name and m["status"] == "FINISHED"
    assert m["loss"] == list(zip(steps, expected))
    assert m["params"]["learning_rate"] == "0.001" and m["params"]["max_steps"] == "3" and m["params"]["run_name"] == name
    print(f"{path}: trainer_state {expected}, wandb {[h['train/loss'] for h in logged]}, mlflow {m['loss']}")


def test_a_missing_tracker_is_refused_naming_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("wandb", "mlflow") else real(n, *a))
    assert ship.tracker_problems(["wandb", "tensorboard"]) == [
        "report_to: wandb is not installed; pip install wandb (or pip install 'finetune[trackers]')"]
    assert ship.tracker_problems("mlflow") == [
        "report_to: mlflow is not installed; pip install mlflow-skinny (or pip install 'finetune[trackers]')"]
    assert ship.tracker_problems("none") == [] and ship.tracker_problems("all") == []


def test_an_mlflow_store_mlflow_refuses_is_refused_first(job, tmp_path):
    """A file store without MLFLOW_ALLOW_FILE_STORE: MLflow 3 would raise in the first callback, after the model
    loaded; the command says so in one line, exit 2, nothing written."""
    root, model, data = job
    r = run([sys.executable, TRAIN, "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir",
             str(tmp_path / "out"), "--report_to", "mlflow"], timeout=120,
            MLFLOW_TRACKING_URI=f"file:{tmp_path / 'mlruns'}", MLFLOW_ALLOW_FILE_STORE="")
    assert r.returncode == 2
    assert "report_to mlflow: MLFLOW_TRACKING_URI=file:" in r.output and "MLFLOW_ALLOW_FILE_STORE=true" in r.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlruns").exists()
