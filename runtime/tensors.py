"""Values crossing the runtime's boundary: numpy arrays to device tensors and back."""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tvm
import tvm_ffi

from ..carriers import to_carrier
from ..errors import GimletError, InputError, summary
from ..files import atomic_path
from ..io_spec import IOSpec


TENSOR_ALIGNMENT = 64
"""Bytes TVM's kernels assume a tensor's data is aligned to (and `from_dlpack` checks)."""
HOST = tvm.cpu().dlpack_device_type()
NUMPY_DTYPES = frozenset(("bool", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
                          "uint8", "uint16", "uint32", "uint64"))
"""Dtypes numpy passes through DLPack; others (ml_dtypes' bfloat16, ...) go through TVM's copies."""
_NUMPY_DTYPES = frozenset(np.dtype(name) for name in NUMPY_DTYPES)
"""The same as dtypes (see carriers._CARRIED: a dtype's `.name` costs about 2 us)."""

# Through DLPack the host's tensors cost about 2 us each way; `tvm.runtime.tensor` (allocation
# and copy through the FFI) about 12 us, `.numpy()` about 5 us: on models that run in under a
# millisecond, a few percent of the call.


def device_tensors(arrays: Sequence[np.ndarray], device: tvm.runtime.Device,
                   unaligned: Sequence[bool] = ()) -> list:
    """Checked input arrays as tensors on `device`, float8/int4/... as their carriers. On the
    host an array that is C-contiguous, writeable and 64-byte aligned becomes a tensor over its
    own memory (a model never writes its inputs), any other one over an aligned copy; where
    `unaligned[i]` (its readers load unaligned: relax_passes/unaligned_inputs.py), array i
    needs no alignment."""
    tensors = []
    on_host = device.dlpack_device_type() == HOST
    for i, array in enumerate(arrays):
        array = to_carrier(array)
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        if on_host and array.size and array.dtype in _NUMPY_DTYPES:
            if i < len(unaligned) and unaligned[i] and array.flags.writeable:
                tensors.append(tvm_ffi.from_dlpack(array, require_alignment=0))
            else:
                tensors.append(tvm.runtime.from_dlpack(_aligned(array)))
        else:
            tensors.append(tvm.runtime.tensor(array, device))
    return tensors


def _aligned(array: np.ndarray) -> np.ndarray:
    """`array`, or a copy of it on a `TENSOR_ALIGNMENT` boundary where it is not on one."""
    if array.flags.writeable and array.ctypes.data % TENSOR_ALIGNMENT == 0:
        return array
    buffer = np.empty(array.nbytes + TENSOR_ALIGNMENT, np.uint8)
    start = -buffer.ctypes.data % TENSOR_ALIGNMENT
    copy = buffer[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def numpy_converter(value: Any, fresh: bool = False) -> Callable[[Any], np.ndarray]:
    """`to_numpy` for outputs of the kind `value` is (a host tensor numpy takes through
    DLPack, a shape, any other tensor), decided once: a model's output keeps its kind from call
    to call, and Python run after milliseconds of kernels runs from cold caches, where
    `to_numpy`'s checks took 10-20 us against 1 us in a loop."""
    if isinstance(value, tvm.runtime.Tensor) and value.device.dlpack_device_type() == HOST \
            and str(value.dtype) in NUMPY_DTYPES:
        return np.from_dlpack if fresh else lambda v: np.from_dlpack(v).copy()
    return lambda v: to_numpy(v, fresh)


def to_numpy(value: Any, fresh: bool = False) -> np.ndarray:
    """An output as a numpy array of its own: tensors copy to the host, except a host tensor
    the call allocated for it (`fresh`: relax_passes/fresh_outputs.py), which the array takes
    over; shapes (ONNX `Shape`) become int64."""
    if isinstance(value, tvm_ffi.Shape):
        return np.array(list(value), dtype=np.int64)
    if value.device.dlpack_device_type() == HOST and str(value.dtype) in NUMPY_DTYPES:
        array = np.from_dlpack(value)
        return array if fresh else array.copy()
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
