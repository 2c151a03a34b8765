"""LLMs on the CPU against Hugging Face transformers (float32, the same weights): SmolLM2-135M
from its real GGUF, and random-weight models of every family built from small configs."""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import gimlet_tvm.llm as gllm  # noqa: E402
from gimlet_tvm.errors import LLMError, ResourceLimitError, WeightsError  # noqa: E402
from gimlet_tvm.llm.compile import compile_llm, load_compiled  # noqa: E402
from gimlet_tvm.llm.config import LLMConfig  # noqa: E402
from tests.llm_models import SMOLLM2_GGUF, random_model, reference_greedy, smollm2_reference  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def smollm2():
    return gllm.load(SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def reference():
    return smollm2_reference()


def test_smollm2_greedy_tokens_equal_transformers(smollm2, reference):
    model, tokenizer = reference
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        ours = smollm2.generate(ids, max_new_tokens=64)
        want = reference_greedy(model, ids, 64, eos=smollm2.tokenizer.eos_token_ids)
        assert ours.token_ids == want, prompt
        assert ours.text == tokenizer.decode(want, skip_special_tokens=True)


def test_smollm2_logits_match_along_a_sequence(smollm2, reference):
    """Prefill and 24 decode steps, teacher-forced along transformers' own greedy tokens."""
    model, tokenizer = reference
    ids = tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    seq = smollm2.add_sequence()
    try:
        logits = smollm2.prefill([seq], [ids])[0]
        for step, token in enumerate(tokens):
            np.testing.assert_allclose(logits, out.logits[step][0].numpy(), atol=1e-3, rtol=0,
                                       err_msg=f"step {step}")
            logits = smollm2.decode([seq], [token])[0]
    finally:
        smollm2.remove_sequence(seq)


def test_smollm2_text_chat_and_stream(smollm2):
    result = smollm2.generate("The capital of France is", max_new_tokens=8)
    assert "Paris" in result.text and result.prompt_tokens == 5 and result.decode_tokens_per_s > 0
    pieces = smollm2.stream("The capital of France is", max_new_tokens=8)
    assert "".join(pieces) == result.text
    answer = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=16)
    assert "Paris" in answer.text and answer.finish_reason == "stop"
    stopped = smollm2.generate("The capital of France is", max_new_tokens=8, stop=["."])
    assert stopped.text == " Paris" and stopped.finish_reason == "stop"


def test_batch_equals_one_at_a_time_and_popn_rolls_back(smollm2, reference):
    _, tokenizer = reference
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    batch = smollm2.generate_batch(prompts, max_new_tokens=12)
    for ids, together in zip(prompts, batch):
        assert together.token_ids == smollm2.generate(ids, max_new_tokens=12).token_ids
    # pop-n: decode 3 tokens, roll them back, decode again: the same logits.
    seq = smollm2.add_sequence()
    try:
        first = smollm2.prefill([seq], [prompts[0]])[0]
        after = [smollm2.decode([seq], [t])[0] for t in (10, 20, 30)]
        smollm2.popn(seq, 3)
        assert smollm2.sequence_length(seq) == len(prompts[0])
        again = [smollm2.decode([seq], [t])[0] for t in (10, 20, 30)]
        np.testing.assert_allclose(np.array(again), np.array(after), atol=1e-5)
        assert np.isfinite(first).all()
    finally:
        smollm2.remove_sequence(seq)


def test_bad_requests_are_typed_errors_and_the_model_still_serves(smollm2):
    vocab = smollm2.config.vocab_size
    for prompt, match in (([vocab], "outside the vocabulary"), ([-1], "outside the vocabulary"),
                          ("", "empty"), ([], "empty"),
                          ([1] * smollm2.context_window, "context window")):
        with pytest.raises(LLMError, match=match):
            smollm2.generate(prompt, max_new_tokens=4)
    with pytest.raises(LLMError, match="temperature"):
        smollm2.generate("Hi", temperature=-1)
    with pytest.raises(LLMError, match="max_batch_size"):
        smollm2.generate_batch(["Hi"] * (smollm2.max_batch_size + 1), max_new_tokens=2)
    assert "Paris" in smollm2.generate("The capital of France is", max_new_tokens=4).text


@pytest.mark.parametrize("family,options", [
    ("llama", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
    ("llama", dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=48, intermediate_size=80, vocab_size=257,
                   rope_theta=500000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    ("llama", dict(num_attention_heads=4, num_key_value_heads=2,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})),
    ("mistral", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None)),
    ("qwen2", dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)),
    ("gpt2", dict(n_head=4, vocab_size=211)),
])
def test_random_models_of_each_family_match_transformers(family, options, tmp_path):
    folder, model = random_model(family, options, tmp_path)
    llm = gllm.load(folder)
    ids = [3, 17, 42, 99, 5, 150, 7]
    got = llm.generate(ids, max_new_tokens=24)
    assert got.token_ids == reference_greedy(model, ids, 24)
    seq = llm.add_sequence()
    logits = llm.prefill([seq], [ids])[0]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=0)


def test_compiled_architecture_serves_other_weights(tmp_path):
    """Export once, load with another checkpoint of the same architecture; a different
    architecture is refused, naming the difference."""
    options = dict(num_attention_heads=4, num_key_value_heads=2)
    first, _ = random_model("llama", options, tmp_path / "a", seed=1)
    second, model = random_model("llama", options, tmp_path / "b", seed=2)
    gllm.load(first).export_compiled(tmp_path / "llama.so")
    assert load_compiled(tmp_path / "llama.so").config.num_kv_heads == 2
    other = gllm.load(second, compiled=tmp_path / "llama.so")
    ids = [5, 6, 7, 8]
    assert other.generate(ids, max_new_tokens=12).token_ids == reference_greedy(model, ids, 12)
    wider, _ = random_model("llama", dict(options, num_key_value_heads=4), tmp_path / "c")
    with pytest.raises(WeightsError, match="different architecture"):
        gllm.load(wider, compiled=tmp_path / "llama.so")


def test_bad_checkpoints_are_typed_errors(tmp_path):
    truncated = tmp_path / "cut.gguf"
    with open(SMOLLM2_GGUF, "rb") as f:
        truncated.write_bytes(f.read(5_000_000))
    with pytest.raises(WeightsError, match="cut.gguf"):
        gllm.load(truncated)
    folder, _ = random_model("llama", dict(num_attention_heads=4, num_key_value_heads=2), tmp_path / "m")
    shard = next(folder.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(WeightsError, match="truncated"):
        gllm.load(folder)
    (folder / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(WeightsError, match="supported: llama, mistral, qwen2, gpt2"):
        gllm.load(folder)
    with pytest.raises(WeightsError, match="no model"):
        gllm.load(tmp_path / "missing")


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    folder, model = random_model("llama", dict(num_attention_heads=4, num_key_value_heads=2), tmp_path)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :-1].contiguous()
    for shard in folder.glob("*.safetensors"):
        shard.unlink()
    safetensors.torch.save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightsError, match="model.layers.1.mlp.down_proj.weight"):
        gllm.load(folder)


def test_cli_generate_streams_and_reports_timings(cli):
    code, out, err = cli("generate", SMOLLM2_GGUF, "--prompt", "The capital of France is",
                         "--max-new-tokens", "6")
    assert code == 0, err
    assert "Paris" in out and "tokens/s" in out.splitlines()[-1]
    code, out, err = cli("chat", SMOLLM2_GGUF, "--max-new-tokens", "16",
                         input="What is the capital of France?\n")
    assert code == 0 and "Paris" in out, err
    code, _, err = cli("generate", SMOLLM2_GGUF, "--prompt", "Hi", "--temperature", "-2")
    assert code == 2 and "temperature" in err


def test_cuda_build_compiles_and_checks_the_kv_cache_kernels(tmp_path):
    """The CUDA target goes through the same path: TVM's GPU attention kernels for the KV
    cache, compiled by nvcc and read back from the fatbin (no GPU here to run them)."""
    config = LLMConfig(family="llama", vocab_size=300, hidden_size=64, intermediate_size=96,
                       num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, context_length=256,
                       norm_eps=1e-5)
    compiled = compile_llm(config, "cuda")
    code = compiled.target["device_code"]
    assert code["checked_with"] == "cuobjdump" and "fatbin" in code["format"]
    for kernel in ("batch_decode_paged_kv_kernel", "batch_prefill_ragged_kv_kernel",
                   "tir_kv_cache_transpose_append_kernel", "fused_rope_kernel"):
        assert kernel in code["kernels"]
    compiled.export(tmp_path / "llama-cuda.so")
    assert load_compiled(tmp_path / "llama-cuda.so").runtime.device_type == "cuda"


def test_a_model_too_big_for_memory_is_refused_before_compiling(monkeypatch):
    """Weights and KV cache sized from the config alone: refused at once, nothing compiled."""
    started = time.monotonic()
    with pytest.raises(ResourceLimitError) as err:
        gllm.load(SMOLLM2_GGUF, "llvm", kv_cache_tokens=10**9)  # 45 KiB a token
    assert "weights 513.0 MiB, KV cache (1000000000 tokens) 41.9 TiB" in str(err.value)
    monkeypatch.setenv("GIMLET_TVM_MEMORY_LIMIT", "300M")  # float32 weights: over 500 MB
    with pytest.raises(ResourceLimitError, match=r"weights 513\.0 MiB, KV cache \(8192 tokens\) 360\.0 MiB"):
        gllm.load(SMOLLM2_GGUF, "llvm")
    with pytest.raises(ResourceLimitError, match=r"weights 80\.2 MiB, KV cache \(100000 tokens\)"):  # q4
        gllm.load(SMOLLM2_GGUF, "llvm", "q4", kv_cache_tokens=10**5)
    assert time.monotonic() - started < 60  # opening the GGUF: seconds each; compiling: minutes
