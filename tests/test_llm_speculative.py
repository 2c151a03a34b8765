"""Speculative decoding: the draft's proposals checked by the model in one pass.

Greedy output must be plain greedy output token for token (SmolLM2, real weights), sampled
output must follow the model's distribution (a chi-square test), and a rollback must leave the
KV cache as if the rejected tokens never ran."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tvm  # noqa: E402
from scipy import stats  # noqa: E402

import gimlet_tvm.llm as gllm  # noqa: E402
from gimlet_tvm.errors import LLMError  # noqa: E402
from gimlet_tvm.llm.sampling import SamplingParams  # noqa: E402
from gimlet_tvm.llm.speculative import Pace, accept_proposals, lookup_proposals  # noqa: E402
from gimlet_tvm.llm.sampling import Sampler  # noqa: E402
from tests.llm_models import SMOLLM2_GGUF, random_model  # noqa: E402

_DEBUG_GET_KV = tvm.get_global_func("vm.builtin.attention_kv_cache_debug_get_kv")

# A text to repeat (prompt lookup's best case), code, and an open question.
TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
        "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 "
        "to 1889.")
CHATS = [
    [{"role": "user", "content": f"Repeat this text word for word:\n\n{TEXT}"}],
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "Why is the sky blue?"}],
]


@pytest.fixture(scope="module")
def smollm2():
    return gllm.load(SMOLLM2_GGUF, target="llvm")


@pytest.mark.parametrize("draft", ["prompt-lookup", "q8 copy"])
def test_greedy_output_is_plain_greedy_output(smollm2, draft):
    source = "prompt-lookup" if draft == "prompt-lookup" else gllm.load(SMOLLM2_GGUF, "llvm", "q8")
    for messages in CHATS:
        ids = smollm2.chat_prompt(messages)
        plain = smollm2.generate(ids, max_new_tokens=64)
        fast = smollm2.generate(ids, max_new_tokens=64, speculative=gllm.Draft(source, k=5))
        assert fast.token_ids == plain.token_ids and fast.text == plain.text
        assert fast.finish_reason == plain.finish_reason
        assert fast.speculation.proposed > 0 and fast.speculation.rounds < len(fast.token_ids)
    if draft == "q8 copy":  # its sequences are gone with the requests
        assert source._sequences == {}
    assert smollm2._sequences == {}


def test_draft_on_vulkan_for_a_model_on_llvm(tmp_path):
    """A random Llama on llvm, its one-layer cut on lavapipe as the draft: the greedy tokens
    of plain decoding, and proposals both accepted and rejected."""
    folder, _ = random_model("llama", dict(num_attention_heads=8, num_key_value_heads=2, initializer_range=0.3),
                             tmp_path)
    llm = gllm.load(folder, target="llvm")
    # Not adaptive: a lavapipe step costs more than it saves here, so a paced draft would not propose.
    draft = gllm.Draft(gllm.load(folder, target="vulkan", layers=1), k=3, adaptive=False)
    for ids in ([3, 17, 42, 99, 5], [7, 7, 7, 1, 2, 3, 7, 7, 7, 1, 2]):
        plain = llm.generate(ids, max_new_tokens=40)
        fast = llm.generate(ids, max_new_tokens=40, speculative=draft)
        assert fast.token_ids == plain.token_ids
        assert 0 < fast.speculation.accepted < fast.speculation.proposed


@pytest.mark.slow
def test_smollm2_with_its_draft_on_vulkan(smollm2):
    """SmolLM2 on llvm with the same model on lavapipe proposing: 64 greedy tokens of each
    chat prompt are plain decoding's (about a minute a prompt on lavapipe)."""
    draft = gllm.Draft(gllm.load(SMOLLM2_GGUF, target="vulkan"), k=4, adaptive=False)  # proposing each round
    for messages in CHATS:
        ids = smollm2.chat_prompt(messages)
        fast = smollm2.generate(ids, max_new_tokens=64, speculative=draft)
        assert fast.token_ids == smollm2.generate(ids, max_new_tokens=64).token_ids
        assert fast.speculation.acceptance_rate > 0.5


def test_stream_and_stop_strings_with_a_draft(smollm2):
    ids = smollm2.chat_prompt(CHATS[0])
    plain = smollm2.generate(ids, max_new_tokens=48, stop=["Gustave"])
    pieces = smollm2.stream(ids, max_new_tokens=48, stop=["Gustave"], speculative=gllm.Draft("prompt-lookup"))
    text = ""
    while True:
        try:
            text += next(pieces)
        except StopIteration as done:
            result = done.value
            break
    assert text == plain.text == result.text and result.finish_reason == plain.finish_reason == "stop"
    assert "Gustave" not in text and result.speculation.accepted > 0


def test_rollback_leaves_the_cache_as_if_the_rejected_tokens_never_ran(smollm2):
    """Score a token and three proposals, pop the three: the cache holds what one decode of
    the token leaves, and what comes next is the same."""
    config = smollm2.config
    prompt = smollm2.chat_prompt(CHATS[2])
    checked, plain = smollm2.add_sequence(), smollm2.add_sequence()
    smollm2.prefill([checked, plain], [prompt, prompt])
    smollm2.score(checked, [1000, 2000, 3000, 4000])
    smollm2.popn(checked, 3)
    smollm2.decode([plain], [1000])
    assert smollm2.sequence_length(checked) == smollm2.sequence_length(plain) == len(prompt) + 1

    def cached(seq: int) -> tuple[np.ndarray, np.ndarray]:
        shape = (config.num_layers, len(prompt) + 1, config.num_kv_heads, config.head_dim)
        keys, values = (tvm.runtime.empty(shape, "float32", smollm2.device) for _ in range(2))
        _DEBUG_GET_KV(smollm2._kv, seq, 0, len(prompt) + 1, keys, values)
        return keys.numpy(), values.numpy()

    (k1, v1), (k2, v2) = cached(checked), cached(plain)
    np.testing.assert_array_equal(k1[:, :-1], k2[:, :-1])  # the prompt's entries untouched
    np.testing.assert_allclose(k1, k2, atol=1e-5, rtol=0)  # the kept token: one pass or another
    np.testing.assert_allclose(v1, v2, atol=1e-5, rtol=0)
    for _ in range(8):
        a, b = smollm2.decode([checked, plain], [7, 7])
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    for seq in (checked, plain):
        smollm2.remove_sequence(seq)


def test_sampled_tokens_follow_the_models_distribution(tmp_path):
    """A 16-token model and a draft that is the same model cut to one layer (so the draft
    often disagrees): the first token speculation makes, over 3000 seeded requests, is
    distributed as the model's own next token (chi-square, p > 0.001)."""
    folder, _ = random_model("llama", dict(vocab_size=16, initializer_range=0.3), tmp_path)
    llm = gllm.load(folder, target="llvm")
    draft = gllm.Draft(gllm.load(folder, target="llvm", layers=1), k=3, adaptive=False)
    prompt, params = [3, 1, 4, 1, 5], dict(temperature=0.9, top_p=0.95)

    # The exact law of the second new token: sum over the first of p(first) p(second | first).
    sampler = Sampler(SamplingParams(**params))
    seq = llm.add_sequence()
    first = sampler.probabilities(llm.prefill([seq], [prompt])[0], prompt)
    law = np.zeros(16)
    for token in np.flatnonzero(first):
        law += first[token] * sampler.probabilities(llm.decode([seq], [token])[0], [*prompt, token])
        llm.popn(seq, 1)
    llm.remove_sequence(seq)

    counts, proposed, accepted = np.zeros(16), 0, 0
    for seed in range(3000):
        result = llm.generate(prompt, max_new_tokens=4, speculative=draft, seed=seed, **params)
        counts[result.token_ids[1]] += 1
        proposed += result.speculation.proposed
        accepted += result.speculation.accepted
    assert 0.1 < accepted / proposed < 0.9, "the draft must both agree and disagree for a real test"
    seen = law * counts.sum() >= 5  # chi-square needs expected counts of 5 or more per cell
    expected = law[seen] / law[seen].sum() * counts[seen].sum()
    assert stats.chisquare(counts[seen], expected).pvalue > 1e-3
    assert counts[~seen].sum() <= max(10, 0.01 * counts.sum())


def test_rejection_sampling_keeps_the_distribution():
    """accept_proposals alone, on distributions given outright: made tokens follow p for
    drafted, looked-up and greedy proposals."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(8))
    q = rng.dirichlet(np.ones(8))
    draws = {"drafted": [], "looked up": []}
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    for _ in range(20000):
        proposal = sampler.draw(q)
        draws["drafted"].append(accept_proposals(sampler, [p, p], [proposal], [q])[0])
        draws["looked up"].append(accept_proposals(sampler, [p, p], [2], None)[0])
    for kind, made in draws.items():
        counts = np.bincount(made, minlength=8)
        assert stats.chisquare(counts, p * len(made)).pvalue > 1e-3, kind
    greedy = Sampler(SamplingParams())
    one_hot = np.eye(8)[5]
    assert accept_proposals(greedy, [one_hot, one_hot, np.eye(8)[1]], [5, 5], None) == [5, 5, 1]
    assert accept_proposals(greedy, [one_hot, one_hot], [3], None) == [5]


def test_pace_proposes_what_pays():
    """A check of n tokens costing 10 + 3 (n - 1) ms: with most proposals accepted many pay,
    with few none does (plain decode steps), and a proposal is tried again after 4 of those
    where acceptance, not cost, held proposals back."""
    pace = Pace(k_max=6)
    assert pace.next_k() == 0  # a plain step first: its time is the unit
    pace.record(1, 0.010, 0, 0, 0.0)
    assert pace.next_k() == 6  # checks not timed yet are taken to cost what one token does
    for n in range(2, 8):
        pace.record(n, 0.010 + 0.003 * (n - 1), n - 1, n - 1, 0.0)
    assert pace.acceptance() > 0.9 and pace.next_k() == 6
    assert pace.next_k(available=2) == 2
    for _ in range(8):
        pace.record(7, 0.028, 6, 0, 0.0)
    assert pace.acceptance() < 0.3 and pace.next_k() == 0
    for _ in range(3):
        pace.record(1, 0.010, 0, 0, 0.0)
        assert pace.next_k() == 0
    pace.record(1, 0.010, 0, 0, 0.0)
    assert pace.next_k() == 1
    slow_draft = Pace(k_max=6)  # proposals that take longer than the model's steps never pay
    slow_draft.record(1, 0.010, 0, 0, 0.0)
    slow_draft.record(7, 0.028, 6, 6, 6 * 0.050)
    assert slow_draft.next_k() == 0
    for _ in range(2 * Pace.PROBE):  # nor are they tried again: their cost, not acceptance, rules them out
        slow_draft.record(1, 0.010, 0, 0, 0.0)
        assert slow_draft.next_k() == 0
    draft_step = Pace(k_max=6)  # a draft model's step on the model's own token counts too
    draft_step.record(1, 0.010, 0, 0, 0.0)
    draft_step.record(3, 0.0105, 2, 2, 2 * 0.002, round_s=0.0)
    assert draft_step.next_k(available=2) == 2
    draft_step.record(3, 0.0105, 2, 2, 2 * 0.002, round_s=0.012)
    assert draft_step.next_k(available=2) == 0


def test_pace_takes_cheap_short_checks_and_tells_kinds_apart():
    """Checking two tokens costs about what one does (a skinny GEMM is bound by reading the
    weights), so one proposal pays even at a low acceptance, where a line through the costs of
    one and seven tokens would say it does not; and a kind of proposal that is rejected (a
    one-token lookup match) does not pull down another that is accepted (a three-token one)."""
    pace = Pace(k_max=6)
    pace.record(1, 0.010, 0, 0, 0.0)
    pace.record(2, 0.0105, 1, 1, 0.0, kind=3)
    for n in range(3, 8):
        pace.record(n, 0.010 + 0.003 * (n - 1), n - 1, n - 1, 0.0, kind=3)
    for _ in range(6):
        pace.record(7, 0.028, 6, 1, 0.0, kind=1)
        pace.record(2, 0.0105, 1, 0, 0.0, kind=1)
    assert 0.2 < pace.acceptance(1) < 0.4
    assert pace.next_k(kind=1) == 1
    assert pace.acceptance(3) > 0.8 and pace.next_k(kind=3) > 3


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    context = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2, 3, 4]
    assert lookup_proposals(context, 3, ngram=3) == ([6, 7, 8], 3)  # the latest earlier match wins
    assert lookup_proposals(context + [9], 2, ngram=3) == ([2, 3], 1)  # only "9" matches
    assert lookup_proposals([1, 2, 3], 4, ngram=3) == ([], 0)


def test_bad_drafts_are_typed_errors(smollm2, tmp_path):
    with pytest.raises(LLMError, match="prompt-lookup"):
        gllm.Draft("ngram")
    with pytest.raises(LLMError, match="k >= 1"):
        gllm.Draft("prompt-lookup", k=0)
    folder, _ = random_model("llama", {}, tmp_path)
    other = gllm.load(folder, target="llvm")
    with pytest.raises(LLMError, match="vocabulary"):
        smollm2.generate("Hello", max_new_tokens=4, speculative=gllm.Draft(other))
    assert smollm2._sequences == {} and smollm2.generate("Hello", max_new_tokens=4).token_ids


def test_cli_prints_acceptance_and_both_speeds(cli):
    code, out, err = cli("generate", SMOLLM2_GGUF, "--prompt", "a b c d e f a b c d e f a b c",
                         "--max-new-tokens", "16", "--draft", "prompt-lookup")
    assert code == 0, err
    assert "proposals accepted" in out and "tokens/s; without:" in out and "same tokens" in out
