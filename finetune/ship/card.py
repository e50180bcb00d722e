"""The model card pushed with a model (README.md): YAML front matter the Hub reads (base_model and the exact commit
tuned, data sets, library, tags), then the method, the final metrics, the loss curve (the `finetune report` image
when the run folder has one, and a table of the logged losses) and the flags that reproduce the run.

Everything is read from the run's own files (finetune_config.yaml, trainer_state.json, config.json,
adapter_config.json), so a card made at the end of training and one made by `finetune export` from the same run
folder say the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from finetune.data.sources import looks_like_dataset_id
from finetune.models.hub import looks_like_repo_id

FINGERPRINT_PREFIX = "# finetune run fingerprint: "
TABLE_ROWS = 20  # the loss table's rows at most: evenly spaced logged steps, the last always among them
REPORT_IMAGE = "report/loss.png"  # `finetune report`'s loss curve, pushed with the model when it exists


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_run(folder: Path | None) -> dict[str, Any]:
    """What a card says, from a run folder (a final save, an adapter, an export's folder): {} parts where absent."""
    if folder is None or not Path(folder).is_dir():
        return {"recipe": {}, "state": {}, "config": {}, "adapter": {}}
    folder = Path(folder)
    recipe = {}
    if (folder / "finetune_config.yaml").is_file():
        recipe = yaml.safe_load((folder / "finetune_config.yaml").read_text()) or {}
    return {"recipe": recipe, "state": _json(folder / "trainer_state.json"), "config": _json(folder / "config.json"),
            "adapter": _json(folder / "adapter_config.json")}


def base_model(run: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the base model, its revision): the Hub repo and commit recorded at training (config.json's
    finetune_base_model, the adapter's base_model_name_or_path and revision, the recipe), else the local folder."""
    config, adapter, recipe = run["config"], run["adapter"], run["recipe"]
    for name, revision in ((config.get("finetune_base_model"), config.get("finetune_base_revision")),
                           (adapter.get("base_model_name_or_path"), adapter.get("revision")),
                           (recipe.get("model_name_or_path"), recipe.get("model_revision"))):
        if name and looks_like_repo_id(name):
            return name, revision
    local = recipe.get("model_name_or_path") or adapter.get("base_model_name_or_path")
    return local, None


def datasets(run: dict[str, Any]) -> list[str]:
    names = run["recipe"].get("dataset") or []
    return [names] if isinstance(names, str) else list(names)


def final_metrics(state: dict) -> dict[str, Any]:
    """The run's last logged values: the last training loss, the last evaluation's metrics, the closing entry's
    train_loss and runtime, and the step reached."""
    history = state.get("log_history") or []
    out: dict[str, Any] = {}
    if "global_step" in state:
        out["global_step"] = state["global_step"]
    last_loss = next((e for e in reversed(history) if "loss" in e), None)
    if last_loss is not None:
        out["loss"] = last_loss["loss"]
    last_eval = next((e for e in reversed(history) if any(k.startswith("eval_") for k in e)), None)
    if last_eval is not None:
        out.update({k: v for k, v in last_eval.items() if k.startswith("eval_") and not k.endswith(
            ("_runtime", "_per_second"))})
    closing = next((e for e in reversed(history) if "train_loss" in e), None)
    if closing is not None:
        out.update({k: closing[k] for k in ("train_loss", "train_runtime") if k in closing})
    return out


def loss_table(state: dict) -> list[str]:
    history = state.get("log_history") or []
    rows = [e for e in history if "loss" in e or "eval_loss" in e]
    if not rows:
        return []
    if len(rows) > TABLE_ROWS:
        keep = {round(i * (len(rows) - 1) / (TABLE_ROWS - 1)) for i in range(TABLE_ROWS)}
        rows = [r for i, r in enumerate(rows) if i in keep]
    evals = any("eval_loss" in r for r in rows)
    lines = ["| step | loss |" + (" eval_loss |" if evals else ""), "|---:|---:|" + ("---:|" if evals else "")]
    for r in rows:
        cells = [str(r.get("step", "")), _fmt(r.get("loss"))] + ([_fmt(r.get("eval_loss"))] if evals else [])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fmt(v: Any) -> str:
    return "" if v is None else str(v)  # a float's shortest exact form: the card's numbers are trainer_state.json's


def model_card(run_folder: Path | None, pushed: list[str], *, what: str, repo_id: str = "") -> str:
    """README.md for a push: `run_folder` holds the run's files (see read_run), `pushed` the repo paths of the files
    in the same commit, `what` a few words on what they are ("model", "LoRA adapter", "GGUF file (q8_0)")."""
    run = read_run(run_folder)
    recipe = run["recipe"]
    base, revision = base_model(run)
    data = datasets(run)
    hub_data = [d for d in data if looks_like_dataset_id(d)]
    method = recipe.get("method", "sft")
    adapter = "adapter_config.json" in pushed  # what is pushed: an adapter, or a model (merged from one or not)
    lora = adapter or bool(recipe.get("use_peft"))
    gguf = any(p.endswith(".gguf") for p in pushed)
    meta: dict[str, Any] = {}
    if base and looks_like_repo_id(base):
        meta["base_model"] = base
        if revision:
            meta["base_model_revision"] = revision
    if hub_data:
        meta["datasets"] = hub_data
    meta["library_name"] = "gguf" if gguf else "peft" if adapter else "transformers"
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = ["finetune", method] + (["lora"] if lora else []) + (["gguf"] if gguf else [])
    metrics = final_metrics(run["state"])
    if metrics:
        meta["finetune_metrics"] = metrics

    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
             f"# {repo_id or what}", "", f"The {what}, fine-tuned with finetune: method `{method}`" +
             (", LoRA" if lora else ", full fine-tuning" if recipe else "") + "."]
    if base:
        lines.append(f"- base model: `{base}`" + (f" at revision `{revision}`" if revision else "")
                     + ("" if looks_like_repo_id(base) else " (a local folder)"))
    for d in data:
        lines.append(f"- data set: `{d}`" + ("" if looks_like_dataset_id(d) else " (a local file)"))
    lines.append(f"- files: {', '.join(f'`{p}`' for p in sorted(pushed))}")
    if metrics:
        lines += ["", "## Final metrics", "", "| metric | value |", "|---|---:|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in metrics.items()]
    table = loss_table(run["state"])
    if table or REPORT_IMAGE in pushed:
        lines += ["", "## Loss", ""]
        if REPORT_IMAGE in pushed:
            lines += [f"![loss]({REPORT_IMAGE})", ""]
        lines += table
    if recipe:
        flags = {k: v for k, v in recipe.items()}
        lines += ["", "## Flags", "", "The run's finetune_config.yaml (`finetune train --recipe` reruns it):", "",
                  "```yaml", yaml.safe_dump(flags, sort_keys=False).rstrip(), "```"]
    return "\n".join(lines) + "\n"
