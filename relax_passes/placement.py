"""Cross-device placement: each op of the graph on the device where the modelled latency of
the whole model is least, counting every copy a cross-device edge needs.

The algorithm is a minimum s-t cut. The VM runs one op at a time, so the modelled latency is
the sum of the ops' times on their devices plus the time of every copy. With two devices
that is an energy over binary labels with one term per op and one per tensor ("copied if
the producer and some consumer differ"), which a graph cut minimises exactly (Kolmogorov and
Zabih, 2004), in polynomial time; a greedy or priority order like an execution-provider
list cannot weigh a cheap op against the copies it causes. A tensor read by several ops on
the other device is copied once, and the cut counts it once (one auxiliary node per tensor
and direction). Ops only one device may run (by capability, by pin, host-only ops) are fixed
and enter the energy through their edges. More than two free devices is not handled (it
would need alpha-expansion over such cuts).

Op times are measured on the device when the caller gives a way to (`OpTimer`: each op
compiled alone for the target and timed), else estimated by a roofline over the device's
`PerfFacts` (launch cost plus the larger of arithmetic and memory time); copy times come from
the devices' link bandwidth.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from ..errors import GimletError
from ..onnx_ops.folding import binding_name
from .min_cut import FlowGraph
from .op_graph import OpGraph, OpNode

if TYPE_CHECKING:
    from ..targets.spec import PerfFacts, TargetSpec

HOST = 0  # index of the host device (LLVM CPU) in every placement

OpTimer = Callable[[OpNode, int], "float | None"]
"""Measured seconds of one op on the device at that index, or None where it can't be measured."""


@dataclasses.dataclass(frozen=True)
class Device:
    """One device a model may be placed on: its target spec and roofline."""

    spec: TargetSpec
    perf: PerfFacts
    placeable: bool = True  # False for the host when the user did not ask for it


@dataclasses.dataclass(frozen=True)
class Pins:
    """Ops the user puts on a device by hand: `{op type or node name: target name}`.

    Op types are ONNX-style or Relax names, matched case-insensitively against the Relax op
    (`"MatMul"` and `"matmul"` both match `relax.matmul`); node names are ONNX node names.
    """

    by_name: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def target_of(self, node: OpNode) -> str | None:
        for key, target in self.by_name.items():
            if binding_name(key) == node.name or _op_key(key) == _op_key(node.op):
                return target
        return None


def _op_key(op: str) -> str:
    return op.rsplit(".", 1)[-1].replace("_", "").lower()


def op_seconds(node: OpNode, perf: PerfFacts) -> float:
    """Roofline time of one op: launch + max(arithmetic, memory traffic)."""
    return perf.launch_us * 1e-6 + max(
        node.flops / (perf.peak_gflops * 1e9), node.nbytes / (perf.memory_gbps * 1e9)
    )


def copy_seconds(nbytes: int, src: PerfFacts, dst: PerfFacts) -> float:
    """One copy: through each end's link to the host (none for the host's own memory)."""
    if src is dst:
        return 0.0
    return sum(
        end.copy_us * 1e-6 + nbytes / (end.link_gbps * 1e9)
        for end in (src, dst)
        if end.link_gbps is not None
    )


@dataclasses.dataclass
class OpPlacement:
    """Where one op runs and why: `costs` is its time on every device it may use, `measured`
    whether those times were measured (else roofline estimates)."""

    node: OpNode
    device: int
    costs: dict[int, float]
    reason: str
    measured: bool = False


Costs = list[dict[int, float]]  # per node: device index -> seconds


def op_costs(graph: OpGraph, devices: Sequence[Device], timer: OpTimer | None) -> tuple[Costs, list[bool]]:
    """Every node's time on every device: measured by `timer` where it can, else the roofline.
    Host-only nodes are not measured (they run on the host whatever the costs)."""
    costs, measured = [], []
    for node in graph.nodes:
        times, timed = {}, True
        for index, device in enumerate(devices):
            seconds = timer(node, index) if timer is not None and not node.host_only else None
            timed &= seconds is not None
            times[index] = seconds if seconds is not None else op_seconds(node, device.perf)
        costs.append(times)
        measured.append(timed)
    return costs, measured


@dataclasses.dataclass
class Placement:
    ops: list[OpPlacement]
    copies: list[tuple[str, int, int, int]]  # (tensor name, bytes, from device, to device)
    modelled_seconds: float

    def to_json(self, device_names: Sequence[str]) -> dict:
        """The placement as plain data, devices by name, times in microseconds."""
        return {
            "devices": list(device_names),
            "ops": [
                {"name": op.node.name, "op": op.node.op, "device": device_names[op.device],
                 "costs_us": {device_names[d]: round(s * 1e6, 3) for d, s in op.costs.items()},
                 "measured": op.measured, "reason": op.reason,
                 "inputs": [v.name for v in op.node.inputs]}
                for op in self.ops
            ],
            "copies": [
                {"tensor": name, "bytes": nbytes, "from": device_names[src], "to": device_names[dst]}
                for name, nbytes, src, dst in self.copies
            ],
            "modelled_ms": round(self.modelled_seconds * 1e3, 6),
        }


def place(
    graph: OpGraph, devices: Sequence[Device], pins: Pins = Pins(), timer: OpTimer | None = None
) -> Placement:
    """Assign every node of `graph` a device index (`devices[0]` is the host)."""
    names = {d.spec.name: i for i, d in enumerate(devices)}
    placeable = [i for i, d in enumerate(devices) if d.placeable]
    if len(placeable) > 2:
        raise GimletError(
            f"placement over more than two devices ({len(placeable)} given) is not supported yet"
        )
    allowed: list[list[int]] = []
    reasons: list[str] = []
    for node in graph.nodes:
        options, reason = _options(node, devices, placeable, names, pins)
        allowed.append(options)
        reasons.append(reason)
    costs, measured = op_costs(graph, devices, timer)
    labels = _cut(graph, devices, allowed, placeable, costs)
    return _report(graph, devices, labels, reasons, costs, measured)


def _options(node: OpNode, devices, placeable, names, pins) -> tuple[list[int], str]:
    """The devices `node` may run on, and why when that is not every placeable one."""
    if node.host_only:
        return [HOST], node.host_only
    capable = [i for i in placeable if devices[i].spec.cannot_run(node.dtypes) is None]
    pinned = pins.target_of(node)
    if pinned is not None:
        if pinned not in names:
            raise GimletError(f"op '{node.name}' is pinned to '{pinned}', which is not among "
                              f"the build's targets: {', '.join(names)}")
        index = names[pinned]
        why_not = devices[index].spec.cannot_run(node.dtypes)
        if why_not is None:
            return [index], f"pinned to {pinned}"
        fallback = capable or [HOST]
        return fallback, f"pinned to {pinned}, which cannot run it ({why_not}): falls back"
    if not capable:
        why = "; ".join(devices[i].spec.cannot_run(node.dtypes) for i in placeable)
        return [HOST], f"no target can run it ({why}): falls back to the host"
    if len(capable) < len(placeable):
        missing = next(i for i in placeable if i not in capable)
        return capable, devices[missing].spec.cannot_run(node.dtypes)
    return capable, "least modelled latency"


def _cut(graph: OpGraph, devices, allowed: list[list[int]], placeable: list[int],
         costs: Costs) -> list[int]:
    """Labels minimising op time plus copy time, by one minimum cut (see the module doc)."""
    labels = [options[0] for options in allowed]
    free = [i for i, options in enumerate(allowed) if len(options) > 1]
    if not free:
        return labels
    a, b = placeable  # source side: a, sink side: b
    perf = [d.perf for d in devices]
    big = 1e6  # seconds: stands for "never"
    flow = FlowGraph()
    vertex = {i: flow.add_node() for i in free}

    def unary(node: int, cost_a: float, cost_b: float) -> None:
        flow.add_edge(FlowGraph.SOURCE, vertex[node], cost_b)  # cut when node is on b
        flow.add_edge(vertex[node], FlowGraph.SINK, cost_a)  # cut when node is on a

    for i in free:
        unary(i, costs[i][a], costs[i][b])
    for tensor in graph.tensors.values():
        consumers = set(tensor.consumers)
        free_consumers = [c for c in consumers if c in vertex]
        fixed_labels = {labels[c] for c in consumers if c not in vertex}
        if tensor.is_output:
            fixed_labels.add(HOST)
        producer = tensor.producer
        if producer is not None and producer in vertex:
            for fixed in fixed_labels:
                unary(producer, copy_seconds(tensor.nbytes, perf[a], perf[fixed]),
                      copy_seconds(tensor.nbytes, perf[b], perf[fixed]))
            if free_consumers and b not in fixed_labels:  # a -> b copy if some consumer is on b
                aux = flow.add_node()
                flow.add_edge(vertex[producer], aux, copy_seconds(tensor.nbytes, perf[a], perf[b]))
                for c in free_consumers:
                    flow.add_edge(aux, vertex[c], big)
            if free_consumers and a not in fixed_labels:  # b -> a copy if some consumer is on a
                aux = flow.add_node()
                flow.add_edge(aux, vertex[producer], copy_seconds(tensor.nbytes, perf[b], perf[a]))
                for c in free_consumers:
                    flow.add_edge(vertex[c], aux, big)
        elif free_consumers:
            source = HOST if producer is None else labels[producer]
            for side, other in ((a, b), (b, a)):
                cost = copy_seconds(tensor.nbytes, perf[source], perf[side])
                if cost == 0:
                    continue
                aux = flow.add_node()
                if side == b:  # paid when some consumer is on b
                    flow.add_edge(FlowGraph.SOURCE, aux, cost)
                    for c in free_consumers:
                        flow.add_edge(aux, vertex[c], big)
                else:  # paid when some consumer is on a
                    flow.add_edge(aux, FlowGraph.SINK, cost)
                    for c in free_consumers:
                        flow.add_edge(vertex[c], aux, big)
    source_side = flow.min_cut()
    for i in free:
        labels[i] = a if vertex[i] in source_side else b
    return labels


def _report(graph: OpGraph, devices, labels: list[int], reasons: list[str], costs: Costs,
            measured: list[bool]) -> Placement:
    perf = [d.perf for d in devices]
    ops = [
        OpPlacement(node, labels[i], {j: costs[i][j] for j, d in enumerate(devices)
                                      if d.placeable or j == labels[i]}, reasons[i], measured[i])
        for i, node in enumerate(graph.nodes)
    ]
    copies = []
    for tensor in graph.tensors.values():
        src = HOST if tensor.producer is None else labels[tensor.producer]
        destinations = {labels[c] for c in tensor.consumers} | ({HOST} if tensor.is_output else set())
        for dst in sorted(destinations - {src}):
            copies.append((tensor.var.name, tensor.nbytes, src, dst))
    modelled = sum(op.costs[op.device] for op in ops) + sum(
        copy_seconds(nbytes, perf[src], perf[dst]) for _, nbytes, src, dst in copies
    )
    return Placement(ops, copies, modelled)
