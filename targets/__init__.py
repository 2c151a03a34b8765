"""Targets: one `TargetSpec` per target, and the registry that finds them."""

from .llvm import LLVM_CPU
from .registry import ENTRY_POINT_GROUP, TargetLike, lookup, register, registered
from .spec import TargetSpec

register(LLVM_CPU)

__all__ = ["ENTRY_POINT_GROUP", "TargetLike", "TargetSpec", "lookup", "register", "registered"]
