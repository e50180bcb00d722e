"""TrainingArguments' flags without importing transformers (which imports torch and peft: about 6 s).

The training commands parse TrainingArguments' fields with their own; to report a flag or recipe mistake before
anything heavy is imported, the parser reads them from a snapshot (finetune/config/_training_arguments.py) of the
installed transformers and accelerate: field names, types, defaults, help and the choices of their enums. The
snapshot is used only while the installed versions are the ones it was written from; otherwise the real class is
imported, as before. tests/test_fast_errors.py holds the snapshot to the real class. After an upgrade:

    python -m finetune.config.hf_fields      # rewrites finetune/config/_training_arguments.py
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import types
import typing
from importlib import metadata
from pathlib import Path
from typing import Any

SNAPSHOT_FILE = Path(__file__).with_name("_training_arguments.py")
PACKAGES = ("transformers", "accelerate")
# The field metadata finetune.config.parser reads; TrainingArguments' others (choices, nargs) are HfArgumentParser's.
PARSER_KEYS = ("help", "required", "aliases", "bare_aliases_ignored", "same", "conflict", "repeat", "positional", "cli")


def training_arguments() -> type:
    """transformers.TrainingArguments' fields for the parser: a stand-in built from the snapshot while it matches the
    installed versions, else the real class. Only for reading flags: TrainingArguments itself is built later."""
    stand_in = _stand_in()
    if stand_in is not None:
        return stand_in
    from transformers import TrainingArguments

    return TrainingArguments


def installed_versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


@functools.lru_cache(maxsize=None)
def _stand_in() -> type | None:
    try:
        from finetune.config._training_arguments import SNAPSHOT
    except ImportError:
        return None
    if SNAPSHOT["versions"] != installed_versions():
        return None
    return build(SNAPSHOT)


# ----------------------------------------------------------------------------------------------
# Describing a dataclass as plain data, and building a dataclass back from that description.


def describe(cls: type) -> dict[str, Any]:
    """cls's flags as plain data: what finetune.config.parser reads of them (and what their types print as)."""
    from finetune.config.parser import field_types

    hints = field_types(cls)
    classes: dict[str, dict[str, Any]] = {}
    fields = []
    for f in dataclasses.fields(cls):
        if f.name not in hints:
            continue
        if f.default is not dataclasses.MISSING:
            default = ("value", f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = ("factory", f.default_factory())  # type: ignore[misc]
        else:
            default = ("missing", None)
        meta = {k: f.metadata[k] for k in PARSER_KEYS if k in f.metadata}
        fields.append({"name": f.name, "type": _spell(hints[f.name], classes), "printed": str(hints[f.name]),
                       "default": default, "metadata": meta})
    # Of the docstring, --help shows the first line only.
    doc = (cls.__doc__ or "").strip().splitlines()[:1]
    return {"versions": installed_versions(), "name": cls.__name__, "module": cls.__module__,
            "doc": doc[0] if doc else None, "classes": classes, "fields": fields}


def _spell(tp: Any, classes: dict[str, dict[str, Any]]) -> str:
    """tp as an expression that build() evaluates back to a type that prints and converts the same."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    if origin is types.UnionType:
        return " | ".join(_spell(a, classes) for a in args)
    if origin is typing.Union:
        return f"Union[{', '.join(_spell(a, classes) for a in args)}]"
    if origin is typing.Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_spell(a, classes) for a in args)}]"
    if tp in (bool, int, float, str, list, dict):
        return tp.__name__
    if not isinstance(tp, type):
        raise TypeError(f"cannot snapshot the type {tp!r}")
    if tp.__name__ in classes and classes[tp.__name__]["module"] != tp.__module__:
        raise TypeError(f"two classes named {tp.__name__}")
    entry: dict[str, Any] = {"module": tp.__module__, "qualname": tp.__qualname__}
    if issubclass(tp, enum.Enum):
        entry["members"] = [(m.name, m.value) for m in tp]
        entry["str"] = issubclass(tp, str)
    classes[tp.__name__] = entry
    return tp.__name__


def build(snapshot: dict[str, Any]) -> type:
    """A dataclass with the snapshot's fields, name, module and docstring (its enums and classes are look-alikes)."""
    namespace: dict[str, Any] = {"Any": Any, "Literal": typing.Literal, "Union": typing.Union}
    for name, entry in snapshot["classes"].items():
        if "members" in entry:
            cls = enum.Enum(name, entry["members"], module=entry["module"], qualname=entry["qualname"],
                            type=str if entry["str"] else None)
        else:
            cls = type(name, (), {"__module__": entry["module"], "__qualname__": entry["qualname"]})
        namespace[name] = cls
    specs = []
    for f in snapshot["fields"]:
        kind, value = f["default"]
        if kind == "value":
            made = dataclasses.field(default=value, metadata=f["metadata"])
        elif kind == "factory":
            made = dataclasses.field(default_factory=functools.partial(copy.deepcopy, value), metadata=f["metadata"])
        else:
            made = dataclasses.field(metadata=f["metadata"])
        specs.append((f["name"], eval(f["type"], namespace), made))  # noqa: S307 (our own snapshot's type names)
    cls = dataclasses.make_dataclass(snapshot["name"], specs, namespace={"__doc__": snapshot["doc"]})
    cls.__module__ = snapshot["module"]
    return cls


def write(path: Path = SNAPSHOT_FILE) -> None:
    """Write the snapshot of the installed transformers' TrainingArguments."""
    import pprint

    from transformers import TrainingArguments

    snapshot = describe(TrainingArguments)
    if describe(build(snapshot)) != snapshot:
        raise SystemExit("the snapshot does not rebuild TrainingArguments' flags exactly; see finetune/config/hf_fields.py")
    path.write_text('"""Generated by `python -m finetune.config.hf_fields` from the installed transformers: '
                    'TrainingArguments\' flags (finetune/config/hf_fields.py says why)."""\n\n'
                    f"SNAPSHOT = {pprint.pformat(snapshot, width=120, sort_dicts=False)}\n")


if __name__ == "__main__":
    write()
    print(f"wrote {SNAPSHOT_FILE}")
