"""One command-line parser for every `finetune` command: dataclasses in, typed and validated values out.

A command declares dataclasses whose fields are its flags (the field's metadata "help" is its --help line) and
gets, in one pass: HfArgumentParser-style flags (`--key value`, `--key=value`, `--flag`, `--no_flag`,
`--list a b c`), an optional recipe YAML (`--recipe FILE`: defaults < recipe < command line), did-you-mean for
unknown keys, and a ConfigError listing every problem at once (file:line for recipe keys).

Field metadata the parser reads:
    help        the --help line
    required    True: the command cannot run without it (reported with the other problems)
    aliases     other flag names for the same field (e.g. --model for --model_name_or_path)
    old_aliases former names that still work: the first use in a process prints one line with the new name
    bare_aliases_ignored  True: an alias given without a value names nothing and is dropped (DeepSpeed's
                on/off `--deepspeed` switch next to `--deepspeed_config FILE`)
    same        callable(a, b) -> bool: when an alias and the field are both given, do the values agree?
    conflict    the message for values that do not agree
    repeat      True: one value per occurrence, occurrences accumulate (`--prompt A --prompt B`)
    positional  True: taken from a bare argument, in declaration order (fields with a default may be left out)
    cli         False: not a flag (set by the command itself)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from finetune import process
from finetune.errors import did_you_mean


_NOTED: set[tuple[str, str]] = set()  # (command, former name) already noted in this process


class ConfigError(Exception):
    """Every problem found in the configuration, reported together."""

    def __init__(self, problems: list[str] | str, prog: str = "finetune"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.prog = prog
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        lines = [f"{self.prog}: {len(self.problems)} configuration problem(s):"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Type conversion: one function for YAML values and command-line strings.


def _type_parts(tp: Any) -> tuple[list[Any], bool]:
    """Split a field type into its non-None members and whether None is allowed."""
    if isinstance(tp, str):
        raise TypeError(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = list(typing.get_args(tp))
        return [a for a in args if a is not type(None)], type(None) in args
    return [tp], False


_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}


def convert(value: Any, tp: Any) -> Any:
    """Convert a YAML value or a command-line string to `tp`; raises ValueError with a readable reason."""
    members, nullable = _type_parts(tp)
    if str in members and any(isinstance(m, type) and issubclass(m, enum.Enum) for m in members):
        # `SchedulerType | str` (lr_scheduler_type, optim, save_strategy, ...): the str only lets Python callers pass
        # the value; TrainingArguments accepts enum members only, so a typo is reported here with the other problems.
        members = [m for m in members if m is not str]
    # The string "none" means None only where a string is not itself valid (report_to takes "none").
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and nullable and str not in members):
        if nullable:
            return None
        raise ValueError("may not be empty")
    errors = []
    # Try the specific members first, str last: "3" for `int | str` must become 3.
    for member in sorted(members, key=lambda m: m is str):
        try:
            return _convert_one(value, member)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    raise ValueError("; ".join(dict.fromkeys(errors)))


def _number(value: Any, kind: type, expected: str):
    """int or float from a number or its string (never from a bool: `--lr true` is a mistake, not 1.0)."""
    if isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool):
        return kind(value)
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ValueError(f"expected {expected}, got {value!r}")


def _convert_one(value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ValueError(f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return _number(value, int, "an integer")
    if tp is float:
        return _number(value, float, "a number")
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        return str(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value).value
        except ValueError:
            choices = ", ".join(str(m.value) for m in tp)
            raise ValueError(f"{value!r} is not one of: {choices}") from None
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        items = value if isinstance(value, list) else _split_list(value)
        return [convert(v, inner) for v in items]
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return value
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"expected a JSON object, got {value!r}") from None
            if isinstance(parsed, dict):
                return parsed
        raise ValueError(f"expected a mapping, got {value!r}")
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ValueError(f"{value!r} is not one of {', '.join(map(str, typing.get_args(tp)))}"
                         f"{did_you_mean(str(value), [str(a) for a in typing.get_args(tp)])}")
    # Types we do not convert (e.g. accelerate's ParallelismConfig) are set from Python, not flags.
    raise TypeError(f"cannot be set from a recipe or the command line ({tp})")


def _split_list(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [value]


# ----------------------------------------------------------------------------------------------
# Reading the recipe.


@dataclass
class Setting:
    value: Any
    where: str  # "--key", "recipe.yaml:12", "default" or a positional's NAME


def read_recipe(path: str) -> tuple[dict[str, Setting], list[str]]:
    import yaml

    p = Path(path)
    if not p.is_file():
        return {}, [f"--recipe {path}: no such file"]
    try:
        root = yaml.compose(p.read_text())
    except yaml.YAMLError as e:
        return {}, [f"{path}: not valid YAML: {e}"]
    if root is None:
        return {}, []
    if not isinstance(root, yaml.MappingNode):
        return {}, [f"{path}: a recipe is a mapping of key: value, got {root.tag.rsplit(':', 1)[-1]}"]
    # Values are built node by node: a key YAML reads as a non-string (`1:`, `on:`) is reported, not a KeyError.
    loader = yaml.SafeLoader("")
    settings, problems = {}, []
    for key_node, value_node in root.value:
        where = f"{path}:{key_node.start_mark.line + 1}"
        if not isinstance(key_node, yaml.ScalarNode):
            problems.append(f"{where}: a recipe key must be a plain name")
            continue
        settings[key_node.value] = Setting(loader.construct_object(value_node, deep=True), where)
    loader.dispose()
    return settings, problems


# ----------------------------------------------------------------------------------------------
# A command's flags.


@dataclass
class Flag:
    name: str
    section: str
    type: Any
    field: dataclasses.Field

    @property
    def meta(self) -> typing.Mapping[str, Any]:
        return self.field.metadata

    @property
    def is_bool(self) -> bool:
        return self.type is bool or str(self.type) in ("bool | None", "str | bool")

    @property
    def is_list(self) -> bool:
        return "list" in str(self.type)

    @property
    def default(self) -> Any:
        f = self.field
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            return f.default_factory()  # type: ignore[misc]
        return dataclasses.MISSING

    @property
    def required(self) -> bool:
        return bool(self.meta.get("required")) or self.default is dataclasses.MISSING


def field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


class Parsed:
    """The parsed command line: one dataclass instance per section (as attributes), where each key came from
    (`sources`: "recipe" or "cli"), and the arguments after `--` (`rest`, for commands that pass them on)."""

    def __init__(self, sections: dict[str, Any], sources: dict[str, str], rest: list[str]):
        self.sections = sections
        self.sources = sources
        self.rest = rest

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["sections"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Collected:
    """collect()'s result: converted values by section (only keys that were set), before any dataclass is built."""

    values: dict[str, dict[str, Any]]
    sources: dict[str, str]
    where: dict[str, str]
    rest: list[str]
    problems: list[str]


class Command:
    """The flags of one command.

    sections: name -> dataclass; each field is a flag (a name in two sections belongs to the first).
    defaults: values that replace the dataclass defaults (applied under the recipe and the command line).
    reserved: key -> why it may not be set (the message says what to use instead).
    passthrough: everything after a bare `--` is returned untouched in Parsed.rest.
    """

    def __init__(self, prog: str, sections: dict[str, type], *, description: str = "", epilog: str = "",
                 recipe: bool = True, defaults: dict[str, Any] | None = None, reserved: dict[str, str] | None = None,
                 passthrough: bool = False):
        self.prog, self.description, self.epilog = prog, description, epilog
        self.sections = sections
        self.recipe = recipe
        self.defaults = dict(defaults or {})
        self.reserved = dict(reserved or {})
        self.passthrough = passthrough
        self.flags: dict[str, Flag] = {}
        for section, cls in sections.items():
            types_ = field_types(cls)
            for f in dataclasses.fields(cls):
                if f.name in types_ and f.name not in self.flags and f.metadata.get("cli", True):
                    self.flags[f.name] = Flag(f.name, section, types_[f.name], f)
        self.aliases: dict[str, str] = {}
        self.old_aliases: set[str] = set()
        for flag in list(self.flags.values()):
            for alias in (*flag.meta.get("aliases", ()), *flag.meta.get("old_aliases", ())):
                self.aliases[alias] = flag.name
                self.flags.pop(alias, None)  # an alias wins over a same-named field of a later section
            self.old_aliases.update(flag.meta.get("old_aliases", ()))
        self.positionals = [f for f in self.flags.values() if f.meta.get("positional")]
        self.builtin_recipe = recipe and "recipe" not in self.flags

    # -- reading ----------------------------------------------------------------------------------

    def _canonical(self, key: str) -> str:
        return self.aliases.get(key, key)

    def split(self, argv: list[str]) -> tuple[dict[str, Setting], list[str], list[str]]:
        """argv -> (settings by key, arguments after `--`, problems). Positionals get their field's name as key."""
        settings: dict[str, Setting] = {}
        problems: list[str] = []
        bare: list[str] = []
        rest: list[str] = []
        by_positional = bool(self.positionals)
        i = 0
        while i < len(argv):
            token = argv[i]
            if token == "--" and self.passthrough:
                rest = list(argv[i + 1:])
                break
            if not token.startswith("--") or token == "--":
                if by_positional and token != "--":
                    bare.append(token)
                else:
                    problems.append(f"unexpected argument {token!r}: options look like --key value")
                i += 1
                continue
            spelled, eq, inline = token[2:].partition("=")
            spelled = spelled.replace("-", "_")
            key = self._canonical(spelled)
            if spelled in self.old_aliases:
                self._note_old_spelling(spelled, key, f"--{spelled}")
            flag = self.flags.get(key)
            is_bool = flag is not None and flag.is_bool
            is_list = flag is not None and flag.is_list
            repeat = flag is not None and bool(flag.meta.get("repeat"))
            i += 1
            if eq:
                values = [inline]
            else:
                values = []
                while i < len(argv) and not (argv[i].startswith("--") and (len(argv[i]) > 2 or self.passthrough)):
                    if by_positional or repeat:
                        # With positionals, a flag takes one value (a list all of them), and a switch only a
                        # true/false word: `--overwrite FILE OUT` leaves FILE and OUT to the positionals.
                        if (is_bool and argv[i].lower() not in _TRUE | _FALSE) or (values and not is_list):
                            break
                        if repeat and values:
                            break
                    values.append(argv[i])
                    i += 1
            where = f"--{spelled}"
            if not values:
                no_key = self._canonical(spelled[3:]) if spelled.startswith("no_") else None
                if no_key and no_key in self.flags and self.flags[no_key].is_bool:
                    self._put(settings, no_key, Setting("false", where), problems)
                elif spelled != key and flag is not None and flag.meta.get("bare_aliases_ignored"):
                    pass  # DeepSpeed's `--deepspeed` switch: the file comes with --deepspeed_config
                else:
                    # A bare flag is `true` for booleans; for anything else the missing value is reported later.
                    self._put(settings, key, Setting("true" if is_bool else None, where), problems)
                continue
            if len(values) > 1 and not is_list:
                problems.append(f"--{spelled} takes one value, got {len(values)}: {' '.join(values)}")
            if repeat:
                previous = settings.get(key)
                collected = (previous.value if previous and isinstance(previous.value, list) else []) + values
                settings[key] = Setting(collected, where)
                continue
            # `--key=a,b` is one string that convert() splits; `--key a b` is already a list.
            self._put(settings, key, Setting(values if is_list and not eq else values[0], where), problems)
        if by_positional:
            self._assign_positionals(bare, settings, problems)
        return settings, rest, problems

    def _note_old_spelling(self, spelled: str, key: str, where: str) -> None:
        """One line the first time a process reads a former name: the run goes on, the user learns the new name."""
        if (self.prog, spelled) in _NOTED or int(os.environ.get("RANK", "0")) != 0:
            return
        _NOTED.add((self.prog, spelled))
        old, new = (f"--{spelled}", f"--{key}") if where.startswith("--") else (f"{where}: {spelled}", key)
        print(f"{self.prog}: {old} is now {new} (the old spelling still works)", file=sys.stderr, flush=True)

    def _put(self, settings: dict[str, Setting], key: str, setting: Setting, problems: list[str]) -> None:
        """Set a key; the same key under two spellings (a field and its alias) must agree."""
        old = settings.get(key)
        flag = self.flags.get(key)
        if old is not None and flag is not None and old.where != setting.where:
            same = flag.meta.get("same") or (lambda a, b: a == b)
            if old.value is not None and setting.value is not None and not same(old.value, setting.value):
                message = flag.meta.get("conflict", f"both set '{key}'")
                problems.append(f"{old.where} {old.value} and {setting.where} {setting.value}: {message}; give one")
        settings[key] = setting

    def _assign_positionals(self, bare: list[str], settings: dict[str, Setting], problems: list[str]) -> None:
        wanted = [f for f in self.positionals if f.name not in settings]
        # Fewer arguments than positionals: the optional ones (with a default) are the ones left out, first first.
        optional = [f for f in wanted if not f.required]
        while len(wanted) > len(bare) and optional:
            wanted.remove(optional.pop(0))
        for flag, value in zip(wanted, bare):
            settings[flag.name] = Setting(value, flag.name.upper())
        for value in bare[len(wanted):]:
            problems.append(f"unexpected argument {value!r} (usage: {self.usage()})")

    def collect(self, argv: list[str]) -> Collected:
        """Command line and recipe -> converted values by section; every problem found so far, none raised."""
        cli, rest, problems = self.split(list(argv))
        recipe: dict[str, Setting] = {}
        if self.recipe and "recipe" in cli and cli["recipe"].value:
            recipe, recipe_problems = read_recipe(str(cli["recipe"].value))
            problems += recipe_problems
            if "recipe" in recipe:
                nested = recipe.pop("recipe")
                problems.append(f"{nested.where}: recipe: {nested.value}: a recipe cannot name another recipe (it "
                                "would be ignored); copy the keys you want from it into this one")
        if self.builtin_recipe:
            cli.pop("recipe", None)
        merged: dict[str, Setting] = {k: Setting(v, "default") for k, v in self.defaults.items()}
        sources: dict[str, str] = {}
        valid = sorted(self.flags) + (["recipe"] if self.builtin_recipe else [])
        for origin, settings in (("recipe", recipe), ("cli", cli)):
            for spelled, setting in settings.items():
                key = self._canonical(spelled)
                if spelled in self.old_aliases:  # a recipe's key (the command line's are noted by split)
                    self._note_old_spelling(spelled, key, setting.where)
                if key not in self.flags:
                    problems.append(f"{setting.where}: unknown key '{spelled}'{did_you_mean(spelled, valid)}")
                    continue
                if key in self.reserved:
                    problems.append(f"{setting.where}: '{key}' is set by finetune; {self.reserved[key]}")
                    continue
                merged[key] = setting
                sources[key] = origin
        values: dict[str, dict[str, Any]] = {name: {} for name in self.sections}
        where: dict[str, str] = {}
        for key, setting in merged.items():
            flag = self.flags[key]
            where[key] = setting.where
            try:
                if setting.value is None and (setting.where.startswith("--") or flag.required):
                    raise ValueError("needs a value")
                values[flag.section][key] = convert(setting.value, flag.type)
            except (ValueError, TypeError) as e:
                # A recipe line names its key; a flag names itself.
                named = setting.where if setting.where.startswith("--") else f"{setting.where}: {key}"
                problems.append(f"{named}: {e}")
        for flag in self.flags.values():
            if flag.required and flag.name not in merged:
                name = flag.name.upper() if flag.meta.get("positional") else f"--{flag.name}"
                hint = flag.meta.get("help", "")
                problems.append(f"{name}: required" + (f" ({hint.rstrip('.')})" if hint else ""))
        return Collected(values, sources, where, rest, problems)

    def parse(self, argv: list[str], validate: Callable[[Parsed], list[str]] | None = None) -> Parsed:
        """Parse, build each section's dataclass and run `validate`; raises ConfigError listing every problem."""
        got = self.collect(argv)
        problems = got.problems
        sections = {}
        for name, cls in self.sections.items():
            kwargs = dict(got.values[name])
            for f in dataclasses.fields(cls):
                flag = self.flags.get(f.name)
                if f.init and f.name not in kwargs and flag is not None and flag.section == name and flag.required \
                        and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                    kwargs[f.name] = None  # reported above; the other checks still run
            try:
                sections[name] = cls(**kwargs)
            except (ValueError, TypeError) as e:
                problems.append(f"{name}: {e}")
        parsed = Parsed(sections, got.sources, got.rest)
        if validate is not None and len(sections) == len(self.sections):
            problems += validate(parsed)
        if problems:
            raise ConfigError(problems, prog=self.prog)
        return parsed

    # -- help -------------------------------------------------------------------------------------

    def usage(self) -> str:
        names = []
        for f in self.positionals:
            names.append(f.name.upper() if f.required else f"[{f.name.upper()}]")
        tail = " [-- ARGS]" if self.passthrough else ""
        return " ".join([self.prog, *names, "[--flag value ...]"]) + tail

    def help(self) -> str:
        width = 100
        lines = [f"usage: {self.usage()}"]
        if self.description:
            text = self.description.strip()
            lines += ["", textwrap.fill(text, width) if "\n" not in text else text]
        if self.positionals:
            lines += ["", "arguments:"]
            for f in self.positionals:
                lines += _help_entry(f.name.upper(), f.meta.get("help", ""), width)
        reverse, former = {}, {}
        for alias, key in self.aliases.items():
            (former if alias in self.old_aliases else reverse).setdefault(key, []).append(alias)
        for name, cls in self.sections.items():
            entries = [f for f in self.flags.values() if f.section == name and not f.meta.get("positional")]
            if not entries:
                continue
            doc = (cls.__doc__ or "").strip()
            title = doc.splitlines()[0].rstrip(".") if doc and not doc.startswith(cls.__name__ + "(") else ""
            lines += ["", f"{cls.__name__} flags" + (f": {title}" if title else "") + ":"]
            for f in entries:
                names = ", ".join(f"--{n}" for n in [f.name, *reverse.get(f.name, [])])
                kind = "" if f.is_bool else " " + _type_name(f.type)
                help_ = " ".join(str(f.meta.get("help", "")).split())
                default = f.default
                if f.required:
                    help_ += " (required)"
                elif f.is_bool and default is True:
                    help_ += f" (default: true; --no_{f.name} turns it off)"
                elif not f.is_bool and default is not dataclasses.MISSING and default is not None and default not in ("", []):
                    help_ += f" (default: {_plain(default)})"
                if f.meta.get("repeat"):
                    help_ += " (repeatable)"
                if former.get(f.name):
                    help_ += f" (formerly {', '.join('--' + n for n in former[f.name])})"
                lines += _help_entry(names + kind, help_, width)
        if self.builtin_recipe:
            lines += ["", "recipe:"]
            lines += _help_entry("--recipe FILE", "YAML file with any of these keys; the command line wins.", width)
        if self.epilog:
            lines += ["", self.epilog.rstrip()]
        return "\n".join(lines)

    # -- entry point ------------------------------------------------------------------------------

    def parse_or_exit(self, argv: list[str] | None = None, validate: Callable[[Parsed], list[str]] | None = None) -> Parsed:
        """parse() for a `main`: -h/--help prints the flags and exits 0; problems exit 2 (printed by rank 0)."""
        argv = list(sys.argv[1:] if argv is None else argv)
        if wants_help(argv, self.passthrough):
            print(self.help())
            raise SystemExit(0)
        try:
            return self.parse(argv, validate)
        except ConfigError as e:
            exit_with_problems(e)
            raise  # unreachable: exit_with_problems exits


def wants_help(argv: list[str], passthrough: bool = False) -> bool:
    if passthrough and "--" in argv:
        argv = argv[: argv.index("--")]
    return "-h" in argv or "--help" in argv


def exit_with_problems(error: ConfigError) -> typing.NoReturn:
    # Every rank finds the same problems (no rank waits on a collective), so all exit and rank 0 prints. The other
    # ranks give rank 0 time to print first (the checks before the heavy imports take 0.2 s, so ranks are seconds
    # apart here); a problem only this rank sees is then printed by it.
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        process.give_the_reporting_rank_time()
        print(f"rank {rank}: {error}", file=sys.stderr, flush=True)
    elif rank == 0:
        print(str(error), file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def _help_entry(names: str, help_: str, width: int) -> list[str]:
    head = f"  {names}"
    if len(head) <= 30 and help_:
        body = textwrap.wrap(help_, width - 32)
        return [f"{head:<32}{body[0]}"] + [" " * 32 + line for line in body[1:]]
    return [head] + [" " * 8 + line for line in textwrap.wrap(help_, width - 8)]


def _type_name(tp: Any) -> str:
    members, _ = _type_parts(tp) if not isinstance(tp, str) else ([tp], False)
    if str in members and any(isinstance(m, type) and issubclass(m, enum.Enum) for m in members):
        members = [m for m in members if m is not str]  # as convert() reads it
    names = []
    for m in members:
        if typing.get_origin(m) is list:
            names.append("VALUE [VALUE ...]")
        elif typing.get_origin(m) is typing.Literal:
            names.append("{" + ",".join(map(str, typing.get_args(m))) + "}")
        elif isinstance(m, type) and issubclass(m, enum.Enum):
            choices = [str(v.value) for v in m]
            names.append("{" + ",".join(choices[:6]) + (",..." if len(choices) > 6 else "") + "}")
        elif m in (int, float, str, bool):
            names.append(m.__name__.upper())
        else:
            names.append("VALUE")
    return "|".join(dict.fromkeys(names))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


__all__ = ["Command", "ConfigError", "Parsed", "Setting", "convert", "did_you_mean", "exit_with_problems",
           "read_recipe", "wants_help"]
