"""Evaluation while training, the same on the three paths: the eval set (its examples come from
finetune.training.examples), the eval loss, generation metrics, the best model and early stopping.

The eval loss is the token-loss sum over the whole eval set divided once by its trained-token count (not a mean of
batch means), so it does not depend on the batch size, the world size or the ZeRO stage. Rank r evaluates samples
r, r + W, r + 2W, ... (every sample exactly once, no DistributedSampler padding); every rank runs the same number
of forward passes (a rank out of samples runs one that counts for nothing), because under ZeRO-3 each forward
gathers the parameters collectively. The sums travel in one all_reduce with the sample count and an index
checksum: a sample counted twice or lost stops the run.

The schedule, the best model and early stopping follow the Trainer (DefaultFlowCallback, _determine_best_metric,
EarlyStoppingCallback): the Trainer path uses them as they are; the loop and the DeepSpeed engine path get the same
decisions from `Evaluator`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from finetune import compat
from finetune.constants import IGNORE_INDEX
from finetune.data.packing import to_device
from finetune.data.images import VisionCollator, processor_of
from finetune.data.prepare import Collator
from finetune.training import checkpoint, core

@dataclass
class EvalSet:
    dataset: object
    tokenizer: object
    batch_size: int
    generate: int = 0
    max_new_tokens: int = 0
    metric: Callable | None = None
    collator: Callable = None

    def __post_init__(self):
        # Always padded records: packing changes how rows are cut, never the per-record losses being summed. A
        # vision-language model's records go through its processor (pixel values, token types), as in training.
        processor = processor_of(self.tokenizer)
        self.collator = self.collator or (VisionCollator(processor, self.tokenizer.pad_token_id) if processor is not None
                                          else Collator(self.tokenizer.pad_token_id))


def eval_set(cfg, tokenizer, dataset) -> EvalSet | None:
    if dataset is None:
        return None
    from finetune.config.training import load_metric

    ev = cfg.evaluation
    return EvalSet(dataset, tokenizer, cfg.training.per_device_eval_batch_size, ev.eval_generate,
                   ev.eval_max_new_tokens, load_metric(ev.eval_metric) if ev.eval_metric else None)


# ----------------------------------------------------------------------------------------------
# One evaluation.


def shard(n: int, world: int, rank: int) -> list[int]:
    """This rank's samples: every sample exactly once over the ranks, no padding."""
    return list(range(rank, n, world))


def rank_sums(forward: Callable, es: EvalSet, device, world: int, rank: int):
    """This rank's [token-loss sum, trained tokens, samples, sum of sample indices] (float64)."""
    import torch

    n = len(es.dataset)
    mine = shard(n, world, rank)
    batches = math.ceil(math.ceil(n / world) / es.batch_size)  # the same on every rank
    sums = torch.zeros(4, dtype=torch.float64)
    for b in range(batches):
        chunk = mine[b * es.batch_size:(b + 1) * es.batch_size]
        batch = es.collator([es.dataset[i] for i in (chunk or [0])])  # a rank out of samples: a forward for nothing
        batch = to_device(batch, device)  # the record boundaries' host ints stay where they are
        loss = forward(batch).double().cpu()
        if chunk:
            tokens = (batch["labels"][..., 1:] != IGNORE_INDEX).sum().double().cpu()
            sums += torch.stack([loss, tokens, torch.tensor(len(chunk), dtype=torch.float64),
                                 torch.tensor(sum(chunk), dtype=torch.float64)])
    return sums


def finish(sums, n: int) -> dict:
    """{loss, perplexity, tokens, samples} from the summed rank_sums; refuses a sample counted twice or lost."""
    loss_sum, tokens, samples, index_sum = sums.tolist()
    if samples != n or index_sum != n * (n - 1) / 2:
        raise RuntimeError(f"evaluation covered {samples:.0f} samples (index sum {index_sum:.0f}) of {n} "
                           f"(index sum {n * (n - 1) // 2}): a sample was counted twice or lost")
    loss = loss_sum / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(tokens), "samples": int(samples)}


def loss_sums(forward: Callable, es: EvalSet, device) -> dict:
    """The eval loss over the whole eval set, every rank's share summed (one all_reduce); `forward(batch)` -> the
    batch's token-loss sum."""
    sums = rank_sums(forward, es, device, core.world(), core.rank())
    return finish(core.all_sum(sums.to(device)).cpu(), len(es.dataset))


def model_forward(model) -> Callable:
    """The token-loss sum of a batch: the model's own loss with num_items_in_batch=1 (a sum, not a mean)."""
    import torch

    def forward(batch):
        one = torch.ones((), dtype=torch.long, device=batch["input_ids"].device)
        return model(**batch, num_items_in_batch=one, use_cache=False).loss.detach().float()

    return forward


def prompt_and_answer(example: dict) -> tuple[list[int], list[int]]:
    """The prompt (everything before the last trained span) and its answer (that span) of a tokenized record."""
    ids, labels = example["input_ids"], example["labels"]
    trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX and i > 0]
    end = trained[-1] + 1
    start = end - 1
    while start - 1 > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return list(ids[:start]), list(ids[start:end])


def exact_match(completion: str, reference: str) -> bool:
    """The whole answer, character for character, after trimming surrounding whitespace."""
    return completion.strip() == reference.strip()


def generations(module, es: EvalSet, device, synced_gpus: bool = False) -> tuple[list[str], list[str]]:
    """Greedy completions of the first es.generate eval records, and their reference answers (every rank runs all of
    them: under ZeRO-3 generation is collective)."""
    import torch
    from transformers import GenerationConfig

    tok = es.tokenizer
    predictions, references = [], []
    for i in range(min(es.generate, len(es.dataset))):
        prompt, answer = prompt_and_answer(es.dataset[i])
        config = GenerationConfig(do_sample=False, max_new_tokens=es.max_new_tokens or len(answer) + 16,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, use_cache=True)
        ids = torch.tensor([prompt], device=device)
        out = module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                              synced_gpus=synced_gpus, **compat.generation_kwargs(module))
        predictions.append(tok.decode(out[0, len(prompt):], skip_special_tokens=True).strip())
        references.append(tok.decode(answer, skip_special_tokens=True).strip())
    return predictions, references


def eval_set_metrics(model, module, es: EvalSet, device, *, synced_gpus: bool = False,
                     prefix: str = "eval") -> dict:
    """One evaluation of `model` (what the path trains: DDP module, DeepSpeed engine, or the model) and its unwrapped
    `module` (for generate): {eval_loss, eval_perplexity, eval_tokens, eval_samples[, eval_exact_match, hook's],
    eval_runtime}. Leaves the model in training mode."""
    import torch

    start = time.time()
    model.eval()
    try:
        with torch.no_grad():
            metrics = loss_sums(model_forward(model), es, device)
            if es.generate:
                predictions, references = generations(module, es, device, synced_gpus)
                metrics["exact_match"] = sum(map(exact_match, predictions, references)) / len(predictions)
                if es.metric is not None:
                    value = es.metric(predictions, references)
                    metrics.update(value if isinstance(value, dict) else {es.metric.__name__: value})
    finally:
        model.train()
    metrics["runtime"] = round(time.time() - start, 4)
    return {f"{prefix}_{k}": float(v) if not isinstance(v, int) else v for k, v in metrics.items()}


# ----------------------------------------------------------------------------------------------
# When to evaluate, the best model and early stopping, for the loop and engine paths (the Trainer has its own).


def metric_key(args) -> str:
    name = args.metric_for_best_model or "loss"
    return name if name.startswith("eval_") else f"eval_{name}"


@dataclass
class Evaluator:
    """The Trainer's decisions, for core.train: evaluate after the step DefaultFlowCallback would (every eval_steps,
    and at max_steps) or at an epoch's end; track the best metric as _determine_best_metric does and the checkpoint
    holding it as _save_checkpoint does; stop as EarlyStoppingCallback does."""

    args: object
    run: Callable  # () -> metrics, prefixed eval_
    max_steps: int
    patience: int = 0
    threshold: float = 0.0
    best_metric: float | None = None
    best_global_step: int = 0
    best_model_checkpoint: str | None = None
    patience_counter: int = 0
    every: int = field(init=False, default=0)

    def __post_init__(self):
        steps = self.args.eval_steps or self.args.logging_steps
        self.every = math.ceil(self.max_steps * steps) if steps < 1 else int(steps)

    @property
    def strategy(self) -> str:
        return core._value(self.args.eval_strategy)

    def due_after_step(self, step: int) -> bool:
        return self.strategy == "steps" and (step % self.every == 0 or step >= self.max_steps)

    def due_after_epoch(self) -> bool:
        return self.strategy == "epoch"

    def record(self, metrics: dict, step: int) -> bool:
        """Early stopping's count, then the best metric; True when training should stop."""
        if not self.args.metric_for_best_model:
            return False
        value, greater = metrics[metric_key(self.args)], bool(self.args.greater_is_better)
        better = (lambda a, b: a > b) if greater else (lambda a, b: a < b)
        if self.patience:
            if self.best_metric is None or (better(value, self.best_metric)
                                            and abs(value - self.best_metric) > self.threshold):
                self.patience_counter = 0
            else:
                self.patience_counter += 1
        if self.best_metric is None:
            self.best_metric = float("-inf") if greater else float("inf")
        if better(value, self.best_metric):
            self.best_metric = value
            if core._value(self.args.save_strategy) in ("steps", "epoch", "best"):
                self.best_global_step = step
        return bool(self.patience) and self.patience_counter >= self.patience

    def saving(self, output_dir, step: int) -> None:
        """At a checkpoint save: the best model's checkpoint, if it was saved (this one included)."""
        if self.best_global_step:
            folder = checkpoint.folder_for(output_dir, self.best_global_step)
            if self.best_global_step == step or folder.exists():
                self.best_model_checkpoint = str(folder)

    def best_to_load(self, final_step: int) -> Path | None:
        """The checkpoint to load before the final save (--load_best_model_at_end), or None: the model in memory,
        after its last step, is the best one."""
        if not self.args.load_best_model_at_end or self.best_model_checkpoint is None:
            return None
        if self.best_global_step == final_step:
            return None
        return Path(self.best_model_checkpoint)

    def state(self) -> dict:
        return {"best_metric": self.best_metric, "best_global_step": self.best_global_step,
                "best_model_checkpoint": self.best_model_checkpoint, "patience_counter": self.patience_counter}

    def load(self, state: dict | None) -> None:
        for k, v in (state or {}).items():
            setattr(self, k, v)


def evaluator(cfg, run: Callable, max_steps: int) -> Evaluator | None:
    if core._value(cfg.training.eval_strategy) == "no":
        return None
    ev = cfg.evaluation
    return Evaluator(cfg.training, run, max_steps, ev.early_stopping_patience, ev.early_stopping_threshold)


def method_evaluator(cfg, method, session, tokenizer, held_out, model, module, device, *, synced_gpus: bool,
                     max_steps: int) -> Evaluator | None:
    """The hand-written paths' Evaluator: the method's own evaluation (Method.own_evaluation: DPO's), else the token
    loss and generation metrics here. `model` runs the forwards (the wrapped model), `module` generates."""
    if method.own_evaluation:
        return evaluator(cfg, lambda: session.evaluate(model, held_out, cfg.training.per_device_eval_batch_size),
                         max_steps)
    es = eval_set(cfg, tokenizer, held_out and held_out.dataset)
    return evaluator(cfg, lambda: eval_set_metrics(model, module, es, device, synced_gpus=synced_gpus), max_steps)


# ----------------------------------------------------------------------------------------------
# report_to for the paths without a Trainer: transformers' own integration callbacks, fed the same log entries.


# A tracker's callback events: the ones a failure of the tracker's own (its server gone, a key it refuses) is kept
# inside of (docs/network.md: a tracker never hides the training result).
TRACKER_EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
                  "on_substep_end", "on_step_end", "on_pre_optimizer_step", "on_optimizer_step", "on_evaluate",
                  "on_predict", "on_save", "on_log", "on_prediction_step", "on_push_begin")


def guard_trackers(callbacks: list) -> list:
    """transformers' tracker callbacks among `callbacks` (W&B, MLflow, TensorBoard, ...) made to fail alone: the first
    error of one prints one warning line and leaves that tracker out for the rest of the run, which goes on (its
    log stays in trainer_state.json). The callbacks keep their type (the Trainer finds them by it)."""
    import sys

    for cb in callbacks:
        if not type(cb).__module__.startswith("transformers.integrations"):
            continue
        name, failed = type(cb).__name__.removesuffix("Callback"), []

        def guarded(event, fn, name=name, failed=failed):
            def call(*args, **kwargs):
                if failed:
                    return None
                try:
                    return fn(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - the tracker's own failure, whatever it raises
                    failed.append(e)
                    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                    print(f"finetune: warning: report_to {name.lower()}: {event} failed ({first}); this tracker is left "
                          "out for the rest of the run, which goes on (its log: trainer_state.json)",
                          file=sys.stderr, flush=True)
                    return None
            return call

        for event in TRACKER_EVENTS:
            fn = getattr(cb, event, None)
            if fn is not None:
                setattr(cb, event, guarded(event, fn))
    return callbacks


class Reporters:
    def __init__(self, args, max_steps: int, model=None):
        from transformers import TrainerControl, TrainerState
        from transformers.integrations import get_reporting_integration_callbacks

        self.args = args
        self.callbacks = guard_trackers([cls() for cls in get_reporting_integration_callbacks(args.report_to)])
        self.state = TrainerState(max_steps=max_steps, is_world_process_zero=core.rank() == 0,
                                  is_local_process_zero=args.local_process_index == 0)
        self.control = TrainerControl()
        for cb in self.callbacks:
            cb.on_train_begin(args, self.state, self.control, model=model)

    def log(self, entry: dict) -> None:
        if not self.callbacks:
            return
        self.state.global_step, self.state.epoch = entry.get("step", 0), entry.get("epoch")
        self.state.log_history.append(entry)
        logs = {k: v for k, v in entry.items() if k != "step"}
        for cb in self.callbacks:
            cb.on_log(self.args, self.state, self.control, logs=logs)

    def close(self) -> None:
        for cb in self.callbacks:
            cb.on_train_end(self.args, self.state, self.control)
