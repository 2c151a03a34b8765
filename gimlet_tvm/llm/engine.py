"""The engine: a compiled architecture, its weights on the device, one paged KV cache, and the
token loop over it. Nothing here knows a family: every family exports the same functions
(`families.base`).

Sequences live in the KV cache by integer id. `prefill` packs the new tokens of several
sequences into one call (split into chunks the cache accepts), `decode` advances several
sequences by one token each, `popn` rolls a sequence back; `generate`, `generate_batch` and
`stream` are the token loop on top, with sampling and stop strings per request.

Every request is checked before it touches the cache (token ids inside the vocabulary, a
prompt that fits the context window, a batch that fits the cache), so a bad request raises
`LLMError` and the engine serves the next one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Generator, Iterator, Sequence

import numpy as np
import tvm
from tvm import relax

from ..errors import LLMError, WeightsError
from ..targets import DEFAULT_TARGET, TargetLike
from .compile import CompiledLLM, compiled_for, load_compiled
from .families import FAMILIES
from .quantization import load_quantized, quantized_sources, quantized_weight
from .request import Request
from .sampling import SamplingParams
from .tokenizer import Tokenizer
from .weights import Checkpoint, open_checkpoint

PAGE_SIZE = 16

_f = tvm.get_global_func
_ADD_SEQUENCE = _f("vm.builtin.kv_state_add_sequence")
_REMOVE_SEQUENCE = _f("vm.builtin.kv_state_remove_sequence")
_POPN = _f("vm.builtin.kv_state_popn")
_BEGIN_FORWARD = _f("vm.builtin.kv_state_begin_forward")
_END_FORWARD = _f("vm.builtin.kv_state_end_forward")
_TOTAL_SEQ_LENGTH = _f("vm.builtin.attention_kv_cache_get_total_sequence_length")


@dataclasses.dataclass
class Generation:
    """One request's result: the new tokens, their text, why it ended, and its timings."""

    token_ids: list[int]
    text: str
    finish_reason: str          # "stop" (end token or stop string) or "length"
    prompt_tokens: int
    prefill_ms: float
    decode_ms: float

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens made by decode steps (all but the first, which prefill makes) per second."""
        steps = len(self.token_ids) - 1
        return steps / (self.decode_ms / 1e3) if steps > 0 and self.decode_ms > 0 else 0.0


class LLM:
    """A loaded model: `generate`, `generate_batch`, `stream`, `chat`, and the KV-cache steps
    they are made of (`add_sequence`, `prefill`, `decode`, `popn`, `remove_sequence`)."""

    def __init__(self, compiled: CompiledLLM, checkpoint: Checkpoint, tokenizer: Tokenizer | None,
                 max_batch_size: int = 8, context_window: int | None = None,
                 kv_cache_tokens: int | None = None):
        self.compiled, self.config, self.tokenizer = compiled, compiled.config, tokenizer
        if compiled.config != checkpoint.config:
            raise WeightsError(f"{checkpoint.path.name} is a different architecture than the compiled "
                               f"model: {checkpoint.config} vs {compiled.config}")
        runtime = compiled.runtime
        reason = runtime.cannot_run()
        if reason is not None:
            raise LLMError(f"the model is compiled for {runtime.name}, which cannot run here: {reason}")
        runtime.load_libraries()
        self.device = runtime.device()
        self.context_window = min(context_window or self.config.context_length, self.config.context_length)
        self.kv_cache_tokens = kv_cache_tokens or self.context_window
        self.max_batch_size = max_batch_size
        self.prefill_chunk = min(2048, self.kv_cache_tokens)
        self._vm = relax.VirtualMachine(compiled.module, self.device)
        self._params = load_params(compiled, checkpoint, self.device)
        shape = tvm.runtime.ShapeTuple
        self._kv = self._vm["create_paged_kv_cache"](
            shape([max_batch_size]), shape([self.kv_cache_tokens]), shape([self.prefill_chunk]),
            shape([PAGE_SIZE]), shape([0]))
        self._sequences: dict[int, int] = {}   # id -> tokens in the cache
        self._next_id = 0

    def export_compiled(self, path: str | os.PathLike) -> None:
        """Write the compiled architecture (weights not included) for `load(..., compiled=path)`
        with this or any other checkpoint of the same architecture."""
        self.compiled.export(path)

    # --- KV-cache steps --------------------------------------------------------------------

    def add_sequence(self) -> int:
        """A new, empty sequence; returns its id."""
        if len(self._sequences) >= self.max_batch_size:
            raise LLMError(f"{self.max_batch_size} sequences are in the cache already (max_batch_size)")
        seq_id, self._next_id = self._next_id, self._next_id + 1
        _ADD_SEQUENCE(self._kv, seq_id)
        self._sequences[seq_id] = 0
        return seq_id

    def remove_sequence(self, seq_id: int) -> None:
        self._check_sequences([seq_id])
        _REMOVE_SEQUENCE(self._kv, seq_id)
        del self._sequences[seq_id]

    def popn(self, seq_id: int, n: int) -> None:
        """Forget the last `n` tokens of a sequence (rejected draft tokens, an edited turn)."""
        self._check_sequences([seq_id])
        if not 0 <= n <= self._sequences[seq_id]:
            raise LLMError(f"cannot pop {n} tokens from a sequence of {self._sequences[seq_id]}")
        if n:
            _POPN(self._kv, seq_id, n)
            self._sequences[seq_id] -= n

    def sequence_length(self, seq_id: int) -> int:
        self._check_sequences([seq_id])
        return self._sequences[seq_id]

    def kv_pages(self) -> tuple[int, int]:
        """(pages in use, pages in all) of the KV cache, `PAGE_SIZE` tokens a page: what a
        scheduler admits and preempts by, and what a server reports."""
        return (sum(math.ceil(n / PAGE_SIZE) for n in self._sequences.values()),
                self.kv_cache_tokens // PAGE_SIZE)

    def prefill(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> np.ndarray:
        """Append `tokens[i]` to sequence `seq_ids[i]`; the logits after each one's last token
        ([len(seq_ids), vocab], float32). Long inputs go through in chunks."""
        self._check_sequences(seq_ids)
        lists = [list(t) for t in tokens]
        for t in lists:
            if not t:
                raise LLMError("no tokens to prefill (empty prompt)")
        self._check_tokens(seq_ids, lists)
        logits = np.empty((len(seq_ids), self.config.vocab_size), np.float32)
        pending = list(range(len(seq_ids)))
        offsets = [0] * len(seq_ids)
        while pending:
            batch, lengths, room = [], [], self.prefill_chunk
            for i in pending:
                take = min(len(lists[i]) - offsets[i], room)
                if take <= 0:
                    break
                batch.append(i)
                lengths.append(take)
                room -= take
            ids = np.concatenate([lists[i][offsets[i]:offsets[i] + n] for i, n in zip(batch, lengths)])
            out = self._forward("prefill", [seq_ids[i] for i in batch], lengths,
                                ids.astype("int32")[None, :], np.cumsum(lengths).astype("int32") - 1)
            for row, (i, n) in enumerate(zip(batch, lengths)):
                offsets[i] += n
                if offsets[i] == len(lists[i]):
                    logits[i] = out[0, row]
            pending = [i for i in pending if offsets[i] < len(lists[i])]
        return logits

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Append one token to each sequence; their next-token logits ([len, vocab])."""
        self._check_sequences(seq_ids)
        self._check_tokens(seq_ids, [[t] for t in tokens])
        ids = np.asarray(tokens, dtype="int32").reshape(len(seq_ids), 1)
        return self._forward("decode", list(seq_ids), [1] * len(seq_ids), ids)[:, 0]

    def _forward(self, function: str, seq_ids: list[int], lengths: list[int], ids: np.ndarray,
                 logit_positions: np.ndarray | None = None) -> np.ndarray:
        shape = tvm.runtime.ShapeTuple
        args = [tvm.runtime.tensor(ids, self.device)]
        if logit_positions is not None:
            args.append(tvm.runtime.tensor(logit_positions, self.device))
        _BEGIN_FORWARD(self._kv, shape(seq_ids), shape(lengths))
        logits, self._kv = self._vm[function](*args, self._kv, self._params)
        _END_FORWARD(self._kv)
        for seq_id, n in zip(seq_ids, lengths):
            self._sequences[seq_id] += n
        return logits.numpy()

    def _check_sequences(self, seq_ids: Sequence[int]) -> None:
        unknown = [s for s in seq_ids if s not in self._sequences]
        if unknown:
            raise LLMError(f"no sequence {unknown[0]} in the cache")
        if len(set(seq_ids)) != len(seq_ids):
            raise LLMError("a sequence is given twice in one step")
        if len(seq_ids) > self.max_batch_size:
            raise LLMError(f"{len(seq_ids)} sequences in one step; max_batch_size is {self.max_batch_size}")

    def _check_vocabulary(self, tokens: Sequence[int]) -> None:
        vocab = self.config.vocab_size
        bad = [t for t in tokens if not 0 <= int(t) < vocab]
        if bad:
            raise LLMError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")

    def _check_tokens(self, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        for t in tokens:
            self._check_vocabulary(t)
        for seq_id, t in zip(seq_ids, tokens):
            if self._sequences[seq_id] + len(t) > self.context_window:
                raise LLMError(f"{self._sequences[seq_id] + len(t)} tokens do not fit the context "
                               f"window of {self.context_window}")
        pages = sum(math.ceil((self._sequences[s] + len(t)) / PAGE_SIZE) for s, t in zip(seq_ids, tokens))
        pages += sum(math.ceil(n / PAGE_SIZE) for s, n in self._sequences.items() if s not in seq_ids)
        if pages * PAGE_SIZE > self.kv_cache_tokens:
            raise LLMError(f"the KV cache ({self.kv_cache_tokens} tokens) cannot hold these sequences")

    # --- the token loop --------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, **sampling) -> Generation:
        """Complete one prompt (text, or token ids); `sampling`: `SamplingParams` fields."""
        return self.generate_batch([prompt], max_new_tokens, **sampling)[0]

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 128,
                       **sampling) -> list[Generation]:
        """Complete several prompts together: one prefill, then every decode step batched
        (the timings are the batch's)."""
        requests = [self.request(p, max_new_tokens, **sampling) for p in prompts]
        clock = _Clock()
        for _ in clock.time(self._steps(requests)):
            pass
        return [self._result(r, clock) for r in requests]

    @staticmethod
    def _result(request: Request, clock: "_Clock") -> Generation:
        return Generation(request.new, request.text, request.finish_reason or "length",
                          len(request.prompt), clock.prefill_ms, clock.decode_ms)

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128,
               **sampling) -> Generator[str, None, Generation]:
        """The completion's text as it is made (a stop string's possible start is held back
        until ruled out); the generator's return value is the whole `Generation`."""
        request = self.request(prompt, max_new_tokens, **sampling)
        shown, clock = 0, _Clock()
        for _ in clock.time(self._steps([request])):
            visible = request.visible_text()
            if len(visible) > shown:
                yield visible[shown:]
                shown = len(visible)
        return self._result(request, clock)

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """A conversation (`[{"role": ..., "content": ...}]`) as token ids, in the model's
        chat template, ending where the assistant's answer starts."""
        text = self._tokenizer().apply_chat_template(list(messages), add_generation_prompt=True)
        return self._tokenizer().encode(text, add_special_tokens=False)

    def chat(self, messages: Sequence[dict], max_new_tokens: int = 256, **sampling) -> Generation:
        """The assistant's answer to a conversation."""
        return self.generate(self.chat_prompt(messages), max_new_tokens, **sampling)

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise LLMError("this model has no tokenizer: give token ids")
        return self.tokenizer

    def request(self, prompt: str | Sequence[int], max_new_tokens: int = 128, **sampling) -> Request:
        """A checked request (not yet in the KV cache): the prompt in the vocabulary and the
        context window, the sampling parameters valid."""
        if isinstance(prompt, str):
            ids = self._tokenizer().encode(prompt) if prompt else []
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise LLMError("the prompt is empty")
        if max_new_tokens < 1:
            raise LLMError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        try:
            params = SamplingParams(**sampling)
        except TypeError as err:
            raise LLMError(f"unknown sampling parameter: {err}") from err
        self._check_vocabulary(ids)
        if len(ids) >= self.context_window:
            raise LLMError(f"the prompt's {len(ids)} tokens do not fit the context window of "
                           f"{self.context_window} (with room for one new token)")
        return Request(ids, max_new_tokens, params, self.tokenizer, self.context_window)

    def _steps(self, requests: list[Request]) -> Iterator[None]:
        """Prefill every request, then decode until all are done; yields after each step."""
        if len(requests) > self.max_batch_size - len(self._sequences):
            raise LLMError(f"{len(requests)} requests do not fit: max_batch_size is {self.max_batch_size}")
        need = sum(math.ceil(min(len(r.prompt) + r.max_new_tokens, self.context_window) / PAGE_SIZE)
                   for r in requests)
        held = sum(math.ceil(n / PAGE_SIZE) for n in self._sequences.values())
        if (need + held) * PAGE_SIZE > self.kv_cache_tokens:
            raise LLMError(f"these requests need {need * PAGE_SIZE} tokens of KV cache; "
                           f"{self.kv_cache_tokens - held * PAGE_SIZE} are free")
        for r in requests:
            r.seq_id = self.add_sequence()
        try:
            logits = self.prefill([r.seq_id for r in requests], [r.prompt for r in requests])
            for r, row in zip(requests, logits):
                r.accept(r.choose(row))
            yield
            while True:
                active = [r for r in requests if not r.done]
                if not active:
                    return
                logits = self.decode([r.seq_id for r in active], [r.new[-1] for r in active])
                for r, row in zip(active, logits):
                    r.accept(r.choose(row))
                yield
        finally:
            for r in requests:
                if r.seq_id in self._sequences:
                    self.remove_sequence(r.seq_id)


class _Clock:
    """Times a token loop's steps: the first (prefill) apart from the rest (decode)."""

    def __init__(self) -> None:
        self.prefill_ms = self.decode_ms = 0.0

    def time(self, steps: Iterator[None]) -> Iterator[None]:
        start = time.perf_counter()
        for index, _ in enumerate(steps):
            now = time.perf_counter()
            if index == 0:
                self.prefill_ms = (now - start) * 1e3
            else:
                self.decode_ms += (now - start) * 1e3
            yield
            start = time.perf_counter()


def load_params(compiled: CompiledLLM, checkpoint: Checkpoint, device: tvm.runtime.Device) -> list:
    """The compiled model's parameters from the checkpoint, on the device, one at a time (the
    host copy of each is freed before the next is read)."""
    sources = quantized_sources(FAMILIES[compiled.config.family].weight_sources(compiled.config),
                                compiled.config)
    params, quantized = [], {}
    for spec in compiled.params:
        weight = quantized_weight(spec.name)
        source = sources.get(weight or spec.name)
        if source is None:
            raise WeightsError(f"the compiled model has a parameter '{spec.name}' that the "
                               f"{compiled.config.family} family does not define")
        if weight is not None:
            if spec.name not in quantized:  # the layer's arrays, made together
                quantized = load_quantized(weight, source, checkpoint, compiled.quantization)
            array = quantized.pop(spec.name)
        else:
            parts = [checkpoint.get(name) for name in source.names]
            array = np.concatenate(parts) if len(parts) > 1 else parts[0]
            if source.transposed:
                array = array.T
        if array.shape != spec.shape:
            raise WeightsError(f"{checkpoint.path.name}: tensor {' + '.join(source.names)} has shape "
                               f"{list(array.shape)}; the architecture needs {list(spec.shape)}")
        params.append(tvm.runtime.tensor(np.ascontiguousarray(array, dtype=spec.dtype), device))
        del array
    return params


def load(path: str | os.PathLike, target: TargetLike = DEFAULT_TARGET, quantization: str | None = None,
         *, compiled: str | os.PathLike | None = None, max_batch_size: int = 8,
         context_window: int | None = None, kv_cache_tokens: int | None = None) -> LLM:
    """A model from an HF folder or a GGUF file, ready to generate.

    The architecture is compiled for `target` once per machine (cached; `compiled` names an
    artifact from `LLM.export_compiled` instead, and its target and quantization are used).
    `quantization`: None (weights as float32), "q8" or "q4" (kept quantized in memory).
    `context_window` caps a sequence's tokens (default: the model's); `kv_cache_tokens` is the
    cache's room for all sequences together (default: one context window)."""
    checkpoint = open_checkpoint(path)
    if compiled is not None:
        built = load_compiled(compiled)
    else:
        built = compiled_for(checkpoint.config, target, quantization)
    return LLM(built, checkpoint, tokenizer_of(checkpoint), max_batch_size=max_batch_size,
               context_window=context_window, kv_cache_tokens=kv_cache_tokens)


def tokenizer_of(checkpoint: Checkpoint) -> Tokenizer | None:
    """The checkpoint's tokenizer: a GGUF's vocabulary, or an HF folder's tokenizer.json
    (None for a folder without one: such a model takes token ids)."""
    if checkpoint.gguf_reader is not None:
        return Tokenizer.from_gguf(checkpoint.gguf_reader)
    if (checkpoint.path / "tokenizer.json").exists():
        return Tokenizer.from_file(checkpoint.path)
    return None


__all__ = ["Generation", "LLM", "load", "load_params", "tokenizer_of"]
