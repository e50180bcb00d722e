"""Unpaired preference examples for KTO: records {"prompt", "completion", "label"} -> a prompt, one completion and
whether it is desirable (label true) or not (false), as TRL's KTOTrainer reads them (docs/preference.md, "KTO").

Forms, one per file (a file mixing them is refused at the first record of the other form):
  plain text     {"prompt": "...", "completion": "...", "label": true}: one user turn and one assistant answer where
                 the tokenizer has a chat template (as preference pairs are), else plain text plus EOS.
  conversational {"prompt": [messages], "completion": [assistant message(s)] or one message, "label": false}

Tokens as finetune.data.preference makes a pair's: the prompt rendered with the generation prompt, the completion's
trained tokens found by the SFT masks' prefix rendering; truncation keeps the prompt's end and the completion's
start (truncate_pair). KTO's KL reference point pairs each prompt with another example's completion
(finetune.methods.kto makes those rows with padded_rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune.data import prepare as P
from finetune.data.formats import shapes
from finetune.data import preference as PR
from finetune.data.preference import padded_rows
from finetune.data.formats.base import record_tools
from finetune.data.formats.vision import refuse_images
from finetune.data.prepare import IGNORE_INDEX, DataError

FORMAT = "unpaired"
KEYS = ("prompt", "completion", "label")
VERSION = "1"  # bump when the tokens change (part of the cache key)
COLUMNS = ("prompt_ids", "completion_ids", "completion_labels", "label")


def form_of(record) -> str:
    """'text' or 'conversational' (what a file's first record sets for the rest)."""
    return "text" if isinstance(record, dict) and isinstance(record.get("completion"), str) else "conversational"


def example_of(record: dict, where: str, chat: bool, form: str | None = None) -> tuple:
    """(prompt, completion, label): two strings for plain text without a chat template, else two message lists.
    DataError for a missing or non-boolean label, a missing or empty field, or a record of another form than
    `form` (the file's first record's)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with {', '.join(KEYS)}")
    refuse_images(record, where, "KTO")
    for key in KEYS:
        if key not in record or record[key] is None:
            hint = shapes.hint(record, "kto") or (" (true: a desirable completion, false: an undesirable one)"
                                                   if key == "label" else "")
            raise DataError(f"{where}: missing field '{key}' (format {FORMAT}: prompt, completion, label){hint}")
    label = record["label"]
    if not isinstance(label, bool):
        raise DataError(f"{where}: field 'label' must be true or false, got {label!r}")
    if form is not None and form_of(record) != form:
        raise DataError(f"{where}: a {form_of(record)} record in a file whose first record is {form}; one form per "
                        "file (split it, and mix the files with --dataset a --dataset b)")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not prompt.strip():
            raise DataError(f"{where}: field 'prompt' is empty")
        if not completion.strip():
            raise DataError(f"{where}: field 'completion' is empty: an empty completion")
        if not chat:
            return prompt, completion, label
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else PR._as_messages(prompt, "prompt", where)
    completion = ([{"role": "assistant", "content": completion}] if isinstance(completion, str)
                  else PR._as_messages(completion, "completion", where))
    if not prompt:
        raise DataError(f"{where}: field 'prompt' is empty")
    if not completion:
        raise DataError(f"{where}: field 'completion' is empty: an empty completion")
    P.validate_record({"messages": prompt + completion, "tools": record.get("tools")}, "messages", where)
    if completion[0].get("role") != "assistant":
        raise DataError(f"{where}: 'completion' must start with an assistant turn, got role "
                        f"{completion[0].get('role')!r}")
    if not any(m.get("role") == "assistant" and (str(m.get("content") or "").strip() or m.get("tool_calls"))
               for m in completion):
        raise DataError(f"{where}: 'completion' is empty: an empty completion (no assistant content)")
    return prompt, completion, label


def tokenize_example(tokenizer, record: dict, where: str = "", form: str | None = None):
    """(prompt ids, completion ids, completion labels, label), labels -100 outside the completion's trained tokens."""
    prompt, completion, label = example_of(record, where, bool(tokenizer.chat_template), form)
    if isinstance(prompt, str):  # plain text: the prompt with the tokenizer's BOS, the completion then EOS
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + eos
        return ids, c, list(c), label
    P.require_chat_template(tokenizer, FORMAT, where)
    context, c, cl = PR._completion(tokenizer, prompt + completion, len(prompt), where, record_tools(record, where))
    if all(x == IGNORE_INDEX for x in cl):
        raise DataError(f"{where}: 'completion' has no trained token (an empty completion)")
    return tokenizer(context, add_special_tokens=False)["input_ids"], c, cl, label


def example_features(tokenizer, record: dict, where: str, max_len: int, form: str | None = None):
    """((prompt ids, completion ids, completion labels, label), what truncation cut): as training takes it."""
    prompt, c, cl, label = tokenize_example(tokenizer, record, where, form)
    prompt, ((c, cl),), cut = PR.truncate_pair(prompt, [(c, cl)], max_len)
    return (prompt, c, cl, label), cut


class TokenizeUnpaired:
    """The batched map function: records in, examples out (with their status)."""

    def __init__(self, tokenizer, max_seq_length: int, drop_long: bool, prefix: str | None, form: str):
        self.tokenizer, self.max_seq_length, self.drop_long, self.prefix = tokenizer, max_seq_length, drop_long, prefix
        self.form = form

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        from finetune.data.pipeline import _record

        out: dict[str, list] = {k: [] for k in (*COLUMNS, "_prompt_cut", "_completion_cut", "_dropped")}
        for k, index in enumerate(indices):
            record, where = _record(batch, k, index, self.prefix)
            (prompt, c, cl, label), cut = example_features(self.tokenizer, record, where, self.max_seq_length,
                                                           self.form)
            long = bool(cut.prompt_tokens or cut.completion_tokens)
            dropped = (long and self.drop_long) or all(x == IGNORE_INDEX for x in cl)
            if dropped:
                prompt, c, cl = [], [], []
            for key, value in zip(COLUMNS, (prompt, c, cl, label)):
                out[key].append(value)
            out["_prompt_cut"].append(int(cut.prompt_tokens > 0))
            out["_completion_cut"].append(int(cut.completion_tokens > 0))
            out["_dropped"].append(int(dropped))
        return out


@dataclass
class UnpairedStats:
    path: str
    records: int
    desirable: int  # label true, kept
    undesirable: int  # label false, kept
    max_seq_length: int
    truncated: int = 0
    prompt_cut: int = 0
    completion_cut: int = 0
    dropped: int = 0  # no trained token left after truncation, or dropped by --drop_long_sequences
    tokens: int = 0  # prompt + completion, all examples
    completion_tokens: int = 0  # trained (scored) tokens
    format: str = FORMAT

    @property
    def examples(self) -> int:
        return self.desirable + self.undesirable

    def summary(self) -> str:
        cut = (f"{self.truncated} longer than max_seq_length={self.max_seq_length} truncated ({self.prompt_cut} "
               f"prompts lost their start, {self.completion_cut} completions their end)")
        return (f"data: {self.records} unpaired records from {self.path}; {cut}; {self.dropped} dropped; "
                f"{self.examples} examples ({self.desirable} desirable, {self.undesirable} undesirable), "
                f"{self.tokens} tokens ({self.completion_tokens} scored)")


def _features():
    import datasets

    ids = datasets.List(datasets.Value("int32"))
    return datasets.Features({"prompt_ids": ids, "completion_ids": ids, "completion_labels": ids,
                              "label": datasets.Value("bool"), "_prompt_cut": datasets.Value("int8"),
                              "_completion_cut": datasets.Value("int8"), "_dropped": datasets.Value("int8")})


def tokenize_source(cfg, tokenizer, hub, work: Path, *, num_proc: int, name: str) -> UnpairedStats:
    """pipeline.tokenize_source for unpaired examples: read, validate, tokenize and truncate one source."""
    import pyarrow.compute as pc

    from finetune.data import pipeline

    ds, prefix = pipeline.source_dataset(cfg, hub, work)
    first, _ = pipeline.first_record(ds, prefix)
    fn = TokenizeUnpaired(tokenizer, cfg.max_seq_length, cfg.drop_long_sequences, prefix, form_of(first))
    mapped = pipeline.map_records(ds, fn, work, num_proc=num_proc, features=_features(), what=f"examples of {name}")
    table = mapped.data
    dropped = table.column("_dropped").to_numpy().astype(bool)
    p_cut = table.column("_prompt_cut").to_numpy().astype(bool)
    c_cut = table.column("_completion_cut").to_numpy().astype(bool)
    label = table.column("label").to_numpy(zero_copy_only=False).astype(bool)

    def total(col: str) -> int:
        return int(pc.sum(pc.list_value_length(table.column(col))).as_py() or 0)

    flat = pc.list_flatten(table.column("completion_labels"))
    stats = UnpairedStats(
        path=str(name), records=len(ds), desirable=int((label & ~dropped).sum()),
        undesirable=int((~label & ~dropped).sum()), max_seq_length=cfg.max_seq_length,
        truncated=int((p_cut | c_cut).sum()), prompt_cut=int(p_cut.sum()), completion_cut=int(c_cut.sum()),
        dropped=int(dropped.sum()), tokens=total("prompt_ids") + total("completion_ids"),
        completion_tokens=int(pc.sum(pc.not_equal(flat, IGNORE_INDEX)).as_py() or 0),
    )
    if not stats.examples:
        raise DataError(f"{name}: no examples left after truncation ({stats.summary()})")
    pipeline.commit(mapped, ~dropped, ["_prompt_cut", "_completion_cut", "_dropped"], work / "final", stats.__dict__)
    del mapped, table, ds
    return stats


def prepare_unpaired(cfg, tokenizer, *, local_rank: int = 0, log=print, seed: int = 42):
    """(datasets.Dataset of examples, UnpairedStats, cache key): each --dataset tokenized once per node and cached as
    SFT data is; several are mixed by --dataset_weights (finetune.data.mix.mix_rows)."""
    from finetune.data import mix, pipeline

    num_proc = getattr(cfg, "dataset_num_proc", None) or pipeline.default_num_proc()
    parts = [pipeline.prepare_source(sub, tokenizer, P.load_hub(sub), local_rank=local_rank, num_proc=num_proc,
                                     log=log, build=tokenize_source, stats_cls=UnpairedStats,
                                     kind=f"unpaired{VERSION}", with_key=True)
             for sub in pipeline.source_configs(cfg)]
    if len(parts) == 1:
        return parts[0]
    return mix.mix_rows(parts, getattr(cfg, "dataset_weights", None), seed, log, combine_unpaired)


def combine_unpaired(stats: list[UnpairedStats], picked: list) -> UnpairedStats:
    """One UnpairedStats for a mixed set: records and filtering per source, examples as taken."""
    desirable = sum(int(sum(d["label"])) for d in picked)
    return UnpairedStats(
        path=" + ".join(s.path for s in stats), records=sum(s.records for s in stats), desirable=desirable,
        undesirable=sum(len(d) for d in picked) - desirable, max_seq_length=stats[0].max_seq_length,
        truncated=sum(s.truncated for s in stats), prompt_cut=sum(s.prompt_cut for s in stats),
        completion_cut=sum(s.completion_cut for s in stats), dropped=sum(s.dropped for s in stats),
        tokens=sum(s.tokens for s in stats), completion_tokens=sum(s.completion_tokens for s in stats))


# ----------------------------------------------------------------------------------------------




class UnpairedCollator:
    """One right-padded row per example (labels -100 outside its completion's trained tokens), its label, and its
    index in the data set where the features carry it (finetune.methods.kto finds the KL rows' completions by it)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features) -> dict:
        import torch

        features = list(features)
        batch = padded_rows([(f["prompt_ids"], f["completion_ids"], f["completion_labels"]) for f in features],
                            self.pad_token_id)
        batch["label"] = torch.tensor([bool(f["label"]) for f in features], dtype=torch.bool)
        if "example_index" in features[0]:
            batch["example_index"] = torch.tensor([f["example_index"] for f in features], dtype=torch.long)
        return batch
