"""`finetune score`: the rewards a reward model (a `finetune train --method reward` run: a full model or a LoRA
adapter with its score head) gives prompt/completion records or preference pairs.

    finetune score --model_name_or_path RUN --dataset pairs.jsonl       # {prompt, chosen, rejected}: both rewards
    finetune score --model_name_or_path RUN --dataset answers.jsonl     # {prompt, completion}: its reward

Records are tokenized, truncated and padded as training took them (finetune.data.preference: the chat template of
the run's tokenizer, the prompt rendered as at inference, the completion after it) and scored in batches. One JSON
line per record (to stdout or --output); for pairs the last line on stderr is the accuracy: the share of pairs whose
chosen completion gets the higher reward.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ScoreError(Exception):
    """A user mistake: one line, exit 2."""


def _flag(default: Any = None, help: str = "", **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class ScoreArgs:
    """The reward model, the records, and how to batch them"""

    model_name_or_path: str | None = _flag(help="A reward model: the output folder of finetune train --method reward "
                                                "(a full model, or a LoRA adapter on its base).", required=True,
                                           aliases=("model",))
    dataset: str | None = _flag(help="JSONL file of pairs {prompt, chosen, rejected} or of completions {prompt, "
                                     "completion} (strings or messages).", required=True)
    output: str | None = _flag(help="Write the JSON lines here (default: stdout).")
    batch_size: int = _flag(8, help="Records per forward (a pair is two rows).")
    max_seq_length: int = _flag(1024, help="Truncate as training did (its --max_seq_length).")
    torch_dtype: str = _flag("float32", help="float32, bfloat16, float16.")
    trust_remote_code: bool = _flag(False, help="Run Python code shipped with the model folder.")


def command():
    from finetune.config.parser import Command

    return Command("finetune score", {"args": ScoreArgs}, description="Score completions with a reward model.",
                   epilog=__doc__.split("\n\n", 1)[1])


def check_args(parsed) -> list[str]:
    """The flags' own problems, all at once, before anything loads."""
    args: ScoreArgs = parsed.args
    problems = []
    for key in ("batch_size", "max_seq_length"):
        if getattr(args, key) < 1:
            problems.append(f"--{key}: must be at least 1, got {getattr(args, key)}")
    if args.torch_dtype not in ("float32", "bfloat16", "float16"):
        problems.append(f"--torch_dtype: '{args.torch_dtype}' is not one of float32, bfloat16, float16")
    if args.model_name_or_path and not Path(args.model_name_or_path).is_dir():
        problems.append(f"--model_name_or_path {args.model_name_or_path}: no such folder")
    if args.dataset and not Path(args.dataset).is_file():
        problems.append(f"--dataset {args.dataset}: no such file")
    if args.output and Path(args.output).is_dir():
        problems.append(f"--output {args.output}: is a folder; give a file name for the JSON lines")
    return problems


# ----------------------------------------------------------------------------------------------
# Records -> features (before any weights load: a bad record is one line naming file and line).


def read_records(path: str) -> list[tuple[dict, str]]:
    """(record, "file:line") of every non-blank line."""
    from finetune.data.prepare import DataError

    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{where}: not UTF-8 text; save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
            out.append((record, where))
    if not out:
        raise DataError(f"{path}: no records")
    return out


def features(tokenizer, records: list[tuple[dict, str]], max_len: int) -> tuple[str, list[dict]]:
    """("pairs" or "completions", the records' features for PairCollator: a completion is the chosen side of a
    one-sided feature). One kind per file: a mixed file is refused at its first odd line."""
    from finetune.data.prepare import DataError
    from finetune.data.preference import PAIR_COLUMNS, pair_features, tokenize_completion, truncate_pair

    kind = "pairs" if "chosen" in records[0][0] or "rejected" in records[0][0] else "completions"
    out = []
    for record, where in records:
        if ("chosen" in record or "rejected" in record) != (kind == "pairs"):
            raise DataError(f"{where}: a {'completion' if kind == 'pairs' else 'pair'} in a file of {kind} (line 1 "
                            "sets the kind); score pairs and completions in separate files")
        if kind == "pairs":
            out.append(dict(zip(PAIR_COLUMNS, pair_features(tokenizer, record, where, max_len)[0])))
        else:
            prompt, ids, labels = tokenize_completion(tokenizer, record, where)
            prompt, ((ids, labels),), _ = truncate_pair(prompt, [(ids, labels)], max_len)
            out.append({"prompt_ids": prompt, "chosen_ids": ids, "chosen_labels": labels})
    return kind, out


def collate_rows(pad_token_id: int, batch: list[dict]) -> dict:
    """Completions: right-padded rows, as PairCollator pads a pair's (one side only)."""
    import torch

    length = max(len(f["prompt_ids"]) + len(f["chosen_ids"]) for f in batch)
    ids = torch.full((len(batch), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for i, f in enumerate(batch):
        row = list(f["prompt_ids"]) + list(f["chosen_ids"])
        ids[i, :len(row)] = torch.as_tensor(row)
        mask[i, :len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask}


# ----------------------------------------------------------------------------------------------
# The model.


def reward_task(folder: str) -> tuple[str, dict]:
    """(task, base arguments) of a reward-model folder (finetune.models.load.saved_task); anything else is a
    ScoreError. Reads config files only."""
    from finetune.methods.reward import Reward
    from finetune.models.load import saved_task

    task, head_kwargs = saved_task(folder)
    if task != Reward.task:
        raise ScoreError(f"--model_name_or_path {folder}: not a reward model (no sequence-classification head in its "
                         "config.json or adapter_config.json); train one with finetune train --method reward")
    return task, head_kwargs


def load_reward_model(folder: str, dtype: str, trust_remote_code: bool):
    """(model in eval mode, tokenizer) of a reward-model folder: a *ForSequenceClassification model, or a SEQ_CLS
    LoRA adapter on its base (finetune.models.load.saved_task). Anything else is a ScoreError."""
    import torch
    import transformers

    from finetune.models.load import DTYPE_NAMES, TASKS, ensure_pad_token, quiet_load_report

    task, head_kwargs = reward_task(folder)
    auto = TASKS[task][0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "right"
    ensure_pad_token(tokenizer)
    kwargs = dict(dtype=DTYPE_NAMES[dtype], trust_remote_code=trust_remote_code)
    adapter = Path(folder) / "adapter_config.json"
    if adapter.is_file():
        from peft import PeftModel

        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        if not base or not Path(base).is_dir():
            raise ScoreError(f"--model_name_or_path {folder}: the adapter's base model {base!r} is not a local folder")
        with quiet_load_report():  # the base has no score head: the adapter's own (modules_to_save) replaces it
            model = getattr(transformers, auto).from_pretrained(base, **head_kwargs, **kwargs)
        from finetune.compat import quiet_checkpointing_alias

        with quiet_checkpointing_alias():
            model = PeftModel.from_pretrained(model, folder, is_trainable=False)
    else:
        model = getattr(transformers, auto).from_pretrained(folder, **kwargs)
    config = model.config.get_text_config()
    if config.pad_token_id is None:  # the head reads each row at its last non-pad token: batches need the pad id
        config.pad_token_id = tokenizer.pad_token_id
    if torch.cuda.is_available():
        model.to("cuda")
    return model.eval(), tokenizer


def rewards(model, rows: dict):
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=rows["input_ids"].to(device), attention_mask=rows["attention_mask"].to(device),
                    use_cache=False)
    return out.logits.squeeze(-1).float().cpu()


def score(model, tokenizer, kind: str, feats: list[dict], batch_size: int, emit=None) -> list[dict]:
    """One result per record: {"reward"} of a completion, {"chosen_reward", "rejected_reward", "margin", "correct"}
    of a pair."""
    from finetune.data.preference import PairCollator

    results = []
    for start in range(0, len(feats), batch_size):
        part = feats[start:start + batch_size]
        if kind == "pairs":
            chosen, rejected = rewards(model, PairCollator(tokenizer.pad_token_id)(part)).double().chunk(2)
            new = [{"chosen_reward": c, "rejected_reward": r, "margin": c - r, "correct": c > r}
                   for c, r in zip(chosen.tolist(), rejected.tolist())]
        else:
            new = [{"reward": r} for r in rewards(model, collate_rows(tokenizer.pad_token_id, part)).double().tolist()]
        for i, result in enumerate(new, start=start):
            result = {"index": i, **result}
            results.append(result)
            if emit is not None:
                emit(result)
    return results


def summary(kind: str, results: list[dict]) -> str:
    n = len(results)
    if kind == "pairs":
        right = sum(r["correct"] for r in results)
        margin = sum(r["margin"] for r in results) / n
        return f"accuracy {right / n:.4f} ({right} of {n} pairs: chosen rewarded above rejected); mean margin {margin:.6f}"
    return f"scored {n} completion(s); mean reward {sum(r['reward'] for r in results) / n:.6f}"


def parse_args(argv: list[str] | None = None) -> ScoreArgs:
    return command().parse_or_exit(argv, check_args).args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        run(args)
    except ScoreError as e:
        print(f"finetune score: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run(args: ScoreArgs) -> list[dict]:
    from types import SimpleNamespace

    from finetune.data.prepare import DataError

    if problems := check_args(SimpleNamespace(args=args)):
        raise ScoreError("; ".join(problems))
    from transformers import AutoTokenizer

    from finetune.models.load import ensure_pad_token

    reward_task(args.model_name_or_path)
    # The records first, with the run's tokenizer alone: a bad line ends here, before any weights load.
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    ensure_pad_token(tokenizer)
    try:
        kind, feats = features(tokenizer, read_records(args.dataset), args.max_seq_length)
    except DataError as e:
        raise ScoreError(str(e)) from None
    model, tokenizer = load_reward_model(args.model_name_or_path, args.torch_dtype, args.trust_remote_code)
    out = open(args.output, "w") if args.output else sys.stdout

    def emit(result: dict) -> None:
        out.write(json.dumps(result) + "\n")
        out.flush()

    try:
        results = score(model, tokenizer, kind, feats, args.batch_size, emit)
    finally:
        if args.output:
            out.close()
    print(summary(kind, results), file=sys.stderr, flush=True)
    return results


if __name__ == "__main__":
    main()
