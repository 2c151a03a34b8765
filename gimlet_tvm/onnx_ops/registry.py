"""The converter map the importer uses: TVM's, overridden and extended by ours, with folding."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Iterable

from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from .folding import Folding


def converters_of(modules: Iterable[ModuleType]) -> dict[str, type[OnnxOpConverter]]:
    """Every `OnnxOpConverter` subclass defined in `modules`, by its class (= ONNX op) name."""
    found: dict[str, type[OnnxOpConverter]] = {}
    for module in modules:
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, OnnxOpConverter)
                    and value.__module__ == module.__name__ and not name.startswith("_")):
                if name in found:
                    raise ImportError(f"ONNX op {name} has converters in both "
                                      f"{found[name].__module__} and {module.__name__}")
                found[name] = value
    return found


def domains_of(converters: dict[str, type[OnnxOpConverter]]) -> dict[str, str]:
    """The ONNX domain of each converter that declares one (`domain = "ai.onnx.ml"`); the
    others convert ops of the default domain."""
    return {op: cls.domain for op, cls in converters.items() if getattr(cls, "domain", None)}


@functools.lru_cache(maxsize=4)
def _merged(base_items: tuple, ours_items: tuple) -> dict[str, Any]:
    merged = dict(base_items)
    merged.update(ours_items)
    return {op: Folding(op, converter) for op, converter in merged.items()}


def convert_map(base: dict[str, Any], ours: dict[str, type[OnnxOpConverter]]) -> dict[str, Any]:
    """`base` (TVM's map) updated with `ours`, each entry folding all-constant nodes first."""
    return _merged(tuple(base.items()), tuple(ours.items()))
