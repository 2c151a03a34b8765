"""The architecture families, one module each: `FAMILIES[config.family]`."""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..config import LLMConfig
from . import gpt2, llama
from .base import DecoderLM, WeightSource


@dataclasses.dataclass(frozen=True)
class Family:
    """A family's model class and which HF-named tensors make each of its parameters."""

    model: type[DecoderLM]
    weight_sources: Callable[[LLMConfig], dict[str, WeightSource]]


FAMILIES = {
    "llama": Family(llama.LlamaLM, llama.weight_sources),
    "qwen2": Family(llama.LlamaLM, llama.weight_sources),
    "gpt2": Family(gpt2.GPT2LM, gpt2.weight_sources),
}
