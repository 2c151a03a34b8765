"""Kernel generators in the selection loop: the protocol (docs/kernel-generators.md).

A generator is a shell command. For each op group it is offered (`formats_for`), it runs up to
`Generator.rounds` times with one JSON task on standard input (`task`: the group, its
reference semantics, the target, the source formats it takes, the best candidate so far and
the history of earlier rounds) and prints a JSON list of candidates (`format`, `source`,
optional `name`) on standard output; both directions are checked against the protocol's
schema (`json_schema`). Each candidate is kept in the records directory's generated-kernel
directory (`external.add_kernel`, built like an external kernel) and verified and timed like
every other candidate, unless the same kernel was accepted before (`accepted`); its verdict
goes into the next round's history. Malformed output, a non-zero exit or running past the
group's time is a failed round: reported, recorded, and selection goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, Callable

import tvm

from ..errors import GimletError
from ..schedules.kernel_selection.candidates import MAX_TASKS, OpSignature
from ..schedules.kernel_selection.choices import GeneratorRound, Tried
from ..schedules.kernel_selection.external import C_FLAGS, C_FUNCTION, OPS, add_kernel
from ..schedules.kernel_selection.sources import find
from ..targets import spec_for
from ..targets.cpu import cpu_features
from ..targets.kernels.dequant_gemv import BLOCK
from . import openai_generator, search_generator
from .accepted import AcceptedKernels, content_hash
from .json_schema import protocol_errors
from .verify import Outcome

PROTOCOL = "gimlet-tvm-kernel-generator/1"
GENERATED_DIR = "generated_kernels"
"""The records directory's folder of generated kernels (a `kernels.json` directory)."""
STDERR_TAIL = 300  # characters of a failed generator's standard error kept in its reason
BUNDLED = {"search": search_generator.__file__, "openai": openai_generator.__file__}
"""Generators that ship with the compiler, by name: each a script run by this Python (they
need neither the package nor TVM, so they start in milliseconds), isolated (`-I`: the script's
folder, which holds a `select.py`, must not shadow the standard library's)."""


@dataclasses.dataclass(frozen=True)
class Generator:
    """A kernel generator: the shell `command`, how many `rounds` per op group, and the
    `seconds` it may take on one op group, its rounds together (verification not counted)."""

    command: str
    rounds: int = 3
    seconds: float = 300.0

    @classmethod
    def named(cls, command: str, rounds: int = 3, seconds: float = 300.0) -> Generator:
        """A generator given by a command, or by the name of a bundled one (`BUNDLED`) and its
        arguments (`openai --url URL --model MODEL`)."""
        name, _, arguments = command.strip().partition(" ")
        if name in BUNDLED:
            command = f"{shlex.quote(sys.executable)} -I {shlex.quote(BUNDLED[name])} {arguments}".rstrip()
        return cls(command, rounds, seconds)

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.seconds <= 0:
            raise GimletError(f"a kernel generator needs at least one round and some time (got {self.rounds} "
                              f"rounds, {self.seconds:g} s per op group)")


def formats_for(sig: OpSignature, target: tvm.target.Target) -> tuple[str, ...]:
    """The source formats a generator may answer in for `sig` on `target`; empty: the group
    is not offered (GEMMs, conv2ds, attention, norms and the LLM's dequantizing GEMV, built as
    external kernels are): C on CPU targets this machine runs, TVMScript on every target (GPU
    kernels bind their threads)."""
    spec = spec_for(target)
    if sig.op not in OPS or (sig.op == "matmul" and sig.addends_2d() is None):
        return ()
    return ("c", "tvmscript") if spec.is_cpu and spec.runs_here() and sig.dtype == "float32" else ("tvmscript",)


def _conv2d(sig: OpSignature) -> dict[str, Any]:
    """A conv2d's sizes and attributes, as the task states them."""
    p = {name: int(value) for name, value in sig.attrs}
    (n, c, h, w), (o, _, kh, kw) = sig.shapes
    _, _, oh, ow = sig.out_shape
    return {"n": n, "c": c, "h": h, "w": w, "o": o, "kh": kh, "kw": kw, "oh": oh, "ow": ow,
            "stride": [p["stride_h"], p["stride_w"]],
            "pad": [p["pad_top"], p["pad_left"], p["pad_bottom"], p["pad_right"]],
            "dilation": [p["dilation_h"], p["dilation_w"]], "groups": p["groups"]}


def _conv2d_numpy(sig: OpSignature) -> str:
    """A conv2d of `a` (NCHW) by `b` (OIHW) as a numpy expression (`sliding_window_view` from
    numpy.lib.stride_tricks)."""
    p = _conv2d(sig)
    (top, left, bottom, right), (sh, sw), (dh, dw), g = p["pad"], p["stride"], p["dilation"], p["groups"]
    extent = (dh * (p["kh"] - 1) + 1, dw * (p["kw"] - 1) + 1)
    windows = (f"sliding_window_view(np.pad(a, ((0, 0), (0, 0), ({top}, {bottom}), ({left}, {right}))), {extent}, "
               f"axis=(2, 3))[:, :, ::{sh}, ::{sw}, ::{dh}, ::{dw}]")
    cpg, opg = p["c"] // g, p["o"] // g
    return (f"np.einsum('ngchwij,gocij->ngohw', {windows}.reshape({p['n']}, {g}, {cpg}, {p['oh']}, {p['ow']}, "
            f"{p['kh']}, {p['kw']}), b.reshape({g}, {opg}, {cpg}, {p['kh']}, {p['kw']}))"
            f".reshape({p['n']}, {p['o']}, {p['oh']}, {p['ow']})")


def _attention(sig: OpSignature) -> dict[str, Any]:
    """An attention's sizes, scale and bias shape (None: no bias), as the task states them."""
    (b, s, n, h), (_, t, _, _), (_, _, _, hv) = sig.shapes[:3]
    bias = list(sig.shapes[3]) if len(sig.shapes) == 4 else None
    return {"b": b, "s": s, "t": t, "n": n, "h": h, "hv": hv, "scale": dict(sig.attrs)["scale"], "bias": bias}


def _attention_numpy(sig: OpSignature) -> str:
    """Softmax over the keys of the scaled scores (plus the bias), weighting the values."""
    bias = " + bias" if len(sig.shapes) == 4 else ""
    scores = f"np.einsum('bsnh,btnh->bnst', q, k) * {dict(sig.attrs)['scale']!r}{bias}"
    return ("(lambda s, v: np.einsum('bnst,btnv->bsnv', np.exp(s - s.max(-1, keepdims=True)) "
            f"/ np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True), v))({scores}, v)")


def _norm(sig: OpSignature) -> dict[str, Any]:
    """A norm's rows, normalized size (`OpSignature.kernel_operands`' x[rows, size]), how many
    trailing axes of x it normalizes over, and its epsilon, as the task states them."""
    (_, (rows, size)) = sig.kernel_operands()[0]
    return {"rows": rows, "size": size, "axes": len(sig.shapes[1]), "epsilon": dict(sig.attrs)["epsilon"]}


def _norm_numpy(sig: OpSignature) -> str:
    """A layer norm of `x` by `gamma` and `beta` (an RMS norm's by `gamma`) over the trailing
    axes, in numpy."""
    axes = tuple(range(-len(sig.shapes[1]), 0))
    mean_square = f"(v * v).mean(axis={axes}, keepdims=True)"
    normed = f"(lambda v: v / np.sqrt({mean_square} + {dict(sig.attrs)['epsilon']!r}))"
    if sig.op == "rms_norm":
        return f"{normed}(x) * gamma"
    return f"{normed}(x - x.mean(axis={axes}, keepdims=True)) * gamma + beta"


def _dequant_gemv(sig: OpSignature) -> dict[str, Any]:
    """A dequant_gemv's sizes, block format and how its blocks are laid out, as the task states them."""
    layout = sig.kind.layout(sig.attrs)
    (_, _, k), (n, blocks) = sig.shapes[:2]
    if layout.has_mins:
        block = ("block b of output row j: weights j, b*32 .. b*32+31; scales[j][b] = d and mins[j][b] = m (IEEE "
                 "float16 bits); quants[j][b*16 + i] (uint8, i < 16) holds q of weight b*32+i in its low nibble and "
                 "q of weight b*32+16+i in its high nibble (0..15); w = d * q + m")
    else:
        block = ("block b of output row j: weights j, b*32 .. b*32+31; scales[j][b] = d (IEEE float16 bits); "
                 "quants[j][b*32 + i] = q (int8, -128..127); w = d * q")
    return {"n": n, "k": k, "blocks": blocks, "format": layout.name, "bias": bool(dict(sig.attrs)["bias"]),
            "block_size": BLOCK, "block": block, "rows_checked": [shapes[0][0] for shapes in
                                                                 (sig.shapes, *(v.shapes for v in sig.variants()))]}


def _dequant_gemv_numpy(sig: OpSignature) -> str:
    """W dequantized from the block arrays (float64), then x @ W^T (+ bias)."""
    layout = sig.kind.layout(sig.attrs)
    (_, _, k), (n, blocks) = sig.shapes[:2]
    if layout.has_mins:
        q = (f"np.concatenate([quants.reshape({n}, {blocks}, 16) & 15, quants.reshape({n}, {blocks}, 16) >> 4], "
             "axis=2)")
        w = f"scales.astype(np.float64)[:, :, None] * {q} + mins.astype(np.float64)[:, :, None]"
    else:
        w = f"scales.astype(np.float64)[:, :, None] * quants.reshape({n}, {blocks}, 32)"
    bias = " + bias" if dict(sig.attrs)["bias"] else ""
    return f"(x[:, 0, :] @ ({w}).reshape({n}, {k}).T{bias})[:, None, :]"


OWN_NUMPY = {"attention": _attention_numpy, "layer_norm": _norm_numpy, "rms_norm": _norm_numpy,
             "dequant_gemv": _dequant_gemv_numpy}
"""The numpy expression of each op without an epilogue, over its operands' names."""


def numpy_expression(sig: OpSignature) -> str:
    """What the group computes as a numpy expression of `a`, `b` and `addend0`, ...
    (`erf`: `math.erf` elementwise; a conv2d's: `_conv2d_numpy`); an attention's of `q`,
    `k`, `v` and `bias`, a norm's of `x`, `gamma` and `beta`, a dequant_gemv's of `x`,
    `scales`, `mins`, `quants` and `bias` (`OWN_NUMPY`)."""
    if sig.op in OWN_NUMPY:
        return OWN_NUMPY[sig.op](sig)
    expr, addends = "a @ b" if sig.op == "matmul" else _conv2d_numpy(sig), 0
    for kind, _ in sig.epilogue:
        if kind == "add":
            expr, addends = f"({expr}) + addend{addends}", addends + 1
        elif kind == "relu":
            expr = f"np.maximum({expr}, 0)"
        else:
            expr = f"0.5 * ({expr}) * (1 + erf(({expr}) / np.sqrt(2)))"
    return expr


LAYOUTS = {
    "matmul": "row-major; a[..., M, K] @ b[K, N] -> c[..., M, N]; addends broadcast numpy-style",
    "conv2d": "NCHW data a[N, C, H, W], OIHW weight b[O, C/groups, KH, KW] -> NCHW out[N, O, OH, OW]; "
              "addends broadcast numpy-style",
    "attention": "BSNH q[B, S, N, H], k[B, T, N, H], v[B, T, N, HV] (batch, positions, heads, head size), "
                 "an optional additive bias[B or 1, N or 1, S or 1, T] that broadcasts -> BSNH out[B, S, N, HV]",
    "layer_norm": "row-major x[..., D1, ..., Dk] normalized over its last k axes (k: gamma's rank), gamma and "
                  "beta [D1, ..., Dk] -> out shaped as x; a kernel sees x and out as [rows, size]",
    "rms_norm": "row-major x[..., D1, ..., Dk] normalized over its last k axes (k: gamma's rank), gamma "
                "[D1, ..., Dk] -> out shaped as x; a kernel sees x and out as [rows, size]",
    "dequant_gemv": "x[rows, 1, K] (float32) @ W^T (+ bias[N], float32) -> out[rows, 1, N] (float32), W[N, K] "
                    "given in a GGUF block format (float16 scales[N, K/32], Q4_1 also float16 mins[N, K/32], "
                    "quants); rows is any count, given at run time",
}
SEMANTICS = {
    "matmul": "(batch axes folded into M)",
    "conv2d": ("out[n][o][y][x] = sum over ci < C/groups, i < KH, j < KW of "
               "data[n][(o / (O/groups)) * (C/groups) + ci][y*stride_h - pad_top + i*dilation_h]"
               "[x*stride_w - pad_left + j*dilation_w] * weight[o][ci][i][j], data outside the image being 0"),
    "attention": ("out[b][s][n][:] = sum over t < T of p[t] * v[b][t][n][:], p = softmax over t of "
                  "(scale * sum over h of q[b][s][n][h] * k[b][t][n][h] + bias[b][n][s][t]), no causal mask; "
                  "scale is the group's attribute"),
    "layer_norm": ("out[r][i] = (x[r][i] - mean) / sqrt(var + epsilon) * gamma[i] + beta[i], mean and var "
                   "(biased: divided by size) over the size elements of row r; epsilon is the group's attribute"),
    "rms_norm": ("out[r][i] = x[r][i] / sqrt(ms + epsilon) * gamma[i], ms the mean of x[r][j] * x[r][j] over "
                 "the size elements of row r; epsilon is the group's attribute"),
    "dequant_gemv": ("out[r][0][j] = sum over c < K of x[r][0][c] * w[j][c] (+ bias[j]), w as group.dequant_gemv "
                     "states it; rows is the first argument"),
}
C_TYPES = {"float32": "float", "float16": "uint16_t", "int8": "int8_t", "uint8": "uint8_t"}
"""The C type of an array element of each dtype (float16: its IEEE half-precision bits)."""


def _interface(sig: OpSignature, target: tvm.target.Target, formats: tuple[str, ...]) -> dict[str, str]:
    """How a kernel of each format takes its operands (`OpSignature.kernel_operands`)."""
    operands, dtypes = sig.kernel_operands(), sig.kernel_dtypes()
    out = operands[-1][0]
    rows = ["int64_t rows"] if sig.kind.rows_generic else []
    c_args = ", ".join([*rows, *(f"const {C_TYPES[dtype]} *{name}" for (name, _), dtype in zip(operands[:-1], dtypes)),
                        f"{C_TYPES[sig.dtype]} *{out}"])
    generic = {0, len(operands) - 1} if rows else set()
    arrays = ", ".join(name + "".join(f"[{'rows' if i in generic and a == 0 else d}]" for a, d in enumerate(shape))
                       + ("" if dtype == sig.dtype else f" {dtype}")
                       for i, ((name, shape), dtype) in enumerate(zip(operands, dtypes)))
    described = {
        "c": (f"C11 source defining void {C_FUNCTION}({c_args}); "
              + ("<stdint.h>'s types; rows: the row count of x and out, any (checked at "
                 f"{', '.join(str(v.shapes[0][0]) for v in (sig, *sig.variants()))}); " if rows else "")
              + f"arrays {arrays}, compact row-major "
              f"{SEMANTICS[sig.op]}; each addend broadcasts over {out} (a dimension of 1 repeats); write every "
              f"element of {out}; compiled with gcc {' '.join(C_FLAGS)} -march=<the target's CPU>; libc and libm "
              "only, no threads, processes, files or network. To use the target's cores, give the candidate \"tasks\": T (2 to "
              f"{MAX_TASKS}): then the function takes int64_t task, int64_t tasks before its other arguments and "
              "computes its share of the output, called for task = 0 .. T-1 in parallel on the compiler's thread pool; "
              "each output element must be written by one task alone (its tasks are also run concurrently, in order "
              "and in reverse order, and must give one output)"),
        "tvmscript": (f"TVMScript of one T.prim_func (T is tvm.script.tirx) with buffers {arrays} in that order, "
                      f"dtype {sig.dtype} unless given, as PrimFunc.script() prints it, no Python imports; "
                      + ("rows a T.int64() variable of T.match_buffer'd x and out; " if rows else "") + "give it "
                      'T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True}) when it is scheduled'
                      + ("" if spec_for(target).is_cpu else
                         "; for this GPU target, bind its loops with T.thread_binding to blockIdx.x/threadIdx.x "
                         "(at most the target facts' max_threads_per_block threads a block)")),
    }
    return {fmt: described[fmt] for fmt in formats}


def _gemm(sig: OpSignature) -> dict[str, int]:
    m, n, k = sig.gemm
    return {"m": m, "n": n, "k": k}


SIZES = {"matmul": ("gemm", _gemm), "conv2d": ("conv2d", _conv2d), "attention": ("attention", _attention),
         "layer_norm": ("layer_norm", _norm), "rms_norm": ("rms_norm", _norm),
         "dequant_gemv": ("dequant_gemv", _dequant_gemv)}
"""Where the task's group states each op's sizes and attributes, and what it says there."""


def _target_facts(target: tvm.target.Target) -> dict[str, Any]:
    spec = spec_for(target)
    return {"kind": target.kind.name, "target": json.loads(str(target)), "facts": spec.facts(),
            "features": cpu_features(target) if spec.is_cpu else []}


def task(sig: OpSignature, target: tvm.target.Target, round_: int, rounds: int,
         best: dict[str, Any] | None, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON task of one round (`generator_schema.json`'s "task")."""
    formats = formats_for(sig, target)
    group = {"key": sig.key, "op": sig.op, "ops": [sig.op, *(kind for kind, _ in sig.epilogue)],
             "dtype": sig.dtype, "shapes": [list(s) for s in (*sig.shapes, *sig.addend_shapes)],
             "epilogue": [[kind, list(shape)] for kind, shape in sig.epilogue], "layout": LAYOUTS[sig.op],
             "addends": [list(shape) for name, shape in sig.kernel_operands() if name.startswith("addend")],
             "weight": sig.weight}
    field, sizes = SIZES[sig.op]
    group[field] = sizes(sig)
    if len(set(sig.operand_dtypes)) > 1:  # each operand's dtype, where they differ
        group["dtypes"] = list(sig.operand_dtypes)
    return {
        "protocol": PROTOCOL, "round": round_, "rounds": rounds, "group": group,
        "reference": {"tvmscript": sig.module().script(), "numpy": numpy_expression(sig)},
        "target": _target_facts(target), "formats": list(formats), "interface": _interface(sig, target, formats),
        "best": best, "history": history,
    }


def call_generator(command: str, task_json: dict[str, Any], timeout: float) -> tuple[list[dict[str, Any]], str]:
    """Run the generator on one task: (its candidates, "") or ([], why the round failed).
    On a timeout its whole process group is killed (a shell command's children too)."""
    problems = protocol_errors(task_json, "task")
    if problems:  # our own side of the protocol
        raise ValueError(f"kernel generator task does not match the schema: {problems[:3]}")
    if timeout <= 0:
        return [], "no time left for this group"
    proc = subprocess.Popen(command, shell=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps(task_json), timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return [], f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        tail = err.strip()[-STDERR_TAIL:] or "no error output"
        return [], f"exited with code {proc.returncode}: {tail}"
    try:
        answer = json.loads(out)
    except ValueError as error:
        return [], f"malformed output (not JSON: {error})"
    problems = protocol_errors(answer, "candidates")
    if problems:
        return [], "malformed output: " + "; ".join(problems[:3])
    return answer, ""


def _attempt(tried: Tried, fmt: str, source: str) -> dict[str, Any]:
    return {"name": tried.id.split(":", 1)[1], "format": fmt, "source": source, "verdict": tried.verdict,
            "error": tried.reason, "seconds": tried.seconds}


def _verified(sig: OpSignature, target: tvm.target.Target, cid: str, candidate: dict[str, Any], directory: str,
              verify: Callable[[str], Outcome], cache: AcceptedKernels, command: str, round_: int) -> Tried:
    """The generated candidate `cid` verified and timed by `verify`, or, where the same kernel
    was accepted before (`cache`), its verdict and time from then."""
    made = find(cid, sig, target, generated_dir=directory)
    digest = content_hash(sig, target, candidate["format"], candidate["source"], candidate.get("tasks", 1))
    known = cache.get(digest)
    if known is not None:
        outcome = Outcome(True, seconds=known["seconds"], checks=known["shapes_checked"])
    else:
        outcome = verify(cid)
        if outcome.verified:
            cache.add(digest, made.name, outcome, command, round_)
    return Tried(cid, f"{made.provenance} (generator round {round_})", outcome.verified, outcome.reason,
                 outcome.seconds, made.digest, verdict=outcome.verdict, cached=known is not None)


def generate(sig: OpSignature, target: tvm.target.Target, generator: Generator, directory: str,
             verify: Callable[[str], Outcome], tried: list[Tried],
             report: Callable[[str], None]) -> list[GeneratorRound]:
    """Run `generator`'s rounds on `sig`: each candidate it gives is kept in `directory`,
    verified and timed by `verify` (candidate id -> outcome) and appended to `tried` (which
    holds the group's other candidates: the best so far is told to the generator)."""
    formats = formats_for(sig, target)
    sources: dict[str, tuple[str, str]] = {}  # generated candidate id -> (format, source)
    history: list[dict[str, Any]] = []
    rounds = []
    cache = AcceptedKernels(directory)
    left = generator.seconds  # the generator's own time: verification is not counted
    for round_ in range(1, generator.rounds + 1):
        verified = [t for t in tried if t.verified]
        best = min(verified, key=lambda t: t.seconds, default=None)
        best_json = None if best is None else {"candidate": best.id, "seconds": best.seconds,
                                               "format": sources.get(best.id, (None, None))[0],
                                               "source": sources.get(best.id, (None, None))[1]}
        started = time.monotonic()
        answer, failure = call_generator(generator.command, task(sig, target, round_, generator.rounds,
                                                                 best_json, history),
                                         left)
        spent = time.monotonic() - started
        left -= spent
        if not failure:
            refused = [c["format"] for c in answer if c["format"] not in formats]
            split = [c["format"] for c in answer if c.get("tasks", 1) != 1 and c["format"] != "c"]
            if refused:
                answer, failure = [], f"format '{refused[0]}' is not accepted here (only {', '.join(formats)})"
            elif split:
                answer, failure = [], f"\"tasks\" is for C kernels only, not {split[0]}"
        attempts, ids = [], []
        for index, candidate in enumerate(answer):
            name = add_kernel(directory, sig, target.kind.name, candidate["format"], candidate["source"],
                              candidate.get("name") or f"r{round_}_{index}", tasks=candidate.get("tasks", 1),
                              generator=generator.command, round=round_)
            cid = f"generator:{name}"
            ids.append(cid)
            done = next((t for t in tried if t.id == cid), None)
            if done is None:  # a kernel given again keeps its first verdict
                done = _verified(sig, target, cid, candidate, directory, verify, cache, generator.command, round_)
                tried.append(done)
                sources[cid] = (candidate["format"], candidate["source"])
                report(f"{sig.key}: {cid} (round {round_}) " + ("cached, verified before: " if done.cached else "")
                       + (f"{done.seconds * 1e3:.3f} ms" if done.verified else f"no: {done.reason}"))
            attempts.append(_attempt(done, candidate["format"], candidate["source"]))
        if failure:
            report(f"{sig.key}: generator round {round_} failed: {failure}")
        history.append({"round": round_, "failure": failure, "attempts": attempts})
        rounds.append(GeneratorRound(round_, ids, failure, round(spent, 3)))
    return rounds
