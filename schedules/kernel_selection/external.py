"""External kernels: a directory of kernel sources described by `kernels.json`.

    {"kernels": [{"name": "gemm_64x256x256", "op": "matmul", "dtype": "float32",
                  "shapes": [[64, 256], [256, 256]], "target": "llvm",
                  "format": "tvmscript", "source": "gemm_64x256x256.py"}]}

`source` (relative to the directory) holds TVMScript as `PrimFunc.script()` prints it (no
Python imports: `T` is TVMScript's `tirx`), one PrimFunc `(a[M, K], b[K, N],
c[M, N])` for exactly those shapes (batch axes of the first operand fold into M). An optional
`"epilogue"`, e.g. `[["add", [256]], ["relu", []]]`, makes it a kernel of that op group
(`OpSignature.epilogue`): its PrimFunc takes each addend after b, as the (rows, columns)
`OpSignature.addends_2d` gives, and applies the steps in order. An entry is a candidate only
for its op, shapes, epilogue, dtype and target kind; only GEMMs (op "matmul") are taken for
now, an entry of another op is listed as unavailable. The source is parsed only
when the candidate is built (in the verification subprocess, or by a build after it was
verified, when its digest must still match).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import tvm

from ...errors import GimletError
from .candidates import Candidate, OpSignature, call_prim_func

MANIFEST = "kernels.json"
FORMATS = ("tvmscript",)


def read_manifest(directory: str) -> list[dict[str, Any]]:
    """The manifest's entries; raises GimletError naming the file when it is unusable."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            entries = json.load(f)["kernels"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise GimletError(f"cannot read external kernel manifest {path}: {err}") from None
    required = {"name", "op", "dtype", "shapes", "target", "format", "source"}
    for index, entry in enumerate(entries):
        missing = required - set(entry) if isinstance(entry, dict) else required
        if missing:
            raise GimletError(f"{path}: kernel {index} lacks {', '.join(sorted(missing))}")
    return entries


def _load_prim_func(path: str) -> tvm.tirx.PrimFunc:
    with open(path) as f:
        parsed = tvm.script.from_source(f.read())
    if isinstance(parsed, tvm.IRModule):
        funcs = [f for _, f in parsed.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
        if len(funcs) != 1:
            raise ValueError(f"{path}: expected one PrimFunc, found {len(funcs)}")
        parsed = funcs[0]
    return parsed


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def external_candidates(directory: str, sig: OpSignature, target: tvm.target.Target) -> list[Candidate]:
    """The directory's candidates for `sig` on `target`."""
    found = []
    for entry in read_manifest(directory):
        shapes = tuple(tuple(int(d) for d in s) for s in entry["shapes"])
        epilogue = tuple((kind, tuple(int(d) for d in shape)) for kind, shape in entry.get("epilogue", []))
        if ((entry["op"], entry["dtype"], shapes, epilogue, entry["target"])
                != (sig.op, sig.dtype, sig.shapes, sig.epilogue, target.kind.name)):
            continue
        path = os.path.join(directory, entry["source"])
        unavailable = None
        if entry["op"] != "matmul":
            unavailable = "only GEMM kernels (op matmul) are taken from outside for now"
        elif entry["format"] not in FORMATS:
            unavailable = f"format '{entry['format']}' is not supported (only {', '.join(FORMATS)})"
        elif not os.path.isfile(path):
            unavailable = f"source not found: {path}"

        def rewrite(bb, call, path=path, name=entry["name"]):
            return call_prim_func(bb, call, _load_prim_func(path), name)

        found.append(Candidate("external", entry["name"], path, rewrite, shape_generic=False,
                               digest=digest(path) if unavailable is None else "",
                               unavailable=unavailable))
    return found
