"""Runtime: `CompiledModel`, the artifact format, and our runtime extensions."""

from .compiled_model import CompiledModel, load
from .tensors import random_inputs
from .timing import BenchmarkResult

__all__ = ["BenchmarkResult", "CompiledModel", "load", "random_inputs"]
