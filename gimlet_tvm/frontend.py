"""ONNX frontend: read a model, refuse what we can't convert, import it into Relax.

The importer itself is TVM's (`tvm.relax.frontend.onnx`); this module owns everything around
it: accepting a path, a `ModelProto` or bytes, one error listing every unsupported operator,
fixing symbolic dimensions on request, and the model's `IOSpec`.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Any, Iterator, Mapping, Sequence, Union

import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from . import onnx_ops
from .carriers import carrier, is_carried
from .relax_passes.checked_shapes import CheckedShapes
from .errors import InputError, ModelImportError, ModelLoadError, UnsupportedOpError, summary
from .io_spec import Dim, IOSpec, TensorSpec
from .resources import Need, require

ModelLike = Union[str, os.PathLike, bytes, onnx.ModelProto]
InputShapes = Mapping[str, Sequence[Dim]]

# Initializers up to this many elements keep their values for shape inference (shapes are
# such small integer tensors); larger ones are passed as dims alone.
SHAPE_VALUES_UP_TO = 1024

# Handled by the importer itself rather than through its converter map.
_BUILTIN_OPS = {"Constant", "If"}
_DEFAULT_DOMAINS = {"", "ai.onnx"}


_TVM_CONVERT_MAP = onnx_frontend._get_convert_map
_OUR_CONVERTERS = onnx_ops.registry.converters_of(onnx_ops.MODULES)
_OUR_DOMAINS = onnx_ops.registry.domains_of(_OUR_CONVERTERS)  # op -> its non-default domain


def _convert_map() -> dict[str, Any]:
    """TVM's converter map with ours (`gimlet_tvm.onnx_ops`) added over it, folding constants."""
    return onnx_ops.registry.convert_map(_TVM_CONVERT_MAP(), _OUR_CONVERTERS)


@contextlib.contextmanager
def _our_converters() -> Iterator[None]:
    """The one hook into TVM's importer: while active, it converts with `_convert_map()`.

    TVM's files stay untouched; the importer looks its map up through
    `onnx_frontend._get_convert_map` for every node, so swapping that function is enough.
    """
    onnx_frontend._get_convert_map = _convert_map
    try:
        yield
    finally:
        onnx_frontend._get_convert_map = _TVM_CONVERT_MAP


def load_model(model: ModelLike) -> onnx.ModelProto:
    """Read and check an ONNX model given as a path, serialized bytes or a `ModelProto`."""
    if isinstance(model, onnx.ModelProto):
        proto = model
    elif isinstance(model, (bytes, bytearray)):
        proto = _parse(bytes(model), "the given bytes")
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise ModelLoadError(f"model file not found: {path}")
        with open(path, "rb") as f:
            proto = _parse(f.read(), path)
        # External data (weights beside the model file) is resolved relative to it.
        onnx.external_data_helper.load_external_data_for_model(proto, os.path.dirname(path))
    else:
        raise ModelLoadError(
            f"model must be a path, bytes or onnx.ModelProto, not {type(model).__name__}"
        )
    try:
        onnx.checker.check_model(proto)
    except (onnx.checker.ValidationError, ValueError) as err:  # ValueError: text that is not UTF-8
        raise ModelLoadError(f"invalid ONNX model: {summary(err)}") from None
    _check_element_types(proto.graph)
    return proto


_ELEMENT_TYPES = set(onnx.helper.get_all_tensor_dtypes())


def _check_element_types(graph: onnx.GraphProto) -> None:
    """Every declared tensor type and initializer of `graph` (subgraphs included) has an element
    type ONNX defines: the checker lets any number through, and the importer fails on it."""
    declared = [(info.name, info.type.tensor_type.elem_type)
                for info in (*graph.input, *graph.output, *graph.value_info)
                if info.type.HasField("tensor_type")]
    declared += [(tensor.name, tensor.data_type) for tensor in graph.initializer]
    for name, code in declared:
        if code not in _ELEMENT_TYPES:
            raise ModelLoadError(f"invalid ONNX model: tensor '{name}' has element type {code}, "
                                 "which ONNX does not define")
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                _check_element_types(sub)


def _parse(data: bytes, source: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as err:  # protobuf raises DecodeError or RuntimeWarning-derived errors
        raise ModelLoadError(f"not an ONNX model: {source} ({err})") from None
    if not proto.graph.node and not proto.graph.output:
        raise ModelLoadError(f"not an ONNX model: {source} (no graph)")
    return proto


def _walk_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of `graph`, including those of subgraphs (If branches, Loop bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _walk_nodes(attr.g)
            for sub in attr.graphs:
                yield from _walk_nodes(sub)


def unsupported_ops(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Op types the importer has no converter for, each with the names of its nodes."""
    converters = _convert_map()
    found: dict[str, list[str]] = {}
    for index, node in enumerate(_walk_nodes(model.graph)):
        domain = _OUR_DOMAINS.get(node.op_type)
        known_domain = node.domain == domain if domain else node.domain in _DEFAULT_DOMAINS
        if known_domain and (node.op_type in converters or node.op_type in _BUILTIN_OPS):
            continue
        op = node.op_type if node.domain in _DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}"
        found.setdefault(op, []).append(node.name or f"#{index}")
    return found


def _itemsize(elem_type: int) -> int:
    try:
        return max(1, onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize)
    except (KeyError, TypeError, ValueError):  # types numpy lacks (4-bit, float8): a byte
        return 1


def _describe(kind: str, name: str, dims: Sequence[int], elem_type: int) -> str:
    try:
        dtype = str(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        dtype = onnx.TensorProto.DataType.Name(elem_type).lower()
    return f"{kind} '{name}' {list(dims)} {dtype}"


def _without_weight_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model for shape inference: its graph, with the large initializers' dims and types
    but not their data (copying a model's weights costs seconds; inference needs none)."""
    light = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import,
                            functions=model.functions)
    graph = light.graph
    for name in ("node", "input", "output", "value_info"):
        getattr(graph, name).extend(getattr(model.graph, name))
    for tensor in model.graph.initializer:
        if math.prod(tensor.dims) <= SHAPE_VALUES_UP_TO:
            graph.initializer.append(tensor)
        else:
            graph.initializer.add(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type)
    return light


def declared_memory(model: onnx.ModelProto, activations: bool = True) -> Need:
    """What the model's declared sizes need at least (`resources.Need`), computed from shapes
    alone (nothing is allocated): its weights (initializers and Constant nodes), and with
    `activations` the largest of the steps (a node: its non-weight inputs and outputs
    together; the graph's inputs and outputs together) over the tensors whose shapes are
    static. Intermediate shapes come from ONNX shape inference."""
    graph = model.graph
    if activations:
        with contextlib.suppress(Exception):  # inference refuses some models: declared shapes then
            graph = onnx.shape_inference.infer_shapes(_without_weight_data(model)).graph
    need = Need({"weights": 0})
    weights = {t.name: t for t in graph.initializer}
    weights |= {node.output[0]: attr.t for node in graph.node if node.op_type == "Constant"
                for attr in node.attribute if attr.name == "value"}
    for name, tensor in weights.items():
        size = math.prod(tensor.dims) * _itemsize(tensor.data_type)
        need.parts["weights"] += size
        need.note(_describe("weight", name, tensor.dims, tensor.data_type), size)
    if not activations:
        return need
    sizes: dict[str, int] = {}
    for kind, infos in (("input", graph.input), ("output", graph.output), ("tensor", graph.value_info)):
        for info in infos:
            tensor_type = info.type.tensor_type
            dims = tensor_type.shape.dim
            if info.name in weights or not tensor_type.HasField("shape") or not all(d.HasField("dim_value") for d in dims):
                continue
            shape = [d.dim_value for d in dims]
            sizes[info.name] = math.prod(shape) * _itemsize(tensor_type.elem_type)
            need.note(_describe(kind, info.name, shape, tensor_type.elem_type), sizes[info.name])
    io = [info.name for info in (*graph.input, *graph.output)]
    need.add_peak(sum(sizes.get(name, 0) for name in set(io)), "the inputs and outputs")
    for node in graph.node:
        names = {name for name in (*node.input, *node.output) if name in sizes}
        need.add_peak(sum(sizes[name] for name in names),
                      f"{node.op_type} node '{node.name or node.output[0]}'")
    return need


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Graph inputs that are real inputs, not initializers listed as inputs."""
    initializers = {init.name for init in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in initializers]


def _declared_spec(info: onnx.ValueInfoProto) -> TensorSpec:
    """The spec as the model declares it; an unknown rank gives an empty shape marked `None`."""
    tensor_type = info.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
    if not tensor_type.HasField("shape"):
        return TensorSpec(info.name, None, str(dtype))  # type: ignore[arg-type]
    shape: list[Dim] = []
    for axis, dim in enumerate(tensor_type.shape.dim):
        if dim.HasField("dim_value") and dim.dim_value < 0:
            raise ModelImportError(f"'{info.name}' declares dimension {dim.dim_value} at axis {axis}; "
                                   "a dimension is 0 or more")
        if dim.HasField("dim_value"):
            shape.append(int(dim.dim_value))
        else:
            shape.append(dim.dim_param or f"{info.name}_dim{axis}")
    return TensorSpec(info.name, tuple(shape), str(dtype))


def _fix_shapes(model: onnx.ModelProto, input_shapes: InputShapes) -> onnx.ModelProto:
    """A copy of `model` whose input declarations carry the user-fixed shapes.

    Rewriting the declaration (rather than passing shapes to the importer) keeps symbolic
    dims shared: an input left alone and a partly fixed one still use the same `batch`.
    """
    inputs = {info.name: info for info in _graph_inputs(model)}
    unknown = sorted(set(input_shapes) - set(inputs))
    if unknown:
        raise InputError(
            f"input_shapes names unknown input(s) {unknown}; the model's inputs are "
            f"{list(inputs)}"
        )
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for info in fixed.graph.input:
        if info.name not in input_shapes:
            continue
        spec = _declared_spec(info)
        shape = [int(d) if str(d).isdigit() else str(d) for d in input_shapes[info.name]]
        if spec.shape is not None and (
            len(shape) != len(spec.shape)
            or any(isinstance(w, int) and w != g for w, g in zip(spec.shape, shape))
        ):
            raise InputError(
                f"input_shapes gives {info.name} shape {shape}, which does not fit the "
                f"model's {spec.describe()}"
            )
        dims = info.type.tensor_type.shape.dim
        del dims[:]
        for size in shape:
            dim = dims.add()
            if isinstance(size, int):
                dim.dim_value = size
            else:
                dim.dim_param = size
    return fixed


def _relax_dims(sinfo: relax.TensorType) -> tuple[Dim, ...] | None:
    if sinfo.shape is None or not hasattr(sinfo.shape, "values"):
        return None
    return tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in sinfo.shape.values)


def _output_specs(model: onnx.ModelProto, mod: tvm.IRModule) -> tuple[TensorSpec, ...]:
    """Output specs: names from ONNX, shapes and dtypes as Relax inferred them."""
    ret = mod["main"].ret_ty
    fields = ret.fields if isinstance(ret, relax.TupleType) else [ret]
    specs = []
    for info, sinfo in zip(model.graph.output, fields):
        declared = _declared_spec(info) if info.type.HasField("tensor_type") else None
        if isinstance(sinfo, relax.TensorType):
            dims = _relax_dims(sinfo) or (declared.shape if declared else ())
            dtype = str(sinfo.dtype)
            if declared is not None and is_carried(declared.dtype):
                if dtype != carrier(declared.dtype):
                    raise ModelImportError(
                        f"output '{info.name}' of dtype {declared.dtype} is computed as {dtype}")
                dtype = declared.dtype  # the runtime converts the carrier back
            specs.append(TensorSpec(info.name, dims, dtype))
        elif declared is not None:
            specs.append(declared)
        else:
            raise ModelImportError(f"output '{info.name}' is not a tensor; only tensor outputs are supported")
    return tuple(specs)


def import_model(
    model: onnx.ModelProto, input_shapes: InputShapes | None = None, *, runs_here: bool = True
) -> tuple[tvm.IRModule, IOSpec]:
    """Import a checked ONNX model into a Relax module (weights as constants) and its IOSpec.

    First refuses (`ResourceLimitError`) a model whose declared sizes need more memory than
    this machine has (`declared_memory`): its weights, which the compiler holds, and with
    `runs_here` (it is built for this machine's CPU) the largest step's tensors too. Every
    shape the imported graph computes at run time is checked before it sizes a tensor
    (`relax_passes.checked_shapes`)."""
    missing = unsupported_ops(model)
    if missing:
        raise UnsupportedOpError(missing)
    for info in _graph_inputs(model):
        if not info.type.HasField("tensor_type"):
            raise ModelImportError(f"input '{info.name}' is not a tensor; only tensor inputs are supported")
    if input_shapes:
        model = _fix_shapes(model, input_shapes)
    require(declared_memory(model, activations=runs_here), f"the model '{model.graph.name}'")
    inputs = [_declared_spec(info) for info in _graph_inputs(model)]
    for spec in inputs:
        if spec.shape is None:
            raise ModelImportError(
                f"input '{spec.name}' has no declared shape; give it with input_shapes"
            )
    lowered = onnx_ops.carried.lower(model)
    with warnings.catch_warnings(), _our_converters():
        warnings.simplefilter("ignore")
        try:
            mod = onnx_frontend.from_onnx(
                lowered,
                dtype_dict={spec.name: carrier(spec.dtype) for spec in inputs},
                keep_params_in_input=False,
            )
        except Exception as err:  # a converter can fail with any error type: name it
            raise ModelImportError(f"ONNX import failed: {summary(err)}") from err
    mod = CheckedShapes()(mod)
    return mod, IOSpec(tuple(inputs), _output_specs(model, mod))
