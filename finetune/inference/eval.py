"""`finetune eval`: lm-evaluation-harness tasks on a model, base and fine-tuned side by side.

    finetune eval --model_name_or_path BASE --adapter outputs/run/model --tasks finetune_quickstart
    finetune eval --model_name_or_path BASE --adapter RUN --tasks my_task --include_path my_tasks/   # local YAML
    finetune eval --model_name_or_path BASE --tasks hellaswag,arc_easy --limit 200                  # Hub data sets
    finetune eval --model_name_or_path BASE --finetuned outputs/full-run --tasks ...                # a full fine-tune

The model is loaded as `finetune generate` loads it (device maps, 8/4-bit) and handed to the harness' HFLM as a
model object. With --adapter, the adapter is applied with peft and every task runs twice on the one loaded model:
adapter layers off (the base) and on (fine-tuned). With --finetuned FOLDER, a second model folder is the fine-tuned
column. Results: OUTPUT_DIR/results.json (every metric, with its standard error, for each model) and
OUTPUT_DIR/results.md (a table: task, metric, base, fine-tuned, difference).

Tasks: the harness' own and YAML task definitions in --include_path folders, their data local files or Hugging Face
Hub data sets (downloaded online; with HF_HUB_OFFLINE=1 read from the datasets cache an online run left, a data set
missing there being one message), and the bundled `finetune_quickstart`: the
quickstart's held-out records (greedy completion through the chat template, exact match of the JSON answer,
surrounding whitespace aside, as the quickstart report scores it).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from finetune.inference.generate import GenerationError, ModelArgs, _flag

QUICKSTART_TASK = "finetune_quickstart"
# The quickstart's held-out records (package data of finetune.apps; read as a file, not imported: another layer).
QUICKSTART_HELDOUT = Path(__file__).resolve().parents[1] / "apps" / "quickstart_data" / "heldout.jsonl"


@dataclass
class EvalArgs(ModelArgs):
    """The model (and its fine-tuned form), the tasks, and where the results go"""

    adapter: str | None = _flag(help="LoRA adapter folder: the fine-tuned column (the base with it applied).")
    finetuned: str | None = _flag(help="A fine-tuned model folder (a full fine-tune) for the fine-tuned column.")
    tasks: str | None = _flag(help=f"Comma-separated task names: the harness' own, those of --include_path, or "
                                   f"{QUICKSTART_TASK}.", required=True)
    include_path: list[str] = _flag(list, help="A folder of task YAML files (with local data files). Repeatable.",
                                    repeat=True)
    limit: int | None = _flag(help="Examples per task, at most (the first N).")
    num_fewshot: int | None = _flag(help="Few-shot examples per prompt (default: each task's own).")
    batch_size: int = _flag(8, help="Requests per forward.")
    apply_chat_template: str = _flag("auto", help="Render prompts with the model's chat template: true, false, or auto "
                                                  "(when the tokenizer has one).")
    output_dir: str = _flag("outputs/eval", help="Where results.json and results.md go.")
    seed: int = _flag(0, help="Seed of the harness (few-shot sampling).")


def command():
    from finetune.config.parser import Command

    return Command("finetune eval", {"args": EvalArgs}, description="Run lm-evaluation-harness tasks on a model, "
                   "base and fine-tuned side by side.", epilog=__doc__.split("\n\n", 1)[1])


def check_args(parsed) -> list[str]:
    from finetune.config.training import writable_problem
    from finetune.inference.generate import model_problems

    args: EvalArgs = parsed.args
    problems = model_problems(args)
    if args.adapter and args.finetuned:
        problems.append("--adapter and --finetuned: choose one (an adapter over the base, or a fine-tuned folder)")
    for flag in ("adapter", "finetuned"):
        if getattr(args, flag) and not Path(getattr(args, flag)).is_dir():
            problems.append(f"--{flag} {getattr(args, flag)}: no such folder")
    for folder in args.include_path:
        if not Path(folder).is_dir():
            problems.append(f"--include_path {folder}: no such folder")
    if args.tasks is not None and not task_names(args.tasks):
        problems.append("--tasks: give at least one task name (comma-separated)")
    for flag in ("limit", "batch_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            problems.append(f"--{flag}: must be at least 1, got {getattr(args, flag)}")
    if args.apply_chat_template not in ("auto", "true", "false"):
        problems.append(f"--apply_chat_template: '{args.apply_chat_template}' is not one of auto, true, false")
    if problem := writable_problem("--output_dir", args.output_dir):
        problems.append(problem)
    return problems


def task_names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


# ----------------------------------------------------------------------------------------------
# The bundled task


def write_quickstart_task(folder: Path, tokenizer, records_file: Path = QUICKSTART_HELDOUT) -> Path:
    """The quickstart's held-out records as a harness task in `folder`: its data file (prompt, answer) and its YAML
    (data file by absolute path: the harness reads it relative to the working directory otherwise). The greedy budget
    is the quickstart's: the longest answer in tokens, plus 8."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for line in records_file.read_text(encoding="utf-8").splitlines():
        if line.strip():
            messages = json.loads(line)["messages"]
            rows.append({"prompt": messages[-2]["content"], "answer": messages[-1]["content"]})
    data = folder / f"{QUICKSTART_TASK}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    budget = max(len(tokenizer(r["answer"], add_special_tokens=False)["input_ids"]) for r in rows) + 8
    (folder / f"{QUICKSTART_TASK}.yaml").write_text(f"""task: {QUICKSTART_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data.resolve()))}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: []
  do_sample: false
  max_gen_toks: {budget}
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]
metadata:
  version: 1.0
""", encoding="utf-8")
    return folder


# ----------------------------------------------------------------------------------------------
# Running the harness


_MANAGERS: dict = {}


def task_manager(tasks: list[str], include: list[str]):
    """The harness' TaskManager that knows `tasks`: the --include_path folders' alone where they hold every task
    (indexing the harness' own 14k task files took 65 s on 2 busy cores), else with the harness' own; unknown names
    raise GenerationError."""
    from lm_eval.tasks import TaskManager

    manager = None
    for defaults in (False, True):
        key = (tuple(include), defaults)
        if key not in _MANAGERS:
            _MANAGERS[key] = TaskManager(include_path=include or None, include_defaults=defaults)
        manager = _MANAGERS[key]
        if all(t in manager.all_tasks for t in tasks):
            return manager
    unknown = [t for t in tasks if t not in manager.all_tasks]
    from finetune.errors import did_you_mean

    raise GenerationError(f"--tasks: no task named {', '.join(repr(t) for t in unknown)}"
                          f"{did_you_mean(unknown[0], list(manager.all_tasks))} (the harness' own tasks, those of "
                          f"--include_path folders, or {QUICKSTART_TASK})")


def harness(model, tokenizer, tasks: list[str], *, include: list[str], limit: int | None = None,
            num_fewshot: int | None = None, batch_size: int = 8, chat: bool = True, seed: int = 0) -> dict:
    """The harness' results of `tasks` on a loaded model: {task: {metric: value, metric_stderr: value, ...}}."""
    import logging

    from datasets.exceptions import DatasetNotFoundError
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = task_manager(tasks, include)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    try:
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                              apply_chat_template=chat, log_samples=False, random_seed=seed, numpy_random_seed=seed,
                              torch_random_seed=seed, fewshot_random_seed=seed, bootstrap_iters=1000)
    except (ConnectionError, DatasetNotFoundError) as e:  # a task's Hub data set (datasets.load_dataset)
        raise GenerationError(hub_data_problem(tasks, e)) from None
    results = {}
    for task, metrics in out["results"].items():
        results[task] = {k.split(",")[0] + ("_stderr" if "_stderr" in k else ""): v for k, v in metrics.items()
                         if isinstance(v, (int, float)) and k != "alias" and "," in k}
        results[task] = {k.replace("_stderr_stderr", "_stderr"): v for k, v in results[task].items()}
        results[task]["samples"] = out.get("n-samples", {}).get(task, {}).get("effective")
    return results


def hub_data_problem(tasks: list[str], error: Exception) -> str:
    """One line for a task whose Hub data set could not be read: offline and not cached, unreachable, or not there."""
    import datasets
    from huggingface_hub import constants

    said = str(error).splitlines()[0]
    if isinstance(error, ConnectionError) and constants.HF_HUB_OFFLINE:
        fix = (f"it is not in the datasets cache ({datasets.config.HF_DATASETS_CACHE}) and HF_HUB_OFFLINE=1 forbids "
               "downloading; unset HF_HUB_OFFLINE to download it, or point HF_HOME at a cache that holds it")
    elif isinstance(error, ConnectionError):
        fix = "the Hub cannot be reached; check the network, HF_ENDPOINT and any proxy"
    else:
        fix = "check the task's dataset_path and dataset_name; if the data set is private or gated, set HF_TOKEN"
    return f"--tasks {','.join(tasks)}: a task's data set could not be read ({said}): {fix}"


def table(results: dict[str, dict], labels: list[str]) -> str:
    """Markdown: one row per task and metric, a column per model, and the difference of the last two."""
    head = "| task | metric | " + " | ".join(labels) + (" | difference |" if len(labels) == 2 else " |")
    lines = [head, "|" + "---|" * (len(labels) + 2 + (len(labels) == 2))]
    first = results[labels[0]]
    for task in sorted(first):
        for metric, value in first[task].items():
            if metric.endswith("_stderr") or metric == "samples" or not isinstance(value, (int, float)):
                continue
            cells = []
            for label in labels:
                v = results[label][task].get(metric)
                err = results[label][task].get(f"{metric}_stderr")
                cells.append(f"{v:.4f}" + (f" ± {err:.4f}" if isinstance(err, (int, float)) else ""))
            diff = (f" | {results[labels[1]][task][metric] - value:+.4f}" if len(labels) == 2 else "")
            lines.append(f"| {task} | {metric} | " + " | ".join(cells) + diff + " |")
    return "\n".join(lines) + "\n"


def run(args: EvalArgs, log=None) -> dict:
    import torch

    from finetune.inference.generate import load_for_inference, load_options, use_adapter

    log = log or (lambda *a: print(*a, file=sys.stderr, flush=True))
    os.environ.setdefault("HF_DATASETS_TRUST_REMOTE_CODE", "false")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks = task_names(args.tasks)
    # The task names are checked before the weights load (the bundled task is written once the tokenizer is there).
    task_manager([t for t in tasks if t != QUICKSTART_TASK], list(args.include_path))
    opts = load_options(args, args.adapter)
    model, tokenizer, _ = load_for_inference(opts, log=log)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    include = list(args.include_path)
    if QUICKSTART_TASK in tasks:
        include.append(str(write_quickstart_task(out / "tasks", tokenizer)))
    chat = {"auto": bool(getattr(tokenizer, "chat_template", None)), "true": True, "false": False}[args.apply_chat_template]
    common = dict(include=include, limit=args.limit, num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                  chat=chat, seed=args.seed)
    results: dict[str, dict] = {}
    if args.adapter:
        use_adapter(base, None)
        results["base"] = harness(base, tokenizer, tasks, **common)
        use_adapter(base, "default")
        results["fine-tuned"] = harness(base, tokenizer, tasks, **common)
    else:
        results["base"] = harness(base, tokenizer, tasks, **common)
    if args.finetuned:
        del model, base
        tuned, tuned_tok, _ = load_for_inference(load_options(with_model(args, args.finetuned)), log=log)
        results["fine-tuned"] = harness(tuned, tuned_tok, tasks, **common)
    labels = list(results)
    report = {"model": str(opts.model_name_or_path), "adapter": args.adapter, "finetuned": args.finetuned,
              "tasks": tasks, "limit": args.limit, "chat_template": chat, "results": results,
              "torch": torch.__version__}
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    text = table(results, labels)
    (out / "results.md").write_text(f"# lm-evaluation-harness: `{opts.model_name_or_path}`"
                                    + (f" with `{args.adapter}`" if args.adapter else "")
                                    + (f" against `{args.finetuned}`" if args.finetuned else "") + "\n\n" + text)
    print(text, end="", flush=True)
    log(f"finetune eval: {out / 'results.md'}, {out / 'results.json'}")
    return report


def with_model(args: EvalArgs, folder: str) -> EvalArgs:
    """The same load flags with another model folder."""
    from dataclasses import replace

    return replace(args, model_name_or_path=folder, adapter=None, finetuned=None)


def main(argv: list[str] | None = None) -> None:
    args = command().parse_or_exit(argv, check_args).args
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from finetune.inference.generate import _quiet_libraries

    _quiet_libraries()
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("finetune eval: lm-evaluation-harness is not installed: pip install 'finetune[eval]'", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        run(args)
    except GenerationError as e:
        print(f"finetune eval: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
