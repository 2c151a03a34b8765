"""GPT-2: learned absolute positions (looked up from the KV cache's query positions), pre-norm
LayerNorm, GELU (tanh approximation), one fused `c_attn` projection, no RoPE. HF stores its
projections as `Conv1D` (weights [in, out]): they are transposed to [out, in] on load
(GGUF files store them [out, in] already: `weights` hands them out in HF's layout).
"""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode

from ..config import LLMConfig
from .base import DecoderLM, WeightSource


class GPT2Attention(nn.Module):
    def __init__(self, config: LLMConfig, dtype: str):
        super().__init__()
        self.heads, self.head_dim = config.num_heads, config.head_dim
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True, dtype=dtype)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True, dtype=dtype)

    def forward(self, x: Tensor, kv: PagedKVCache, layer: int) -> Tensor:
        b, s, _ = x.shape
        qkv = op.reshape(self.c_attn(x), (b, s, 3 * self.heads, self.head_dim))
        out = kv.attention_with_fused_qkv(layer, qkv, self.heads, sm_scale=self.head_dim ** -0.5)
        return self.c_proj(op.reshape(out, (b, s, self.heads * self.head_dim)))


class GPT2MLP(nn.Module):
    def __init__(self, config: LLMConfig, dtype: str):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=True, dtype=dtype)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True, dtype=dtype)
        self.exact_gelu = config.hidden_act == "gelu"

    def forward(self, x: Tensor) -> Tensor:
        h = self.c_fc(x)
        return self.c_proj(op.gelu(h, approximate=None if self.exact_gelu else "tanh"))


class GPT2Layer(nn.Module):
    def __init__(self, config: LLMConfig, dtype: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, config.norm_eps, dtype=dtype)
        self.attn = GPT2Attention(config, dtype)
        self.ln_2 = nn.LayerNorm(config.hidden_size, config.norm_eps, dtype=dtype)
        self.mlp = GPT2MLP(config, dtype)

    def forward(self, x: Tensor, kv: PagedKVCache, layer: int) -> Tensor:
        x = x + self.attn(self.ln_1(x), kv, layer)
        return x + self.mlp(self.ln_2(x))


class GPT2LM(DecoderLM):
    rope_mode = RopeMode.NONE

    def __init__(self, config: LLMConfig, dtype: str = "float32"):
        super().__init__(config, dtype)
        self.wpe = nn.Embedding(config.context_length, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList([GPT2Layer(config, dtype) for _ in range(config.num_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, config.norm_eps, dtype=dtype)

    def hidden_states(self, embeds: Tensor, kv: PagedKVCache) -> Tensor:
        b, s, _ = embeds.shape
        positions = kv.get_query_positions(b * s)
        x = embeds + op.reshape(self.wpe(positions), (b, s, self.config.hidden_size))
        for index, layer in enumerate(self.layers):
            x = layer(x, kv, index)
        return self.ln_f(x)


def weight_sources(config: LLMConfig) -> dict[str, WeightSource]:
    """Each parameter and its HF tensor (`Conv1D` weights transposed)."""
    sources = {"embed_tokens.weight": WeightSource("transformer.wte.weight"),
               "wpe.weight": WeightSource("transformer.wpe.weight"),
               "ln_f.weight": WeightSource("transformer.ln_f.weight"),
               "ln_f.bias": WeightSource("transformer.ln_f.bias")}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = WeightSource("lm_head.weight")
    for i in range(config.num_layers):
        hf, layer = f"transformer.h.{i}", f"layers.{i}"
        for norm in ("ln_1", "ln_2"):
            for part in ("weight", "bias"):
                sources[f"{layer}.{norm}.{part}"] = WeightSource(f"{hf}.{norm}.{part}")
        for proj in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            sources[f"{layer}.{proj}.weight"] = WeightSource(f"{hf}.{proj}.weight", transposed=True)
            sources[f"{layer}.{proj}.bias"] = WeightSource(f"{hf}.{proj}.bias")
    return sources
