"""Evaluation while training (finetune/training/evaluate.py), the report (finetune/ship/report.py; its command,
finetune/apps/report.py), and the flags.

Fast: the eval shards cover every sample once on any world size, and the summed eval loss of W simulated ranks
is the whole set's token-normalized loss (not a mean of batch means); a sample counted twice is refused; the
seeded split is disjoint and reproducible; prompts and answers of tokenized records; the best-model and early
stopping decisions equal transformers' own (EarlyStoppingCallback, Trainer._determine_best_metric); the flags'
mistakes; TensorBoard event files read back with tensorboard's reader; `finetune report` on a run folder.

Slow: the best model and early stopping on the three paths under ZeRO-3 (2 processes), with a held-out split,
--eval_generate, a user metric and --report_to tensorboard; eval losses equal across the paths, the saved model
is the best checkpoint's (its eval loss, recomputed here, is the logged best).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune import config as C
from finetune.apps import report
from finetune.data.prepare import IGNORE_INDEX, Collator, tokenize_record
from finetune.models import tiny
from finetune.training import evaluate, examples
from launch import ENGINE, LOOP, TRAIN, deepspeed_launcher, launcher, matrix, run, tiny_job


# ----------------------------------------------------------------------------------------------
# The eval loss.


@pytest.mark.parametrize("n", [1, 2, 13, 37])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_cover_every_sample_once(n, world):
    got = sorted(i for r in range(world) for i in evaluate.shard(n, world, r))
    assert got == list(range(n))


@pytest.fixture(scope="module")
def eval_records(tiny_chatml):
    from transformers import AutoTokenizer

    from finetune.models.load import ensure_pad_token

    tok = AutoTokenizer.from_pretrained(tiny_chatml)
    ensure_pad_token(tok)
    examples = []
    for record in tiny.synthetic_records(13, seed=3):
        ids, labels = tokenize_record(tok, record, "messages", True)
        examples.append({"input_ids": ids, "labels": labels})
    return tok, examples


def _whole_set_loss(model, examples) -> float:
    """By hand: every trained token's cross-entropy, summed over the set, over the set's trained tokens."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for e in examples:
            logits = model(input_ids=torch.tensor([e["input_ids"]])).logits[0, :-1].double()
            labels = torch.tensor(e["labels"][1:])
            keep = labels != IGNORE_INDEX
            total += torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
            tokens += int(keep.sum())
    return total / tokens


@pytest.fixture(scope="module")
def tiny_model(tiny_chatml):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_chatml, dtype=torch.float32).eval()


@pytest.mark.parametrize("world,batch", [(1, 4), (2, 3), (3, 4), (4, 5)])
def test_eval_loss_is_the_whole_sets_token_mean(world, batch, eval_records, tiny_model, one_thread):
    tok, examples = eval_records
    model = tiny_model
    es = evaluate.EvalSet(examples, tok, batch)
    forward = evaluate.model_forward(model)
    with torch.no_grad():
        sums = sum(evaluate.rank_sums(forward, es, "cpu", world, r) for r in range(world))
    got = evaluate.finish(sums, len(examples))
    expected = _whole_set_loss(model, examples)
    assert got["samples"] == 13 and got["tokens"] == sum(sum(x != IGNORE_INDEX for x in e["labels"][1:]) for e in examples)
    assert abs(got["loss"] - expected) <= 1e-6 * expected, (got, expected)
    assert got["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    # What a mean of batch means would give differs (records have different numbers of trained tokens).
    with torch.no_grad():
        means = [forward(Collator(tok.pad_token_id)(examples[i:i + 4])).item()
                 / sum(sum(x != IGNORE_INDEX for x in e["labels"][1:]) for e in examples[i:i + 4])
                 for i in range(0, 13, 4)]
    assert abs(sum(means) / len(means) - expected) > 1e-3
    # A sample counted twice (a rank's share added again) or lost is refused, not averaged in.
    with pytest.raises(RuntimeError, match="counted twice or lost"):
        evaluate.finish(sums + evaluate.rank_sums(forward, es, "cpu", world, world - 1), len(examples))


def test_split_is_seeded_and_disjoint():
    train, held = examples.split_indices(100, 0.05, seed=1234)
    assert len(held) == 5 and len(train) == 95 and sorted(train + held) == list(range(100))
    assert examples.split_indices(100, 0.05, seed=1234) == (train, held)  # reproducible
    assert examples.split_indices(100, 0.05, seed=1)[1] != held  # the seed matters
    assert len(examples.split_indices(100, 7, seed=0)[1]) == 7  # a count of records
    for bad in (0.001, 100, 1000):
        with pytest.raises(ValueError, match="at least one on each side"):
            examples.split_indices(100, bad, seed=0)


def test_prompt_and_answer(eval_records):
    tok, examples = eval_records
    record = tiny.synthetic_records(13, seed=3)[0]
    prompt, answer = evaluate.prompt_and_answer(examples[0])
    assert prompt + answer == examples[0]["input_ids"][:len(prompt) + len(answer)]
    assert tok.decode(answer, skip_special_tokens=True).strip() == record["messages"][-1]["content"].strip()
    assert all(x == IGNORE_INDEX for x in examples[0]["labels"][1:len(prompt)])
    assert evaluate.exact_match(" a b\n", "a b") and not evaluate.exact_match("a  b", "a b")


# ----------------------------------------------------------------------------------------------
# The best model and early stopping: transformers' decisions.


@pytest.mark.parametrize("greater,patience,threshold", [(False, 2, 0.0), (True, 1, 0.0), (False, 2, 0.05)])
def test_best_and_early_stopping_are_transformers(greater, patience, threshold):
    from transformers import EarlyStoppingCallback, TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir="unused", eval_strategy="steps", save_strategy="steps", eval_steps=2,
                             save_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                             greater_is_better=greater, report_to="none", use_cpu=True)
    values = [3.0, 2.5, 2.48, 2.6, 2.47, 2.9, 2.95, 3.1]
    ours = evaluate.Evaluator(args, run=None, max_steps=100, patience=patience, threshold=threshold)
    hf, state, control = EarlyStoppingCallback(patience, threshold), TrainerState(), TrainerControl()
    ours_stop = hf_stop = None
    for i, value in enumerate(values):
        step = 2 * (i + 1)
        metrics = {"eval_loss": value}
        if ours.record(metrics, step) and ours_stop is None:
            ours_stop = step
        hf.on_evaluate(args, state, control, metrics)  # inside Trainer.evaluate, before _determine_best_metric
        state.global_step = step
        best = state.best_metric if state.best_metric is not None else (-math.inf if greater else math.inf)
        if (value > best) if greater else (value < best):
            state.best_metric, state.best_global_step = value, step
        if control.should_training_stop and hf_stop is None:
            hf_stop = step
        assert (ours.best_metric, ours.best_global_step) == (state.best_metric, state.best_global_step)
        assert ours.patience_counter == hf.early_stopping_patience_counter
    assert ours_stop == hf_stop and ours_stop is not None


def test_best_checkpoint_is_the_one_saved(tmp_path):
    args = SimpleNamespace(eval_steps=5, logging_steps=1, eval_strategy="steps", save_strategy="steps",
                           metric_for_best_model="loss", greater_is_better=False, load_best_model_at_end=True)
    ev = evaluate.Evaluator(args, run=None, max_steps=20)
    assert [s for s in range(1, 21) if ev.due_after_step(s)] == [5, 10, 15, 20]
    ev.record({"eval_loss": 2.0}, 5)
    ev.saving(tmp_path, 5)
    ev.record({"eval_loss": 3.0}, 10)
    ev.saving(tmp_path, 10)
    assert ev.best_to_load(20) == tmp_path / "checkpoint-5"
    ev.record({"eval_loss": 1.0}, 20)
    assert ev.best_to_load(20) is None  # the last step is the best: the model in memory


# ----------------------------------------------------------------------------------------------
# Flags.


def _problems(*flags: str, check_paths: bool = True) -> list[str]:
    with pytest.raises(C.ConfigError) as info:
        C.parse(list(flags), check_paths=check_paths)
    return info.value.problems


def test_eval_flags_defaults():
    cfg = C.parse(["--eval_split_size", "0.1"], check_paths=False)
    assert cfg.training.eval_strategy.value == "steps" and cfg.training.eval_steps == 0.1
    cfg = C.parse(["--eval_dataset", "e.jsonl", "--save_steps", "4", "--load_best_model_at_end", "true"],
                  check_paths=False)
    assert (cfg.training.eval_steps, cfg.training.metric_for_best_model, cfg.training.greater_is_better) == (4, "loss", False)
    assert cfg.resolved()["eval_dataset"] == "e.jsonl"
    assert cfg.training.ddp_find_unused_parameters is False  # no extra autograd pass, no DDP warning


@pytest.mark.parametrize("flags,expected", [
    (["--eval_strategy", "steps"], "eval_strategy: 'steps' needs an eval set"),
    (["--eval_dataset", "a.jsonl", "--eval_split_size", "0.1"], "give one of them"),
    (["--eval_split_size", "2.5"], "eval_split_size: a fraction below 1"),
    (["--eval_generate", "2"], "eval_generate: needs an eval set"),
    (["--eval_split_size", "0.1", "--eval_metric", "math:sqrt"], "eval_metric: scores --eval_generate completions"),
    (["--eval_split_size", "0.1", "--early_stopping_patience", "2"], "needs --load_best_model_at_end true"),
    (["--eval_split_size", "0.1", "--eval_generate", "2", "--eval_metric", "os.path:joinn"],
     "os.path has no function 'joinn'; did you mean 'join'?"),
    (["--eval_split_size", "0.1", "--eval_generate", "2", "--eval_metric", "no_such_module_x:f"], "cannot import"),
    (["--eval_split_size", "0.1", "--save_steps", "5", "--load_best_model_at_end", "true",
      "--metric_for_best_model", "eval_los"], "metric_for_best_model: 'eval_los' is not logged; did you mean 'loss'?"),
])
def test_eval_flag_mistakes_are_named(flags, expected):
    problems = _problems("--model_name_or_path", "m", "--dataset", "d", *flags)
    assert any(expected in p for p in problems), problems


def test_eval_metric_is_checked_with_paths(tmp_path):
    problems = _problems("--eval_split_size", "0.1", "--eval_generate", "1", "--eval_metric", "os.path:joinn",
                         "--eval_strategy", "nope", check_paths=False)
    assert not any("eval_metric" in p for p in problems)  # without paths: not imported
    cfg = C.parse(["--eval_split_size", "0.1", "--eval_generate", "1", "--eval_metric", "os.path:join"], check_paths=False)
    assert C.load_metric(cfg.evaluation.eval_metric) is __import__("os").path.join


# ----------------------------------------------------------------------------------------------
# report_to tensorboard and `finetune report`.


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = list(logdir.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_reporters_write_tensorboard_events(tmp_path):
    args = SimpleNamespace(report_to=["tensorboard"], output_dir=str(tmp_path), local_process_index=0,
                           to_json_string=lambda: "{}")
    reporters = evaluate.Reporters(args, max_steps=4)
    history = [{"loss": 2.0, "learning_rate": 1e-3, "epoch": 0.5, "step": 2},
               {"eval_loss": 1.75, "eval_perplexity": math.exp(1.75), "epoch": 0.5, "step": 2},
               {"loss": 1.5, "learning_rate": 5e-4, "epoch": 1.0, "step": 4}]
    for entry in history:
        reporters.log(entry)
    reporters.close()
    scalars = _scalars(tmp_path / "runs")
    assert scalars["train/loss"] == [(2, 2.0), (4, 1.5)]
    assert scalars["eval/loss"] == [(2, 1.75)]
    assert scalars["train/learning_rate"] == [(2, pytest.approx(1e-3)), (4, pytest.approx(5e-4))]


def _state(tmp_path: Path) -> Path:
    history = [{"loss": 3.0 - 0.1 * s, "learning_rate": 1e-3 * s / 10, "epoch": s / 10, "num_input_tokens_seen": 100 * s,
                "train_runtime": 0.5 * s, "train_tokens_per_second": 200.0, "step": s} for s in range(1, 11)]
    history.insert(5, {"eval_loss": 2.6, "eval_perplexity": math.exp(2.6), "epoch": 0.5, "step": 5})
    history.append({"eval_loss": 2.2, "eval_perplexity": math.exp(2.2), "epoch": 1.0, "step": 10})
    history.append({"train_runtime": 5.0, "train_loss": 2.55, "epoch": 1.0, "step": 10})
    out = tmp_path / "run"
    out.mkdir()
    (out / "trainer_state.json").write_text(json.dumps({"global_step": 10, "max_steps": 10, "log_history": history,
                                                        "best_metric": 2.2, "best_global_step": 10}))
    return out


def test_report_writes_curves_and_metrics(tmp_path):
    out = _state(tmp_path)
    folder = report.write_report(out)
    assert folder == out / "report"
    for name in ("loss.png", "learning_rate.png", "tokens_per_second.png"):
        data = (folder / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
        assert f"]({name})" in (folder / "README.md").read_text()
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["train"]["first_loss"] == 2.9 and metrics["train"]["last_loss"] == pytest.approx(2.0)
    assert metrics["eval"]["eval_loss"] == 2.2 and metrics["eval"]["evaluations"] == 2
    assert metrics["best"] == {"best_metric": 2.2, "best_global_step": 10} and metrics["run"]["train_loss"] == 2.55
    readme = (folder / "README.md").read_text()
    assert "| eval_loss | 2.2 |" in readme
    # Named within the run folder, not by this machine's path: the report is pushed with the model.
    assert readme.startswith("# Run report: run\n") and "From the run folder's `trainer_state.json` (step 10 of 10)" in readme
    assert str(tmp_path) not in readme
    # A run stopped before its final save: the newest checkpoint's state, named within the run folder.
    (out / "checkpoint-10").mkdir()
    (out / "trainer_state.json").rename(out / "checkpoint-10" / "trainer_state.json")
    readme = (report.write_report(out) / "README.md").read_text()
    assert readme.startswith("# Run report: run\n") and "`checkpoint-10/trainer_state.json`" in readme, readme[:300]
    assert report.series(json.loads((out / "checkpoint-10" / "trainer_state.json").read_text())["log_history"], "loss")[0] == list(range(1, 11))


def test_report_command_errors(tmp_path, capsys):
    from finetune import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["report", str(tmp_path / "missing")])
    assert info.value.code == 2 and "no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as info:
        cli.main(["report", str(tmp_path / "empty")])
    assert info.value.code == 2 and "no trainer_state.json" in capsys.readouterr().err
    assert list((tmp_path / "empty").iterdir()) == []  # nothing half-written


# ----------------------------------------------------------------------------------------------
# Slow: the best model and early stopping on the three paths under ZeRO-3, 2 processes.

METRIC_MODULE = '''
def answer_chars(predictions, references):
    return {"pred_chars": float(sum(map(len, predictions))), "ref_chars": float(sum(map(len, references)))}
'''
# --greater_is_better with eval_loss: while the eval loss falls, the first evaluation stays the best, so the model
# saved must be the step-2 checkpoint's (not the last weights), and patience 2 stops the run after step 6.
BEST_FLAGS = ["--config", "zero3_no_offload", "--max_steps", "12", "--learning_rate", "2e-3", "--warmup_steps", "2",
              "--seed", "1234", "--max_seq_length", "128", "--disable_tqdm", "true", "--per_device_train_batch_size", "4",
              "--eval_split_size", "9", "--eval_steps", "2", "--save_steps", "2", "--per_device_eval_batch_size", "2",
              "--load_best_model_at_end", "true", "--metric_for_best_model", "eval_loss", "--greater_is_better", "true",
              "--early_stopping_patience", "2", "--eval_generate", "2", "--eval_metric", "evalhook:answer_chars",
              "--report_to", "tensorboard"]
BEST_PATHS = {"trainer": lambda: launcher("accelerate", 2, script=TRAIN),
              "loop": lambda: launcher("accelerate", 2, script=LOOP),
              "engine": lambda: deepspeed_launcher(2, script=ENGINE)}


@pytest.fixture(scope="module")
def best_job(tmp_path_factory):
    root, model, data = tiny_job(tmp_path_factory.mktemp("best"), records=72, seed=7)
    (root / "hooks").mkdir()
    (root / "hooks" / "evalhook.py").write_text(METRIC_MODULE)
    return root, model, data


_best_runs: dict[str, tuple[Path, str]] = {}


def best_run(job, path: str) -> tuple[Path, str]:
    if path not in _best_runs:
        root, model, data = job
        out = root / path
        result = run(BEST_PATHS[path]() + ["--model_name_or_path", str(model), "--dataset", str(data),
                                           "--output_dir", str(out), "--dataset_cache_dir", str(root / "cache"),
                                           *BEST_FLAGS],
                     timeout=600, PYTHONPATH=f"{Path(__file__).resolve().parents[1]}:{root / 'hooks'}").check()
        _best_runs[path] = out, result.output
    return _best_runs[path]


@pytest.mark.slow
# CI: the Trainer and the engine; the loop with FINETUNE_FULL_MATRIX=1 (it runs the engine's evaluator, best-checkpoint
# choice and early stopping, core.train's; its best-model load is its resume's accelerator.load_state).
@pytest.mark.parametrize("path", matrix(list(BEST_PATHS), ["trainer", "engine"]))
def test_best_model_and_early_stopping(path, best_job, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, output = best_run(best_job, path)
    state = json.loads((out / "trainer_state.json").read_text())
    evals = [e for e in state["log_history"] if "eval_loss" in e]
    losses_ = [e["eval_loss"] for e in evals]
    # Early stopping: evaluations at 2, 4, 6 (the eval loss falls, so with greater_is_better none improves on the
    # first); patience 2 stops after step 6.
    assert [e["step"] for e in evals] == [2, 4, 6] and losses_[0] > losses_[1] > losses_[2], evals
    assert state["global_step"] == 6
    assert (state["best_global_step"], state["best_metric"]) == (2, losses_[0])
    assert state["best_model_checkpoint"].endswith("checkpoint-2")
    # The split: 9 of 72 held out, disjoint, every eval record counted once on 2 ranks.
    split = examples.read_split(out)
    assert len(split["eval_indices"]) == 9 and split["seed"] == 1234 and split["examples"] == 72
    assert all(e["eval_samples"] == 9 for e in evals)
    assert "verified model" in output  # the best model's save is verified like every save
    # What was saved is the best (step-2) model: its eval loss, recomputed here, is the logged best, not the last.
    from finetune.models.load import ensure_pad_token

    tok = AutoTokenizer.from_pretrained(out)
    ensure_pad_token(tok)
    records = tiny.synthetic_records(72, seed=7)
    held_out = []
    for i in split["eval_indices"]:
        ids, labels = tokenize_record(tok, records[i], "messages", True)
        held_out.append({"input_ids": ids, "labels": labels})
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        saved = evaluate.finish(evaluate.rank_sums(evaluate.model_forward(model), evaluate.EvalSet(held_out, tok, 4),
                                                   "cpu", 1, 0), 9)
    assert abs(saved["loss"] - losses_[0]) <= 1e-4 * losses_[0], (saved, losses_)
    assert abs(saved["loss"] - losses_[-1]) > 1e-3
    # Generation metrics and the user's hook, logged like the loss.
    refs = sum(len(records[i]["messages"][-1]["content"].strip()) for i in split["eval_indices"][:2])
    for e in evals:
        assert 0.0 <= e["eval_exact_match"] <= 1.0 and e["eval_ref_chars"] == refs and e["eval_pred_chars"] >= 0
    # --report_to tensorboard: real event files, read back with tensorboard's reader, holding the logged numbers.
    scalars = _scalars(out / "runs")
    assert [s for s, _ in scalars["eval/loss"]] == [2, 4, 6]
    assert [v for _, v in scalars["eval/loss"]] == pytest.approx(losses_, rel=1e-6)
    train = [e for e in state["log_history"] if "loss" in e]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([e["loss"] for e in train], rel=1e-6)
    # The paths evaluate the same: their eval losses agree within 1e-4 (each run against the Trainer's, once run).
    if "trainer" in _best_runs:
        curves = {p: [e["eval_loss"] for e in json.loads((o / "trainer_state.json").read_text())["log_history"]
                      if "eval_loss" in e] for p, (o, _) in _best_runs.items()}
        for p, curve in curves.items():
            assert curve == pytest.approx(curves["trainer"], rel=1e-4), (p, curves)
    # `finetune report` on the run folder.
    folder = report.write_report(out)
    assert (folder / "loss.png").stat().st_size > 5000 and "eval_loss" in (folder / "README.md").read_text()
