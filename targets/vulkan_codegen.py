"""TIR device kernels -> GLSL 450 compute shaders -> SPIR-V (glslangValidator).

`target.build.vulkan` receives the IRModule of lowered device kernels (flat buffers,
`thread_extent` attributes for blockIdx/threadIdx, `AllocBuffer` for shared/local arrays,
`tirx.kernel_launch_params` for the launch argument order). Each kernel becomes one compute
shader with the calling convention of `runtime/ext/vulkan/vulkan_module.cc`:

- buffer arguments: std430 storage buffers, binding i of set 0, in argument order;
- scalar arguments: push constants, one 8-byte slot each;
- then the logical grid (x, y, total: 3 x uint32) as push constants; blockIdx comes from the
  linear workgroup index (the runtime folds big grids to fit maxComputeWorkGroupCount);
  threadIdx is gl_LocalInvocationID, its extents the compile-time workgroup size;
- shared arrays: `shared` arrays; `tvm_storage_sync` : workgroup barriers; local arrays:
  module-scope arrays (private to each invocation), so helper functions can read them too;
- vectors (float32x4, int64x2...: TVM's vectorized loads, KV-cache kernels' float32x4 locals):
  GLSL vec2..vec4 of the element type. An index vector (a Ramp) reads one element per lane
  through a gather helper and writes one per lane; comparisons and logic on vectors use GLSL's
  component-wise functions; math whose GLSL form branches per element runs lane by lane;
- int64 (TVM's index type here) through GL_EXT_shader_explicit_arithmetic_types: the target
  must support shaderInt64 (lavapipe does). Array indices are converted to int: a storage
  buffer holds at most maxStorageBufferRange bytes (128 MiB on lavapipe), far below 2^31
  elements.
- math: GLSL.std.450 builtins, with our own tanh (no overflow), erf (Numerical Recipes' erfc,
  fractional error < 1.2e-7) and pow (C semantics for negative bases with integral exponents).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import tvm
from tvm import tirx

from ..errors import CompileError
from ..runtime.vulkan_runtime import load_vulkan_runtime
from .toolchain import find_tool

_SCALAR_TYPES = {
    "float32": "float",
    "float64": "double",
    "int64": "int64_t",
    "int32": "int",
    "int16": "int16_t",
    "int8": "int8_t",
    "uint64": "uint64_t",
    "uint32": "uint",
    "uint16": "uint16_t",
    "uint8": "uint8_t",
    "bool": "bool",
}
# Types a storage buffer element may have: bool tensors are 1 byte per element in memory.
_STORAGE_TYPES = {**_SCALAR_TYPES, "bool": "uint8_t"}
# GLSL vector types (2 to 4 lanes) by element type: vec4, i64vec2...
_VECTOR_PREFIX = {
    "float32": "vec", "float64": "dvec", "int64": "i64vec", "int32": "ivec", "int16": "i16vec",
    "int8": "i8vec", "uint64": "u64vec", "uint32": "uvec", "uint16": "u16vec", "uint8": "u8vec",
    "bool": "bvec",
}
_LANE_NAMES = "xyzw"

_PREAMBLE = """#version 450
#extension GL_EXT_shader_explicit_arithmetic_types : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_16bit_storage : require
"""

# Helper functions, emitted into a shader only when used.
_HELPERS = {
    "g_tanh": """float g_tanh(float x) {
  // tanh without the overflow of (e^2x - 1) / (e^2x + 1); series near 0 keeps precision.
  float a = abs(x);
  if (a < 0.004) return x * (1.0 - x * x / 3.0);
  float t = exp(-2.0 * a);
  return sign(x) * (1.0 - t) / (1.0 + t);
}""",
    "g_erf": """float g_erf(float x) {
  // erfc from Numerical Recipes (Chebyshev fit, fractional error < 1.2e-7); series near 0.
  float z = abs(x);
  if (z < 0.1) {
    float x2 = x * x;
    return x * 1.1283791671 * (1.0 - x2 / 3.0 + x2 * x2 / 10.0 - x2 * x2 * x2 / 42.0);
  }
  float t = 1.0 / (1.0 + 0.5 * z);
  float r = t * exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
            t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
            t * (-0.82215223 + t * 0.17087277)))))))));
  return x >= 0.0 ? 1.0 - r : r - 1.0;
}""",
    "g_pow": """float g_pow(float x, float y) {
  // GLSL pow is undefined for x < 0; C's powf is defined for integral exponents.
  if (y == 0.0) return 1.0;
  if (x >= 0.0) return pow(x, y);
  if (y != floor(y)) return uintBitsToFloat(0x7fc00000u);
  float r = pow(-x, y);
  return mod(y, 2.0) == 0.0 ? r : -r;
}""",
    "g_copysign": """float g_copysign(float x, float y) {
  return (floatBitsToUint(y) & 0x80000000u) != 0u ? -abs(x) : abs(x);
}""",
    "g_fmod": """float g_fmod(float x, float y) { return x - y * trunc(x / y); }""",
}
for _t in ("int", "int64_t"):
    _HELPERS[f"g_floordiv_{_t}"] = f"""{_t} g_floordiv({_t} a, {_t} b) {{
  {_t} q = a / b;
  return (a - q * b != {_t}(0) && ((a < {_t}(0)) != (b < {_t}(0)))) ? q - {_t}(1) : q;
}}"""
    _HELPERS[f"g_floormod_{_t}"] = f"""{_t} g_floormod({_t} a, {_t} b) {{
  {_t} r = a - (a / b) * b;
  return (r != {_t}(0) && ((r < {_t}(0)) != (b < {_t}(0)))) ? r + b : r;
}}"""
    _HELPERS[f"g_truncmod_{_t}"] = f"""{_t} g_truncmod({_t} a, {_t} b) {{ return a - (a / b) * b; }}"""

# C math functions (TVM lowers intrinsics to call_pure_extern("expf", ...)) and TIR
# intrinsics, by base name: GLSL function or helper.
_MATH = {
    "exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "sqrt": "sqrt",
    "rsqrt": "inversesqrt", "sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin",
    "acos": "acos", "atan": "atan", "sinh": "sinh", "cosh": "cosh", "asinh": "asinh",
    "acosh": "acosh", "atanh": "atanh", "fabs": "abs", "abs": "abs", "floor": "floor",
    "ceil": "ceil", "trunc": "trunc", "round": "roundEven", "nearbyint": "roundEven",
    "rint": "roundEven", "fmin": "min", "fmax": "max", "fma": "fma", "atan2": "atan",
    "tanh": "g_tanh", "erf": "g_erf", "pow": "g_pow", "copysign": "g_copysign",
    "fmod": "g_fmod", "isnan": "isnan", "isinf": "isinf",
}
_MATH_EXPR: dict[str, Callable[[list[str]], str]] = {
    "log10": lambda a: f"(log2({a[0]}) * 0.30102999566398120)",
    "log1p": lambda a: f"log(1.0 + {a[0]})",
    "expm1": lambda a: f"(exp({a[0]}) - 1.0)",
    "exp10": lambda a: f"exp2({a[0]} * 3.3219280948873623)",
    "sigmoid": lambda a: f"(1.0 / (1.0 + exp(-({a[0]}))))",
    "isfinite": lambda a: f"(!isnan({a[0]}) && !isinf({a[0]}))",
}

_BINARY = {
    tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.EQ: "==", tirx.NE: "!=", tirx.LT: "<",
    tirx.LE: "<=", tirx.GT: ">", tirx.GE: ">=", tirx.And: "&&", tirx.Or: "||",
    tirx.BitwiseAnd: "&", tirx.BitwiseOr: "|", tirx.BitwiseXor: "^", tirx.LShift: "<<",
    tirx.RShift: ">>",
}
# Comparisons of vectors: GLSL's operators compare whole vectors to one bool.
_VECTOR_COMPARE = {
    tirx.EQ: "equal", tirx.NE: "notEqual", tirx.LT: "lessThan", tirx.LE: "lessThanEqual",
    tirx.GT: "greaterThan", tirx.GE: "greaterThanEqual",
}
_THREAD_BUILTINS = {"blockIdx": "g_block", "threadIdx": "gl_LocalInvocationID"}
# TVM's grid (blockIdx extents, in pc.grid_*) is folded by the runtime into a dispatch within
# maxComputeWorkGroupCount: each workgroup recovers its blockIdx from its linear index, and the
# rounding-up surplus returns at once (whole workgroups, so barriers stay uniform).
_GRID_PROLOGUE = (
    "  const uint g_linear = gl_WorkGroupID.x + gl_NumWorkGroups.x * (gl_WorkGroupID.y +",
    "                        gl_NumWorkGroups.y * gl_WorkGroupID.z);",
    "  if (g_linear >= pc.grid_total) return;",
    "  const uvec3 g_block = uvec3(g_linear % pc.grid_x, (g_linear / pc.grid_x) % pc.grid_y,",
    "                              g_linear / (pc.grid_x * pc.grid_y));",
)


class VulkanCodegenError(CompileError):
    """A kernel cannot be expressed as a Vulkan compute shader (names the kernel)."""


@dataclasses.dataclass
class Kernel:
    """One kernel's GLSL and what the runtime needs to launch it."""

    name: str
    glsl: str
    num_buffers: int
    scalars: list[str]
    launch_params: list[str]
    workgroup: list[int]
    shared_bytes: int

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "num_buffers": self.num_buffers, "scalars": self.scalars,
            "launch_params": self.launch_params, "workgroup": self.workgroup,
            "shared_bytes": self.shared_bytes,
        }


def _bytes(dtype: str) -> int:
    return max(1, tvm.DataType(dtype).bits // 8)


def _dtype(e: Any) -> str:
    """An expression's type, from its IR type (`"handle"` for pointers)."""
    return str(e.ty.dtype) if isinstance(e.ty, tvm.ir.PrimType) else "handle"


def _lanes(dtype: str) -> int:
    return tvm.DataType(dtype).lanes


def _element(dtype: str) -> str:
    """The element type of a (vector) type: float32 for float32x4."""
    return str(tvm.DataType(dtype).with_lanes(1))


class _Printer:
    """Prints one PrimFunc as a GLSL compute shader."""

    def __init__(self, name: str, func: tirx.PrimFunc, limits: dict[str, int]):
        self.name = name
        self.func = func
        self.limits = limits
        self.names: dict[Any, str] = {}  # Var -> GLSL identifier
        self.used_names: set[str] = set()
        self.globals: dict[Any, str] = {}  # pointer argument -> its storage block instance
        self.storage_dtype: dict[Any, str] = {}  # pointer argument -> its element type
        self.bindings: dict[Any, int] = {}  # pointer argument -> its binding
        self.vector_views: dict[tuple[Any, int], str] = {}  # (pointer argument, lanes) -> block
        self.view_decls: list[str] = []  # vector views of storage buffers
        self.analyzer = tvm.sym.Analyzer()
        self.views: dict[Any, Any] = {}  # declared buffer (DeclBuffer) -> its pointer argument
        self.arrays: dict[Any, str] = {}  # allocated or declared-over buffer -> its array name
        self.array_decls: list[str] = []  # shared and local arrays, at module scope
        self.shared_bytes = 0
        self.helpers: dict[str, str] = {}
        self.workgroup = [1, 1, 1]
        self.thread_seen: dict[str, int] = {}
        self.uses_int64 = False
        self.lines: list[str] = []
        self.indent = 1

    # -- helpers -------------------------------------------------------------------------------
    def fail(self, what: str) -> VulkanCodegenError:
        return VulkanCodegenError(f"Vulkan code generation failed for kernel '{self.name}': {what}")

    def type_of(self, dtype: Any, table: dict[str, str] = _SCALAR_TYPES) -> str:
        element, lanes = _element(str(dtype)), _lanes(str(dtype))
        if element not in table:
            raise self.fail(f"element type {element} is not supported")
        if element in ("int64", "uint64"):
            self.uses_int64 = True
        if lanes == 1:
            return table[element]
        if not 2 <= lanes <= 4 or table is not _SCALAR_TYPES:
            raise self.fail(f"vector type {dtype} is not supported (GLSL vectors have 2 to 4 lanes)")
        return f"{_VECTOR_PREFIX[element]}{lanes}"

    def ident(self, var: Any, hint: str | None = None) -> str:
        if var not in self.names:
            base = "v_" + "".join(c if c.isalnum() else "_" for c in (hint or var.name))
            name, n = base, 1
            while name in self.used_names:
                name, n = f"{base}_{n}", n + 1
            self.used_names.add(name)
            self.names[var] = name
        return self.names[var]

    def emit(self, line: str) -> None:
        self.lines.append("  " * self.indent + line)

    def helper(self, name: str) -> str:
        self.helpers[name] = _HELPERS[name]
        return name

    def helper_call(self, name: str) -> Callable[[list[str]], str]:
        """Printed arguments -> a call of helper `name` (emitted into the shader when used)."""
        return lambda texts: f"{self.helper(name)}({', '.join(texts)})"

    # -- kernel --------------------------------------------------------------------------------
    def kernel(self) -> Kernel:
        params = list(self.func.params)
        is_buffer = [_dtype(p) == "handle" for p in params]
        if is_buffer != sorted(is_buffer, reverse=True):
            raise self.fail("buffer arguments must precede scalar arguments")
        buffers = [p for p, b in zip(params, is_buffer) if b]
        scalars = [p for p, b in zip(params, is_buffer) if not b]
        launch = [str(t) for t in self.func.attrs["tirx.kernel_launch_params"]]
        unknown = [t for t in launch if t.split(".")[0] not in _THREAD_BUILTINS]
        if unknown:
            raise self.fail(f"unsupported launch parameters {unknown} (dynamic shared memory?)")
        decls = []
        for i, param in enumerate(buffers):
            dtype = str(param.ty.element_type.dtype)
            block = self.ident(param)
            self.globals[param] = block
            self.storage_dtype[param] = dtype
            self.bindings[param] = i
            decls.append(
                f"layout(std430, set = 0, binding = {i}) buffer B{i} "
                f"{{ {self.type_of(dtype, _STORAGE_TYPES)} data[]; }} {block};"
            )
        members, body_prefix = [], list(_GRID_PROLOGUE)
        for i, param in enumerate(scalars):
            dtype = _dtype(param)
            glsl = "int" if dtype == "bool" else self.type_of(dtype)
            members.append(f"  layout(offset = {8 * i}) {glsl} s{i};")
            value = f"(pc.s{i} != 0)" if dtype == "bool" else f"pc.s{i}"
            body_prefix.append(f"  const {self.type_of(dtype)} {self.ident(param)} = {value};")
        grid = 8 * len(scalars)
        members += [f"  layout(offset = {grid + 4 * i}) uint {name};"
                    for i, name in enumerate(("grid_x", "grid_y", "grid_total"))]
        decls.append("layout(push_constant) uniform Params {\n" + "\n".join(members) + "\n} pc;")
        self.stmt(self.func.body)
        invocations = math.prod(self.workgroup)
        if invocations > self.limits["max_num_threads"]:
            raise self.fail(
                f"a workgroup of {invocations} threads ({'x'.join(map(str, self.workgroup))}) "
                f"exceeds the target's max_num_threads={self.limits['max_num_threads']}"
            )
        if self.shared_bytes > self.limits["max_shared_memory_per_block"]:
            raise self.fail(
                f"{self.shared_bytes} bytes of shared memory exceed the target's "
                f"max_shared_memory_per_block={self.limits['max_shared_memory_per_block']}"
            )
        if self.uses_int64 and not self.limits["supports_int64"]:
            raise self.fail("it needs 64-bit integers, and the target has supports_int64=False")
        x, y, z = self.workgroup
        source = "\n".join([
            _PREAMBLE,
            f"// kernel {self.name}",
            f"layout(local_size_x = {x}, local_size_y = {y}, local_size_z = {z}) in;",
            *decls,
            *self.view_decls,
            *self.array_decls,
            *self.helpers.values(),
            "void main() {",
            *body_prefix,
            *self.lines,
            "}",
            "",
        ])
        return Kernel(self.name, source, len(buffers), [_dtype(p) for p in scalars], launch,
                      self.workgroup, self.shared_bytes)

    # -- statements ----------------------------------------------------------------------------
    def block(self, stmt: Any) -> None:
        self.indent += 1
        self.stmt(stmt)
        self.indent -= 1

    def stmt(self, s: Any) -> None:
        if isinstance(s, tirx.SeqStmt):
            for child in s.seq:
                self.stmt(child)
        elif isinstance(s, tirx.AttrStmt):
            self.attr(s)
        elif isinstance(s, tirx.Bind):
            value = self.expr(s.value)
            self.emit(f"const {self.type_of(_dtype(s.var))} {self.ident(s.var)} = {value};")
        elif isinstance(s, tirx.LetStmt):
            self.emit("{")
            self.indent += 1
            self.emit(f"const {self.type_of(_dtype(s.var))} {self.ident(s.var)} = {self.expr(s.value)};")
            self.stmt(s.body)
            self.indent -= 1
            self.emit("}")
        elif isinstance(s, tirx.For):
            self.loop(s)
        elif isinstance(s, tirx.While):
            self.emit(f"while ({self.expr(s.condition)}) {{")
            self.block(s.body)
            self.emit("}")
        elif isinstance(s, tirx.IfThenElse):
            self.emit(f"if ({self.expr(s.condition)}) {{")
            self.block(s.then_case)
            if s.else_case is not None:
                self.emit("} else {")
                self.block(s.else_case)
            self.emit("}")
        elif isinstance(s, tirx.BufferStore):
            self.store(s)
        elif isinstance(s, tirx.AllocBuffer):
            self.allocate(s.buffer)
        elif isinstance(s, tirx.DeclBuffer):
            self.declare(s.buffer, s.data)
        elif isinstance(s, tirx.Evaluate):
            self.evaluate(s.value)
        else:
            raise self.fail(f"unsupported statement {type(s).__name__}")

    def attr(self, s: Any) -> None:
        if s.attr_key != "thread_extent":
            self.stmt(s.body)  # scheduling hints (reduce_scope, pragmas) need no code
            return
        tag = s.node.thread_tag
        scope, axis = tag.split(".")
        dim = "xyz".index(axis)
        if scope == "threadIdx":
            if not isinstance(s.value, tirx.IntImm):
                raise self.fail(f"{tag} has a symbolic extent ({s.value}); workgroup sizes are "
                                "compile-time constants in Vulkan")
            extent = int(s.value.value)
            if self.thread_seen.setdefault(tag, extent) != extent:
                raise self.fail(f"{tag} is launched with different extents")
            self.workgroup[dim] = extent
        var = s.node.var
        glsl_type = self.type_of(_dtype(var))
        self.emit("{")
        self.indent += 1
        self.emit(f"const {glsl_type} {self.ident(var, tag)} = {glsl_type}({_THREAD_BUILTINS[scope]}.{axis});")
        self.stmt(s.body)
        self.indent -= 1
        self.emit("}")

    def loop(self, s: Any) -> None:
        var = self.ident(s.loop_var)
        glsl_type = self.type_of(_dtype(s.loop_var))
        begin = self.expr(s.min)
        end = self.expr(s.extent) if _is_zero(s.min) else f"({begin} + {self.expr(s.extent)})"
        step = "++" + var if s.step is None or _is_one(s.step) else f"{var} += {self.expr(s.step)}"
        self.emit(f"for ({glsl_type} {var} = {begin}; {var} < {end}; {step}) {{")
        self.block(s.body)
        self.emit("}")

    def allocate(self, buffer: Any) -> None:
        scope = str(buffer.ty.storage_scope)
        size = 1
        for dim in buffer.ty.shape:
            if not isinstance(dim, tirx.IntImm):
                raise self.fail(f"{scope} array '{buffer.name}' has a symbolic size")
            size *= int(dim.value)
        name = self.ident(buffer)
        self.arrays[buffer] = name
        glsl_type = self.type_of(buffer.dtype)
        if scope == "shared":
            self.array_decls.append(f"shared {glsl_type} {name}[{size}];")
            self.shared_bytes += size * _bytes(str(buffer.dtype))
        elif scope == "local":
            self.array_decls.append(f"{glsl_type} {name}[{size}];")
        else:
            raise self.fail(f"allocation in scope '{scope}' ('{buffer.name}') is not supported")

    def declare(self, buffer: Any, data: Any) -> None:
        """A buffer declared over an argument's pointer, or over an allocated array (a view of
        shared memory under another name or shape, as the KV-cache kernels declare)."""
        if data in self.globals:
            self.views[buffer] = data
            return
        # An array's pointer is `buffer_data(array)`.
        base = data.args[0] if isinstance(data, tvm.ir.Call) and data.op.name == "tirx.buffer_data" else None
        if base not in self.arrays:
            raise self.fail(f"buffer '{buffer.name}' is declared over an unknown pointer")
        if str(base.dtype) != str(buffer.dtype):
            raise self.fail(f"buffer '{buffer.name}' views the {base.dtype} array '{base.name}' "
                            f"as {buffer.dtype}")
        self.arrays[buffer] = self.arrays[base]

    def evaluate(self, value: Any) -> None:
        if isinstance(value, tvm.ir.Call) and value.op.name == "tirx.tvm_storage_sync":
            scope = str(value.args[0].value)
            if scope == "shared":
                self.emit("memoryBarrierShared(); barrier();")
            elif scope == "global":
                # Only synchronizes within the workgroup, like TVM's other GPU backends.
                self.emit("memoryBarrierBuffer(); barrier();")
            else:
                raise self.fail(f"storage sync of scope '{scope}' is not supported")
        elif isinstance(value, tirx.IntImm):
            pass  # a no-op statement
        else:
            self.emit(f"{self.expr(value)};")

    # -- expressions ---------------------------------------------------------------------------
    def is_bool_storage(self, buffer: Any) -> bool:
        return buffer in self.views and str(buffer.dtype) == "bool"

    def array_of(self, buffer: Any) -> str:
        """The GLSL array holding `buffer`'s elements: a storage block's data, or an array."""
        if buffer in self.views:
            data = self.views[buffer]
            declared = self.storage_dtype[data]
            if declared != str(buffer.dtype):
                raise self.fail(f"buffer '{buffer.name}' is accessed as {buffer.dtype} but the "
                                f"argument is {declared}")
            return f"{self.globals[data]}.data"
        if buffer in self.arrays:
            return self.arrays[buffer]
        raise self.fail(f"buffer '{buffer.name}' is neither an argument nor allocated")

    def index(self, buffer: Any, indices: Any) -> tuple[str, int]:
        """The printed index of an access (int, or ivecN for N lanes) and its lanes."""
        if len(indices) != 1:
            raise self.fail(f"buffer '{buffer.name}' is not flattened ({len(indices)} indices)")
        index = indices[0]
        lanes = _lanes(_dtype(index))
        if lanes > 1 and _lanes(str(buffer.dtype)) > 1:
            raise self.fail(f"vectorized access to the vector array '{buffer.name}' is not supported")
        text = self.expr(index)
        if _element(_dtype(index)) != "int32":
            text = f"{self.type_of(f'int32x{lanes}' if lanes > 1 else 'int32')}({text})"
        return text, lanes

    def vector_element(self, buffer: Any, indices: Any) -> str | None:
        """`view.data[i]` when the access reads or writes `lanes` consecutive elements of a
        storage buffer starting at a multiple of `lanes`: one vector element of a view of the
        same binding typed vecN. Else None (a gather, one element per lane).

        A CPU driver (lavapipe) loads a vector element in one go per invocation, where it
        makes one scalar load per element of a gather."""
        if buffer not in self.views or len(indices) != 1 or self.is_bool_storage(buffer):
            return None
        index = indices[0]
        lanes = _lanes(_dtype(index))
        if not (isinstance(index, tirx.Ramp) and _is_one(index.stride) and lanes in (2, 4)):
            return None
        dtype = str(buffer.dtype)
        if tvm.DataType(dtype).bits != 32 or _lanes(dtype) != 1:
            return None
        modular = self.analyzer.modular_set(index.base)
        if modular.coeff % lanes or modular.base % lanes:
            return None
        data = self.views[buffer]
        view = self.vector_views.get((data, lanes))
        if view is None:
            view = f"{self.globals[data]}_x{lanes}"
            binding = self.bindings[data]
            self.view_decls.append(
                f"layout(std430, set = 0, binding = {binding}) buffer B{binding}x{lanes} "
                f"{{ {self.type_of(f'{dtype}x{lanes}')} data[]; }} {view};")
            self.vector_views[(data, lanes)] = view
        element = self.analyzer.simplify(tirx.floordiv(index.base, lanes))
        text = self.expr(element)
        if _dtype(element) != "int32":
            text = f"int({text})"
        return f"{view}.data[{text}]"

    def load(self, e: Any) -> str:
        vector = self.vector_element(e.source, e.indices)
        if vector is not None:
            return vector
        array = self.array_of(e.source)
        index, lanes = self.index(e.source, e.indices)
        if lanes > 1:
            return f"{self.gather(array, _dtype(e), self.is_bool_storage(e.source))}({index})"
        text = f"{array}[{index}]"
        return f"({text} != uint8_t(0))" if self.is_bool_storage(e.source) else text

    def gather(self, array: str, dtype: str, bool_storage: bool) -> str:
        """A helper reading one element of `array` per lane of an index vector (GLSL indexes
        one element at a time; the helper evaluates the index once)."""
        lanes = _lanes(dtype)
        name = f"g_load_{array.replace('.', '_')}_{lanes}"
        if name not in self.helpers:
            vector = self.type_of(dtype)
            parts = [f"{array}[i.{lane}]" for lane in _LANE_NAMES[:lanes]]
            if bool_storage:
                parts = [f"{part} != uint8_t(0)" for part in parts]
            self.helpers[name] = (f"{vector} {name}(ivec{lanes} i) {{ "
                                  f"return {vector}({', '.join(parts)}); }}")
        return name

    def store(self, s: Any) -> None:
        vector = self.vector_element(s.buffer, s.indices)
        if vector is not None:
            self.emit(f"{vector} = {self.expr(s.value)};")
            return
        array = self.array_of(s.buffer)
        index, lanes = self.index(s.buffer, s.indices)
        value = self.expr(s.value)
        bool_storage = self.is_bool_storage(s.buffer)
        if lanes == 1:
            if bool_storage:
                value = f"(({value}) ? uint8_t(1) : uint8_t(0))"
            self.emit(f"{array}[{index}] = {value};")
            return
        # One element per lane, the index and value evaluated once.
        self.emit("{")
        self.emit(f"  const ivec{lanes} g_i = {index};")
        self.emit(f"  const {self.type_of(_dtype(s.value))} g_v = {value};")
        for lane in _LANE_NAMES[:lanes]:
            element = f"(g_v.{lane} ? uint8_t(1) : uint8_t(0))" if bool_storage else f"g_v.{lane}"
            self.emit(f"  {array}[g_i.{lane}] = {element};")
        self.emit("}")

    def expr(self, e: Any) -> str:
        if isinstance(e, tirx.IntImm):
            return self.int_literal(int(e.value), _dtype(e))
        if isinstance(e, tirx.FloatImm):
            return self.float_literal(float(e.value), _dtype(e))
        if isinstance(e, tvm.ir.Var):
            if e not in self.names:
                raise self.fail(f"variable '{e.name}' is used but never defined")
            return self.names[e]
        if isinstance(e, tirx.Broadcast):
            return f"{self.type_of(_dtype(e))}({self.expr(e.value)})"
        if isinstance(e, tirx.Ramp):
            return self.ramp(e)
        if isinstance(e, tirx.Shuffle):
            return self.shuffle(e)
        vector = _lanes(_dtype(e)) > 1
        if vector and type(e) in _VECTOR_COMPARE:
            return f"{_VECTOR_COMPARE[type(e)]}({self.expr(e.a)}, {self.expr(e.b)})"
        if vector and isinstance(e, (tirx.And, tirx.Or)):
            # GLSL has no && / || on bvecN: combine the lanes as 0/1 integers.
            uvec, op = f"uvec{_lanes(_dtype(e))}", "&" if isinstance(e, tirx.And) else "|"
            return f"bvec{_lanes(_dtype(e))}({uvec}({self.expr(e.a)}) {op} {uvec}({self.expr(e.b)}))"
        if type(e) in _BINARY:
            return f"({self.expr(e.a)} {_BINARY[type(e)]} {self.expr(e.b)})"
        if isinstance(e, tirx.Div):
            return f"({self.expr(e.a)} / {self.expr(e.b)})"
        if isinstance(e, (tirx.Mod, tirx.FloorDiv, tirx.FloorMod)):
            return self.division(e)
        if isinstance(e, (tirx.Min, tirx.Max)):
            fn = "min" if isinstance(e, tirx.Min) else "max"
            return f"{fn}({self.expr(e.a)}, {self.expr(e.b)})"
        if isinstance(e, tirx.Not):
            return f"not({self.expr(e.a)})" if vector else f"(!{self.expr(e.a)})"
        if isinstance(e, tirx.BitwiseNot):
            return f"(~{self.expr(e.a)})"
        if isinstance(e, tirx.Select):
            c, t, f = self.expr(e.condition), self.expr(e.true_value), self.expr(e.false_value)
            # A lane-wise condition picks per lane (both sides are evaluated, as in TIR).
            return f"mix({f}, {t}, {c})" if _lanes(_dtype(e.condition)) > 1 else f"({c} ? {t} : {f})"
        if isinstance(e, tirx.Cast):
            return self.cast(e)
        if isinstance(e, tvm.ir.TensorLoad):
            return self.load(e)
        if isinstance(e, tvm.ir.Call):
            return self.call(e)
        if isinstance(e, tirx.Let):
            return self.let(e)
        raise self.fail(f"unsupported expression {type(e).__name__}: {e}")

    def ramp(self, e: Any) -> str:
        """`base + stride * (0, 1, ..., lanes - 1)`."""
        vector = self.type_of(_dtype(e))
        offsets = f"{vector}({', '.join(str(k) for k in range(_lanes(_dtype(e))))})"
        if not _is_one(e.stride):
            offsets = f"{offsets} * {self.expr(e.stride)}"
        return f"({self.expr(e.base)} + {offsets})"

    def shuffle(self, e: Any) -> str:
        """Lanes picked from one vector (a swizzle), or vectors and scalars concatenated."""
        if not all(isinstance(i, tirx.IntImm) for i in e.indices):
            raise self.fail("a shuffle with computed lane indices is not supported")
        indices = [int(i.value) for i in e.indices]
        vectors = list(e.vectors)
        if len(vectors) == 1 and _lanes(_dtype(vectors[0])) > 1:
            swizzle = "".join(_LANE_NAMES[i] for i in indices)
            return f"({self.expr(vectors[0])}).{swizzle}"
        if indices == list(range(sum(_lanes(_dtype(v)) for v in vectors))):
            return f"{self.type_of(_dtype(e))}({', '.join(self.expr(v) for v in vectors)})"
        raise self.fail(f"a shuffle of {len(vectors)} vectors with lanes {indices} is not supported")

    def let(self, e: Any) -> str:
        """A let expression, its value printed in place of each use (GLSL has no expression
        that binds a name; hoisting the value out would evaluate it where its guard, such as a
        Select's condition, does not hold). The shader compiler merges the copies."""
        outer = self.names.get(e.var)
        self.names[e.var] = f"({self.expr(e.value)})"
        try:
            return self.expr(e.body)
        finally:
            if outer is None:
                del self.names[e.var]
            else:
                self.names[e.var] = outer

    def int_literal(self, value: int, dtype: str) -> str:
        if dtype == "bool":
            return "true" if value else "false"
        glsl = self.type_of(dtype)
        suffix = {"int64_t": "l", "uint64_t": "ul", "int": "", "uint": "u"}.get(glsl)
        if suffix is None:
            return f"{glsl}({value})"
        if value < 0:
            # -2^31 / -2^63 have no literal of their own type.
            return f"({value + 1}{suffix} - 1{suffix})"
        return f"{value}{suffix}"

    def float_literal(self, value: float, dtype: str) -> str:
        glsl = self.type_of(dtype)
        if math.isnan(value) or math.isinf(value):
            if dtype != "float32":
                raise self.fail(f"non-finite {dtype} constants are not supported")
            bits = "0x7fc00000u" if math.isnan(value) else ("0x7f800000u" if value > 0 else "0xff800000u")
            return f"uintBitsToFloat({bits})"
        text = repr(value)  # shortest round-trip form, always with '.' or an exponent
        if dtype == "float64":
            text += "lf"
        elif dtype != "float32":
            return f"{glsl}({text})"
        return f"({text})" if value < 0 else text

    def cast(self, e: Any) -> str:
        to, src = _dtype(e), _dtype(e.value)
        value = self.expr(e.value)
        if to == src:
            return value
        glsl = self.type_of(to)
        vector = _lanes(to) > 1
        if _element(to) == "bool":
            zero = f"{self.type_of(src)}(0)"
            return f"notEqual({value}, {zero})" if vector else f"({value} != {zero})"
        if _element(src) == "bool" and not vector:
            return f"({value} ? {glsl}(1) : {glsl}(0))"
        return f"{glsl}({value})"  # vector constructors convert bool lanes to 0 and 1

    def division(self, e: Any) -> str:
        a, b = self.expr(e.a), self.expr(e.b)
        dtype = _dtype(e)
        if tvm.DataType(dtype).type_code == tvm.DataTypeCode.FLOAT:
            if isinstance(e, tirx.FloorDiv):
                return f"floor({a} / {b})"
            if isinstance(e, tirx.FloorMod):
                return f"({a} - floor({a} / {b}) * {b})"
            return self.lanewise("g_fmod", self.helper_call("g_fmod"), e, [e.a, e.b], [a, b])
        if dtype.startswith("uint"):
            return f"({a} / {b})" if isinstance(e, tirx.FloorDiv) else f"({a} % {b})"
        glsl = self.type_of(_element(dtype))
        if glsl not in ("int", "int64_t"):
            raise self.fail(f"integer division of {dtype} is not supported")
        kind = {tirx.Mod: "truncmod", tirx.FloorDiv: "floordiv", tirx.FloorMod: "floormod"}[type(e)]
        self.helper(f"g_{kind}_{glsl}")
        return self.lanewise(f"g_{kind}", lambda t: f"g_{kind}({t[0]}, {t[1]})", e, [e.a, e.b], [a, b])

    def call(self, e: Any) -> str:
        op = e.op.name.replace("prim.", "tirx.", 1)  # if_then_else, likely live in "prim."
        args = list(e.args)
        if op in ("tirx.call_pure_extern", "tirx.call_extern"):
            name = str(args[0].value)
            args = args[1:]
            if name not in _MATH and name not in _MATH_EXPR and name.endswith("f"):
                name = name[:-1]  # expf -> exp: the float32 C function
            return self.math(name, args, e)
        if op == "tirx.if_then_else":
            # GLSL evaluates only the selected operand, like TIR's if_then_else (guarded loads).
            c, t, f = (self.expr(a) for a in args)
            return f"({c} ? {t} : {f})"
        if op in ("tirx.likely", "tirx.tvm_thread_invariant"):
            return self.expr(args[0])  # hints: the condition itself
        if op == "tirx.reinterpret":
            return self.reinterpret(args[0], _dtype(e))
        if op.startswith("tirx."):
            return self.math(op[len("tirx."):], args, e)
        raise self.fail(f"unsupported call {op}")

    def math(self, name: str, args: list, e: Any) -> str:
        if _element(_dtype(e)) not in ("float32", "bool") and name not in ("fabs", "abs", "fmin", "fmax"):
            raise self.fail(f"{name} on {_dtype(e)} is not supported (float32 only)")
        texts = [self.expr(a) for a in args]
        if name in _MATH_EXPR:
            scalar = _MATH_EXPR[name]
        elif name in _MATH and _MATH[name] in _HELPERS:
            scalar = self.helper_call(_MATH[name])
        elif name in _MATH:
            return f"{_MATH[name]}({', '.join(texts)})"  # GLSL builtins apply lane by lane
        else:
            raise self.fail(f"unsupported math function '{name}'")
        return self.lanewise(f"g_{name}", scalar, e, args, texts)

    def lanewise(self, name: str, scalar: Callable[[list[str]], str], e: Any, args: list,
                 texts: list[str]) -> str:
        """`scalar` (printed arguments -> printed result) applied to `texts`: directly for a
        scalar `e`, else through an overload `name` that applies it to each lane, for
        functions whose GLSL form works on one element (branches, helpers with ifs)."""
        lanes = _lanes(_dtype(e))
        if lanes == 1:
            return scalar(texts)
        result = self.type_of(_dtype(e))
        params = [self.type_of(_dtype(a)) for a in args]
        key = f"{name}({', '.join(params)})"
        if key not in self.helpers:
            def lane(k: int) -> str:
                return scalar([f"a{i}.{_LANE_NAMES[k]}" if _lanes(_dtype(a)) > 1 else f"a{i}"
                               for i, a in enumerate(args)])
            values = ", ".join(lane(k) for k in range(lanes))
            signature = ", ".join(f"{t} a{i}" for i, t in enumerate(params))
            self.helpers[key] = f"{result} {name}({signature}) {{ return {result}({values}); }}"
        return f"{name}({', '.join(texts)})"

    def reinterpret(self, value: Any, to: str) -> str:
        src = _dtype(value)
        fn = {("float32", "int32"): "floatBitsToInt", ("float32", "uint32"): "floatBitsToUint",
              ("int32", "float32"): "intBitsToFloat", ("uint32", "float32"): "uintBitsToFloat"}
        if (_element(src), _element(to)) not in fn or _lanes(src) != _lanes(to):
            raise self.fail(f"reinterpret from {src} to {to} is not supported")
        return f"{fn[(_element(src), _element(to))]}({self.expr(value)})"


def _is_zero(e: Any) -> bool:
    return isinstance(e, tirx.IntImm) and int(e.value) == 0


def _is_one(e: Any) -> bool:
    return isinstance(e, tirx.IntImm) and int(e.value) == 1


def target_limits(target: tvm.target.Target) -> dict[str, Any]:
    """The limits the printer enforces, from the TVM target's attributes."""
    attrs = dict(target.export())
    return {
        "max_num_threads": int(attrs.get("max_num_threads", 256)),
        "max_shared_memory_per_block": int(attrs.get("max_shared_memory_per_block", 16384)),
        "supports_int64": bool(attrs.get("supports_int64", True)),
    }


def print_kernels(mod: tvm.IRModule, target: tvm.target.Target) -> list[Kernel]:
    """Every PrimFunc of `mod` as a GLSL compute shader."""
    limits = target_limits(target)
    kernels = []
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            name = str(func.attrs["global_symbol"]) if "global_symbol" in func.attrs else gv.name_hint
            kernels.append(_Printer(name, func, limits).kernel())
    return sorted(kernels, key=lambda k: k.name)


def glslang() -> str | None:
    """glslangValidator on PATH (Debian: glslang-tools)."""
    return find_tool("glslangValidator")


def compile_glsl(kernel: Kernel) -> bytes:
    """GLSL -> SPIR-V for Vulkan 1.1 with glslangValidator; errors name the kernel."""
    with tempfile.TemporaryDirectory(prefix="gimlet-glsl-") as folder:
        source, binary = Path(folder, f"{kernel.name}.comp"), Path(folder, f"{kernel.name}.spv")
        source.write_text(kernel.glsl)
        proc = subprocess.run(
            [glslang(), "-V", "--target-env", "vulkan1.1", "-o", os.fspath(binary), os.fspath(source)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            detail = [line for line in proc.stdout.splitlines() if "ERROR" in line][:5]
            raise VulkanCodegenError(
                f"glslangValidator rejected the shader of kernel '{kernel.name}': "
                + " | ".join(detail or proc.stdout.strip().splitlines()[-5:])
            )
        return binary.read_bytes()


def build_vulkan(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.runtime.Module:
    """`target.build.vulkan`: the kernels of `mod` as a runnable gimlet Vulkan module."""
    load_vulkan_runtime()
    kernels = print_kernels(mod, target)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        blobs = list(pool.map(compile_glsl, kernels))
    description = {
        "kernels": [k.describe() for k in kernels],
        "source": "\n".join(k.glsl for k in kernels),
    }
    create = tvm.get_global_func("gimlet.vulkan.module_create")
    return create(json.dumps(description), [bytearray(b) for b in blobs])
