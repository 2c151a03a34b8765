"""`TargetSpec`: everything the compiler needs to know about one target, in one place.

The middle end never asks "is this CUDA?": it asks the spec for its TVM target, its device,
its library-dispatch passes and its default schedule rules.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import tvm


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """A registered compilation target.

    name: the registry name users type (`"llvm"`).
    aliases: other accepted names (`"cpu"`).
    kind: the TVM target kind this spec builds for.
    description: one line for `gimlet-tvm targets`.
    default_target: returns the TVM target dict for this machine (host detection lives here).
    device_type: the DLPack device type name for `tvm.device` (`"cpu"`, `"cuda"`).
    library_passes: Relax passes run before legalization that hand ops to libraries.
    schedule_rules: DLight-style schedule rules applied to every PrimFunc after fusion.
    facts: device facts shown to users and read by passes (vector width, cores, ...).
    can_compile / can_run: whether this machine can generate code for / execute on the target.
    """

    name: str
    kind: str
    description: str
    default_target: Callable[[], dict[str, Any]]
    device_type: str
    aliases: tuple[str, ...] = ()
    library_passes: Callable[[tvm.target.Target], Sequence[tvm.transform.Pass]] = lambda t: ()
    schedule_rules: Callable[[tvm.target.Target], Sequence[Any]] = lambda t: ()
    facts: Callable[[], Mapping[str, Any]] = dict
    can_compile: Callable[[], bool] = lambda: True
    can_run: Callable[[], bool] = lambda: False

    def make_target(self, overrides: Mapping[str, Any] | None = None) -> tvm.target.Target:
        """The TVM target: this machine's defaults with `overrides` on top."""
        config = dict(self.default_target())
        config.update(overrides or {})
        return tvm.target.Target(config)

    def device(self, index: int = 0) -> tvm.runtime.Device:
        """The runtime device executables built for this target run on."""
        return tvm.device(self.device_type, index)
