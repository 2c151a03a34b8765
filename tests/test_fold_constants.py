"""`relax_passes.fold_constants.FoldConstantsWithNumpy`: each op it folds gives the constant
TVM's FoldConstant computes, bit for bit; what it does not fold stays for FoldConstant; a
network's batch norms fold without a compiled kernel."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from gimlet_tvm import models
from gimlet_tvm.frontend import import_model
from gimlet_tvm.relax_passes import fold_constants
from gimlet_tvm.relax_passes.fold_constants import HOST_FOLDS, FoldConstantsWithNumpy

from .test_cpu_library import rand

op = relax.op


def one_op_module(make) -> tvm.IRModule:
    """`main(x)` returning (make(), x): the op on constants beside a use of the parameter."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            folded = bb.emit(make())
            out = bb.emit_output(relax.Tuple([folded, x]))
        bb.emit_func_output(out)
    return bb.get()


def folded_value(mod: tvm.IRModule) -> np.ndarray | None:
    """The function's first output as a constant, None where it is still computed."""
    bound = {b.var: b.value for block in mod["main"].body.blocks for b in block.bindings}
    value = mod["main"].body.body
    while isinstance(value, relax.Var) and value in bound:
        value = bound[value]
    value = value.fields[0]
    while isinstance(value, relax.Var) and value in bound:
        value = bound[value]
    return value.value.numpy() if isinstance(value, tvm.ir.GenericConst) else None


C = lambda *shape, seed=0: relax.const(rand(*shape, seed=seed))  # noqa: E731
POSITIVE = lambda *shape: relax.const(np.abs(rand(*shape, seed=5)) + 0.1)  # noqa: E731

CASES = {
    "relax.add": lambda: op.add(C(4, 3), C(3, seed=1)),
    "relax.subtract": lambda: op.subtract(C(4, 1), C(1, 3, seed=1)),
    "relax.multiply": lambda: op.multiply(C(5), relax.prim_value(tvm.tirx.FloatImm("float32", 0.1))),
    "relax.divide": lambda: op.divide(C(6), POSITIVE(6)),
    "relax.maximum": lambda: op.maximum(C(6), C(6, seed=1)),
    "relax.minimum": lambda: op.minimum(C(6), C(6, seed=1)),
    "relax.negative": lambda: op.negative(C(6)),
    "relax.sqrt": lambda: op.sqrt(POSITIVE(7)),
    "relax.reshape": lambda: op.reshape(C(4, 6), (3, 8)),
    "relax.permute_dims": lambda: op.permute_dims(C(2, 3, 4), [2, 0, 1]),
    "relax.expand_dims": lambda: op.expand_dims(C(3, 4), [0, 2]),
    "relax.squeeze": lambda: op.squeeze(C(3, 1, 4), [1]),
    # 40 output channels in blocks of 16: the last block padded
    "relax.layout_transform": lambda: op.layout_transform(
        C(40, 3, 3, 3), lambda o, i, h, w: (o // 16, i, h, w, o % 16), pad_value=0.0),
}


def test_every_fold_has_a_case() -> None:
    assert set(CASES) == set(HOST_FOLDS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_folds_as_fold_constant_does(name: str) -> None:
    mod = one_op_module(CASES[name])
    ours = folded_value(FoldConstantsWithNumpy()(mod))
    assert ours is not None, f"{name} was not folded"
    theirs = folded_value(relax.transform.FoldConstant()(mod))
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(ours, theirs)


def test_layout_transform_in_chunks(monkeypatch) -> None:
    """A weight larger than one chunk of indices: its leading axis a few rows at a time."""
    monkeypatch.setattr(fold_constants, "_INDEX_CHUNK", 100)
    test_folds_as_fold_constant_does("relax.layout_transform")


@pytest.mark.parametrize("make", [
    lambda: op.exp(C(4)),  # not computed exactly alike
    lambda: op.divide(relax.const(np.array([7, -7], "int32")), relax.const(np.array([2, 2], "int32"))),
], ids=["inexact", "integer-division"])
def test_leaves_other_folds_to_fold_constant(make) -> None:
    assert folded_value(FoldConstantsWithNumpy()(one_op_module(make))) is None


def test_folds_chains_through_bindings_and_keeps_variable_operands() -> None:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([3], "float32"))
    var, eps = POSITIVE(3), relax.prim_value(tvm.tirx.FloatImm("float32", 1e-5))
    with bb.function("main", [x]):
        with bb.dataflow():
            std = bb.emit(op.sqrt(bb.emit(op.add(var, eps))))
            scale = bb.emit(op.divide(C(3, seed=2), std))
            out = bb.emit_output(op.multiply(x, scale))
        bb.emit_func_output(out)
    mod = FoldConstantsWithNumpy()(bb.get())
    calls = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    assert [c.op.name for c in calls] == ["relax.multiply"]
    expected = relax.transform.FoldConstant()(bb.get())
    feed = tvm.runtime.tensor(rand(3, seed=9))
    run = lambda m: relax.VirtualMachine(tvm.compile(m, "llvm"), tvm.cpu())["main"](feed).numpy()  # noqa: E731
    np.testing.assert_array_equal(run(mod), run(expected))


def test_batch_norms_fold_without_compiled_kernels() -> None:
    """resnet_cnn's batch norms, folded into its conv weights and decomposed: nothing left on
    constants alone for FoldConstant to compile."""
    mod, _ = import_model(models.SUITE["resnet_cnn"].build())
    mod = tvm.transform.Sequential([
        relax.transform.FoldBatchnormToConv2D(), relax.transform.DecomposeOpsForInference(),
        FoldConstantsWithNumpy()])(mod)
    on_constants = []

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.args and all(
                isinstance(a, (tvm.ir.GenericConst, relax.ShapeExpr, tvm.tirx.FloatImm)) for a in expr.args):
            on_constants.append(expr.op.name)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    assert on_constants == []
