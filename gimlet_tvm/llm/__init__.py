"""Language models: decoder-only LLMs compiled by gimlet-tvm, with a paged KV cache.

    llm = gimlet_tvm.llm.load("SmolLM2-135M-Instruct.Q4_1.gguf", target="llvm")
    print(llm.generate("The capital of France is", max_new_tokens=16).text)

Modules: `config` (one `LLMConfig` from an HF `config.json` or GGUF metadata), `weights`
(safetensors and GGUF readers, quantized blocks kept quantized), `families/` (one module per
architecture family, built with `tvm.relax.frontend.nn`), `tokenizer` and `sampling`, `compile`
(the family's Relax module through our pipeline), `engine` (KV cache, prefill/decode, batches).
"""
