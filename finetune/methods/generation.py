"""The rollouts of the methods that generate (GRPO, RLOO; finetune.methods.grpo): sampling with the model being
trained, scoring, the reference, and the Session the training paths call.

Sampling is a plain KV-cached loop, not model.generate: each completion draws its tokens from a torch.Generator of
its own, seeded by (--seed, step, prompt, generation index), so a completion is the same whichever process, batch
or row makes it. Position ids follow the attention mask (left-padded prompts), in sampling and in scoring alike.
Under ZeRO-3 with several processes every rank runs as many forwards as the longest rank needs (the layers'
parameters are gathered collectively, forward by forward: the whole model is never gathered at once).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

from finetune import compat
from finetune.methods.base import Context, Examples, Session, Window


class PromptCollator:
    """Prompts left-padded (completions are appended on the right): prompt_ids, prompt_mask, prompt_index."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features) -> dict:
        import torch

        features = list(features)
        length = max(len(f["prompt_ids"]) for f in features)
        ids = torch.full((len(features), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(features), length), dtype=torch.long)
        for i, f in enumerate(features):
            p = list(f["prompt_ids"])
            ids[i, length - len(p):] = torch.as_tensor(p)
            mask[i, length - len(p):] = 1
        return {"prompt_ids": ids, "prompt_mask": mask,
                "prompt_index": torch.tensor([f["prompt_index"] for f in features], dtype=torch.long)}


def positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def pick(logits, generators, temperature: float, top_p: float):
    """One token per row: argmax at temperature 0, else sampled (nucleus top_p) with the row's own generator."""
    import torch

    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest set whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)]).to(logits.device)


def sample(module, prompt_ids, prompt_mask, seeds, *, max_new: int, temperature: float, top_p: float, stop_ids,
           pad_id: int, synced_sum=None, autocast=contextlib.nullcontext):
    """(completion ids [n, C], completion mask [n, C]) of each row: tokens up to and including the first of
    `stop_ids`, or `max_new` tokens. `synced_sum` (ZeRO-3, several ranks) sums a tensor over ranks: the loop runs
    until no rank has an unfinished row."""
    import torch

    device = prompt_ids.device
    n = prompt_ids.shape[0]
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds] if temperature > 0 else None
    stop = torch.tensor(sorted(stop_ids), device=device)
    out = torch.full((n, max_new), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.full((n,), max_new, dtype=torch.long, device=device)
    mask, pos, ids, past = prompt_mask, positions(prompt_mask), prompt_ids, None
    steps = 0
    with torch.no_grad():
        for t in range(max_new):
            with autocast():
                o = module(input_ids=ids, attention_mask=mask, position_ids=pos, cache=past, use_cache=True,
                           logits_to_keep=1, **compat.generation_kwargs(module))
            past = o.cache
            token = pick(o.logits[:, -1], generators, temperature, top_p)
            token = torch.where(done, torch.full_like(token, pad_id), token)
            out[:, t] = token
            ended = ~done & torch.isin(token, stop)
            lengths = torch.where(ended, torch.full_like(lengths, t + 1), lengths)
            done = done | ended
            steps = t + 1
            unfinished = (~done).sum()
            if synced_sum is not None:
                unfinished = synced_sum(unfinished.clone())
            if int(unfinished) == 0:
                break
            ids, pos = token[:, None], pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)
    width = max(int(lengths.max()), 1) if n else 1
    width = min(width, steps) if steps else width
    completion = out[:, :width]
    completion_mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
    return completion, completion_mask


def sequences(prompt_ids, prompt_mask, completion_ids, completion_mask) -> tuple:
    """(input_ids, attention_mask) of the prompts (left-padded) followed by their completions (right-padded)."""
    import torch

    return (torch.cat([prompt_ids, completion_ids], dim=1), torch.cat([prompt_mask, completion_mask], dim=1))


def token_logps(model, ids, mask, completion_ids, temperature: float = 1.0):
    """[n, C] log p(completion token | everything before it) under `model` of the sequences (`ids`, `mask`) that
    end with `completion_ids` [n, C], the logits over `temperature` as TRL's (the distribution the tokens were
    sampled from); grad where enabled."""
    import torch

    c = completion_ids.shape[1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), logits_to_keep=c + 1,
                use_cache=False)
    logits = out.logits[:, :-1].float() / temperature
    picked = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@contextlib.contextmanager
def eval_mode(module):
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


class Metrics(Window):
    """The logging window: sums per completion of the method's metrics and of each reward function's values (and
    their squares, for the stds), reduced over ranks and averaged when popped."""

    def __init__(self, base: tuple[str, ...], reward_names: list[str], nonfinite: bool = False):
        self.base, self.reward_names = base, reward_names
        stats = ("mean", "sq", "nonfinite") if nonfinite else ("mean", "sq")
        super().__init__(base + ("reward_sq",) + tuple(f"rewards/{r}/{s}" for r in reward_names for s in stats))

    def row(self, **values) -> torch.Tensor:
        import torch

        return torch.tensor([float(values.get(n, 0.0)) for n in self.names] + [float(values.get("n", 0))],
                            dtype=torch.float64)

    def pop(self, reduce=None) -> dict:
        out = super().pop(reduce)

        def std(mean, sq):
            return math.sqrt(max(sq - mean * mean, 0.0))

        out["reward_std"] = std(out["reward"], out.pop("reward_sq"))
        for r in self.reward_names:
            out[f"rewards/{r}/std"] = std(out[f"rewards/{r}/mean"], out.pop(f"rewards/{r}/sq"))
        return out


class Reference:
    """The KL's reference, as DPO's (finetune.methods.dpo): the LoRA model with its adapters disabled, a frozen copy
    of full fine-tuning (partitioned under ZeRO-3), made before any update."""

    def __init__(self, context: Context, model):
        from finetune.methods import dpo

        self.context, self.copy, self.placed = context, None, False
        if not context.cfg.model.use_peft:
            from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

            self.copy = dpo.partitioned_copy(context.cfg) if is_deepspeed_zero3_enabled() else dpo.frozen_copy(model)
            self.partitioned = is_deepspeed_zero3_enabled()

    def describe(self) -> str:
        if self.copy is None:
            return "the model with its LoRA adapters disabled (no copy)"
        return "a frozen copy of the model" + (", partitioned by ZeRO-3" if self.partitioned else "")

    def logps(self, *args, temperature: float):
        from finetune.methods import dpo

        if self.copy is not None:
            if not self.partitioned and not self.placed:
                p = next(self.context.unwrap().parameters())
                self.copy.to(device=p.device, dtype=p.dtype)
                self.placed = True
            return token_logps(self.copy, *args, temperature=temperature)
        module = self.context.unwrap()
        with eval_mode(module), dpo.reference_context(module):
            return token_logps(module, *args, temperature=temperature)


class RolloutSession(Session):
    """GRPO or RLOO (`method`) at work: rollout() makes a micro-batch's completions, rewards, advantages (from
    Method.count), loss() scores them with the model being trained."""

    def __init__(self, method, options, model, tokenizer, sets: list[Examples | None], context: Context):
        import torch

        from finetune.data.prepare import end_of_turn_ids
        from finetune.methods import rewards

        self.method, self.options, self.tokenizer, self.context = method, options, tokenizer, context
        self.train_set = sets[0]
        try:
            self.rewards = rewards.Rewards.of(options.reward_funcs, options.reward_weights, options.nonfinite_rewards)
        except rewards.RewardError as e:
            context.fail(str(e))
        self.weights = torch.tensor(self.rewards.weights, dtype=torch.float64)
        self.stop_ids = end_of_turn_ids(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.reference = Reference(context, model) if options.beta > 0 else None
        self.window = Metrics(method.metrics, self.rewards.names, nonfinite=options.nonfinite_rewards == "skip")
        self.columns_cache: dict[int, dict] = {}
        self.kept = None  # (the step that generated them, [(prompt_index, tensors, metrics row)]): --num_iterations
        self.timing = {"generation_s": 0.0, "training_s": 0.0}
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        self.zero3 = is_deepspeed_zero3_enabled()

    def describe(self) -> str:
        o = self.options
        ref = f"; reference: {self.reference.describe()}" if self.reference is not None else ""
        return (f"{self.method.name}: {o.num_generations} completions per prompt (temperature {o.temperature}, top_p "
                f"{o.top_p}, up to {o.max_completion_length} tokens); rewards {', '.join(self.rewards.specs)} "
                f"(weights {', '.join(f'{w:g}' for w in self.rewards.weights)}); beta {o.beta}{ref}")

    def synced_sum(self):
        return self.context.all_sum if self.zero3 and self.context.world() > 1 else None

    # -- the rollout ------------------------------------------------------------------------------

    def generate(self, module, batch: dict, generations: int, temperature: float, step: int | None):

        ids = batch["prompt_ids"].repeat_interleave(generations, dim=0)
        mask = batch["prompt_mask"].repeat_interleave(generations, dim=0)
        index = batch["prompt_index"].tolist()
        seed = self.context.cfg.training.seed
        seeds = [step_seed(seed, step, i, g) for i in index for g in range(generations)] if step is not None else None
        device = next(module.parameters()).device
        with eval_mode(module):
            return sample(module, ids.to(device), mask.to(device), seeds, max_new=self.options.max_completion_length,
                          temperature=temperature, top_p=self.options.top_p, stop_ids=self.stop_ids,
                          pad_id=self.pad_id, synced_sum=self.synced_sum(), autocast=self.context.autocast)

    def score(self, examples: Examples, batch: dict, completion_ids, completion_mask, generations: int):
        """([n, k] float64 rewards per function, decoded prompts, completions) of the completions of `batch`."""
        import torch

        from finetune.methods.rewards import RewardError

        rows = [examples.dataset[int(i)] for i in batch["prompt_index"].tolist()]
        prompts = [r["prompt"] for r in rows for _ in range(generations)]
        columns = [json.loads(r["columns"]) for r in rows for _ in range(generations)]
        where = [r.get("where") or f"prompt {int(i)}" for r, i in zip(rows, batch["prompt_index"].tolist())
                 for _ in range(generations)]
        ids = [row[m.bool()].tolist() for row, m in zip(completion_ids.cpu(), completion_mask.cpu())]
        completions = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        try:
            table = self.rewards.score(prompts, completions, columns, where=where, completion_ids=ids,
                                       max_completion_length=self.options.max_completion_length)
        except RewardError as e:
            self.context.fail(str(e))
            raise
        return torch.tensor(table, dtype=torch.float64).view(len(completions), -1), prompts, completions

    def rollout(self, batch: dict) -> None:
        """Completions, rewards and advantages of a batch outside a training step (its own batch statistics)."""
        self.rollouts([batch], step=False)

    def rollouts(self, batches: list[dict], step: bool = True) -> None:
        """Completions, rewards and advantages of this rank's micro-batches of a step, added to each (once). The
        advantages' batch statistics are every rank's (collective when `step`). With --num_iterations μ > 1 the
        step that generates keeps what it added; the next μ - 1 steps (the same prompts again: Method.repeats)
        reuse it."""
        import torch

        if all("completion_ids" in b for b in batches):
            return
        o, now = self.options, self.context.step()
        if step and o.num_iterations > 1 and now % o.num_iterations:
            self.reuse(batches, now)
            return
        start = time.time()
        made = [self.make(batch, now) for batch in batches]
        per_func = torch.cat([m["per_func"] for m in made])
        kl = torch.cat([m["kl"] for m in made]) if made[0]["kl"] is not None else None
        rewards = self.method.weighted(o, per_func, self.weights, kl)
        advantages, std = self.method.advantages(o, rewards, self.all_sum if step else None)
        first, kept = 0, []
        for batch, m in zip(batches, made):
            n = m["per_func"].shape[0]
            part = slice(first, first + n)
            first += n
            added = {**m["tensors"], "advantages": advantages[part].float()}
            batch.update(added)
            row = self.row(m, per_func[part], std[part], None if kl is None else kl[part])
            self.window.add(row)
            kept.append((batch["prompt_index"].clone(), added, row))
        if step and o.num_iterations > 1:
            self.kept = (now, kept)
        self.timing["generation_s"] += time.time() - start

    def reuse(self, batches: list[dict], now: int) -> None:
        """The kept completions of the step that generated them: the same prompts, micro-batch by micro-batch."""
        import torch

        made, kept = self.kept if self.kept is not None else (None, [])
        if made is None or now - made >= self.options.num_iterations or len(kept) != len(batches) or not all(
                torch.equal(b["prompt_index"], k[0]) for b, k in zip(batches, kept)):
            raise RuntimeError(f"step {now + 1}: no completions kept for these prompts (generated at step "
                               f"{None if made is None else made + 1}); --num_iterations resumes only from a checkpoint "
                               f"at a multiple of it")
        for batch, (_, added, row) in zip(batches, kept):
            batch.update(added)
            self.window.add(row)  # the rewards of the completions this step trains on

    def all_sum(self, t):
        return self.context.all_sum(t.to(self.context.device)).cpu()

    def make(self, batch: dict, now: int) -> dict:
        """One micro-batch's completions, their rewards per function, and the log-probabilities the loss needs: the
        reference's (--beta), p_old (Method.needs_old_logps), RLOO's sequence KL."""
        import torch

        o, module = self.options, self.context.unwrap()
        g = o.num_generations
        completion, cmask = self.generate(module, batch, g, o.temperature, now)
        per_func, _, _ = self.score(self.train_set, batch, completion, cmask, g)
        skipped = list(self.rewards.skipped or [])
        ids, mask = sequences(batch["prompt_ids"].repeat_interleave(g, dim=0).to(completion.device),
                              batch["prompt_mask"].repeat_interleave(g, dim=0).to(completion.device), completion, cmask)
        args = (ids, mask, completion)
        ref = old = None
        with torch.no_grad(), self.context.autocast():
            if self.reference is not None:
                ref = self.reference.logps(*args, temperature=o.temperature)
            if self.method.needs_old_logps(o):
                with eval_mode(module):
                    old = token_logps(module, *args, temperature=o.temperature)
        kl = None
        if ref is not None and old is not None:
            kl = ((old - ref) * cmask).sum(-1).double().cpu()
        # input_ids and attention_mask: what the loss scores, and what the paths count as the tokens seen.
        tensors = dict(input_ids=ids, attention_mask=mask, completion_ids=completion, completion_mask=cmask)
        if ref is not None and self.method.reference_in_loss(o):
            tensors["ref_logps"] = ref.float()
        if old is not None and o.num_iterations > 1:
            tensors["old_logps"] = old.float()
        return {"per_func": per_func, "kl": kl, "tensors": tensors, "skipped": skipped}

    def row(self, made: dict, per_func, std, kl):
        """The logging window's row of one micro-batch's completions."""
        import torch

        o = self.options
        lengths = made["tensors"]["completion_mask"].sum(-1).double().cpu()
        plain = weighted_rewards(per_func, self.weights)
        values = {"reward": torch.nansum(plain).item(), "reward_sq": torch.nansum(plain ** 2).item(),
                  "frac_reward_zero_std": float(torch.isclose(std, torch.zeros_like(std)).sum()),
                  "completions/mean_length": float(lengths.sum()),
                  "completions/clipped_ratio": float((lengths >= o.max_completion_length).sum()),
                  "n": len(lengths)}
        if kl is not None and not self.method.reference_in_loss(o):  # RLOO: the sequence's KL, in its reward
            values["kl"] = float(kl.sum())
        for j, name in enumerate(self.rewards.names):
            col = per_func[:, j]
            values[f"rewards/{name}/mean"] = torch.nansum(col).item()
            values[f"rewards/{name}/sq"] = torch.nansum(col ** 2).item()
            if made.get("skipped"):  # --nonfinite_rewards skip: the share of completions whose value was left out
                values[f"rewards/{name}/nonfinite"] = float(made["skipped"][j])
        return self.window.row(**values)

    def normalizer(self, batch: dict) -> int:
        if self.method.loss_normalizer(self.options) == "tokens":
            return int(batch["completion_mask"].sum())
        return int(batch["completion_mask"].shape[0])

    # -- the loss -----------------------------------------------------------------------------------

    def loss(self, model, batch: dict, n_items, *, autocast=contextlib.nullcontext):
        import torch

        self.rollout(batch)  # a batch the path did not count (outside training)
        start = time.time()
        o = self.options
        device = batch["prompt_ids"].device
        completion = batch["completion_ids"].to(device)
        cmask = batch["completion_mask"].to(device)
        with self.context.autocast():
            logps = token_logps(model, batch["input_ids"].to(device), batch["attention_mask"].to(device), completion,
                                temperature=o.temperature)
        # p_old: the model that generated them (kept at generation) with --num_iterations > 1; otherwise the model
        # itself, detached: r = 1, as TRL's.
        old = batch["old_logps"].to(device) if "old_logps" in batch else logps.detach()
        ref = batch.get("ref_logps")
        ref = ref.to(device) if ref is not None else None
        numerator, ratio, kl = self.method.completion_loss(o, logps, old, ref, batch["advantages"].to(device),
                                                           cmask.to(logps.dtype))
        with torch.no_grad():
            m = cmask.to(logps.dtype)
            tokens = m.sum(-1).clamp(min=1.0)
            eps_high = o.epsilon if o.epsilon_high is None else o.epsilon_high
            a = batch["advantages"].to(device).unsqueeze(1)
            clipped = ((ratio < 1 - o.epsilon) & (a < 0)) | ((ratio > 1 + eps_high) & (a > 0))
            if clipped.dim() == 2 and clipped.shape[1] == m.shape[1]:
                clip = ((clipped * m).sum(-1) / tokens).sum()
            else:
                clip = clipped.double().sum()
            kl_sum = ((kl * m).sum(-1) / tokens).sum() if kl is not None else torch.zeros(())
            self.window.add(self.window.row(**{"clip_ratio/region_mean": float(clip), "kl": float(kl_sum)}))
        self.timing["training_s"] += time.time() - start  # the forward; the backward is the path's
        return numerator / n_items

    def metrics(self, reduce=None) -> dict:
        """The window's means, and the seconds this window spent making completions (sampling, rewards, reference)
        and in the loss' forwards, per rank (the mean over ranks)."""
        import torch

        out = self.window.pop(reduce)
        seconds = torch.tensor([self.timing["generation_s"], self.timing["training_s"]], dtype=torch.float64)
        if reduce is not None:
            seconds = reduce(seconds.to(self.context.device)).cpu() / self.context.world()
        out["time/generation_s"], out["time/loss_forward_s"] = (round(float(v), 3) for v in seconds)
        self.timing = {"generation_s": 0.0, "training_s": 0.0}
        return out

    # -- evaluation ---------------------------------------------------------------------------------

    def evaluate(self, model, examples: Examples, batch_size: int, *, prefix: str = "eval") -> dict:
        """One greedy completion per eval prompt (each prompt once over the ranks), its rewards: {prefix}_reward
        ({prefix}_loss is minus it), per
        function {prefix}_rewards/<name>/mean, the mean completion length; rank 0's share written with its
        rewards to <output_dir>/completions/step-N.jsonl."""
        import torch

        context = self.context
        start, n, world, rank = time.time(), len(examples.dataset), context.world(), context.rank()
        mine = list(range(rank, n, world))
        module = context.unwrap()
        k = len(self.rewards.names)
        sums = torch.zeros(3 + k, dtype=torch.float64)  # reward, length, prompts, per function
        samples = []
        collate = PromptCollator(self.pad_id)
        for b in range(math.ceil(math.ceil(n / world) / batch_size)):
            idx = mine[b * batch_size:(b + 1) * batch_size]
            batch = collate([{**examples.dataset[i], "prompt_index": i} for i in (idx or [0])])
            completion, cmask = self.generate(module, batch, 1, 0.0, None)
            if not idx:  # out of prompts: generated in step with the other ranks, for nothing
                continue
            per_func, prompts, completions = self.score(examples, batch, completion, cmask, 1)
            plain = weighted_rewards(per_func, self.weights)
            lengths = cmask.sum(-1).double().cpu()
            sums += torch.cat([torch.stack([torch.nansum(plain), lengths.sum(), torch.tensor(float(len(idx)))]),
                               torch.nansum(per_func, dim=0)])
            for p, c, r, row in zip(prompts, completions, plain.tolist(), per_func.tolist()):
                samples.append({"prompt": p, "completion": c, "reward": r,
                                "rewards": dict(zip(self.rewards.names, row))})
        sums = context.all_sum(sums.to(context.device)).cpu()
        if float(sums[2]) != n:
            raise RuntimeError(f"evaluation covered {float(sums[2]):.0f} of {n} prompts")
        if rank == 0:
            write_samples(Path(context.cfg.training.output_dir) / "completions", context.step(), samples)
        # The loss is minus the reward: what --load_best_model_at_end minimizes by default.
        out = {"loss": -float(sums[0]) / n, "reward": float(sums[0]) / n, "completions/mean_length": float(sums[1]) / n}
        out.update({f"rewards/{name}/mean": float(v) / n for name, v in zip(self.rewards.names, sums[3:].tolist())})
        out.update(samples=n, runtime=round(time.time() - start, 4))
        return {f"{prefix}_{key}": v for key, v in out.items()}


def weighted_rewards(per_func, weights):
    """[n] the weighted sum over the functions (NaN where every function returned None). `per_func`: [n, k]."""
    import torch

    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    return rewards


def step_seed(seed: int, step: int, prompt: int, generation: int) -> int:
    """The sampling seed of one completion: a hash of what identifies it, not of where it is computed."""
    import hashlib

    digest = hashlib.sha256(f"{seed}/{step}/{prompt}/{generation}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def write_samples(folder: Path, step: int, rows: list[dict]) -> Path:
    """completions/step-N.jsonl in the run folder: prompts, completions and their rewards of an evaluation."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step}.jsonl"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path

