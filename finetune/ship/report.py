"""A run folder's report: its curves and final metrics, as PNG, markdown and JSON (`finetune report OUTPUT_DIR`,
finetune/apps/report.py, and the push of a training run, whose model card shows the loss curve).

Reads the run's log_history (trainer_state.json of the final save, else of its newest checkpoint), the same on
all three training paths, and writes OUTPUT_DIR/report/: loss.png (training and eval loss per step),
learning_rate.png, tokens_per_second.png (when the run counted tokens), a curve for each group of metrics the
run's method logs (finetune.methods: DPO's rewards.png and logps.png), metrics.json and README.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

from finetune import methods

_STEP = re.compile(r"^checkpoint-(\d+)$")


class ReportError(Exception):
    pass


def find_state(output_dir: str | Path) -> tuple[Path, dict]:
    """(file, trainer state): the final save's, else the newest checkpoint's (a run still going, or stopped)."""
    out = Path(output_dir)
    if not out.is_dir():
        raise ReportError(f"{out}: no such folder (give a run's --output_dir)")
    candidates = [out / "trainer_state.json"]
    steps = sorted((int(m.group(1)), p) for p in out.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())
    for _, folder in reversed(steps):
        candidates += [folder / "trainer_state.json", folder / "finetune_position.json"]
    for path in candidates:
        if path.is_file():
            try:
                state = json.loads(path.read_text())
            except ValueError as e:
                raise ReportError(f"{path}: not valid JSON ({e})") from None
            if state.get("log_history"):
                return path, state
    raise ReportError(f"{out}: no trainer_state.json with a log history, here or in a checkpoint-N folder; "
                      "is it a finetune run's --output_dir?")


def series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(e["step"], e[key]) for e in history if isinstance(e.get(key), (int, float)) and "step" in e
             and not (key == "loss" and "train_loss" in e)]
    return [p[0] for p in pairs], [float(p[1]) for p in pairs]


def method_of(output_dir: str | Path):
    """The run's training method (finetune.methods), as its saved recipe names it (finetune_config.yaml)."""
    recipe = Path(output_dir) / "finetune_config.yaml"
    name = methods.DEFAULT
    if recipe.is_file():
        import yaml

        try:
            name = (yaml.safe_load(recipe.read_text()) or {}).get("method", name)
        except yaml.YAMLError:
            pass
    return methods.get(name) or methods.get(methods.DEFAULT)


def metric_groups(method) -> dict[str, list[str]]:
    """The metrics the method logs, by group (`rewards/chosen` is in `rewards`): one curve image per group."""
    groups: dict[str, list[str]] = {}
    for name in method.metrics:
        groups.setdefault(name.split("/")[0], []).append(name)
    return groups


def summary(state: dict, method=None) -> dict:
    """The final metrics: the last training window (with the method's own metrics), the last evaluation, the best
    one, the run's totals."""
    history = state["log_history"]
    train = [e for e in history if "loss" in e]
    evals = [e for e in history if "eval_loss" in e]
    end = next((e for e in reversed(history) if "train_loss" in e), {})
    out = {"global_step": state.get("global_step"), "max_steps": state.get("max_steps")}
    if train:
        out["train"] = {"first_loss": train[0]["loss"], "last_loss": train[-1]["loss"], "last_step": train[-1]["step"],
                        "learning_rate": train[-1].get("learning_rate")}
        tps = [e["train_tokens_per_second"] for e in train if "train_tokens_per_second" in e]
        if tps:
            out["train"]["tokens_per_second"] = tps[-1]
        if "num_input_tokens_seen" in train[-1]:
            out["train"]["tokens_seen"] = train[-1]["num_input_tokens_seen"]
        for name in getattr(method, "metrics", ()):
            if name in train[-1]:
                out["train"][name] = train[-1][name]
    if evals:
        out["eval"] = {k: v for k, v in evals[-1].items() if k.startswith("eval_") or k == "step"}
        out["eval"]["evaluations"] = len(evals)
    for key in ("best_metric", "best_global_step", "best_model_checkpoint"):
        if state.get(key) is not None:
            out.setdefault("best", {})[key] = state[key]
    if end:
        out["run"] = {k: end[k] for k in ("train_loss", "train_runtime", "train_samples_per_second", "epoch") if k in end}
    return out


def _plot(path: Path, title: str, ylabel: str, curves: list[tuple[str, list[int], list[float], str]], log: bool = False):
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for label, xs, ys, marker in curves:
        if xs:
            ax.plot(xs, ys, marker=marker, markersize=3, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    if log and all(y > 0 for _, _, ys, _ in curves for y in ys):
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len([c for c in curves if c[1]]) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else str(v)
    return str(v)


def markdown(source: Path, metrics: dict, images: list[str], run: Path) -> str:
    """The report's README. SOURCE (a file find_state found in the run folder RUN) is named relative to RUN: the
    report travels (a Hub push), and this machine's paths mean nothing there."""
    run = Path(run).resolve()
    shown = source.resolve().relative_to(run)
    lines = [f"# Run report: {run.name}",
             "", f"From the run folder's `{shown}` (step {metrics.get('global_step')} of {metrics.get('max_steps')}).",
             ""]
    titles = {"loss.png": "loss", "learning_rate.png": "learning rate", "tokens_per_second.png": "tokens per second"}
    for name in images:
        lines += [f"![{titles.get(name, name.removesuffix('.png'))}]({name})", ""]
    for section in ("train", "eval", "best", "run"):
        if section in metrics:
            lines += [f"## {section}", "", "| metric | value |", "|---|---|"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in metrics[section].items()]
            lines.append("")
    lines.append("All numbers: `metrics.json`.")
    return "\n".join(lines) + "\n"


def write_report(output_dir: str | Path, report_dir: str | Path | None = None) -> Path:
    """Write the report folder (staged, then renamed into place: complete or absent); returns it."""
    source, state = find_state(output_dir)
    report = Path(report_dir) if report_dir else Path(output_dir) / "report"
    history = state["log_history"]
    staging = report.parent / f".{report.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    images = []
    train_x, train_y = series(history, "loss")
    eval_x, eval_y = series(history, "eval_loss")
    if train_x or eval_x:
        _plot(staging / "loss.png", "loss", "loss (trained tokens)",
              [("train", train_x, train_y, "."), ("eval", eval_x, eval_y, "o")], log=True)
        images.append("loss.png")
    lr_x, lr_y = series(history, "learning_rate")
    if lr_x:
        _plot(staging / "learning_rate.png", "learning rate", "learning rate", [("learning rate", lr_x, lr_y, ".")])
        images.append("learning_rate.png")
    tps_x, tps_y = series(history, "train_tokens_per_second")
    if tps_x:
        _plot(staging / "tokens_per_second.png", "throughput", "input tokens / s (run average)",
              [("tokens/s", tps_x, tps_y, ".")])
        images.append("tokens_per_second.png")
    method = method_of(output_dir)
    for group, names in metric_groups(method).items():
        curves = [(f"{where} {name.split('/', 1)[-1]}", *series(history, prefix + name), marker)
                  for name in names for where, prefix, marker in (("train", "", "."), ("eval", "eval_", "o"))]
        if any(xs for _, xs, _, _ in curves):
            _plot(staging / f"{group}.png", f"{method.title}: {group}", group, curves)
            images.append(f"{group}.png")
    metrics = summary(state, method)
    (staging / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (staging / "README.md").write_text(markdown(source, metrics, images, run=Path(output_dir)))
    old = report.parent / f".{report.name}.old-{os.getpid()}"
    if report.exists():
        os.rename(report, old)
    os.rename(staging, report)
    shutil.rmtree(old, ignore_errors=True)
    return report
