"""The model's interface: input/output names, shapes (with symbolic dims) and dtypes.

Built once by the frontend, stored in the artifact, and used to check inputs at run time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence, Union

import numpy as np

from .errors import InputError

Dim = Union[int, str]
"""A dimension: a fixed size, or the name of a symbolic dimension (`"batch"`)."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One named tensor of the model's interface."""

    name: str
    shape: tuple[Dim, ...]
    dtype: str

    def describe(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "TensorSpec":
        """The spec `to_json` wrote; ValueError (or KeyError, TypeError) on anything else."""
        name, shape, dtype = data["name"], data["shape"], data["dtype"]
        dims_ok = isinstance(shape, list) and all(
            isinstance(d, str) or (isinstance(d, int) and d >= 0) for d in shape)
        if not isinstance(name, str) or not dims_ok or not isinstance(dtype, str):
            raise ValueError(f"not a tensor spec: {str(data)[:200]}")
        np.dtype(dtype)  # a name numpy (with ml_dtypes) does not know: TypeError
        return cls(name, tuple(shape), dtype)


@dataclasses.dataclass(frozen=True)
class IOSpec:
    """The inputs and outputs of a compiled model, in call order."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @functools.cached_property
    def _input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @functools.cached_property
    def _fixed_inputs(self) -> tuple[tuple[np.dtype, tuple[int, ...]], ...] | None:
        """Each input's dtype and shape where no input has a symbolic dim, else None: arrays
        that match these pass `check_inputs` at once (a dtype's name costs about 2 us)."""
        if any(isinstance(d, str) for t in self.inputs for d in t.shape):
            return None
        return tuple((np.dtype(t.dtype), t.shape) for t in self.inputs)

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "IOSpec":
        return cls(
            tuple(TensorSpec.from_json(t) for t in data["inputs"]),
            tuple(TensorSpec.from_json(t) for t in data["outputs"]),
        )

    def order_inputs(
        self, args: Sequence[Any], named: Mapping[str, Any] | None = None
    ) -> list[np.ndarray]:
        """Inputs as arrays in call order, from positional `args` or a `named` mapping.

        Raises `InputError` naming the input and what was expected on any mismatch.
        """
        names = list(self._input_names)
        if named is not None:
            if args:
                raise InputError("pass inputs either positionally or by name, not both")
            if len(named) != len(names) or not all(n in named for n in names):
                unknown = sorted(set(named) - set(names))
                if unknown:
                    raise InputError(f"unknown input(s) {unknown}; the model's inputs are {names}")
                missing = [n for n in names if n not in named]
                raise InputError(f"missing input(s) {missing}; the model's inputs are {names}")
            args = [named[n] for n in names]
        if len(args) != len(names):
            raise InputError(f"expected {len(names)} input(s) {names}, got {len(args)}")
        arrays = [_as_array(name, a) for name, a in zip(names, args)]
        self.check_inputs(arrays)
        return arrays

    def check_inputs(self, arrays: Sequence[np.ndarray]) -> None:
        """Check dtypes and shapes; a symbolic dim must take one value across all inputs."""
        fixed = self._fixed_inputs
        if fixed is not None and len(arrays) == len(fixed) and all(
                a.dtype == dtype and a.shape == shape for a, (dtype, shape) in zip(arrays, fixed)):
            return
        bound: dict[str, tuple[int, str]] = {}
        for spec, array in zip(self.inputs, arrays):
            if str(array.dtype) != spec.dtype:
                raise InputError(
                    f"input '{spec.name}' has dtype {array.dtype}, expected {spec.dtype}"
                )
            if array.ndim != len(spec.shape):
                raise InputError(
                    f"input '{spec.name}' has shape {list(array.shape)} (rank {array.ndim}), "
                    f"expected rank {len(spec.shape)}: {spec.describe()}"
                )
            for axis, (dim, size) in enumerate(zip(spec.shape, array.shape)):
                if isinstance(dim, int):
                    if dim != size:
                        raise InputError(
                            f"input '{spec.name}' has shape {list(array.shape)}, expected "
                            f"{dim} at axis {axis}: {spec.describe()}"
                        )
                elif dim in bound and bound[dim][0] != size:
                    value, owner = bound[dim]
                    raise InputError(
                        f"input '{spec.name}' has {dim}={size} at axis {axis}, but input "
                        f"'{owner}' set {dim}={value}"
                    )
                else:
                    bound.setdefault(dim, (size, spec.name))


def _as_array(name: str, value: Any) -> np.ndarray:
    """`value` as an array; one numpy cannot make (a ragged list) is an `InputError`."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as err:
        raise InputError(f"input '{name}' is not an array: {err}") from None
