"""Targets: one `TargetSpec` per target, one module each, and the registry that finds them.

Every module here that defines `TARGET` is registered on import, in the order of `FIRST` and
then by name (the host CPU first: it is the default target).
"""

import importlib
import pkgutil

from .registry import ENTRY_POINT_GROUP, TargetLike, host_spec, lookup, register, registered, spec_for
from .spec import DeviceCode, TargetSpec

FIRST = ("llvm",)

for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: (m.name not in FIRST, m.name)):
    _target = getattr(importlib.import_module(f"{__name__}.{_module.name}"), "TARGET", None)
    if isinstance(_target, TargetSpec):
        register(_target)
del _module, _target

DEFAULT_TARGET = host_spec().name
"""What a build targets when none is named: this machine's CPU."""

__all__ = ["DEFAULT_TARGET", "DeviceCode", "ENTRY_POINT_GROUP", "TargetLike", "TargetSpec", "host_spec",
           "lookup", "register", "registered", "spec_for"]
