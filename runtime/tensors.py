"""Values crossing the runtime's boundary: numpy arrays to device tensors and back."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import tvm
import tvm_ffi

from ..carriers import from_carrier, to_carrier
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


def random_inputs(io: IOSpec, *, seed: int = 0, dims: Mapping[str, int] | None = None) -> list:
    """Random arrays for `io`'s inputs; symbolic dims take `dims[name]`, else 1."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in io.inputs:
        shape = [d if isinstance(d, int) else (dims or {}).get(d, 1) for d in spec.shape]
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            arrays.append(rng.standard_normal(shape).astype(dtype))
        elif dtype.kind == "b":
            arrays.append(rng.integers(0, 2, shape).astype(dtype))
        else:
            arrays.append(rng.integers(0, 8, shape).astype(dtype))
    return arrays
