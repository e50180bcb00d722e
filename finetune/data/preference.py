"""Preference pairs for DPO: records {"prompt", "chosen", "rejected"} -> a shared prompt and two completions.

Forms (docs/preference.md):
  strings        {"prompt": "...", "chosen": "...", "rejected": "..."}: one user turn and one assistant answer
                 where the tokenizer has a chat template (as alpaca records are), else plain text plus EOS.
  conversational {"prompt": [messages], "chosen": [assistant message(s)] or one message, "rejected": ...}
  full           {"chosen": [whole conversation], "rejected": [whole conversation]} sharing their first messages
                 (UltraFeedback-binarized; a "prompt" string beside them is the first user turn and is not needed).

The prompt is tokenized as the model gets it at inference (rendered with the generation prompt), the completion
after it; the completion's trained tokens are found by the same prefix rendering as the SFT masks
(prepare.assistant_turns / _mask_spans), so a DPO pair scores exactly the tokens SFT would train.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune.data import prepare as P
from finetune.data.formats import shapes
from finetune.data.formats.base import record_tools
from finetune.data.formats.messages import check_role
from finetune.data.formats.vision import refuse_images
from finetune.data.prepare import IGNORE_INDEX, DataError

FORMAT = "preference"
KEYS = ("prompt", "chosen", "rejected")
# Bump when pair tokenization changes (with prepare.DATA_VERSION, part of the cache key).
PAIR_VERSION = "1"


# ----------------------------------------------------------------------------------------------
# Records -> (prompt, chosen, rejected) as messages, or as plain strings.


def _as_messages(value, key: str, where: str) -> list[dict]:
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return [{k: v for k, v in m.items() if v is not None} for m in value]  # Arrow gives every key, null if absent
    raise DataError(f"{where}: field '{key}' must be a string, a message or a list of messages, "
                    f"got {type(value).__name__}")


def _common_prefix(a: list[dict], b: list[dict]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    # Both completions start with an assistant turn: cut back to a turn boundary before one.
    while n and not (a[n:] and b[n:] and a[n]["role"] == "assistant" and b[n]["role"] == "assistant"):
        n -= 1
    return n


def pair_of(record: dict, where: str, chat: bool) -> tuple:
    """(prompt, chosen, rejected): three strings for plain-text pairs, else three message lists. DataError for a
    missing field, an empty completion or identical completions."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with {', '.join(KEYS)}")
    refuse_images(record, where, "preference training (DPO, ORPO, SimPO, CPO, reward models)")
    for key in ("chosen", "rejected"):
        if key not in record or record[key] is None:
            raise DataError(f"{where}: missing field '{key}' (format preference: prompt, chosen, rejected)"
                            f"{shapes.hint(record, 'dpo')}")
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    full = isinstance(chosen, list) and chosen and isinstance(chosen[0], dict) and chosen[0].get("role") != "assistant"
    if not full and prompt is None:
        raise DataError(f"{where}: missing field 'prompt' (format preference: prompt, chosen, rejected)")
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        if not prompt.strip():
            raise DataError(f"{where}: field 'prompt' is empty")
        for key, text in (("chosen", chosen), ("rejected", rejected)):
            if not text.strip():
                raise DataError(f"{where}: field '{key}' is empty: an empty completion")
        if chosen == rejected:
            raise DataError(f"{where}: 'chosen' and 'rejected' are identical; a pair must differ")
        if not chat:
            return prompt, chosen, rejected
    if full:
        chosen, rejected = _as_messages(chosen, "chosen", where), _as_messages(rejected, "rejected", where)
        n = _common_prefix(chosen, rejected)
        if n == 0:
            raise DataError(f"{where}: 'chosen' and 'rejected' are whole conversations, so they must share their "
                            "first messages (the prompt) and go on with an assistant turn each")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    else:
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _as_messages(prompt, "prompt", where)
        chosen = [{"role": "assistant", "content": chosen}] if isinstance(chosen, str) else _as_messages(chosen, "chosen", where)
        rejected = ([{"role": "assistant", "content": rejected}] if isinstance(rejected, str)
                    else _as_messages(rejected, "rejected", where))
    if not prompt:
        raise DataError(f"{where}: field 'prompt' is empty")
    for j, m in enumerate(prompt):  # named as the prompt's, before they are joined to each completion
        check_role(m.get("role") if isinstance(m, dict) else None, f"{where} (prompt): messages[{j}]")
    for key, msgs in (("chosen", chosen), ("rejected", rejected)):
        if not msgs:
            raise DataError(f"{where}: field '{key}' is empty: an empty completion")
        P.validate_record({"messages": prompt + msgs, "tools": record.get("tools")}, "messages", f"{where} ({key})")
        if msgs[0].get("role") != "assistant":
            raise DataError(f"{where}: '{key}' must start with an assistant turn, got role {msgs[0].get('role')!r}")
        if not any(m.get("role") == "assistant" and (str(m.get("content") or "").strip() or m.get("tool_calls"))
                   for m in msgs):
            raise DataError(f"{where}: '{key}' has an empty completion (no assistant content)")
    if chosen == rejected:
        raise DataError(f"{where}: 'chosen' and 'rejected' are identical; a pair must differ")
    return prompt, chosen, rejected


# ----------------------------------------------------------------------------------------------
# Tokens.


def _completion(tokenizer, messages: list[dict], n_prompt: int, where: str, tools) -> tuple[str, list[int], list[int]]:
    """(rendered prompt, completion ids, completion labels) for the conversation prompt + completion."""
    renderer = P.ChatRenderer(tokenizer)
    turns = P.assistant_turns(tokenizer, messages, where, tools, renderer)
    # Ending with an assistant turn, the conversation was just rendered whole, as that turn's `through`.
    full = turns[-1][1] if messages[-1]["role"] == "assistant" else renderer(messages, where=where, tools=tools)
    turns = turns[-sum(m["role"] == "assistant" for m in messages[n_prompt:]):]
    context = turns[0][0]
    if not all(full.startswith(through) for _, through in turns):
        raise DataError(f"{where}: the chat template rewrites earlier turns of this completion, so its assistant "
                        "turns cannot be located in one rendering; give a one-turn completion")
    text = full[len(context):]
    ids, labels = P._mask_spans(tokenizer, text, [(len(c) - len(context), len(t) - len(context)) for c, t in turns], True)
    return context, ids, labels


def tokenize_pair(tokenizer, record: dict, where: str = "") -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, chosen labels, rejected ids, rejected labels): the labels cover the completion only
    (its trained tokens, -100 elsewhere). A top-level function of its arguments, so datasets.map workers run it."""
    chat = bool(tokenizer.chat_template)
    prompt, chosen, rejected = pair_of(record, where, chat)
    if isinstance(prompt, str):  # plain text: the prompt with the tokenizer's BOS, each completion then EOS
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        c = tokenizer(chosen, add_special_tokens=False)["input_ids"] + eos
        r = tokenizer(rejected, add_special_tokens=False)["input_ids"] + eos
        return ids, c, list(c), r, list(r)
    P.require_chat_template(tokenizer, FORMAT, where)
    tools = record_tools(record, where)
    sides = []
    for key, completion in (("chosen", chosen), ("rejected", rejected)):
        sides.append(_completion(tokenizer, prompt + completion, len(prompt), f"{where} ({key})", tools))
    (context, c, cl), (context_r, r, rl) = sides
    if context != context_r:  # the template renders the prompt differently before each completion
        raise DataError(f"{where}: the chat template renders the prompt differently before 'chosen' and 'rejected'")
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    for key, labels in (("chosen", cl), ("rejected", rl)):
        if all(x == IGNORE_INDEX for x in labels):
            raise DataError(f"{where}: '{key}' has no trained token (an empty completion)")
    return ids, c, cl, r, rl


def tokenize_completion(tokenizer, record: dict, where: str = "") -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, completion labels) of a {"prompt", "completion"} record (TRL's prompt-completion
    form; a string or messages each), tokenized as one side of a pair is (tokenize_pair): what a reward model scores
    it by (finetune score)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with prompt, completion")
    refuse_images(record, where, "scoring")
    for key in ("prompt", "completion"):
        if record.get(key) is None:
            raise DataError(f"{where}: missing field '{key}' (a completion to score: prompt, completion; or a pair: "
                            "prompt, chosen, rejected)")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(completion, str) and not completion.strip():
        raise DataError(f"{where}: field 'completion' is empty: an empty completion")
    if isinstance(prompt, str) and not prompt.strip():
        raise DataError(f"{where}: field 'prompt' is empty")
    chat = bool(tokenizer.chat_template)
    if isinstance(prompt, str) and isinstance(completion, str) and not chat:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + eos
        return tokenizer(prompt, add_special_tokens=True)["input_ids"], ids, list(ids)
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _as_messages(prompt, "prompt", where)
    completion = ([{"role": "assistant", "content": completion}] if isinstance(completion, str)
                  else _as_messages(completion, "completion", where))
    if not completion or completion[0].get("role") != "assistant":
        raise DataError(f"{where}: 'completion' must start with an assistant turn")
    P.validate_record({"messages": prompt + completion, "tools": record.get("tools")}, "messages", where)
    P.require_chat_template(tokenizer, FORMAT, where)
    context, ids, labels = _completion(tokenizer, prompt + completion, len(prompt), where, record_tools(record, where))
    if all(x == IGNORE_INDEX for x in labels):
        raise DataError(f"{where}: 'completion' has no trained token (an empty completion)")
    return tokenizer(context, add_special_tokens=False)["input_ids"], ids, labels


@dataclass
class Truncation:
    prompt_tokens: int = 0  # tokens cut from the prompt's start
    completion_tokens: int = 0  # tokens cut from the completions' ends (both sides)


def truncate_pair(prompt: list[int], sides: list[tuple[list[int], list[int]]], max_len: int):
    """Fit prompt + each completion in max_len: the prompt loses its start (it keeps at least half of max_len when
    longer, so a long completion cannot crowd it out), then each completion loses its end."""
    longest = max(len(ids) for ids, _ in sides)
    cut = Truncation()
    if len(prompt) + longest > max_len:
        keep = min(len(prompt), max(max_len - longest, max_len // 2))
        cut.prompt_tokens = len(prompt) - keep
        prompt = prompt[len(prompt) - keep:]
    room = max_len - len(prompt)
    out = []
    for ids, labels in sides:
        cut.completion_tokens += max(len(ids) - room, 0)
        out.append((ids[:room], labels[:room]))
    return prompt, out, cut


# ----------------------------------------------------------------------------------------------
# Data sets: the pipeline's sources, cache and lock (pipeline.prepare_source), with this map function.


@dataclass
class PreferenceStats:
    path: str
    records: int
    pairs: int
    max_seq_length: int
    truncated: int = 0  # pairs cut to max_seq_length
    prompt_cut: int = 0  # of those, pairs whose prompt lost its start
    completion_cut: int = 0  # of those, pairs whose completion lost its end
    dropped: int = 0  # pairs with no trained token left after truncation, or dropped by --drop_long_sequences
    tokens: int = 0  # prompt + chosen + rejected, all pairs
    chosen_tokens: int = 0  # trained (scored) tokens
    rejected_tokens: int = 0
    format: str = FORMAT

    @property
    def examples(self) -> int:  # what describe_run counts: one example per pair
        return self.pairs

    def summary(self) -> str:
        cut = (f"{self.truncated} longer than max_seq_length={self.max_seq_length} truncated ({self.prompt_cut} "
               f"prompts lost their start, {self.completion_cut} completions their end)")
        return (f"data: {self.records} preference records from {self.path}; {cut}; {self.dropped} dropped; "
                f"{self.pairs} pairs, {self.tokens} tokens (scored: {self.chosen_tokens} chosen, "
                f"{self.rejected_tokens} rejected)")


PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")


def pair_features(tokenizer, record: dict, where: str, max_len: int):
    """((prompt ids, chosen ids, chosen labels, rejected ids, rejected labels), what truncation cut): one record
    tokenized and truncated as training takes it (the PAIR_COLUMNS, in order)."""
    prompt, c, cl, r, rl = tokenize_pair(tokenizer, record, where)
    prompt, ((c, cl), (r, rl)), cut = truncate_pair(prompt, [(c, cl), (r, rl)], max_len)
    return (prompt, c, cl, r, rl), cut


def record_margin(record: dict, where: str) -> float:
    """A pair's optional `margin` (TRL's reward-model column: how far the chosen answer should win by); 0 where the
    record has none, which is the loss without a margin."""
    import math

    value = record.get("margin")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}: field 'margin' must be a finite number, got {value!r}")
    return float(value)


class TokenizePairs:
    """The batched map function: records in, pairs out (with their status; with `margin`, each pair's margin)."""

    def __init__(self, tokenizer, max_seq_length: int, drop_long: bool, prefix: str | None, margin: bool = False):
        self.tokenizer, self.max_seq_length, self.drop_long, self.prefix = tokenizer, max_seq_length, drop_long, prefix
        self.margin = margin

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        from finetune.data.pipeline import _record

        out: dict[str, list] = {k: [] for k in (*PAIR_COLUMNS, "_prompt_cut", "_completion_cut", "_dropped")}
        if self.margin:
            out["margin"] = []
        for k, index in enumerate(indices):
            record, where = _record(batch, k, index, self.prefix)
            if self.margin:
                out["margin"].append(record_margin(record, where))
            (prompt, c, cl, r, rl), cut = pair_features(self.tokenizer, record, where, self.max_seq_length)
            long = bool(cut.prompt_tokens or cut.completion_tokens)
            dropped = (long and self.drop_long) or any(all(x == IGNORE_INDEX for x in lab) for lab in (cl, rl))
            if dropped:
                prompt, c, cl, r, rl = [], [], [], [], []
            for key, value in zip(PAIR_COLUMNS, (prompt, c, cl, r, rl)):
                out[key].append(value)
            out["_prompt_cut"].append(int(cut.prompt_tokens > 0))
            out["_completion_cut"].append(int(cut.completion_tokens > 0))
            out["_dropped"].append(int(dropped))
        return out


def _features(margin: bool = False):
    import datasets

    ids = datasets.List(datasets.Value("int32"))
    return datasets.Features({"prompt_ids": ids, "chosen_ids": ids, "chosen_labels": ids, "rejected_ids": ids,
                              "rejected_labels": ids, "_prompt_cut": datasets.Value("int8"),
                              "_completion_cut": datasets.Value("int8"), "_dropped": datasets.Value("int8"),
                              **({"margin": datasets.Value("float32")} if margin else {})})


def tokenize_source(cfg, tokenizer, hub, work: Path, *, num_proc: int, name: str, margin: bool = False) -> PreferenceStats:
    """pipeline.tokenize_source for pairs: read, validate, tokenize and truncate one source into `work/final`."""
    import pyarrow.compute as pc

    from finetune.data import pipeline

    ds, prefix = pipeline.source_dataset(cfg, hub, work)
    fn = TokenizePairs(tokenizer, cfg.max_seq_length, cfg.drop_long_sequences, prefix, margin)
    mapped = pipeline.map_records(ds, fn, work, num_proc=num_proc, features=_features(margin),
                                  what=f"pairs of {name}")
    table = mapped.data
    dropped = table.column("_dropped").to_numpy().astype(bool)
    p_cut = table.column("_prompt_cut").to_numpy().astype(bool)
    c_cut = table.column("_completion_cut").to_numpy().astype(bool)

    def total(col: str) -> int:
        return int(pc.sum(pc.list_value_length(table.column(col))).as_py() or 0)

    def trained(col: str) -> int:
        flat = pc.list_flatten(table.column(col))
        return int(pc.sum(pc.not_equal(flat, IGNORE_INDEX)).as_py() or 0)

    stats = PreferenceStats(
        path=str(name), records=len(ds), pairs=int((~dropped).sum()), max_seq_length=cfg.max_seq_length,
        truncated=int((p_cut | c_cut).sum()), prompt_cut=int(p_cut.sum()), completion_cut=int(c_cut.sum()),
        dropped=int(dropped.sum()),
        tokens=2 * total("prompt_ids") + total("chosen_ids") + total("rejected_ids"),
        chosen_tokens=trained("chosen_labels"), rejected_tokens=trained("rejected_labels"),
    )
    if not stats.pairs:
        raise DataError(f"{name}: no pairs left after truncation ({stats.summary()})")
    pipeline.commit(mapped, ~dropped, ["_prompt_cut", "_completion_cut", "_dropped"], work / "final", stats.__dict__)
    del mapped, table, ds
    return stats


def prepare_pairs(cfg, tokenizer, *, local_rank: int = 0, log=print, margin: bool = False, seed: int = 42):
    """(datasets.Dataset of pairs, PreferenceStats, cache key): tokenized once per node (per job on a shared cache
    folder) and cached as SFT data is, under a key of its own. `margin`: with each pair's margin column (reward
    models), cached under another key."""
    import functools

    from finetune.data import mix, pipeline

    num_proc = getattr(cfg, "dataset_num_proc", None) or pipeline.default_num_proc()
    build = functools.partial(tokenize_source, margin=margin) if margin else tokenize_source
    parts = [pipeline.prepare_source(sub, tokenizer, P.load_hub(sub), local_rank=local_rank, num_proc=num_proc,
                                     log=log, build=build, stats_cls=PreferenceStats,
                                     kind=f"pairs{PAIR_VERSION}" + ("-margin" if margin else ""), with_key=True)
             for sub in pipeline.source_configs(cfg)]
    if len(parts) == 1:
        return parts[0]
    # Several sets, mixed by --dataset_weights as SFT's are (finetune.data.mix).
    return mix.mix_rows(parts, getattr(cfg, "dataset_weights", None), seed, log, combine_pairs)


def combine_pairs(stats: list[PreferenceStats], picked: list) -> PreferenceStats:
    """One PreferenceStats for a mixed set: records, truncation and tokens per source, pairs as taken."""
    return PreferenceStats(
        path=" + ".join(s.path for s in stats), records=sum(s.records for s in stats),
        pairs=sum(len(d) for d in picked), max_seq_length=stats[0].max_seq_length,
        truncated=sum(s.truncated for s in stats), prompt_cut=sum(s.prompt_cut for s in stats),
        completion_cut=sum(s.completion_cut for s in stats), dropped=sum(s.dropped for s in stats),
        tokens=sum(s.tokens for s in stats), chosen_tokens=sum(s.chosen_tokens for s in stats),
        rejected_tokens=sum(s.rejected_tokens for s in stats))


# ----------------------------------------------------------------------------------------------


def padded_rows(rows, pad_token_id: int) -> dict:
    """Right-padded input_ids / labels / attention_mask of (prompt ids, completion ids, completion labels) rows."""
    import torch

    length = max(len(p) + len(c) for p, c, _ in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (p, c, lab) in enumerate(rows):
        n = len(p) + len(c)
        ids[i, :n] = torch.as_tensor(list(p) + list(c))
        labels[i, len(p):n] = torch.as_tensor(list(lab))
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class PairCollator:
    """Two right-padded rows per pair: the chosen rows of the batch, then the rejected rows (one forward scores
    both sides of every pair). Labels are -100 over the prompt and wherever the completion is not trained."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features) -> dict:
        import torch

        features = list(features)
        rows = [(f["prompt_ids"], f[f"{side}_ids"], f[f"{side}_labels"]) for side in ("chosen", "rejected")
                for f in features]
        batch = padded_rows(rows, self.pad_token_id)
        if "pair_index" in features[0]:  # where the pair's precomputed reference log-probs are (finetune.methods.dpo)
            batch["pair_index"] = torch.tensor([f["pair_index"] for f in features], dtype=torch.long)
        if "margin" in features[0]:  # a reward model's per-pair margin (finetune.methods.reward)
            batch["margin"] = torch.tensor([f["margin"] for f in features], dtype=torch.float32)
        batch[SCORED_POSITIONS], batch[SCORED_INDEX] = scored(batch["labels"])
        return batch


# The batch keys of what the pair losses score (finetune.methods.dpo.sequence_logps), found on the host by the
# collator so the loss makes no device sync: the positions whose logits predict a trained token, as one range for
# every row (the model's logits_to_keep), and the flat indices of the trained targets in [rows x that range].
SCORED_POSITIONS, SCORED_INDEX = "scored_positions", "scored_index"


def scored(labels):
    """(SCORED_POSITIONS, SCORED_INDEX) of a batch's labels [rows, T]."""
    import torch

    trained = labels[:, 1:] != IGNORE_INDEX
    columns = trained.any(0).nonzero().squeeze(1)
    if len(columns) == 0:  # no trained token in the batch: one scored column, no target
        return torch.zeros(1, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    positions = torch.arange(int(columns.min()), int(columns.max()) + 1)
    return positions, trained[:, positions].reshape(-1).nonzero().squeeze(1)
