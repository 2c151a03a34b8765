"""Graph-level fusion rewrites run on the imported Relax graph, before placement and
legalization (see `gimlet_tvm.compiler.fusion_passes`)."""

from __future__ import annotations

import tvm


def graph_fusion_passes() -> list[tvm.transform.Pass]:
    """The rewrites, in order. Empty until the fusion passes land (issue #6)."""
    return []
