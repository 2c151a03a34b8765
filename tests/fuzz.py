"""Fuzzing: broken models, artifacts, tuning records and inputs through `build`, `load`, `run` and
the CLI. Every case must end in a typed error (a `GimletError`) or a correct result: never a
crash, a hang, another exception, a wrong result or a half-written file.

    python -m tests.fuzz --minutes 60 [--seed S] [--corpus DIR] [--all]

Cases run in a worker process (one at a time, each in a fresh folder), so a crash (the worker
dies) or a hang (no answer within `--timeout` seconds) is caught and the worker replaced. A
round runs every mutator of every stage once, on the seed models in turn (`tests/fuzz_seeds`);
`--minutes` runs rounds until the time is up. Each finding's input is saved in the corpus
(`tests/fuzz_corpus/`: the input, gzipped, named by its content hash, and `HASH.case.json` saying the
stage, the seed, the mutator and what went wrong), which `tests/test_fuzz.py` replays.

Stages and their input:
- `build`: a mutated ONNX model (bytes) to `gimlet_tvm.build`; a model that builds is run on
  random inputs and compared with onnxruntime (where onnxruntime accepts the model).
- `compile`: the same through `gimlet-tvm compile` then `gimlet-tvm run` (in-process `main`):
  exit 0 or 2, and no file but the ones asked for.
- `load`: a mutated artifact (the seed's, exported) to `gimlet_tvm.load` and `gimlet-tvm run`;
  one that loads must compute the seed's outputs.
- `run`: a mutated `.npz` of inputs to the seed's artifact, through `CompiledModel.run` and
  `gimlet-tvm run --inputs`; `call`: Python objects (JSON) to `CompiledModel(*args)`.
- `records`: a mutated tuning-records directory (as JSON {file: text}) to `gimlet-tvm records
  validate|list|stats|best` and to `build(..., records=)`.

Mutated artifacts keep a library whose checksum matches only by accident: an artifact is a
shared library, and one altered on purpose with its checksum recomputed runs what it holds,
which no loader can make safe.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gzip
import hashlib
import io
import json
import math
import multiprocessing
import os
import re
import resource
import shutil
import struct
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

import tvm
from tvm.s_tir import meta_schedule as ms

import gimlet_tvm
from gimlet_tvm.cli import main as cli_main
from gimlet_tvm.errors import GimletError
from gimlet_tvm.peers import onnxruntime_session
from gimlet_tvm.runtime.artifact import MAGIC
from gimlet_tvm.runtime.tensors import random_inputs
from gimlet_tvm.schedules.tuning.records import RECORD_FILE, TASKS_FILE, WORKLOAD_FILE, RecordsDB, record_json
from gimlet_tvm.tuning import extract_tasks

from .fuzz_seeds import RECORDS_SEED, SEEDS

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
TIMEOUT = 120.0
"""Seconds a case may take before it counts as a hang (a seed model builds in about one)."""
MEMORY_LIMIT = 8 << 30
"""Address space of the worker: a model that asks for a huge allocation fails instead of
taking the machine down."""
MAX_RUN_ELEMENTS = 1 << 22
"""A model built from mutated shapes is run only when its inputs are at most this many elements."""
TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}
EXTENSIONS = {"build": ".onnx", "compile": ".onnx", "load": ".so", "run": ".npz", "call": ".json",
              "records": ".json"}
KNOWN = {
    ("run", "index_out_of_range", "gather"): "Gather indices past the table are not bounds-checked "
    "at run time: a read out of bounds, wrong values or a segfault",
    ("run", "nan_inf", "softmax"): "Softmax of a row holding +inf: onnxruntime gives NaN, we give "
    "finite values",
    ("run", "nan_inf", "conv"): "Conv/Relu/MaxPool over NaN and inf inputs: some outputs differ "
    "from onnxruntime's (finite against inf, 0 against a finite value)",
}
"""(stage, mutator, seed) cases whose findings are known and wait for a fix, with what goes
wrong: left out of rounds unless `--all` asks for them."""


# ---- mutators -------------------------------------------------------------------------------
# Each takes the seed's input and a random generator and returns the mutated input, or None
# where it has nothing to change in that seed (the round then tries the next seed).

def _flip_bits(data: bytes, rng: np.random.Generator, start: int = 0, end: int | None = None) -> bytes:
    out = bytearray(data)
    end = len(out) if end is None else end
    for _ in range(int(rng.integers(1, 9))):
        out[int(rng.integers(start, end))] ^= 1 << int(rng.integers(0, 8))
    return bytes(out)


def _truncate(data: bytes, rng: np.random.Generator) -> bytes:
    return data[: int(rng.integers(0, len(data)))]


def _proto(data: bytes) -> onnx.ModelProto:
    return onnx.load_from_string(data)


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    nodes = []
    for node in graph.node:
        nodes.append(node)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                nodes += _all_nodes(attr.g)
    return nodes


_DTYPES = [TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT32, TensorProto.INT64,
           TensorProto.INT8, TensorProto.UINT8, TensorProto.BOOL, TensorProto.STRING,
           TensorProto.COMPLEX64, TensorProto.BFLOAT16, TensorProto.UNDEFINED, 99]


def model_wrong_dtype(data: bytes, rng: np.random.Generator) -> bytes:
    """A graph input, output, initializer or value_info declared with another element type."""
    model = _proto(data)
    graph = model.graph
    places = [*graph.input, *graph.output, *graph.value_info, *graph.initializer]
    place = places[int(rng.integers(len(places)))]
    dtype = _DTYPES[int(rng.integers(len(_DTYPES)))]
    if isinstance(place, onnx.TensorProto):
        place.data_type = dtype
    else:
        place.type.tensor_type.elem_type = dtype
    return model.SerializeToString()


def model_dangling_edge(data: bytes, rng: np.random.Generator) -> bytes:
    """A node (subgraphs included) reads a tensor nothing produces."""
    model = _proto(data)
    nodes = [n for n in _all_nodes(model.graph) if n.input]
    node = nodes[int(rng.integers(len(nodes)))]
    node.input[int(rng.integers(len(node.input)))] = "dangling_tensor"
    return model.SerializeToString()


def model_huge_shape(data: bytes, rng: np.random.Generator) -> bytes:
    """A dimension of 2**31..2**62 (or a negative one) on an input or an initializer."""
    model = _proto(data)
    size = -int(rng.integers(1, 10)) if rng.random() < 0.2 else 1 << int(rng.integers(31, 63))
    inputs = [i for i in model.graph.input if i.type.tensor_type.shape.dim]
    initializers = [t for t in model.graph.initializer if t.dims]
    if initializers and (not inputs or rng.random() < 0.5):
        tensor = initializers[int(rng.integers(len(initializers)))]
        tensor.dims[int(rng.integers(len(tensor.dims)))] = size
    elif inputs:
        dims = inputs[int(rng.integers(len(inputs)))].type.tensor_type.shape.dim
        dims[int(rng.integers(len(dims)))].dim_value = size
    else:
        return None
    return model.SerializeToString()


def model_cycle(data: bytes, rng: np.random.Generator) -> bytes:
    """The first node reads the last one's output (with one node: its own)."""
    model = _proto(data)
    nodes = model.graph.node
    first, last = nodes[0], nodes[len(nodes) - 1]
    first.input[int(rng.integers(len(first.input)))] = last.output[0]
    return model.SerializeToString()


def model_deep_subgraph(data: bytes, rng: np.random.Generator) -> bytes | None:
    """The seed's If nested in the then-branch of 20..300 more Ifs on the same condition (built
    in place: protobuf's copies refuse messages nested past 100 levels)."""
    model = _proto(data)
    graph = model.graph
    if [n.op_type for n in graph.node] != ["If"]:
        return None
    seed_if = onnx.NodeProto()
    seed_if.CopyFrom(graph.node[0])
    out = graph.output[0]
    node = graph.node[0]
    del node.attribute[:]
    for level in range(int(rng.choice([20, 60, 300]))):
        then_attr = node.attribute.add(name="then_branch", type=onnx.AttributeProto.GRAPH)
        else_attr = node.attribute.add(name="else_branch", type=onnx.AttributeProto.GRAPH)
        else_attr.g.name = f"else{level}"
        else_attr.g.node.append(helper.make_node("Identity", ["x"], [f"other{level}"]))
        else_attr.g.output.append(out)
        else_attr.g.output[0].name = f"other{level}"
        then_attr.g.name = f"then{level}"
        then_attr.g.output.append(out)
        then_attr.g.output[0].name = f"level{level}"
        node = then_attr.g.node.add()
        node.op_type, node.name = "If", f"if{level}"
        node.input.append("cond")
        node.output.append(f"level{level}")
    node.CopyFrom(seed_if)
    node.output[0] = f"level{level}"
    return model.SerializeToString()


MODEL_MUTATORS: dict[str, Callable] = {
    "truncate": _truncate,
    "bitflip": _flip_bits,
    "wrong_dtype": model_wrong_dtype,
    "dangling_edge": model_dangling_edge,
    "huge_shape": model_huge_shape,
    "cycle": model_cycle,
    "deep_subgraph": model_deep_subgraph,
}

_FOOTER = struct.Struct("<Q")


def _artifact_parts(data: bytes) -> tuple[bytes, dict, bytes]:
    """(library, metadata, magic) of a well-formed artifact (runtime/artifact.py's layout)."""
    (length,) = _FOOTER.unpack(data[-_FOOTER.size - len(MAGIC): -len(MAGIC)])
    end = len(data) - _FOOTER.size - len(MAGIC)
    return data[: end - length], json.loads(data[end - length: end]), MAGIC


def _artifact(library: bytes, meta: dict, magic: bytes) -> bytes:
    blob = json.dumps(meta, sort_keys=True).encode()
    return library + blob + _FOOTER.pack(len(blob)) + magic


def artifact_bitflip_library(data: bytes, rng: np.random.Generator) -> bytes:
    library, _, _ = _artifact_parts(data)
    return _flip_bits(data, rng, 0, len(library))


def artifact_bitflip_metadata(data: bytes, rng: np.random.Generator) -> bytes:
    library, _, _ = _artifact_parts(data)
    return _flip_bits(data, rng, len(library), len(data))


def _edit_metadata(meta: dict, rng: np.random.Generator) -> None:
    """One structural change: a key gone, a value of another type, an interface altered."""
    spec = meta["io"]["inputs"][0]
    edits = [
        lambda: meta.pop(str(rng.choice(sorted(meta)))),
        lambda: meta["io"].pop("outputs"),
        lambda: meta.__setitem__("io", "inputs"),
        lambda: meta.__setitem__("targets", []),
        lambda: meta.__setitem__("targets", [{"name": "tpu9000"}]),
        lambda: meta.__setitem__("targets", "llvm"),
        lambda: spec.__setitem__("dtype", "float64"),
        lambda: spec.__setitem__("dtype", "no_such_type"),
        lambda: spec.__setitem__("shape", [*spec["shape"], 3]),
        lambda: spec.__setitem__("shape", [7] * len(spec["shape"])),
        lambda: spec.__setitem__("shape", None),
        lambda: spec.__setitem__("name", 12),
        lambda: meta["io"]["inputs"].append(dict(spec, name="extra")),
        lambda: meta.__setitem__("format", "1"),
    ]
    edits[int(rng.integers(len(edits)))]()


def artifact_edit_metadata(data: bytes, rng: np.random.Generator) -> bytes:
    """Valid JSON with a field removed, retyped or changed: a writer of another version, or an
    edit by hand."""
    library, meta, magic = _artifact_parts(data)
    _edit_metadata(meta, rng)
    return _artifact(library, meta, magic)


def artifact_footer_length(data: bytes, rng: np.random.Generator) -> bytes:
    """The footer's metadata length replaced by another number."""
    library, meta, magic = _artifact_parts(data)
    blob = json.dumps(meta, sort_keys=True).encode()
    lengths = [0, 1, len(blob) + 1, len(library) + len(blob), 2**63, 2**64 - 1]
    length = lengths[int(rng.integers(len(lengths)))]
    return library + blob + _FOOTER.pack(length) + magic


def artifact_append(data: bytes, rng: np.random.Generator) -> bytes:
    return data + rng.bytes(int(rng.integers(1, 64)))


ARTIFACT_MUTATORS: dict[str, Callable] = {
    "truncate": _truncate,
    "bitflip_library": artifact_bitflip_library,
    "bitflip_metadata": artifact_bitflip_metadata,
    "edit_metadata": artifact_edit_metadata,
    "footer_length": artifact_footer_length,
    "append": artifact_append,
}


def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _arrays(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def _change_array(data: bytes, rng: np.random.Generator, change: Callable) -> bytes | None:
    arrays = _arrays(data)
    name = sorted(arrays)[int(rng.integers(len(arrays)))]
    changed = change(arrays[name], rng)
    if changed is None:
        return None
    arrays[name] = changed
    return _npz(arrays)


def _wrong_shape(a: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    if a.ndim == 0:
        return np.zeros((2,), a.dtype)
    shape = list(a.shape)
    shape[int(rng.integers(len(shape)))] = int(rng.choice([0, 1, 3, 5, 17]))
    return np.resize(a, shape) if shape != list(a.shape) else None


def _wrong_rank(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return a[None] if a.ndim == 0 or rng.random() < 0.5 else a.reshape(-1)[:1].reshape(()) if a.ndim == 1 else a[0]


def _wrong_dtype(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    dtypes = [t for t in ("float64", "float16", "int32", "int64", "uint8", "bool", "complex64")
              if t != str(a.dtype)]
    return a.astype(str(rng.choice(dtypes)))


def _special_values(a: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    if a.dtype.kind != "f" or not a.size:
        return None
    out = a.copy().reshape(-1)
    picks = rng.integers(0, out.size, max(1, out.size // 3))
    out[picks] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], dtype=a.dtype), picks.size)
    return out.reshape(a.shape)


def _huge_values(a: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    if a.dtype.kind != "f":
        return None
    return (a * np.float32(rng.choice([1e15, 1e30, -1e30]))).astype(a.dtype)


def _out_of_range(a: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    if a.dtype.kind not in "iu":
        return None
    return np.full_like(a, int(rng.choice([-11, 10, 1000, 2**40])))


def inputs_missing(data: bytes, rng: np.random.Generator) -> bytes:
    arrays = _arrays(data)
    arrays.pop(sorted(arrays)[int(rng.integers(len(arrays)))])
    return _npz(arrays)


def inputs_extra(data: bytes, rng: np.random.Generator) -> bytes:
    return _npz(dict(_arrays(data), bogus=np.zeros(3, np.float32)))


def inputs_object_array(data: bytes, rng: np.random.Generator) -> bytes:
    """An object array (pickled in the .npz), which a reader must refuse to unpickle."""
    arrays: dict[str, Any] = _arrays(data)
    name = sorted(arrays)[0]
    arrays[name] = np.array([{"a": 1}, None], dtype=object)
    return _npz(arrays)


INPUT_MUTATORS: dict[str, Callable] = {
    "wrong_shape": lambda d, r: _change_array(d, r, _wrong_shape),
    "wrong_rank": lambda d, r: _change_array(d, r, _wrong_rank),
    "wrong_dtype": lambda d, r: _change_array(d, r, _wrong_dtype),
    "nan_inf": lambda d, r: _change_array(d, r, _special_values),
    "huge_values": lambda d, r: _change_array(d, r, _huge_values),
    "index_out_of_range": lambda d, r: _change_array(d, r, _out_of_range),
    "missing": inputs_missing,
    "extra": inputs_extra,
    "object_array": inputs_object_array,
    "truncate_npz": _truncate,
    "bitflip_npz": _flip_bits,
}


def call_objects(data: bytes, rng: np.random.Generator) -> bytes:
    """Positional arguments that are no arrays: ragged lists, strings, None, dicts, too many."""
    arrays = _arrays(data)
    args: list[Any] = [a.tolist() for a in arrays.values()]
    index = int(rng.integers(len(args)))
    choices = [[[1.0, 2.0], [3.0]], "x", None, {"a": 1}, [[None]], 1e400, []]
    pick = int(rng.integers(len(choices) + 1))
    if pick == len(choices):
        args.append(args[0])
    else:
        args[index] = choices[pick]
    return json.dumps(args).encode()


CALL_MUTATORS: dict[str, Callable] = {"objects": call_objects}


def _records(data: bytes) -> dict[str, str]:
    return json.loads(data)


def _pick_file(files: dict[str, str], rng: np.random.Generator) -> str:
    return sorted(files)[int(rng.integers(len(files)))]


def _edit_file(data: bytes, rng: np.random.Generator, edit: Callable[[bytes], bytes]) -> bytes:
    files = _records(data)
    name = _pick_file(files, rng)
    files[name] = edit(files[name].encode()).decode("utf-8", errors="replace")
    return json.dumps(files).encode()


def _lines(data: bytes, name: str) -> tuple[dict[str, str], list[str]]:
    files = _records(data)
    return files, files[name].splitlines()


def records_bad_line(data: bytes, rng: np.random.Generator) -> bytes:
    """A line replaced by JSON of the wrong shape or by junk."""
    name = str(rng.choice([RECORD_FILE, WORKLOAD_FILE]))
    files, lines = _lines(data, name)
    record = json.loads(files[RECORD_FILE].splitlines()[0])[1]
    junk = ["[]", "{}", '"x"', "[1]", "[1, 2, 3]", "null", "[-1, %s]", '["0", %s]', "[999, %s]",
            "[0, 5]", "[true, %s]", '["hash", "not base64"]', '[0, "AAAA"]', "[[0], %s]", "\x00\xff"]
    text = str(rng.choice(junk))
    lines[int(rng.integers(len(lines)))] = text.replace("%s", json.dumps(record))
    files[name] = "\n".join(lines) + "\n"
    return json.dumps(files).encode()


def records_edit_record(data: bytes, rng: np.random.Generator) -> bytes:
    """A record's run time, target, trace or argument info replaced by a value of the wrong kind."""
    files, lines = _lines(data, RECORD_FILE)
    index = int(rng.integers(len(lines)))
    workload, record = json.loads(lines[index])
    field = int(rng.integers(4))
    values = {
        0: [[], [[["Bogus", [], [], []]], []], [[["GetSBlock", [], ["no_block", "main"], ["b0"]]], []],
            [[["Parallel", ["l999"], [], []]], []], "trace"],
        1: [["nan"], [-1.0], "fast", [], [1e308, 1e308], [0.0], None],
        2: ["junk", {}, {"kind": "cuda"}, {"kind": "llvm", "mcpu": 5}, [1]],
        3: [[], [["TENSOR", "float32", [-1]]], "args", [["TENSOR", "no_dtype", [4, 32]]]],
    }[field]
    record[field] = values[int(rng.integers(len(values)))]
    lines[index] = json.dumps([workload, record])
    files[RECORD_FILE] = "\n".join(lines) + "\n"
    return json.dumps(files).encode()


def records_edit_tasks(data: bytes, rng: np.random.Generator) -> bytes:
    """The task names file: not a dict, a weight that is no number, an entry that is no dict."""
    files = _records(data)
    tasks = json.loads(files[TASKS_FILE])
    key = sorted(tasks)[0]
    edits = [lambda: [1, 2], lambda: dict(tasks, **{key: {"weight": "many"}}),
             lambda: dict(tasks, **{key: "softmax"}), lambda: dict(tasks, **{key: {"name": 5}}),
             lambda: dict(tasks, **{key: {"weight": None}}), lambda: dict(tasks, **{key: {"weight": 1e400}})]
    files[TASKS_FILE] = json.dumps(edits[int(rng.integers(len(edits)))]())
    return json.dumps(files).encode()


def records_delete_file(data: bytes, rng: np.random.Generator) -> bytes:
    files = _records(data)
    del files[_pick_file(files, rng)]
    return json.dumps(files).encode()


RECORDS_MUTATORS: dict[str, Callable] = {
    "truncate_file": lambda d, r: _edit_file(d, r, lambda b: _truncate(b, r)),
    "bitflip_file": lambda d, r: _edit_file(d, r, lambda b: _flip_bits(b, r)),
    "bad_line": records_bad_line,
    "edit_record": records_edit_record,
    "edit_tasks": records_edit_tasks,
    "delete_file": records_delete_file,
}

MUTATORS: dict[str, dict[str, Callable]] = {
    "build": MODEL_MUTATORS,
    "compile": MODEL_MUTATORS,
    "load": ARTIFACT_MUTATORS,
    "run": INPUT_MUTATORS,
    "call": CALL_MUTATORS,
    "records": RECORDS_MUTATORS,
}


# ---- cases and their outcomes ---------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One input for one stage; `seed` names the seed model it was made from."""

    stage: str
    seed: str
    mutator: str
    payload: bytes

    def digest(self) -> str:
        return hashlib.sha256(self.stage.encode() + b"\0" + self.payload).hexdigest()[:20]


@dataclasses.dataclass
class Outcome:
    """`status`: "ok" (a correct result, or one no reference could check), "typed" (a
    GimletError), or a finding: "crash", "hang", "untyped", "wrong", "leftover", "cli"."""

    status: str
    detail: str = ""

    @property
    def finding(self) -> bool:
        return self.status not in ("ok", "typed")

    def signature(self, case: "Case") -> str:
        """What makes two findings the same: stage, mutator, status and the message without its
        numbers, paths and quoted names (the corpus keeps one input of each)."""
        message = re.sub(r"\d+|'[^']*'|/\S*", "", self.detail)
        return f"{case.stage}/{case.mutator}/{self.status}/{message[:80]}"


class Finding(Exception):
    """Raised inside the worker when a case fails a check."""

    def __init__(self, status: str, detail: str):
        super().__init__(detail)
        self.status = status


# ---- the worker: runs cases ------------------------------------------------------------------

class Checker:
    """Runs cases of every stage against seed material in `workdir` (made by `prepare`)."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self._models: dict[str, Any] = {}

    def prepare(self) -> dict[str, str]:
        """Export each seed's artifact, write the seed records: paths, by name."""
        paths = {}
        os.makedirs(os.path.join(self.workdir, "seeds"), exist_ok=True)
        for name, make in SEEDS.items():
            paths[name] = os.path.join(self.workdir, "seeds", f"{name}.so")
            gimlet_tvm.build(make(), "llvm").export(paths[name])
        paths["records"] = os.path.join(self.workdir, "seeds", "records")
        _seed_records(paths["records"])
        return paths

    def run(self, case: Case) -> Outcome:
        folder = tempfile.mkdtemp(prefix=f"{case.stage}-", dir=self.workdir)
        try:
            getattr(self, f"_{case.stage}")(case, folder)
            return Outcome("ok")
        except Finding as err:
            return Outcome(err.status, str(err))
        except GimletError as err:
            return Outcome("typed", f"{type(err).__name__}: {err}")
        except Exception as err:
            frames = traceback.extract_tb(err.__traceback__)
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            return Outcome("untyped", f"{type(err).__name__}: {str(err)[:500]}{where}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    # stages
    def _build(self, case: Case, folder: str) -> None:
        model = gimlet_tvm.build(case.payload, "llvm")
        _check_against_reference(model, case.payload, None)

    def _compile(self, case: Case, folder: str) -> None:
        _write(folder, "model.onnx", case.payload)
        expected = {"model.onnx"}
        if _cli(folder, "compile", "model.onnx", "-o", "out.so") == 0:
            expected.add("out.so")
            if _cli(folder, "run", "out.so", "--outputs", "out.npz") == 0:
                expected.add("out.npz")
        _check_files(folder, expected)

    def _load(self, case: Case, folder: str) -> None:
        _write(folder, "model.so", case.payload)
        expected = {"model.so"}
        if _cli(folder, "run", "model.so", "--outputs", "out.npz") == 0:
            expected.add("out.npz")
        _check_files(folder, expected)
        model = gimlet_tvm.load(os.path.join(folder, "model.so"))
        _check_against_reference(model, SEEDS[case.seed]().SerializeToString(), _seed_inputs(case.seed))

    def _run(self, case: Case, folder: str) -> None:
        _write(folder, "in.npz", case.payload)
        expected = {"in.npz"}
        if _cli(folder, "run", self._artifact(case.seed), "--inputs", "in.npz", "--outputs", "out.npz") == 0:
            expected.add("out.npz")
        _check_files(folder, expected)
        try:
            arrays = _arrays(case.payload)
        except Exception:  # numpy itself cannot read it: the CLI's part was the test
            return
        model = self._model(case.seed)
        _check_against_reference(model, SEEDS[case.seed]().SerializeToString(), arrays)

    def _call(self, case: Case, folder: str) -> None:
        args = json.loads(case.payload)
        self._model(case.seed)(*args)

    def _records(self, case: Case, folder: str) -> None:
        records = os.path.join(folder, "records")
        os.makedirs(records)
        for name, text in json.loads(case.payload).items():
            _write(records, name, text.encode())
        for action in ("validate", "list", "stats", "best"):
            code = _cli(folder, "records", action, records)
            if code not in (0, 1, 2) or (code == 1 and action != "validate"):
                raise Finding("cli", f"records {action} exited with {code}")
        seed = SEEDS[case.seed]()
        model = gimlet_tvm.build(seed, "llvm", records=records)
        _check_against_reference(model, seed.SerializeToString(), None)

    def _artifact(self, seed: str) -> str:
        return os.path.join(self.workdir, "seeds", f"{seed}.so")

    def _model(self, seed: str):
        if seed not in self._models:
            self._models[seed] = gimlet_tvm.load(self._artifact(seed))
        return self._models[seed]


def _seed_records(path: str) -> None:
    """Records for the records seed's kernels, each scheduled (its loops parallel) with a
    made-up run time: MetaSchedule's own format, without the minute a tuning run takes."""
    target, tasks, _ = extract_tasks(SEEDS[RECORDS_SEED](), "llvm")
    lines = []
    for task in tasks:
        sch = tvm.s_tir.Schedule(task.mod)
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            loops = sch.get_loops(block)
            if len(loops) > 1:
                sch.parallel(loops[0])
        record = ms.database.TuningRecord(sch.trace, ms.database.Workload(task.mod), [1e-5], target,
                                          ms.arg_info.ArgInfo.from_prim_func(task.mod["main"]))
        lines.append((task.workload, record_json(record)))
    RecordsDB(path, create=True).add(lines, {t.workload[0]: {"name": t.name, "weight": t.weight} for t in tasks})


def _write(folder: str, name: str, data: bytes) -> None:
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def _cli(folder: str, *argv: str) -> int:
    """`gimlet-tvm ARGV` in `folder`, in this process: its exit code; a finding when it raises
    (no exit code) or prints a traceback."""
    err = io.StringIO()
    previous = os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = cli_main(list(argv))
    except SystemExit as exit:  # argparse
        code = exit.code if isinstance(exit.code, int) else 2
    except Exception as exc:
        raise Finding("cli", f"gimlet-tvm {' '.join(argv)} raised {type(exc).__name__}: {str(exc)[:500]}") from None
    finally:
        os.chdir(previous)
    if code not in (0, 1, 2) or "Traceback" in err.getvalue():
        raise Finding("cli", f"gimlet-tvm {' '.join(argv)} exited with {code}: {err.getvalue()[-500:]}")
    return code


def _check_files(folder: str, expected: set[str]) -> None:
    extra = sorted(set(os.listdir(folder)) - expected)
    if extra:
        raise Finding("leftover", f"files left behind: {extra}")


def _seed_inputs(seed: str) -> dict[str, np.ndarray]:
    """Inputs for a seed model: symbolic dims 2, indices within range (the tables have 10 rows)."""
    rng = np.random.default_rng(0)
    model = SEEDS[seed]()
    arrays = {}
    for info in model.graph.input:
        tensor_type = info.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if dtype.kind == "f":
            arrays[info.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            arrays[info.name] = rng.integers(0, 2, shape).astype(dtype)
        else:
            arrays[info.name] = rng.integers(0, 10, shape).astype(dtype)
    return arrays


def _check_against_reference(model, onnx_bytes: bytes, inputs: dict | None) -> None:
    """Run `model` (inputs: given, else random for its interface) and compare its outputs with
    onnxruntime's on the same ONNX model; where onnxruntime refuses the model or the inputs,
    our result goes unchecked."""
    if inputs is None:
        sizes = [math.prod(d if isinstance(d, int) else 2 for d in spec.shape) for spec in model.inputs]
        if any(size > MAX_RUN_ELEMENTS or size < 0 for size in sizes):
            return
        inputs = dict(zip(model.input_names, random_inputs(model.io, dims={d: 2 for s in model.inputs
                                                                           for d in s.shape})))
    ours = model.run(inputs)
    try:
        reference = onnxruntime_session(onnx.load_from_string(onnx_bytes), 1).run(None, inputs)
    except Exception:
        return
    for (name, got), want in zip(ours.items(), reference):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise Finding("wrong", f"output {name}: {got.dtype}{list(got.shape)}, onnxruntime "
                                   f"{want.dtype}{list(want.shape)}")
        if not np.allclose(got, want, equal_nan=True, **TOLERANCE):
            raise Finding("wrong", f"output {name} differs from onnxruntime's (max abs diff "
                                   f"{np.nanmax(np.abs(got.astype(float) - want.astype(float)))})")


def _serve(conn, workdir: str) -> None:
    """The worker's loop: a request is ("prepare",) or ("case", Case); answers go back on `conn`.
    Its stdout and stderr (TVM's C++ log lines too) go to `workdir/worker.log`."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, hard))
    log = os.open(os.path.join(workdir, "worker.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    checker = Checker(workdir)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request[0] == "prepare":
            conn.send(checker.prepare())
        else:
            conn.send(checker.run(request[1]))


class Worker:
    """A worker process; `run` answers a case's outcome, turning the worker's death into a
    "crash" and its silence past `timeout` into a "hang" (and starting a new worker)."""

    def __init__(self, workdir: str, timeout: float = TIMEOUT):
        self.workdir = workdir
        self.timeout = timeout
        self._process = None
        self._conn = None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self.workdir), daemon=True)
        self._process.start()
        child.close()

    def _ask(self, timeout: float):
        if not self._conn.poll(timeout):
            self.close()
            raise TimeoutError
        try:
            return self._conn.recv()
        except EOFError:
            self._process.join(5)
            code = self._process.exitcode
            self._process = None
            raise ChildProcessError(_death(code)) from None

    def prepare(self) -> dict[str, str]:
        if self._process is None:
            self._start()
        self._conn.send(("prepare",))
        return self._ask(20 * self.timeout)

    def run(self, case: Case) -> Outcome:
        if self._process is None:
            self._start()
        start = os.path.getsize(self._log()) if os.path.exists(self._log()) else 0
        try:
            self._conn.send(("case", case))
            return self._ask(self.timeout)
        except BrokenPipeError:  # it died before the case: report that death
            self._process.join(5)
            code, self._process = self._process.exitcode, None
            return Outcome("crash", f"{_death(code)}{self._log_tail(start)}")
        except TimeoutError:
            return Outcome("hang", f"no answer within {self.timeout:.0f} s")
        except ChildProcessError as err:
            return Outcome("crash", f"{err}{self._log_tail(start)}")

    def _log(self) -> str:
        return os.path.join(self.workdir, "worker.log")

    def _log_tail(self, start: int = 0) -> str:
        try:
            with open(self._log(), "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace").strip()
        except OSError:
            return ""
        return f"; its last output: {text[-800:]}" if text else ""

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        self._process = None


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        return f"worker killed by signal {-code}"
    return f"worker exited with code {code}"


# ---- making cases, the corpus, the driver ------------------------------------------------------

def seed_payloads(paths: dict[str, str]) -> dict[str, dict[str, bytes]]:
    """Each stage's unmutated input per seed model."""
    models = {name: make().SerializeToString() for name, make in SEEDS.items()}
    artifacts = {name: Path(paths[name]).read_bytes() for name in SEEDS}
    npz = {name: _npz(_seed_inputs(name)) for name in SEEDS}
    records = {RECORDS_SEED: json.dumps({f.name: f.read_text() for f in Path(paths["records"]).iterdir()
                                         if not f.name.startswith(".")}).encode()}
    return {"build": models, "compile": models, "load": artifacts, "run": npz, "call": npz,
            "records": records}


def round_cases(seeds: dict[str, dict[str, bytes]], round_index: int, master_seed: int,
                include_known: bool = False) -> list[Case]:
    """One round: every mutator of every stage once, on the seeds in turn (the next one where a
    mutator has nothing to change in a seed)."""
    cases = []
    for stage, mutators in MUTATORS.items():
        names = sorted(seeds[stage])
        for number, (mutator, mutate) in enumerate(mutators.items()):
            rng = np.random.default_rng([master_seed, round_index, len(cases)])
            for shift in range(len(names)):
                seed = names[(round_index + number + shift) % len(names)]
                if (stage, mutator, seed) in KNOWN and not include_known:
                    continue
                payload = mutate(seeds[stage][seed], rng)
                if payload is not None:
                    cases.append(Case(stage, seed, mutator, payload))
                    break
    return cases


def save_finding(corpus: Path, case: Case, outcome: Outcome) -> Path:
    """Save the case's input as `HASH.EXT.gz` (gzipped) and `HASH.case.json` beside it."""
    corpus.mkdir(parents=True, exist_ok=True)
    digest = case.digest()
    path = corpus / f"{digest}{EXTENSIONS[case.stage]}.gz"
    path.write_bytes(gzip.compress(case.payload, mtime=0))
    sidecar = {"stage": case.stage, "seed": case.seed, "mutator": case.mutator,
               "finding": outcome.status, "error": outcome.detail[:2000],
               "found": datetime.date.today().isoformat()}
    (corpus / f"{digest}.case.json").write_text(json.dumps(sidecar, indent=1) + "\n")
    return path


def corpus_cases(corpus: Path) -> list[Case]:
    """Every case saved in `corpus`, in file-name order."""
    cases = []
    for sidecar in sorted(corpus.glob("*.case.json")):
        info = json.loads(sidecar.read_text())
        digest = sidecar.name[: -len(".case.json")]
        payload = gzip.decompress((corpus / f"{digest}{EXTENSIONS[info['stage']]}.gz").read_bytes())
        cases.append(Case(info["stage"], info["seed"], info["mutator"], payload))
    return cases


@dataclasses.dataclass
class Report:
    """Counts of a run's outcomes, and its findings."""

    cases: int = 0
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)
    findings: list[tuple[Case, Outcome]] = dataclasses.field(default_factory=list)

    signatures: set[str] = dataclasses.field(default_factory=set)

    def add(self, case: Case, outcome: Outcome) -> None:
        self.cases += 1
        self.outcomes[outcome.status] = self.outcomes.get(outcome.status, 0) + 1
        if outcome.finding:
            self.findings.append((case, outcome))
            self.signatures.add(outcome.signature(case))

    def summary(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        return (f"{self.cases} cases ({counts}), {len(self.findings)} findings "
                f"({len(self.signatures)} distinct)")


def run_cases(cases: list[Case], worker: Worker, corpus: Path | None = None,
              log: Callable[[str], None] | None = None, report: Report | None = None) -> Report:
    """Run `cases`; findings are saved in `corpus` (when given) and logged as they come."""
    report = report or Report()
    for case in cases:
        outcome = worker.run(case)
        new = outcome.finding and outcome.signature(case) not in report.signatures
        report.add(case, outcome)
        if new:
            saved = f" -> {save_finding(corpus, case, outcome)}" if corpus is not None else ""
            if log is not None:
                log(f"FINDING {case.stage}/{case.mutator} on {case.seed}: {outcome.status}: "
                    f"{outcome.detail[:300]}{saved}")
    return report


def fuzz(minutes: float, seed: int = 0, corpus: Path | None = CORPUS, include_known: bool = False,
         timeout: float = TIMEOUT, log: Callable[[str], None] = print) -> Report:
    """Rounds of cases until `minutes` have passed (the first round runs whole)."""
    deadline = time.monotonic() + minutes * 60
    report = Report()
    with tempfile.TemporaryDirectory(prefix="gimlet-fuzz-") as workdir:
        worker = Worker(workdir, timeout)
        try:
            seeds = seed_payloads(worker.prepare())
            round_index = 0
            while round_index == 0 or time.monotonic() < deadline:
                for case in round_cases(seeds, round_index, seed, include_known):
                    run_cases([case], worker, corpus, log, report)
                    if round_index and time.monotonic() >= deadline:
                        break
                round_index += 1
                log(f"[fuzz {minutes * 60 - (deadline - time.monotonic()):6.0f} s] round "
                    f"{round_index}: {report.summary()}")
        finally:
            worker.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help=f"where findings go (default {CORPUS})")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds a case may take")
    parser.add_argument("--all", action="store_true",
                        help="also the cases whose findings are known and wait for a fix: "
                             + "; ".join(f"{'/'.join(k)} ({why})" for k, why in sorted(KNOWN.items())))
    args = parser.parse_args(argv)
    report = fuzz(args.minutes, args.seed, args.corpus, args.all, args.timeout)
    print(f"done: {report.summary()}")
    for case, outcome in report.findings:
        print(f"  {case.stage}/{case.mutator} on {case.seed}: {outcome.status}: {outcome.detail[:200]}")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
