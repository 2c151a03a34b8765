"""`PlacementReport`: where a multi-device build put each op, what it modelled, what it copies."""

from __future__ import annotations

import collections
import os
from typing import Any

from ..files import atomic_path

_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")


class PlacementReport:
    """A placement as recorded at build time (also in exported artifacts).

    `ops`: per op its name, Relax op, device, time on each device (microseconds) and its
    source (tuning records, measured, roofline), and the reason; `copies`: every cross-device copy (tensor, bytes, from, to).
    """

    def __init__(self, data: dict[str, Any]):
        self.devices: list[str] = data["devices"]
        self.ops: list[dict[str, Any]] = data["ops"]
        self.copies: list[dict[str, Any]] = data["copies"]
        self.modelled_ms: float = data["modelled_ms"]

    @property
    def copy_bytes(self) -> int:
        return sum(c["bytes"] for c in self.copies)

    def device_of(self, name: str) -> str:
        """The device of the op bound to `name` (an ONNX node name where the importer kept it)."""
        for op in self.ops:
            if op["name"] == name:
                return op["device"]
        raise KeyError(f"no op named '{name}' in the placement")

    def ops_per_device(self) -> dict[str, int]:
        return dict(collections.Counter(op["device"] for op in self.ops))

    def __str__(self) -> str:
        width = max([len(op["name"]) for op in self.ops] + [4])
        lines = [f"{'op':<{width}}  {'kind':<16} {'device':<8} "
                 + " ".join(f"{d + ' us':>12}" for d in self.devices) + "  times     reason"]
        for op in self.ops:
            costs = " ".join(f"{op['costs_us'].get(d, float('nan')):>12.1f}" for d in self.devices)
            source = "+".join(dict.fromkeys(op.get("sources", {}).values()))
            lines.append(f"{op['name']:<{width}}  {op['op']:<16} {op['device']:<8} {costs}  "
                         f"{source:<9} {op['reason']}")
        per_device = ", ".join(f"{d}: {n}" for d, n in self.ops_per_device().items())
        lines.append(f"ops per device: {per_device}; {len(self.copies)} copies, "
                     f"{self.copy_bytes} bytes; modelled latency {self.modelled_ms:.3f} ms")
        return "\n".join(lines)

    def write_graph(self, path: str | os.PathLike) -> None:
        """The op graph with ops coloured by device: Graphviz source (`.dot`) or a picture
        drawn with matplotlib (`.png`, `.svg`, `.pdf`), written atomically."""
        path = os.fspath(path)
        with atomic_path(path) as tmp:
            if path.endswith(".dot"):
                with open(tmp, "w") as f:
                    f.write(self._dot())
            else:
                self._draw(tmp, os.path.splitext(path)[1].lstrip(".") or "png")

    def _edges(self) -> list[tuple[int, int, bool]]:
        index = {op["name"]: i for i, op in enumerate(self.ops)}
        return [(index[v], i, self.ops[index[v]]["device"] != op["device"])
                for i, op in enumerate(self.ops) for v in op["inputs"] if v in index]

    def _dot(self) -> str:
        colour = dict(zip(self.devices, _COLOURS))
        lines = ["digraph placement {", "  node [shape=box, style=filled, fontcolor=white];"]
        for i, op in enumerate(self.ops):
            lines.append(f'  n{i} [label="{op["name"]}\\n{op["op"]} @ {op["device"]}", '
                         f'fillcolor="{colour[op["device"]]}"];')
        for src, dst, crosses in self._edges():
            lines.append(f"  n{src} -> n{dst}" + (' [color=red, penwidth=2, label="copy"];' if crosses else ";"))
        lines.append("}")
        return "\n".join(lines) + "\n"

    def _draw(self, path: str, fmt: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colour = dict(zip(self.devices, _COLOURS))
        column = {d: i for i, d in enumerate(self.devices)}
        rows = len(self.ops)
        fig, ax = plt.subplots(figsize=(3 + 3 * len(self.devices), max(3, 0.28 * rows)))
        xy = [(column[op["device"]], rows - i) for i, op in enumerate(self.ops)]
        for src, dst, crosses in self._edges():
            (x0, y0), (x1, y1) = xy[src], xy[dst]
            ax.plot([x0, x1], [y0, y1], color="red" if crosses else "0.7",
                    linewidth=2 if crosses else 0.8, zorder=1)
        for (x, y), op in zip(xy, self.ops):
            ax.text(x, y, f"{op['name']} ({op['op']})", ha="center", va="center", fontsize=7,
                    color="white", bbox={"facecolor": colour[op["device"]], "edgecolor": "none"},
                    zorder=2)
        ax.set_xticks(range(len(self.devices)), self.devices)
        ax.set_xlim(-0.7, len(self.devices) - 0.3)
        ax.set_yticks([])
        ax.set_title(f"placement: {len(self.copies)} copies, {self.copy_bytes} bytes, "
                     f"modelled {self.modelled_ms:.3f} ms")
        fig.tight_layout()
        fig.savefig(path, format=fmt)
        plt.close(fig)
