"""Runs a C kernel once on operands placed against guard pages, so an out-of-bounds access
faults; or its tasks in three orders, to see whether its output depends on them.

    python -I guard_pages.py < job.json
    job: {"library": "k.so", "function": "kernel", "shapes": [[5, 24], [24, 40], [5, 40]],
          "placement": "end" | "start", "protect": [0, 1, 2], "seed": 0,
          "dtypes": ["float32", "float32", "float32"], "scalars": [], "tasks": 1}
    job: {"library": "k.so", "function": "kernel", "shapes": [...], "tasks": 4, "orders": true, ...}

The function takes the `scalars` first (int64_t; a rows-generic kernel's row count), then a
pointer to each operand (of its dtype in `dtypes`, float32 by default; compact row-major, the
output last); a kernel of `tasks` T > 1 takes `int64_t task, int64_t tasks` before all of
them and is called for each task (`CSource`), here in order. Each operand whose index is in
`protect` gets a mapping of its own: with placement "end" it ends exactly where a PROT_NONE
page begins (a read or write one element past its end faults), with "start" it begins right
after one (one element before its start faults); a protected input is made read-only once
filled (the kernel may not write it). The others are ordinary arrays. The function is called
through ctypes on the exact addresses (no DLPack, so no 64-byte alignment in the way): a
fault kills this process with SIGSEGV, which the verifier (`verify.out_of_bounds`) reads as an
out-of-bounds access.

With `"orders"`, its tasks run on ordinary arrays holding the same inputs concurrently (a
thread each: ctypes lets go of the GIL), in order and in reverse order; the script prints a
JSON object: how many elements of the output differ between those runs (NaN equal to NaN),
and where the first lies. Each output element written by one task alone makes them equal;
tasks that write one element with different values, or read what another writes, make the
output depend on the order (a race).

This script needs neither the package nor TVM, so it starts quickly; run it isolated (`-I`)
by its path.
"""
from __future__ import annotations

import ctypes
import json
import math
import mmap
import sys
import threading

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


def _call(function, arrays: list[np.ndarray], scalars: list[int], tasks: int, order: str = "forward") -> None:
    """Call the kernel on `scalars` and `arrays`: once, or each of its `tasks` in `order`
    ("forward", "reverse", or "concurrent": all at once, a thread each)."""
    args = [*(ctypes.c_int64(value) for value in scalars), *(ctypes.c_void_p(array.ctypes.data) for array in arrays)]
    if tasks == 1:
        function(*args)
        return
    calls = [lambda t=t: function(ctypes.c_int64(t), ctypes.c_int64(tasks), *args) for t in range(tasks)]
    if order == "concurrent":
        threads = [threading.Thread(target=call) for call in reversed(calls)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for call in calls if order == "forward" else reversed(calls):
            call()


def _inputs(arrays: list[np.ndarray], seed: int) -> None:
    """Random inputs (small integers for integer arrays), the output zeroed."""
    rng = np.random.default_rng(seed)
    for array in arrays[:-1]:
        array[...] = rng.standard_normal(array.shape) if array.dtype.kind == "f" else rng.integers(0, 8, array.shape)
    arrays[-1][...] = 0


def _orders(function, job: dict, dtypes: list[str]) -> dict:
    """The kernel's outputs with its tasks concurrent, in order and reversed, compared."""
    outputs = []
    for order in ("concurrent", "forward", "reverse"):
        arrays = [np.empty(shape, dtype) for shape, dtype in zip(job["shapes"], dtypes)]
        _inputs(arrays, job.get("seed", 0))
        _call(function, arrays, job.get("scalars", []), job["tasks"], order)
        outputs.append(arrays[-1])
    first = outputs[0]
    differ = np.zeros(first.shape, bool)
    for other in outputs[1:]:
        differ |= ~((first == other) | (np.isnan(first) & np.isnan(other)))
    where = np.argwhere(differ)
    return {"differ": int(differ.sum()), "size": int(differ.size),
            "first": [int(i) for i in where[0]] if len(where) else None}


def main() -> None:
    job = json.load(sys.stdin)
    shapes = job["shapes"]
    dtypes = job.get("dtypes") or ["float32"] * len(shapes)
    function = ctypes.CDLL(job["library"])[job["function"]]
    function.restype = None
    if job.get("orders"):
        print(json.dumps(_orders(function, job, dtypes)))
        return
    protect = set(job["protect"])
    guarded = {i: Guarded(shapes[i], job["placement"] == "end", dtype=dtypes[i]) for i in protect}
    arrays = [guarded[i].array if i in guarded else np.empty(shape, dtype)
              for i, (shape, dtype) in enumerate(zip(shapes, dtypes))]
    _inputs(arrays, job.get("seed", 0))
    for index in guarded:
        if index < len(arrays) - 1:
            guarded[index].read_only()
    _call(function, arrays, job.get("scalars", []), job.get("tasks", 1))


if __name__ == "__main__":
    main()
