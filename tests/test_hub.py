"""Hub model ids and Hub data sets, offline, through huggingface_hub's and datasets' real resolution code.

The tests build the HF cache layout those libraries read (hub/models--org--name/{blobs,refs,snapshots/<commit>},
datasets/<org>___<name>/<config>/<version>/<commit>/) in a temporary HF_HOME and run the real commands on the repo
id with HF_HUB_OFFLINE=1. Nothing is mocked; no network is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO, TRAIN, env, finish, launcher, losses, run, tiny_job

# Every test here runs the real commands in processes (HF_HOME and HF_ENDPOINT are read when huggingface_hub loads).
pytestmark = pytest.mark.slow

COMMIT = "a" * 8 + "0123456789abcdef0123456789abcdef"  # 40 hex digits, as the Hub names commits
TAG_COMMIT = "b" * 8 + "0123456789abcdef0123456789abcdef"
REPO_ID = "tinyorg/tiny-llama"
DATA_ID = "tinyorg/tiny-chat"
DATA_COMMIT = "c" * 8 + "0123456789abcdef0123456789abcdef"


def hf_env(hf_home: Path) -> dict[str, str]:
    """HF_HOME and the two cache variables that would override it, should the caller's environment set them."""
    return dict(HF_HOME=str(hf_home), HF_HUB_CACHE=str(hf_home / "hub"), HF_DATASETS_CACHE=str(hf_home / "datasets"))


def add_snapshot(hf_home: Path, repo_id: str, folder: Path, commit: str, refs: dict[str, str]) -> Path:
    """Put `folder`'s files into the hub cache as huggingface_hub lays them out: content-addressed blobs, the
    snapshot folder of links to them, and refs/<branch or tag> files holding the commit."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    for ref, target in refs.items():
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(target)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(root, local model folder, data file, HF_HOME) with the model cached under REPO_ID at `main` and tag v1."""
    root, model, data = tiny_job(tmp_path_factory.mktemp("hub"), records=24)
    hf_home = root / "hf_home"
    add_snapshot(hf_home, REPO_ID, model, COMMIT, {"main": COMMIT})
    # The tag points at a second commit with other weights (another seed), so loading the wrong one shows in the losses.
    from finetune.models import tiny

    add_snapshot(hf_home, REPO_ID, tiny.build(root / "model_v1", style="chatml", seed=1), TAG_COMMIT, {"v1": TAG_COMMIT})
    return root, model, data, hf_home


def start(argv: list[str], environ: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "finetune.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environ)


def cli_start(hf_home: Path, *argv: str) -> subprocess.Popen:
    return start(list(argv), env(**hf_env(hf_home), HF_HUB_OFFLINE="1", FINETUNE_CACHE=str(hf_home.parent / "ft-cache")))


def cli(hf_home: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return finish(cli_start(hf_home, *argv), timeout=timeout)[0]


TRAIN_FLAGS = ["--max_steps", "3", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3",
               "--max_seq_length", "64", "--seed", "3"]


def train(hub, out: Path, model: str, *extra: str, dataset: str | None = None, cmd: list[str] | None = None) -> list[float]:
    root, _, data, hf_home = hub
    result = run([*(cmd or [sys.executable, TRAIN]), "--model_name_or_path", model, "--dataset", dataset or str(data),
                  "--output_dir", str(out), *TRAIN_FLAGS, *extra], timeout=300,
                 **hf_env(hf_home), FINETUNE_CACHE=str(root / "ft-cache"))
    result.check()
    return losses(out)


@pytest.fixture(scope="module")
def local_losses(hub, tmp_path_factory):
    return train(hub, tmp_path_factory.mktemp("local") / "out", str(hub[1]))


def test_repo_id_trains_like_the_local_folder(hub, local_losses, tmp_path):
    """org/name from the offline cache: the same losses as the same files given as a folder; the saved config.json
    and finetune_config.yaml name the repo and the exact commit."""
    out = tmp_path / "out"
    got = train(hub, out, REPO_ID)
    assert len(got) == 3 and got == local_losses
    saved = json.loads((out / "config.json").read_text())
    assert saved["finetune_base_model"] == REPO_ID and saved["finetune_base_revision"] == COMMIT
    import yaml

    recipe = yaml.safe_load((out / "finetune_config.yaml").read_text())
    assert recipe["model_name_or_path"] == REPO_ID and recipe["model_revision"] == COMMIT


@pytest.fixture(scope="module")
def v1_losses(hub, local_losses, tmp_path_factory):
    got = train(hub, tmp_path_factory.mktemp("local_v1") / "out", str(hub[0] / "model_v1"))
    assert got != local_losses  # the two commits really hold different models
    return got


# The tag's own commit given by hash: with FINETUNE_FULL_MATRIX=1 (CI: a tag, and a commit by hash).
@pytest.mark.parametrize("revision, commit", [
    ("v1", TAG_COMMIT), pytest.param(TAG_COMMIT, TAG_COMMIT, marks=pytest.mark.full_matrix), (COMMIT, COMMIT)])
def test_revision_tag_and_commit(hub, local_losses, v1_losses, tmp_path, revision, commit):
    """--model_revision as a tag (refs/v1) and as a commit (snapshots/<commit>) load that commit's files offline:
    the losses of that commit's model given as a folder."""
    out = tmp_path / "out"
    expected = v1_losses if commit == TAG_COMMIT else local_losses
    assert train(hub, out, REPO_ID, "--model_revision", revision) == expected
    assert json.loads((out / "config.json").read_text())["finetune_base_revision"] == commit


def test_lora_on_a_repo_id_then_export_and_generate(hub, tmp_path):
    """A LoRA adapter trained on org/name records the commit; export merges it onto the repo id (resolved from the
    cache again), and generate on the merged folder prints what generate on repo id + adapter prints."""
    out = tmp_path / "adapter"
    train(hub, out, REPO_ID, "--use_peft", "--lora_r", "4", "--model_revision", "v1")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["revision"] == TAG_COMMIT and cfg["base_model_name_or_path"].endswith(f"snapshots/{TAG_COMMIT}")
    merged = tmp_path / "merged"
    r = cli(hub[3], "export", "--adapter", str(out), "--base_model", REPO_ID, "--base_model_revision", "v1",
            "--output_dir", str(merged))
    assert r.returncode == 0, r.stderr
    args = ["--prompt", "count: red cat dog", "--max_new_tokens", "6", "--chat", "--with_ids"]
    with_adapter, from_merged = finish(
        cli_start(hub[3], "generate", "--model_name_or_path", REPO_ID, "--model_revision", "v1", "--adapter", str(out), *args),
        cli_start(hub[3], "generate", "--model_name_or_path", str(merged), *args))
    assert with_adapter.returncode == 0, with_adapter.stderr
    assert with_adapter.stdout == from_merged.stdout and "completion_ids" in from_merged.stdout


def test_two_ranks_resolve_the_repo_id(hub, tmp_path):
    """torchrun, 2 ranks: each rank resolves org/name from the cache itself; the same losses as the folder."""
    by_folder = train(hub, tmp_path / "folder", str(hub[1]), cmd=launcher("torchrun", 2))
    by_id = train(hub, tmp_path / "id", REPO_ID, cmd=launcher("torchrun", 2))
    assert len(by_id) == 3 and by_id == by_folder


def test_unknown_revision_is_refused_naming_the_cached_ones(hub, tmp_path):
    r = cli(hub[3], "train", "--model_name_or_path", REPO_ID, "--model_revision", "v9", "--dataset", str(hub[2]),
            "--output_dir", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert f"--model_revision v9: not in the cache for {REPO_ID} (cached: main, v1, {COMMIT}, {TAG_COMMIT}" in r.stderr
    assert not (tmp_path / "out").exists()


def test_missing_repo_offline_names_hf_hub_offline_and_the_cache(hub, tmp_path):
    r = cli(hub[3], "train", "--model_name_or_path", "tinyorg/not-there", "--dataset", str(hub[2]),
            "--output_dir", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert ("--model_name_or_path tinyorg/not-there: not in the Hugging Face cache "
            f"({hub[3] / 'hub'}) and HF_HUB_OFFLINE=1 forbids downloading") in r.stderr
    assert "Traceback" not in r.stderr


def test_generate_and_plan_take_the_repo_id(hub):
    """generate on the repo id prints what generate on the folder prints; plan reads only config.json."""
    args = ["--prompt", "reverse: red cat", "--max_new_tokens", "5", "--chat", "--with_ids"]
    plan_args = ["--devices_per_node", "1", "--device_memory", "8GB", "--host_memory", "16GB"]
    by_id, by_folder, p_id, p_folder = finish(
        cli_start(hub[3], "generate", "--model_name_or_path", REPO_ID, *args),
        cli_start(hub[3], "generate", "--model_name_or_path", str(hub[1]), *args),
        cli_start(hub[3], "plan", "--model_name_or_path", REPO_ID, *plan_args),
        cli_start(hub[3], "plan", "--model_name_or_path", str(hub[1]), *plan_args))
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout == by_folder.stdout and "completion_ids" in by_id.stdout
    assert p_id.returncode == 0, p_id.stderr
    assert p_id.stdout == p_folder.stdout


def test_plan_fetches_config_json_only(hub, tmp_path):
    """A cache whose snapshot holds only config.json (as hf_hub_download leaves it) is enough for plan."""
    hf_home = tmp_path / "hf_home"
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    shutil.copy(hub[1] / "config.json", only_config / "config.json")
    add_snapshot(hf_home, REPO_ID, only_config, COMMIT, {"main": COMMIT})
    r, t = finish(cli_start(hf_home, "plan", "--model_name_or_path", REPO_ID, "--devices_per_node", "1",
                            "--device_memory", "8GB", "--host_memory", "16GB"),
                  cli_start(hf_home, "train", "--model_name_or_path", REPO_ID, "--dataset", str(hub[2]),
                            "--output_dir", str(tmp_path / "o")))
    assert r.returncode == 0, r.stderr
    # ...while training needs the weights and the tokenizer, and says the snapshot has no weights.
    assert t.returncode == 2 and "no weights (*.safetensors)" in t.stderr, t.stderr


# ----------------------------------------------------------------------------------------------
# Hub data sets


def cache_dataset(hf_home: Path, repo_id: str, data_file: Path | dict[str, Path], commit: str,
                  config: str = "default") -> Path:
    """Leave in HF_HOME/datasets what `load_dataset(repo_id[, config])` leaves after an online run: the Arrow data
    prepared by datasets' own json builder, in <org>___<name>/<config>/0.0.0/<commit>/ (datasets names the folder after
    the Hub commit). `data_file`: the train split's file, or {split: file}. Offline, load_dataset finds it through its
    cache module; this only writes it."""
    splits = {"train": data_file} if isinstance(data_file, Path) else data_file
    code = (
        "import json, sys\n"
        "from datasets.packaged_modules.json.json import Json\n"
        "from datasets.data_files import DataFilesDict\n"
        "repo_id, splits, commit, config = sys.argv[1:]\n"
        "splits = {k: [v] for k, v in json.loads(splits).items()}\n"
        "b = Json(data_files=DataFilesDict.from_patterns(splits), dataset_name=repo_id.split('/')[1],\n"
        "         config_name=config, config_id=config, hash=commit)\n"
        # the repo id sets the <org>___ folder; given to the constructor it would demand hf:// data file paths
        "b.repo_id = repo_id\n"
        "b._cache_dir = b._build_cache_dir()\n"
        "b.download_and_prepare()\n"
        "print(b.cache_dir)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, repo_id, json.dumps({k: str(v) for k, v in splits.items()}), commit,
                        config], capture_output=True, text=True, timeout=120, env=env(**hf_env(hf_home)))
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


def test_hub_dataset_gives_the_records_of_the_local_file(hub, local_losses, tmp_path):
    """--dataset org/name read by datasets.load_dataset offline: the same records, so the same losses, as the file;
    its tokenize cache entry is its own (repo id + commit in the key)."""
    root, _, data, hf_home = hub
    where = cache_dataset(hf_home, DATA_ID, data, DATA_COMMIT)
    assert where.name == DATA_COMMIT
    out = tmp_path / "out"
    got = train(hub, out, str(hub[1]), dataset=DATA_ID)
    assert got == local_losses
    r = run([sys.executable, "-c",
             "import json,sys\nfrom types import SimpleNamespace as N\nfrom finetune.data import prepare, sources\n"
             f"cfg = N(dataset='{DATA_ID}', dataset_config=None, dataset_split='train', dataset_revision=None)\n"
             "h = sources.load_hub(cfg)\nrecs, where = prepare.read_hub_records(h)\n"
             "print(json.dumps([h.revision, recs, where[0]]))"], timeout=120, **hf_env(hf_home))
    r.check()
    revision, records, first = json.loads(r.output.strip().splitlines()[-1])
    assert revision == DATA_COMMIT and first == f"{DATA_ID}@{DATA_COMMIT[:12]} row 0"
    assert records == [json.loads(line) for line in data.read_text().splitlines()]


def test_hub_dataset_errors(hub, tmp_path):
    root, model, data, hf_home = hub
    cache_dataset(hf_home, DATA_ID, data, DATA_COMMIT)
    # One output folder each: the three run at once, and a folder takes one run at a time (its run lock).
    base = ["train", "--model_name_or_path", str(model), *TRAIN_FLAGS]
    other = "d" * 40
    missing, wrong_rev, split = finish(
        cli_start(hf_home, *base, "--output_dir", str(tmp_path / "out1"), "--dataset", "tinyorg/no-data"),
        cli_start(hf_home, *base, "--output_dir", str(tmp_path / "out2"), "--dataset", DATA_ID,
                  "--dataset_revision", other),
        cli_start(hf_home, *base, "--output_dir", str(tmp_path / "out3"), "--dataset", DATA_ID,
                  "--dataset_split", "test"))
    assert missing.returncode == 2, missing.stderr
    assert (f"--dataset tinyorg/no-data: not in the datasets cache ({hf_home / 'datasets'}) and HF_HUB_OFFLINE=1 "
            "forbids downloading") in missing.stderr
    assert wrong_rev.returncode == 2, wrong_rev.stderr
    assert f"--dataset_revision {other}: the cache holds {DATA_ID} at {DATA_COMMIT} only" in wrong_rev.stderr
    assert split.returncode == 2 and "--dataset tinyorg/tiny-chat: " in split.stderr and "split" in split.stderr.lower()


# ----------------------------------------------------------------------------------------------
# Errors only a server gives: a tiny HTTP server on 127.0.0.1 answers as the Hub does (status + X-Error-Code), and
# huggingface_hub's own hf_raise_for_status turns the answers into its exception classes.

ANSWERS = {  # path fragment -> (status, X-Error-Code)
    "tinyorg/gated": (401, "GatedRepo"),
    "tinyorg/tiny-llama/revision/v9": (404, "RevisionNotFound"),
    "tinyorg/tiny-llama/resolve/v9": (404, "RevisionNotFound"),
}


@pytest.fixture(scope="module")
def fake_hub():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body: bool) -> None:
            seen.append(self.path)
            status, code = next(((st, c) for frag, (st, c) in ANSWERS.items() if frag in self.path), (404, "RepoNotFound"))
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            payload = json.dumps({"error": code}).encode()
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def do_GET(self):
            self.answer(True)

        def do_HEAD(self):
            self.answer(False)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()
    thread.join(10)


def online_start(fake_hub, tmp_path, *argv: str, token: str | None = None) -> subprocess.Popen:
    e = env(**hf_env(tmp_path / "hf_home"), HF_HUB_OFFLINE="0", HF_ENDPOINT=fake_hub[0],
            HF_HUB_ETAG_TIMEOUT="10", HF_HUB_DOWNLOAD_TIMEOUT="10", FINETUNE_CACHE=str(tmp_path / "ft-cache"))
    e.pop("HF_TOKEN", None)
    if token:
        e["HF_TOKEN"] = token
    return start(list(argv), e)


def test_server_errors_are_one_line_fixes(hub, fake_hub, tmp_path):
    """Gated without and with a token, no such repo, no such revision: exit 2, one line each, before any model
    code (no output folder); the requests went to the loopback server only."""
    data = str(hub[2])
    train_args = ["--dataset", data, "--output_dir", str(tmp_path / "out")]
    gated, with_token, missing, revision, plan = finish(
        online_start(fake_hub, tmp_path, "train", "--model_name_or_path", "tinyorg/gated", *train_args),
        online_start(fake_hub, tmp_path, "train", "--model_name_or_path", "tinyorg/gated", *train_args, token="hf_x"),
        online_start(fake_hub, tmp_path, "train", "--model_name_or_path", "tinyorg/nothing", *train_args),
        online_start(fake_hub, tmp_path, "train", "--model_name_or_path", REPO_ID, "--model_revision", "v9", *train_args),
        # plan fetches config.json alone (hf_hub_download): the same mapping
        online_start(fake_hub, tmp_path, "plan", "--model_name_or_path", "tinyorg/gated", "--devices_per_node", "1"),
        timeout=180)
    assert gated.returncode == 2, gated.stderr
    assert ("--model_name_or_path tinyorg/gated: a gated repository; accept its terms at "
            "https://huggingface.co/tinyorg/gated, then set HF_TOKEN (or run `hf auth login`)") in gated.stderr
    assert with_token.returncode == 2 and "a gated repository and your token has no access" in with_token.stderr
    assert missing.returncode == 2, missing.stderr
    assert ("--model_name_or_path tinyorg/nothing: no such repository on the Hub (check the spelling; if it is "
            "private, set HF_TOKEN), or give a local folder") in missing.stderr
    assert revision.returncode == 2, revision.stderr
    assert (f"--model_revision v9: no such branch, tag or commit in {REPO_ID}; check the name at "
            f"https://huggingface.co/{REPO_ID}") in revision.stderr
    assert plan.returncode == 2 and "tinyorg/gated: a gated repository" in plan.stderr, plan.stderr
    for r in (gated, with_token, missing, revision, plan):
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
    assert any("/api/models/tinyorg/gated" in p for p in fake_hub[1])
    assert any("/config.json" in p for p in fake_hub[1])


def test_server_errors_for_data_sets(hub, fake_hub, tmp_path):
    base = ["train", "--model_name_or_path", str(hub[1]), *TRAIN_FLAGS]  # an output folder each: they run at once
    gated, missing = finish(
        online_start(fake_hub, tmp_path, *base, "--output_dir", str(tmp_path / "out1"), "--dataset", "tinyorg/gated"),
        online_start(fake_hub, tmp_path, *base, "--output_dir", str(tmp_path / "out2"), "--dataset", "tinyorg/nothing"),
        timeout=180)
    assert gated.returncode == 2, gated.stderr
    assert "--dataset tinyorg/gated: Dataset 'tinyorg/gated' is a gated dataset on the Hub" in gated.stderr
    assert "set HF_TOKEN" in gated.stderr
    assert missing.returncode == 2, missing.stderr
    assert "--dataset tinyorg/nothing: Dataset 'tinyorg/nothing' doesn't exist on the Hub" in missing.stderr
