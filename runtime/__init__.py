"""Runtime: `CompiledModel`, the artifact format, and our runtime extensions."""

from .compiled_model import BenchmarkResult, CompiledModel, load, random_inputs

__all__ = ["BenchmarkResult", "CompiledModel", "load", "random_inputs"]
