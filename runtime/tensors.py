"""Values crossing the runtime's boundary: numpy arrays to device tensors and back."""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import numpy as np
import tvm
import tvm_ffi

from ..carriers import to_carrier
from ..errors import GimletError, InputError, summary
from ..files import atomic_path
from ..io_spec import IOSpec


def device_tensors(arrays: Sequence[np.ndarray], device: tvm.runtime.Device) -> list:
    """Checked input arrays as tensors on `device`, float8/int4/... as their carriers."""
    return [tvm.runtime.tensor(np.require(to_carrier(a), requirements="C"), device)
            for a in arrays]


def to_numpy(value: Any) -> np.ndarray:
    """An output as numpy: tensors copy to the host; shapes (ONNX `Shape`) become int64."""
    if isinstance(value, tvm_ffi.Shape):
        return np.array(list(value), dtype=np.int64)
    return value.numpy()


RANDOM_INPUT_LIMIT = 1 << 28
"""Most elements `random_inputs` draws for one input (1 GiB of float32)."""


def random_inputs(io: IOSpec, *, seed: int = 0, dims: Mapping[str, int] | None = None) -> list:
    """Random arrays for `io`'s inputs; symbolic dims take `dims[name]`, else 1. An input of more
    than `RANDOM_INPUT_LIMIT` elements is an `InputError` (give the inputs instead)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in io.inputs:
        shape = [d if isinstance(d, int) else (dims or {}).get(d, 1) for d in spec.shape]
        if math.prod(shape) > RANDOM_INPUT_LIMIT or min(shape, default=0) < 0:
            raise InputError(f"no random input for {spec.describe()}: {shape} is not a shape of at "
                             f"most {RANDOM_INPUT_LIMIT} elements; give the inputs")
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            arrays.append(rng.standard_normal(shape).astype(dtype))
        elif dtype.kind == "b":
            arrays.append(rng.integers(0, 2, shape).astype(dtype))
        else:
            arrays.append(rng.integers(0, 8, shape).astype(dtype))
    return arrays


def read_npz(path: str) -> dict[str, np.ndarray]:
    if not os.path.isfile(path):
        raise InputError(f"inputs file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except Exception as err:  # numpy and zipfile raise a dozen types on a damaged file
        raise InputError(f"cannot read inputs file {path} as .npz: {summary(err)}") from None


def write_npz(path: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Write arrays to `path` atomically (a temp file renamed into place)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise GimletError(f"output folder does not exist: {folder}")
    with atomic_path(path, suffix=".npz") as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
