"""External kernels: a directory of kernel sources described by `kernels.json`.

    {"kernels": [{"name": "gemm_64x256x256", "op": "matmul", "dtype": "float32",
                  "shapes": [[64, 256], [256, 256]], "target": "llvm",
                  "format": "tvmscript", "source": "gemm_64x256x256.py"}]}

`source` (relative to the directory) holds, by `format`:
- "tvmscript": TVMScript as `PrimFunc.script()` prints it (no Python imports: `T` is
  TVMScript's `tirx`), one PrimFunc over the arrays of `OpSignature.kernel_operands` for
  exactly those shapes: for a matmul `(a[M, K], b[K, N], c[M, N])` (batch axes of the first
  operand fold into M), for a conv2d `(data[N, C, H, W], weight[O, C/groups, KH, KW],
  out[N, O, OH, OW])`, whose `"attrs"` (strides, pads, dilation, groups: `Conv2d.ATTRS`) the
  entry gives, for a layer norm `(x[rows, size], gamma[size], beta[size], out[rows, size])`
  (an RMS norm's without beta), whose `"attrs"` give its epsilon;
- "c" (CPU targets): C11 source defining `void FUNCTION(...)` taking a pointer to each of the
  same arrays, compact row-major, the output last (a matmul's `(const float *a, const float
  *b, float *c)`; an array of another dtype by its C type, e.g. a dequant_gemv's `const
  uint16_t *scales` (float16 bits), `const int8_t *quants`; a rows-generic op's kernel takes
  `int64_t rows` first: `OpSignature.kernel_buffers`), FUNCTION being the entry's `"function"`
  (default: its name). It is compiled with `$CC` (gcc) `C_FLAGS` for the target's CPU
  (`-march` = its `mcpu`; native when
  that is this machine's CPU or none) to an object file that the build links into the model
  (so exported models carry it); the function is renamed to a symbol unique to the source and
  every other global symbol of the source made local, so that kernels linked into one model
  never clash. The object may call libc's memory functions and libm only
  (`ALLOWED_CALLS`): one that calls anything else (fork, system, socket, ...) is refused
  with an `UnsafeKernelError`, as is TVMScript calling an external function outside that list.
  With `"tasks": T` (2 to `MAX_TASKS`) the function takes `int64_t task, int64_t tasks` before
  the arrays and computes its share of the output: the build calls it for each task in a
  parallel loop (TVM's thread pool, the model's threads), so a kernel uses the cores without
  starting threads of its own (`CSource`).
An optional `"epilogue"`, e.g. `[["add", [256]], ["relu", []]]`, makes it a kernel of that op
group (`OpSignature.epilogue`): it takes each addend after the operands, as
`OpSignature.kernel_operands` shapes it, and applies the steps in order. An entry is a
candidate only for its op, shapes, epilogue, attributes, dtype and target kind; only matmul,
conv2d, attention, the norms and dequant_gemv are taken for now (`OPS`), an entry of another
op is listed as unavailable. The source is parsed only when the candidate is built (in the
verification subprocess, or by a build after it was verified, when its digest must still
match).

Kernel generators' candidates (`gimlet_tvm.selection.generator`) are kept in a directory of
the same form (`add_kernel` writes it), listed as source "generator" instead of "external".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import tvm

from ...errors import GimletError, UnsafeKernelError
from ...files import atomic_path
from ...runtime.extensions import build_library
from ...targets import spec_for
from .candidates import MAX_TASKS, Candidate, CSource, OpSignature, call_prim_func

MANIFEST = "kernels.json"
FORMATS = ("tvmscript", "c")
OPS = ("matmul", "conv2d", "attention", "layer_norm", "rms_norm", "dequant_gemv")
"""The ops kernels from outside the compiler are taken for (`OpSignature.kernel_operands`)."""
C_COMPILER = os.environ.get("CC", "gcc")
C_FLAGS = ("-std=c11", "-O3", "-ffp-contract=fast", "-fPIC")
"""How C kernels are compiled: ISO C11, at -O3, multiplies and adds fused where the CPU has FMA
(strict ISO C mode would keep them apart, at half the arithmetic rate), position-independent."""
C_FUNCTION = "kernel"
"""The function a generated C kernel defines (`add_kernel`'s entries)."""
ALLOWED_CALLS = re.compile(
    r"(mem(cpy|set|move)|__stack_chk_fail|_GLOBAL_OFFSET_TABLE_|(sqrt|cbrt|exp|exp2|expm1|log|log2|log10|log1p|"
    r"erf|erfc|tanh|sinh|cosh|sin|cos|tan|asin|acos|atan|atan2|pow|fabs|fma|fmax|fmin|floor|ceil|round|"
    r"trunc|rint|nearbyint|copysign|ldexp|frexp|hypot|fmod)f?)")
"""The functions an external or generated kernel may call (undefined symbols of its object)."""
_EXTERN_CALL = re.compile(r'T\.call_(?:pure_)?extern\([^,]*,\s*"([^"]*)"|T\.call_c?packed\(\s*"([^"]*)"')
"""A TVMScript kernel's calls of outside functions (extern or packed): the name called."""
LINK_OBJECT = "gimlet.link_object"
"""PrimFunc attribute: the object file the function calls into (`link_objects` gathers them)."""


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
    called = [m.group(1) or m.group(2) for m in _EXTERN_CALL.finditer(parsed.script())]
    _refuse_calls(path, called)
    return parsed


def _refuse_calls(path: str, called: list[str]) -> None:
    """Raise `UnsafeKernelError` when the kernel at `path` calls a function outside `ALLOWED_CALLS`."""
    refused = sorted({name for name in called if not ALLOWED_CALLS.fullmatch(name)})
    if refused:
        raise UnsafeKernelError(f"{path} calls {', '.join(refused)}: a kernel may call libc's memory "
                                "functions and libm only")


def _c_prim_func(c: CSource, sig: OpSignature, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    """A PrimFunc over the group's buffers (`OpSignature.kernel_operands`) that calls the
    function of the C kernel `c`, compiled (cached) with the function renamed to a symbol of
    its own, once or (`c.tasks` > 1) once per task in a parallel loop; the object file is
    named in the `LINK_OBJECT` attribute."""
    symbol = f"gimlet_external_{digest(c.path)}_{c.function}"
    flags = [*C_FLAGS, "-c", _march(target), f"-D{c.function}={symbol}"]
    obj = _only_global(build_library(symbol, [Path(c.path)], flags, compiler=C_COMPILER, suffix=".o"), symbol)
    undefined = subprocess.run(["nm", "-u", "--format=just-symbols", str(obj)], capture_output=True, text=True,
                               check=True).stdout.split()
    _refuse_calls(c.path, undefined)
    scalars, buffers = sig.kernel_buffers()
    args = [*scalars, *(b.data for b in buffers)]
    if c.tasks == 1:
        body = tvm.tirx.Evaluate(tvm.tirx.call_extern("void", symbol, *args))
    else:
        task = tvm.tirx.Var("task", "int64")
        call = tvm.tirx.call_extern("void", symbol, task, tvm.tirx.IntImm("int64", c.tasks), *args)
        body = tvm.tirx.For(task, tvm.tirx.IntImm("int64", 0), tvm.tirx.IntImm("int64", c.tasks),
                            tvm.tirx.ForKind.PARALLEL, tvm.tirx.Evaluate(call))
    func = tvm.tirx.PrimFunc(buffers, body)
    return func.with_attrs({"tir.noalias": True, "tirx.is_scheduled": True, LINK_OBJECT: str(obj)})


def _march(target: tvm.target.Target) -> str:
    """gcc's `-march` for the target's CPU."""
    mcpu = str(target.attrs.get("mcpu", ""))
    # This machine's own CPU model is `native` to gcc too, also where gcc's release predates
    # LLVM's name for it (gcc 12 has no znver4).
    native = not mcpu or mcpu == str(tvm.target.codegen.llvm_get_system_cpu())
    return f"-march={'native' if native else mcpu}"


def shared_library(path: str, target: tvm.target.Target) -> Path:
    """The C source at `path` compiled (cached) as the build compiles it, into a shared library
    whose functions keep their names: what verification calls directly (`verify.out_of_bounds`)."""
    return build_library(f"gimlet_external_{digest(path)}", [Path(path)], [*C_FLAGS, "-shared", _march(target)],
                         compiler=C_COMPILER)


def _only_global(obj: Path, symbol: str) -> Path:
    """A copy of the object file `obj` in which `symbol` is the only global symbol (made once,
    renamed into place)."""
    local = obj.with_suffix(".local.o")
    if not local.exists():
        temporary = obj.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run(["objcopy", f"--keep-global-symbol={symbol}", str(obj), str(temporary)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"objcopy failed on {obj}: {result.stderr.strip()}")
        os.replace(temporary, local)
    return local


def link_objects(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with the object files its PrimFuncs call into (`LINK_OBJECT`, then dropped from
    them) among its `external_mods`, which the build links into the model."""
    calling = {g_var: func for g_var, func in mod.functions_items() if isinstance(func, tvm.tirx.PrimFunc)
               and func.attrs is not None and LINK_OBJECT in func.attrs}
    if not calling:
        return mod
    objects = sorted({str(func.attrs[LINK_OBJECT]) for func in calling.values()})
    linked = list(mod.attrs.get("external_mods", [])) if mod.attrs is not None else []
    mod = mod.with_attr("external_mods", linked + [tvm.runtime.load_static_library(o, []) for o in objects])
    for g_var, func in calling.items():
        mod[g_var] = func.without_attr(LINK_OBJECT)
    return mod


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def add_kernel(directory: str, sig: OpSignature, target_kind: str, fmt: str, text: str, name: str,
               tasks: int = 1, **provenance: Any) -> str:
    """Keep the kernel source `text` (of `format` fmt, for `sig` on targets of `target_kind`,
    split into `tasks` for C) in `directory` as an entry of its manifest (created if missing;
    written atomically), named `name` and the hash of its content and target kind, with
    `provenance` (e.g. generator, round) beside it; the same kernel added again for the same
    kind of target is the same entry. Returns the entry's name."""
    os.makedirs(directory, exist_ok=True)
    split = f"\ntasks={tasks}" if tasks != 1 else ""
    content = hashlib.sha256(f"{sig.key}\n{target_kind}\n{fmt}\n{text}{split}".encode()).hexdigest()[:12]
    entry_name = f"{re.sub(r'[^A-Za-z0-9_]', '_', name)[:40]}_{content}"
    manifest = os.path.join(directory, MANIFEST)
    entries = read_manifest(directory) if os.path.isfile(manifest) else []
    if any(e["name"] == entry_name for e in entries):
        return entry_name
    source = f"{entry_name}.{'c' if fmt == 'c' else 'py'}"
    with atomic_path(os.path.join(directory, source)) as tmp, open(tmp, "w") as f:
        f.write(text)
    entries.append({"name": entry_name, "op": sig.op, "dtype": sig.dtype, "shapes": [list(s) for s in sig.shapes],
                    "epilogue": [[kind, list(shape)] for kind, shape in sig.epilogue], "attrs": dict(sig.attrs),
                    "target": target_kind,
                    "format": fmt, "source": source, "function": C_FUNCTION,
                    **({"tasks": tasks} if tasks != 1 else {}), **provenance})
    with atomic_path(manifest) as tmp, open(tmp, "w") as f:
        json.dump({"kernels": entries}, f, indent=1)
    return entry_name


def external_candidates(directory: str, sig: OpSignature, target: tvm.target.Target,
                        source: str = "external") -> list[Candidate]:
    """The directory's candidates for `sig` on `target`, of candidate source `source`."""
    found = []
    for entry in read_manifest(directory):
        shapes = tuple(tuple(int(d) for d in s) for s in entry["shapes"])
        epilogue = tuple((kind, tuple(int(d) for d in shape)) for kind, shape in entry.get("epilogue", []))
        attrs = {name: float(value) for name, value in entry.get("attrs", {}).items()}
        if ((entry["op"], entry["dtype"], shapes, epilogue, attrs, entry["target"])
                != (sig.op, sig.dtype, sig.shapes, sig.epilogue, dict(sig.attrs), target.kind.name)):
            continue
        path = os.path.join(directory, entry["source"])
        function = entry.get("function", entry["name"])
        tasks = entry.get("tasks", 1)
        unavailable = None
        if entry["op"] not in OPS:
            unavailable = f"only kernels of {', '.join(OPS)} are taken from outside for now"
        elif entry["format"] not in FORMATS:
            unavailable = f"format '{entry['format']}' is not supported (only {', '.join(FORMATS)})"
        elif not os.path.isfile(path):
            unavailable = f"source not found: {path}"
        elif entry["format"] == "c" and not spec_for(target).runs_here():
            unavailable = "C source is taken for host CPU targets only"
        elif entry["format"] == "c" and not re.fullmatch(r"[A-Za-z_]\w*", function):
            unavailable = f"function '{function}' is not a C identifier"
        elif not (isinstance(tasks, int) and 1 <= tasks <= MAX_TASKS) or (tasks != 1 and entry["format"] != "c"):
            unavailable = f"tasks must be an integer from 1 to {MAX_TASKS}, above 1 for C kernels only, not {tasks!r}"
        c_source = CSource(path, function, tasks) if entry["format"] == "c" and unavailable is None else None

        def kernel(sig: OpSignature, c=c_source, path=path) -> tvm.tirx.PrimFunc:
            return _c_prim_func(c, sig, target) if c is not None else _load_prim_func(path)

        def rewrite(bb, call, name=entry["name"], kernel=kernel):
            return call_prim_func(bb, call, kernel(OpSignature.of_call(call, bb.get())), f"{source}_{name}")

        found.append(Candidate(source, entry["name"], path, rewrite, shape_generic=False,
                               digest=digest(path) if unavailable is None else "", kernel=kernel,
                               unavailable=unavailable,
                               c_source=c_source))
    return found
