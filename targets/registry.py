"""The target registry: name -> `TargetSpec`, open to other packages through entry points.

Every module of this package that defines `TARGET` (a `TargetSpec`) is registered when the
package loads (`targets/__init__.py`), so a target is added as one module. A package outside
adds one by exposing a `TargetSpec` (or a zero-argument callable returning one) under the
`gimlet_tvm.targets` entry-point group; it is registered on first lookup.
"""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any, Mapping, Union

import tvm

from ..errors import UnknownTargetError
from .spec import TargetSpec

TargetLike = Union[str, Mapping[str, Any]]
"""A registry name or alias (`"llvm"`), or a TVM target dict (`{"kind": "llvm", ...}`)."""

ENTRY_POINT_GROUP = "gimlet_tvm.targets"

_SPECS: dict[str, TargetSpec] = {}
_ALIASES: dict[str, str] = {}
_entry_points_loaded = False


def register(spec: TargetSpec, *, override: bool = False) -> TargetSpec:
    """Add `spec` under its name and aliases; a name already taken needs `override=True`."""
    names = (spec.name, *spec.aliases)
    taken = [name for name in names if name in _ALIASES]
    if taken and not override:
        raise ValueError(f"target name(s) {taken} already registered")
    _SPECS[spec.name] = spec
    for name in names:
        _ALIASES[name] = spec.name
    return spec


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        spec = entry.load()
        register(spec() if callable(spec) else spec)


def registered() -> list[TargetSpec]:
    """Every registered target, in registration order."""
    _load_entry_points()
    return list(_SPECS.values())


def lookup(target: TargetLike) -> tuple[TargetSpec, dict[str, Any]]:
    """The spec for `target` and the overrides it carries on top of the spec's defaults.

    A name gives no overrides; a TVM target dict is matched by its `kind` (and, among CPU specs
    of one kind, its `mtriple`'s architecture) and its keys become the overrides (so
    `{"kind": "cuda", "arch": "sm_80"}` changes only the arch).
    """
    _load_entry_points()
    if isinstance(target, str):
        name, overrides = target, {}
    elif isinstance(target, Mapping) and "kind" in target:
        name, overrides = str(target["kind"]), dict(target)
    else:
        raise UnknownTargetError(
            f"a target is a registered name or a TVM target dict with a 'kind', not {target!r}"
        )
    by_name = _ALIASES.get(name) if isinstance(target, str) else None
    canonical = by_name or _by_kind(name, overrides) or _ALIASES.get(name)
    if canonical is None:
        known = ", ".join(sorted(_ALIASES))
        raise UnknownTargetError(f"unknown target '{name}'; known targets: {known}")
    return _SPECS[canonical], overrides


def _by_kind(kind: str, config: Mapping[str, Any]) -> str | None:
    """The spec of TVM kind `kind` for a target dict: among CPU specs of one kind, the one for
    the dict's architecture (its `mtriple`, else this machine's)."""
    specs = [spec for spec in _SPECS.values() if spec.kind == kind]
    arch = str(config.get("mtriple") or platform.machine()).split("-")[0]
    return next((s.name for s in specs if s.arch == arch), specs[0].name if specs else None)


def spec_for(target: tvm.target.Target) -> TargetSpec:
    """The spec a TVM target belongs to (what the middle end asks instead of its kind name)."""
    return lookup(dict(target.export()))[0]


def host_spec() -> TargetSpec:
    """The spec of this machine's CPU: the host of a multi-device build."""
    return next(spec for spec in registered() if spec.runs_here())
