"""A kernel generator for the tests: `python scripted_generator.py PLAN,PLAN,...` answers round
r of an op group by the r-th PLAN, each a '+'-joined list of kernels, or one misbehaviour:

    good  wrong  uninit  loop  fork   C GEMMs for the task's shapes (matmul without epilogue):
    oob  oobwrite  before  stray      right; off by one element; the first output element never
                                      written; an endless loop; a fork() call (never reached on
                                      real inputs: only its presence is under test); reading
                                      one element past the end of b; writing one past the end
                                      of c; reading one element before the start of a; writing
                                      far from every operand
    tvmscript                         a right GEMM in TVMScript
    gpu  gpunozero                    TVMScript GEMMs for GPU targets (a thread an element of c,
                                      64 a block): right; one that never zeroes c
    tasks  splitk                     C GEMMs in 3 tasks: right (rows split between the tasks);
                                      a race (K split, each task adding its part into c,
                                      which task 0 zeroes first)
    conv  convnopad                   C conv2ds for the task's conv (no epilogue): right; one
                                      that forgets the padding (reads outside data at its edges)
    attention  attentionnoscale       C attentions for the task's (with its bias, if any): right;
                                      one that forgets the scale
    norm  normnoeps  normunbiased     C layer or RMS norms for the task's: right (two passes);
    normonepass  normoob              one that forgets epsilon; one that divides the variance by
                                      size - 1; one that takes it as E[x^2] - E[x]^2 in float32;
                                      one that reads one element past the end of gamma
    gemv  gemvnoscale  gemvunsigned   C Q8_0 dequantizing GEMVs for the task's (with its bias, if
                                      any): right; one that ignores the scales; one that reads the
                                      quants as unsigned
    malformed  notlist  exit  hang    not JSON; JSON but no list of candidates; exit code 3; sleep

With GIMLET_TEST_TASKS=DIR, every task it reads is saved there as round<r>.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

# The bundled search generator's file, loaded on its own: importing it through the package
# would import TVM, and this generator must start in well under a second.
_SEARCH = Path(__file__).resolve().parents[1] / "gimlet_tvm" / "selection" / "search_generator.py"
_spec = importlib.util.spec_from_file_location("search_generator", _SEARCH)
search_generator = sys.modules.setdefault("search_generator", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(search_generator)

C_GEMM = """
#include <unistd.h>
void kernel(const float *a, const float *b, float *c) {{
  {prelude}
  for (int i = {first}; i < {m} * {n}; ++i) {{
    float sum = 0.0f;
    for (int kk = 0; kk < {k}; ++kk) sum += a[(i / {n}) * {k} + kk] * b[kk * {n} + i % {n}];
    c[i] = sum;
  }}
  {after}
}}
"""
C_KERNELS = {
    "good": {},
    "wrong": {"after": "c[{m} * {n} - 1] += 1.0f;"},
    "uninit": {"first": "1"},
    "loop": {"prelude": "volatile int spin = 1; while (spin) {{}}"},
    "fork": {"prelude": "if (a[0] == 1234.5f && b[0] == -1234.5f) fork();"},
    "oob": {"after": "c[0] += 0.0f * b[{k} * {n}];"},
    "oobwrite": {"after": "c[{m} * {n}] = 0.0f;"},
    "before": {"after": "c[0] += 0.0f * a[-1];"},
    "stray": {"after": "c[(long)1 << 41] = 1.0f;"},
}
TVMSCRIPT_GPU = """
# from tvm.script import tirx as T

@T.prim_func
def gemm(a: T.Buffer(({m}, {k}), "float32"), b: T.Buffer(({k}, {n}), "float32"),
         c: T.Buffer(({m}, {n}), "float32")):
    T.func_attr({{"tir.noalias": True, "tirx.is_scheduled": True}})
    for block in T.thread_binding(({m} * {n} + 63) // 64, thread="blockIdx.x"):
        for thread in T.thread_binding(64, thread="threadIdx.x"):
            if block * 64 + thread < {m} * {n}:
                {zero}
                for kk in range({k}):
                    c[(block * 64 + thread) // {n}, (block * 64 + thread) % {n}] = (
                        c[(block * 64 + thread) // {n}, (block * 64 + thread) % {n}]
                        + a[(block * 64 + thread) // {n}, kk] * b[kk, (block * 64 + thread) % {n}])
"""
GPU_ZERO = {"gpu": "c[(block * 64 + thread) // {n}, (block * 64 + thread) % {n}] = T.float32(0)",
            "gpunozero": "T.evaluate(0)"}
C_TASKS = """
#include <stdint.h>
void kernel(int64_t task, int64_t tasks, const float *a, const float *b, float *c) {{
  {body}
}}
"""
TASK_BODIES = {
    "tasks": """for (int64_t i = {m} * task / tasks; i < {m} * (task + 1) / tasks; ++i)
    for (int j = 0; j < {n}; ++j) {{
      float sum = 0.0f;
      for (int kk = 0; kk < {k}; ++kk) sum += a[i * {k} + kk] * b[kk * {n} + j];
      c[i * {n} + j] = sum;
    }}""",
    "splitk": """if (task == 0)
    for (int i = 0; i < {m} * {n}; ++i) c[i] = 0.0f;
  for (int i = 0; i < {m} * {n}; ++i) {{
    float sum = 0.0f;
    for (int64_t kk = {k} * task / tasks; kk < {k} * (task + 1) / tasks; ++kk)
      sum += a[(i / {n}) * {k} + kk] * b[kk * {n} + i % {n}];
    c[i] += sum;
  }}""",
}
TASKS = 3
C_CONV = """
void kernel(const float *data, const float *weight, float *out) {{
  for (int n = 0; n < {n}; ++n)
    for (int o = 0; o < {o}; ++o)
      for (int y = 0; y < {oh}; ++y)
        for (int x = 0; x < {ow}; ++x) {{
          int group = o / ({o} / {groups}), per_group = {c} / {groups};
          float sum = 0.0f;
          for (int ci = 0; ci < per_group; ++ci)
            for (int i = 0; i < {kh}; ++i)
              for (int j = 0; j < {kw}; ++j) {{
                int r = y * {stride[0]} - {pad[0]} + i * {dilation[0]};
                int s = x * {stride[1]} - {pad[1]} + j * {dilation[1]};
                if ({inside})
                  sum += data[((n * {c} + group * per_group + ci) * {h} + r) * {w} + s]
                         * weight[((o * per_group + ci) * {kh} + i) * {kw} + j];
              }}
          out[((n * {o} + o) * {oh} + y) * {ow} + x] = sum;
        }}
}}
"""
CONV_INSIDE = {"conv": "r >= 0 && r < {h} && s >= 0 && s < {w}", "convnopad": "1"}
C_ATTENTION = """
#include <math.h>
void kernel(const float *q, const float *k, const float *v, {bias_arg}float *out) {{
  for (int b = 0; b < {b}; ++b)
    for (int s = 0; s < {s}; ++s)
      for (int n = 0; n < {n}; ++n) {{
        float p[{t}], top = -INFINITY, total = 0.0f;
        for (int t = 0; t < {t}; ++t) {{
          float dot = 0.0f;
          for (int h = 0; h < {h}; ++h) dot += q[((b * {s} + s) * {n} + n) * {h} + h] * k[((b * {t} + t) * {n} + n) * {h} + h];
          p[t] = dot * {scaled} {bias_term};
          top = p[t] > top ? p[t] : top;
        }}
        for (int t = 0; t < {t}; ++t) {{ p[t] = expf(p[t] - top); total += p[t]; }}
        for (int j = 0; j < {hv}; ++j) {{
          float sum = 0.0f;
          for (int t = 0; t < {t}; ++t) sum += p[t] * v[((b * {t} + t) * {n} + n) * {hv} + j];
          out[((b * {s} + s) * {n} + n) * {hv} + j] = sum / total;
        }}
      }}
}}
"""


def attention_kernel(plan: str, sizes: dict) -> str:
    """The C attention of `plan` for the task's `attention` sizes."""
    bias_arg, bias_term = "", ""
    if sizes["bias"] is not None:
        bias_arg, bias_term = "const float *bias, ", f"+ bias[{search_generator.broadcast_index(['b', 'n', 's', 't'], sizes['bias'])}]"
    scaled = repr(sizes["scale"]) + "f" if plan == "attention" else "1.0f"
    return C_ATTENTION.format(**sizes, bias_arg=bias_arg, bias_term=bias_term, scaled=scaled)
C_NORM = """
#include <math.h>
void kernel(const float *x, const float *gamma, {beta_arg}float *out) {{
  for (int r = 0; r < {rows}; ++r) {{
    const float *row = x + r * {size};
    float mean = 0.0f, var = 0.0f, squares = 0.0f;
    for (int i = 0; i < {size}; ++i) {{ mean += row[i]; squares += row[i] * row[i]; }}
    mean = {centered} ? mean / {size} : 0.0f;
    for (int i = 0; i < {size}; ++i) var += (row[i] - mean) * (row[i] - mean);
    var = {variance};
    float scale = 1.0f / sqrtf(var + {epsilon});
    for (int i = 0; i < {size}; ++i) out[r * {size} + i] = (row[i] - mean) * scale * gamma[i]{beta_term};
  }}
  {after}
}}
"""
NORM_VARIANTS = {"normunbiased": {"variance": "var / ({size} - 1)"},
                 "normonepass": {"variance": "squares / {size} - mean * mean"},
                 "normnoeps": {"epsilon": "0.0f"},
                 "normoob": {"after": "out[0] += 0.0f * gamma[{size}];"}}


def norm_kernel(plan: str, sizes: dict, op: str) -> str:
    """The C layer norm (`op` "layer_norm") or RMS norm of `plan` for the task's norm sizes."""
    parts = {"variance": "var / {size}", "epsilon": f"{sizes['epsilon']!r}f", "after": "",
             **NORM_VARIANTS.get(plan, {})}
    beta = op == "layer_norm"
    return C_NORM.format(**{**sizes, **{key: value.format(**sizes) for key, value in parts.items()}},
                         centered=int(beta), beta_arg="const float *beta, " if beta else "",
                         beta_term=" + beta[i]" if beta else "")


C_GEMV = """
#include <stdint.h>
#include <string.h>
#include <math.h>
static float half_to_float(uint16_t h) {{
  uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023, bits;
  if (exponent == 0) {{ float f = ldexpf((float)mantissa, -24); return sign ? -f : f; }}
  bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}}
void kernel(int64_t rows, const float *x, const uint16_t *scales, const int8_t *quants, {bias_arg}float *out) {{
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < {n}; ++j) {{
      float sum = 0.0f;
      for (int b = 0; b < {blocks}; ++b) {{
        float part = 0.0f;
        for (int i = 0; i < 32; ++i)
          part += (float)({quant_type})quants[j * {k} + b * 32 + i] * x[r * {k} + b * 32 + i];
        sum += {scaled};
      }}
      out[r * {n} + j] = sum{bias_term};
    }}
}}
"""
GEMV_PLANS = {"gemv": ("int8_t", "half_to_float(scales[j * {blocks} + b]) * part"),
              "gemvnoscale": ("int8_t", "part"),
              "gemvunsigned": ("uint8_t", "half_to_float(scales[j * {blocks} + b]) * part")}


def gemv_kernel(plan: str, sizes: dict) -> str:
    """The C Q8_0 GEMV of `plan` for the task's `dequant_gemv` sizes."""
    assert sizes["format"] == "q8_0", "this generator writes Q8_0 GEMVs only"
    quant_type, scaled = GEMV_PLANS[plan]
    bias = sizes["bias"]
    return C_GEMV.format(**sizes, quant_type=quant_type, scaled=scaled.format(**sizes),
                         bias_arg="const float *bias, " if bias else "", bias_term=" + bias[j]" if bias else "")


TVMSCRIPT = """
# from tvm.script import tirx as T

@T.prim_func
def gemm(a: T.Buffer(({m}, {k}), "float32"), b: T.Buffer(({k}, {n}), "float32"),
         c: T.Buffer(({m}, {n}), "float32")):
    T.func_attr({{"tir.noalias": True, "tirx.is_scheduled": True}})
    for i, j in T.grid({m}, {n}):
        c[i, j] = T.float32(0)
        for kk in range({k}):
            c[i, j] = c[i, j] + a[i, kk] * b[kk, j]
"""


def kernel(plan: str, sizes: dict, op: str = "matmul") -> dict:
    """The candidate of `plan` for the task's sizes (its group's `gemm`, `conv2d`, `attention`,
    norm's or `dequant_gemv`) of op `op`."""
    if plan.startswith("norm"):
        return {"format": "c", "source": norm_kernel(plan, sizes, op), "name": plan}
    if plan in GEMV_PLANS:
        return {"format": "c", "source": gemv_kernel(plan, sizes), "name": plan}
    if plan.startswith("attention"):
        return {"format": "c", "source": attention_kernel(plan, sizes), "name": plan}
    if plan in CONV_INSIDE:
        return {"format": "c", "source": C_CONV.format(**sizes, inside=CONV_INSIDE[plan].format(**sizes)), "name": plan}
    if plan == "tvmscript":
        return {"format": "tvmscript", "source": TVMSCRIPT.format(**sizes), "name": plan}
    if plan in GPU_ZERO:
        return {"format": "tvmscript", "source": TVMSCRIPT_GPU.format(**sizes, zero=GPU_ZERO[plan].format(**sizes)),
                "name": plan}
    if plan in TASK_BODIES:
        body = TASK_BODIES[plan].format(**sizes)
        return {"format": "c", "source": C_TASKS.format(body=body), "name": plan, "tasks": TASKS}
    parts = {"prelude": "", "first": "0", "after": "", **C_KERNELS[plan]}
    parts = {key: value.format(**sizes) for key, value in parts.items()}
    return {"format": "c", "source": C_GEMM.format(**sizes, **parts), "name": plan}


def main() -> None:
    task = json.load(sys.stdin)
    if os.environ.get("GIMLET_TEST_TASKS"):
        with open(os.path.join(os.environ["GIMLET_TEST_TASKS"], f"round{task['round']}.json"), "w") as f:
            json.dump(task, f)
    plan = sys.argv[1].split(",")[task["round"] - 1]
    if plan == "malformed":
        print("here are your kernels: {")
    elif plan == "notlist":
        print(json.dumps({"format": "c"}))
    elif plan == "exit":
        print("generator gave up", file=sys.stderr)
        sys.exit(3)
    elif plan == "hang":
        time.sleep(600)
    else:
        assert not task["group"]["epilogue"], "this generator writes plain GEMMs, conv2ds, attention, norms and GEMVs only"
        op = task["group"]["op"]
        sizes = task["group"][{"matmul": "gemm"}.get(op, op)]
        print(json.dumps([kernel(p, sizes, op) for p in plan.split("+")]))


if __name__ == "__main__":
    main()
