"""Which default schedule rules a target's kernels get: chosen by the TVM target's keys
(`"cpu"`, `"gpu"`, as TVM's own strategies dispatch), less the rules its spec names as known
to fail it (`TargetSpec.schedule_rules_without`)."""

from __future__ import annotations

from typing import Callable, Sequence

import tvm

from ...targets import TargetSpec
from .cpu import RULES as CPU_RULES
from .gpu import gpu_rules


def cpu_rules(without: Sequence[str] = ()) -> list:
    return [rule() for rule in CPU_RULES if rule.__name__ not in without]


RULE_SETS: dict[str, Callable[[Sequence[str]], list]] = {"cpu": cpu_rules, "gpu": gpu_rules}


def default_rules(spec: TargetSpec, target: tvm.target.Target) -> list:
    """The rules of the first of `target`'s keys that has a rule set (none: no rules)."""
    key = next((key for key in target.keys if key in RULE_SETS), None)
    return RULE_SETS[key](spec.schedule_rules_without) if key else []
