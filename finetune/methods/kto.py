"""KTO (--method kto, docs/preference.md): Kahneman-Tversky Optimization on unpaired examples (Ethayarajh et al.
2024; TRL's KTOTrainer, loss_type="kto"), from records {prompt, completion, label} (finetune.data.unpaired).

A completion's log-probability is the sum over its trained tokens of log p(token | everything before it), scored as
DPO scores one (dpo.sequence_logps); r = log π(y|x) - log π_ref(y|x), its log-ratio to the reference (DPO's:
adapters off with LoRA, a frozen copy in full fine-tuning, partitioned under ZeRO-3). With β = --beta, per example:

    desirable   (label true):   --desirable_weight   × (1 - σ(β (r - z0)))
    undesirable (label false):  --undesirable_weight × (1 - σ(β (z0 - r)))

z0, KTO's reference point, estimates KL(π || π_ref) from mismatched pairs within the batch: each example's prompt
followed by another example's completion, z0 = max(0, mean of log π(y'|x) - log π_ref(y'|x)), detached. TRL rotates
the completions by one within each device's batch; here the batch is the step's GLOBAL batch (all ranks, all
micro-batches): its examples in data-set order, example k's prompt with example k-1's completion (the first with
the last). On one micro-batch in data-set order that is TRL's pairing; over several ranks and micro-batches it does
not depend on how the batch is split, so 2 processes train as 1 does. The KL rows are scored without gradients at
the start of each step (Session.step_start). A step minimizes the mean over the examples of the global batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace

from finetune.methods import dpo
from finetune.methods.base import Context, Examples, Method, MethodConfig, PlannerTerms, Session, Window

# Logged per logging window: TRL's names. rewards/* and logps/* are means over the window's desirable (chosen) or
# undesirable (rejected) examples; kl is z0, the mean over the window's examples.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
ROW_KEYS = ("input_ids", "attention_mask", "labels")


@dataclass
class KTOConfig(MethodConfig):
    """KTO's flags (--method kto; docs/preference.md)"""

    beta: float = field(default=0.1, metadata={
        "help": "KTO: how far the model may move from the reference (higher keeps it closer); the rewards logged are "
                "beta x log(policy / reference) of each completion."})
    desirable_weight: float = field(default=1.0, metadata={
        "help": "KTO: the weight of the desirable (label true) examples' losses (TRL's desirable_weight)."})
    undesirable_weight: float = field(default=1.0, metadata={
        "help": "KTO: the weight of the undesirable (label false) examples' losses (TRL's undesirable_weight)."})


def kto_loss(logps, ref_logps, label, z0, beta: float, desirable_weight: float, undesirable_weight: float):
    """(per-example weighted losses, rewards β r detached) of completion log-probs under the policy and the
    reference; `label` true = desirable; z0 the KL reference point (a detached scalar)."""
    import torch

    ratio = logps - ref_logps
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (ratio - z0)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratio)))
    return torch.where(label, desirable, undesirable), (beta * ratio).detach()


def kl_point(policy_kl_logps, ref_kl_logps):
    """(sum of log π(y'|x) - log π_ref(y'|x), rows), to be summed over the global batch; z0 = max(0, sum / rows)."""
    return (policy_kl_logps - ref_kl_logps).detach().double().sum(), len(policy_kl_logps)


def rotated(indices: list[int]) -> dict[int, int]:
    """Each example of a batch -> the example whose completion its KL row takes: in data-set order, the one before
    it (the first takes the last's), as TRL rotates a batch's completions by one."""
    order = sorted(indices)
    return {i: order[k - 1] for k, i in enumerate(order)}


class KTOWindow(Window):
    """Sums [chosen rewards, chosen logps, chosen, rejected rewards, rejected logps, rejected, z0 x examples,
    examples] (this rank), reduced and averaged at log time."""

    def __init__(self):
        super().__init__(METRICS)

    def add_batch(self, logps, rewards, label, z0) -> None:
        import torch

        label = label.to(logps.device)
        c, r = label.to(torch.float64), (~label).to(torch.float64)
        lp, rw = logps.detach().double(), rewards.double()
        n = float(len(label))
        self.add(torch.stack([(rw * c).sum(), (lp * c).sum(), c.sum(), (rw * r).sum(), (lp * r).sum(), r.sum(),
                              torch.as_tensor(float(z0) * n, dtype=torch.float64, device=lp.device),
                              torch.tensor(n, dtype=torch.float64, device=lp.device)]))

    def pop(self, reduce=None) -> dict:
        import torch

        sums = self.sums if self.sums is not None else torch.zeros(8, dtype=torch.float64)
        self.sums = None
        if reduce is not None:
            sums = reduce(sums)
        rc, lc, nc, rr, lr, nr, kl, n = sums.tolist()
        # A window without desirable (or undesirable) examples logs 0 for their means, as it has none to average.
        out = {"rewards/chosen": rc / nc if nc else 0.0, "rewards/rejected": rr / nr if nr else 0.0,
               "logps/chosen": lc / nc if nc else 0.0, "logps/rejected": lr / nr if nr else 0.0,
               "kl": kl / n if n else 0.0}
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return {k: out[k] for k in METRICS}


class KTO(Method):
    name = "kto"
    title = "KTO"
    summary = "KTO on unpaired {prompt, completion, label} examples, desirable or not (docs/preference.md)"
    config = KTOConfig
    paths = ("trainer", "loop")  # the engine path (scripts/sft.py) is not written for preference data, as for DPO
    own_evaluation = True
    metrics = METRICS
    unit = "examples"

    def validate(self, options: KTOConfig, data, training: dict, evaluation) -> list[str]:
        problems = []
        if options.beta <= 0:
            problems.append(f"beta: must be positive, got {options.beta}")
        for flag in ("desirable_weight", "undesirable_weight"):
            if getattr(options, flag) <= 0:
                problems.append(f"{flag}: must be positive, got {getattr(options, flag)}")
        return problems + dpo.pair_data_problems(self.name, data, training, evaluation)

    def eval_metrics(self, evaluation) -> list[str]:
        return ["loss", *METRICS]

    def prepare(self, data, tokenizer, *, local_rank: int, log, seed: int = 42):
        from finetune.data.unpaired import prepare_unpaired

        return prepare_unpaired(data, tokenizer, local_rank=local_rank, log=log, seed=seed)

    def examples(self, dataset, key: str | None) -> Examples:
        """The examples numbered (`example_index`: how a step finds the completions of its KL rows)."""
        return Examples(dataset.add_column("example_index", list(range(len(dataset)))), key)

    def collator(self, cfg, tokenizer):
        from finetune.data.unpaired import UnpairedCollator

        return UnpairedCollator(tokenizer.pad_token_id)

    def count(self, batches: list[dict]):
        """The examples (a step's loss is the mean over the examples of the global batch)."""
        import torch

        return torch.tensor(sum(int(b["input_ids"].shape[0]) for b in batches))

    def setup(self, options: KTOConfig, model, tokenizer, examples: list[Examples | None], collator,
              context: Context) -> Session:
        # DPO's reference, live (KTO's KL rows are built each step, so nothing is precomputed): the frozen copy of
        # full fine-tuning is taken here, before any update.
        reference = dpo.Reference(context, SimpleNamespace(precompute_ref_log_probs=False), model, [], collator)
        return KTOSession(options, reference, examples[0], tokenizer.pad_token_id)

    def planner_terms(self, options: KTOConfig, *, use_peft: bool) -> PlannerTerms:
        # One row per example with gradients, and its KL row scored without (its logits are freed before the
        # step's first forward with gradients): counted as two rows scored by log-probabilities, DPO's pair, an
        # upper bound.
        what = "the base, adapters disabled (no copy)" if use_peft else "a frozen copy of the model"
        return PlannerTerms(pairs=True, reference_copy=not use_peft,
                            note=f"; KTO: 1 row per example plus its KL row (counted as 2), reference {what}")


class KTOSession(Session):
    def __init__(self, options: KTOConfig, reference: dpo.Reference, train: Examples, pad_token_id: int):
        self.options, self.reference, self.train, self.pad = options, reference, train, pad_token_id
        self.window, self.z0 = KTOWindow(), None
        self.max_len = reference.context.cfg.data.max_seq_length

    # -- the KL reference point ---------------------------------------------------------------------------

    def kl_rows(self, dataset, indices: list[int], batch_indices: list[int]) -> dict:
        """The KL rows of this rank's `indices` (their prompts, each with its rotated partner's completion in the
        global batch `batch_indices`, cut to max_seq_length)."""
        from finetune.data.unpaired import padded_rows

        partner = rotated(batch_indices)
        rows = []
        for i in indices:
            own, other = dataset[int(i)], dataset[int(partner[i])]
            room = self.max_len - len(own["prompt_ids"])
            rows.append((own["prompt_ids"], other["completion_ids"][:room], other["completion_labels"][:room]))
        return padded_rows(rows, self.pad)

    def gather_indices(self, mine: list[int]) -> list[int]:
        """Every rank's `mine`, joined (through the path's all-sum)."""
        import torch

        context = self.reference.context
        device, world, rank = context.device, context.world(), context.rank()
        counts = torch.zeros(world, dtype=torch.long, device=device)
        counts[rank] = len(mine)
        counts = context.all_sum(counts).tolist()
        out = torch.zeros(sum(counts), dtype=torch.long, device=device)
        start = sum(counts[:rank])
        out[start:start + len(mine)] = torch.tensor(mine, dtype=torch.long, device=device)
        return context.all_sum(out).tolist()

    def kl_sums(self, dataset, chunks: list[list[int]], batch_indices: list[int]):
        """[sum of log-ratios, rows] of this rank's KL rows, chunk by chunk (a chunk: one micro-batch's indices;
        an empty chunk still runs a forward, as ZeRO-3 needs every rank in each)."""
        import torch

        context = self.reference.context
        sums = torch.zeros(2, dtype=torch.float64, device=context.device)
        module = context.unwrap()
        for chunk in chunks:
            some = chunk or [batch_indices[0]]
            rows = {k: v.to(context.device) for k, v in self.kl_rows(dataset, some, batch_indices or some).items()}
            with torch.no_grad(), context.autocast():
                policy = dpo.sequence_logps(module, rows)
                ref = self.reference.logps(rows).to(policy.device, policy.dtype)
            if chunk:
                s, n = kl_point(policy, ref)
                sums += torch.stack([s, torch.tensor(float(n), dtype=torch.float64, device=s.device)])
        return sums

    def z0_of(self, dataset, chunks: list[list[int]]) -> float:
        """z0 of the global batch whose micro-batches on this rank hold `chunks` (indices into `dataset`)."""
        batch_indices = self.gather_indices([i for c in chunks for i in c])
        sums = self.reference.context.all_sum(self.kl_sums(dataset, chunks, batch_indices))
        return max(float(sums[0]) / max(float(sums[1]), 1.0), 0.0)

    def step_start(self, batches: list[dict]) -> None:
        self.z0 = self.z0_of(self.train.dataset, [b["example_index"].tolist() for b in batches])

    # -- the loss -----------------------------------------------------------------------------------------

    def batch_losses(self, model, batch: dict, z0: float):
        import torch

        rows = {k: batch[k].to(self.reference.device) for k in ROW_KEYS}
        with torch.no_grad(), self.reference.context.autocast():
            ref = self.reference.logps(rows)
        logps = dpo.sequence_logps(model, rows)
        label = batch["label"].to(logps.device)
        o = self.options
        losses, rewards = kto_loss(logps, ref.to(logps.device, logps.dtype), label, z0, o.beta, o.desirable_weight,
                                   o.undesirable_weight)
        return losses, logps, rewards, label

    def loss(self, model, batch: dict, n_items, *, autocast=contextlib.nullcontext):
        if self.z0 is None:  # outside a step (no step_start): this batch is the step
            self.step_start([batch])
        losses, logps, rewards, label = self.batch_losses(model, batch, self.z0)
        self.window.add_batch(logps, rewards, label, self.z0)
        return losses.sum() / n_items

    def metrics(self, reduce=None) -> dict:
        return self.window.pop(reduce)

    def evaluate(self, model, examples: Examples, batch_size: int, *, prefix: str = "eval") -> dict:
        """The loss and metrics over every eval example, each once over the ranks (every rank runs as many forwards,
        as ZeRO-3 needs); the whole eval set is one batch for z0 (its KL rows rotated over all of it)."""
        import math
        import time

        import torch

        context = self.reference.context
        start, n, world, rank = time.time(), len(examples.dataset), context.world(), context.rank()
        mine = list(range(rank, n, world))
        chunks = [mine[b * batch_size:(b + 1) * batch_size] for b in range(math.ceil(math.ceil(n / world) / batch_size))]
        from finetune.data.unpaired import UnpairedCollator

        collate = UnpairedCollator(self.pad)
        model.eval()
        try:
            z0 = self.z0_of(examples.dataset, chunks)
            window, loss_sum, index_sum = KTOWindow(), torch.zeros((), dtype=torch.float64), 0
            window.sums = torch.zeros(8, dtype=torch.float64, device=context.device)  # a rank may get no example
            with torch.no_grad():
                for idx in chunks:
                    batch = collate([examples.dataset[i] for i in (idx or [0])])  # none left: a forward for nothing
                    losses, logps, rewards, label = self.batch_losses(model, batch, z0)
                    if idx:
                        loss_sum += losses.double().sum().cpu()
                        window.add_batch(logps, rewards, label, z0)
                        index_sum += sum(idx)
        finally:
            model.train()
        sums = torch.stack([loss_sum, torch.tensor(float(index_sum), dtype=torch.float64)]).to(context.device)
        sums = context.all_sum(sums).cpu()
        metrics = window.pop(context.all_sum)
        seen = float(sums[1])
        if seen != n * (n - 1) / 2:
            raise RuntimeError(f"evaluation covered the examples wrongly (index sum {seen:.0f}, want {n * (n - 1) / 2:.0f})")
        out = {"loss": float(sums[0]) / n, **metrics, "samples": n, "runtime": round(time.time() - start, 4)}
        return {f"{prefix}_{k}": v for k, v in out.items()}

    def describe(self) -> str:
        r, o = self.reference, self.options
        if r.partitioned:
            what = "a frozen copy of the model, partitioned by ZeRO-3 like the policy"
        elif r.copy is not None:
            what = "a frozen copy of the model (full fine-tuning: a second set of weights in memory)"
        else:
            what = "the model with its LoRA adapters disabled (no copy)"
        return (f"kto: beta {o.beta}, desirable weight {o.desirable_weight}, undesirable weight "
                f"{o.undesirable_weight}; KL reference point from mismatched pairs of each global batch; reference: "
                f"{what}")
