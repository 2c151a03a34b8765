"""benchmarks/torch_models.py (models the suite does not contain, exported from torch) and
benchmarks/conv_gemm.py (layer GFLOP/s against OpenBLAS, oneDNN and onnxruntime)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gimlet_tvm
from gimlet_tvm.peers import onnxruntime_session

from .conftest import load_script

torch_models = load_script("benchmarks/torch_models.py")
conv_gemm = load_script("benchmarks/conv_gemm.py")


@pytest.mark.parametrize("name, parameters, convs", [
    ("torch_resnet18", 11_689_512, 20), ("torch_resnet50", 25_557_032, 53),
    ("torch_mobilenetv2", 3_504_872, 52)])
def test_cnns_have_torchvisions_structure(name: str, parameters: int, convs: int) -> None:
    """Parameter and Conv2d counts as torchvision documents them for these architectures."""
    make = {"torch_resnet18": lambda: torch_models.ResNet(torch_models.BasicBlock, [2, 2, 2, 2]),
            "torch_resnet50": lambda: torch_models.ResNet(torch_models.Bottleneck, [3, 4, 6, 3]),
            "torch_mobilenetv2": torch_models.MobileNetV2}[name]
    model = make()
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert sum(isinstance(m, torch_models.nn.Conv2d) for m in model.modules()) == convs


@pytest.mark.parametrize("name, parameters", [
    ("EfficientNetB0", 5_288_548), ("MobileNetV3Large", 5_483_032), ("SqueezeNet11", 1_235_496), ("ShuffleNetV2", 2_278_604),
    ("DenseNet121", 7_978_856), ("ResNeXt50", 25_028_904), ("ConvNeXtTiny", 28_589_128)])
def test_more_cnns_have_torchvisions_parameter_counts(name: str, parameters: int) -> None:
    model = getattr(torch_models.torch_cnns, name)()
    assert sum(p.numel() for p in model.parameters()) == parameters


def _small_models() -> list:
    """The exported models at test sizes: 32x32 images; BERT and GPT-2 narrow and shallow."""
    images = torch_models.models(image_size=32)
    return [
        *(model for name, model in images.items() if model.vocab is None),
        torch_models.TorchModel("torch_bert_tiny", lambda: torch_models.bert_onnx(
            hidden=32, layers=2, heads=2, intermediate=64, vocab_size=97, tokens=8),
            "input_ids", (1, 8), 97),
        torch_models.TorchModel("torch_gpt2_tiny", torch_models.gpt2_onnx, "input_ids", (1, 8), 211),
    ]


@pytest.mark.parametrize("exported", _small_models(), ids=lambda m: m.name)
def test_exported_model_matches_onnxruntime(exported, tmp_path, monkeypatch) -> None:
    """Exported once into the cache (a second call reads the file), imported and built by
    gimlet_tvm, and equal to onnxruntime on the same model."""
    monkeypatch.setenv("GIMLET_TVM_CACHE", str(tmp_path))
    model = exported.onnx()
    cached = list((tmp_path / "bench-models").iterdir())
    assert [p.suffix for p in cached] == [".onnx"]
    assert exported.onnx() == model and list((tmp_path / "bench-models").iterdir()) == cached
    inputs = exported.example_inputs()
    reference = onnxruntime_session(model, threads=1).run(None, inputs)
    ours = gimlet_tvm.build(model, "llvm")(*inputs.values())
    assert len(ours) == len(reference)
    for out, ref in zip(ours, reference):
        np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))


def _pin_threads(monkeypatch) -> None:
    """The scripts' main() sets these; monkeypatch restores them after the test."""
    for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")


def test_run_py_resolves_torch_models(tmp_path, monkeypatch) -> None:
    """`run.py --models` takes torch-exported names beside the suite's (exported into the
    cache at the benchmark's size); an unknown name is refused."""
    monkeypatch.setenv("GIMLET_TVM_CACHE", str(tmp_path))
    _pin_threads(monkeypatch)
    run = load_script("benchmarks/run.py")
    batch, model, inputs = run.model_and_inputs("torch_mobilenetv2")
    assert batch == 1 and inputs["image"].shape == (1, 3, 224, 224)
    assert [i.name for i in model.graph.input] == ["image"]
    assert len(list((tmp_path / "bench-models").glob("torch_mobilenetv2-1x3x224x224-*.onnx"))) == 1
    batch, model, inputs = run.model_and_inputs("mlp")
    assert batch == 32 and list(inputs) == [i.name for i in model.graph.input]
    with pytest.raises(SystemExit):
        run.main(["--models", "torch_resnet19"])


@pytest.mark.parametrize("conv", [(4, 9, 7, 6, 3, 2, 1, 2), (6, 5, 5, 6, 3, 1, 1, 6), (3, 8, 8, 5, 1, 1, 0, 1)],
                         ids=["grouped-stride2-odd", "depthwise", "1x1"])
def test_im2col_reference_matches_onnxruntime(conv) -> None:
    """The numpy im2col convolution (OpenBLAS's column and every engine's reference) against
    onnxruntime's Conv: grouped, strided, padded, odd sizes."""
    problem = conv_gemm.Problem("case", (), conv=conv)
    x, weights = problem.operands()
    expected = onnxruntime_session(conv_gemm.one_op_model(problem, weights), threads=1).run(None, {"x": x})[0]
    np.testing.assert_allclose(conv_gemm.im2col_conv(problem, x, weights), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(conv_gemm.reference(problem, x, weights), expected, rtol=1e-4, atol=1e-5)


def test_shapes_cover_the_networks_and_bert() -> None:
    shapes = conv_gemm.problems()
    names = [p.name for p in shapes]
    assert len(names) == len(set(names))
    assert set(conv_gemm.SELECTED) <= set(names) and set(conv_gemm.QUICK) <= set(names)
    networks = {n for p in shapes for n in p.networks}
    assert networks == {"resnet18", "resnet50", "mobilenetv2", "bert"}
    assert any(p.conv and p.conv[-1] == p.conv[0] > 1 for p in shapes)  # depthwise
    first = next(p for p in shapes if p.name == "resnet18 conv 3x224x224 k7/2 -> 64")
    assert first.out_hw == (112, 112) and first.flops == 2 * 64 * 112 * 112 * 3 * 49


def test_quick_run_end_to_end(tmp_path, monkeypatch) -> None:
    """`conv_gemm.py --quick`: every engine checked and timed on a depthwise layer (tuning
    left out with its reason), the JSON and the table written."""
    _pin_threads(monkeypatch)
    out = tmp_path / "quick.json"
    assert conv_gemm.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["peak"]["gflops"] > 0 and result["peak"]["isa"] in ("avx512", "avx2")
    (row,) = result["rows"]
    cells = row["cells"]
    assert cells["tuned"]["skipped"].startswith("not run")
    for engine in ("untuned", "selected", "openblas", "onednn", "ort"):
        assert cells[engine]["error"] is None and cells[engine]["gflops"] > 0, (engine, cells[engine])
    assert "jit_dw" in cells["onednn"]["note"]
    assert cells["selected"]["note"].startswith("selected ")


def test_unknown_shape_word_is_refused(monkeypatch) -> None:
    _pin_threads(monkeypatch)
    with pytest.raises(SystemExit):
        conv_gemm.main(["--shapes", "no-such-layer"])
