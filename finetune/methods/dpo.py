"""DPO (--method dpo, docs/preference.md): a preference loss over the pairs of finetune.data.preference (--loss_type:
sigmoid, hinge, ipo, robust, as TRL's DPOTrainer names them; LOSSES below).

A micro-batch holds whole pairs: rows [chosen of pair 0..n-1, rejected of pair 0..n-1] (PairCollator), scored in
one forward. With a vision-language model, pairs may hold images (TRL's vision preference format, docs/vision.md):
VisionPairCollator adds what the processor makes of each row's prompt images, and every forward, the policy's and the
reference's, gets it (finetune.data.preference.model_inputs). A sequence's log-probability is the sum over its
completion's trained tokens (labels != -100) of log p(token | everything before it). With β = --beta and ε = --label_smoothing, per pair:

    d    = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    loss = -(1 - ε) log σ(β d) - ε log σ(-β d)                       (sigmoid, the default; conservative DPO for ε > 0)

and a step minimizes the mean over the pairs of the GLOBAL batch (all ranks, all micro-batches): each micro-batch
contributes its pairs' loss sum over that count, as the SFT loss divides token sums by the global token count.
The reference is the LoRA model with its adapters disabled, a frozen copy of the model (full fine-tuning; under
ZeRO-3 loaded again partitioned, in an engine of its own), or log-probabilities computed once before training
(--precompute_ref_log_probs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from finetune.errors import did_you_mean
from finetune.methods.base import Context, Examples, Method, MethodConfig, PlannerTerms, Session, Window

# torch and the data modules are imported in the functions: the parser reads this module's flags, and a flag
# mistake is reported before they are imported.

# Logged per logging window: TRL's names, so dashboards read them alike.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


# ----------------------------------------------------------------------------------------------
# The loss types (--loss_type, TRL's DPOConfig.loss_type names). Each: per-pair losses of the pairs' log-ratios to the
# reference (summed over the completion's trained tokens), their trained token counts, β and ε.


def sigmoid_loss(chosen_ratio, rejected_ratio, lengths, beta: float, label_smoothing: float):
    """DPO: -log σ(β d); with ε > 0 conservative DPO, -(1 - ε) log σ(β d) - ε log σ(-β d). (TRL 1.16's "sigmoid"
    ignores label_smoothing; its older versions and the cDPO note apply it, as here: docs/preference.md.)"""
    import torch.nn.functional as F

    d = beta * (chosen_ratio - rejected_ratio)
    return -(1 - label_smoothing) * F.logsigmoid(d) - label_smoothing * F.logsigmoid(-d)


def hinge_loss(chosen_ratio, rejected_ratio, lengths, beta: float, label_smoothing: float):
    """SLiC's hinge: max(0, 1 - β d)."""
    import torch

    return torch.relu(1 - beta * (chosen_ratio - rejected_ratio))


def ipo_loss(chosen_ratio, rejected_ratio, lengths, beta: float, label_smoothing: float):
    """IPO (Azar et al. 2023, eq. 17; β is its τ): (d' - 1 / (2β))², d' of the log-ratios averaged over each
    completion's tokens, as TRL (the IPO authors' normalization)."""
    chosen_tokens, rejected_tokens = lengths
    d = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
    return (d - 1 / (2 * beta)) ** 2


def robust_loss(chosen_ratio, rejected_ratio, lengths, beta: float, label_smoothing: float):
    """Robust DPO (Chowdhury et al. 2024): an unbiased loss when a share ε of the labels is flipped,
    (-(1 - ε) log σ(β d) + ε log σ(-β d)) / (1 - 2ε)."""
    import torch.nn.functional as F

    d = beta * (chosen_ratio - rejected_ratio)
    return (-(1 - label_smoothing) * F.logsigmoid(d) + label_smoothing * F.logsigmoid(-d)) / (1 - 2 * label_smoothing)


LOSSES = {"sigmoid": sigmoid_loss, "hinge": hinge_loss, "ipo": ipo_loss, "robust": robust_loss}
# The loss types that read --label_smoothing (the others refuse it rather than ignore it).
SMOOTHED = ("sigmoid", "robust")


@dataclass
class DPOConfig(MethodConfig):
    """DPO's flags (--method dpo; docs/preference.md)"""

    beta: float = field(
        default=0.1,
        metadata={"help": "DPO: how far the model may move from the reference (higher keeps it closer); the "
                          "rewards logged are beta x log(policy / reference) of each completion."},
    )
    # A plain string: --loss_type is one flag shared with GRPO, whose names differ; validate() checks DPO's.
    loss_type: str = field(
        default="sigmoid",
        metadata={"help": "DPO: the loss of each pair's log-ratio margin, as TRL names it: sigmoid (DPO), hinge "
                          "(SLiC), ipo (IPO, length-normalized), robust (Robust DPO, with --label_smoothing)."},
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "DPO: the share of pairs assumed mislabelled, in [0, 0.5): conservative DPO with "
                          "--loss_type sigmoid, the flip rate of --loss_type robust."},
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "DPO: compute the reference log-probabilities once before training and cache them with "
                          "the tokenized data, instead of a reference forward every step (full fine-tuning then "
                          "keeps no reference copy)."},
    )



def loss_type_problems(loss_type: str, label_smoothing: float, losses, smoothed) -> list[str]:
    """--loss_type one of a method's `losses` (did-you-mean), and --label_smoothing in [0, 0.5) with a type that
    reads it (one of `smoothed`): DPO's and CPO's checks."""
    problems = []
    if loss_type not in losses:
        problems.append(f"loss_type: '{loss_type}' is not one of {', '.join(losses)}"
                        f"{did_you_mean(loss_type, list(losses))}")
    if not 0.0 <= label_smoothing < 0.5:
        problems.append(f"label_smoothing: must be in [0, 0.5), got {label_smoothing}")
    elif label_smoothing and loss_type in losses and loss_type not in smoothed:
        problems.append(f"label_smoothing: --loss_type {loss_type} does not use it; leave it out or use "
                        f"--loss_type {' or '.join(smoothed)}")
    return problems


def pair_data_problems(method: str, data, training: dict, evaluation, hints: dict | None = None) -> list[str]:
    """What the preference data paths do not support yet, refused by name for every method that trains on
    preference data (DPO, SimPO, ORPO, KTO)."""
    problems = []
    for flag, on in (("packing", data.packing), ("padding_free", data.padding_free),
                     ("eval_generate", bool(evaluation and evaluation.eval_generate)),
                     ("label_smoothing_factor", bool(training.get("label_smoothing_factor"))),
                     ("use_liger_kernel", bool(training.get("use_liger_kernel"))),
                     ("remove_unused_columns", bool(training.get("remove_unused_columns")))):
        if on:
            problems.append(f"{flag}: not supported with --method {method} yet{(hints or {}).get(flag, '')}")
    return problems


class DPO(Method):
    name = "dpo"
    title = "DPO"
    summary = "Direct Preference Optimization on {prompt, chosen, rejected} pairs (docs/preference.md)"
    config = DPOConfig
    paths = ("trainer", "loop")  # the engine path (scripts/sft.py) is not written for pairs yet
    own_evaluation = True
    metrics = METRICS
    unit = "pairs"

    def validate(self, options: DPOConfig, data, training: dict, evaluation) -> list[str]:
        """DPO's flags; what DPO does not support yet is refused by name."""
        problems = []
        if options.beta <= 0:
            problems.append(f"beta: must be positive, got {options.beta}")
        problems += loss_type_problems(options.loss_type, options.label_smoothing, LOSSES, SMOOTHED)
        return problems + pair_data_problems("dpo", data, training, evaluation,
                                             hints={"label_smoothing_factor": " (DPO's own is --label_smoothing)"})

    def eval_metrics(self, evaluation) -> list[str]:  # evaluate's
        return ["loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected"]

    def prepare(self, data, tokenizer, *, local_rank: int, log, seed: int = 42):
        from finetune.data.preference import prepare_pairs

        # Image pairs too (TRL's vision preference format) with a vision-language model (docs/vision.md).
        return prepare_pairs(data, tokenizer, local_rank=local_rank, log=log, seed=seed, images=True)

    def examples(self, dataset, key: str | None) -> Examples:
        """The pairs numbered (`pair_index`: where their precomputed reference log-probs are)."""
        return Examples(dataset.add_column("pair_index", list(range(len(dataset)))), key)

    def collator(self, cfg, tokenizer):
        from finetune.data.preference import pair_collator

        return pair_collator(tokenizer, images=True)

    def count(self, batches: list[dict]):
        """The pairs (a step's loss is the mean over the pairs of the global batch, not over its tokens)."""
        import torch

        return torch.tensor(pair_count(batches))

    def setup(self, options: DPOConfig, model, tokenizer, examples: list[Examples | None], collator,
              context: Context) -> Session:
        # The frozen copy of full fine-tuning is taken here, before any update.
        return DPOSession(options, Reference(context, options, model, examples, collator))

    def planner_terms(self, options: DPOConfig, *, use_peft: bool) -> PlannerTerms:
        copy = not use_peft and not options.precompute_ref_log_probs
        what = ("a frozen copy of the model" if copy else "the base, adapters disabled (no copy)" if use_peft
                else "precomputed log-probabilities (no copy)")
        return PlannerTerms(pairs=True, reference_copy=copy, note=f"; DPO: 2 rows per pair, reference {what}")


class DPOSession(Session):
    def __init__(self, options: DPOConfig, reference: "Reference"):
        self.options, self.reference, self.window = options, reference, Metrics()

    def loss(self, model, batch: dict, n_items):
        r = self.reference
        return micro_batch_loss(model, r.prepare(batch), r.logps, self.options, n_items, self.window,
                                r.context.autocast)

    def metrics(self, reduce=None) -> dict:
        return self.window.pop(reduce)

    def evaluate(self, model, examples: Examples, batch_size: int, *, prefix: str = "eval") -> dict:
        return pair_metrics(model, self.reference, examples, batch_size, self.options, prefix=prefix)

    def describe(self) -> str:
        return self.reference.describe()


# ----------------------------------------------------------------------------------------------
# The loss.


def scored_positions(labels):
    """The positions whose logits predict a trained token (label at p + 1), as one range for every row: the
    model's logits_to_keep, so prompts get no logits. Found on the device (a sync): the pair collator's batches carry
    them, found on the host (finetune.data.preference.scored)."""
    import torch

    from finetune.data.prepare import IGNORE_INDEX

    trained = (labels[:, 1:] != IGNORE_INDEX).any(0).nonzero().squeeze(1)
    return torch.arange(int(trained.min()), int(trained.max()) + 1, device=labels.device)


def completion_logps(logits, labels, positions, index=None):
    """Per row: the sum of log p(label[p + 1]) over `positions` p (the logits' columns) with a trained label.
    `index`: the flat indices of those targets in [rows x positions] (from the host); else found here (a sync)."""
    import torch

    from finetune.data.prepare import IGNORE_INDEX

    targets = labels[:, positions + 1]
    if index is None:
        index = (targets != IGNORE_INDEX).reshape(-1).nonzero().squeeze(1)
    index = index.to(logits.device, non_blocking=True)
    rows = logits.reshape(-1, logits.shape[-1]).index_select(0, index).float()  # the scored positions in float32
    picked = rows.gather(1, targets.reshape(-1).index_select(0, index)[:, None]).squeeze(1) \
        - torch.logsumexp(rows, dim=-1)
    out = torch.zeros(labels.shape[0], dtype=picked.dtype, device=picked.device)
    return out.index_add(0, torch.div(index, targets.shape[1], rounding_mode="floor"), picked)


def sequence_logps(model, batch: dict):
    """The completion log-probability of every row of a pair batch under `model` (grad where enabled). The model
    gets the batch's tokens and attention mask, and what else the collator gave it (a vision-language model's pixel
    values, image grids, token types: finetune.data.preference.model_inputs)."""
    from finetune.data.preference import SCORED_INDEX, SCORED_POSITIONS, model_inputs

    labels = batch["labels"]
    positions = batch.get(SCORED_POSITIONS)
    positions = scored_positions(labels) if positions is None else positions.to(labels.device, non_blocking=True)
    out = model(**model_inputs(batch), logits_to_keep=positions, use_cache=False)
    return completion_logps(out.logits, labels, positions, batch.get(SCORED_INDEX))


def pair_logps(model, tokenizer, records: list[dict], *, batch_size: int = 16, max_seq_length: int = 512,
               where: str = "pair"):
    """[pairs, 2] float64: the completion log-probabilities (chosen, rejected) of each preference record under
    `model`, tokenized, truncated and scored exactly as training scores them (pair_features, PairCollator,
    sequence_logps), without gradients. The held-out preference accuracy is the share of rows whose
    chosen log-probability is the higher."""
    import torch

    from finetune.data.preference import PAIR_COLUMNS, PairCollator, pair_features

    features = [dict(zip(PAIR_COLUMNS, pair_features(tokenizer, record, f"{where} {i + 1}", max_seq_length)[0]))
                for i, record in enumerate(records)]
    collate = PairCollator(tokenizer.pad_token_id)
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for start in range(0, len(features), batch_size):
            batch = {k: v.to(device) for k, v in collate(features[start:start + batch_size]).items()}
            out.append(torch.stack(sequence_logps(model, batch).double().chunk(2), dim=1).cpu())
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.float64)


class Metrics(Window):
    """Sums of the window's rewards, margins, accuracies and log-probs (this rank), reduced and averaged at log time."""

    def __init__(self):
        super().__init__(METRICS)

    def add(self, chosen, rejected, reward_chosen, reward_rejected) -> None:
        import torch

        values = torch.stack([reward_chosen.sum(), reward_rejected.sum(), (reward_chosen - reward_rejected).sum(),
                              (reward_chosen > reward_rejected).sum().to(reward_chosen.dtype),
                              chosen.detach().sum(), rejected.detach().sum(),
                              reward_chosen.new_full((), float(len(chosen)))])  # a fill, not a host copy
        super().add(values.double())


def pair_count(batches: list[dict]) -> int:
    return sum(int(b["input_ids"].shape[0]) // 2 for b in batches)


def reference_context(model):
    """What makes `model` the reference: its LoRA adapters disabled (no second copy). A plain model has none."""
    if hasattr(model, "disable_adapter") and getattr(model, "peft_config", None):
        return model.disable_adapter()
    return contextlib.nullcontext()


def micro_batch_loss(policy, batch: dict, reference, options: DPOConfig, n_pairs, metrics: Metrics | None = None,
                     autocast=contextlib.nullcontext):
    """This micro-batch's pairs' loss sum over `n_pairs` (the pairs of the global batch). `policy` is the (wrapped)
    model trained; `reference` computes the reference log-probs of the batch (a callable), unless the batch carries
    them (`ref_logps`, precomputed)."""
    import torch

    from finetune.data.prepare import IGNORE_INDEX

    if "ref_logps" in batch:
        ref = batch["ref_logps"]
    else:
        # Before the policy's forward: the reference's logits are gone before the policy's activations pile up.
        with torch.no_grad(), autocast():
            ref = reference(batch)
    logps = sequence_logps(policy, batch)
    ref = ref.to(logps.device, logps.dtype)
    chosen, rejected = logps.chunk(2)
    chosen_ratio, rejected_ratio = (logps - ref).chunk(2)
    tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1).to(logps.dtype).chunk(2)
    losses = LOSSES[options.loss_type](chosen_ratio, rejected_ratio, tokens, options.beta, options.label_smoothing)
    # TRL's rewards: β × the log-ratio, whatever the loss type.
    reward_chosen, reward_rejected = (options.beta * chosen_ratio).detach(), (options.beta * rejected_ratio).detach()
    if metrics is not None:
        metrics.add(chosen, rejected, reward_chosen, reward_rejected)
    return losses.sum() / n_pairs


# ----------------------------------------------------------------------------------------------
# The reference: live (adapters disabled, or a frozen copy), or precomputed once and cached.


@contextlib.contextmanager
def eval_mode(module):
    """Score as at inference (no dropout), then back to training mode."""
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


def precompute(module, dataset, collator, batch_size: int, device, autocast=contextlib.nullcontext,
               rank: int = 0, world: int = 1, log=print):
    """[pairs, 2] reference log-probs (chosen, rejected) of every pair, under the reference of `module` (its
    adapters disabled). Rank r scores pairs r, r + W, ...; every rank runs as many forwards (ZeRO-3 gathers the
    weights collectively in each), then the rows are summed over ranks."""
    import math

    import torch
    import torch.distributed as dist

    n = len(dataset)
    mine = list(range(rank, n, world))
    steps = math.ceil(math.ceil(n / world) / batch_size)
    out = torch.zeros(n, 2, dtype=torch.float64, device=device)
    log(f"dpo: computing the reference log-probabilities of {n} pairs once ({steps} forwards per rank)")
    with torch.no_grad(), eval_mode(module), reference_context(module):
        for s in range(steps):
            idx = mine[s * batch_size:(s + 1) * batch_size]
            batch = collator([dataset[i] for i in (idx or [0])])
            batch = {k: v.to(device) for k, v in batch.items() if k != "pair_index"}
            with autocast():
                logps = sequence_logps(module, batch).double()
            if idx:
                out[torch.tensor(idx, device=device)] = torch.stack(logps.chunk(2), dim=1)
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(out)
    return out.cpu()


def ref_cache_file(cfg, data_key: str, hash_path) -> Path:
    """Where a data set's reference log-probs are cached: beside its tokenized pairs, keyed by the base weights
    (`hash_path`: their content hash) and what changes their numbers (dtype, quantization, mixed precision,
    attention kernel)."""
    import hashlib

    from finetune.data.prepare import cache_root

    m, args = cfg.model, cfg.training
    parts = (hash_path(m.model_name_or_path, ("config.json", "*.safetensors", "*.bin")), m.torch_dtype,
             m.load_in_8bit, m.load_in_4bit, m.bnb_4bit_quant_type, m.attn_implementation, bool(args.bf16),
             bool(args.fp16), str(cfg.preset.path or ""))
    h = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    return Path(cache_root(cfg.data)) / f"{data_key}.ref-{h}.pt"


def load_or_precompute(context: Context, data_key: str, module, dataset, collator):
    """The cached reference log-probs, or computed now (before the first update) and cached. A full fine-tuning
    run resumed without them cannot recompute them: its weights have moved."""
    import os

    import torch

    cfg, device, log = context.cfg, context.device, context.log
    path = ref_cache_file(cfg, data_key, context.hash_path)
    # Every rank decides alike (a node without the cached file would otherwise score alone and wait forever).
    cached = int(context.all_sum(torch.tensor(int(path.is_file()), device=device)).item()) == context.world()
    if cached:
        log(f"dpo: reference log-probabilities from the cache ({path})")
        return torch.load(path, weights_only=True)
    if context.resumed and not cfg.model.use_peft:
        context.fail(f"--precompute_ref_log_probs: resuming, but the reference log-probabilities are gone from the "
                     f"cache ({path}), and the model has been trained since; restart without --resume_from_checkpoint")
    table = precompute(module, dataset, collator, cfg.training.per_device_train_batch_size, device, context.autocast,
                       context.rank(), context.world(), log)
    if context.rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(table, tmp)
        os.replace(tmp, path)
    return table


def frozen_copy(model):
    """Full fine-tuning's reference: a frozen copy of the model as loaded (before any update)."""
    import copy

    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


def reference_ds_config(policy: dict, hidden_size: int) -> dict:
    """The policy's (filled) DeepSpeed config for an engine that only runs forwards: no optimizer, scheduler or
    optimizer offload; its own parameter partition kept in memory (the policy's NVMe swap folder is not shared);
    the size settings the Trainer fills from the model later set as it would (transformers' hidden-size rules)."""
    import copy

    config = copy.deepcopy(policy)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if zero.get("offload_param", {}).get("device") == "nvme":
        zero.pop("offload_param")
    for key, value in (("reduce_bucket_size", hidden_size * hidden_size),
                       ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
                       ("stage3_param_persistence_threshold", 10 * hidden_size)):
        if zero.get(key) == "auto":
            zero[key] = value
    return config


def partitioned_copy(cfg):
    """Full fine-tuning's reference under ZeRO-3: the weights loaded again, partitioned over the ranks as the
    policy's are (a deepcopy would copy empty partitions), in a DeepSpeed engine of its own that gathers each
    layer's parameters for its forward and frees them after. Every rank calls it at the same point."""
    import deepspeed
    from transformers import AutoConfig
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, set_hf_deepspeed_config

    from finetune.models.load import load_model

    policy = cfg.training.hf_deepspeed_config
    model_config = AutoConfig.from_pretrained(cfg.model.model_name_or_path,
                                              trust_remote_code=cfg.model.trust_remote_code)
    config = reference_ds_config(policy.config, model_config.get_text_config().hidden_size)
    ref_hf = HfDeepSpeedConfig(config)  # registered: from_pretrained loads under zero.Init with this config
    try:
        model = load_model(cfg.model, None)
    finally:
        set_hf_deepspeed_config(policy)
    del ref_hf
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # DeepSpeedEngine.eval returns None
    return engine


def partition_share(module) -> tuple[int, int]:
    """(parameters held by this rank, parameters of the model) of a ZeRO-3 partitioned module."""
    params = list(module.parameters())
    return sum(p.ds_tensor.numel() for p in params), sum(p.ds_numel for p in params)


class Reference:
    """The reference of a run, the same on every path. `context.unwrap()` gives the trained module (the engine's,
    once prepared): with LoRA its adapters are switched off to score; full fine-tuning scores with a frozen copy
    made here (before any update); --precompute_ref_log_probs scores every pair of every set once, at the first step
    (when the engine can run the model, and before any update), or reads them from the cache."""

    def __init__(self, context: Context, options: DPOConfig, model, sets: list[Examples | None], collator):
        cfg = context.cfg
        self.context, self.options = context, options
        self.sets, self.collator = [p for p in sets if p is not None], collator
        self.precompute = options.precompute_ref_log_probs
        self.copy, self.partitioned = None, False
        if not cfg.model.use_peft and not self.precompute:
            from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

            self.partitioned = is_deepspeed_zero3_enabled()
            self.copy = partitioned_copy(cfg) if self.partitioned else frozen_copy(model)
        self.tables: dict = {}
        self.placed = False

    @property
    def device(self):
        return self.context.device

    def describe(self) -> str:
        if self.precompute:
            what = "log-probabilities computed once before training, cached with the tokenized data"
        elif self.partitioned:
            held, total = partition_share(self.copy.module)
            what = (f"a frozen copy of the model, partitioned by ZeRO-3 like the policy ({held:,} of its {total:,} "
                    "parameters on this rank; each layer gathered for its forward)")
        elif self.copy is not None:
            what = "a frozen copy of the model (full fine-tuning: a second set of weights in memory)"
        else:
            what = "the model with its LoRA adapters disabled (no copy)"
        return (f"dpo: loss {self.options.loss_type}, beta {self.options.beta}, label smoothing "
                f"{self.options.label_smoothing}; reference: {what}")

    def prepare(self, batch: dict, pairs: Examples | None = None) -> dict:
        """The batch for micro_batch_loss: `pair_index` swapped for the pairs' precomputed log-probs (of `pairs`,
        by default the training set)."""
        import torch

        batch = dict(batch)
        index = batch.pop("pair_index", None)
        if self.precompute:
            if not self.tables:
                for p in self.sets:
                    self.tables[p.key] = load_or_precompute(self.context, p.key, self.context.unwrap(), p.dataset,
                                                            self.collator)
            rows = self.tables[(pairs or self.sets[0]).key][index.cpu()]
            batch["ref_logps"] = torch.cat([rows[:, 0], rows[:, 1]]).to(self.device)
        return batch

    def logps(self, batch: dict):
        batch = {k: v for k, v in batch.items() if k not in ("pair_index", "ref_logps")}
        if self.partitioned:  # the reference's own engine: placed and cast by DeepSpeed
            return sequence_logps(self.copy, batch)
        if self.copy is not None:
            if not self.placed:
                # Where, and in which dtype, the engine put the policy (DeepSpeed casts it for bf16).
                p = next(self.context.unwrap().parameters())
                self.copy.to(device=p.device, dtype=p.dtype)
                self.placed = True
            return sequence_logps(self.copy, batch)
        module = self.context.unwrap()
        with eval_mode(module), reference_context(module):
            return sequence_logps(module, batch)


def pair_metrics(model, reference: Reference, pairs: Examples, batch_size: int, options: DPOConfig, *,
                 prefix: str = "eval") -> dict:
    """The DPO loss and metrics over every eval pair (each exactly once over the ranks; every rank runs as many
    forwards, as ZeRO-3 needs): {eval_loss, eval_rewards/..., eval_logps/..., eval_samples, eval_runtime}."""
    import math
    import time

    import torch

    context = reference.context
    start, n, world, rank = time.time(), len(pairs.dataset), context.world(), context.rank()
    mine = list(range(rank, n, world))
    metrics, loss_sum, index_sum = Metrics(), torch.zeros((), dtype=torch.float64), 0
    model.eval()
    try:
        with torch.no_grad():
            for b in range(math.ceil(math.ceil(n / world) / batch_size)):
                idx = mine[b * batch_size:(b + 1) * batch_size]
                batch = reference.collator([pairs.dataset[i] for i in (idx or [0])])  # out of pairs: a forward for nothing
                batch = {k: v.to(reference.device) for k, v in batch.items()}
                window = Metrics()
                loss = micro_batch_loss(model, reference.prepare(batch, pairs), reference.logps, options, 1, window,
                                        context.autocast)
                if idx:
                    loss_sum += loss.double().cpu()
                    metrics.sums = window.sums if metrics.sums is None else metrics.sums + window.sums
                    index_sum += sum(idx)
    finally:
        model.train()
    sums = torch.cat([torch.stack([loss_sum, torch.tensor(float(index_sum), dtype=torch.float64)]),
                      metrics.sums.cpu() if metrics.sums is not None else torch.zeros(7, dtype=torch.float64)])
    sums = context.all_sum(sums.to(reference.device)).cpu()
    pairs_seen = float(sums[-1])
    if pairs_seen != n or float(sums[1]) != n * (n - 1) / 2:
        raise RuntimeError(f"evaluation covered {pairs_seen:.0f} of {n} pairs: a pair was counted twice or lost")
    out = {"loss": float(sums[0]) / n}
    out.update({k: float(v) / n for k, v in zip(METRICS, sums[2:-1].tolist())})
    out.update(samples=n, runtime=round(time.time() - start, 4))
    return {f"{prefix}_{k}": v for k, v in out.items()}
