"""Weights kept quantized (`gimlet_tvm.llm.quantization`): the split block arrays mean what
GGUF's blocks mean, bit for bit; a model's linear layers are all swapped; small random Llama
and GPT-2 models quantized on load, and SmolLM2's Q4_1 GGUF taken as it is, generate the
greedy tokens of a float32 transformers model with the same (dequantized) weights, with
logits close to its."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

import gimlet_tvm.llm as gllm  # noqa: E402
from gimlet_tvm.llm import quantization as quant  # noqa: E402
from gimlet_tvm.llm.compile import compile_llm  # noqa: E402
from gimlet_tvm.llm.config import LLMConfig  # noqa: E402
from gimlet_tvm.llm.families import FAMILIES  # noqa: E402
from gimlet_tvm.llm.families.base import WeightSource  # noqa: E402
from gimlet_tvm.llm.weights import Checkpoint, open_checkpoint  # noqa: E402
from tests.llm_models import SMOLLM2_GGUF, random_model, smollm2_reference  # noqa: E402

NEW_TOKENS = 32
PROMPT = [1, 17, 42, 99, 3, 250, 7]


def _blocks(rows: int, cols: int, kind: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Random weights in GGUF blocks, with a constant row and a row of zeros among them."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, cols), dtype=np.float32) * rng.uniform(0.01, 3, (rows, 1))
    weights[0], weights[1] = 0.25, 0
    return gguf.quants.quantize(weights.astype(np.float32), kind)


def _dequantize_split(fmt: quant.BlockFormat, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The weights the kernels compute from the split arrays, in numpy (as gguf's dequantize
    computes them: float32 d times q, plus m)."""
    scales = arrays[quant.SCALES].astype(np.float32)[..., None]
    quants = arrays[quant.QUANTS]
    rows, blocks = scales.shape[:2]
    if fmt.per_byte == 2:  # byte j: element j (low nibble) and j + 16 (high nibble)
        halves = quants.reshape(rows, blocks, 1, quant.HALF) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (halves & np.uint8(15)).reshape(rows, blocks, quant.BLOCK).astype(np.float32)
    else:
        q = quants.reshape(rows, blocks, quant.BLOCK).astype(np.float32)
    if fmt is quant.Q4_0:
        q = q - np.float32(8)
    weights = scales * q
    if fmt.has_mins:
        weights = weights + arrays[quant.MINS].astype(np.float32)[..., None]
    return weights.reshape(rows, -1)


@pytest.mark.parametrize("fmt", [quant.Q8_0, quant.Q4_0, quant.Q4_1], ids=lambda f: f.name)
def test_split_blocks_dequantize_as_gguf(fmt: quant.BlockFormat) -> None:
    data = _blocks(6, 128, fmt.gguf_type)
    arrays = quant.split_blocks(fmt, data)
    assert arrays[quant.SCALES].shape == (6, 4) and arrays[quant.SCALES].dtype == np.float16
    assert arrays[quant.QUANTS].shape == (6, 128 // fmt.per_byte)
    assert arrays[quant.QUANTS].dtype == np.dtype(fmt.quants_dtype)
    want = gguf.quants.dequantize(data, fmt.gguf_type)
    assert np.array_equal(_dequantize_split(fmt, arrays).view(np.uint32), want.view(np.uint32))


def _checkpoint(tensors: dict[str, tuple[str, np.ndarray]], floats: dict[str, np.ndarray]) -> Checkpoint:
    """A checkpoint of raw (GGUF type, data) tensors, whose float values are `floats`."""
    config = LLMConfig(family="llama", vocab_size=8, hidden_size=64, intermediate_size=64, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=64, context_length=16, norm_eps=1e-5)
    return Checkpoint(Path("test.gguf"), config, list(tensors), floats.__getitem__, tensors.__getitem__)


def test_load_quantized_takes_stored_blocks_and_quantizes_the_rest() -> None:
    """Q4_1 tensors are taken as they are, Q4_0 ones converted exactly, float and Q8_0 ones
    quantized with gguf's rounding (transposed first when the source says so); the parts are
    joined along the output axis."""
    q41, q40, q80 = (_blocks(4, 64, kind, seed) for seed, kind in enumerate(
        (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)))
    floats = np.random.default_rng(3).standard_normal((64, 4), dtype=np.float32)  # [in, out]
    dequantized = {name: gguf.quants.dequantize(data, kind) for name, data, kind in (
        ("a", q41, GGMLQuantizationType.Q4_1), ("b", q40, GGMLQuantizationType.Q4_0),
        ("c", q80, GGMLQuantizationType.Q8_0))}
    checkpoint = _checkpoint({"a": ("Q4_1", q41), "b": ("Q4_0", q40), "c": ("Q8_0", q80),
                              "d": ("F32", floats)}, {**dequantized, "d": floats})
    arrays = quant.load_quantized("x.weight", WeightSource("a", "b", "c"), checkpoint, "q4")
    assert sorted(arrays) == ["x.weight_mins", "x.weight_quants", "x.weight_scales"]
    split = {suffix: arrays[f"x.{suffix}"] for suffix in quant.SUFFIXES}
    assert np.array_equal(split[quant.QUANTS][:4], q41.reshape(4, 2, 20)[..., 4:].reshape(4, 32))
    got = _dequantize_split(quant.Q4_1, split)
    requantized = gguf.quants.dequantize(
        gguf.quants.quantize(dequantized["c"], GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
    want = np.concatenate([dequantized["a"], dequantized["b"], requantized])
    assert np.array_equal(got, want)  # values: d * q - 8 d is +0 where d * (q - 8) may be -0

    arrays = quant.load_quantized("y.weight", WeightSource("d", transposed=True), checkpoint, "q8")
    assert sorted(arrays) == ["y.weight_quants", "y.weight_scales"]
    got = _dequantize_split(quant.Q8_0, {s: arrays[f"y.{s}"] for s in (quant.SCALES, quant.QUANTS)})
    want = gguf.quants.dequantize(gguf.quants.quantize(floats.T.copy(), GGMLQuantizationType.Q8_0),
                                  GGMLQuantizationType.Q8_0)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_quantize_module_swaps_every_linear_layer(tied: bool) -> None:
    """Every linear layer becomes Q4_1 under "q4"; the output head too, or, with tied
    embeddings, a Q8_0 copy of them (the float32 table stays)."""
    config = LLMConfig(family="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, context_length=64, norm_eps=1e-5,
                       tie_word_embeddings=tied)
    model = FAMILIES["llama"].model(config)
    quant.quantize_module(model, "q4")
    names = [name for name, _ in model.named_parameters()]
    assert not [n for n in names if n.endswith("proj.weight") or n == "lm_head.weight"]
    assert len([n for n in names if n.endswith(quant.QUANTS)]) == 4 * 2 + 1
    assert model.layers[1].mlp.down_proj.weight_quants.shape == [64, 64]
    assert model.lm_head.fmt is (quant.Q8_0 if tied else quant.Q4_1)
    assert model.embed_tokens.weight.dtype == "float32"


def _run_greedy(llm: gllm.LLM, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the logits each was chosen from, step by step through the cache."""
    seq = llm.add_sequence()
    logits = [llm.prefill([seq], [prompt])[0]]
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < NEW_TOKENS:
        logits.append(llm.decode([seq], [tokens[-1]])[0])
        tokens.append(int(np.argmax(logits[-1])))
    llm.remove_sequence(seq)
    return tokens, np.stack(logits)


def _reference_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The reference's next-token logits after the prompt and each of our tokens but the last."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return out.float().numpy()


def _assert_same_greedy(tokens: list[int], logits: np.ndarray, reference: np.ndarray) -> None:
    assert tokens == [int(t) for t in np.argmax(reference, axis=-1)]
    scale = np.abs(reference).max()
    np.testing.assert_allclose(logits, reference, rtol=1e-3, atol=1e-3 * scale)


def _requantized(weights: np.ndarray, kind: GGMLQuantizationType) -> torch.Tensor:
    """dequantize(quantize(weights)), as torch wants it."""
    blocks = gguf.quants.quantize(np.ascontiguousarray(weights), kind)
    return torch.from_numpy(gguf.quants.dequantize(blocks, kind))


@pytest.mark.parametrize("quantization", ["q8", "q4"])
def test_small_llama_quantized_on_load(quantization: str, tmp_path) -> None:
    """Every linear weight quantized from float32 at load: the same greedy tokens, and close
    logits, as the float32 model whose linear weights are dequantize(quantize(w))."""
    folder, model = random_model("llama", dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
        tie_word_embeddings=False, initializer_range=0.1), tmp_path)
    tokens, logits = _run_greedy(gllm.load(folder, quantization=quantization), PROMPT)

    kind = quant.FORMAT_OF[quantization].gguf_type
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_requantized(module.weight.numpy(), kind))
    _assert_same_greedy(tokens, logits, _reference_logits(model, PROMPT, tokens))


def test_batched_decode_matches_one_sequence_at_a_time(tmp_path) -> None:
    """Five sequences in one decode step (a tile of four rows sharing each dequantized block,
    then one row alone) give each one's logits as decoding it alone does."""
    folder, _ = random_model("llama", dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
        tie_word_embeddings=False, initializer_range=0.1), tmp_path)
    llm = gllm.load(folder, quantization="q4")
    prompts = [PROMPT[:n] for n in range(3, 8)]
    alone = []
    for prompt in prompts:
        seq = llm.add_sequence()
        llm.prefill([seq], [prompt])
        alone.append(llm.decode([seq], [11])[0])
        llm.remove_sequence(seq)
    seqs = [llm.add_sequence() for _ in prompts]
    llm.prefill(seqs, prompts)
    together = llm.decode(seqs, [11] * len(seqs))
    np.testing.assert_allclose(together, np.stack(alone), rtol=1e-4, atol=1e-4 * np.abs(together).max())


def test_other_targets_dequantize_then_multiply() -> None:
    """Off the CPU (CUDA here, compiled only) every linear layer dequantizes its weight into a
    float32 temporary and multiplies as `nn.Linear` does: the fused CPU kernel is not used."""
    config = LLMConfig(family="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                       num_heads=8, num_kv_heads=2, head_dim=8, context_length=256, norm_eps=1e-5,
                       tie_word_embeddings=True)
    kernels = compile_llm(config, "cuda", "q4").target["device_code"]["kernels"]
    dequantized = {kernel.split("_")[2] for kernel in kernels if kernel.startswith("fused_dequantize_")}
    assert dequantized == {"q4", "q8"}  # the layers, and the tied embeddings' head
    assert not [kernel for kernel in kernels if "gemv" in kernel]


def test_small_gpt2_quantized_on_load(tmp_path) -> None:
    """GPT-2 under "q4": biases in the kernel, `Conv1D` weights ([in, out]) transposed before
    quantizing, and the tied embeddings' Q8_0 copy as the output head (the float32 table
    still looked up): the greedy tokens of the float32 model with those weights."""
    folder, model = random_model("gpt2", dict(n_embd=128, n_head=4, vocab_size=256, initializer_range=0.1),
                                 tmp_path)
    tokens, logits = _run_greedy(gllm.load(folder, quantization="q4"), PROMPT)

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, transformers.pytorch_utils.Conv1D):
                module.weight.copy_(_requantized(module.weight.numpy().T, GGMLQuantizationType.Q4_1).T)
        model.lm_head.weight = torch.nn.Parameter(
            _requantized(model.lm_head.weight.numpy(), GGMLQuantizationType.Q8_0))  # unties it
    _assert_same_greedy(tokens, logits, _reference_logits(model, PROMPT, tokens))


def test_smollm2_q4_takes_the_gguf_blocks() -> None:
    """SmolLM2's Q4_1 tensors become the kernels' arrays byte for byte, and so do its Q8_0
    embeddings for the output head; the model generates the greedy tokens of the float32
    transformers model dequantized from the same file."""
    checkpoint = open_checkpoint(SMOLLM2_GGUF)
    embeddings = "model.embed_tokens.weight"
    kind, data = checkpoint.raw(embeddings)
    assert kind == "Q8_0" and checkpoint.config.tie_word_embeddings
    head = quant.load_quantized("lm_head.weight", WeightSource(embeddings), checkpoint, "q4")
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 34)
    assert np.array_equal(head["lm_head.weight_quants"].view(np.uint8), blocks[..., 2:].reshape(rows, -1))
    assert np.array_equal(head["lm_head.weight_scales"].view(np.uint8), blocks[..., :2].reshape(rows, -1))

    layer, down = "layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj.weight"
    kind, data = checkpoint.raw(down)
    assert kind == "Q4_1"
    arrays = quant.load_quantized(f"{layer}.weight", WeightSource(down), checkpoint, "q4")
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 20)
    assert np.array_equal(arrays[f"{layer}.weight_quants"], blocks[..., 4:].reshape(rows, -1))
    assert np.array_equal(arrays[f"{layer}.weight_scales"].view(np.uint8), blocks[..., 0:2].reshape(rows, -1))
    assert np.array_equal(arrays[f"{layer}.weight_mins"].view(np.uint8), blocks[..., 2:4].reshape(rows, -1))

    prompt = [504, 3575, 282, 4649, 314]
    tokens, logits = _run_greedy(gllm.load(SMOLLM2_GGUF, quantization="q4"), prompt)
    reference, _ = smollm2_reference()
    _assert_same_greedy(tokens, logits, _reference_logits(reference, prompt, tokens))
