"""The engine: a compiled architecture, its weights on the device, one paged KV cache, and the
token loop over it. Nothing here knows a family: every family exports the same functions
(`families.base`).

Sequences live in the KV cache by integer id. `prefill` packs the new tokens of several
sequences into one call (split into chunks the cache accepts), `decode` advances several
sequences by one token each, `popn` rolls a sequence back; `generate`, `generate_batch` and
`stream` are the token loop on top, with sampling and stop strings per request.

`load` refuses (`ResourceLimitError`), before compiling, a model whose weights and KV cache would
not fit in this machine's memory (`sizes.memory_need`) when it runs on the CPU here.

Every request is checked before it touches the cache (token ids inside the vocabulary, a
prompt that fits the context window, a batch that fits the cache), so a bad request raises
`LLMError` and the engine serves the next one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Generator, Iterable, Iterator, Sequence

import numpy as np
import tvm
from tvm import relax

from ..errors import LLMError, WeightsError, summary
from ..resources import require
from ..targets import DEFAULT_TARGET, TargetLike, lookup
from ..runtime.remote import RemoteDevice
from .compile import CompiledLLM, compiled_for, load_compiled
from .config import LLMConfig
from .hosts import LocalHost, RemoteHost
from .families import FAMILIES
from .quantization import load_quantized, quantized_sources, quantized_weight
from .request import Request, SpeculationStats
from .sampling import SamplingParams
from .sizes import memory_need
from .speculative import Draft, speculative_rounds
from .tokenizer import Tokenizer
from .weights import Checkpoint, open_checkpoint

PAGE_SIZE = 16
# Sequence id 0 is never handed out: TVM's page export and import work on sequence 0 only, so
# a sequence moving out is forked to 0 first, and one moving in arrives at 0 and is forked on.
TRANSFER_SLOT = 0



class _Builtins:
    """The VM's KV-cache builtins, from the engine's host."""

    def __init__(self, host: LocalHost | RemoteHost):
        get = host.function
        self.add_sequence = get("vm.builtin.kv_state_add_sequence")
        self.remove_sequence = get("vm.builtin.kv_state_remove_sequence")
        self.fork_sequence = get("vm.builtin.kv_state_fork_sequence")
        self.popn = get("vm.builtin.kv_state_popn")
        self.begin_forward = get("vm.builtin.kv_state_begin_forward")
        self.end_forward = get("vm.builtin.kv_state_end_forward")
        self.pages_metadata = get("vm.builtin.attention_kv_cache_get_checkpoint_metadata")
        self.export_pages = host.function_taking_tensors("vm.builtin.attention_kv_cache_export_page_group")
        self.prepare_import = get("vm.builtin.attention_kv_cache_prepare_import")
        self.import_pages = host.function_taking_tensors("vm.builtin.attention_kv_cache_import_page_group")
        self.finish_import = get("vm.builtin.attention_kv_cache_finish_import")


@dataclasses.dataclass
class Generation:
    """One request's result: the new tokens, their text, why it ended, and its metrics: time
    to first token (`prefill_ms`: prefill makes the first token), decode time, the draft's
    proposals and acceptances, and the KV-cache bytes moved between devices."""

    token_ids: list[int]
    text: str
    finish_reason: str          # "stop" (end token or stop string) or "length"
    prompt_tokens: int
    prefill_ms: float
    decode_ms: float
    speculation: SpeculationStats | None = None   # with a draft: proposed and accepted tokens
    kv_bytes_moved: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens made by decode steps (all but the first, which prefill makes) per second."""
        steps = len(self.token_ids) - 1
        return steps / (self.decode_ms / 1e3) if steps > 0 and self.decode_ms > 0 else 0.0

    @property
    def inter_token_ms(self) -> float:
        """Mean time between tokens after the first."""
        rate = self.decode_tokens_per_s
        return 1e3 / rate if rate else 0.0


@dataclasses.dataclass
class KVPages:
    """One sequence's KV cache in the cache's own page layout, as host arrays: to continue
    the sequence in another cache (another device, process or machine) without running its
    tokens again. `metadata` is the cache's description of them (JSON: layout hash, length,
    one entry per page group); a cache of another layout refuses them."""

    metadata: str
    groups: list[np.ndarray]

    @property
    def length(self) -> int:
        return int(json.loads(self.metadata)["seq_length"])

    @property
    def nbytes(self) -> int:
        return sum(group.nbytes for group in self.groups)


class LLM:
    """A loaded model: `generate`, `generate_batch`, `stream`, `chat`, and the KV-cache steps
    they are made of (`add_sequence`, `prefill`, `decode`, `popn`, `remove_sequence`)."""

    def __init__(self, compiled: CompiledLLM, checkpoint: Checkpoint, tokenizer: Tokenizer | None,
                 max_batch_size: int = 8, context_window: int | None = None,
                 kv_cache_tokens: int | None = None, remote: RemoteDevice | None = None):
        self.compiled, self.config, self.tokenizer = compiled, compiled.config, tokenizer
        if compiled.config != checkpoint.config:
            raise WeightsError(f"{checkpoint.path.name} is a different architecture than the compiled "
                               f"model: {checkpoint.config} vs {compiled.config}")
        self._host = RemoteHost(compiled, remote) if remote is not None else LocalHost(compiled)
        self.device, self.where = self._host.device, self._host.name
        self._builtins = _Builtins(self._host)
        self.context_window, self.kv_cache_tokens = cache_tokens(self.config, context_window, kv_cache_tokens)
        self.max_batch_size = max_batch_size
        self.prefill_chunk = min(2048, self.kv_cache_tokens)
        host = self._host
        self._vm = host.guard("load", lambda: relax.VirtualMachine(host.module, self.device))
        self._params = host.params(host.guard("copy weights", lambda: load_params(compiled, checkpoint, self.device)))
        self._kv = host.guard("create KV cache", lambda: self._vm["create_paged_kv_cache"](
            # one more sequence: the transfer slot
            *(host.shape([n]) for n in (max_batch_size + 1, self.kv_cache_tokens, self.prefill_chunk, PAGE_SIZE, 0))))
        self._sequences: dict[int, int] = {}   # id -> tokens in the cache
        self._next_id = TRANSFER_SLOT + 1

    def export_compiled(self, path: str | os.PathLike) -> None:
        """Write the compiled architecture (weights not included) for `load(..., compiled=path)`
        with this or any other checkpoint of the same architecture."""
        self.compiled.export(path)

    # --- KV-cache steps --------------------------------------------------------------------

    def add_sequence(self) -> int:
        """A new, empty sequence; returns its id."""
        seq_id = self._new_id()
        self._builtins.add_sequence(self._kv, seq_id)
        self._sequences[seq_id] = 0
        return seq_id

    def _new_id(self) -> int:
        """The id for one more sequence, if the cache has room for one."""
        if len(self._sequences) >= self.max_batch_size:
            raise LLMError(f"{self.max_batch_size} sequences are in the cache already (max_batch_size)")
        seq_id, self._next_id = self._next_id, self._next_id + 1
        return seq_id

    def remove_sequence(self, seq_id: int) -> None:
        self._check_sequences([seq_id])
        self._builtins.remove_sequence(self._kv, seq_id)
        del self._sequences[seq_id]

    def popn(self, seq_id: int, n: int) -> None:
        """Forget the last `n` tokens of a sequence (rejected draft tokens, an edited turn)."""
        self._check_sequences([seq_id])
        if not 0 <= n <= self._sequences[seq_id]:
            raise LLMError(f"cannot pop {n} tokens from a sequence of {self._sequences[seq_id]}")
        if n:
            self._builtins.popn(self._kv, seq_id, n)
            self._sequences[seq_id] -= n

    def export_sequence(self, seq_id: int) -> KVPages:
        """A copy of the sequence's KV pages (the sequence stays)."""
        self._check_sequences([seq_id])
        self._builtins.fork_sequence(self._kv, seq_id, TRANSFER_SLOT, -1)
        try:
            metadata = self._builtins.pages_metadata(self._kv, TRANSFER_SLOT)
            groups = []
            for group in json.loads(metadata)["groups"]:
                pages = tvm.runtime.empty(tuple(group["shape"]), group["dtype"], self.device)
                self._builtins.export_pages(self._kv, TRANSFER_SLOT, group["group_index"], pages)
                groups.append(self._host.guard("fetch KV pages", pages.numpy))
        finally:
            self._builtins.remove_sequence(self._kv, TRANSFER_SLOT)
        return KVPages(metadata, groups)

    def import_sequence(self, pages: KVPages) -> int:
        """A new sequence holding exported pages; returns its id."""
        seq_id = self._new_id()
        length = pages.length
        if length > self.context_window:
            raise LLMError(f"{length} tokens do not fit the context window of {self.context_window}")
        self._check_pages({**self._sequences, TRANSFER_SLOT: length})
        try:
            self._builtins.prepare_import(self._kv, TRANSFER_SLOT, pages.metadata)
            for group in json.loads(pages.metadata)["groups"]:
                array = pages.groups[group["group_index"]]
                on_device = self._host.guard("send KV pages", lambda: tvm.runtime.tensor(array, self.device))
                self._builtins.import_pages(self._kv, TRANSFER_SLOT, group["group_index"], on_device)
            self._builtins.finish_import(self._kv, TRANSFER_SLOT)
        except (RuntimeError, ValueError) as err:  # TVM errors: layout hash, shapes, room
            raise LLMError(f"these KV pages do not fit this model's cache: {summary(err)}") from err
        try:
            self._builtins.fork_sequence(self._kv, TRANSFER_SLOT, seq_id, -1)
        finally:
            self._builtins.remove_sequence(self._kv, TRANSFER_SLOT)
        self._sequences[seq_id] = length
        return seq_id

    def sequence_length(self, seq_id: int) -> int:
        self._check_sequences([seq_id])
        return self._sequences[seq_id]

    def kv_pages(self) -> tuple[int, int]:
        """(pages in use, pages in all) of the KV cache, `PAGE_SIZE` tokens a page: what a
        scheduler admits and preempts by, and what a server reports."""
        return pages_for(self._sequences.values()), self.kv_cache_tokens // PAGE_SIZE

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

    def score(self, seq_id: int, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens` to a sequence in one pass; the logits after each of them
        ([len(tokens), vocab]): how speculative decoding checks a draft's proposals."""
        if len(tokens) == 1:
            return self.decode([seq_id], tokens)
        if not 0 < len(tokens) <= self.prefill_chunk:
            raise LLMError(f"{len(tokens)} tokens to score; one pass takes 1 to {self.prefill_chunk}")
        self._check_sequences([seq_id])
        self._check_tokens([seq_id], [tokens])
        ids = np.asarray(tokens, dtype="int32")[None, :]
        return self._forward("prefill", [seq_id], [len(tokens)], ids, np.arange(len(tokens), dtype="int32"))[0]

    def decode(self, seq_ids: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Append one token to each sequence; their next-token logits ([len, vocab])."""
        self._check_sequences(seq_ids)
        self._check_tokens(seq_ids, [[t] for t in tokens])
        ids = np.asarray(tokens, dtype="int32").reshape(len(seq_ids), 1)
        return self._forward("decode", list(seq_ids), [1] * len(seq_ids), ids)[:, 0]

    def _forward(self, function: str, seq_ids: list[int], lengths: list[int], ids: np.ndarray,
                 logit_positions: np.ndarray | None = None) -> np.ndarray:
        host = self._host

        def run() -> np.ndarray:
            args = [tvm.runtime.tensor(ids, self.device)]
            if logit_positions is not None:
                args.append(tvm.runtime.tensor(logit_positions, self.device))
            result = self._vm[function](*args, self._kv, self._params)
            return host.item(result, 0).numpy()

        self._builtins.begin_forward(self._kv, host.shape(seq_ids), host.shape(lengths))
        logits = host.guard(function, run)
        self._builtins.end_forward(self._kv)
        for seq_id, n in zip(seq_ids, lengths):
            self._sequences[seq_id] += n
        return logits

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
        self._check_pages({**self._sequences, **{s: self._sequences[s] + len(t) for s, t in zip(seq_ids, tokens)}})

    def _check_pages(self, lengths: dict[int, int]) -> None:
        """Sequences of these lengths fit the cache's pages."""
        if pages_for(lengths.values()) * PAGE_SIZE > self.kv_cache_tokens:
            raise LLMError(f"the KV cache ({self.kv_cache_tokens} tokens) cannot hold these sequences")

    # --- the token loop --------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128,
                 speculative: Draft | None = None, **sampling) -> Generation:
        """Complete one prompt (text, or token ids); `sampling`: `SamplingParams` fields.
        With a `speculative` draft, decode checks the draft's proposals (the same tokens
        under greedy decoding, the same distribution when sampling)."""
        request = self.request(prompt, max_new_tokens, **sampling)
        return run_to_end(request, self._steps([request], speculative))

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 128,
                       **sampling) -> list[Generation]:
        """Complete several prompts together: one prefill, then every decode step batched
        (the timings are the batch's)."""
        requests = [self.request(p, max_new_tokens, **sampling) for p in prompts]
        clock = _Clock()
        for _ in clock.time(self._steps(requests)):
            pass
        return [_generation(r, clock) for r in requests]

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128,
               speculative: Draft | None = None, **sampling) -> Generator[str, None, Generation]:
        """The completion's text as it is made (a stop string's possible start is held back
        until ruled out); the generator's return value is the whole `Generation`."""
        request = self.request(prompt, max_new_tokens, **sampling)
        return stream_text(request, self._steps([request], speculative))

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

    def _steps(self, requests: list[Request], draft: Draft | None = None) -> Iterator[None]:
        """Prefill every request, then decode until all are done (with a draft: speculative
        rounds, one request); yields after each step."""
        self.check_room(requests)
        try:
            for r in requests:
                r.seq_id = self.add_sequence()
            self.start(requests)
            yield
            yield from self.advance(requests, draft)
        finally:
            self.release(requests)

    def check_room(self, requests: Sequence[Request]) -> None:
        """The requests fit the cache whole (each to its token budget), next to what is in it."""
        if len(requests) > self.max_batch_size - len(self._sequences):
            raise LLMError(f"{len(requests)} requests do not fit: max_batch_size is {self.max_batch_size}")
        need = pages_for(min(len(r.prompt) + r.max_new_tokens, self.context_window) for r in requests)
        held = pages_for(self._sequences.values())
        if (need + held) * PAGE_SIZE > self.kv_cache_tokens:
            raise LLMError(f"these requests need {need * PAGE_SIZE} tokens of KV cache; "
                           f"{self.kv_cache_tokens - held * PAGE_SIZE} are free")

    def start(self, requests: Sequence[Request]) -> None:
        """Prefill the requests' prompts (their sequences added) and take each one's first token."""
        logits = self.prefill([r.seq_id for r in requests], [r.prompt for r in requests])
        for r, row in zip(requests, logits):
            r.accept(r.choose(row))

    def advance(self, requests: Sequence[Request], draft: Draft | None = None) -> Iterator[None]:
        """Decode started requests (their last token not in the cache yet) until all are done;
        yields after each step. With a draft: speculative rounds, one request."""
        if draft is not None:
            (request,) = requests
            request.speculation = SpeculationStats()
            yield from speculative_rounds(self, request, draft, request.speculation)
            return
        while True:
            active = [r for r in requests if not r.done]
            if not active:
                return
            logits = self.decode([r.seq_id for r in active], [r.new[-1] for r in active])
            for r, row in zip(active, logits):
                r.accept(r.choose(row))
            yield

    def release(self, requests: Sequence[Request]) -> None:
        """Remove the requests' sequences (those still in the cache)."""
        for r in requests:
            if r.seq_id in self._sequences:
                self.remove_sequence(r.seq_id)


def pages_for(lengths: Iterable[int]) -> int:
    """KV-cache pages that sequences of these lengths take."""
    return sum(math.ceil(n / PAGE_SIZE) for n in lengths)


def run_to_end(request: Request, steps: Iterator[None]) -> Generation:
    """Run a request's steps (prefill first) to the end; its result and timings."""
    clock = _Clock()
    for _ in clock.time(steps):
        pass
    return _generation(request, clock)


def stream_text(request: Request, steps: Iterator[None]) -> Generator[str, None, Generation]:
    """Run a request's steps, yielding its text as it becomes visible; returns its result."""
    shown, clock = 0, _Clock()
    for _ in clock.time(steps):
        visible = request.visible_text()
        if len(visible) > shown:
            yield visible[shown:]
            shown = len(visible)
    return _generation(request, clock)


def _generation(request: Request, clock: "_Clock") -> Generation:
    return Generation(request.new, request.text, request.finish_reason or "length", len(request.prompt),
                      clock.prefill_ms, clock.decode_ms, request.speculation, request.kv_bytes_moved)


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


def cache_tokens(config: LLMConfig, context_window: int | None, kv_cache_tokens: int | None) -> tuple[int, int]:
    """(a sequence's most tokens, the KV cache's tokens): the model's context window unless
    capped by `context_window`, and room for one window unless `kv_cache_tokens` is given."""
    window = min(context_window or config.context_length, config.context_length)
    return window, kv_cache_tokens or window


def load(path: str | os.PathLike, target: TargetLike = DEFAULT_TARGET, quantization: str | None = None,
         *, compiled: str | os.PathLike | None = None, max_batch_size: int = 8,
         context_window: int | None = None, kv_cache_tokens: int | None = None,
         layers: int | None = None, remote: RemoteDevice | None = None,
         records: str | os.PathLike | None = None) -> LLM:
    """A model from an HF folder or a GGUF file, ready to generate.

    The architecture is compiled for `target` once per machine (cached; `compiled` names an
    artifact from `LLM.export_compiled` instead, and its target and quantization are used).
    `quantization`: None (weights as float32), "q8" or "q4" (kept quantized in memory).
    `context_window` caps a sequence's tokens (default: the model's); `kv_cache_tokens` is the
    cache's room for all sequences together (default: one context window). `layers` keeps
    only the first decoder layers: the model cut short, as a draft for speculative decoding.
    `remote`: run on an RPC server's device instead (weights are read here and copied there).
    `records`: a records directory whose tuning records and kernel selection the compile
    applies (`select_llm_kernels` stores one)."""
    checkpoint = open_checkpoint(path)
    if layers is not None:
        checkpoint = checkpoint.first_layers(layers)
    built = load_compiled(compiled) if compiled is not None else None
    device = built.runtime.device() if built is not None else lookup(target)[0].device()
    if remote is None and device.dlpack_device_type() == tvm.cpu().dlpack_device_type():
        # Weights and KV cache in this machine's memory: refused before compiling if too big.
        tokens = cache_tokens(checkpoint.config, context_window, kv_cache_tokens)[1]
        require(memory_need(checkpoint.config, built.quantization if built else quantization, tokens),
                f"loading {os.fspath(path)}")
    if built is None:
        built = compiled_for(checkpoint.config, target, quantization, records)
    return LLM(built, checkpoint, tokenizer_of(checkpoint), max_batch_size=max_batch_size,
               context_window=context_window, kv_cache_tokens=kv_cache_tokens, remote=remote)


def tokenizer_of(checkpoint: Checkpoint) -> Tokenizer | None:
    """The checkpoint's tokenizer: a GGUF's vocabulary, or an HF folder's tokenizer.json
    (None for a folder without one: such a model takes token ids)."""
    if checkpoint.gguf_reader is not None:
        return Tokenizer.from_gguf(checkpoint.gguf_reader)
    if (checkpoint.path / "tokenizer.json").exists():
        return Tokenizer.from_file(checkpoint.path)
    return None


__all__ = ["Generation", "LLM", "load", "load_params", "tokenizer_of"]
