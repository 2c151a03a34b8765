"""The fuzzer's mutators (`tests/fuzz.py`): per stage, functions that take a seed's input (an
ONNX model, an artifact, an `.npz` of inputs, a tuning-records directory as JSON) and a random
generator, and return a broken variant of it, or None where they have nothing to change in that
seed."""

from __future__ import annotations

import io
import json
import struct
from typing import Any, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from gimlet_tvm.runtime.artifact import MAGIC
from gimlet_tvm.schedules.tuning.records import RECORD_FILE, TASKS_FILE, WORKLOAD_FILE

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


def model_bad_attribute(data: bytes, rng: np.random.Generator) -> bytes | None:
    """An integer attribute (axis, pads, strides, kernel shape, ...) set to 0, a negative or a
    huge value, or its list emptied or lengthened; or an attribute no op has."""
    model = _proto(data)
    nodes = _all_nodes(model.graph)
    node = nodes[int(rng.integers(len(nodes)))]
    values = [0, -1, -7, 3, 1 << 31, -(1 << 40)]
    attrs = [a for a in node.attribute if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS)]
    if not attrs or rng.random() < 0.15:
        node.attribute.append(helper.make_attribute("no_such_attribute", 1))
        return model.SerializeToString()
    attr = attrs[int(rng.integers(len(attrs)))]
    value = values[int(rng.integers(len(values)))]
    if attr.type == onnx.AttributeProto.INT:
        attr.i = value
    elif rng.random() < 0.15:
        del attr.ints[:]
    elif rng.random() < 0.15:
        attr.ints.extend([value] * 3)
    else:
        attr.ints[int(rng.integers(len(attr.ints)))] = value
    return model.SerializeToString()


def model_other_op(data: bytes, rng: np.random.Generator) -> bytes:
    """A node's op type replaced by another (its inputs, outputs and attributes kept)."""
    model = _proto(data)
    nodes = _all_nodes(model.graph)
    ops = ["Relu", "Gemm", "MatMul", "Conv", "MaxPool", "Softmax", "Gather", "Reshape", "If",
           "Loop", "Add", "Concat", "Split", "Transpose", "Flatten", "Identity", "Pad", "Resize"]
    nodes[int(rng.integers(len(nodes)))].op_type = ops[int(rng.integers(len(ops)))]
    return model.SerializeToString()


MODEL_MUTATORS: dict[str, Callable] = {
    "truncate": _truncate,
    "bitflip": _flip_bits,
    "wrong_dtype": model_wrong_dtype,
    "dangling_edge": model_dangling_edge,
    "huge_shape": model_huge_shape,
    "cycle": model_cycle,
    "deep_subgraph": model_deep_subgraph,
    "bad_attribute": model_bad_attribute,
    "other_op": model_other_op,
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


def npz_of(arrays: dict[str, np.ndarray]) -> bytes:
    """Arrays as the bytes of an `.npz` file."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def arrays_of(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of an `.npz` file's bytes."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def _change_array(data: bytes, rng: np.random.Generator, change: Callable) -> bytes | None:
    arrays = arrays_of(data)
    name = sorted(arrays)[int(rng.integers(len(arrays)))]
    changed = change(arrays[name], rng)
    if changed is None:
        return None
    arrays[name] = changed
    return npz_of(arrays)


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
    arrays = arrays_of(data)
    arrays.pop(sorted(arrays)[int(rng.integers(len(arrays)))])
    return npz_of(arrays)


def inputs_extra(data: bytes, rng: np.random.Generator) -> bytes:
    return npz_of(dict(arrays_of(data), bogus=np.zeros(3, np.float32)))


def inputs_object_array(data: bytes, rng: np.random.Generator) -> bytes:
    """An object array (pickled in the .npz), which a reader must refuse to unpickle."""
    arrays: dict[str, Any] = arrays_of(data)
    name = sorted(arrays)[0]
    arrays[name] = np.array([{"a": 1}, None], dtype=object)
    return npz_of(arrays)


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
    arrays = arrays_of(data)
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
