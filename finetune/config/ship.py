"""What ships a run, checked with the other flags before anything loads: --report_to's trackers (known names,
installed, W&B's key or offline folder, MLflow's store usable, a tracking server that answers within seconds) and
--push_to_hub (the Trainer's hub flags). Without this a missing tracker fails at the Trainer's first callback, after
the model has loaded, a tracking server that does not answer costs minutes of retries there, and a push fails after
the whole run. A tracker that cannot be used stops the run here, before anything loads (docs/network.md)."""

from __future__ import annotations

import importlib.util
import netrc
import os
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

from finetune import network
from finetune.errors import did_you_mean

# The trackers tested here (docs/training.md 'Trackers'): the module --report_to X needs and how to get it.
TRACKERS = {"wandb": ("wandb", "pip install wandb"), "mlflow": ("mlflow", "pip install mlflow-skinny")}
EXTRA = "pip install 'finetune[trackers]'"
# --report_to's values: transformers' integrations (INTEGRATION_TO_CALLBACK in transformers/integrations/
# integration_utils.py, 5.24; tests/test_fail_fast.py compares), "all" and "none". Read here without importing
# transformers (seconds), so that a misspelt tracker is one line before anything loads.
INTEGRATIONS = ("azure_ml", "clearml", "codecarbon", "comet_ml", "dagshub", "dvclive", "flyte", "kubeflow", "mlflow",
                "neptune", "swanlab", "tensorboard", "trackio", "wandb")
WANDB_HOST = "https://api.wandb.ai"
# Hub flags that only mean something with --push_to_hub (TrainingArguments' names). --hub_token is not among them:
# a token in a shared recipe is not a mistake (and is never saved: finetune.config.training's resolved()).
HUB_FLAGS = ("hub_model_id", "hub_private_repo")


def report_to(value: Any) -> list[str]:
    """--report_to as the list TrainingArguments makes of it ("none" -> [], "all" stays "all")."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    items = [str(getattr(v, "value", v)) for v in items]
    return [] if items in ([], ["none"]) else items


def tracker_problems(value: Any, environ: Mapping[str, str] | None = None) -> list[str]:
    """--report_to's trackers, each usable before anything loads; their network calls get finetune.network's bound
    (MLflow's timeout and retries, unless the environment sets them)."""
    environ = os.environ if environ is None else environ
    names = report_to(value)
    problems = []
    for name in names:
        if name not in (*INTEGRATIONS, "all", "none"):
            problems.append(f"report_to: '{name}' is not a tracker{did_you_mean(name, [*INTEGRATIONS, 'all', 'none'])} "
                            f"(one of: {', '.join(INTEGRATIONS)}, all, none)")
        elif name in TRACKERS and importlib.util.find_spec(TRACKERS[name][0]) is None:
            problems.append(f"report_to: {name} is not installed; {TRACKERS[name][1]} (or {EXTRA})")
    if problems or not names:
        return problems
    problems += network.env_problems(environ)
    if environ is os.environ:
        network.bound_trackers(os.environ)
    # "all" is every installed integration, MLflow and W&B among them when they are installed.
    if ("mlflow" in names or "all" in names) and importlib.util.find_spec("mlflow") is not None:
        problems += mlflow_store_problems(environ) or mlflow_server_problems(environ)
    if ("wandb" in names or "all" in names) and importlib.util.find_spec("wandb") is not None:
        problems += wandb_problems(environ)
    return problems


def mlflow_server_problems(environ: Mapping[str, str]) -> list[str]:
    """An http(s) tracking URI asked once, within seconds: MLflow's own client would retry for minutes inside the
    first callback, after the model loaded, and end in a chain of tracebacks."""
    uri = environ.get("MLFLOW_TRACKING_URI", "")
    if urlparse(uri).scheme not in ("http", "https"):
        return []
    why = network.probe(uri, "/health")
    if why is None:
        return []
    return [f"report_to mlflow: MLFLOW_TRACKING_URI={uri} did not answer ({why}); start the tracking server or fix the "
            "URI (or MLFLOW_TRACKING_URI=file:./mlruns with MLFLOW_ALLOW_FILE_STORE=true, a local store)"]


def wandb_problems(environ: Mapping[str, str]) -> list[str]:
    """W&B: offline, a folder its run files can be written to; online, an API key and a server that answers."""
    mode = environ.get("WANDB_MODE", "").lower()
    if mode == "disabled" or environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return []
    if mode in ("offline", "dryrun"):
        folder = Path(environ.get("WANDB_DIR") or ".")
        if not _writable(folder):
            where = (f"WANDB_DIR={environ['WANDB_DIR']}" if environ.get("WANDB_DIR")
                     else f"the working folder {Path.cwd()}")
            return [f"report_to wandb: WANDB_MODE={mode} writes the run under {where}, which cannot be written; set "
                    "WANDB_DIR to a writable folder"]
        return []
    host = environ.get("WANDB_BASE_URL") or WANDB_HOST
    if not (environ.get("WANDB_API_KEY") or _netrc_key(host, environ)):
        return ["report_to wandb: no W&B API key; set WANDB_API_KEY (or run `wandb login`), or WANDB_MODE=offline to "
                "keep the run in ./wandb (`wandb sync` later)"]
    why = network.probe(host)
    if why is None:
        return []
    return [f"report_to wandb: {host} did not answer ({why}); check the network or WANDB_BASE_URL, or "
            "WANDB_MODE=offline to keep the run in ./wandb (`wandb sync` later)"]


def _netrc_key(host: str, environ: Mapping[str, str]) -> bool:
    """`wandb login` keeps the key in ~/.netrc (NETRC names another file), under the server's host name."""
    path = environ.get("NETRC") or str(Path(environ.get("HOME", str(Path.home()))) / ".netrc")
    try:
        return netrc.netrc(path).authenticators(urlparse(host).hostname or host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _writable(folder: Path) -> bool:
    """The folder, or the nearest one above it that exists, takes a new file (a path under a regular file does not)."""
    folder = folder.absolute()
    while not folder.exists():
        if folder.parent == folder:
            return False
        folder = folder.parent
    if not folder.is_dir():
        return False
    try:
        probe = folder / f".finetune-write-{os.getpid()}"
        probe.touch()
        probe.unlink()
        return True
    except OSError:
        return False


def mlflow_store_problems(environ: Mapping[str, str]) -> list[str]:
    """MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE is true, and its default store (sqlite) needs
    SQLAlchemy, which mlflow-skinny lacks: either fails inside the first callback, after the model loaded."""
    uri = environ.get("MLFLOW_TRACKING_URI", "")
    scheme = uri.split(":", 1)[0].lower() if "://" in uri or uri.startswith("file:") else ""
    allowed = environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")
    if uri and scheme in ("", "file") and not allowed:
        return [f"report_to mlflow: MLFLOW_TRACKING_URI={uri} is MLflow's file store, which MLflow 3 refuses unless "
                "MLFLOW_ALLOW_FILE_STORE=true; set that, or point MLFLOW_TRACKING_URI at a tracking server (http://...)"]
    database = not uri or scheme.split("+")[0] in ("sqlite", "postgresql", "mysql", "mssql")
    if database and importlib.util.find_spec("sqlalchemy") is None:
        where = f"MLFLOW_TRACKING_URI={uri}" if uri else "MLflow's default store (sqlite:///mlflow.db, MLFLOW_TRACKING_URI unset)"
        return [f"report_to mlflow: {where} needs SQLAlchemy, which mlflow-skinny lacks; pip install mlflow, or set "
                "MLFLOW_TRACKING_URI=file:./mlruns and MLFLOW_ALLOW_FILE_STORE=true (a local file store)"]
    return []


def hub_problems(training: Mapping[str, Any], sources: Mapping[str, str], environ: Mapping[str, str] | None = None,
                 prefix: str = "") -> list[str]:
    """--push_to_hub's flags: its companions without it, an offline Hub, and the Trainer's per-checkpoint pushes
    (a run pushes its verified final save once, in one commit)."""
    environ = os.environ if environ is None else environ
    problems = []
    if not training.get("push_to_hub"):
        given = [k for k in HUB_FLAGS if k in sources and training.get(k) is not None]
        if given:
            problems.append(f"{prefix}{given[0]}: goes with --push_to_hub (add it, or drop --{given[0]})")
        return problems
    problems += [f"{prefix}push_to_hub: {p}" for p in network.env_problems(environ)]
    if environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        problems.append(f"{prefix}push_to_hub: HF_HUB_OFFLINE={environ['HF_HUB_OFFLINE']} forbids the upload; unset "
                        "HF_HUB_OFFLINE to push")
    strategy = str(getattr(training.get("hub_strategy"), "value", training.get("hub_strategy") or "every_save"))
    if strategy not in ("every_save", "end"):
        problems.append(f"{prefix}hub_strategy: '{strategy}' pushes checkpoints; finetune pushes the verified final "
                        "model once, in one commit (drop --hub_strategy)")
    if training.get("hub_revision"):
        problems.append(f"{prefix}hub_revision: not supported; the push goes to the repo's main branch")
    return problems
