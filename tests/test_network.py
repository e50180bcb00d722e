"""Nothing waits forever on the network (finetune/network.py): through huggingface_hub's real client and real local
servers (tests/hub_server.py: one that accepts connections and never answers, and the fake Hub stalling on one
path), a push, a model look-up and a tracking server each end in bounded time with one line naming the endpoint,
the local result kept; huggingface_hub's retries stop at FINETUNE_NETWORK_TRIES unanswered requests and a server's
Retry-After is cut; and every Hub call in finetune/ goes through the bound (read from the source)."""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune import network
from tests.hub_server import serve, silent

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 2  # FINETUNE_NETWORK_TIMEOUT in these tests: seconds, not the default's 40
START_S = 30  # a Python start-up with huggingface_hub on a loaded 2-core machine, at most


@pytest.fixture(scope="module")
def stalled():
    url, stop = silent()
    yield url
    stop()


@pytest.fixture
def fake():
    hub, server, thread = serve()
    yield hub
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture
def bounded(monkeypatch):
    """This process's huggingface_hub with the bounded client (FINETUNE_NETWORK_TIMEOUT=TIMEOUT_S), then its own
    again."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    from huggingface_hub import constants

    monkeypatch.setenv(network.TIMEOUT_ENV, str(TIMEOUT_S))
    monkeypatch.delenv(network.TRIES_ENV, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the tests' environment is offline; these servers are local
    network.forget_unanswered()
    set_client_factory(network.hub_client)
    yield
    set_client_factory(default_client_factory)
    network.forget_unanswered()


def hub_env(endpoint: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", network.TRIES_ENV)}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0", HF_TOKEN="hf_test", HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=str(REPO),
               FINETUNE_CACHE=str(tmp_path / "cache"), **{network.TIMEOUT_ENV: str(TIMEOUT_S)})
    env.update(extra)
    return env


PUSH = """
import sys, time
from pathlib import Path
from finetune.ship import hub
folder = Path(sys.argv[1])
start = time.monotonic()
try:
    hub.push_or_exit(folder, {p.name: p for p in folder.iterdir()}, run_folder=None, what="model",
                     repo_id="tinyorg/stalled", private=None, token=None)
finally:
    print(f"{time.monotonic() - start:.2f}")
"""


def test_a_push_to_a_hub_that_never_answers_ends_in_one_line(stalled, tmp_path):
    """The Hub accepts the connection and never answers: before the bound the push waited forever in create_repo.
    Now it ends within the bound (tries x timeout), exit 1, one line naming the endpoint, the files as they were."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    proc = subprocess.run([sys.executable, "-c", PUSH, str(folder)], env=hub_env(stalled, tmp_path),
                          capture_output=True, text=True, timeout=network.total_bound() + START_S)
    seconds = float(proc.stdout.split()[-1])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        f"finetune: --push_to_hub: the push to tinyorg/stalled failed ({stalled} did not answer within {TIMEOUT_S} s "
        f"(2 tries); check the network, HF_ENDPOINT and any proxy; {network.TIMEOUT_ENV}=SECONDS waits longer); the "
        f"local model in {folder} is intact; push it again with `hf upload tinyorg/stalled {folder}`"), proc.stderr
    # create_repo is one request (huggingface_hub does not retry it); its client asks the Hub's agent registry first
    # (a 3 s timeout of its own, here the bound's 2 s): 2 unanswered requests, then no more.
    assert TIMEOUT_S <= seconds <= 2 * TIMEOUT_S + 3, seconds
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()} == before
    bound = network.total_bound({network.TIMEOUT_ENV: str(TIMEOUT_S)})
    print(f"\npush to a Hub that never answers: exit 1 after {seconds:.1f} s (the bound at {TIMEOUT_S} s a request: "
          f"{bound:.0f} s; the default's: {network.total_bound({}):.0f} s)")


def test_retries_stop_after_the_tries(fake, bounded):
    """huggingface_hub's own retry loop (http_backoff: 5 retries) on a path the Hub never answers: 2 requests reach
    the server (FINETUNE_NETWORK_TRIES' default), each waiting TIMEOUT_S; the others are refused at once, without a
    request. The host stays given up (another path too) until the count is reset, and answers again after."""
    from huggingface_hub.utils import http_backoff

    fake.reset(hang="/api/stall")
    start = time.monotonic()
    with pytest.raises(Exception) as e:
        http_backoff("POST", f"{fake.url}/api/stall", json={}, base_wait_time=0.01, max_wait_time=0.01)
    seconds = time.monotonic() - start
    assert type(e.value).__name__ == "Unanswered" and network.stalled(e.value) == fake.url, repr(e.value)
    assert [r[:2] for r in fake.requests] == [("POST", "/api/stall")] * network.DEFAULT_TRIES
    assert network.DEFAULT_TRIES * TIMEOUT_S <= seconds <= network.DEFAULT_TRIES * TIMEOUT_S + 2, seconds
    with pytest.raises(Exception) as e:
        http_backoff("GET", f"{fake.url}/api/models/a/b", max_retries=0)
    assert type(e.value).__name__ == "Unanswered" and len(fake.requests) == network.DEFAULT_TRIES
    network.forget_unanswered()
    assert http_backoff("GET", f"{fake.url}/api/models/a/b").status_code == 404  # answered
    assert network.stalled() is None


def test_a_servers_retry_wait_is_cut(fake, bounded, monkeypatch):
    """A 500 asking to retry after an hour: huggingface_hub waits the cut wait (MAX_WAIT_S, here 1 s) + 1 s."""
    from huggingface_hub.utils import http_backoff

    monkeypatch.setattr(network, "MAX_WAIT_S", 1)
    fake.reset(fail=True, retry_after=3600)
    start = time.monotonic()
    with pytest.raises(Exception) as e:
        http_backoff("POST", f"{fake.url}/api/repos/create", json={}, max_retries=1)
    seconds = time.monotonic() - start
    assert "500" in str(e.value) and len(fake.requests) == 2
    assert 2 <= seconds < 6, seconds


@pytest.mark.slow
def test_a_model_look_up_on_a_hub_that_never_answers(stalled, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "finetune", "plan", "--model_name_or_path", "someorg/somemodel"],
                          env=hub_env(stalled, tmp_path), capture_output=True, text=True,
                          timeout=network.total_bound() + START_S, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"  - --model_name_or_path someorg/somemodel: {stalled} did not answer within {TIMEOUT_S} s (2 tries); "
            "check the network, HF_ENDPOINT and any proxy") in proc.stderr, proc.stderr


@pytest.mark.slow
def test_mlflow_gets_the_bound(stalled, monkeypatch):
    """The config check gives MLflow's client the bound (2 tries of TIMEOUT_S), unless the environment sets its own;
    MLflow itself then stops within it on a server that never answers (its defaults: 120 s x 8 tries, and waits)."""
    from finetune.config import ship

    for key in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(network.TIMEOUT_ENV, str(TIMEOUT_S))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", stalled)
    assert ship.tracker_problems("mlflow")[0].startswith(f"report_to mlflow: MLFLOW_TRACKING_URI={stalled} did not")
    assert (os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"], os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) == ("2", "1")
    code = "import mlflow, time\nt = time.monotonic()\ntry:\n    mlflow.set_experiment('x')\nexcept Exception as e:\n" \
           "    print(type(e).__name__)\nprint(f'{time.monotonic() - t:.2f}')"
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True,
                          timeout=120)
    name, seconds = proc.stdout.split()
    # 2 requests of 2 s, and urllib3's one backoff wait (factor 1)
    assert name == "MlflowException" and 2 * TIMEOUT_S <= float(seconds) <= 2 * TIMEOUT_S + 4, proc.stdout
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")
    ship.tracker_problems("mlflow")
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"  # the user's own setting stays


def test_the_bound_is_read_from_the_environment_of_the_moment(monkeypatch, tmp_path):
    """datasets' map with num_proc replaces the os.environ object with a copy: the bound set after it (as the tests'
    fixtures do, in an xdist worker where another file ran such a map first) is the one in effect, and the config
    check still gives MLflow's client its bound."""
    import datasets

    from finetune.config import ship

    monkeypatch.setattr(os, "environ", os.environ)  # this process's own object again afterwards
    before = os.environ
    datasets.Dataset.from_dict({"a": list(range(4))}).map(lambda r: r, num_proc=2,
                                                         cache_file_name=str(tmp_path / "map.arrow"))
    assert os.environ is not before  # what datasets does; if a release stops, this test has nothing left to hold
    for key in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(network.TIMEOUT_ENV, "3")
    monkeypatch.setenv(network.TRIES_ENV, "4")
    assert (network.timeout(), network.tries(), network.total_bound()) == (3, 4, 4 * 3 + network.HUB_BACKOFF_S)
    assert "within 3 s (4 tries)" in network.describe("http://h", "x")
    monkeypatch.setenv(network.TRIES_ENV, "0")
    assert network.env_problems() == [f"{network.TRIES_ENV}=0: give a whole number of requests, 1 or more"]
    monkeypatch.setenv(network.TRIES_ENV, "4")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:./mlruns")
    ship.tracker_problems("mlflow")
    assert [os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES")] == ["3", "3"]


def test_the_default_bound_is_about_two_minutes():
    assert network.timeout({}) == 40 and network.tries({}) == 2
    assert network.total_bound({}) == 2 * 40 + 23 <= 120
    assert network.env_problems({network.TIMEOUT_ENV: "soon", network.TRIES_ENV: "0"}) == [
        f"{network.TIMEOUT_ENV}=soon: give a number of seconds above 0",
        f"{network.TRIES_ENV}=0: give a whole number of requests, 1 or more"]


# ----------------------------------------------------------------------------------------------
# Every Hub call of finetune/ goes through the bound: in each function that calls one of huggingface_hub's (or
# datasets') network entry points, network.bound_hub() is called first.

HUB_CALLS = {"HfApi", "hf_hub_download", "snapshot_download", "load_dataset", "create_repo", "create_commit",
             "upload_file", "upload_folder", "upload_large_folder", "model_info", "dataset_info", "list_repo_files",
             "HfFileSystem", "get_hf_file_metadata", "whoami", "repo_exists", "file_exists"}


@functools.cache
def _trees() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted((REPO / "finetune").rglob("*.py"))]


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def test_every_hub_call_is_bounded():
    found, unbounded = [], []
    for path, tree in _trees():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
            bound = [c.lineno for c in calls if _name(c) == "bound_hub"]
            for c in calls:
                if _name(c) in HUB_CALLS:
                    where = f"{path.relative_to(REPO)}:{c.lineno} {fn.name}: {_name(c)}"
                    found.append(where)
                    if not any(line < c.lineno for line in bound):
                        unbounded.append(where)
    assert not unbounded, f"Hub calls without network.bound_hub() before them: {unbounded}"
    # the ones there are today (a test that finds none proves nothing)
    assert {w.split(":")[0] for w in found} >= {"finetune/ship/hub.py", "finetune/models/hub.py",
                                                "finetune/data/sources.py"}, found


@pytest.mark.slow
def test_export_push_to_a_hub_that_never_answers_keeps_the_export(stalled, tmp_path):
    """The command the issue names: `finetune export --to gguf ... --push_to_hub` against a Hub that never answers
    (it waited forever in create_repo): exit 1 within the bound, one line, the verified GGUF file and its Modelfile
    in place."""
    from finetune.models import tiny

    model = tiny.build(tmp_path / "model", style="chatml")
    out = tmp_path / "gguf" / "tiny.gguf"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "finetune", "export", "--to", "gguf", "--model_name_or_path",
                           str(model), str(out), "--push_to_hub", "--hub_model_id", "tinyorg/tiny-gguf"],
                          env=hub_env(stalled, tmp_path), capture_output=True, text=True, timeout=600, cwd=REPO)
    seconds = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("finetune: --push_to_hub")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"finetune: --push_to_hub: the push to tinyorg/tiny-gguf failed ({stalled} did not "
                               f"answer within {TIMEOUT_S} s (2 tries)") and f"in {out} is intact" in lines[0], lines[0]
    import gguf

    reader = gguf.GGUFReader(str(out))
    assert reader.tensors and (out.parent / "Modelfile").is_file()
    print(f"\nexport --push_to_hub to a Hub that never answers: exit 1 after {seconds:.1f} s (export included)")


@pytest.mark.slow
def test_a_tracker_failing_mid_run_does_not_hide_the_result(fake, tiny_chatml, tmp_path, isolated, one_thread,
                                                            capsys, monkeypatch):
    """MLflow's server answers (the check before anything loads passes) and then refuses every call (500): the run
    starts its tracker, which fails; one warning line, the run trains and saves as usual, its losses in
    trainer_state.json. Before, the failure in the first callback ended the run after the model had loaded."""
    from finetune.training import trainer

    fake.reset(fail=True)  # GET answers 404, POST 500
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fake.url)
    monkeypatch.setenv(network.TIMEOUT_ENV, str(TIMEOUT_S))
    for key in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        monkeypatch.delenv(key, raising=False)
    data = tmp_path / "d.jsonl"
    data.write_text("".join('{"text": "hello world %d"}\n' % i for i in range(8)))
    out = tmp_path / "out"
    trainer.main(["--model_name_or_path", str(tiny_chatml), "--dataset", str(data), "--output_dir", str(out),
                  "--max_steps", "2", "--per_device_train_batch_size", "2", "--report_to", "mlflow"])
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("finetune: warning: report_to mlflow")]
    assert len(warnings) == 1 and "on_train_begin failed (" in warnings[0], err[-3000:]
    assert any(method == "GET" for method, _, _ in fake.requests)  # MLflow did ask the server
    logged = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    assert [e["step"] for e in logged] == [1, 2] and (out / "model.safetensors").is_file()
    print(f"\n{warnings[0]}")


def test_every_tracker_is_bounded_and_guarded():
    """Trackers run as transformers' callbacks: every place finetune/ makes them (the loop and engine's Reporters,
    the Trainer's own list) passes them through evaluate.guard_trackers; finetune's own calls into wandb or mlflow
    (the runs ended after the final save) sit in a try; and the check every training command runs first
    (config/ship.py's tracker_problems) gives MLflow's client the bound (test_mlflow_gets_the_bound)."""
    guarded, made, direct = set(), [], []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node) == "guard_trackers":
                guarded |= {id(n) for n in ast.walk(node) if n is not node}
                if "callback_handler" in ast.unparse(node):
                    guarded.add(("handler", path.name))
        tries = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for n in ast.walk(t)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node) == "get_reporting_integration_callbacks":
                made.append((path.name, node.lineno, id(node) in guarded))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id in ("wandb", "mlflow"):
                direct.append((path.name, node.lineno, ast.unparse(node), id(node) in tries))
    assert made and all(ok for *_, ok in made), made
    assert ("handler", "trainer.py") in guarded  # the Trainer's callbacks, trackers among them
    assert direct and all(ok for *_, ok in direct), direct
