"""Language models: decoder-only LLMs compiled by gimlet-tvm, with a paged KV cache.

    llm = gimlet_tvm.llm.load("SmolLM2-135M-Instruct.Q4_1.gguf", target="llvm")
    print(llm.generate("The capital of France is", max_new_tokens=16).text)

Modules: `config` (one `LLMConfig` from an HF `config.json` or GGUF metadata), `weights`
(safetensors and GGUF readers), `families/` (one module per architecture family, built with
`tvm.relax.frontend.nn`), `quantization` (weights kept quantized), `tokenizer` and `sampling`,
`request` (one completion's state), `speculative` (a draft's proposals checked in one
pass), `compile` (the family's Relax module through our pipeline, cached per architecture),
`engine` (KV cache, prefill/decode, batches, the token loop), `stages` (prefill, decode and
draft on several devices, placed by cost).
"""

from .config import LLMConfig
from .engine import LLM, Generation, KVPages
from .request import Request
from .sampling import SamplingParams
from .speculative import Draft
from .stages import SplitLLM, Workload, load
from .tokenizer import Tokenizer

__all__ = ["Draft", "Generation", "KVPages", "LLM", "LLMConfig", "Request", "SamplingParams", "SplitLLM",
           "Tokenizer", "Workload", "load"]
