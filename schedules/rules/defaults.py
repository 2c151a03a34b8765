"""Which default schedule rules a target's kernels get: chosen by the TVM target's keys
(`"cpu"`, `"gpu"`, as TVM's own strategies dispatch), less the rules its spec names as known
to fail it (`TargetSpec.schedule_rules_without`), after the ones its spec asks to try first
(`TargetSpec.schedule_rules_first`)."""

from __future__ import annotations

from typing import Callable, Sequence

import tvm

from ...targets import TargetSpec
from .cpu import RULES as CPU_RULES
from .gpu import gpu_rules


def cpu_rules(without: Sequence[str] = (), first: Sequence[str] = ()) -> list:
    """The CPU rules less `without`, those named in `first` moved to the front."""
    rules = [rule for rule in CPU_RULES if rule.__name__ not in without]
    rules.sort(key=lambda rule: rule.__name__ not in first)
    return [rule() for rule in rules]


RULE_SETS: dict[str, Callable[[Sequence[str], Sequence[str]], list]] = {"cpu": cpu_rules, "gpu": gpu_rules}


def default_rules(spec: TargetSpec, target: tvm.target.Target) -> list:
    """The rules of the first of `target`'s keys that has a rule set (none: no rules)."""
    key = next((key for key in target.keys if key in RULE_SETS), None)
    return RULE_SETS[key](spec.schedule_rules_without, spec.schedule_rules_first(target)) if key else []
