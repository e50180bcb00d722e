"""`finetune ui`'s server (finetune/apps/ui.py, ui_app.py, ui_runs.py) through its HTTP API (the real app, in
this process through Starlette's TestClient; the runs are real `finetune train` / `finetune export` processes).

The page's plan, command line, recipe, refusals and data preview are the CLI's own (compared with the CLI's entry
points' output); paths stay inside the roots; a token guards any other host; a run stops (SIGTERM to its group),
resumes to the same end, exports and chats. The whole run from a browser is tests/test_ui_browser.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from finetune.apps import ui as ui_cmd  # noqa: E402
from finetune.apps.ui_app import Confine, PageError, Settings, create_app  # noqa: E402
from finetune.apps.ui_runs import parse_log  # noqa: E402
from finetune.training.checkpoint import MARKER  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def root(tmp_path, tiny_chatml) -> Path:
    root = tmp_path / "root"
    (root / "models").mkdir(parents=True)
    shutil.copytree(tiny_chatml, root / "models" / "tiny")
    (root / "data").mkdir()
    shutil.copy(REPO / "data" / "demo.jsonl", root / "data" / "demo.jsonl")
    return root


def client(root: Path, token: str | None = None, loopback: bool = True) -> TestClient:
    app = create_app(Settings(roots=[root], runs_dir=root / "runs", token=token, loopback=loopback))
    return TestClient(app, base_url="http://127.0.0.1:7860")


def fields(**over) -> dict:
    base = {"model_name_or_path": "models/tiny", "dataset": "data/demo.jsonl", "max_steps": "6",
            "learning_rate": "1e-3", "per_device_train_batch_size": "4", "max_seq_length": "128", "save_steps": "3"}
    return {**base, **over}


# ----------------------------------------------------------------------------------------------
# Security


def test_paths_outside_the_roots_are_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "data").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.jsonl").write_text("{}\n")
    (root / "data" / "a.jsonl").write_text("{}\n")
    (root / "out-link").symlink_to(outside)  # a symlink out of the root
    (root / "in-link").symlink_to(root / "data")  # one that stays inside
    confine = Confine([root])
    assert confine.path("data/a.jsonl", "dataset") == str(root / "data" / "a.jsonl")
    assert confine.path("in-link/a.jsonl", "dataset") == str(root / "data" / "a.jsonl")
    assert confine.path(str(root / "data" / "a.jsonl"), "dataset") == str(root / "data" / "a.jsonl")
    for bad in ("../outside/secret.jsonl", "data/../../outside/secret.jsonl", str(outside / "secret.jsonl"),
                "out-link/secret.jsonl", "out-link", "/etc/passwd", "~/x"):
        with pytest.raises(PageError, match="outside the folders this page may use"):
            confine.path(bad, "dataset")
    # A Hub id is no path: it passes as it is (a local folder of that name would win, inside the root).
    assert confine.path("HuggingFaceTB/SmolLM2-135M", "model_name_or_path", hub="model") == "HuggingFaceTB/SmolLM2-135M"
    assert confine.path("org/name", "dataset", hub="dataset") == "org/name"
    with pytest.raises(PageError):  # a data file name is a (missing) local file, not a Hub id
        confine.path("../x.jsonl", "dataset", hub="dataset")


def test_the_api_confines_every_path_flag(root):
    (root / "link").symlink_to("/etc")
    c = client(root)
    for body in ({"fields": fields(model_name_or_path="../x")},
                 {"fields": fields(dataset="link/passwd")},
                 {"fields": fields(), "extra": "--eval_dataset ../../etc/passwd"},
                 {"fields": fields(), "extra": "--chat_template=/etc/passwd"},
                 {"fields": fields(), "extra": "--recipe link/x.yaml"}):
        for path in ("/api/plan", "/api/runs"):
            r = c.post(path, json={**body, "name": "r"})
            assert r.status_code == 400 and "outside the folders this page may use" in r.json()["error"], r.json()
    r = c.post("/api/preview", json={"model_name_or_path": "models/tiny", "dataset": "link/passwd"})
    assert "outside the folders" in r.json()["error"]
    # The flags the page sets itself, and run names that are paths.
    r = c.post("/api/plan", json={"fields": fields(), "extra": "--output_dir /tmp/x", "name": "r"})
    assert r.json()["error"].startswith("--output_dir: set by the page")
    for name in ("../x", "a/b", ".ui", ""):
        assert "run name" in c.post("/api/runs", json={"fields": fields(), "name": name}).json()["error"]
    assert c.get("/api/runs/..%2F..%2Fetc").status_code in (400, 404)
    assert not (root / "runs").exists() or not any((root / "runs").iterdir())


def test_token_host_and_json_guards(root):
    token = "t0ken-of-sixteen-chars"
    c = client(root, token=token, loopback=False)
    assert c.get("/api/info").status_code == 401
    assert c.get("/api/info", headers={"x-finetune-token": "wrong-token-0000000"}).status_code == 401
    assert c.get("/api/info", headers={"x-finetune-token": token}).status_code == 200
    page = c.get(f"/?token={token}")  # the printed address sets the cookie the page then sends
    assert page.status_code == 200 and "finetune" in page.text
    assert c.get("/api/info").status_code == 200
    # Loopback: no token, but only a loopback Host (DNS rebinding), and changes only as JSON from this origin.
    local = client(root)
    assert local.get("/api/info").status_code == 200
    assert local.get("/api/info", headers={"host": "evil.example:7860"}).status_code == 403
    assert local.post("/api/plan", content="{}", headers={"content-type": "text/plain"}).status_code == 415
    assert local.post("/api/plan", json={}, headers={"origin": "http://evil.example"}).status_code == 403


def test_ui_flags(tmp_path):
    def parse(*argv):
        return ui_cmd.command().parse(list(argv), ui_cmd.check_args).args

    assert ui_cmd.settings_of(parse("--root", str(tmp_path))).token is None
    made = ui_cmd.settings_of(parse("--root", str(tmp_path), "--host", "0.0.0.0"))
    assert made.token and len(made.token) >= 16 and not made.loopback
    given = ui_cmd.settings_of(parse("--root", str(tmp_path), "--host", "0.0.0.0", "--token", "x" * 20))
    assert given.token == "x" * 20
    assert ui_cmd.settings_of(parse("--root", str(tmp_path), "--host", "::1")).loopback
    from finetune.config.parser import ConfigError

    with pytest.raises(ConfigError) as e:
        parse("--root", str(tmp_path / "nope"), "--token", "short", "--port", "70000")
    assert e.value.problems == [f"--port: must be 0-65535, got 70000", f"--root {tmp_path / 'nope'}: no such folder",
                                "--token: at least 16 characters, letters, digits or -_.~ only (it travels in a URL)"]
    with pytest.raises(ConfigError, match="--runs_dir ../elsewhere: outside every --root"):
        parse("--root", str(tmp_path), "--runs_dir", "../elsewhere")


def test_the_command_off_loopback_makes_and_prints_a_token(tmp_path):
    """`finetune ui --host 0.0.0.0` as a process: the address it prints carries a token, and only that token opens
    the page."""
    import urllib.error
    import urllib.request

    from finetune import testing

    cmd = [sys.executable, "-m", "finetune.cli", "ui", "--root", str(tmp_path), "--host", "0.0.0.0", "--port", "0"]
    with testing.Launched(cmd, REPO, testing.env()) as server:
        assert server.wait(60, until=lambda: "token=" in server.output), server.output
        url = next(w for w in server.output.split() if w.startswith("http://"))
        port, token = url.split(":")[2].split("/")[0], url.split("token=")[1]
        assert len(token) >= 16 and "the token above was made for this session" in server.output

        def status(path, **headers):
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
            try:
                return urllib.request.urlopen(request, timeout=30).status
            except urllib.error.HTTPError as e:
                return e.code

        assert status("/api/info") == 401
        assert status(f"/?token={token[:-1]}x") == 401
        assert status("/api/info", **{"X-Finetune-Token": token}) == 200
        assert status(f"/?token={token}") == 200
        server.kill()
    assert (tmp_path / "runs").is_dir()


# ----------------------------------------------------------------------------------------------
# The CLI's own plan, command line, recipe and messages


def test_plan_command_and_recipe_are_the_cli_s(root, capsys, isolated):
    from finetune import config as C
    from finetune.plan import planner

    c = client(root)
    body = {"fields": fields(use_peft=True, lora_r="8", gradient_checkpointing=True), "name": "p1",
            "plan": {"devices_per_node": "2", "accelerator": "gpu", "device_memory": "24GB"},
            "extra": "--warmup_steps 2 --lora_alpha=16"}
    got = c.post("/api/plan", json=body).json()
    assert "error" not in got, got
    argv = shlex.split(got["command"])
    assert argv[:6] == ["torchrun", "--nproc_per_node", "2", "-m", "finetune.cli", "train"]
    flags = argv[6:]
    assert flags == ["--model_name_or_path", str(root / "models" / "tiny"), "--dataset", str(root / "data/demo.jsonl"),
                     "--use_peft", "--lora_r", "8", "--max_steps", "6", "--learning_rate", "1e-3",
                     "--per_device_train_batch_size", "4", "--max_seq_length", "128", "--gradient_checkpointing",
                     "--save_steps", "3", "--warmup_steps", "2", "--lora_alpha=16",
                     "--output_dir", str(root / "runs" / "p1"), "--resume_from_checkpoint", "latest"]
    # `finetune plan --json` with the same flags prints the plan the page shows.
    planner.main([*flags[:-4], "--devices_per_node", "2", "--accelerator", "gpu", "--device_memory", "24GB", "--json"])
    assert json.loads(capsys.readouterr().out) == got["plan"]
    assert got["plan"]["job"]["world_size"] == 2 and got["plan"]["job"]["method"].startswith("LoRA r=8")
    # The recipe is the same run as the command line.
    recipe = root / "recipe.yaml"
    recipe.write_text(got["recipe"])
    assert C.parse(["--recipe", str(recipe)]).resolved() == C.parse(flags).resolved()


def test_the_method_s_own_options(root, isolated):
    from finetune import config as C
    from finetune import methods

    shutil.copy(REPO / "data" / "quickstart" / "train_pairs.jsonl", root / "data" / "pairs.jsonl")
    c = client(root)
    options = c.get("/api/info").json()["method_options"]
    assert sorted(options) == sorted(methods.names()) and options["sft"] == []
    dpo = {o["name"]: o for o in options["dpo"]}
    assert list(dpo) == ["beta", "loss_type", "label_smoothing", "precompute_ref_log_probs"]
    assert dpo["beta"]["default"] == methods.get("dpo").config().beta and dpo["precompute_ref_log_probs"]["bool"]
    body = {"fields": fields(method="dpo", dataset="data/pairs.jsonl"), "name": "d",
            "options": {"beta": "0.25", "loss_type": dpo["loss_type"]["default"], "label_smoothing": "",
                        "precompute_ref_log_probs": False}}
    got = c.post("/api/plan", json=body).json()
    assert "error" not in got, got
    argv = shlex.split(got["command"])[2:]
    assert argv[argv.index("--method"):argv.index("--method") + 2] == ["--method", "dpo"]
    assert argv[argv.index("--beta") + 1] == "0.25" and "--loss_type" not in argv  # a default is left out
    assert C.parse(argv).objective.beta == 0.25
    assert got["plan"]["job"]["method"] == "full; DPO: 2 rows per pair, reference a frozen copy of the model"
    bad = c.post("/api/plan", json={**body, "options": {"beta": "strong"}}).json()["error"]
    assert "--beta: expected a number, got 'strong'" in bad


@pytest.mark.parametrize("change", [
    {"learning_rate": "abc"},
    {"extra": "--learnin_rate 0.1"},
    {"method": "dpx"},
    {"dataset": "data/missing.jsonl", "max_steps": "-3", "save_steps": "0"},
    {"model_name_or_path": "nobody/no-such-model"},  # a Hub id passes the confinement; the Hub's answer is the CLI's
])
def test_bad_inputs_get_the_cli_s_message(root, change, capsys, isolated):
    from finetune import cli

    c = client(root)
    extra = change.pop("extra", "")
    body = {"fields": fields(**change), "extra": extra, "name": "bad"}
    page = c.post("/api/plan", json=body).json()["error"]
    launched = c.post("/api/runs", json=body)
    assert launched.status_code == 400 and launched.json()["error"] == page
    argv = shlex.split(c.post("/api/plan", json={"fields": fields(), "name": "bad"}).json()["command"])
    # The same flags given to `finetune train` (its entry point, in this process): the same text on stderr, exit 2.
    given = dict(zip(argv[2::2], argv[3::2]))
    for key, value in change.items():
        given[f"--{key}"] = str(root / value) if key == "dataset" else value  # the page resolves local paths
    cli_argv = [x for kv in given.items() for x in kv] + shlex.split(extra)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *cli_argv])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == page
    assert not (root / "runs" / "bad").exists() and not (root / "runs" / ".ui" / "bad").exists()


# ----------------------------------------------------------------------------------------------
# Data preview: the loss mask training uses


def test_preview_is_the_training_mask(root):
    from transformers import AutoTokenizer

    from finetune.constants import IGNORE_INDEX
    from finetune.data import prepare

    c = client(root)
    got = c.post("/api/preview", json={"model_name_or_path": "models/tiny", "dataset": "data/demo.jsonl", "n": 4,
                                       "max_seq_length": 48}).json()
    assert "error" not in got, got
    records, where = prepare.read_records(root / "data" / "demo.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(root / "models" / "tiny")
    # prepare.tokenize_all is the per-record reference of the pipeline's map that training reads.
    examples, stats = prepare.tokenize_all(records[:4], where[:4], "messages", tokenizer, 48, False, True)
    kept = [r for r in got["records"] if not r["dropped"]]
    assert [(r["input_ids"], r["labels"]) for r in kept] == [(e["input_ids"], e["labels"]) for e in examples]
    # 48 tokens cut records, and leave one with no trained token, which training drops
    assert sum(r["truncated"] for r in got["records"]) == stats.truncated > 0
    assert len(got["records"]) - len(kept) == stats.dropped_no_labels > 0
    assert [r["trained"] for r in kept] == [sum(x != IGNORE_INDEX for x in e["labels"][1:]) for e in examples]
    first = got["records"][0]
    assert [on for _, on in first["tokens"]] == [x != IGNORE_INDEX for x in first["labels"]]
    bad = c.post("/api/preview", json={"model_name_or_path": "models/tiny", "dataset": "data/demo.jsonl",
                                       "dataset_format": "alpaca"}).json()["error"]
    assert bad.startswith(f"{root / 'data' / 'demo.jsonl'}:1:")  # the data's own message, with file and line


# ----------------------------------------------------------------------------------------------
# Reading the printed log


TRAINER_LOG = (
    "  0%|          | 0/4 [00:00<?, ?it/s]\r 25%|██▌       | 1/4 [00:01<00:03,  1.0s/it]\r"
    "                                     \r{'loss': '6.222', 'grad_norm': '1.7', 'learning_rate': '5e-05', 'epoch': '0.1'}\n"
    "\r 25%|██▌       | 1/4 [00:01<00:03,  1.0s/it]\r 50%|█████     | 2/4 [00:02<00:02,  1.0s/it]\r"
    # tqdm's refresh interval: the bar at step 3 was not drawn before the entry; the redraw after it is.
    "                                     \r{'loss': '6.1', 'epoch': '0.2'}\n\r 75%|███████▌  | 3/4 [00:03<00:01,  1.0s/it]\r"
    "{'eval_loss': '6.05', 'eval_runtime': '0.1'}\n\r 75%|███████▌  | 3/4 [00:03<00:01,  1.0s/it]\r"
    "Writing model shards:   0%|          | 0/1 [00:00<?, ?it/s]\r"
    "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 20.0it/s]\n"
    "{'loss': '5.9', 'epoch': '0.4'}"  # its bar is not out yet: read next time
)


def test_the_trainer_s_printed_log_is_read_by_step():
    parsed = parse_log(TRAINER_LOG)
    assert (parsed["step"], parsed["max_steps"]) == (3, 4)  # the labelled bar (model shards) is not the run's
    assert parsed["entries"] == [(1, {"loss": 6.222, "grad_norm": 1.7, "learning_rate": 5e-05, "epoch": 0.1}),
                                 (3, {"loss": 6.1, "epoch": 0.2}), (3, {"eval_loss": 6.05, "eval_runtime": 0.1})]


# ----------------------------------------------------------------------------------------------
# A run: launch, watch, stop, resume, report, export, chat


def _wait(what, until, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = until()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout:.0f} s")


def _pending(pid: int, sig: int) -> bool:
    """Whether `sig` waits for process `pid` (a stopped process takes it when continued), or `pid` is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    status = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return any(int(status[k], 16) >> (sig - 1) & 1 for k in ("ShdPnd", "SigPnd"))


@pytest.mark.slow
def test_stop_resume_export_and_chat(root):
    from finetune.inference.generate import GenerateArgs, run

    c = client(root)
    # 40 tiny steps (~0.2 s each): after step 6 the run has seconds to go, so a test process starved by a loaded
    # machine (CI runs two workers on two cores) still freezes it mid-run; with 12 it had once ended first.
    steps = 40
    # LoRA: the adapter run's chat (base + adapter) and its merge; the browser test chats with a full run.
    body = {"fields": fields(max_steps=str(steps), save_steps="4", use_peft=True, lora_r="4"), "name": "r"}
    launched = c.post("/api/runs", json=body).json()
    assert "run" in launched, launched
    pid = launched["run"]["pid"]
    _wait("step 6", lambda: (c.get("/api/runs/r").json()["progress"]["step"] or 0) >= 6)
    # Frozen where the page saw it, so the stop lands mid-run; it goes on once the stop's SIGTERM waits for it.
    os.killpg(pid, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        stopping = pool.submit(lambda: c.post("/api/runs/r/stop", json={}).json())
        _wait("the stop's SIGTERM", lambda: _pending(pid, signal.SIGTERM), timeout=30)
        with contextlib.suppress(ProcessLookupError):  # a stopped process may end at SIGTERM without going on
            os.killpg(pid, signal.SIGCONT)
        stopped = stopping.result(timeout=60)
    assert stopped.get("stopped") and stopped["killed"] == [], stopped  # SIGTERM ended the whole group
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    detail = c.get("/api/runs/r").json()
    assert detail["status"] == "stopped" and (root / "runs" / "r" / "checkpoint-4").is_dir()
    # The resume's checkpoint: the last complete one (the stop may land in a save, leaving that folder unmarked).
    last = max(int(p.parent.name.split("-")[1]) for p in (root / "runs" / "r").glob(f"checkpoint-*/{MARKER}"))
    assert 4 <= last < steps
    assert c.post("/api/runs/r/stop", json={}).status_code == 400  # not running
    assert "run r exists" in c.post("/api/runs", json=body).json()["error"]

    assert "run" in c.post("/api/runs/r/resume", json={}).json()
    _wait("the run's end", lambda: c.get("/api/runs/r").json()["status"] == "finished", timeout=300)
    detail = c.get("/api/runs/r").json()
    state = json.loads((root / "runs" / "r" / "trainer_state.json").read_text())
    history = state["log_history"]
    assert state["global_step"] == steps
    assert detail["curves"]["train"] == [[e["step"], e["loss"]] for e in history if "loss" in e]
    assert [s for s, _ in detail["curves"]["train"]] == list(range(1, steps + 1))
    assert detail["curves"]["eval"] == [[e["step"], e["eval_loss"]] for e in history if "eval_loss" in e]
    assert detail["progress"] == {"step": steps, "max_steps": steps}
    # What the page drew while it ran (the printed entries of the resumed session) is the saved history, to the
    # printed 4 significant digits.
    log = detail["log"] and (root / "runs" / ".ui" / "r" / "train.log").read_text()
    resumed = log.rsplit("finetune ui: started again", 1)[1]
    assert f"resume: from {root / 'runs' / 'r' / f'checkpoint-{last}'}\n" in resumed
    printed = {s: e["loss"] for s, e in parse_log(resumed)["entries"] if "loss" in e}
    saved = {e["step"]: e["loss"] for e in history if "loss" in e}
    assert sorted(printed) == list(range(last + 1, steps + 1))  # from the last checkpoint on
    assert max(abs(printed[s] - saved[s]) / saved[s] for s in printed) < 5e-4

    report = c.post("/api/runs/r/report", json={}).json()
    assert "loss.png" in report["images"]
    assert c.get("/api/runs/r/report/loss.png").content[:4] == b"\x89PNG"

    # Both exports at once: the merged folder, and GGUF (merged first, then written).
    assert c.post("/api/runs/r/export", json={"to": "hf"}).json()["path"].endswith("exports/r/hf")
    assert c.post("/api/runs/r/export", json={"to": "gguf"}).json()["path"].endswith("exports/r/r.gguf")
    exports = _wait("the exports", lambda: (lambda e: e if all(x["state"] != "running" for x in e.values()) else None)(
        c.get("/api/runs/r").json()["exports"]), timeout=300)
    assert {to: e["state"] for to, e in exports.items()} == {"hf": "done", "gguf": "done"}, exports
    assert "merged vs base+adapter logits max diff" in exports["hf"]["log"]
    assert (root / "runs" / "exports" / "r" / "hf" / "model.safetensors").is_file()
    assert (root / "runs" / "exports" / "r" / "r.gguf").is_file() and "logits vs HF max diff" in exports["gguf"]["log"]

    # Chat: greedy, `finetune generate`'s own run on the same prompt gives the same tokens.
    messages = [{"role": "user", "content": "reverse: one two three"}]
    reply = c.post("/api/chat", json={"run": "r", "messages": messages, "max_new_tokens": 8}).json()
    base, adapter = str(root / "models" / "tiny"), str(root / "runs" / "r")
    cli = run(GenerateArgs(model_name_or_path=base, adapter=adapter, prompt=["reverse: one two three"], chat=True,
                           max_new_tokens=8, output=str(root / "gen.jsonl")))
    assert reply["completion_ids"] == cli[0]["completion_ids"] and reply["reply"] == cli[0]["completion"]
    sampled = c.post("/api/chat", json={"run": "r", "messages": messages, "max_new_tokens": 8, "do_sample": True,
                                        "seed": 3}).json()
    cli = run(GenerateArgs(model_name_or_path=base, adapter=adapter, prompt=["reverse: one two three"], chat=True,
                           max_new_tokens=8, do_sample=True, seed=3, output=str(root / "gen.jsonl")))
    assert sampled["completion_ids"] == cli[0]["completion_ids"] and len(sampled["completion_ids"]) > 0
    listed = c.get("/api/runs").json()["runs"]
    assert [(r["name"], r["status"], r["step"]) for r in listed] == [("r", "finished", steps)]


@pytest.mark.slow
def test_hub_ids_for_model_and_data(root, tmp_path):
    """A Hub model and a Hub data set (in an HF cache this test lays out, offline): the page plans with the ids as
    they are, and previews the data set's records with the model's tokenizer. The server is a process: HF_HOME is
    read when huggingface_hub loads."""
    import urllib.request

    from finetune import testing
    from tests.test_hub import COMMIT, DATA_COMMIT, DATA_ID, REPO_ID, add_snapshot, cache_dataset, hf_env

    hf_home = tmp_path / "hf_home"
    add_snapshot(hf_home, REPO_ID, root / "models" / "tiny", COMMIT, {"main": COMMIT})
    cache_dataset(hf_home, DATA_ID, root / "data" / "demo.jsonl", DATA_COMMIT)
    cmd = [sys.executable, "-m", "finetune.cli", "ui", "--root", str(root), "--port", "0"]
    with testing.Launched(cmd, REPO, testing.env(HF_HUB_OFFLINE="1", **hf_env(hf_home))) as server:
        assert server.wait(60, until=lambda: "http://" in server.output), server.output
        url = next(w for w in server.output.split() if w.startswith("http://"))

        def post(path, body):
            request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(request, timeout=120).read())

        plan = post("/api/plan", {"fields": fields(model_name_or_path=REPO_ID, dataset=DATA_ID), "name": "h"})
        assert "error" not in plan, plan
        assert shlex.split(plan["command"])[2:6] == ["--model_name_or_path", REPO_ID, "--dataset", DATA_ID]
        assert plan["plan"]["model"]["parameters"] == 138_304
        hub = post("/api/preview", {"model_name_or_path": REPO_ID, "dataset": DATA_ID, "n": 2})
        local = post("/api/preview", {"model_name_or_path": "models/tiny", "dataset": "data/demo.jsonl", "n": 2})
        assert [r["where"] for r in hub["records"]] == [f"{DATA_ID}@{DATA_COMMIT[:12]} row {i}" for i in (0, 1)]
        assert [(r["input_ids"], r["labels"]) for r in hub["records"]] == [
            (r["input_ids"], r["labels"]) for r in local["records"]]
        server.kill()
