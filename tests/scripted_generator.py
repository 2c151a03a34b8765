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
    malformed  notlist  exit  hang    not JSON; JSON but no list of candidates; exit code 3; sleep

With GIMLET_TEST_TASKS=DIR, every task it reads is saved there as round<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

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


def kernel(plan: str, gemm: dict) -> dict:
    if plan == "tvmscript":
        return {"format": "tvmscript", "source": TVMSCRIPT.format(**gemm), "name": plan}
    parts = {"prelude": "", "first": "0", "after": "", **C_KERNELS[plan]}
    parts = {key: value.format(**gemm) for key, value in parts.items()}
    return {"format": "c", "source": C_GEMM.format(**gemm, **parts), "name": plan}


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
        assert not task["group"]["epilogue"], "this generator writes plain GEMMs only"
        print(json.dumps([kernel(p, task["group"]["gemm"]) for p in plan.split("+")]))


if __name__ == "__main__":
    main()
