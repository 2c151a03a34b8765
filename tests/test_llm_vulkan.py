"""LLMs on Vulkan (lavapipe here) against Hugging Face transformers float32: TVM's paged KV
cache with its GPU kernels (ragged and paged prefill, decode, merging attention states, RoPE),
printed as GLSL compute shaders by our code generator and run by our Vulkan runtime."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import gimlet_tvm.llm as gllm  # noqa: E402
from gimlet_tvm.errors import CompileError  # noqa: E402
from gimlet_tvm.llm.compile import compile_llm  # noqa: E402
from gimlet_tvm.llm.config import LLMConfig  # noqa: E402
from tests.llm_models import SMOLLM2_GGUF, random_model, reference_greedy, smollm2_reference  # noqa: E402

# Weights at 15x transformers' default scale: attention is far from uniform, so a kernel that
# mixes up positions, heads or pages moves the logits well beyond the tolerance.
STRONG_WEIGHTS = dict(initializer_range=0.3)


def last_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


@pytest.mark.parametrize("family,options", [
    ("llama", dict(num_attention_heads=8, num_key_value_heads=2)),
    # head_dim 16: test_llm's GPT-2 (48 / 4 = 12) is refused (the next test).
    ("gpt2", dict(n_embd=64, n_head=4)),
])
def test_random_models_match_transformers(family, options, tmp_path):
    folder, model = random_model(family, {**options, **STRONG_WEIGHTS}, tmp_path)
    llm = gllm.load(folder, target="vulkan")
    ids = [3, 17, 42, 99, 5, 150, 7]
    assert llm.generate(ids, max_new_tokens=16).token_ids == reference_greedy(model, ids, 16)

    # Two sequences packed into one prefill, decoded together along transformers' greedy
    # tokens, then more tokens prefilled onto the first (attention over its cached pages
    # merged with attention over the new tokens).
    rng = np.random.default_rng(0)
    histories = [list(ids), rng.integers(0, llm.config.vocab_size, 37).tolist()]
    seqs = [llm.add_sequence() for _ in histories]
    logits = llm.prefill(seqs, histories)
    for step in range(4):
        wants = [last_logits(model, history) for history in histories]
        for got, want in zip(logits, wants):
            np.testing.assert_allclose(got, want, atol=1e-3, rtol=0, err_msg=f"step {step}")
        tokens = [int(np.argmax(want)) for want in wants]
        for history, token in zip(histories, tokens):
            history.append(token)
        logits = llm.decode(seqs, tokens)
    more = rng.integers(0, llm.config.vocab_size, 21).tolist()
    logits = llm.prefill(seqs[:1], [more])[0]
    np.testing.assert_allclose(logits, last_logits(model, histories[0] + more), atol=1e-3, rtol=0)


def test_split_attention_matches_at_head_dim_64(tmp_path):
    """head_dim 64 (SmolLM2's), 2 query heads per KV head: attention split in two parts and
    merged. A prefill onto cached tokens attends to the cached pages, then to the new tokens;
    a sequence imported from another engine decodes its shared prefix apart from its own
    tokens. TVM's merge kernel raced on lavapipe from head_dim 64 on
    (`targets/vulkan_kernel_fixes.py`): both were off by several units."""
    options = dict(num_attention_heads=2, num_key_value_heads=1, hidden_size=128)
    folder, model = random_model("llama", {**options, **STRONG_WEIGHTS}, tmp_path)
    llm, cpu = gllm.load(folder, target="vulkan"), gllm.load(folder, target="llvm")
    ids = np.random.default_rng(0).integers(0, llm.config.vocab_size, 30).tolist()

    seq = llm.add_sequence()
    llm.prefill([seq], [ids])
    logits = llm.prefill([seq], [[5, 17, 42]])[0]
    np.testing.assert_allclose(logits, last_logits(model, ids + [5, 17, 42]), atol=1e-3, rtol=0)

    source = cpu.add_sequence()
    token = int(np.argmax(cpu.prefill([source], [ids])[0]))
    imported = llm.import_sequence(cpu.export_sequence(source))
    logits = llm.decode([imported], [token])[0]
    np.testing.assert_allclose(logits, cpu.decode([source], [token])[0], atol=1e-3, rtol=0)
    np.testing.assert_allclose(logits, last_logits(model, ids + [token]), atol=1e-3, rtol=0)


def test_head_dim_not_a_multiple_of_8_is_a_compile_error():
    # TVM's GPU prefill kernel splits its tiles over 128 threads: head_dim must be a multiple
    # of 8. Exporting the model builds that kernel, so the refusal is a CompileError too.
    config = LLMConfig(family="gpt2", vocab_size=211, hidden_size=48, intermediate_size=192,
                       num_layers=2, num_heads=4, num_kv_heads=4, head_dim=12, context_length=128,
                       norm_eps=1e-5, hidden_act="gelu_new")
    with pytest.raises(CompileError, match="compiling gpt2 for vulkan failed: .*Prefill tile"):
        compile_llm(config, "vulkan")


@functools.lru_cache(maxsize=1)
def smollm2_vulkan() -> gllm.LLM:
    """SmolLM2 on lavapipe, loaded once for the tests of several prompts."""
    return gllm.load(SMOLLM2_GGUF, target="vulkan")


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", SMOLLM2_PROMPTS)
def test_smollm2_greedy_tokens_and_logits_equal_transformers(prompt):
    """64 greedy tokens as transformers makes them, the logits of every step within 1e-3
    (transformers' logits of all steps from one forward pass over prompt and completion).
    About one minute per prompt on lavapipe (and a minute's compile before the first)."""
    model, tokenizer = smollm2_reference()
    llm = smollm2_vulkan()
    ids = tokenizer(prompt)["input_ids"]
    want = reference_greedy(model, ids, 64, eos=llm.tokenizer.eos_token_ids)
    seq = llm.add_sequence()
    logits, tokens = [llm.prefill([seq], [ids])[0]], []
    while int(np.argmax(logits[-1])) not in llm.tokenizer.eos_token_ids:
        tokens.append(int(np.argmax(logits[-1])))
        if len(tokens) == 64:
            break
        logits.append(llm.decode([seq], [tokens[-1]])[0])
    llm.remove_sequence(seq)
    assert tokens == want
    with torch.no_grad():
        reference = model(torch.tensor([ids + tokens[:len(logits) - 1]])).logits[0, len(ids) - 1:].numpy()
    np.testing.assert_allclose(np.stack(logits), reference, atol=1e-3, rtol=0)
    # The engine's own token loop makes the same tokens.
    assert llm.generate(ids, max_new_tokens=8).token_ids == want[:8]
