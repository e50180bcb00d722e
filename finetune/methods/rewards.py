"""Reward functions for the methods that generate (GRPO, RLOO; docs/grpo.md), named by --reward_funcs.

A reward function takes the prompts, the completions (decoded text) and the records' columns as keyword lists
(TRL's interface: `completion_ids` and every column of the data set, one value per completion) and returns one
float per completion (None: not scored, left out of its group's baseline as TRL does):

    def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float]

--reward_funcs names built-ins (below), `regex:PATTERN` (1.0 where the completion matches PATTERN), or a function
of the user's own, `path/to/file.py:name`. Reading that file RUNS IT, as Python imports do: it is the user's own
code, with the user's rights; name only files you trust.

The built-ins compare against the column `reference` (the record's own answer: finetune.data.prompts).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


class RewardError(Exception):
    """A reward that cannot be loaded, raised, or gave the wrong number of values: one line naming it."""


def _json(text: str):
    try:
        return json.loads(text.strip())
    except (json.JSONDecodeError, ValueError):
        return None


def json_valid(prompts, completions, **columns) -> list[float]:
    """1.0 where the completion is one JSON value (surrounding whitespace aside), else 0.0."""
    out = []
    for c in completions:
        try:
            json.loads(c.strip())
            out.append(1.0)
        except (json.JSONDecodeError, ValueError):
            out.append(0.0)
    return out


def json_fields(prompts, completions, reference=None, **columns) -> list[float]:
    """The share of the reference JSON object's fields the completion's object has right (the quickstart's field
    accuracy); a reference that is not an object scores as exact_match of the parsed values."""
    _need("json_fields", reference)
    out = []
    for c, ref in zip(completions, reference):
        want, got = _json(ref) if isinstance(ref, str) else ref, _json(c)
        if isinstance(want, dict) and want:
            out.append(sum(got.get(k) == v for k, v in want.items()) / len(want) if isinstance(got, dict) else 0.0)
        else:
            out.append(float(got is not None and got == want))
    return out


def exact_match(prompts, completions, reference=None, **columns) -> list[float]:
    """1.0 where the completion is the reference, character for character after trimming whitespace (the scorer of
    --eval_generate)."""
    _need("exact_match", reference)
    return [float(c.strip() == str(r).strip()) for c, r in zip(completions, reference)]


def length_penalty(prompts, completions, completion_ids=None, max_completion_length=None, **columns) -> list[float]:
    """-(completion tokens / --max_completion_length): 0 for an empty completion, -1 for one cut at the limit."""
    return [-len(ids) / max(max_completion_length or 1, 1) for ids in completion_ids]


def _need(name: str, reference) -> None:
    if reference is None:
        raise RewardError(f"reward {name}: the data has no 'reference' column (the record's answer: the last "
                          "assistant turn, alpaca's output, or a 'reference' key)")


BUILTINS: dict[str, Callable] = {f.__name__: f for f in (json_valid, json_fields, exact_match, length_penalty)}


def regex(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompts, completions, **columns) -> list[float]:
        return [float(compiled.search(c) is not None) for c in completions]

    return reward


def user_function(spec: str) -> Callable:
    """`path/to/file.py:name`: the file is imported (its code runs) and its `name` returned."""
    path, _, name = spec.rpartition(":")
    p = Path(path)
    if not p.is_file():
        raise RewardError(f"reward_funcs: {spec}: no such file {path}")
    module_spec = importlib.util.spec_from_file_location(f"finetune_reward_{p.stem}", p)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise RewardError(f"reward_funcs: {spec}: importing {path} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"reward_funcs: {spec}: {path} has no function '{name}'")
    return fn


def is_user_spec(spec: str) -> bool:
    return ".py:" in spec


def load(spec: str) -> Callable:
    """The reward function `spec` names; RewardError naming it if it names none."""
    if spec.startswith("regex:"):
        try:
            return regex(spec[len("regex:"):])
        except re.error as e:
            raise RewardError(f"reward_funcs: {spec}: not a regular expression ({e})") from None
    if is_user_spec(spec):
        return user_function(spec)
    if spec in BUILTINS:
        return BUILTINS[spec]
    raise RewardError(f"reward_funcs: '{spec}' is not a built-in ({', '.join(BUILTINS)}), regex:PATTERN or "
                      "path/to/file.py:name")


def short_name(spec: str) -> str:
    """How a reward is named in the logs: its function name, `regex` for a pattern."""
    if spec.startswith("regex:"):
        return "regex"
    return spec.rpartition(":")[2] if is_user_spec(spec) else spec


# --nonfinite_rewards: what a reward's NaN or ±inf does (None is "not scored", as TRL; a NaN is not: trained on, it
# would zero the group's advantages and the run would go on learning nothing, reward 0, grad_norm 0).
NONFINITE = ("stop", "skip")


@dataclass
class Rewards:
    """The run's reward functions and weights (--reward_funcs, --reward_weights); `nonfinite`: --nonfinite_rewards
    (stop: RewardError naming the function and the record; skip: left out as not scored, and counted)."""

    specs: list[str]
    weights: list[float]
    funcs: list[Callable]
    nonfinite: str = "stop"
    skipped: list[int] | None = None  # skip: per function, the non-finite values of the last score()

    @classmethod
    def of(cls, specs: list[str], weights: list[float] | None, nonfinite: str = "stop") -> Rewards:
        funcs = [load(s) for s in specs]
        return cls(list(specs), list(weights) if weights else [1.0] * len(specs), funcs, nonfinite)

    @property
    def names(self) -> list[str]:
        names = [short_name(s) for s in self.specs]
        return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]

    def score(self, prompts: list[str], completions: list[str], columns: list[dict], *, where: list[str] | None = None,
              **extra) -> list[list[float]]:
        """[completion][function] rewards (NaN where a function returned None). RewardError, one line naming the
        function, when one raises, returns another number of values than completions, or a value that is not a
        number; and, unless --nonfinite_rewards skip, NaN or ±inf, naming the record too (`where`: each completion's
        record, file:line)."""
        n = len(completions)
        self.skipped = [0] * len(self.specs)
        keys = {k for row in columns for k in row}
        by_column = {k: [row.get(k) for row in columns] for k in keys}
        table = []
        for spec, fn in zip(self.specs, self.funcs):
            try:
                values = fn(prompts=prompts, completions=completions, **extra, **by_column)
            except RewardError:
                raise
            except Exception as e:
                raise RewardError(f"reward {spec} raised {type(e).__name__}: {e}") from None
            try:
                values = list(values)
            except TypeError:
                raise RewardError(f"reward {spec} returned {type(values).__name__}, not a list of floats") from None
            if len(values) != n:
                raise RewardError(f"reward {spec} returned {len(values)} values for {n} completions")
            row = []
            for i, v in enumerate(values):
                if v is None:
                    row.append(math.nan)
                elif isinstance(v, (int, float)) and not isinstance(v, bool) or hasattr(v, "__float__"):
                    row.append(self._finite(spec, float(v), i, n, where))
                else:
                    raise RewardError(f"reward {spec} returned a {type(v).__name__} ({v!r:.40}), not a number")
            table.append(row)
        return [list(r) for r in zip(*table)]

    def _finite(self, spec: str, value: float, i: int, n: int, where: list[str] | None) -> float:
        if math.isfinite(value):
            return value
        if self.nonfinite == "skip":
            self.skipped[self.specs.index(spec)] += 1
            return math.nan  # not scored: out of its group's baseline, advantage 0
        record = f" (record {where[i]})" if where else ""
        raise RewardError(f"reward {spec} returned {value} for completion {i + 1} of {n}{record}: not a finite "
                          "number; return None for a completion it cannot score, or pass --nonfinite_rewards skip to "
                          "leave such values out (counted in the logs: rewards/<name>/nonfinite)")
