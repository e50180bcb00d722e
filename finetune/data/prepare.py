"""Local data files or Hub data sets (sources.py) -> validated records -> tokenized examples with loss masks -> padded batches.

Record formats (text, alpaca, messages, sharegpt) are one module each in data/formats/, listed by its registry.
A record becomes one example, or one per assistant turn where the template rewrites earlier turns
(tokenize_examples, the per-record unit).
"""

from __future__ import annotations

import bisect
import csv
import json
import operator
import os
import types
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from finetune import compat
from finetune.constants import IGNORE_INDEX, TRAINED_ROWS
from finetune.data import formats
from finetune.data.errors import DataError

# Bump when tokenization changes, so stale caches are not reused.
DATA_VERSION = "5"  # 4: Arrow cache of int32 columns written by pipeline.py; per-turn examples; end-of-turn counts;
# 5: the cache is the map's own files (layout.json), not a save_to_disk copy


# ----------------------------------------------------------------------------------------------
# Reading files. Each record comes with where it was found, for error messages.


def read_records(path: str | Path) -> tuple[list[dict], list[str]]:
    """Return (records, locations); a location reads like 'data.jsonl:12' or 'data.csv row 3'."""
    p = Path(path)
    if p.is_dir():
        return _read_saved(p)
    suffix = p.suffix.lower()
    try:
        if suffix in (".jsonl", ".json"):
            records, where = read_json(p)
        elif suffix == ".csv":
            records, where = _read_csv(p)
        elif suffix == ".parquet":
            records, where = _read_parquet(p)
        else:
            raise DataError(f"{p}: unsupported file type '{suffix}'; use .jsonl, .json, .csv, .parquet or a save_to_disk folder")
    except UnicodeDecodeError:
        raise DataError(f"{p}:{first_bad_utf8_line(p)}: not UTF-8 text; save the file as UTF-8") from None
    if not records:
        raise DataError(f"{p}: the file holds no records")
    return records, where


def first_bad_utf8_line(p: Path) -> int:
    raw = p.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return raw[: e.start].count(b"\n") + 1
    return 1


def read_json(p: Path) -> tuple[list[dict], list[str]]:
    text = p.read_text(encoding="utf-8-sig")  # -sig: also accept a byte order mark, as some editors write
    if p.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        records, where = [], []
        for i, item in enumerate(data):
            if not isinstance(item, dict):
                raise DataError(f"{p} record {i}: expected a JSON object, got {type(item).__name__}")
            records.append(item)
            where.append(f"{p} record {i}")
        return records, where
    records, where = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(item, dict):
            raise DataError(f"{p}:{lineno}: expected a JSON object per line, got {type(item).__name__}")
        records.append(item)
        where.append(f"{p}:{lineno}")
    return records, where


def _read_csv(p: Path) -> tuple[list[dict], list[str]]:
    with p.open(newline="", encoding="utf-8-sig") as f:  # Excel writes a byte order mark
        rows = list(csv.DictReader(f))
    records = []
    for row in rows:
        # A `messages` column in CSV holds JSON text.
        if isinstance(row.get("messages"), str) and row["messages"].lstrip().startswith("["):
            try:
                row["messages"] = json.loads(row["messages"])
            except json.JSONDecodeError:
                pass  # reported by validation as a wrong type
        records.append(row)
    return records, [f"{p} row {i + 1}" for i in range(len(records))]


def _read_parquet(p: Path) -> tuple[list[dict], list[str]]:
    import pyarrow.parquet as pq

    try:
        records = pq.read_table(p).to_pylist()
    except Exception as e:  # pyarrow.ArrowInvalid and friends: not a Parquet file
        raise DataError(f"{p}: cannot read as Parquet: {e}") from None
    return records, [f"{p} row {i}" for i in range(len(records))]


def load_saved(p: Path):
    """A save_to_disk folder as a Dataset (a DatasetDict's 'train' split); errors name the folder."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except FileNotFoundError as e:
        raise DataError(f"{p}: not a folder written by datasets.save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{p}: a DatasetDict without a 'train' split (splits: {', '.join(ds)})")
        ds = ds["train"]
    return ds


def _read_saved(p: Path) -> tuple[list[dict], list[str]]:
    records = load_saved(p).to_list()
    if not records:
        raise DataError(f"{p}: the data set holds no records")
    return records, [f"{p} row {i}" for i in range(len(records))]


def load_hub(cfg):
    """A Hub data set (`--dataset org/name`), loaded on every rank (memory-mapped from the datasets cache), or None."""
    from finetune.data import sources

    if not sources.is_hub_dataset(cfg):
        return None
    try:
        return sources.load_hub(cfg)
    except sources.HubDataError as e:
        raise DataError(str(e)) from None


def read_hub_records(hub) -> tuple[list[dict], list[str]]:
    from finetune.data import sources

    records, where = sources.records_of(hub)
    if not records:
        raise DataError(f"{where[0] if where else hub.repo_id}: the data set holds no records")
    return records, where


# ----------------------------------------------------------------------------------------------
# Formats.


def detect_format(record: dict, where: str) -> str:
    return formats.detect(record, where).name


def validate_record(record: dict, fmt: str, where: str) -> None:
    formats.get(fmt).validate(record, where)


# ----------------------------------------------------------------------------------------------
# Tokenization with loss masks.


def require_chat_template(tokenizer, fmt: str, where: str) -> None:
    if not tokenizer.chat_template:
        raise DataError(
            f"{where}: '{fmt}' records are rendered with the tokenizer's chat template, and this tokenizer has none "
            "(a base model); pass --chat_template FILE.jinja (a Jinja chat template, e.g. ChatML's) or use a model "
            "whose tokenizer ships one"
        )


def _plain_messages(messages) -> bool:
    """A list of dicts of plain JSON (below) none of which holds None: apply_chat_template drops keys holding None,
    so a message holding one takes its path, to drop them the same way."""
    if type(messages) is not list:
        return False
    for m in messages:
        if type(m) is not dict:
            return False
        for k, v in m.items():
            t = type(v)
            if type(k) is not str or v is None or not (t is str or t is int or t is float or t is bool or _plain_json(v)):
                return False
    return True


def _plain_json(value) -> bool:
    """Only JSON's own types, exactly (no subclasses, tuples or other objects): the values apply_chat_template's
    normalization copies unchanged. Leaves are checked inline (a call per message value was a tenth of a short
    conversation's preparation)."""
    kind = type(value)
    if kind is dict:
        if not all(type(k) is str for k in value):
            return False
        values = value.values()
    elif kind is list:
        values = value
    else:
        return value is None or kind is str or kind is int or kind is float or kind is bool
    for v in values:
        t = type(v)
        if not (t is str or v is None or t is int or t is float or t is bool) and not _plain_json(v):
            return False
    return True


class ChatRenderer:
    """apply_chat_template(..., tokenize=False) of one tokenizer without its per-call work, most of the cost of a
    short conversation (issue 13): the template compiled by transformers' own cache, the special tokens read once,
    and messages of plain JSON types checked once per conversation and passed as they are (apply_chat_template would
    copy them into equal values). Anything else (other objects, a tokenizer class with its own apply_chat_template,
    a transformers without these helpers) takes apply_chat_template itself; tests/test_formats.py compares the two."""

    def __init__(self, tokenizer):
        from transformers import PreTrainedTokenizerBase

        self.tokenizer, self.compile, self.templates = tokenizer, None, {}
        if getattr(type(tokenizer), "apply_chat_template", None) is not PreTrainedTokenizerBase.apply_chat_template:
            return
        helpers = compat.chat_template_helpers()
        if helpers is None:
            return
        self.compile, self.alias, self.reasoning, plain_data = helpers
        self.variables = plain_data(tokenizer.special_tokens_map)

    def __call__(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "", tools=None) -> str:
        return self.prefixes(messages, where, tools)(len(messages), add_generation_prompt)

    def prefixes(self, messages: list[dict], where: str = "", tools=None):
        """render(n, add_generation_prompt=False): the conversation's first n messages rendered; a template error is a
        DataError naming `where`."""
        tools = tools or None
        try:
            compiled = self._compiled(messages, tools)
        except Exception as e:
            raise _rejected(where, e) from None

        def render(n: int, add_generation_prompt: bool = False) -> str:
            try:
                if compiled is not None:
                    template, template_globals, _, seen, shared = compiled
                    return compat.render_template(template, template_globals, {
                        **shared, "messages": seen[:n], "add_generation_prompt": add_generation_prompt})
                return self.tokenizer.apply_chat_template(messages[:n], tokenize=False, add_generation_prompt=add_generation_prompt,
                                                          **({"tools": tools} if tools else {}))
            except Exception as e:  # e.g. raise_exception('Conversation roles must alternate ...') in the template
                raise _rejected(where, e) from None

        return render

    def one_pass_layout(self, messages: list[dict], tools=None):
        """chat_layout's (full, spans) from one rendering (finetune.data.one_pass), or None."""
        from finetune.data import one_pass

        try:
            compiled = self._compiled(messages, tools or None)
        except Exception:  # the per-prefix path reports it
            return None
        if compiled is None or not compiled[2]:
            return None
        template, template_globals, _, seen, shared = compiled

        def pieces(marked):
            variables = {**shared, "messages": marked, "add_generation_prompt": True}
            return compat.template_pieces(template, template_globals, variables)

        return one_pass.layout(pieces, messages, seen)

    def _compiled(self, messages: list[dict], tools):
        """(template, its globals, whether one rendering lays a conversation out, the messages as the template reads
        them, what every rendering of them shares), or None where apply_chat_template itself renders them."""
        if self.compile is None or not _plain_json(tools) or not _plain_messages(messages):
            return None
        template, template_globals, single = self._template(tools)
        # Reasoning under its other names is copied to the names templates read, as apply_chat_template does.
        seen = self.alias(messages) if any(not self.reasoning.isdisjoint(m) for m in messages) else messages
        # The template's globals, then the variables.
        shared = {**template_globals, "tools": tools, "documents": None, **self.variables}
        return template, template_globals, single, seen, shared

    def _template(self, tools):
        """(compiled template, its globals as a dict, one_pass) of the template apply_chat_template would pick."""
        from finetune.data import one_pass

        source = self.tokenizer.get_chat_template(None, tools)
        found = self.templates.get(source) or _RENDER_TEMPLATES.get(source)
        if found is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            template = self.compile(source)
            env = template.environment
            if type(env) is ImmutableSandboxedEnvironment:
                # The sandbox checks every attribute a template reads (`loop.first`: half the rendering time of a
                # short chat); its answer depends on the object's type and the name only, so it is remembered per
                # (type, name), on a copy of transformers' environment (theirs is left as it is).
                env = env.overlay()
                env.is_safe_attribute = _per_type(env.is_safe_attribute)
                env.getattr = _known_getattr(env)
                template = env.from_string(source)
            # Whether one rendering gives a conversation's layout: decided once per template (finetune.data.one_pass).
            single = not template.environment.is_async and one_pass.one_pass(source, template.environment)
            found = _RENDER_TEMPLATES[source] = (template, dict(template.globals), single)
        self.templates[source] = found
        return found


def _rejected(where: str, error: Exception) -> DataError:
    return DataError(f"{where}: the tokenizer's chat template rejected this conversation: {error}")


_RENDER_TEMPLATES: dict = {}  # source -> (template, globals, one_pass): a renderer is made per map batch, compiled once


def _per_type(check):
    """A sandbox's is_safe_attribute(obj, attr, value) remembered per (type(obj), attr): jinja2's checks (names with
    underscores, internal attributes of functions, frames, generators, mutating methods of lists, dicts and sets)
    look at nothing else."""
    known: dict = {}

    def is_safe_attribute(obj, attr, value):
        key = (type(obj), attr)
        safe = known.get(key)
        if safe is None:
            safe = known[key] = check(obj, attr, value)
        return safe

    return is_safe_attribute


_METHODS = (types.MethodType, types.BuiltinMethodType)
_DICT_NAMES = frozenset(dir(dict))


def _known_getattr(env):
    """The sandbox's getattr(obj, attr) (`loop.first`, `message.content`) without its checks where their answer is
    known: a key of a plain dict that is no dict attribute is the item (the sandbox first raises and catches an
    AttributeError); an attribute that is no method and that the (per type remembered, _per_type) safety check
    passes is the attribute itself (the sandbox wraps str.format, so methods always take its path)."""
    slow, check = env.getattr, env.is_safe_attribute

    def getattr_(obj, attribute):
        if type(obj) is dict and attribute not in _DICT_NAMES:
            try:
                return obj[attribute]
            except (KeyError, TypeError):
                return slow(obj, attribute)
        try:
            value = getattr(obj, attribute)
        except AttributeError:
            return slow(obj, attribute)
        if isinstance(value, _METHODS) or not check(obj, attribute, value):
            return slow(obj, attribute)
        return value

    return getattr_


def assistant_turns(tokenizer, messages: list[dict], where: str = "", tools=None, renderer=None) -> list[tuple[str, str]]:
    """(context, through) for each assistant turn: the text the model continues at inference (the conversation
    before the turn rendered with the generation prompt) and the conversation rendered through the turn, which
    must start with the context."""
    renderer = renderer or ChatRenderer(tokenizer)
    return _turns(renderer, renderer.prefixes(messages, where, tools), messages, where, tools)


def _turns(renderer, render, messages: list[dict], where: str, tools) -> list[tuple[str, str]]:
    turns = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        context = render(i, True) if i else _before_first(renderer, m, where, tools)
        through = render(i + 1)
        if context is None or not through.startswith(context):
            raise DataError(
                f"{where}: the chat template does not render the assistant turn messages[{i}] after its generation "
                "prompt (the text the model continues at inference), so its tokens cannot be located; use a template "
                "whose generation prompt ends where an assistant turn's content starts"
            )
        turns.append((context, through))
    return turns


def chat_layout(tokenizer, messages: list[dict], where: str = "", tools=None, renderer=None):
    """(full, spans): the conversation rendered and the character spans of its assistant turns; or, where the
    template rewrites history (a prefix of the conversation is not rendered as a prefix of the whole, as Qwen3 drops
    the reasoning of turns before the last user message), (None, assistant_turns).

    A span starts where the template's generation prompt ends and ends where the rendered turn ends, so it is right
    with or without `{% generation %}` markers.
    """
    renderer = renderer or ChatRenderer(tokenizer)
    found = renderer.one_pass_layout(messages, tools)
    return found if found is not None else layout_by_prefixes(renderer, messages, where, tools)


def layout_by_prefixes(renderer, messages: list[dict], where: str = "", tools=None):
    """chat_layout from each assistant turn's renderings (its context, and through it)."""
    render = renderer.prefixes(messages, where, tools)
    turns = _turns(renderer, render, messages, where, tools)
    # A conversation ending with an assistant turn was just rendered whole, as that turn's `through`.
    full = turns[-1][1] if messages[-1]["role"] == "assistant" else render(len(messages))
    if not all(full.startswith(through) for _, through in turns):
        return None, turns
    return full, [(len(context), len(through)) for context, through in turns]


def _before_first(renderer, first: dict, where: str, tools=None) -> str | None:
    """The text before the content of a conversation's first message (an assistant turn).

    An empty conversation cannot be rendered (and would miss a default system prompt the template adds),
    so render the first turn with a marker as its content and cut at the marker.
    """
    marker = "FINETUNEMARKER7f3a"
    text = renderer([{**first, "content": marker}], where=where, tools=tools)
    return text[: text.index(marker)] if marker in text else None


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def _plain_backend(tokenizer):
    """The fast tokenizer's Rust backend where calling it is what tokenizer(texts, add_special_tokens=False) runs
    (nothing truncated or padded), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))):
        return backend
    return None


def _encode(tokenizer, texts: list[str], offsets: bool = False) -> tuple[list, list]:
    """(ids, offsets or []) of texts, in one tokenizer call (the fast tokenizer's own batch, each text on its own)."""
    if not texts:
        return [], []
    backend = _plain_backend(tokenizer)
    if backend is not None:
        # Without transformers' conversion of every encoding into a dict of lists.
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings], [e.offsets for e in encodings] if offsets else []
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=offsets, return_attention_mask=False,
                    return_token_type_ids=False)
    return enc["input_ids"], enc["offset_mapping"] if offsets else []


def _mask_spans(tokenizer, full: str, spans: list[tuple[int, int]], completion_only: bool) -> tuple[list[int], list[int]]:
    (ids,), (offsets,) = _encode(tokenizer, [full], offsets=True)
    return _span_labels(tokenizer, ids, offsets, len(full), spans, completion_only, _special_ids(tokenizer))


def _span_labels(tokenizer, ids: list[int], offsets: list[tuple[int, int]], end: int, spans: list[tuple[int, int]],
                 completion_only: bool, special: set[int]) -> tuple[list[int], list[int]]:
    """Train the tokens that start inside a span (through its last special token), for a text `end` characters long."""
    return _labels(tokenizer, ids, _runs_from_offsets(offsets, spans), [b == end for _, b in spans], completion_only,
                   special)


def _runs_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list:
    """Per span, the indices of the tokens that start inside it and hold text."""
    starts = list(map(operator.itemgetter(0), offsets))
    # Offsets run in text order (always, for the tokenizers seen), so a span's tokens are one run found by bisection.
    ordered = all(map(operator.le, starts, starts[1:]))
    runs = []
    for a, b in spans:
        if ordered:
            inside = range(bisect.bisect_left(starts, a), bisect.bisect_left(starts, b))
            if any(e <= s for s, e in offsets[inside.start:inside.stop]):  # a token with no text is never trained
                inside = [t for t in inside if offsets[t][1] > offsets[t][0]]
        else:
            inside = [t for t, (s, e) in enumerate(offsets) if a <= s < b and e > s]
        runs.append(inside)
    return runs


def _runs_from_encoding(encoding, n: int, end: int, spans: list[tuple[int, int]]) -> list[range]:
    """_runs_from_offsets without the offsets list (turning every offset into a Python tuple cost a third of the
    tokenization, issue 13): each run's ends looked up at its span's ends, for tokenizers whose offsets are ordered
    and never empty (_offsets_ordered)."""
    return [range(_first_token_from(encoding, n, end, a), _first_token_from(encoding, n, end, b)) for a, b in spans]


def _first_token_from(encoding, n: int, end: int, char: int) -> int:
    """bisect_left over the tokens' start characters: the first token starting at `char` or later."""
    t = None
    while t is None:
        if char >= end:
            return n
        # A character in no token (NFC joins 'e' and a combining accent into one, mapped to the 'e'): no token
        # starts there either, so the answer is the next character's.
        t = encoding.char_to_token(char)
        char += 1
    char -= 1
    # A character can be split over several tokens (bytes of one character), and a token can start before `char`.
    while t > 0 and encoding.token_to_chars(t - 1)[0] >= char:
        t -= 1
    while t < n and encoding.token_to_chars(t)[0] < char:
        t += 1
    return t


def _offsets_ordered(tokenizer) -> bool:
    """The tokenizer's offsets run in text order and every token holds text: byte-level BPE (GPT-2, Llama-3, Qwen,
    SmolLM2) with no normalizer or NFC, no offset trimming. Each token is then bytes of the text in order, mapped to
    the characters holding them. Anything else (SentencePiece's prepended '▁', trimmed offsets) keeps the offsets
    list. Read once per tokenizer."""
    try:
        return _ORDERED[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    ok = False
    if backend is not None:
        # Each part's own JSON, not the whole tokenizer's (its vocabulary: megabytes).
        spec = {}
        for part in ("normalizer", "pre_tokenizer", "post_processor"):
            try:
                component = getattr(backend, part)
                spec[part] = json.loads(component.__getstate__()) if component is not None else None
            except Exception:
                spec[part] = {"type": "unknown"}

        def steps(part):
            if not part:
                return []
            return [s for p in part.get("pretokenizers") or part.get("normalizers") or part.get("processors") or [part]
                    for s in ([p] if p.get("type") != "Sequence" else steps(p))]

        pre = steps(spec.get("pre_tokenizer"))
        ok = (type(backend.model).__name__ == "BPE"
              and all(n.get("type") == "NFC" for n in steps(spec.get("normalizer")))
              and bool(pre) and pre[-1].get("type") == "ByteLevel"
              and all(p.get("type") in ("Split", "ByteLevel") for p in pre)
              and all(p.get("type") == "TemplateProcessing" or (p.get("type") == "ByteLevel" and not p.get("trim_offsets"))
                      for p in steps(spec.get("post_processor"))))
    try:
        _ORDERED[tokenizer] = ok
    except TypeError:  # not weakly referable: checked again next time
        pass
    return ok


_ORDERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _labels(tokenizer, ids: list[int], runs: list, at_end: list[bool], completion_only: bool,
            special: set[int]) -> tuple[list[int], list[int]]:
    """Labels training each run of tokens through its last special token; a run reaching the end of the text with
    no special token gets EOS appended and trained."""
    labels = [IGNORE_INDEX] * len(ids)
    needs_eos = False
    for inside, last in zip(runs, at_end):
        # Train through the turn's end-of-turn token, not the whitespace the template puts after it.
        last_special = next((k for k in range(len(inside) - 1, -1, -1) if ids[inside[k]] in special), None)
        if last_special is not None:
            inside = inside[: last_special + 1]
        elif last:
            needs_eos = True
        if isinstance(inside, range):
            labels[inside.start:inside.stop] = ids[inside.start:inside.stop]
        else:
            for t in inside:
                labels[t] = ids[t]
    ids = list(ids)
    if needs_eos and tokenizer.eos_token_id is not None:
        # The template ends the last turn with no special token: append EOS so the model learns to stop.
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
    if not completion_only:
        labels = list(ids)  # every token, the appended EOS included
    return ids, labels


def _turn_example(tokenizer, prompt: list[int], turn: list[int], completion_only: bool,
                  special: set[int]) -> tuple[list[int], list[int]]:
    """One assistant turn as its own example: the context's tokens exactly as the model gets them at inference
    (apply_chat_template(..., add_generation_prompt=True) tokenizes the rendered text on its own), then the turn's."""
    last_special = max((t for t, x in enumerate(turn) if x in special), default=None)
    if last_special is not None:
        trained = turn[: last_special + 1] + [IGNORE_INDEX] * (len(turn) - last_special - 1)
    else:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        turn, trained = turn + eos, turn + eos
    ids = list(prompt) + list(turn)
    return ids, (list(ids) if not completion_only else [IGNORE_INDEX] * len(prompt) + trained)


def encode_chats(tokenizer, layouts: list, completion_only: bool) -> list[list[tuple[list[int], list[int]]]]:
    """The examples of conversations laid out by chat_layout: one for each whole rendering, one per assistant turn
    of the others. All their texts are tokenized in two tokenizer calls (the whole renderings with offsets)."""
    special = _special_ids(tokenizer)
    wholes = [(full, spans) for full, spans in layouts if full is not None]
    whole = iter(_whole_examples(tokenizer, wholes, completion_only, special))
    # A turn's context and the turn are tokenized apart; an empty context is no tokens, not the text "".
    pieces = [text for full, turns in layouts if full is None for context, through in turns
              for text in ((context,) if context else ()) + (through[len(context):],)]
    piece_ids = iter(_encode(tokenizer, pieces)[0])
    out = []
    for full, parts in layouts:
        if full is not None:
            out.append([next(whole)])
        else:
            out.append([_turn_example(tokenizer, next(piece_ids) if context else [], next(piece_ids), completion_only, special)
                        for context, _ in parts])
    return out


def _whole_examples(tokenizer, wholes: list[tuple[str, list]], completion_only: bool, special: set[int]) -> list:
    """(ids, labels) of whole renderings and their assistant spans."""
    if not wholes:
        return []
    backend = _plain_backend(tokenizer)
    if backend is None or not _offsets_ordered(tokenizer):
        ids, offsets = _encode(tokenizer, [full for full, _ in wholes], offsets=True)
        return [_span_labels(tokenizer, i, o, len(full), spans, completion_only, special)
                for i, o, (full, spans) in zip(ids, offsets, wholes)]
    out = []
    for encoding, (full, spans) in zip(backend.encode_batch([full for full, _ in wholes], add_special_tokens=False), wholes):
        ids = encoding.ids
        runs = _runs_from_encoding(encoding, len(ids), len(full), spans)
        out.append(_labels(tokenizer, ids, runs, [b == len(full) for _, b in spans], completion_only, special))
    return out


def chat_examples(tokenizer, messages: list[dict], completion_only: bool, where: str = "", tools=None) -> list[tuple[list[int], list[int]]]:
    """One example for the conversation where the template renders a prefix as a prefix (ChatML, Llama-3), else one
    per assistant turn in the context the template renders at inference, only that turn trained."""
    return encode_chats(tokenizer, [chat_layout(tokenizer, messages, where, tools)], completion_only)[0]


def _is_chat(tokenizer, fmt: str) -> bool:
    return formats.get(fmt).uses_template(tokenizer)


def _conversation(tokenizer, record: dict, fmt: str, where: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) of a record rendered with the chat template."""
    if formats.get(fmt).chat:
        require_chat_template(tokenizer, fmt, where)
    return formats.get(fmt).conversation(record, where)


def tokenize_examples(tokenizer, record: dict, fmt: str, completion_only: bool, where: str = "") -> list[tuple[list[int], list[int]]]:
    """The per-record unit: (input_ids, labels) pairs, one per record, or one per assistant turn of a conversation
    whose template rewrites earlier turns. A top-level function of its arguments only, so datasets.map workers run it."""
    if _is_chat(tokenizer, fmt):
        return tokenize_many(tokenizer, [(record, where)], fmt, completion_only)[0]
    return formats.get(fmt).examples(tokenizer, record, completion_only)


def tokenize_many(tokenizer, records: Iterable[tuple[dict, str]], fmt: str, completion_only: bool) -> list[list[tuple[list[int], list[int]]]]:
    """tokenize_examples of each (record, where), in order (so the first bad record is the one reported); chat
    records are all rendered first, then tokenized together (encode_chats)."""
    if not _is_chat(tokenizer, fmt):
        return [tokenize_examples(tokenizer, record, fmt, completion_only, where) for record, where in records]
    renderer = ChatRenderer(tokenizer)
    layouts = []
    for record, where in records:
        messages, tools = _conversation(tokenizer, record, fmt, where)
        layouts.append(chat_layout(tokenizer, messages, where, tools, renderer))
    return encode_chats(tokenizer, layouts, completion_only)


def tokenize_record(tokenizer, record: dict, fmt: str, completion_only: bool, where: str = "") -> tuple[list[int], list[int]]:
    """tokenize_examples for a record that is one example (refused for one its template splits per turn)."""
    examples = tokenize_examples(tokenizer, record, fmt, completion_only, where)
    if len(examples) != 1:
        raise DataError(f"{where}: the chat template rewrites earlier turns, so this conversation is "
                        f"{len(examples)} examples, one per assistant turn (tokenize_examples)")
    return examples[0]


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """EOS and the special token the chat template closes an assistant turn with (<|im_end|>, <|eot_id|>, ...):
    an example that trains one of them teaches the model to stop."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if tokenizer.chat_template:
        marker = "FINETUNEMARKER7f3a"
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False)
        except Exception:  # a template with rules of its own; EOS alone then
            text = ""
        if marker in text:
            after = tokenizer(text[text.index(marker) + len(marker):], add_special_tokens=False)["input_ids"]
            closing = next((t for t in after if t in _special_ids(tokenizer)), None)
            if closing is not None:
                ids.add(closing)
    return frozenset(ids)


def has_trained_end(labels: list[int], end_ids: frozenset[int]) -> bool:
    return not end_ids.isdisjoint(labels[1:])  # position 0 is never predicted


@dataclass
class DataStats:
    path: str
    format: str
    records: int
    truncated: int
    dropped_long: int
    dropped_no_labels: int
    examples: int
    tokens: int
    trained_tokens: int
    max_seq_length: int
    # --packing: rows the records were packed into (0 = not packed), and the real-token share of their slots.
    packed_rows: int = 0
    padding_free: bool = False
    # Conversations whose chat template rewrites earlier turns, and the per-turn examples they became.
    split_records: int = 0
    split_examples: int = 0
    # Examples that train no EOS / end-of-turn token (end_tokens names them), and how many of those were truncated.
    no_trained_end: int = 0
    no_trained_end_truncated: int = 0
    end_tokens: str = ""
    # Image records that truncation at max_seq_length would have cut inside or before an image's tokens (dropped).
    dropped_image_cut: int = 0
    # Examples of an image data set that hold no image (text records beside the image records).
    without_images: int = 0

    @property
    def packing_efficiency(self) -> float:
        return self.tokens / max(self.packed_rows * self.max_seq_length, 1)

    def summary(self) -> str:
        long_note = (
            f"{self.dropped_long} longer than max_seq_length={self.max_seq_length} dropped"
            if self.dropped_long
            else f"{self.truncated} longer than max_seq_length={self.max_seq_length} truncated"
        )
        return (
            f"data: {self.records} records ({self.format}) from {self.path}; {long_note}; "
            f"{self.dropped_no_labels} with no trained tokens left dropped; "
            + (f"{self.dropped_image_cut} dropped because truncation at max_seq_length={self.max_seq_length} would cut "
               "an image's tokens (raise --max_seq_length to keep them); " if self.dropped_image_cut else "")
            + f"{self.examples} examples, "
            f"{self.tokens} tokens ({self.trained_tokens} trained), mean length {self.tokens / max(self.examples, 1):.1f}"
            + (f"\nnotice: the chat template rewrites earlier turns (as Qwen3's drops their reasoning), so "
               f"{self.split_records} conversation{'s' if self.split_records != 1 else ''} became {self.split_examples} examples, one per assistant turn, "
               "each in the context the template renders at inference" if self.split_records else "")
            + self.end_warning()
            + (f"\npacking: {self.examples} records into {self.packed_rows} rows of {self.max_seq_length} tokens "
               f"(best-fit decreasing); efficiency {100 * self.packing_efficiency:.1f}% real tokens / slots"
               if self.packed_rows else "")
            + ("\npadding-free: each micro-batch is one flattened row, no padding" if self.padding_free else "")
        )

    def end_warning(self) -> str:
        if 2 * self.no_trained_end <= self.examples:
            return ""
        cut = (f"; {self.no_trained_end_truncated} of them lost it to truncation at max_seq_length={self.max_seq_length}"
               " (raise --max_seq_length, or --drop_long_sequences)" if self.no_trained_end_truncated else "")
        return (f"\nwarning: {self.no_trained_end} of {self.examples} examples train no end-of-turn/EOS token "
                f"({self.end_tokens or 'the tokenizer has no EOS'}), so the model may not learn to stop{cut}")


def tokenize_all(records: list[dict], where: list[str], fmt: str, tokenizer, max_seq_length: int,
                 drop_long: bool, completion_only: bool, path: str = "") -> tuple[list[dict], DataStats]:
    """The per-record reference of pipeline.py's map, on Python lists (tests compare the two)."""
    examples = []
    truncated = dropped_long = dropped_no_labels = split_records = split_examples = no_end = no_end_cut = 0
    end_ids = end_of_turn_ids(tokenizer)
    for record, loc in zip(records, where):
        pairs = tokenize_examples(tokenizer, record, fmt, completion_only, loc)
        if len(pairs) > 1:
            split_records, split_examples = split_records + 1, split_examples + len(pairs)
        for ids, labels in pairs:
            cut = len(ids) > max_seq_length
            if cut:
                if drop_long:
                    dropped_long += 1
                    continue
                truncated += 1
                ids, labels = ids[:max_seq_length], labels[:max_seq_length]
            # Position 0 is never predicted (labels shift by one), so it cannot carry the only trained token.
            if all(label == IGNORE_INDEX for label in labels[1:]):
                dropped_no_labels += 1
                continue
            if not has_trained_end(labels, end_ids):
                no_end, no_end_cut = no_end + 1, no_end_cut + cut
            examples.append({"input_ids": ids, "labels": labels})
    stats = DataStats(
        path=str(path), format=fmt, records=len(records), truncated=truncated, dropped_long=dropped_long,
        dropped_no_labels=dropped_no_labels, examples=len(examples),
        tokens=sum(len(e["input_ids"]) for e in examples),
        trained_tokens=sum(sum(1 for x in e["labels"][1:] if x != IGNORE_INDEX) for e in examples),
        max_seq_length=max_seq_length, split_records=split_records, split_examples=split_examples,
        no_trained_end=no_end, no_trained_end_truncated=no_end_cut,
        end_tokens=", ".join(tokenizer.convert_ids_to_tokens(sorted(end_ids))),
    )
    return examples, stats


# ----------------------------------------------------------------------------------------------
# Where the tokenize-once cache lives (finetune.data.pipeline writes and reads it).


def cache_root(cfg) -> Path:
    if cfg.dataset_cache_dir:
        return Path(cfg.dataset_cache_dir)
    return Path(os.environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune")) / "tokenized"


# ----------------------------------------------------------------------------------------------


class Collator:
    """Right-pads a batch. Labels come from tokenization, never from `input_ids == pad`, so a pad that
    equals EOS never masks a trained EOS."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Iterable[dict[str, Any]]) -> dict[str, Any]:
        import torch

        features = list(features)
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(features), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(features), length), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.as_tensor(f["input_ids"])
            labels[i, :n] = torch.as_tensor(f["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def make_collator(cfg, tokenizer):
    """The collator every training path uses: padded records, or packed / padding-free rows (finetune.data.packing).

    `cfg`: the FinetuneConfig (or its DataConfig; the attention kernel then counts as sdpa).
    """
    from finetune.data.packing import PackedCollator, collator_layout

    from finetune.data.images import PackedVisionCollator, VisionCollator, processor_of

    data_cfg = getattr(cfg, "data", cfg)
    attn = getattr(getattr(cfg, "model", None), "attn_implementation", "sdpa")
    layout = collator_layout(getattr(data_cfg, "packing", False), getattr(data_cfg, "padding_free", False), attn)
    if processor_of(tokenizer) is not None:  # a vision-language model: its processor makes the batches
        if layout is not None:  # a family that packs image records (prepare_dataset refuses the others)
            return PackedVisionCollator(processor_of(tokenizer), tokenizer.pad_token_id, layout=layout)
        return VisionCollator(processor_of(tokenizer), tokenizer.pad_token_id)
    collator = Collator(tokenizer.pad_token_id) if layout is None else PackedCollator(tokenizer.pad_token_id,
                                                                                       layout=layout)
    return WithTrainedRows(collator) if chunked_loss_on(cfg) else collator


def chunked_loss_on(cfg) -> bool:
    """Whether the training loss is the chunked one (--loss_chunk_size, finetune.training.loss): not where Liger's
    patched forward computes the loss (--use_liger_kernel). `cfg`: the FinetuneConfig."""
    chunk = getattr(getattr(cfg, "model", None), "loss_chunk_size", 0)
    return bool(chunk) and chunk > 0 and not getattr(getattr(cfg, "training", None), "use_liger_kernel", False)


def trained_rows(labels):
    """The flat indices of the trained positions of the shifted labels (labels[..., 1:], -100 at each row's end):
    the rows the chunked loss computes logits for, found here on the host."""
    import torch

    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return (shifted.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


class WithTrainedRows:
    """A collator's batches with TRAINED_ROWS added (trained_rows of their labels), for the chunked loss: their
    count is then a shape the host knows, and the loss makes no device sync. The loss' hook takes the key out
    before the model's forward sees it."""

    def __init__(self, collator):
        self.collator = collator

    def __getattr__(self, name: str):  # pad_token_id, layout, ... of the collator it wraps
        if "collator" not in self.__dict__:  # while unpickled (a DataLoader worker)
            raise AttributeError(name)
        return getattr(self.__dict__["collator"], name)

    def __call__(self, features) -> dict[str, Any]:
        batch = self.collator(features)
        batch[TRAINED_ROWS] = trained_rows(batch["labels"])
        return batch
