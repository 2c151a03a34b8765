"""Llama and the families shaped like it: Mistral (full-context attention), Qwen2 (biases on
Q, K and V), SmolLM2, TinyLlama. RMSNorm, RoPE applied by the KV cache, grouped-query
attention, SwiGLU MLP. Q, K and V are one matmul; so are the MLP's gate and up projections.
"""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

from ..config import LLMConfig
from .base import DecoderLM, WeightSource


class LlamaAttention(nn.Module):
    def __init__(self, config: LLMConfig, dtype: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim,
                                  bias=config.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor, kv: PagedKVCache, layer: int) -> Tensor:
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, self.heads + 2 * self.kv_heads, self.head_dim))
        out = kv.attention_with_fused_qkv(layer, qkv, self.heads, sm_scale=self.head_dim ** -0.5)
        return self.o_proj(op.reshape(out, (b, s, self.heads * self.head_dim)))


class LlamaMLP(nn.Module):
    def __init__(self, config: LLMConfig, dtype: str):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(self, config: LLMConfig, dtype: str):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, -1, config.norm_eps, bias=False, dtype=dtype)
        self.self_attn = LlamaAttention(config, dtype)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, -1, config.norm_eps, bias=False, dtype=dtype)
        self.mlp = LlamaMLP(config, dtype)

    def forward(self, x: Tensor, kv: PagedKVCache, layer: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLM(DecoderLM):
    def __init__(self, config: LLMConfig, dtype: str = "float32"):
        super().__init__(config, dtype)
        self.layers = nn.ModuleList([LlamaLayer(config, dtype) for _ in range(config.num_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, -1, config.norm_eps, bias=False, dtype=dtype)

    def hidden_states(self, embeds: Tensor, kv: PagedKVCache) -> Tensor:
        x = embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, kv, index)
        return self.norm(x)


def weight_sources(config: LLMConfig) -> dict[str, WeightSource]:
    """Each parameter and the HF tensors it is made of (Q/K/V and gate/up concatenated)."""
    sources = {"embed_tokens.weight": WeightSource("model.embed_tokens.weight"),
               "norm.weight": WeightSource("model.norm.weight")}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = WeightSource("lm_head.weight")
    for i in range(config.num_layers):
        hf, layer = f"model.layers.{i}", f"layers.{i}"
        qkv = [f"{hf}.self_attn.{p}_proj" for p in "qkv"]
        sources[f"{layer}.self_attn.qkv_proj.weight"] = WeightSource(*(f"{n}.weight" for n in qkv))
        if config.attention_bias:
            sources[f"{layer}.self_attn.qkv_proj.bias"] = WeightSource(*(f"{n}.bias" for n in qkv))
        sources[f"{layer}.self_attn.o_proj.weight"] = WeightSource(f"{hf}.self_attn.o_proj.weight")
        sources[f"{layer}.mlp.gate_up_proj.weight"] = WeightSource(
            f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight")
        sources[f"{layer}.mlp.down_proj.weight"] = WeightSource(f"{hf}.mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sources[f"{layer}.{norm}.weight"] = WeightSource(f"{hf}.{norm}.weight")
    return sources
