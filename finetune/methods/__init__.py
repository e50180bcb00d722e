"""The training methods: one module each, behind finetune.methods.base's interface; this is their one registry.

A new method is a module here (its Method subclass and config) and one line in METHODS; the parser, the three
training paths, the planner and the report find it here (docs/layout.md, "a new training method").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.methods.base import Method, MethodConfig
from finetune.methods.cpo import CPO
from finetune.methods.dpo import DPO
from finetune.methods.grpo import GRPO
from finetune.methods.kto import KTO
from finetune.methods.orpo import ORPO
from finetune.methods.reward import Reward
from finetune.methods.rloo import RLOO
from finetune.methods.sft import SFT
from finetune.methods.simpo import SimPO

METHODS: dict[str, Method] = {m.name: m for m in (SFT(), DPO(), SimPO(), ORPO(), CPO(), KTO(), Reward(), GRPO(),
                                                  RLOO())}
DEFAULT = SFT.name  # an SFT run's recipe leaves the method keys out, as before --method existed


@dataclass
class ObjectiveConfig(MethodConfig):
    """What the run trains for: a method of finetune.methods (its own flags below)"""

    method: str = field(default=DEFAULT, metadata={
        "help": "; ".join(f"{m.name}: {m.summary}" for m in METHODS.values()) + "."})


def get(name: str) -> Method | None:
    return METHODS.get(name)


def names() -> list[str]:
    return list(METHODS)
