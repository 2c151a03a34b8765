"""A kernel generator that needs no model: a hill climb over C templates, a GEMM, a direct
convolution and an attention.

    gimlet-tvm select model.onnx --records DIR --generator search
    (any command running this file as a script does the same: `python search_generator.py`)

It speaks the kernel generator protocol (docs/kernel-generators.md): a task on standard
input, a JSON list of candidates on standard output. The GEMM template (`c_gemm`) computes c
in tiles of MR rows by NV vectors of VW floats (GCC vector extensions; the last columns
scalar), over blocks of KB rows of b, its K loop unrolled U times; the convolution's (`c_conv2d`) in tiles of MR output
channels by NV vectors of VW output columns; each applies the group's epilogue to a tile as it
is stored. The attention's (`c_attention`) in tiles of MR query rows of one head, its values
summed in vectors of VW. Each splits its tiles into T tasks (the protocol's `tasks`: the
compiler runs them on its thread pool), T one of 1, the target's cores and twice that. Round 1
proposes the smallest tile, one task a core; each later round the neighbours (one parameter
of the op's template one step up or down) of the fastest kernel the history calls `ok`, never
a configuration already tried (the configuration is in the kernel's name). When none is `ok`
yet, it tries configurations it has not, smallest first.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import sys
from typing import Any

MR = (1, 2, 3, 4, 6, 8)
NV = (1, 2, 3, 4)
VW = (4, 8, 16)
UNROLL = (1, 2, 4, 8)
PER_ROUND = 4
KB = (0, 256, 64, 16)  # rows of b a block (0: all of K), largest first
NAME = re.compile(r"mr(\d+)_nv(\d+)_vw(\d+)_u(\d+)_t(\d+)_kb(\d+)")


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of the template's space."""

    mr: int
    nv: int
    vw: int
    unroll: int
    tasks: int
    kb: int = 0

    @property
    def name(self) -> str:
        return f"mr{self.mr}_nv{self.nv}_vw{self.vw}_u{self.unroll}_t{self.tasks}_kb{self.kb}"

    @classmethod
    def parse(cls, name: str) -> Config | None:
        found = NAME.match(name)
        return None if found is None else cls(*map(int, found.groups()))

    def neighbours(self, axes: dict[str, tuple[int, ...]]) -> list[Config]:
        """Each parameter of `axes` one step up or down its axis."""
        found = []
        for field, axis in axes.items():
            value = getattr(self, field)
            if value not in axis:
                continue
            index = axis.index(value)
            for step in (1, -1):
                if 0 <= index + step < len(axis):
                    found.append(dataclasses.replace(self, **{field: axis[index + step]}))
        return found


def broadcast_index(coords: list[str], shape: list[int]) -> str:
    """The C index into a compact row-major array of `shape` of the element at `coords` (C
    expressions, one per axis) of the array it broadcasts over: an axis of 1 repeats."""
    terms, stride = [], 1
    for coord, size in reversed(list(zip(coords, shape))):
        if size != 1:
            terms.append(f"({coord}) * {stride}")
        stride *= size
    return " + ".join(terms) or "0"


def _epilogue(group: dict[str, Any], coords: list[str]) -> str:
    """C statements applying the group's epilogue to `x`, the output element at `coords` (C
    expressions, one per output axis); each addend broadcasts numpy-style (an axis of 1
    repeats), its shape padded on the left to the output's rank."""
    lines, addend = [], 0
    for kind, _ in group["epilogue"]:
        if kind == "add":
            shape = [1] * (len(coords) - len(group["addends"][addend])) + group["addends"][addend]
            lines.append(f"x += addend{addend}[{broadcast_index(coords, shape)}];")
            addend += 1
        elif kind == "relu":
            lines.append("x = x < 0.0f ? 0.0f : x;")  # NaN stays NaN, as numpy's maximum
        else:
            lines.append("x = 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));")
    return " ".join(lines)


def _split(config: Config, units: str) -> tuple[str, str]:
    """The kernel's leading parameters for `config.tasks` and the statement declaring its
    share `[begin, end)` of `units` (a C expression), split evenly between the tasks."""
    params = "int64_t task, int64_t tasks, " if config.tasks > 1 else ""
    one = "" if config.tasks > 1 else "const int64_t task = 0, tasks = 1;\n  "
    return params, (f"{one}const int64_t units = {units}, begin = units * task / tasks, "
                    "end = units * (task + 1) / tasks;")


def c_gemm(config: Config, group: dict[str, Any]) -> str:
    """The GEMM template's C source for the task's group at `config`: tiles of MR rows by NV
    vectors of VW columns of c (a tile's accumulators in registers), over blocks of KB rows of
    b (KB = 0: all of K at once), each block of b read once for all the tiles of a task before
    the next (a GEMV streams b row by row; a GEMM keeps the block in cache for every row tile).
    The last columns go element by element; the epilogue is applied to each tile at the end."""
    m, n, k = group["gemm"]["m"], group["gemm"]["n"], group["gemm"]["k"]
    addends = "".join(f"const float *addend{i}, " for i in range(len(group["addends"])))
    addend_args = "".join(f"addend{i}, " for i in range(len(group["addends"])))
    params, share = _split(config, "(int64_t)((M + MR - 1) / MR) * TILES_J")
    return f"""#include <math.h>
#include <stdint.h>
#include <string.h>
enum {{ M = {m}, N = {n}, K = {k}, MR = {config.mr}, NV = {config.nv}, VW = {config.vw}, NR = NV * VW,
       KB = {config.kb or k}, TILES_J = (N + NR - 1) / NR }};
typedef float vf __attribute__((vector_size(VW * 4)));

static inline void finish(int i0, int rows, int j0, int cols, {addends}float *c) {{
  for (int i = i0; i < i0 + rows; ++i)
    for (int j = j0; j < j0 + cols; ++j) {{
      float x = c[i * N + j];
      {_epilogue(group, ["i", "j"])}
      c[i * N + j] = x;
    }}
}}

/* c[i0 : i0 + rows, j0 : j0 + NR] (+)= a[.., k0 : k1] b[k0 : k1, ..]; inlined with rows = MR
   known, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_block(const float *a, const float *b, float *c, int i0,
                                                            int j0, int rows, int k0, int k1) {{
  vf acc[MR][NV];
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < NV; ++v) {{
      if (k0 == 0) memset(&acc[r][v], 0, sizeof(vf));
      else memcpy(&acc[r][v], c + (i0 + r) * N + j0 + v * VW, sizeof(vf));
    }}
  #pragma GCC unroll {config.unroll}
  for (int k = k0; k < k1; ++k) {{
    vf bv[NV];
    for (int v = 0; v < NV; ++v) memcpy(&bv[v], b + k * N + j0 + v * VW, sizeof(vf));
    for (int r = 0; r < rows; ++r) {{
      const float s = a[(i0 + r) * K + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += s * bv[v];
    }}
  }}
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < NV; ++v) memcpy(c + (i0 + r) * N + j0 + v * VW, &acc[r][v], sizeof(vf));
}}

void kernel({params}const float *a, const float *b, {addends}float *c) {{
  {share}
  for (int k0 = 0; k0 < K; k0 += KB) {{
    const int k1 = K - k0 < KB ? K : k0 + KB;
    for (int64_t tile = begin; tile < end; ++tile) {{
      const int i0 = (int)(tile / TILES_J) * MR, j0 = (int)(tile % TILES_J) * NR;
      const int rows = M - i0 < MR ? M - i0 : MR, cols = N - j0 < NR ? N - j0 : NR;
      if (cols == NR && rows == MR) tile_block(a, b, c, i0, j0, MR, k0, k1);
      else if (cols == NR) tile_block(a, b, c, i0, j0, rows, k0, k1);
      else
        for (int i = i0; i < i0 + rows; ++i)
          for (int j = j0; j < j0 + cols; ++j) {{
            float sum = k0 == 0 ? 0.0f : c[i * N + j];
            for (int k = k0; k < k1; ++k) sum += a[i * K + k] * b[k * N + j];
            c[i * N + j] = sum;
          }}
    }}
  }}
  for (int64_t tile = begin; tile < end; ++tile) {{
    const int i0 = (int)(tile / TILES_J) * MR, j0 = (int)(tile % TILES_J) * NR;
    finish(i0, M - i0 < MR ? M - i0 : MR, j0, N - j0 < NR ? N - j0 : NR, {addend_args}c);
  }}
}}
"""


def c_conv2d(config: Config, group: dict[str, Any]) -> str:
    """The direct convolution template's C source for the task's conv2d group at `config`:
    tiles of MR output channels by NV vectors of VW output columns of one output row, over
    NCHW data and OIHW weights. A tile whose input columns all lie inside the image, at column
    stride 1, is computed in vectors (each weight broadcast, the input row loaded as is); the
    others (the image's borders, other strides, the last channels and columns) element by
    element. The epilogue is applied to each tile as it is stored."""
    p = group["conv2d"]
    (top, left, _, _), (sh, sw), (dh, dw), groups = p["pad"], p["stride"], p["dilation"], p["groups"]
    addends = "".join(f"const float *addend{i}, " for i in range(len(group["addends"])))
    addend_args = "".join(f"addend{i}, " for i in range(len(group["addends"])))
    params, share = _split(config, "(int64_t)N * G * TILES_G")
    return f"""#include <math.h>
#include <stdint.h>
#include <string.h>
enum {{ N = {p["n"]}, C = {p["c"]}, H = {p["h"]}, W = {p["w"]}, O = {p["o"]}, KH = {p["kh"]}, KW = {p["kw"]},
       OH = {p["oh"]}, OW = {p["ow"]}, SH = {sh}, SW = {sw}, PH = {top}, PW = {left}, DH = {dh}, DW = {dw},
       G = {groups}, CG = C / G, OG = O / G,
       MR = {config.mr}, NV = {config.nv}, VW = {config.vw}, XR = NV * VW, TILES_G = (OG + MR - 1) / MR }};
typedef float vf __attribute__((vector_size(VW * 4)));

static inline void finish(int n, int oc0, int rows, int oy, int ox0, int cols, {addends}float *c) {{
  for (int oc = oc0; oc < oc0 + rows; ++oc)
    for (int ox = ox0; ox < ox0 + cols; ++ox) {{
      float x = c[((n * O + oc) * OH + oy) * OW + ox];
      {_epilogue(group, ["n", "oc", "oy", "ox"])}
      c[((n * O + oc) * OH + oy) * OW + ox] = x;
    }}
}}

static float element(const float *a, const float *b, int n, int oc, int oy, int ox) {{
  const int g = oc / OG;
  float sum = 0.0f;
  for (int ci = 0; ci < CG; ++ci)
    for (int ky = 0; ky < KH; ++ky) {{
      const int y = oy * SH - PH + ky * DH;
      if (y < 0 || y >= H) continue;
      for (int kx = 0; kx < KW; ++kx) {{
        const int xx = ox * SW - PW + kx * DW;
        if (xx < 0 || xx >= W) continue;
        sum += a[((n * C + g * CG + ci) * H + y) * W + xx] * b[((oc * CG + ci) * KH + ky) * KW + kx];
      }}
    }}
  return sum;
}}

void kernel({params}const float *a, const float *b, {addends}float *c) {{
  {share}
  for (int64_t tile = begin; tile < end; ++tile) {{  /* tiles of MR output channels of one group */
      const int n = (int)(tile / (G * TILES_G)), g = (int)(tile / TILES_G % G), first_oc = (int)(tile % TILES_G) * MR;
      const int oc0 = g * OG + first_oc, rows = OG - first_oc < MR ? OG - first_oc : MR;
      for (int oy = 0; oy < OH; ++oy)
        for (int ox0 = 0; ox0 < OW; ox0 += XR) {{
          const int cols = OW - ox0 < XR ? OW - ox0 : XR;
          const int first = ox0 * SW - PW, last = (ox0 + XR - 1) * SW - PW + (KW - 1) * DW;
          if (SW == 1 && rows == MR && cols == XR && first >= 0 && last < W) {{
            vf acc[MR][NV];
            memset(acc, 0, sizeof acc);
            for (int ci = 0; ci < CG; ++ci)
              for (int ky = 0; ky < KH; ++ky) {{
                const int y = oy * SH - PH + ky * DH;
                if (y < 0 || y >= H) continue;
                const float *row = a + ((n * C + g * CG + ci) * H + y) * W + first;
                #pragma GCC unroll {config.unroll}
                for (int kx = 0; kx < KW; ++kx) {{
                  vf xv[NV];
                  for (int v = 0; v < NV; ++v) memcpy(&xv[v], row + kx * DW + v * VW, sizeof(vf));
                  for (int r = 0; r < MR; ++r) {{
                    const float w = b[(((oc0 + r) * CG + ci) * KH + ky) * KW + kx];
                    for (int v = 0; v < NV; ++v) acc[r][v] += w * xv[v];
                  }}
                }}
              }}
            for (int r = 0; r < MR; ++r)
              for (int v = 0; v < NV; ++v)
                memcpy(c + ((n * O + oc0 + r) * OH + oy) * OW + ox0 + v * VW, &acc[r][v], sizeof(vf));
          }} else {{
            for (int r = 0; r < rows; ++r)
              for (int ox = ox0; ox < ox0 + cols; ++ox)
                c[((n * O + oc0 + r) * OH + oy) * OW + ox] = element(a, b, n, oc0 + r, oy, ox);
          }}
          finish(n, oc0, rows, oy, ox0, cols, {addend_args}c);
        }}
    }}
}}
"""


def c_attention(config: Config, group: dict[str, Any]) -> str:
    """The attention template's C source for the task's attention group at `config`: tiles of
    MR query rows of one head (each key row read once for the tile); a tile's scores kept
    whole, softmax over them, then the values summed in vectors of VW floats (the head's last
    values element by element). NaN and Inf propagate as in the reference: a NaN score, or an
    infinite one (inf - inf), makes the row's sum NaN."""
    a = group["attention"]
    bias_arg, bias_term = "", ""
    if a["bias"] is not None:  # broadcast over (b, n, s, t)
        bias_arg = "const float *bias, "
        bias_term = f" + bias[{broadcast_index(['b', 'n', 's0 + r', 't'], a['bias'])}]"
    params, share = _split(config, "(int64_t)B * NH * TILES_S")
    return f"""#include <math.h>
#include <stdint.h>
#include <string.h>
enum {{ B = {a["b"]}, S = {a["s"]}, T = {a["t"]}, NH = {a["n"]}, H = {a["h"]}, HV = {a["hv"]},
       MR = {config.mr}, VW = {config.vw}, TILES_S = (S + MR - 1) / MR }};
typedef float vf __attribute__((vector_size(VW * 4)));
static const float SCALE = {float(a["scale"])!r}f;

static inline float dot(const float *x, const float *y) {{
  vf acc = {{0}};
  int i = 0;
  for (; i + VW <= H; i += VW) {{
    vf xv, yv;
    memcpy(&xv, x + i, sizeof xv);
    memcpy(&yv, y + i, sizeof yv);
    acc += xv * yv;
  }}
  float sum = 0.0f;
  for (int l = 0; l < VW; ++l) sum += acc[l];
  for (; i < H; ++i) sum += x[i] * y[i];
  return sum;
}}

void kernel({params}const float *q, const float *k, const float *v, {bias_arg}float *out) {{
  {share}
  for (int64_t tile = begin; tile < end; ++tile) {{
    const int b = (int)(tile / (NH * TILES_S)), n = (int)(tile / TILES_S % NH), s0 = (int)(tile % TILES_S) * MR;
    const int rows = S - s0 < MR ? S - s0 : MR;
    float p[MR][T], top[MR], total[MR];
    for (int r = 0; r < rows; ++r) {{ top[r] = -INFINITY; total[r] = 0.0f; }}
    #pragma GCC unroll {config.unroll}
    for (int t = 0; t < T; ++t) {{
      const float *key = k + ((b * T + t) * NH + n) * H;
      for (int r = 0; r < rows; ++r) {{
        const float x = dot(q + ((b * S + s0 + r) * NH + n) * H, key) * SCALE{bias_term};
        p[r][t] = x;
        top[r] = x > top[r] ? x : top[r];
      }}
    }}
    for (int r = 0; r < rows; ++r)
      for (int t = 0; t < T; ++t) {{
        p[r][t] = expf(p[r][t] - top[r]);
        total[r] += p[r][t];
      }}
    for (int r = 0; r < rows; ++r) {{
      float *o = out + ((b * S + s0 + r) * NH + n) * HV;
      int j = 0;
      for (; j + VW <= HV; j += VW) {{
        vf acc = {{0}};
        for (int t = 0; t < T; ++t) {{
          vf value;
          memcpy(&value, v + ((b * T + t) * NH + n) * HV + j, sizeof value);
          acc += p[r][t] * value;
        }}
        acc /= total[r];
        memcpy(o + j, &acc, sizeof acc);
      }}
      for (; j < HV; ++j) {{
        float sum = 0.0f;
        for (int t = 0; t < T; ++t) sum += p[r][t] * v[((b * T + t) * NH + n) * HV + j];
        o[j] = sum / total[r];
      }}
    }}
  }}
}}
"""


TEMPLATES = {"matmul": (c_gemm, ("mr", "nv", "vw", "unroll", "tasks", "kb")),
             "conv2d": (c_conv2d, ("mr", "nv", "vw", "unroll", "tasks")),
             "attention": (c_attention, ("mr", "vw", "unroll", "tasks"))}
"""Each op's template and the parameters its search varies (the others stay at their first value)."""


def propose(task: dict[str, Any]) -> list[Config]:
    """The configurations to try this round (at most PER_ROUND, none tried before)."""
    facts = task["target"]["facts"]
    bits = int(facts.get("vector_bits", 128))
    cores = max(1, int(facts.get("cores", 1)))
    space = {"mr": MR, "nv": NV, "vw": tuple(w for w in VW if w * 32 <= bits) or VW[:1], "unroll": UNROLL,
             "tasks": tuple(sorted({1, cores, 2 * cores})), "kb": KB}
    axes = {field: space[field] for field in TEMPLATES[task["group"]["op"]][1]}
    attempts = [a for h in task["history"] for a in h["attempts"]]
    tried = {Config.parse(a["name"]) for a in attempts}
    ok = [(a["seconds"], Config.parse(a["name"])) for a in attempts
          if a["verdict"] == "ok" and a["seconds"] is not None and Config.parse(a["name"]) is not None]
    first = {field: axis[0] for field, axis in space.items()}
    if not task["history"]:
        return [Config(**{**first, "tasks": cores})]
    if ok:
        best = min(ok, key=lambda pair: pair[0])[1]
        pool = best.neighbours(axes)
    else:  # nothing verified yet: the space, smallest tiles first
        points = itertools.product(*(axes.get(field, (value,)) for field, value in first.items()))
        pool = sorted((Config(*point) for point in points),
                      key=lambda c: (c.mr * c.nv * c.vw, c.unroll, c.tasks != cores))
    return [c for c in dict.fromkeys(pool) if c not in tried][:PER_ROUND]


def answer(task: dict[str, Any]) -> list[dict[str, str]]:
    """The candidates for one task (C only; none when the target does not take C, or for an
    op without a template)."""
    template = TEMPLATES.get(task["group"]["op"], (None,))[0]
    if "c" not in task["formats"] or template is None:
        return []
    return [{"format": "c", "name": c.name, "source": template(c, task["group"]),
             **({"tasks": c.tasks} if c.tasks > 1 else {})} for c in propose(task)]


def main() -> None:
    json.dump(answer(json.load(sys.stdin)), sys.stdout)


if __name__ == "__main__":
    main()
