"""What ships a run, checked with the other flags before anything loads: --report_to's trackers (installed, and
MLflow's store usable) and --push_to_hub (the Trainer's hub flags). Without this a missing tracker fails at the
Trainer's first callback, after the model has loaded, and a push fails after the whole run."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Mapping

# The trackers tested here (docs/training.md 'Trackers'): the module --report_to X needs and how to get it.
TRACKERS = {"wandb": ("wandb", "pip install wandb"), "mlflow": ("mlflow", "pip install mlflow-skinny")}
EXTRA = "pip install 'finetune[trackers]'"
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


def tracker_problems(value: Any, environ: Mapping[str, str] = os.environ) -> list[str]:
    names = report_to(value)
    problems = []
    for name in names:
        if name in TRACKERS and importlib.util.find_spec(TRACKERS[name][0]) is None:
            problems.append(f"report_to: {name} is not installed; {TRACKERS[name][1]} (or {EXTRA})")
    # "all" is every installed integration, MLflow among them when it is installed.
    if ("mlflow" in names or "all" in names) and importlib.util.find_spec("mlflow") is not None:
        problems += mlflow_store_problems(environ)
    return problems


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


def hub_problems(training: Mapping[str, Any], sources: Mapping[str, str], environ: Mapping[str, str] = os.environ,
                 prefix: str = "") -> list[str]:
    """--push_to_hub's flags: its companions without it, an offline Hub, and the Trainer's per-checkpoint pushes
    (a run pushes its verified final save once, in one commit)."""
    problems = []
    if not training.get("push_to_hub"):
        given = [k for k in HUB_FLAGS if k in sources and training.get(k) is not None]
        if given:
            problems.append(f"{prefix}{given[0]}: goes with --push_to_hub (add it, or drop --{given[0]})")
        return problems
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
