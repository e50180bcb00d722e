"""--push_to_hub on the three training paths and on `finetune export`, through huggingface_hub's real client against
a Hub on 127.0.0.1 (tests/hub_server.py; HF_ENDPOINT points at it). What arrives is checked: one repo created (its
visibility), ONE commit per push holding every file of the local result byte for byte plus README.md, the weights,
GGUF files and images through Git LFS as the Hub asks (batch call, upload to the storage URL, verify; the commit
names them by sha256 and size), the token's header on every Hub call and not on the storage upload, and the card's
front matter and numbers (the same losses as trainer_state.json, the report's loss curve as an image in the commit).
A server that answers 500, or an LFS upload that fails or arrives short, leaves the local result intact and no
commit on the server, and the command says so in one line and exits 1."""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tests.hub_server import serve
from tests.launch import ENGINE, LOOP, REPO, TRAIN, launcher, losses, run, tiny_job
from tests.test_hub import COMMIT, REPO_ID, add_snapshot, hf_env

pytestmark = pytest.mark.slow

TOKEN = "hf_pushtest_token"
FLAGS = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--max_seq_length", "64",
         "--seed", "3"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(root, local model, data, HF_HOME with the model cached as REPO_ID at main)."""
    root, model, data = tiny_job(tmp_path_factory.mktemp("push"), records=24)
    hf_home = root / "hf_home"
    add_snapshot(hf_home, REPO_ID, model, COMMIT, {"main": COMMIT})
    return root, model, data, hf_home


@pytest.fixture(scope="module")
def fake():
    hub, server, thread = serve()
    yield hub
    server.shutdown()
    server.server_close()
    thread.join(10)


def online(job, fake, **extra) -> dict[str, str]:
    root, _, _, hf_home = job
    # HF_HUB_DISABLE_XET: the client's Git LFS path (hf_xet, installed here, would send the LFS files to the Hub's
    # Xet storage, which tests/hub_server.py does not answer).
    e = dict(**hf_env(hf_home), HF_HUB_OFFLINE="0", HF_ENDPOINT=fake.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1",
             HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", FINETUNE_CACHE=str(root / "ft-cache"))
    e.update(extra)
    return e


def final_files(folder: Path) -> dict[str, Path]:
    """The folder's files but hidden ones; README.md (PEFT writes one beside an adapter) is replaced by the card."""
    return {p.name: p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != "README.md"}


def with_report(local: dict[str, Path], run_folder: Path) -> dict[str, Path]:
    """`local` and the run's `finetune report` folder, as the push names them (report/...)."""
    return {**local, **{f"report/{p.name}": p for p in sorted((run_folder / "report").iterdir())}}


def lfs_expected(local: dict[str, Path]) -> set[str]:
    """The files the Hub sends through LFS among these: weights and GGUF files by their suffix, PNG images by their
    binary content; text files (configs, tokenizer, card, Modelfile) under 10 MB go inline in the commit."""
    return {name for name in local if name.endswith((".safetensors", ".gguf", ".png"))}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def front_matter(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    meta, body = card[4:].split("\n---\n", 1)
    return yaml.safe_load(meta), body


def table_losses(body: str) -> list[float]:
    section = body.split("## Loss", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| step")]
    return [float(r.split("|")[2]) for r in rows]


def check_commit(fake, local: dict[str, Path], lfs: set[str]) -> tuple[dict, str]:
    """One repo, one commit, the local files byte for byte plus README.md, the `lfs` ones through Git LFS, the token
    on every Hub call; the card."""
    assert len(fake.created) == 1, fake.created
    assert len(fake.commits) == 1, [c.header for c in fake.commits]
    commit = fake.commits[0]
    assert sorted(commit.files) == sorted([*local, "README.md"]), set(commit.files) ^ {*local, "README.md"}
    for name, path in local.items():
        assert commit.files[name] == path.read_bytes(), name
    # LFS: the commit names each file by its sha256 and size, and the server assembled it from the stored object;
    # one batch call for all of them, one upload (one PUT, or one per part and the completion call) and one verify
    # per object.
    assert set(commit.lfs) == lfs, set(commit.lfs) ^ lfs
    for name in lfs:
        data = local[name].read_bytes()
        assert commit.lfs[name] == (sha256(data), len(data)) and sha256(commit.files[name]) == sha256(data), name
    oids = {oid for oid, _ in commit.lfs.values()}
    assert len(fake.batches) == (1 if lfs else 0), fake.batches
    if lfs:
        batch = fake.batches[0]
        assert batch["operation"] == "upload" and batch["hash_algo"] == "sha256" and batch["repo"] == commit.repo_id
        assert {o["oid"] for o in batch["objects"]} == oids and batch["accept"] == "application/vnd.git-lfs+json"
    storage = [r for r in fake.requests if r[1].startswith("/lfs-store/")]
    expected = []
    for oid, size in set(commit.lfs.values()):
        if fake.lfs_multipart and size > fake.lfs_multipart:
            parts = math.ceil(size / fake.lfs_multipart)
            expected += [("PUT", f"/lfs-store/{oid}/part/{n}") for n in range(1, parts + 1)]
            expected.append(("POST", f"/lfs-store/{oid}"))
        else:
            expected.append(("PUT", f"/lfs-store/{oid}"))
    assert sorted((method, path) for method, path, _ in storage) == sorted(expected), storage
    assert all(auth is None for _, _, auth in storage), storage  # the URL is signed; the token stays with the Hub
    verified = [r for r in fake.requests if r[1].endswith("/info/lfs/objects/verify")]
    assert len(verified) == len(oids), verified
    # create, validate-yaml, preupload, the LFS batch and verify calls, commit
    posts = [r for r in fake.requests if r[0] == "POST" and r not in storage]
    assert posts and all(auth == f"Bearer {TOKEN}" for _, _, auth in posts), posts
    assert commit.authorization == f"Bearer {TOKEN}" and commit.revision == "main"
    return front_matter(commit.files["README.md"].decode())


def check_loss_image(data: bytes) -> None:
    """`finetune report`'s loss.png: a PNG that decodes whole, 640x380 (its 6.4x3.8 inch figure at 100 dpi)."""
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG" and image.size == (640, 380), (image.format, image.size)
    image.load()  # every pixel decodes: the file is complete


def test_trainer_path_two_ranks_pushes_once(job, fake, tmp_path):
    """torchrun, 2 ranks, a Hub model: rank 0 alone pushes; the repo is created private, one commit holds the final
    save; the card names the base repo and its commit, the method and the final loss, and its loss table holds
    trainer_state.json's losses."""
    fake.reset()
    out = tmp_path / "out"
    run([*launcher("torchrun", 2, script=TRAIN), "--model_name_or_path", REPO_ID, "--dataset", str(job[2]),
         "--output_dir", str(out), *FLAGS, "--push_to_hub", "--hub_model_id", "tinyorg/pushed",
         "--hub_private_repo", "true"], timeout=400, **online(job, fake)).check()
    assert fake.created[0] == {"name": "pushed", "organization": "tinyorg", "visibility": "private", "type": "model",
                               "authorization": f"Bearer {TOKEN}"}
    local = with_report(final_files(out), out)  # the push wrote the run's report first, for the card's loss curve
    assert {"model.safetensors", "report/loss.png", "report/learning_rate.png"} <= lfs_expected(local), sorted(local)
    meta, body = check_commit(fake, local, lfs_expected(local))
    assert fake.commits[0].repo_id == "tinyorg/pushed"
    assert {"model.safetensors", "config.json", "trainer_state.json", "finetune_config.yaml"} <= set(fake.commits[0].files)
    assert meta["base_model"] == REPO_ID and meta["base_model_revision"] == COMMIT
    assert meta["library_name"] == "transformers" and meta["tags"] == ["finetune", "sft"]
    got = losses(out)
    assert len(got) == 3 and meta["finetune_metrics"]["loss"] == got[-1] and meta["finetune_metrics"]["global_step"] == 3
    assert table_losses(body) == got
    assert f"data set: `{job[2]}` (a local file)" in body and "## Flags" in body
    # The card shows the report's loss curve, by its path in the repo, above the table of the same run's losses.
    check_loss_image(fake.commits[0].files["report/loss.png"])
    assert "## Loss\n\n![loss](report/loss.png)\n\n| step | loss |" in body
    report = json.loads(fake.commits[0].files["report/metrics.json"])
    assert report["train"]["last_loss"] == got[-1] and report["train"]["first_loss"] == got[0]


@pytest.mark.parametrize("path, script", [("loop", LOOP), ("engine", ENGINE)])
def test_loop_and_engine_push_an_adapter(job, fake, tmp_path, path, script):
    """The hand-written paths, a LoRA adapter: the adapter's files in one commit; with no --hub_model_id the repo
    is the output folder's name in the token's namespace, its visibility left to the Hub (no --hub_private_repo)."""
    fake.reset()
    out = tmp_path / f"adapter-{path}"
    run([sys.executable, script, "--model_name_or_path", REPO_ID, "--dataset", str(job[2]), "--output_dir", str(out),
         *FLAGS, "--use_peft", "--lora_r", "4", "--push_to_hub"], timeout=300, **online(job, fake)).check()
    assert fake.created[0] == {"name": out.name, "organization": None, "type": "model",
                               "authorization": f"Bearer {TOKEN}"}
    local = with_report(final_files(out), out)
    assert {"adapter_model.safetensors", "report/loss.png"} <= lfs_expected(local)
    meta, body = check_commit(fake, local, lfs_expected(local))
    assert fake.commits[0].repo_id == f"tester/{out.name}"
    assert "adapter_model.safetensors" in fake.commits[0].files
    assert meta["library_name"] == "peft" and meta["tags"] == ["finetune", "sft", "lora"]
    assert meta["base_model"] == REPO_ID and meta["base_model_revision"] == COMMIT
    assert table_losses(body) == losses(out)
    check_loss_image(fake.commits[0].files["report/loss.png"])
    assert "![loss](report/loss.png)" in body


@pytest.fixture(scope="module")
def adapter(job, tmp_path_factory):
    """A LoRA adapter trained on REPO_ID (offline), with `finetune report`'s folder in it."""
    root, _, data, hf_home = job
    out = tmp_path_factory.mktemp("adapter") / "out"
    run([sys.executable, TRAIN, "--model_name_or_path", REPO_ID, "--dataset", str(data), "--output_dir", str(out),
         *FLAGS, "--use_peft", "--lora_r", "4"], timeout=300, **hf_env(hf_home),
        FINETUNE_CACHE=str(root / "ft-cache")).check()
    run([sys.executable, "-m", "finetune.cli", "report", str(out)], timeout=120).check()
    assert (out / "report" / "loss.png").is_file()
    return out


def test_export_merged_model_pushes_with_the_report(job, fake, adapter, tmp_path):
    """export --adapter: the merged, verified folder in one commit, plus the run's report; the card shows the
    report's loss curve and the adapter's run (base repo and commit, losses). The storage takes objects over
    200,000 bytes in parts (a multipart upload, as the Hub asks for large files): the merged weights go in 3."""
    fake.reset(lfs_multipart=200_000)
    merged = tmp_path / "merged"
    run([sys.executable, "-m", "finetune.cli", "export", "--adapter", str(adapter), "--output_dir", str(merged),
         "--push_to_hub", "--hub_model_id", "tinyorg/merged", "--hub_private_repo", "false"], timeout=300,
        **online(job, fake)).check()
    local = with_report(final_files(merged), adapter)
    assert {"model.safetensors", "report/loss.png"} <= lfs_expected(local)
    meta, body = check_commit(fake, local, lfs_expected(local))
    assert math.ceil(local["model.safetensors"].stat().st_size / 200_000) == 3
    assert fake.created[0]["visibility"] == "public"
    assert meta["base_model"] == REPO_ID and meta["base_model_revision"] == COMMIT and meta["library_name"] == "transformers"
    assert meta["tags"] == ["finetune", "sft", "lora"]
    assert "![loss](report/loss.png)" in body and table_losses(body) == losses(adapter)
    assert "# tinyorg/merged\n\nThe model (a LoRA adapter merged into its base), fine-tuned with finetune: method `sft`, LoRA." in body


def test_export_gguf_pushes_the_file_and_its_modelfile(job, fake, adapter, tmp_path):
    fake.reset()
    gguf = tmp_path / "gguf" / "tiny.gguf"
    run([sys.executable, "-m", "finetune.cli", "export", "--to", "gguf", "--adapter", str(adapter), str(gguf),
         "--gguf_type", "q8_0", "--push_to_hub", "--hub_model_id", "tinyorg/tiny-gguf"], timeout=300,
        **online(job, fake)).check()
    local = with_report({"tiny.gguf": gguf, "Modelfile": gguf.parent / "Modelfile"}, adapter)
    assert "tiny.gguf" in lfs_expected(local) and "Modelfile" not in lfs_expected(local)
    meta, body = check_commit(fake, local, lfs_expected(local))
    assert meta["library_name"] == "gguf" and "gguf" in meta["tags"] and meta["base_model"] == REPO_ID
    assert "# tinyorg/tiny-gguf\n\nThe GGUF file (q8_0), fine-tuned with finetune" in body


def test_a_failed_push_keeps_the_local_model(job, fake, tmp_path):
    """The Hub answers 500: exit 1, one line naming the repo and the local folder, the verified save in place."""
    fake.reset(fail=True)
    out = tmp_path / "out"
    r = run([sys.executable, TRAIN, "--model_name_or_path", str(job[1]), "--dataset", str(job[2]),
             "--output_dir", str(out), *FLAGS, "--push_to_hub", "--hub_model_id", "tinyorg/down"], timeout=300,
            **online(job, fake))
    fake.reset()
    assert r.returncode == 1, r.output[-3000:]
    lines = [line for line in r.output.splitlines() if line.startswith("finetune: --push_to_hub")]
    assert len(lines) == 1 and "tinyorg/down failed (" in lines[0] and "500 Internal Server Error" in lines[0], r.output[-3000:]
    assert f"the local model in {out} is intact" in lines[0] and "Traceback" not in r.output
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file() and len(losses(out)) == 3


@pytest.mark.parametrize("fault", ["500", "short"])
def test_a_failed_lfs_upload_keeps_the_export_and_commits_nothing(job, fake, adapter, tmp_path, fault):
    """The storage answers every LFS upload 500 (the client tries each 6 times: once and 5 retries), or keeps half
    of each upload (the verify call finds it short and answers 422): exit 1, one line naming the file and the cause,
    the verified export in place (the bytes the client hashed), and no commit on the server: the commit call is
    never made, so the repo holds nothing of the push."""
    fake.reset(lfs_fault=fault)
    merged = tmp_path / "merged"
    r = run([sys.executable, "-m", "finetune.cli", "export", "--adapter", str(adapter), "--output_dir", str(merged),
             "--push_to_hub", "--hub_model_id", "tinyorg/lfs-fail"], timeout=300, **online(job, fake))
    requests, batches, objects = list(fake.requests), list(fake.batches), dict(fake.objects)
    commits = list(fake.commits)
    fake.reset()
    assert r.returncode == 1, r.output[-3000:]
    lines = [line for line in r.output.splitlines() if line.startswith("finetune: --push_to_hub")]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output[-3000:]
    m = re.fullmatch(r"finetune: --push_to_hub: the push to tinyorg/lfs-fail failed \(Error while uploading '([^']+)' "
                     r"to the Hub: (.+)\); the local model \(a LoRA adapter merged into its base\) in (\S+) is intact; "
                     r"push it again with `hf upload tinyorg/lfs-fail \S+`", lines[0])
    assert m and m.group(3) == str(merged), lines[0]
    local = with_report(final_files(merged), adapter)
    name, cause = m.group(1), m.group(2)
    assert name in lfs_expected(local), lines[0]
    assert "X-Amz-Signature" not in lines[0]  # the storage URL's signature is not printed
    data = local[name].read_bytes()
    oid = sha256(data)
    puts = [path for method, path, _ in requests if method == "PUT" and path == f"/lfs-store/{oid}"]
    verifies = [path for method, path, _ in requests if path.endswith("/info/lfs/objects/verify")]
    if fault == "500":
        assert "500 Internal Server Error" in cause and len(puts) == 6 and not verifies, (cause, puts, verifies)
    else:
        assert "422" in cause and "objects/verify" in cause and len(puts) == 1 and verifies, (cause, puts)
        assert len(objects[oid]) == len(data) // 2  # what the storage kept of it
    assert commits == [] and not any("/commit/" in path for _, path, _ in requests), requests
    # The export stands as it was verified: its files are the bytes the client hashed for the batch call.
    assert len(batches) == 1
    assert {sha256(local[n].read_bytes()) for n in lfs_expected(local)} == {o["oid"] for o in batches[0]["objects"]}
    assert (merged / "config.json").is_file() and (merged / "model.safetensors").is_file()


def test_push_flags_are_checked_before_anything_loads(job, tmp_path):
    """HF_HUB_OFFLINE=1, a checkpoint hub_strategy, a hub flag without --push_to_hub: exit 2, one line each."""
    root, model, data, hf_home = job
    base = [sys.executable, "-m", "finetune.cli", "train", "--model_name_or_path", str(model), "--dataset", str(data),
            "--output_dir", str(tmp_path / "out")]
    r = run([*base, "--push_to_hub", "--hub_strategy", "all_checkpoints"], timeout=120, HF_HUB_OFFLINE="1")
    assert r.returncode == 2
    assert "push_to_hub: HF_HUB_OFFLINE=1 forbids the upload" in r.output
    assert "hub_strategy: 'all_checkpoints' pushes checkpoints" in r.output
    r = run([*base, "--hub_model_id", "a/b"], timeout=120)
    assert r.returncode == 2 and "hub_model_id: goes with --push_to_hub" in r.output
    assert not (tmp_path / "out").exists()
