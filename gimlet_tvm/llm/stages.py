"""A model on several devices: prefill on one, decode on another, the draft where it is cheapest,
each stage placed by a cost model.

Prefill is compute-bound (every weight meets a whole prompt), decode memory-bound (every weight
is read again for one token), so the device that prefills best need not decode best. Moving a
prefilled sequence costs its KV pages over the devices' links (`relax_passes.placement`'s copy
model). For a request of P prompt tokens and G new ones, each (prefill device, decode device)
pair costs

    prefill(P) + move(KV of P tokens) + G x decode step

from each device's roofline (`TargetSpec.perf_facts`, or facts given instead): a pass is the
larger of its arithmetic and its memory traffic, plus a kernel launch per kernel. The cheapest
pair wins; a draft model goes where its own decode step is cheapest (it exchanges only token
ids with the model). `pins` overrides any stage. The decision and its reasons are in
`SplitLLM.placement()`; `benchmarks/llm.py --disaggregated` sets the prediction beside the
measured times.

The sequence moves once, after prefill, in the cache's own page layout (`LLM.export_sequence`
and `import_sequence`), so decode continues exactly where prefill ended.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Generator, Iterator, Mapping, Sequence

from ..errors import LLMError
from ..relax_passes.placement import copy_seconds
from ..targets import DEFAULT_TARGET, TargetLike, lookup
from ..targets.spec import PerfFacts
from .config import LLMConfig
from .engine import LLM, Generation, KVPages, load as load_one, run_to_end, stream_text
from .request import Request
from .sizes import kv_bytes, macs_per_token, weight_bytes
from .speculative import Draft
from .weights import open_checkpoint

STAGES = ("prefill", "decode", "draft")
# The kernels one decoder layer launches (two norms, the projections, attention, the MLP):
# what a device's launch cost is paid for, per layer and pass.
KERNELS_PER_LAYER = 12


@dataclasses.dataclass(frozen=True)
class Workload:
    """The request the placement is made for: its prompt and new tokens."""

    prompt_tokens: int = 512
    new_tokens: int = 128


def pass_seconds(config: LLMConfig, quantization: str | None, perf: PerfFacts, tokens: int,
                 context: int) -> float:
    """One forward pass over `tokens` new tokens after `context` cached ones, on a roofline."""
    flops = 2 * macs_per_token(config) * tokens
    traffic = weight_bytes(config, quantization) + kv_bytes(config, context + tokens)
    launches = config.num_layers * KERNELS_PER_LAYER * perf.launch_us * 1e-6
    return max(flops / (perf.peak_gflops * 1e9), traffic / (perf.memory_gbps * 1e9)) + launches


@dataclasses.dataclass
class StagePlacement:
    """Where each stage runs, what the model predicted, and why."""

    devices: dict[str, str]                  # stage -> target name
    predicted: dict[str, float]              # prefill_s, move_s, decode_step_s, total_s
    reasons: dict[str, str]

    def describe(self) -> str:
        return "\n".join(f"{stage}: {self.devices[stage]} ({self.reasons[stage]})" for stage in self.devices)


def place_stages(config: LLMConfig, quantization: str | None, facts: Mapping[str, PerfFacts],
                 workload: Workload = Workload(), pins: Mapping[str, str] | None = None,
                 draft: tuple[LLMConfig, str | None] | None = None) -> StagePlacement:
    """The cheapest (prefill, decode) pair of devices for `workload`, and the draft's device
    (`draft`: its config and quantization) — each unless pinned."""
    pins = dict(pins or {})
    unknown = {stage: name for stage, name in pins.items() if stage not in STAGES or name not in facts}
    if unknown:
        raise LLMError(f"pins must map {', '.join(STAGES)} to one of {', '.join(facts)}, not {unknown}")
    names = list(facts)
    p, g = workload.prompt_tokens, workload.new_tokens

    def prefill(name: str) -> float:
        return pass_seconds(config, quantization, facts[name], p, 0)

    def step(name: str) -> float:
        return pass_seconds(config, quantization, facts[name], 1, p + g // 2)

    def move(src: str, dst: str) -> float:
        return copy_seconds(kv_bytes(config, p), facts[src], facts[dst]) if src != dst else 0.0

    pairs = [(a, b) for a, b in itertools.product(names, names)
             if pins.get("prefill", a) == a and pins.get("decode", b) == b]
    cost = {(a, b): prefill(a) + move(a, b) + g * step(b) for a, b in pairs}
    first, then = min(pairs, key=lambda pair: (cost[pair], names.index(pair[0]), names.index(pair[1])))
    others = lambda measure, chosen: ", ".join(f"{n}: {measure(n) * 1e3:.1f} ms" for n in names if n != chosen)
    reasons = {
        "prefill": f"{p} tokens in {prefill(first) * 1e3:.1f} ms" + (f"; {others(prefill, first)}" if len(names) > 1 else ""),
        "decode": f"{step(then) * 1e3:.2f} ms a token" + (f"; {others(step, then)}" if len(names) > 1 else ""),
    }
    if first != then:
        reasons["decode"] += f"; moving the KV cache costs {move(first, then) * 1e3:.2f} ms"
    for stage in ("prefill", "decode"):
        if stage in pins:
            reasons[stage] = "pinned; " + reasons[stage]
    devices = {"prefill": first, "decode": then}
    if draft is not None:
        draft_config, draft_quantization = draft
        draft_step = lambda n: pass_seconds(draft_config, draft_quantization, facts[n], 1, p + g // 2)
        devices["draft"] = pins.get("draft") or min(names, key=lambda n: (draft_step(n), names.index(n)))
        reasons["draft"] = (("pinned; " if "draft" in pins else "") +
                            f"{draft_step(devices['draft']) * 1e3:.2f} ms a proposal")
    predicted = {"prefill_s": prefill(first), "move_s": move(first, then), "decode_step_s": step(then),
                 "total_s": cost[(first, then)]}
    return StagePlacement(devices, predicted, reasons)


class SplitLLM:
    """One model on several devices, its stages placed by `place_stages`: `generate` and
    `stream` prefill on one engine and decode on another, moving the sequence's KV pages once."""

    def __init__(self, engines: Mapping[str, LLM], placement: StagePlacement, facts: Mapping[str, PerfFacts],
                 workload: Workload = Workload(), pins: Mapping[str, str] | None = None):
        self.engines, self._placement = dict(engines), placement  # the devices a stage uses
        self.facts, self.workload, self.pins = dict(facts), workload, dict(pins or {})
        self.prefiller = self.engines[self._placement.devices["prefill"]]
        self.decoder = self.engines[self._placement.devices["decode"]]
        self.config, self.tokenizer = self.decoder.config, self.decoder.tokenizer
        self.kv_bytes_moved = 0

    @classmethod
    def from_engines(cls, prefill: LLM, decode: LLM) -> "SplitLLM":
        """Prefill on one loaded engine and decode on another, as given (the engines may be in
        other processes: `load(..., remote=...)`)."""
        if prefill.config != decode.config:
            raise LLMError("the prefill and decode engines hold different architectures")
        devices = {"prefill": prefill.where, "decode": decode.where}
        placement = StagePlacement(devices, {}, {"prefill": "given", "decode": "given"})
        return cls({prefill.where: prefill, decode.where: decode}, placement, {})

    def placement(self) -> StagePlacement:
        return self._placement

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128,
                 speculative: Draft | None = None, **sampling) -> Generation:
        """As `LLM.generate`, prefill and decode on their devices."""
        request = self.decoder.request(prompt, max_new_tokens, **sampling)
        return run_to_end(request, self._steps(request, speculative))

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128,
               speculative: Draft | None = None, **sampling) -> Generator[str, None, Generation]:
        """As `LLM.stream`, prefill and decode on their devices."""
        request = self.decoder.request(prompt, max_new_tokens, **sampling)
        return stream_text(request, self._steps(request, speculative))

    def chat(self, messages: Sequence[dict], max_new_tokens: int = 256, **sampling) -> Generation:
        return self.generate(self.decoder.chat_prompt(messages), max_new_tokens, **sampling)

    def _steps(self, request: Request, draft: Draft | None) -> Iterator[None]:
        self.decoder.check_room([request])
        pages = self._prefill(request)
        yield
        if request.done:
            return
        request.seq_id = self.decoder.import_sequence(pages)
        request.kv_bytes_moved = pages.nbytes
        self.kv_bytes_moved += pages.nbytes
        try:
            yield from self.decoder.advance([request], draft)
        finally:
            self.decoder.release([request])

    def _prefill(self, request: Request) -> KVPages:
        """Prefill on the prefill device; the sequence's pages, taken off it."""
        engine = self.prefiller
        engine.check_room([request])
        try:
            request.seq_id = engine.add_sequence()
            engine.start([request])
            return engine.export_sequence(request.seq_id)
        finally:
            engine.release([request])

    def draft(self, path: str | os.PathLike, quantization: str | None = None, layers: int | None = None,
              k: int = 4) -> Draft:
        """A draft model (same vocabulary) loaded on the device the placement picks for it."""
        if not self.facts:
            raise LLMError("engines given as they are have no device facts to place a draft by: "
                           "load the draft model and pass Draft(model)")
        checkpoint = open_checkpoint(path)
        config = (checkpoint.first_layers(layers) if layers else checkpoint).config
        placed = place_stages(self.config, self.decoder.compiled.quantization, self.facts, self.workload,
                              {**self._placement.devices, **self.pins}, draft=(config, quantization))
        self._placement = placed
        return Draft(load_one(path, placed.devices["draft"], quantization, layers=layers), k=k)


def load(path: str | os.PathLike, target: TargetLike = DEFAULT_TARGET, quantization: str | None = None,
         *, targets: Sequence[TargetLike] | None = None, pins: Mapping[str, str] | None = None,
         device_facts: Mapping[str, PerfFacts] | None = None, workload: Workload = Workload(),
         **options) -> LLM | SplitLLM:
    """A model ready to generate: on `target` (an `LLM`), or with `targets` on several devices,
    prefill and decode placed by cost (a `SplitLLM`; `pins` such as `{"decode": "llvm"}`
    override the model, `device_facts` replace the targets' rooflines). `options` go to each
    device's `engine.load` (`max_batch_size`, `context_window`, ...)."""
    if targets is None:
        return load_one(path, target, quantization, **options)
    names = [lookup(t)[0].name for t in targets]
    facts = {name: (device_facts or {}).get(name) or lookup(name)[0].perf_facts() for name in names}
    placement = place_stages(open_checkpoint(path).config, quantization, facts, workload, pins)
    used = dict.fromkeys(placement.devices[stage] for stage in ("prefill", "decode"))
    engines = {name: load_one(path, name, quantization, **options) for name in used}
    return SplitLLM(engines, placement, facts, workload, pins)
