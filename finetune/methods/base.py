"""The interface every training method implements (SFT, DPO; docs/layout.md, "a new training method").

A method is one module of finetune.methods and one line in its registry (finetune/methods/__init__.py). The three
training paths, the config parser, the planner and the report know a method only through this interface:

    Method        what the method is: its name, its flags (a MethodConfig subclass), the paths that run it, its
                  checks of the other flags, records to examples (prepare, examples, collator), how a batch's
                  loss is normalized (count), its planner terms, the metrics it logs;
    Method.setup  what else a run of it needs (DPO: a reference model), given the model and what the training path
                  lends it (a Context); returns a Session;
    Session       the method at work in one run: the loss of a micro-batch, the logging window of its metrics, its
                  own evaluation.

A method that generates during training (GRPO, RLOO) sets `generates`: it makes a step's completions in
Method.count (where each path first holds all of the step's micro-batches) with the model Context.unwrap gives,
seeded by Context.step, and scores them in Session.loss; the planner adds the generation's memory through its
PlannerTerms.

Nothing here imports torch at module level: the parser reads the methods' flags before torch is imported.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar


@dataclass
class MethodConfig:
    """A method's flags (a method with flags subclasses this; its fields are its flags, their help its --help)."""

    method: str = field(default="sft", metadata={"help": "The training method (finetune.methods)."})


@dataclass
class PlannerTerms:
    """What a method adds to `finetune plan`'s memory prediction (finetune.plan.planner reads it)."""

    # Each example of a micro-batch is a (chosen, rejected) pair, two rows scored in one forward by the completions'
    # log-probabilities (logits at the scored positions only), not by the chunked cross-entropy.
    pairs: bool = False
    # A frozen copy of the weights beside the trained ones (the reference of full fine-tuning).
    reference_copy: bool = False
    # The outputs of the model's head where it is not the LM head (a reward model's score head: 1): no vocabulary
    # logits, a head of hidden x head_outputs weights. 0: the LM head.
    head_outputs: int = 0
    # A method that generates (GRPO): completions sampled per prompt, and their longest length in tokens (the KV
    # cache of generation holds prompts x generations x (prompt + completion) positions).
    generations: int = 0
    completion_length: int = 0
    # Appended to the plan's method line.
    note: str = ""


@dataclass
class Examples:
    """A tokenized data set as a method trains on it, with the key its derived data (DPO: the reference's
    precomputed log-probabilities) is cached under."""

    dataset: Any
    key: str | None = None


@dataclass
class Context:
    """What a training path lends a method for one run: the run's config, where it runs, the trained module once
    the path has wrapped it, and the path's collective and logging helpers (a method imports nothing of
    finetune.training)."""

    cfg: Any  # the run's finetune.config.FinetuneConfig
    device: Any
    unwrap: Callable[[], Any]  # the trained module (the engine's, once prepared)
    autocast: Callable[[], Any] = contextlib.nullcontext  # the path's mixed-precision context
    resumed: bool = False
    log: Callable[..., None] = print  # rank 0's print
    all_sum: Callable[[Any], Any] = lambda t: t  # sums a tensor over the ranks (collective)
    rank: Callable[[], int] = lambda: 0
    world: Callable[[], int] = lambda: 1
    fail: Callable[[str], Any] = None  # ends the run with one message, every rank alike
    hash_path: Callable[..., str] = None  # a file's or folder's content hash (finetune.training.outputs')
    step: Callable[[], int] = lambda: 0  # the optimizer steps done (a method that generates seeds its sampling by it)


class Session:
    """A method at work in one run (Method.setup's result). Every rank calls `step_start`, `metrics` and `evaluate`
    together."""

    def step_start(self, batches: list[dict]) -> None:
        """Called with this rank's micro-batches of an optimizer step before their losses, for a loss that depends
        on the whole global batch (KTO's KL reference point); collective."""

    def loss(self, model, batch: dict, n_items, *, autocast=contextlib.nullcontext):
        """This micro-batch's loss over `n_items` (Method.count of the whole global batch, all ranks): the sum of the
        micro-batches' losses of a step is the global batch's mean. Metrics of the batch go to the window."""
        raise NotImplementedError

    def metrics(self, reduce: Callable | None = None) -> dict:
        """The logging window's means of Method.metrics over every rank (`reduce` sums over ranks); the window
        restarts."""
        return {}

    def evaluate(self, model, examples: Examples, batch_size: int, *, prefix: str = "eval") -> dict:
        """The method's own evaluation of `examples` ({prefix}_loss and its metrics), for a method whose
        Method.own_evaluation is true."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the run's log: the method's settings and what it holds."""
        return ""


class Method:
    """One training method. Subclasses set the class attributes and override what differs from SFT's defaults."""

    name: ClassVar[str]
    title: ClassVar[str]  # how messages name it ("DPO")
    summary: ClassVar[str]  # its --method help
    config: ClassVar[type[MethodConfig]] = MethodConfig
    # The training paths that run it: "trainer" (finetune/train.py), "loop" (finetune/loop.py), "engine"
    # (scripts/sft.py); the others refuse it by name.
    paths: ClassVar[tuple[str, ...]] = ("trainer", "loop", "engine")
    # The HF Trainer computes its loss (the model's token loss): the Trainer path uses the Trainer as it is.
    trainer_loss: ClassVar[bool] = False
    # Its evaluation is Session.evaluate, not the token loss and generation metrics of finetune.training.evaluate.
    own_evaluation: ClassVar[bool] = False
    # It generates during training (online methods): Session.loss makes the completions it scores.
    generates: ClassVar[bool] = False
    # Logged per logging window besides the loss (Session.metrics), and so in `finetune report`.
    metrics: ClassVar[tuple[str, ...]] = ()
    unit: ClassVar[str] = "examples"  # what one example is called in the log
    # The model it trains, by peft's task type: the causal LM, or "SEQ_CLS", a sequence-classification head of one
    # output (a reward model); finetune.models.load.TASKS maps it to the model class and LoRA's task.
    task: ClassVar[str] = "CAUSAL_LM"

    def validate(self, options: MethodConfig, data, training: dict[str, Any], evaluation) -> list[str]:
        """Problems with this method's flags, and with other flags it does not support (each named)."""
        return []

    def eval_metrics(self, evaluation) -> list[str]:
        """The eval metrics it logs (eval_<name>), for --metric_for_best_model."""
        return ["loss", "perplexity"] + (["exact_match"] if evaluation is not None and evaluation.eval_generate else [])

    # -- records to examples ----------------------------------------------------------------------

    def prepare(self, data, tokenizer, *, local_rank: int, log, seed: int = 42) -> tuple[Any, Any, str | None]:
        """(tokenized data set, stats with summary(), cache key) of the data set `data` (a DataConfig) names; a bad
        record raises finetune.data.prepare.DataError."""
        raise NotImplementedError

    def examples(self, dataset, key: str | None) -> Examples:
        return Examples(dataset, key)

    def collator(self, cfg, tokenizer) -> Callable:
        raise NotImplementedError

    def count(self, batches: list[dict]):
        """What a batch's loss is normalized by, summed over `batches` (this rank's): an int tensor."""
        raise NotImplementedError

    def repeats(self, options: MethodConfig) -> int:
        """How many optimizer steps in a row train on each step's micro-batches (GRPO's --num_iterations: one batch
        of generations, several updates); the paths' data order repeats them (finetune.data.sampler)."""
        return 1

    # -- training ---------------------------------------------------------------------------------

    def setup(self, options: MethodConfig, model, tokenizer, examples: list[Examples | None], collator,
              context: Context) -> Session:
        """What else the run needs (a reference model; a method that generates, the tokenizer to decode with), made
        before any update; the Session the paths call. `examples`: the training set, then the eval set or None."""
        raise NotImplementedError

    def planner_terms(self, options: MethodConfig, *, use_peft: bool) -> PlannerTerms:
        return PlannerTerms()


def own_flags(method: Method) -> list[str]:
    """The flags a method adds (its config's fields besides --method)."""
    return [f.name for f in fields(method.config) if f.name not in {f.name for f in fields(MethodConfig)}]


class Window:
    """A logging window of per-example metric sums (this rank), reduced over ranks and averaged when popped."""

    def __init__(self, names: tuple[str, ...]):
        self.names, self.sums = names, None

    def add(self, values) -> None:
        """`values`: a float64 tensor [sum of each metric..., examples]."""
        self.sums = values if self.sums is None else self.sums + values

    def pop(self, reduce: Callable | None = None) -> dict:
        """The window's means over every rank's examples (`reduce` sums a tensor over ranks); the window restarts.
        Every rank must call it together when `reduce` is collective."""
        import torch

        sums = self.sums if self.sums is not None else torch.zeros(len(self.names) + 1, dtype=torch.float64)
        self.sums = None
        if reduce is not None:
            sums = reduce(sums)
        n = max(float(sums[-1]), 1.0)
        return {name: float(v) / n for name, v in zip(self.names, sums[:-1].tolist())}
