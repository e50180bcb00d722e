"""`finetune ui` in a real headless browser (Debian's Chromium, driven by Selenium): a whole tiny run from the page.

The server is the real command (`python -m finetune.cli ui --port 0`); the run it launches is a real `finetune train`
process. Steps: bad inputs show `finetune train`'s own message and the page's refusal of a path outside the root;
pick the tiny model and the bundled data; the plan and the command line appear; preview the records with the trained
tokens highlighted; launch; watch the loss to the end; chat with the result (the reply is `finetune generate`'s, token
for token). Screenshots of each screen are written under the test's tmp folder (path printed) and, with
FINETUNE_UI_SCREENSHOTS=DIR, copied there (docs/ui/ holds the committed ones).

Chromium and chromedriver come from Debian (scripts/setup.sh installs them); in CI (CI=true) their absence fails.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune import testing
from finetune.apps.ui_runs import parse_log
from finetune.models import tiny

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
STEPS = 40  # ~0.2 s a step: the run outlasts a starved poll (see the freeze below)

pytestmark = pytest.mark.slow


def _browser(downloads: Path):
    if not (CHROMIUM and CHROMEDRIVER):
        why = ("Chromium and chromedriver are not installed (Debian: apt-get install -y chromium chromium-driver; "
               "scripts/setup.sh does it as root)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why + ": CI must run the browser test")
        pytest.skip(why)
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1360,1500",
                "--disable-gpu", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def _wait(what: str, until, timeout: float = 60.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = until()
        except Exception:  # noqa: BLE001 - an element not there yet, a stale one: look again
            value = None
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"the page did not show {what} within {timeout:.0f} s")


def test_a_tiny_run_from_the_page(tmp_path):
    t0 = time.monotonic()
    root = tmp_path / "root"
    tiny.build(root / "models" / "tiny", style="chatml")
    (root / "data").mkdir()
    shutil.copy(REPO / "data" / "demo.jsonl", root / "data" / "demo.jsonl")
    (tmp_path / "outside").mkdir()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"\nscreenshots: {shots}")

    # What `finetune train` itself prints for a learning rate that is no number (started now, read later).
    bad_argv = ["--model_name_or_path", str(root / "models" / "tiny"), "--dataset", str(root / "data" / "demo.jsonl"),
                "--learning_rate", "abc"]
    cli_bad = subprocess.Popen([sys.executable, "-m", "finetune.cli", "train", *bad_argv], cwd=REPO,
                               env=testing.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cmd = [sys.executable, "-m", "finetune.cli", "ui", "--root", str(root), "--port", "0"]
    with testing.Launched(cmd, REPO, testing.env()) as server:
        assert server.wait(90, until=lambda: "http://" in server.output), server.output
        url = next(w for w in server.output.split() if w.startswith("http://"))
        driver = _browser(tmp_path / "downloads")
        try:
            _run_from_the_page(driver, url, root, shots, cli_bad, tmp_path / "downloads")
        finally:
            driver.quit()
            server.kill()
    target = os.environ.get("FINETUNE_UI_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        for png in shots.glob("*.png"):
            shutil.copy(png, Path(target) / png.name)
    print(f"browser test: {time.monotonic() - t0:.1f} s")


def _run_from_the_page(driver, url, root: Path, shots: Path, cli_bad: subprocess.Popen, downloads: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    t0 = time.monotonic()

    def step(what: str) -> None:
        print(f"  {time.monotonic() - t0:6.1f} s  {what}")

    def el(id_):
        return driver.find_element(By.ID, id_)

    def fill(id_, value):
        box = el(id_)
        box.clear()
        box.send_keys(value)

    driver.get(url)
    _wait("the model list", lambda: driver.find_elements(By.CSS_SELECTOR, "#models option"))
    options = [o.get_attribute("value") for o in driver.find_elements(By.CSS_SELECTOR, "#models option")]
    assert options == ["models/tiny"]
    assert "data/demo.jsonl" in [o.get_attribute("value") for o in driver.find_elements(By.CSS_SELECTOR,
                                                                                         "#datasets option")]

    # Bad inputs: a path outside the root is refused by the page; a bad value gets the CLI's own message.
    fill("model_name_or_path", "../outside")
    fill("dataset", "data/demo.jsonl")
    refusal = _wait("the refusal of ../outside", lambda: "outside the folders" in el("plan-error").text
                    and el("plan-error").text)
    assert refusal.startswith("--model_name_or_path ../outside: outside the folders this page may use")
    fill("model_name_or_path", "models/tiny")
    fill("learning_rate", "abc")
    out, err = cli_bad.communicate(timeout=120)
    assert cli_bad.returncode == 2, err
    expected = err.strip()
    assert "--learning_rate: expected a number, got 'abc'" in expected
    _wait("the CLI's message for --learning_rate abc", lambda: el("plan-error").text.strip() == expected)
    driver.save_screenshot(str(shots / "setup-bad-input.png"))
    step("bad inputs: the page's refusal and the CLI's message")

    # The tiny run's choices: the plan and the exact command line follow.
    fill("learning_rate", "1e-3")
    fill("max_seq_length", "128")
    fill("max_steps", str(STEPS))
    fill("save_steps", "8")
    fill("eval_split_size", "0.1")
    fill("run-name", "tiny-run")
    Select(el("method")).select_by_value("sft")
    _wait("the plan", lambda: el("plan-fits").text == "fits" and "tiny-run" in el("command").text)
    command = el("command").text
    model, data, out_dir = root / "models" / "tiny", root / "data" / "demo.jsonl", root / "runs" / "tiny-run"
    assert shlex.split(command) == [
        "finetune", "train", "--model_name_or_path", str(model), "--dataset", str(data), "--max_steps", str(STEPS),
        "--learning_rate", "1e-3", "--per_device_train_batch_size", "4", "--max_seq_length", "128",
        "--eval_split_size", "0.1", "--save_steps", "8", "--output_dir", str(out_dir),
        "--resume_from_checkpoint", "latest"]
    assert f"max_steps: {STEPS}" in el("recipe").text
    assert "total per device" in el("plan-bars").text
    el("copy-command").click()
    _wait("the copy", lambda: el("copy-command").text == "Copied", timeout=10)
    el("save-recipe").click()  # the recipe as a file, the same run as the command line (tests/test_ui.py)
    saved = _wait("the saved recipe", lambda: (downloads / "tiny-run.yaml").is_file() and
                  (downloads / "tiny-run.yaml").read_text(), timeout=20)
    assert saved == driver.execute_script("return document.getElementById('recipe').textContent")

    # Preview: the first record's trained tokens are its assistant reply and the end of turn.
    el("preview-btn").click()
    _wait("the preview", lambda: driver.find_elements(By.CSS_SELECTOR, "#preview .rec"))
    first = driver.find_elements(By.CSS_SELECTOR, "#preview .rec")[0]
    trained = "".join(s.get_attribute("textContent") for s in first.find_elements(By.CSS_SELECTOR, ".t.on"))
    record = json.loads((root / "data" / "demo.jsonl").read_text().splitlines()[0])
    assert trained == record["messages"][-1]["content"] + "<|im_end|>", trained
    _wait("the plan again", lambda: el("plan-fits").text == "fits")
    driver.save_screenshot(str(shots / "setup.png"))
    step("plan, command line, recipe, preview")

    # Launch, and watch the loss move to the end.
    el("launch").click()
    _wait("the run", lambda: el("run-title").text == "tiny-run" and el("run-status").text, timeout=30)
    # The run is frozen (SIGSTOP to its process group) once it has printed three steps: its 40 tiny steps take ~8 s,
    # which a loaded machine's page poll can miss entirely (the page then shows it finished); frozen, the live view
    # must show exactly the steps printed so far, as running.
    ui = root / "runs" / ".ui" / "tiny-run"
    pid = _wait("the run's pid", lambda: json.loads((ui / "run.json").read_text())["pid"], timeout=30)

    def printed() -> tuple[int, int | None]:
        parsed = parse_log((ui / "train.log").read_text())
        return len({s for s, e in parsed["entries"] if "loss" in e and "train_loss" not in e}), parsed["step"]

    _wait("three printed steps", lambda: printed()[0] >= 3, timeout=120, every=0.1)
    os.killpg(pid, signal.SIGSTOP)
    try:
        live, at = printed()
        assert 3 <= live < STEPS, live
        _wait(f"the {live} printed steps live", lambda: el("chart").find_element(By.TAG_NAME, "svg").get_attribute(
            "data-train") == str(live) and el("run-status").text == "running", timeout=60, every=0.5)
        assert el("run-progress").text == f"step {at} of {STEPS}"
        driver.save_screenshot(str(shots / "run-live.png"))
    finally:
        os.killpg(pid, signal.SIGCONT)
    step("launched: the loss moves")
    _wait("the run's end", lambda: el("run-status").text == "finished", timeout=180, every=0.5)
    _wait("the final curves", lambda: el("chart").find_element(By.TAG_NAME, "svg").get_attribute("data-train")
          == str(STEPS) and el("last-loss").text)
    state = json.loads((out_dir / "trainer_state.json").read_text())
    losses = [e["loss"] for e in state["log_history"] if "loss" in e]
    evals = [e for e in state["log_history"] if "eval_loss" in e]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert el("last-loss").text == f"{losses[-1]:.4f}"
    assert el("chart").find_element(By.TAG_NAME, "svg").get_attribute("data-eval") == str(len(evals)) != "0"
    assert el("run-progress").text == f"step {STEPS} of {STEPS}"
    el("report").click()
    _wait("the report's curves", lambda: len(driver.find_elements(By.CSS_SELECTOR, "#report-images img")) == 3 and
          driver.execute_script("return [...document.querySelectorAll('#report-images img')]"
                                ".every((i) => i.complete && i.naturalWidth > 600)"))
    assert (out_dir / "report" / "loss.png").is_file()
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(shots / "run-finished.png"))
    step("finished: final curves and report")

    # Chat with the result: the reply is `finetune generate`'s, token for token (sampled with seed 0: the tiny
    # model's greedy reply is its end-of-turn at once).
    prompt, max_new = "copy: city dog", 12
    gen = subprocess.Popen([sys.executable, "-m", "finetune.cli", "generate", "--model_name_or_path", str(out_dir),
                            "--prompt", prompt, "--chat", "--max_new_tokens", str(max_new), "--do_sample", "--seed",
                            "0", "--with_ids"], cwd=REPO, env=testing.env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    el("chat-with").click()
    _wait("the chat's run", lambda: Select(el("chat-run")).first_selected_option.text == "tiny-run")
    fill("max_new_tokens", str(max_new))
    el("do_sample").click()
    fill("chat-input", prompt)
    el("chat-send").click()
    reply = _wait("the reply", lambda: driver.find_elements(By.CSS_SELECTOR, "#chat-log .msg.assistant"), timeout=90)
    out, err = gen.communicate(timeout=180)
    assert gen.returncode == 0, err
    line = json.loads(out.strip().splitlines()[-1])
    note = reply[0].find_element(By.CLASS_NAME, "note").text
    shown = reply[0].get_attribute("textContent")[: -len(note)]
    assert line["completion_ids"], line  # a reply with tokens, so the comparison says something
    assert shown == line["completion"], (shown, line)
    assert note.startswith(f"{len(line['completion_ids'])} tokens, ended by {line['finish_reason']}")
    driver.save_screenshot(str(shots / "chat.png"))
    step("chat: the reply is finetune generate's")
