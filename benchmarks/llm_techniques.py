"""`benchmarks/llm.py --speculative` and `--disaggregated`: our engine against itself, each
technique beside the plain run in the same process and the same settled block.

--speculative: greedy decode tokens/s of SmolLM2 (float32, llvm) on a fixed prompt set (code,
chat, a summary of a given text, where prompt lookup shines), plain and with each draft
(prompt lookup; the model's own Q8 copy), with acceptance rates and a check that the tokens
are the plain run's.

--disaggregated: time to first token and decode tokens/s of one-device runs and of prefill on
one device with decode on the other (llvm and vulkan here), beside what the stage cost model
(`gimlet_tvm.llm.stages`) predicted for the same request.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

import gimlet_tvm.llm as gllm
from gimlet_tvm.llm.stages import Workload, place_stages
from gimlet_tvm.targets import lookup

GIVEN_TEXT = (
    "The James Webb Space Telescope is a space telescope designed to conduct infrared "
    "astronomy. Its high-resolution and high-sensitivity instruments allow it to view objects "
    "too old, distant, or faint for the Hubble Space Telescope. This enables investigations "
    "across many fields of astronomy and cosmology, such as observation of the first stars and "
    "the formation of the first galaxies, and detailed atmospheric characterization of "
    "potentially habitable exoplanets. The telescope was launched on 25 December 2021 and "
    "arrived at the Sun-Earth L2 Lagrange point in January 2022.")
PROMPTS = {
    "summary": f"Summarize this text, quoting its key sentences:\n\n{GIVEN_TEXT}",
    "repeat": f"Repeat this text exactly:\n\n{GIVEN_TEXT}",
    "code": "Write a Python function that checks whether a string is a palindrome, with a docstring "
            "and three doctest examples.",
    "chat": "What are three good habits for a healthy sleep schedule?",
}
LOOKUP_FRIENDLY = ("summary", "repeat")


def _stats(values: list[float]) -> dict:
    arr = np.asarray(values, dtype=float)
    return {"median": float(np.median(arr)), "p10": float(np.percentile(arr, 10)),
            "p90": float(np.percentile(arr, 90)), "values": list(values)}


def speculative(gguf: str, new_tokens: int, repeat: int, k: int, log: Callable[[str], None]) -> tuple[str, dict]:
    """The --speculative table and its numbers. The plain run and each draft's run take
    turns, `repeat` rounds, so load from elsewhere falls on all alike; a speed-up is the
    median of the rounds' ratios."""
    llm = gllm.load(gguf, target="llvm")
    drafts = {"prompt lookup": gllm.Draft("prompt-lookup", k=k),
              "Q8 copy": gllm.Draft(gllm.load(gguf, target="llvm", quantization="q8"), k=k)}
    rows, results = [], {}
    for name, text in PROMPTS.items():
        ids = llm.chat_prompt([{"role": "user", "content": text}])
        llm.generate(ids, max_new_tokens=8)  # settle
        runs: dict[str, list[gllm.Generation]] = {"plain": [], **{d: [] for d in drafts}}
        for _ in range(repeat):
            runs["plain"].append(llm.generate(ids, max_new_tokens=new_tokens))
            for draft_name, draft in drafts.items():
                runs[draft_name].append(llm.generate(ids, max_new_tokens=new_tokens, speculative=draft))
        plain_rates = [g.decode_tokens_per_s for g in runs["plain"]]
        plain = _stats(plain_rates)
        results[name] = {"plain": plain, "tokens": len(runs["plain"][0].token_ids)}
        cells = [name, str(len(ids)), f"{plain['median']:.1f} ({plain['p10']:.1f}-{plain['p90']:.1f})"]
        for draft_name in drafts:
            rates = [g.decode_tokens_per_s for g in runs[draft_name]]
            speedup = _stats([r / p for r, p in zip(rates, plain_rates)])
            same = all(g.token_ids == runs["plain"][0].token_ids for g in runs[draft_name])
            acceptance = runs[draft_name][0].speculation.acceptance_rate
            results[name][draft_name] = {"decode": _stats(rates), "speedup": speedup,
                                         "acceptance": acceptance, "same_tokens": same}
            cells += [f"{np.median(rates):.1f}", f"{speedup['median']:.2f}x ({speedup['p10']:.2f}-{speedup['p90']:.2f})",
                      f"{acceptance:.0%}", "yes" if same else "NO"]
            log(f"{name} / {draft_name}: {speedup['median']:.2f}x, acceptance {acceptance:.0%}")
        rows.append(cells)
    head = ["prompt", "prompt tokens", "plain tok/s"]
    for draft_name in drafts:
        head += [f"{draft_name} tok/s", "speed-up", "accepted", "same tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    note = (f"\nSmolLM2-135M float32 on llvm, greedy, {new_tokens} new tokens, k={k} proposals a round at "
            f"most; decode tokens/s median (p10-p90) of {repeat} rounds, a speed-up is the median "
            f"(p10-p90) of the rounds' ratios; prompt-lookup-friendly: {', '.join(LOOKUP_FRIENDLY)}.")
    return "\n".join(lines) + note, results


def _time_to_first_token(run: Callable[[], gllm.Generation], repeat: int) -> tuple[dict, dict]:
    runs = [run() for _ in range(repeat)]
    return _stats([g.prefill_ms for g in runs]), _stats([g.decode_tokens_per_s for g in runs])


def disaggregated(gguf: str, new_tokens: int, repeat: int, log: Callable[[str], None]) -> tuple[str, dict]:
    """The --disaggregated table and its numbers."""
    devices = ["llvm", "vulkan"]
    facts = {name: lookup(name)[0].perf_facts() for name in devices}
    prompt = PROMPTS["chat"]  # short: lavapipe prefills a row at a time
    plans = [("llvm", "llvm"), ("vulkan", "vulkan"), ("vulkan", "llvm"), ("llvm", "vulkan")]
    rows, results = [], {}
    for prefill, decode in plans:
        log(f"prefill on {prefill}, decode on {decode} ...")
        model = gllm.load(gguf, targets=devices, pins={"prefill": prefill, "decode": decode})
        ids = model.decoder.chat_prompt([{"role": "user", "content": prompt}])
        workload = Workload(prompt_tokens=len(ids), new_tokens=new_tokens)
        placed = place_stages(model.config, None, facts, workload, {"prefill": prefill, "decode": decode})
        model.generate(ids, max_new_tokens=2)  # settle
        ttft, decode_rate = _time_to_first_token(lambda: model.generate(ids, max_new_tokens=new_tokens), repeat)
        predicted_ttft = placed.predicted["prefill_s"] * 1e3
        predicted_rate = 1 / placed.predicted["decode_step_s"]
        results[f"{prefill}->{decode}"] = {"ttft_ms": ttft, "decode": decode_rate,
                                           "predicted_ttft_ms": predicted_ttft,
                                           "predicted_decode": predicted_rate,
                                           "move_ms": placed.predicted["move_s"] * 1e3}
        rows.append([prefill, decode, f"{ttft['median']:.0f} ({ttft['p10']:.0f}-{ttft['p90']:.0f})",
                     f"{predicted_ttft:.0f}", f"{decode_rate['median']:.2f}", f"{predicted_rate:.1f}",
                     f"{placed.predicted['move_s'] * 1e3:.2f}"])
    chosen = place_stages(model.config, None, facts, Workload(len(ids), new_tokens)).devices
    head = ["prefill", "decode", "TTFT ms", "model's TTFT ms", "decode tok/s", "model's tok/s", "model's move ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    note = (f"\nSmolLM2-135M float32, prompt of {len(ids)} tokens, {new_tokens} new tokens, median (p10-p90) "
            f"of {repeat} runs. The cost model's own choice for this request: prefill on "
            f"{chosen['prefill']}, decode on {chosen['decode']}.")
    return "\n".join(lines) + note, {"plans": results, "model_choice": chosen}

