"""The LLM's dequantizing GEMV as a kernel-selection op group ("dequant_gemv"): found by the
mark on its PrimFunc, with per-operand dtypes and a rows-generic signature; its float64
reference is GGUF's dequantization times x; the shipped TIR kernel is the verified baseline;
kernel generators are offered it and their C kernels are verified (a right one accepted, wrong
ones rejected); an LLM built with an accepted kernel decodes as without."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import tvm
from tvm.relax.frontend import nn

import gimlet_tvm.llm as gllm
from gimlet_tvm.compiler import resolve_target
from gimlet_tvm.llm import quantization as quant
from gimlet_tvm.llm.compile import compile_llm, llm_module
from gimlet_tvm.llm.kernel_selection import select_llm_kernels
from gimlet_tvm.llm.weights import open_checkpoint
from gimlet_tvm.llm.quantization import QuantizedLinear
from gimlet_tvm.schedules.kernel_selection.candidates import OpSignature
from gimlet_tvm.schedules.kernel_selection.choices import KernelSelection, OpChoice
from gimlet_tvm.schedules.kernel_selection.op_kinds import OP_KINDS
from gimlet_tvm.schedules.kernel_selection.sources import candidates
from gimlet_tvm.schedules.tuning.records import target_key
from gimlet_tvm.selection.generator import Generator, generate, task
from gimlet_tvm.selection.json_schema import protocol_errors
from gimlet_tvm.selection.select import op_signatures
from gimlet_tvm.selection.verify import run_candidate

from .llm_models import SMOLLM2_GGUF, random_model
from .test_kernel_generators import scripted
from .test_llm_quantization import PROMPT, _assert_same_greedy, _reference_logits, _requantized, _run_greedy


class _Linear(nn.Module):
    def __init__(self, fmt: quant.BlockFormat, n: int, k: int, bias: bool) -> None:
        super().__init__()
        self.lin = QuantizedLinear(k, n, fmt, bias)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.lin(x)


def linear_module(fmt: quant.BlockFormat, n: int, k: int, bias: bool) -> tvm.IRModule:
    """A Relax module of one `QuantizedLinear` in decode (x [rows, 1, k], rows symbolic)."""
    _, target = resolve_target("llvm")
    with target:
        mod, _ = _Linear(fmt, n, k, bias).export_tvm(
            spec={"forward": {"x": nn.spec.Tensor(["rows", 1, k], "float32")}})
    return mod


def _request(sig: OpSignature, target, **more) -> dict:
    return {"signature": sig.to_json(), "target": json.loads(str(target)), "external_dir": None,
            "records": None, "min_repeat_ms": 1, **more}


@pytest.mark.parametrize("fmt,bias", [(quant.Q8_0, False), (quant.Q4_1, True)], ids=["q8_0", "q4_1_bias"])
def test_dequant_gemv_groups_are_found_by_their_mark(fmt, bias):
    """A QuantizedLinear's decode call is one dequant_gemv group (rows generic: 1 in the
    signature), its operands of their own dtypes, the signature round-tripping through JSON;
    the same call_tir of a PrimFunc without the mark is no group."""
    _, target = resolve_target("llvm")
    mod = linear_module(fmt, 64, 96, bias)
    ((sig, count),) = op_signatures(mod, target).items()
    blocks = (64, 3)
    mins = [blocks] if fmt.has_mins else []
    assert count == 1 and sig.op == "dequant_gemv"
    assert sig.shapes == ((1, 1, 96), blocks, *mins, (64, 96 // fmt.per_byte), *([(64,)] if bias else []))
    assert sig.operand_dtypes == ("float32", "float16", *["float16"] * len(mins), fmt.quants_dtype,
                                  *(["float32"] if bias else []))
    assert sig.key == f"dequant_gemv float32 rowsx1x96 @ 64x96^T {fmt.name.lower()}" + (" +bias" if bias else "")
    assert OpSignature.from_json(json.loads(json.dumps(sig.to_json()))) == sig
    assert [c.id for c in candidates(sig, target)] == ["generated:tir"]
    unmarked = tvm.IRModule({g: (f.without_attr("gimlet.op_group") if isinstance(f, tvm.tirx.PrimFunc) else f)
                             for g, f in mod.functions_items()})
    assert op_signatures(unmarked, target) == {}


@pytest.mark.parametrize("fmt", [quant.Q8_0, quant.Q4_1], ids=lambda f: f.name)
def test_reference_is_gguf_dequantization_times_x(fmt):
    """The op's float64 reference computes x @ W^T + bias with W as gguf dequantizes the
    blocks the arrays were split from; its input sets cover each quant dtype's whole range and
    zero, negative, tiny and large scales."""
    rng = np.random.default_rng(0)
    n, k = 40, 96
    blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), fmt.gguf_type)
    arrays = quant.split_blocks(fmt, blocks)
    x, bias = rng.standard_normal((3, 1, k)), rng.standard_normal(n)
    operands = [x, arrays[quant.SCALES], *([arrays[quant.MINS]] if fmt.has_mins else []), arrays[quant.QUANTS], bias]
    sig = OpSignature("dequant_gemv", tuple(np.shape(a) for a in operands), "float32",
                      attrs=(("bits", 8.0 if fmt is quant.Q8_0 else 4.0), ("bias", 1.0)))
    want = x[:, 0, :] @ gguf.quants.dequantize(blocks, fmt.gguf_type).astype(np.float64).T + bias
    np.testing.assert_allclose(sig.reference(*operands)[:, 0, :], want, rtol=1e-12, atol=1e-12)
    sets = OpSignature("dequant_gemv", ((1, 1, k), *sig.shapes[1:]), "float32", attrs=sig.attrs).input_sets(rng)
    quants = sets["random"][-2]
    info = np.iinfo(fmt.quants_dtype)
    assert quants.min() == info.min and quants.max() == info.max
    scales = np.concatenate([s[1].ravel() for s in sets.values()])
    assert (scales == 0).any() and (scales < 0).any() and np.abs(scales[scales != 0]).min() < 1e-5
    assert np.abs(scales).max() > 100
    assert OP_KINDS["dequant_gemv"].variants(sig.shapes)[0][0] == (7, 1, k)


def test_the_shipped_kernel_is_the_verified_baseline():
    """The generated candidate keeps the shipped TIR kernel; verification checks it at one
    row, at an odd row count and at edge sizes (37 outputs, 3 blocks) and times it."""
    _, target = resolve_target("llvm")
    ((sig, _),) = op_signatures(linear_module(quant.Q4_1, 64, 96, True), target).items()
    outcome = run_candidate(_request(sig, target, candidate="generated:tir"), 120)
    assert outcome.verified, outcome.reason
    assert len(outcome.checks) == 3 and "37x96^T" in outcome.checks[2]


def test_generators_are_offered_the_group_and_a_right_c_kernel_is_accepted(tmp_path):
    """The task of a Q8_0 GEMV states its block layout, dtypes and C interface (the row count
    first), valid against the schema, its numpy expression computing the reference; of three
    C kernels the right one is verified (guard pages and poisons with rows, 1 and 7 rows) and
    the ones that ignore the scales or read the quants as unsigned are wrong results."""
    _, target = resolve_target("llvm")
    ((sig, _),) = op_signatures(linear_module(quant.Q8_0, 64, 96, True), target).items()
    made = task(sig, target, 1, 1, None, [])
    assert protocol_errors(made, "task") == [] and made["formats"] == ["c", "tvmscript"]
    assert made["group"]["dequant_gemv"]["format"] == "q8_0" and made["group"]["dequant_gemv"]["rows_checked"] == [1, 7]
    assert "w = d * q" in made["group"]["dequant_gemv"]["block"]
    assert made["group"]["dtypes"] == ["float32", "float16", "int8", "float32"]
    assert ("void kernel(int64_t rows, const float *x, const uint16_t *scales, const int8_t *quants, "
            "const float *bias, float *out)") in made["interface"]["c"]
    assert "x[rows][1][96], scales[64][3] float16, quants[64][96] int8, bias[64], out[rows][1][64]" in made[
        "interface"]["c"]
    operands = sig.cast(sig.input_sets(np.random.default_rng(5))["random"])
    names = dict(zip(("x", "scales", "quants", "bias"), operands))
    got = eval(made["reference"]["numpy"], {"np": np}, names)  # noqa: S307
    np.testing.assert_allclose(got, sig.reference(*operands), rtol=1e-12, atol=1e-12)

    directory = str(tmp_path)
    tried = []
    rounds = generate(sig, target, Generator(scripted("gemv+gemvnoscale+gemvunsigned"), rounds=1), directory,
                      lambda cid: run_candidate(_request(sig, target, candidate=cid, generated_dir=directory), 120),
                      tried, lambda line: None)
    assert not rounds[0].failure, rounds
    outcomes = {t.id.split(":")[1].split("_")[0]: t for t in tried}
    assert outcomes["gemv"].verified, outcomes["gemv"].reason
    for wrong in ("gemvnoscale", "gemvunsigned"):
        assert outcomes[wrong].verdict == "wrong result", outcomes[wrong].reason


def test_llm_built_with_a_generated_gemv_decodes_as_the_reference(tmp_path):
    """A small Q8_0 Llama's decode GEMV groups as the LLM module has them; a generator's C
    kernel for the output head's (decode's and prefill's logits), verified and stored as the winner in
    a records directory, is built into the LLM by `load(..., records=DIR)`, which then decodes
    the greedy tokens, with close logits, of the float32 transformers model whose weights are
    dequantize(quantize(w)) (as the build without a selection does:
    test_llm_quantization.test_small_llama_quantized_on_load)."""
    folder, model = random_model("llama", dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
        tie_word_embeddings=False, initializer_range=0.1), tmp_path / "model")
    _, target = resolve_target("llvm")
    mod, _ = llm_module(open_checkpoint(folder).config, target, "q8")
    sigs = op_signatures(mod, target)
    # query/key/value, output, gate/up, down projections and the head
    assert sorted((s.shapes[1][0], s.shapes[0][2]) for s in sigs) == [(128, 128), (128, 256), (192, 128),
                                                                       (256, 128), (512, 128)]
    records, directory = tmp_path / "records", str(tmp_path / "records" / "generated_kernels")
    choices = {}
    for sig in sigs:
        if sig.shapes[1][0] != 256:
            continue  # the layers keep the shipped kernel
        tried = []
        generate(sig, target, Generator(scripted("gemv"), rounds=1), directory,
                 lambda cid, sig=sig: run_candidate(_request(sig, target, candidate=cid, generated_dir=directory),
                                                    120), tried, lambda line: None)
        (made,) = tried
        assert made.verified, made.reason
        choices[sig.key] = OpChoice(sig, tried, made.id)
    KernelSelection(target_key(target), choices, generated_dir=directory).save(records)

    compiled = compile_llm(open_checkpoint(folder).config, "llvm", "q8", records)
    for choice in choices.values():
        assert compiled.module.implements_function(f"generator_{choice.winner.split(':')[1]}", True)
    tokens, logits = _run_greedy(gllm.LLM(compiled, open_checkpoint(folder), None), PROMPT)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_requantized(module.weight.numpy(), quant.Q8_0.gguf_type))
    _assert_same_greedy(tokens, logits, _reference_logits(model, PROMPT, tokens))


@pytest.mark.slow
def test_smollm2_decode_gemvs_are_selected_with_a_generator_and_applied(tmp_path):
    """SmolLM2-135M at Q8_0: `select_llm_kernels` finds its five decode GEMV shapes (hidden
    576, intermediate 1536, the 49152-row head), verifies the shipped kernel and the scripted
    generator's C kernel at each and stores the winners; the LLM loaded with those records
    generates the greedy tokens it generates without them."""
    _, target = resolve_target("llvm")
    selection = select_llm_kernels(SMOLLM2_GGUF, "llvm", "q8", records=tmp_path,
                                   generator=Generator(scripted("gemv"), rounds=1))
    sizes = sorted((c.signature.shapes[1][0], c.signature.shapes[0][2]) for c in selection.choices.values())
    assert sizes == [(576, 576), (576, 1536), (960, 576), (3072, 576), (49152, 576)]
    for choice in selection.choices.values():
        verified = {t.id.split(":")[0] for t in choice.tried if t.verified}
        assert verified == {"generated", "generator"}, choice.tried
    assert KernelSelection.load(tmp_path, target).choices.keys() == selection.choices.keys()
    tokens, _ = _run_greedy(gllm.load(SMOLLM2_GGUF, quantization="q8", records=tmp_path), [504, 3575, 282, 4649, 314])
    want, _ = _run_greedy(gllm.load(SMOLLM2_GGUF, quantization="q8"), [504, 3575, 282, 4649, 314])
    assert tokens == want


@pytest.mark.slow  # ~2 min: the shipped kernel verified at five shapes, then the LLM built
def test_select_cli_chooses_an_llms_decode_kernels(cli, tmp_path):
    """`gimlet-tvm select MODEL -q q8 --records DIR` on a small Llama: a table per decode GEMV
    shape, each with the shipped kernel verified and winning, stored in DIR, and the LLM
    builds with it; an LLM selection refuses the ONNX-only options."""
    folder, _ = random_model("llama", dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
        tie_word_embeddings=False, initializer_range=0.1), tmp_path / "model")
    code, out, err = cli("select", str(folder), "-q", "q8", "--records", str(tmp_path / "records"))
    assert code == 0, err
    assert out.count("winner: generated:tir") == 5, out
    assert "dequant_gemv float32 rowsx1x128 @ 256x128^T q8_0" in out and "the LLM builds with the selection" in out
    assert len(KernelSelection.load(tmp_path / "records", resolve_target("llvm")[1]).choices) == 5
    code, _, err = cli("select", str(folder), "-q", "q8", "--records", str(tmp_path / "r2"), "--kernels", "x")
    assert code != 0 and "an LLM's kernels are selected on this machine" in err
