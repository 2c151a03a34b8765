"""What a model's config makes it weigh: multiply-adds a token, bytes of weights and of KV
cache, and the memory one engine needs at least (the placement's roofline and the engine's
memory check both count with these)."""

from __future__ import annotations

from ..resources import Need
from .config import LLMConfig
from .quantization import BLOCK, FORMAT_OF


def macs_per_token(config: LLMConfig) -> int:
    """Multiply-adds of one token: the layers' projections (an MLP of three matrices; GPT-2's
    two are counted as three: this is a roofline estimate) and the output head."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = 2 * h * q + 2 * h * kv + 3 * h * config.intermediate_size
    return config.num_layers * layer + config.vocab_size * h


def weight_bytes(config: LLMConfig, quantization: str | None) -> float:
    """Bytes a pass reads for the weights: float32, or the quantization's blocks."""
    per_weight = 4 if quantization is None else FORMAT_OF[quantization].block_bytes / BLOCK
    return macs_per_token(config) * per_weight


def kv_bytes(config: LLMConfig, tokens: int) -> int:
    """Bytes of KV cache for `tokens` tokens (float32 keys and values of every layer)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 * tokens


def memory_need(config: LLMConfig, quantization: str | None, kv_cache_tokens: int) -> Need:
    """What one engine holds on its device: its weights (as `weight_bytes` counts them) and
    a KV cache of `kv_cache_tokens` tokens."""
    return Need({"weights": int(weight_bytes(config, quantization)),
                 f"KV cache ({kv_cache_tokens} tokens)": kv_bytes(config, kv_cache_tokens)})
