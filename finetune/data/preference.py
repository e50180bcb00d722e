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

Image pairs (TRL's vision preference format, for a method that reads them: `images=True`, DPO's): `images` beside a
conversational pair whose prompt holds one {"type": "image"} part per image. The prompt goes through the
vision-language model's processor (finetune.data.vision.encode: its image-token expansion); the completions are text,
tokenized as above. The cache keeps the rendered prompt and its images; VisionPairCollator runs the processor on them
again per batch (pixel values, image grids, token types) and checks its tokens against the cache's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune.data import prepare as P
from finetune.data import vision
from finetune.data.formats import shapes
from finetune.data.formats.base import record_tools, text_only
from finetune.data.formats.messages import check_role
from finetune.data.formats.vision import image_refs, refuse_images
from finetune.data.images import as_pil, open_image, processor_of
from finetune.data.prepare import IGNORE_INDEX, DataError

FORMAT = "preference"
KEYS = ("prompt", "chosen", "rejected")
# Bump when pair tokenization changes (with prepare.DATA_VERSION, part of the cache key).
PAIR_VERSION = "1"


# ----------------------------------------------------------------------------------------------
# Records -> (prompt, chosen, rejected) as messages, or as plain strings.


def _as_messages(value, key: str, where: str) -> list[dict]:
    if isinstance(value, dict):
        return [_without_nulls(value)]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return [_without_nulls(m) for m in value]
    raise DataError(f"{where}: field '{key}' must be a string, a message or a list of messages, "
                    f"got {type(value).__name__}")


def _without_nulls(message: dict) -> dict:
    """A message without the keys holding null, its content's parts too: Arrow gives every row every key (a text
    part an `image: null`, which Qwen's template would render as an image)."""
    out = {k: v for k, v in message.items() if v is not None}
    if isinstance(out.get("content"), list):
        out["content"] = [{k: v for k, v in p.items() if v is not None} if isinstance(p, dict) else p
                          for p in out["content"]]
    return out


def _common_prefix(a: list[dict], b: list[dict]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    # Both completions start with an assistant turn: cut back to a turn boundary before one.
    while n and not (a[n:] and b[n:] and a[n]["role"] == "assistant" and b[n]["role"] == "assistant"):
        n -= 1
    return n


def pair_of(record: dict, where: str, chat: bool, images: bool = False) -> tuple:
    """(prompt, chosen, rejected): three strings for plain-text pairs, else three message lists. DataError for a
    missing field, an empty completion or identical completions. `images`: the method reads image pairs (DPO); their
    images are checked as the `vision` format checks an SFT record's (one image per image part of the prompt)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with {', '.join(KEYS)}")
    if not images:
        refuse_images(record, where, "preference training (ORPO, SimPO, CPO, reward models)", instead="dpo")
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
        if images:
            _image_pair_checks(record, prompt, msgs, key, where)
        else:
            P.validate_record({"messages": prompt + msgs, "tools": record.get("tools")}, "messages", f"{where} ({key})")
        if msgs[0].get("role") != "assistant":
            raise DataError(f"{where}: '{key}' must start with an assistant turn, got role {msgs[0].get('role')!r}")
        if not any(m.get("role") == "assistant" and (str(m.get("content") or "").strip() or m.get("tool_calls"))
                   for m in msgs):
            raise DataError(f"{where}: '{key}' has an empty completion (no assistant content)")
    if chosen == rejected:
        raise DataError(f"{where}: 'chosen' and 'rejected' are identical; a pair must differ")
    return prompt, chosen, rejected


def _image_parts(messages: list[dict]) -> int:
    return sum(isinstance(p, dict) and p.get("type") == "image" for m in messages
               if isinstance(m.get("content"), list) for p in m["content"])


def _image_pair_checks(record: dict, prompt: list[dict], completion: list[dict], key: str, where: str) -> None:
    """An image pair's side: no image in the completion (the images are the prompt's, as in TRL's format), then the
    `vision` format's checks of prompt + completion with the record's images (parts, their count, roles)."""
    for j, m in enumerate(completion):
        if _image_parts([m]):
            raise DataError(f"{where}: '{key}'[{j}] has an image part; a pair's images belong to its prompt (one "
                            "{\"type\": \"image\"} part in 'prompt' per entry of 'images'), its completions are text")
    conversation = {"messages": prompt + completion, "tools": record.get("tools")}
    for field_name in ("images", "image"):
        if field_name in record:
            conversation[field_name] = record[field_name]
    P.validate_record(conversation, "vision", f"{where} ({key})")


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


@dataclass
class ImagePair:
    """A pair of the image path: its tokens (as tokenize_pair's) and what the collator needs to run the processor on
    its prompt again."""

    tokens: tuple  # (prompt ids, chosen ids, chosen labels, rejected ids, rejected labels)
    text: str  # the prompt as rendered (image placeholders, not image tokens)
    images: list  # what the cache stores per image (images.open_image)
    image_end: int  # one past the prompt's last image token (0: none)


def tokenize_image_pair(tokenizer, record: dict, where: str = "", base: Path | None = None) -> ImagePair:
    """tokenize_pair for a method that reads image pairs: with a vision-language model's processor on the tokenizer,
    the prompt rendered with its image parts and expanded by the processor (finetune.data.vision.encode), the
    completions tokenized as tokenize_pair's; without one, a text pair (a record with images is refused, naming the
    model as text-only)."""
    processor = processor_of(tokenizer)
    refs = image_refs(record) if isinstance(record, dict) else []
    if processor is None:
        if isinstance(record, dict) and (refs or any(_image_parts(_maybe_turns(record.get(k))) for k in KEYS)):
            raise text_only(where, len(refs) or 1, tokenizer.name_or_path)
        return ImagePair(tokenize_pair(tokenizer, record, where), "", [], 0)
    P.require_chat_template(tokenizer, FORMAT, where)
    prompt, chosen, rejected = pair_of(record, where, True, images=True)
    prompt, chosen, rejected = ([vision.as_parts(m) for m in turns] for turns in (prompt, chosen, rejected))
    tools = record_tools(record, where)
    sides = [_completion(tokenizer, prompt + completion, len(prompt), f"{where} ({key})", tools)
             for key, completion in (("chosen", chosen), ("rejected", rejected))]
    (context, c, cl), (context_r, r, rl) = sides
    if context != context_r:
        raise DataError(f"{where}: the chat template renders the prompt differently before 'chosen' and 'rejected'")
    opened = [open_image(ref, where, k, base) for k, ref in enumerate(refs)]
    example = vision.encode(tokenizer, processor, context, [], [i for i, _ in opened], [s for _, s in opened], True,
                            where, P._special_ids(tokenizer))
    for key, labels in (("chosen", cl), ("rejected", rl)):
        if all(x == IGNORE_INDEX for x in labels):
            raise DataError(f"{where}: '{key}' has no trained token (an empty completion)")
    return ImagePair((example.input_ids, c, cl, r, rl), example.text, example.images, example.image_end)


def _maybe_turns(value) -> list[dict]:
    return [m for m in (value if isinstance(value, list) else [value]) if isinstance(m, dict)]


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


def truncate_pair(prompt: list[int], sides: list[tuple[list[int], list[int]]], max_len: int,
                  keep_prompt: bool = False):
    """Fit prompt + each completion in max_len: the prompt loses its start (it keeps at least half of max_len when
    longer, so a long completion cannot crowd it out), then each completion loses its end. `keep_prompt`: the prompt
    is kept whole (an image pair's: the processor renders it again per batch, images and all) and only the
    completions lose their end (none left when the prompt fills max_len)."""
    longest = max(len(ids) for ids, _ in sides)
    cut = Truncation()
    if len(prompt) + longest > max_len and not keep_prompt:
        keep = min(len(prompt), max(max_len - longest, max_len // 2))
        cut.prompt_tokens = len(prompt) - keep
        prompt = prompt[len(prompt) - keep:]
    room = max(max_len - len(prompt), 0)
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
    # Image pairs (a method that reads them, with a vision-language model): of the dropped, the pairs whose prompt
    # (kept whole: it holds the images) left no room in max_seq_length; and the pairs kept that hold no image (the
    # ZeRO-3 check of finetune.training.examples reads it as SFT's).
    dropped_image_cut: int = 0
    without_images: int = 0

    @property
    def examples(self) -> int:  # what describe_run counts: one example per pair
        return self.pairs

    def summary(self) -> str:
        cut = (f"{self.truncated} longer than max_seq_length={self.max_seq_length} truncated ({self.prompt_cut} "
               f"prompts lost their start, {self.completion_cut} completions their end)")
        image_cut = (f" ({self.dropped_image_cut} because their prompt, kept whole with its images, fills "
                     f"max_seq_length={self.max_seq_length}: raise --max_seq_length to keep them)"
                     if self.dropped_image_cut else "")
        return (f"data: {self.records} preference records from {self.path}; {cut}; {self.dropped} dropped{image_cut}; "
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


def image_pair_features(tokenizer, record: dict, where: str, max_len: int, base: Path | None = None):
    """(ImagePair with its tokens truncated, what truncation cut, whether its prompt left no room): pair_features
    for image pairs. An image pair's prompt is never cut (it holds the images, and the processor renders it whole
    per batch); its completions lose their end."""
    pair = tokenize_image_pair(tokenizer, record, where, base)
    prompt, c, cl, r, rl = pair.tokens
    keep = bool(pair.image_end)
    prompt, ((c, cl), (r, rl)), cut = truncate_pair(prompt, [(c, cl), (r, rl)], max_len, keep_prompt=keep)
    pair.tokens = (prompt, c, cl, r, rl)
    return pair, cut, keep and len(prompt) >= max_len


class TokenizePairs:
    """The batched map function: records in, pairs out (with their status; with `margin`, each pair's margin;
    `images`: image pairs, with the rendered prompt and its images, finetune.data.vision's columns)."""

    def __init__(self, tokenizer, max_seq_length: int, drop_long: bool, prefix: str | None, margin: bool = False,
                 images: bool = False, base: Path | None = None):
        self.tokenizer, self.max_seq_length, self.drop_long, self.prefix = tokenizer, max_seq_length, drop_long, prefix
        self.margin, self.images, self.base = margin, images, base
        # The prompt's text and images kept for the collator: with a processor to run on them.
        self.columns = images and processor_of(tokenizer) is not None

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        from finetune.data.pipeline import _record

        out: dict[str, list] = {k: [] for k in (*PAIR_COLUMNS, "_prompt_cut", "_completion_cut", "_dropped")}
        if self.margin:
            out["margin"] = []
        if self.columns:
            out.update(text=[], images=[], _no_image=[], _image_cut=[])
        for k, index in enumerate(indices):
            record, where = _record(batch, k, index, self.prefix)
            if self.margin:
                out["margin"].append(record_margin(record, where))
            image_cut = False
            if self.images:
                pair, cut, image_cut = image_pair_features(self.tokenizer, record, where, self.max_seq_length,
                                                           self.base)
                prompt, c, cl, r, rl = pair.tokens
            else:
                (prompt, c, cl, r, rl), cut = pair_features(self.tokenizer, record, where, self.max_seq_length)
            long = bool(cut.prompt_tokens or cut.completion_tokens)
            dropped = (image_cut or (long and self.drop_long)
                       or any(all(x == IGNORE_INDEX for x in lab) for lab in (cl, rl)))
            if dropped:
                prompt, c, cl, r, rl = [], [], [], [], []
            for key, value in zip(PAIR_COLUMNS, (prompt, c, cl, r, rl)):
                out[key].append(value)
            out["_prompt_cut"].append(int(cut.prompt_tokens > 0))
            out["_completion_cut"].append(int(cut.completion_tokens > 0))
            out["_dropped"].append(int(dropped))
            if self.columns:
                out["text"].append("" if dropped else pair.text)
                out["images"].append([] if dropped else pair.images)
                out["_no_image"].append(int(not dropped and not pair.images))
                out["_image_cut"].append(int(image_cut))
        return out


def _features(margin: bool = False, images: bool = False):
    import datasets

    ids = datasets.List(datasets.Value("int32"))
    return datasets.Features({"prompt_ids": ids, "chosen_ids": ids, "chosen_labels": ids, "rejected_ids": ids,
                              "rejected_labels": ids, "_prompt_cut": datasets.Value("int8"),
                              "_completion_cut": datasets.Value("int8"), "_dropped": datasets.Value("int8"),
                              **({"margin": datasets.Value("float32")} if margin else {}),
                              **({"text": datasets.Value("large_string"), "images": datasets.List(datasets.Image()),
                                  "_no_image": datasets.Value("int8"), "_image_cut": datasets.Value("int8")}
                                 if images else {})})


def tokenize_source(cfg, tokenizer, hub, work: Path, *, num_proc: int, name: str, margin: bool = False,
                    images: bool = False) -> PreferenceStats:
    """pipeline.tokenize_source for pairs: read, validate, tokenize and truncate one source into `work/final`.
    `images`: image pairs (a method that reads them; with a vision-language model's processor on the tokenizer)."""
    import pyarrow.compute as pc

    from finetune.data import pipeline

    ds, prefix = pipeline.source_dataset(cfg, hub, work)
    base, columns = None, images and processor_of(tokenizer) is not None
    if columns:
        ds = pipeline._undecoded(ds)
        base = (None if hub is not None else Path(cfg.dataset).resolve() if Path(cfg.dataset).is_dir()
                else Path(cfg.dataset).resolve().parent)
    fn = TokenizePairs(tokenizer, cfg.max_seq_length, cfg.drop_long_sequences, prefix, margin, images, base)
    mapped = pipeline.map_records(ds, fn, work, num_proc=num_proc, features=_features(margin, columns),
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
    if columns:
        stats.dropped_image_cut = int(table.column("_image_cut").to_numpy().astype(bool).sum())
        stats.without_images = int(table.column("_no_image").to_numpy().astype(bool).sum())
    if not stats.pairs:
        raise DataError(f"{name}: no pairs left after truncation ({stats.summary()})")
    pipeline.commit(mapped, ~dropped, ["_prompt_cut", "_completion_cut", "_dropped"]
                    + (["_no_image", "_image_cut"] if columns else []), work / "final", stats.__dict__)
    del mapped, table, ds
    return stats


def prepare_pairs(cfg, tokenizer, *, local_rank: int = 0, log=print, margin: bool = False, seed: int = 42,
                  images: bool = False):
    """(datasets.Dataset of pairs, PreferenceStats, cache key): tokenized once per node (per job on a shared cache
    folder) and cached as SFT data is, under a key of its own. `margin`: with each pair's margin column (reward
    models), cached under another key. `images`: the method reads image pairs (DPO): with a vision-language model's
    processor on the tokenizer, every pair goes through it (VisionPairCollator's columns), cached under another key;
    without one, a record with images is refused as for a text-only model."""
    import functools

    from finetune.data import mix, pipeline

    num_proc = getattr(cfg, "dataset_num_proc", None) or pipeline.default_num_proc()
    vision_pairs = images and processor_of(tokenizer) is not None
    build = functools.partial(tokenize_source, margin=margin, images=images) if margin or images else tokenize_source
    parts = [pipeline.prepare_source(sub, tokenizer, P.load_hub(sub), local_rank=local_rank, num_proc=num_proc,
                                     log=log, build=build, stats_cls=PreferenceStats,
                                     kind=f"pairs{PAIR_VERSION}" + ("-margin" if margin else "")
                                     + ("-vision" if vision_pairs else ""), with_key=True)
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
        rejected_tokens=sum(s.rejected_tokens for s in stats),
        dropped_image_cut=sum(s.dropped_image_cut for s in stats),
        without_images=sum(s.without_images for s in stats))


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


class VisionPairCollator:
    """PairCollator's rows for image pairs, with what a vision-language model takes besides the tokens: the
    processor runs on each pair's cached prompt text and images, twice (the chosen rows, then the rejected rows, as
    TRL's vision preference collator), its prompt tokens checked against the cache's; per-token outputs (Gemma-3's
    token types, Qwen's mm token types) are the processor's over the prompt and 0 (text) over the completion, the
    rest (pixel values, image grids, sizes, pixel masks) as the processor gives them."""

    def __init__(self, processor, pad_token_id: int):
        self.processor, self.pad_token_id = processor, pad_token_id
        self.rows = PairCollator(pad_token_id)

    def __call__(self, features) -> dict:
        import torch

        features = list(features)
        batch = self.rows(features)
        texts = [f["text"] for f in features] * 2
        images = [[as_pil(x) for x in f.get("images") or []] for f in features] * 2
        enc = self.processor(text=texts, images=images if any(images) else None, padding=True, padding_side="right",
                             add_special_tokens=False, return_tensors="pt")
        ids = enc["input_ids"]
        prompts = [len(f["prompt_ids"]) for f in features] * 2
        for i, (f, n) in enumerate(zip(features * 2, prompts)):
            if ids.shape[1] < n or ids[i, :n].tolist() != list(f["prompt_ids"]):
                raise DataError(
                    "the processor's tokens of a cached prompt differ from the cache's (an image file changed size "
                    "since the data was tokenized, or the processor's settings changed): delete the tokenized data "
                    "cache (--dataset_cache_dir) and run again")
        rows, width = batch["input_ids"].shape
        for key, value in enc.items():
            if key in ("input_ids", "attention_mask") or not isinstance(value, torch.Tensor):
                continue
            if value.dim() >= 2 and value.shape[:2] == ids.shape[:2]:  # per token: the prompt's, 0 over completions
                out = value.new_zeros((rows, width) + tuple(value.shape[2:]))
                for i, n in enumerate(prompts):
                    out[i, :n] = value[i, :n]
                value = out
            batch[key] = value
        return batch


# The keys of a pair batch that are not the model's inputs (sequence_logps passes it the rest: the tokens, the
# attention mask, and a vision-language model's pixel values, image grids and token types).
NOT_MODEL_INPUTS = ("labels", "pair_index", "margin", "ref_logps")


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS + (SCORED_POSITIONS, SCORED_INDEX)}


def pair_collator(tokenizer, images: bool = False):
    """The collator of a pair method's batches: VisionPairCollator for a method that reads image pairs (`images`)
    with a vision-language model's processor on the tokenizer, else PairCollator."""
    processor = processor_of(tokenizer) if images else None
    if processor is not None:
        return VisionPairCollator(processor, tokenizer.pad_token_id)
    return PairCollator(tokenizer.pad_token_id)


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
