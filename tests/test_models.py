"""The model suite: valid ONNX, symbolic batch, runs in onnxruntime."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from gimlet_tvm.models import SUITE


@functools.lru_cache(maxsize=None)
def _model_bytes(name: str) -> bytes:
    return SUITE[name].build().SerializeToString()


@pytest.mark.parametrize("name", SUITE)
def test_checker_and_symbolic_batch(name: str) -> None:
    model = onnx.load_from_string(_model_bytes(name))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 17
    for value in [*model.graph.input, *model.graph.output]:
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch", value.name


@pytest.mark.parametrize("name", SUITE)
def test_runs_in_onnxruntime(name: str) -> None:
    session = ort.InferenceSession(_model_bytes(name), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(SUITE[name].example_inputs(1))
    for batch in (1, 2):
        outputs = session.run(None, SUITE[name].example_inputs(batch, seed=batch))
        for out in outputs:
            assert out.shape[0] == batch
            assert out.dtype == np.float32
            assert np.isfinite(out).all()
            assert out.std() > 0


def test_deterministic_weights() -> None:
    assert _model_bytes("mobilenet_cnn") == SUITE["mobilenet_cnn"].build().SerializeToString()
