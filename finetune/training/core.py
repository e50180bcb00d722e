"""What the prepare() loop (loop.py) and the DeepSpeed engine path (engine.py) share with the HF Trainer, once.

The Trainer path is the reference: every function here does what transformers' Trainer does for the same
flags (optimizer and its parameter groups, LR schedule, gradient checkpointing, loss normalization over the
trained tokens of the whole global batch, the logging window of log_history), so that a run gives the same
per-step losses and the same log_history on all three paths. Flags the two hand-written paths cannot honour
are refused by name (`refused_flags`), never ignored.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from finetune import compat, methods
from finetune.methods.base import Context
from finetune.process import exit_with
from finetune.training import checkpoint, faults, sequence_parallel, watchdog
from finetune.training.lifecycle import (_hash_path, commit_staged, plan_or_exit, rank0_print, saving, staging_dir,
                                         verify_staged, write_json_atomic, write_resolved)

# --optim values whose optimizer is one torch.optim-style class over the Trainer's parameter groups. The others
# (8-bit, GaLore, LOMO, schedule-free, ...) need model hooks or a training_step of their own that only the
# Trainer has.
SUPPORTED_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adafactor")
# The hand-written paths' scripts -> the path names a method lists in Method.paths.
PATHS = {"finetune/loop.py": "loop", "scripts/sft.py": "engine"}
POSITION = "finetune_position.json"


def _value(x):
    return getattr(x, "value", x)


def refused_flags(cfg, script: str) -> list[str]:
    """Flags the Trainer path honours that `script` (loop.py / sft.py) does not: each refused by name."""
    args, problems = cfg.training, []

    def flag(key: str, default=None):  # absent: the TrainingArguments default (a partial config in a test)
        return _value(getattr(args, key, default))

    preset = cfg.preset
    optim = flag("optim", "adamw_torch_fused")
    if preset.own_optimizer:
        if "optim" in cfg.sources:
            problems.append(f"optim: the DeepSpeed config {preset.path} names its own optimizer "
                            f"({preset.ds_config['optimizer'].get('type')}), so --optim {optim} would be ignored; "
                            "drop --optim or use a preset without an \"optimizer\" section (zero2, zero3_no_offload)")
    elif optim not in SUPPORTED_OPTIMIZERS:
        problems.append(f"optim: {script} supports --optim {', '.join(SUPPORTED_OPTIMIZERS)}, not '{optim}' "
                        "(the Trainer path, finetune/train.py, supports it)")
    if (strategy := flag("save_strategy", "no")) not in ("no", "steps"):
        problems.append(f"save_strategy: {script} saves checkpoints every --save_steps only, not '{strategy}'")
    if (strategy := flag("logging_strategy", "steps")) not in ("no", "steps"):
        problems.append(f"logging_strategy: {script} logs every --logging_steps only, not '{strategy}'")
    if flag("do_predict"):
        problems.append(f"do_predict: {script} does not predict (finetune/train.py does)")
    if (scheduler := flag("lr_scheduler_type", "linear")) in ("reduce_lr_on_plateau", "greedy"):
        problems.append(f"lr_scheduler_type: '{scheduler}' steps on evaluation metrics; {script} does not support it "
                        "(finetune/train.py does)")
    unsupported = {
        "save_total_limit": flag("save_total_limit") is not None,
        "eval_on_start": flag("eval_on_start"),
        "eval_delay": bool(flag("eval_delay", 0)),
        "ignore_data_skip": flag("ignore_data_skip"),
        "torch_compile": flag("torch_compile") and "loop" not in script,  # the loop compiles as the Trainer does
        "neftune_noise_alpha": flag("neftune_noise_alpha") is not None,
        "label_smoothing_factor": bool(flag("label_smoothing_factor", 0)),
    }
    # A method names the paths that run it (finetune.methods).
    name = getattr(getattr(cfg, "objective", None), "method", methods.DEFAULT)
    unsupported[f"method {name}"] = script in PATHS and PATHS[script] not in methods.METHODS[name].paths
    problems += [f"{key}: not supported by {script} (finetune/train.py supports it)" for key, on in unsupported.items() if on]
    return problems


def check_flags_or_exit(cfg, script: str) -> None:
    from finetune import config as C

    if problems := refused_flags(cfg, script):
        exit_with(str(C.ConfigError(problems)))


# ----------------------------------------------------------------------------------------------
# Start of every run.


def start(argv: list[str] | None, prog: str, *, script: str | None = None, deepspeed_engine: bool = False):
    """The start of every training path (finetune/train.py, finetune/loop.py, scripts/sft.py): the watchdog
    (start_run), the flags and the preset (finetune.config.load_or_exit), the process group where DeepSpeed needs
    one (start_process_group), --plan_check, and the flags a hand-written `script` refuses. Returns the config."""
    from finetune import config as C

    start_run()  # no rank outlives its launcher; no silent wait
    cfg = C.load_or_exit(argv, prog, before_arguments=process_group_for)
    plan_or_exit(cfg)
    if script is not None:
        check_flags_or_exit(cfg, script)
    path = "scripts/sft.py" if deepspeed_engine else script or "finetune/train.py"
    if problems := fsdp_problems(cfg, path) + sequence_parallel.path_problems(cfg, path):
        exit_with(str(C.ConfigError(problems)))
    if cfg.preset.is_fsdp:
        compat.fsdp_on_cpu()  # accelerate 1.15 would train DDP on CPU processes instead
    if deepspeed_engine and not cfg.preset.is_deepspeed:
        # `--config ddp` on the DeepSpeed engine path: DeepSpeed's stage 0 needs its communication layer too.
        start_process_group()
    return cfg


def fsdp_problems(cfg, script: str) -> list[str]:
    """What an FSDP2 preset does not run: the DeepSpeed engine path, and the methods other than SFT (their reference
    copies and generation were not built or tested for FSDP's sharded parameters)."""
    preset = cfg.preset
    if not preset.is_fsdp:
        return []
    problems = []
    if script == "scripts/sft.py":
        problems.append(f"--config {preset.name}: FSDP2 runs on the Trainer path (finetune train, finetune/train.py) and "
                        "the loop path (finetune loop, finetune/loop.py); the engine path (scripts/sft.py, finetune "
                        "engine) is DeepSpeed's engine, which does not shard with FSDP: use one of those two, or a "
                        "ZeRO preset (--config zero3) here")
    name = getattr(getattr(cfg, "objective", None), "method", methods.DEFAULT)
    if name != methods.DEFAULT:
        problems.append(f"--config {preset.name}: method {name} is not supported under FSDP2 (only {methods.DEFAULT}: "
                        "its reference model and generation are not sharded with fully_shard); use --config zero3 "
                        "or ddp for it")
    return problems


def process_group_for(preset) -> None:
    """config.parse's `before_arguments` for anything that trains: a DeepSpeed preset's process group before
    TrainingArguments. Its DeepSpeed config check (train_batch_size = micro x accum x world) runs when TrainingArguments
    is built, with world size 1 if no group exists yet; and the HfDeepSpeedConfig TrainingArguments registers is what
    makes ZeRO-3 load the weights partitioned."""
    if preset.is_deepspeed:
        start_process_group()
    elif preset.is_fsdp:
        start_world_of_one()


def start_world_of_one() -> None:
    """FSDP2 without a launcher (`python finetune/train.py --config fsdp2`): a process group of one on loopback, as
    the Trainer shards only in a distributed run. Under a launcher accelerate starts the group itself."""
    import torch
    import torch.distributed as dist

    from finetune import config as C

    if dist.is_initialized() or "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(C.free_port()))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def start_process_group() -> None:
    """DeepSpeed's communication layer, through compat (which unlinks its shared-memory buffers). Started here
    only, through start(). Without a launcher (`python finetune/train.py --config zero2`) a world of one on
    loopback: DeepSpeed needs a process group even for one process, and would otherwise look for MPI."""
    import torch.distributed as dist

    from finetune import config as C

    if not dist.is_initialized() and "RANK" not in os.environ and "LOCAL_RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(C.free_port()))
    compat.init_deepspeed_distributed()


def start_run() -> None:
    """First thing every training path does (through start()).

    Under a launcher, starts the watchdog (finetune.training.watchdog): no rank outlives its launcher, no wait is
    silent. DeepSpeed's JIT-built ops get this virtualenv's folder and a build lock that survives no dead builder
    (finetune.compat.guard_extension_builds), and the CPU is described to DeepSpeed's op builders once per process
    (compat.cache_cpu_info), both set up before DeepSpeed is imported (the guard imports torch, which a run stopping
    at a flag mistake does without)."""
    compat.before_deepspeed(compat.guard_extension_builds)
    compat.before_deepspeed(compat.cache_cpu_info)
    watchdog.start()


# ----------------------------------------------------------------------------------------------
# Seed, data order, gradient checkpointing.


def data_seed(args) -> int:
    return args.data_seed if args.data_seed is not None else args.seed


def seed(args) -> None:
    """Where the Trainer seeds (its __init__, after the model is built): dropout then draws the same numbers."""
    from transformers import enable_full_determinism, set_seed

    enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)


def load_model_for_training(cfg, stats, world_size: int):
    """The model (and LoRA) as the Trainer trains it: seeded where the Trainer seeds, gradient checkpointing on."""
    from finetune.models import attention
    from finetune.models.load import WeightsError, load_model
    from finetune.training.lifecycle import describe_run

    try:
        model = load_model(cfg.model, cfg.training, task=methods.get(cfg.objective.method).task)
    except WeightsError as e:
        exit_with(str(e))
    attention.enable(model, cfg)
    rank0_print(describe_run(cfg, stats, model, world_size))
    seed(cfg.training)
    enable_gradient_checkpointing(model, cfg.training)
    install_loss(model, cfg)
    install_tiling(model, cfg)
    return model


def install_tiling(model, cfg) -> int:
    """--tiled_mlp: each decoder layer's MLP over tiles of positions (finetune.models.tiled), on every path."""
    if not getattr(cfg.model, "tiled_mlp", False):
        return 0
    from finetune.models import tiled

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.config.get_text_config().hidden_size
    count = tiled.enable(model, hidden)
    rank0_print(f"tiled MLP: {count} layers, tiles of {tiled.tile_tokens(hidden)} positions")
    return count


def install_loss(model, cfg) -> bool:
    """--loss_chunk_size: the training loss a chunk of tokens at a time (finetune.training.loss), on every path.
    Left out where something else computes the loss: Liger's patched forward (--use_liger_kernel) or a label
    smoother (--label_smoothing_factor, which takes the labels before the model sees them)."""
    from finetune.data.prepare import chunked_loss_on
    from finetune.training import loss

    if not chunked_loss_on(cfg):  # the collator's TRAINED_ROWS follow the same rule
        return False
    return loss.install(model, cfg.model.loss_chunk_size)


def enable_gradient_checkpointing(model, args) -> None:
    """--gradient_checkpointing, as Trainer.train applies it (use_reentrant=False unless given). For LoRA,
    finetune.models.load has already made the inputs require grads (enable_input_require_grads)."""
    if not args.activation_checkpointing:
        return
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
    )


# ----------------------------------------------------------------------------------------------
# Optimizer and schedule.


def trainable_parameters(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Trainer.create_optimizer's groups: weight decay on all but biases and norm weights. An empty group is left
    out: ZeRO's optimizer drops it, and a schedule built on the optimizer before prepare() would then step one group
    more than there is (LoRA trains no bias or norm: `--config zero2 --use_peft` on the loop path failed so)."""
    from transformers import Trainer

    # get_decay_parameter_names only reads the model: call it rather than copy its name patterns.
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(args, model, ds_config: dict | None = None):
    """The Trainer's optimizer (--optim); None when the DeepSpeed config names its own. DeepSpeed then builds it
    over trainable_parameters(model) as ONE group with the config's weight_decay (biases and norms included):
    what the Trainer hands it too (transformers.integrations.deepspeed.deepspeed_optim_sched)."""
    from transformers import Trainer

    if ds_config and "optimizer" in ds_config:
        return None
    if ds_config and ds_config.get("zero_optimization", {}).get("stage", 0) > 0:
        ds_config["zero_allow_untested_optimizer"] = True  # as deepspeed_optim_sched does for a torch optimizer
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    return optimizer_cls(parameter_groups(model, args.weight_decay), **kwargs)


def scheduler_factory(args, max_steps: int) -> Callable:
    """Trainer.create_scheduler, as a function of the optimizer (DeepSpeed calls it with the one it built)."""
    from transformers import get_scheduler

    def make(optimizer):
        return get_scheduler(
            args.lr_scheduler_type, optimizer, num_warmup_steps=args.get_warmup_steps(max_steps),
            num_training_steps=max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )

    return make


def max_steps_of(args, micro_per_epoch: int) -> int:
    updates_per_epoch = -(-micro_per_epoch // args.gradient_accumulation_steps)
    return args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * updates_per_epoch)


# ----------------------------------------------------------------------------------------------
# Distributed helpers (a world of one works without a process group).


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    return _dist().get_rank() if _dist() else 0


def world() -> int:
    return _dist().get_world_size() if _dist() else 1


def all_sum(tensor):
    if _dist():
        _dist().all_reduce(tensor)
    return tensor


def global_count(count: Callable, chunk: list[dict], device):
    """What the method normalizes a step's loss by (Method.count: SFT's trained tokens, DPO's pairs) over the whole
    global batch (all ranks, all micro-batches of the step): each micro-batch loss is its sum over this number, the
    Trainer's normalization (average_tokens_across_devices)."""
    return all_sum(count(chunk).to(device, non_blocking=True))  # a host count (DPO's): no wait for the device


def method_context(cfg, device, unwrap: Callable, autocast: Callable, *, resumed: bool,
                   step: Callable[[], int] | None = None):
    """What a path lends the run's method (finetune.methods.base.Context): this module's collectives, rank 0's print,
    the run's one-message exit, the optimizer steps done."""
    return Context(cfg, device, unwrap, autocast, resumed=resumed, log=rank0_print, all_sum=all_sum, rank=rank,
                   world=world, fail=exit_with, hash_path=_hash_path, step=step or (lambda: 0))


# ----------------------------------------------------------------------------------------------
# log_history, as the Trainer writes it.


@dataclass
class LogWindow:
    """The Trainer's logging window (Trainer._maybe_log_save_evaluate): every logging_steps optimizer steps one
    entry {loss: mean of the window's step losses, grad_norm and learning_rate of its last step, epoch: fractional
    (micro-batches done / per epoch), step}; a partial window at the end is not logged; then one summary entry.
    Its state (history and the open window) travels in the checkpoint position, so a resumed run logs what the
    uninterrupted run logs.

    A step's loss, grad norm and token count may be device tensors of this rank: they are summed where they are and
    read (reduced over ranks by `reduce`, then copied to the host) only when an entry is logged or the state saved,
    as the Trainer keeps its loss on the device between logs. A step that does not log waits for no device."""

    every: int
    enabled: bool = True
    first_step: bool = False
    history: list = field(default_factory=list)
    loss: object = 0.0  # this rank's sum over the open window (a float, or a device tensor), reduced when logged
    steps: int = 0
    session_loss: object = 0.0
    session_steps: int = 0
    started: float = field(default_factory=time.time)
    count_tokens: bool = False  # --include_num_input_tokens_seen: the Trainer's num_input_tokens_seen and speed
    tokens_seen: int = 0
    session_tokens: int = 0
    reduce: Callable | None = None  # sums a tensor over ranks (collective: every rank reads at the same steps)
    main: bool = True  # rank 0 (a resumed window's global sum is rank 0's share)
    pending_tokens: object = 0  # this rank's tokens since the last read (an int or a device tensor)
    device: object = None  # where `reduce` sums (the path's device)

    @classmethod
    def for_run(cls, args, max_steps: int, state: dict | None = None, reduce: Callable | None = None,
                main: bool = True, device=None) -> "LogWindow":
        every = args.logging_steps
        every = math.ceil(max_steps * every) if every < 1 else int(every)  # a ratio of the run, as the Trainer
        log = cls(every=max(every, 1), enabled=_value(args.logging_strategy) == "steps",
                  first_step=args.logging_first_step,
                  count_tokens=_value(getattr(args, "include_num_input_tokens_seen", "no")) not in ("no", False),
                  reduce=reduce, main=main, device=device)
        if state:
            log.history, (loss, log.steps) = state["log_history"], state["window"]
            log.loss = loss if main else 0.0  # saved reduced over ranks: one rank holds it
            log.tokens_seen = state.get("tokens_seen", 0)
        return log

    def _read(self, value) -> float:
        """A window sum as a float: reduced over ranks, copied to the host (a sync, at logging steps only)."""
        if self.reduce is None:
            return float(value)
        import torch

        if not hasattr(value, "item"):  # nothing added on this rank since the last read: its share is a number
            value = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        return self.reduce(value.detach().clone()).item()

    def state(self) -> dict:
        self._flush_tokens()
        return {"log_history": self.history, "window": [self._read(self.loss), self.steps],
                "tokens_seen": self.tokens_seen}

    def count(self, chunk: list[dict], device) -> None:
        """The step's real input tokens (the Trainer's include_num_input_tokens_seen "non_padding"), summed where they
        are; all ranks' at the next log."""
        if self.count_tokens:
            for b in chunk:
                mask = b.get("attention_mask")  # a 4-D one (a sequence-parallel slice's) is no padding mask
                self.pending_tokens = self.pending_tokens + (mask.sum() if mask is not None and mask.dim() == 2
                                                             else b["input_ids"].numel())

    def _flush_tokens(self) -> None:
        if self.count_tokens:
            n = int(self._read(self.pending_tokens))
            self.pending_tokens = 0
            self.tokens_seen, self.session_tokens = self.tokens_seen + n, self.session_tokens + n

    def _speed(self, entry: dict, train: bool) -> None:
        # What Trainer.log adds: the tokens seen, and on training entries the session's runtime and tokens/s.
        if self.count_tokens:
            self._flush_tokens()
            entry["num_input_tokens_seen"] = self.tokens_seen
            if train:
                runtime = time.time() - self.started
                entry["train_runtime"] = round(runtime, 4)
                entry["train_tokens_per_second"] = round(self.session_tokens / runtime, 3) if runtime > 0 else 0.0

    def add(self, step: int, loss, learning_rate: float, grad_norm, epoch: float, metrics=None) -> dict | None:
        """The step's loss (this rank's share of it, a float or a tensor) and grad norm; the entry when it logs."""
        loss = loss.detach() if hasattr(loss, "detach") else loss
        self.loss, self.steps = self.loss + loss, self.steps + 1
        self.session_loss = self.session_loss + (loss.double() if hasattr(loss, "double") else loss)
        self.session_steps += 1
        if not (self.enabled and (step % self.every == 0 or (self.first_step and step == 1))):
            return None
        entry = {"loss": self._read(self.loss) / self.steps}
        if grad_norm is not None:
            entry["grad_norm"] = float(grad_norm)
        entry.update(learning_rate=learning_rate, **(metrics() if metrics is not None else {}), epoch=epoch)
        self._speed(entry, train=True)
        entry["step"] = step
        self.history.append(entry)
        self.loss, self.steps = 0.0, 0
        return entry

    def add_eval(self, metrics: dict, step: int, epoch: float) -> dict:
        entry = {**metrics, "epoch": epoch}
        self._speed(entry, train=False)
        entry["step"] = step
        self.history.append(entry)
        return entry

    def finish(self, step: int, epoch: float, samples_per_step: int) -> None:
        """The Trainer's closing entry (its speed metrics and train_loss: the mean step loss of this session)."""
        self._flush_tokens()
        runtime, n = time.time() - self.started, self.session_steps
        entry = {"train_runtime": round(runtime, 4)}
        if runtime > 0:
            entry.update(train_samples_per_second=round(n * samples_per_step / runtime, 3),
                         train_steps_per_second=round(n / runtime, 3))
        entry.update(train_loss=self._read(self.session_loss) / max(n, 0.001), epoch=epoch, step=step)
        self.history.append(entry)


def trainer_state(log: LogWindow, step: int, max_steps: int, evaluator=None) -> dict:
    state = {"global_step": step, "max_steps": max_steps, "logging_steps": log.every, "log_history": log.history}
    if evaluator is not None:
        state.update({k: v for k, v in evaluator.state().items() if k != "patience_counter"},
                     eval_steps=evaluator.every, num_input_tokens_seen=log.tokens_seen)
    return state


# ----------------------------------------------------------------------------------------------
# The training loop: epochs of micro-batches, one optimizer step per gradient_accumulation_steps of them.


@dataclass
class Position:
    """Where a run stands; saved with every checkpoint and read back at resume."""

    step: int = 0
    epoch: int = 0
    micro_done: int = 0  # micro-batches of `epoch` already trained (this rank)
    log: dict | None = None
    evaluation: dict | None = None  # the best metric so far and early stopping's count (finetune.training.evaluate)

    def to_json(self, args, log: LogWindow, evaluator=None) -> dict:
        return {"global_step": self.step, "epoch": self.epoch, "micro_batches_done_in_epoch": self.micro_done,
                "data": {"world_size": world(), "per_device_train_batch_size": args.per_device_train_batch_size,
                         "seed": data_seed(args), "drop_last": args.dataloader_drop_last},
                **log.state(), "evaluation": evaluator.state() if evaluator is not None else None}

    @classmethod
    def read(cls, folder: Path | None) -> "Position":
        if folder is None:
            return cls()
        p = json.loads((Path(folder) / POSITION).read_text())
        return cls(p["global_step"], p["epoch"], p["micro_batches_done_in_epoch"],
                   {"log_history": p["log_history"], "window": p["window"], "tokens_seen": p.get("tokens_seen", 0)},
                   p.get("evaluation"))


@dataclass
class TrainingPath:
    """A hand-written training path as train() runs it: its name ("loop", "engine") and ZeRO stage (for the
    checkpoint marker), its device, and its functions.

    step(chunk, n_items) -> (this rank's loss sum as a tensor, the learning rate the step used, grad norm): one
    optimizer step over this rank's micro-batches, n_items what the global batch's loss is normalized by (the
    method's count, all ranks). save(folder, position) writes the engine's checkpoint files."""

    name: str
    zero_stage: int
    step: Callable
    save: Callable
    device: object
    count: Callable  # count(chunk): this rank's share of n_items (finetune.methods' Method.count)
    fingerprint: dict | None = None  # the run's (finetune.training.lifecycle.run_fingerprint), for the checkpoint marker
    evaluator: object = None  # finetune.training.evaluate.Evaluator: when to evaluate, the best model, early stopping
    load: Callable | None = None  # load(folder): a checkpoint's weights back into the model (the best, at the end)
    reporters: object = None  # finetune.training.evaluate.Reporters: --report_to (TensorBoard, ...)
    # metrics() -> {name: value} of the logging window, added to each logged entry (DPO's rewards); every rank calls
    # it at the same steps, so it may reduce over ranks.
    metrics: Callable | None = None
    position: "Position | None" = None  # where the run stands, once train() has read it (a method's Context.step)
    fsdp: int = 0  # the FSDP version the path shards with (0: none), for the checkpoint marker
    sequence_parallel: int = 1  # ranks that train slices of the same rows (--sequence_parallel_size): one sample


def _show(entry: dict) -> None:
    rank0_print({k: round(v, 6) if isinstance(v, float) else v for k, v in entry.items()})


def train(args, path: TrainingPath, loader, micro_per_epoch: int, max_steps: int,
          resume: Path | None) -> tuple[LogWindow, Position]:
    """Run from the resumed position (or step 0) to max_steps, or until early stopping; evaluates, checkpoints every
    --save_steps, and with --load_best_model_at_end ends with the best checkpoint's weights in the model."""
    pos = path.position = Position.read(resume)
    log = LogWindow.for_run(args, max_steps, pos.log, reduce=all_sum, main=rank() == 0, device=path.device)
    ev = path.evaluator
    if ev is not None:
        ev.load(pos.evaluation)
    save_every = checkpoint.save_interval(args, max_steps)
    accum, skip = args.gradient_accumulation_steps, pos.micro_done
    stop = False

    def report(entry: dict) -> None:
        _show(entry)
        if path.reporters is not None:
            path.reporters.log(entry)

    def evaluate(epoch: float) -> bool:
        metrics = ev.run()
        report(log.add_eval(metrics, pos.step, epoch))
        return ev.record(metrics, pos.step)

    while pos.step < max_steps and not stop:
        set_epoch(loader, pos.epoch)
        batches = iter(loader)
        pos.micro_done = 0
        if skip:
            # Mid-epoch resume: the uninterrupted run's micro-batches, in its order; then its RNG states as they
            # were after the saved step (creating the iterator above drew from the RNG once more).
            for _ in zip(range(skip), batches):
                pass
            pos.micro_done, skip = skip, 0
            checkpoint.load_rng(resume, rank())
        while pos.micro_done < micro_per_epoch and pos.step < max_steps:
            # The epoch's last step may have fewer micro-batches (as the Trainer's).
            chunk = [next(batches) for _ in range(min(accum, micro_per_epoch - pos.micro_done))]
            pos.micro_done += len(chunk)
            # Counted first: a method that generates makes the step's completions there (their tokens are seen).
            n_items = global_count(path.count, chunk, path.device)
            log.count(chunk, path.device)
            loss, lr, grad_norm = path.step(chunk, n_items)
            pos.step += 1
            faults.stop_point(pos.step)
            epoch = pos.epoch + pos.micro_done / micro_per_epoch
            # The loss and grad norm stay on the device until a step logs (no sync in the others).
            entry = log.add(pos.step, loss.detach().float(), float(lr), grad_norm, epoch, path.metrics)
            if entry is not None:
                report(entry)
            # Then evaluate, then save: the Trainer's order (_maybe_log_save_evaluate).
            if ev is not None and ev.due_after_step(pos.step):
                stop = evaluate(epoch)
            if save_every and pos.step % save_every == 0 and pos.step < max_steps:
                if ev is not None:
                    ev.saving(args.output_dir, pos.step)
                save_checkpoint(args, path, pos.to_json(args, log, ev))
            if stop:
                break
        if pos.micro_done >= micro_per_epoch:
            pos.epoch += 1
            if ev is not None and ev.due_after_epoch() and not stop:
                stop = evaluate(float(pos.epoch))
    if ev is not None and (best := ev.best_to_load(pos.step)) is not None:
        rank0_print(f"loading the best model: {best.name} ({args.metric_for_best_model or 'loss'} {ev.best_metric})")
        path.load(best)
    log.finish(pos.step, pos.epoch + pos.micro_done / micro_per_epoch if pos.micro_done < micro_per_epoch
               else float(pos.epoch), args.per_device_train_batch_size * accum * world() // path.sequence_parallel)
    if path.reporters is not None:
        path.reporters.log(log.history[-1])
        path.reporters.close()
    return log, pos


def set_epoch(loader, epoch: int) -> None:
    # A prepared DataLoaderShard has set_epoch; a plain DataLoader's DistributedSampler is reached directly.
    (loader if hasattr(loader, "set_epoch") else loader.sampler).set_epoch(epoch)


def save_checkpoint(args, path: TrainingPath, position: dict) -> None:
    """All ranks: the engine's files (write), this rank's RNG states and, from rank 0, the data position and log
    window; then the completion marker once every rank is done."""
    folder = checkpoint.folder_for(args.output_dir, position["global_step"])
    with saving(folder, f"checkpoint {folder.name}", partial=folder):
        path.save(folder, position)
        checkpoint.save_rng(folder, rank())
        if rank() == 0:
            write_json_atomic(folder / POSITION, position)
        checkpoint.mark_complete(folder, path=path.name, world_size=world(), zero_stage=path.zero_stage, fsdp=path.fsdp,
                                 global_step=position["global_step"], fingerprint=path.fingerprint,
                                 sequence_parallel=path.sequence_parallel)


# ----------------------------------------------------------------------------------------------
# The final save.


def consolidated_state_dict(ds_engine, module, accelerator=None):
    """Under ZeRO-3 or FSDP2 (collective): the whole state dict on rank 0, gathered from every rank's partition or
    shard (under ZeRO-3 for an adapter only the trainable LoRA weights; FSDP2's is the whole model's, which the
    adapter's save picks its weights from). None otherwise: the module holds its whole weights."""
    if accelerator is not None and getattr(accelerator, "is_fsdp2", False):
        return accelerator.get_state_dict(module)  # collective: every shard gathered, onto rank 0's CPU
    if ds_engine is None or ds_engine.zero_optimization_stage() != 3:
        return None
    return compat.zero3_consolidated_state_dict(ds_engine, exclude_frozen_parameters=hasattr(module, "peft_config"))


def save_processor(tokenizer, folder) -> None:
    """A vision-language model's processor beside its tokenizer, so the folder reloads with AutoProcessor."""
    from finetune.data.images import processor_of

    if processor_of(tokenizer) is not None:
        processor_of(tokenizer).save_pretrained(folder)


def save_final_module(module, state_dict, tokenizer, output_dir, state: dict, cfg=None) -> None:
    """Every rank: model (or adapter) + tokenizer + trainer_state.json written to a staging folder, verified to
    reload to the same logits, then moved in with config.json / adapter_config.json last, so a crash never leaves a
    folder that looks complete but is not. Under ZeRO-3 the gathered state dict is the reference, else the module."""
    from finetune.models.verify import VerificationError

    staging, main = staging_dir(output_dir), rank() == 0
    if main:
        shutil.rmtree(staging, ignore_errors=True)
        from finetune.models.load import set_use_cache

        set_use_cache(module.config, True)  # turned off for training; the saved model is for inference
        with saving(staging, "the final model", partial=staging):
            module.save_pretrained(staging, state_dict=state_dict)
            tokenizer.save_pretrained(staging)
            save_processor(tokenizer, staging)
            write_json_atomic(staging / "trainer_state.json", state)
            if cfg is not None:
                write_resolved(cfg, staging)
    try:
        verify_staged(staging, state_dict if state_dict is not None else module, is_main=main)
    except VerificationError as e:
        exit_with(str(e))
    if main:
        commit_staged(staging, output_dir)
    if _dist():
        _dist().barrier()
    rank0_print(f"saved to {output_dir}")
