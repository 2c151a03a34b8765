"""Runs a C kernel once on operands placed against guard pages, so an out-of-bounds access faults.

    python -I guard_pages.py < job.json
    job: {"library": "k.so", "function": "kernel", "shapes": [[5, 24], [24, 40], [5, 40]],
          "placement": "end" | "start", "protect": [0, 1, 2], "seed": 0,
          "dtypes": ["float32", "float32", "float32"], "scalars": []}

The function takes the `scalars` first (int64_t; a rows-generic kernel's row count), then a
pointer to each operand (of its dtype in `dtypes`, float32 by default; compact row-major, the
output last). Each operand whose index is
in `protect` gets a mapping of its own: with placement "end" it ends exactly where a PROT_NONE
page begins (a read or write one element past its end faults), with "start" it begins right
after one (one element before its start faults); a protected input is made read-only once
filled (the kernel may not write it). The others are ordinary arrays. The function is called
through ctypes on the exact addresses (no DLPack, so no 64-byte alignment in the way): a
fault kills this process with SIGSEGV, which the verifier (`verify.out_of_bounds`) reads as an
out-of-bounds access. This script needs neither the package nor TVM, so it starts quickly; run
it isolated (`-I`) by its path.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import sys

import numpy as np

PAGE = mmap.PAGESIZE
PROT_NONE = 0  # <sys/mman.h> (the mmap module names only PROT_READ, PROT_WRITE, PROT_EXEC)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _protect(address: int, size: int, prot: int) -> None:
    if _libc.mprotect(address, size, prot) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")


class Guarded:
    """An array of `shape` and `dtype` in a mapping of its own, against a PROT_NONE page after
    its end (`at_end`) or before its start, exactly by default. With `align`, its start is a
    multiple of that many bytes: at the end it then lies within align - element size bytes of
    the page (TVM takes DLPack data 64-byte aligned only)."""

    def __init__(self, shape: list[int] | tuple[int, ...], at_end: bool, align: int = 1,
                 dtype: str = "float32") -> None:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        self.pages = -(-nbytes // PAGE)
        self.map = mmap.mmap(-1, (self.pages + 1) * PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.usable = self.base if at_end else self.base + PAGE  # the pages the array lies in
        _protect(self.base + self.pages * PAGE if at_end else self.base, PAGE, PROT_NONE)
        offset = self.usable - self.base + ((self.pages * PAGE - nbytes) // align * align if at_end else 0)
        self.array = np.frombuffer(self.map, dtype, math.prod(shape), offset).reshape(shape)

    def read_only(self) -> None:
        _protect(self.usable, self.pages * PAGE, mmap.PROT_READ)


def main() -> None:
    job = json.load(sys.stdin)
    shapes, protect = job["shapes"], set(job["protect"])
    dtypes = job.get("dtypes") or ["float32"] * len(shapes)
    guarded = {i: Guarded(shapes[i], job["placement"] == "end", dtype=dtypes[i]) for i in protect}
    arrays = [guarded[i].array if i in guarded else np.empty(shape, dtype)
              for i, (shape, dtype) in enumerate(zip(shapes, dtypes))]
    rng = np.random.default_rng(job.get("seed", 0))
    for index, array in enumerate(arrays[:-1]):
        array[...] = rng.standard_normal(array.shape) if array.dtype.kind == "f" else rng.integers(0, 8, array.shape)
        if index in guarded:
            guarded[index].read_only()
    arrays[-1][...] = 0
    function = ctypes.CDLL(job["library"])[job["function"]]
    function.restype = None
    function(*(ctypes.c_int64(value) for value in job.get("scalars", [])),
             *(ctypes.c_void_p(array.ctypes.data) for array in arrays))


if __name__ == "__main__":
    main()
