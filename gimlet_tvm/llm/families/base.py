"""What every family's model shares: the functions the engine calls and their signatures.

A family subclasses `DecoderLM` and provides the layers (`hidden_states`) and its weight names;
the functions exported from it, and so the engine, are the same for every family:

- `prefill(input_ids[1, n], logit_positions[b], kv) -> (logits[1, b, vocab], kv)`: the new
  tokens of `b` sequences, packed one after another; logits at the given positions (each
  sequence's last token).
- `decode(input_ids[b, 1], kv) -> (logits[b, 1, vocab], kv)`: one token per sequence.
- `create_paged_kv_cache(max_batch, max_total_len, prefill_chunk, page_size, sliding)`.

Logits are float32 whatever the weights are. Token embeddings are looked up inside (positions
are the layers' business: GPT-2 adds learned ones from the KV cache's query positions, Llama
rotates in attention); the engine checks ids against the vocabulary before the call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tvm
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from ..config import LLMConfig


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """How a parameter is made from a checkpoint's HF-named tensors: these tensors joined along
    their first axis (fused Q/K/V, gate/up), transposed when HF stores it [in, out]."""

    names: tuple[str, ...]
    transposed: bool = False

    def __init__(self, *names: str, transposed: bool = False):
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "transposed", transposed)


class DecoderLM(nn.Module):
    """A decoder-only LM over a paged KV cache; subclasses define `hidden_states`."""

    rope_mode = RopeMode.NORMAL

    def __init__(self, config: LLMConfig, dtype: str = "float32"):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    def hidden_states(self, embeds: Tensor, kv: PagedKVCache) -> Tensor:
        """The final (normalized) hidden states of every input position."""
        raise NotImplementedError

    def logits(self, hidden: Tensor) -> Tensor:
        """[rows, 1, hidden] -> [rows, 1, vocab]: one row per sequence, in decode and prefill.
        Tied embeddings multiply as they are, unless the model has an `lm_head` anyway (a
        quantized copy of them: `quantization`)."""
        if hasattr(self, "lm_head"):
            logits = self.lm_head(hidden)
        else:
            logits = op.matmul(hidden, op.permute_dims(self.embed_tokens.weight))
        return logits.astype("float32") if logits.dtype != "float32" else logits

    def prefill(self, input_ids: Tensor, logit_positions: Tensor, kv: PagedKVCache):
        hidden = self.hidden_states(self.embed_tokens(input_ids), kv)
        rows = logit_positions.shape[0]
        last = op.reshape(op.take(hidden, logit_positions, axis=1), (rows, 1, self.config.hidden_size))
        return op.reshape(self.logits(last), (1, rows, self.config.vocab_size)), kv

    def decode(self, input_ids: Tensor, kv: PagedKVCache):
        return self.logits(self.hidden_states(self.embed_tokens(input_ids), kv)), kv

    def create_paged_kv_cache(self, max_batch_size: tvm.tirx.Var, max_total_seq_len: tvm.tirx.Var,
                              prefill_chunk_size: tvm.tirx.Var, page_size: tvm.tirx.Var,
                              support_sliding_window: tvm.tirx.Var) -> PagedKVCache:
        c = self.config
        scaling = dict(c.rope_scaling or {})
        # TVM's kernels take linear scaling as a factor on the positions (HF divides them by
        # "factor"), other kinds as a dict.
        rope_scale = 1.0 / scaling.pop("factor") if scaling.get("rope_type") == "linear" else 1.0
        return TIRPagedKVCache(
            attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size, page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=tvm.relax.ShapeExpr([0, c.num_layers]),
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads, qk_head_dim=c.head_dim, v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0, mla_original_v_head_dim=0, rope_mode=self.rope_mode,
            rope_scale=rope_scale, rope_theta=c.rope_theta,
            rope_scaling=scaling if scaling.get("rope_type") not in (None, "linear") else {},
            rope_ext_factors=tvm.relax.prim_value(0), rotary_dim=c.head_dim,
            enable_disaggregation=False, dtype=self.dtype, target=tvm.target.Target.current(),
        )

    def export_spec(self) -> dict[str, Any]:
        """The functions to export and their inputs (symbolic sizes by name)."""
        packed = {"param_mode": "packed", "effect_mode": "none"}
        kv = nn.spec.Object(object_type=PagedKVCache)
        return {
            "prefill": {"input_ids": nn.spec.Tensor([1, "seq_len"], "int32"),
                        "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                        "kv": kv, "$": packed},
            "decode": {"input_ids": nn.spec.Tensor(["batch_size", 1], "int32"), "kv": kv, "$": packed},
            "create_paged_kv_cache": {
                name: int for name in ("max_batch_size", "max_total_seq_len",
                                       "prefill_chunk_size", "page_size", "support_sliding_window")
            } | {"$": {"param_mode": "none", "effect_mode": "none"}},
        }
