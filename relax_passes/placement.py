"""Cross-device placement: each op of the graph on the device where the modelled latency of
the whole model is least, counting every copy a cross-device edge needs.

The VM runs one op at a time, so the modelled latency is the sum of the ops' times on their
devices plus the time of every copy: an energy with one term per op and one per tensor
("copied to device d if the producer is elsewhere and some consumer is on d"). It is
minimised by alpha-expansion (Boykov, Veksler and Zabih, 2001): each move asks, for one
device, which ops should move there, and answers exactly with one minimum s-t cut
(Kolmogorov and Zabih, 2004); moves repeat over the devices until none helps. With two
devices the first move from "all on the first" already is the global optimum; with more,
the result is a local optimum no single move improves. A greedy or priority order like an
execution-provider list cannot weigh a cheap op against the copies it causes. A tensor read
by several ops on one device is copied there once, and the cut counts it once (one auxiliary
node per tensor and destination). Ops only one device may run (by capability, by pin,
host-only ops) are fixed and enter the energy through their edges.

Op times come from the first of the caller's sources (`OpTimes`: tuning records, or each op
compiled alone for the target and timed on the device) that knows them, else from a roofline
over the device's `PerfFacts` (launch cost plus the larger of arithmetic and memory time);
copy times come from the devices' link bandwidth.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

from ..errors import GimletError
from .min_cut import FlowGraph
from .op_graph import OpGraph, OpNode, binding_name

if TYPE_CHECKING:
    from ..targets.spec import PerfFacts, TargetSpec

HOST = 0  # index of the host device (LLVM CPU) in every placement

ROOFLINE = "roofline"


class OpTimes(Protocol):
    """A source of op times: seconds of one op on the device at that index, or None where it
    does not know; `source` names it in reports."""

    source: str

    def __call__(self, node: OpNode, device: int) -> float | None: ...


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
    """Where one op runs and why: `costs` is its time on every device it may use, `sources`
    where each time came from."""

    node: OpNode
    device: int
    costs: dict[int, float]
    reason: str
    sources: dict[int, str]


Costs = list[dict[int, float]]  # per node: device index -> seconds
Sources = list[dict[int, str]]  # per node: device index -> where its time came from


def op_costs(graph: OpGraph, devices: Sequence[Device],
             timers: Sequence[OpTimes] = ()) -> tuple[Costs, Sources]:
    """Every node's time on every device, from the first of `timers` that knows it, else the
    roofline. Host-only nodes are not timed (they run on the host whatever the costs)."""
    costs, sources = [], []
    for node in graph.nodes:
        times, origins = {}, {}
        for index, device in enumerate(devices):
            for timer in () if node.host_only else timers:
                seconds = timer(node, index)
                if seconds is not None:
                    times[index], origins[index] = seconds, timer.source
                    break
            else:
                times[index], origins[index] = op_seconds(node, device.perf), ROOFLINE
        costs.append(times)
        sources.append(origins)
    return costs, sources


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
                 "sources": {device_names[d]: op.sources[d] for d in op.costs},
                 "reason": op.reason,
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
    graph: OpGraph, devices: Sequence[Device], pins: Pins = Pins(), timers: Sequence[OpTimes] = ()
) -> Placement:
    """Assign every node of `graph` a device index (`devices[0]` is the host)."""
    names = {d.spec.name: i for i, d in enumerate(devices)}
    placeable = [i for i, d in enumerate(devices) if d.placeable]
    allowed: list[list[int]] = []
    reasons: list[str] = []
    for node in graph.nodes:
        options, reason = _options(node, devices, placeable, names, pins)
        allowed.append(options)
        reasons.append(reason)
    costs, sources = op_costs(graph, devices, timers)
    labels = _expansion(graph, devices, allowed, placeable, costs)
    return _report(graph, devices, labels, reasons, costs, sources)


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


def _expansion(graph: OpGraph, devices, allowed: list[list[int]], placeable: list[int],
               costs: Costs) -> list[int]:
    """Labels minimising op time plus copy time by alpha-expansion (see the module doc): from
    every op on its first allowed device, repeat one expansion move per device until none
    lowers the modelled latency."""
    labels = [options[0] for options in allowed]
    perf = [d.perf for d in devices]
    best = _modelled_seconds(graph, perf, labels, costs)
    for _ in range(_MAX_SWEEPS):
        improved = False
        for alpha in placeable:
            movable = [i for i, options in enumerate(allowed)
                       if alpha in options and labels[i] != alpha]
            if not movable:
                continue
            moved = _expansion_move(graph, perf, labels, movable, alpha, costs)
            seconds = _modelled_seconds(graph, perf, moved, costs)
            if seconds < best * (1 - 1e-12):
                labels, best, improved = moved, seconds, True
        if not improved:
            break
    return labels


_MAX_SWEEPS = 8  # expansion converges in two or three sweeps on real graphs
_NEVER = 1e6  # seconds: an edge that stands for "impossible"


def _expansion_move(graph: OpGraph, perf: list[PerfFacts], labels: list[int], movable: list[int],
                    alpha: int, costs: Costs) -> list[int]:
    """The least-latency labelling in which any subset of `movable` ops moves to `alpha` and
    every other op keeps its label: one minimum cut. Source side keeps, sink side moves.

    A copy is charged once per tensor and destination device, when the producer is elsewhere
    and some consumer is there (an auxiliary node joins the consumers). The one term a cut can't
    express, a tensor whose producer may move between two devices that both differ from the
    destination and where staying would copy dearer than moving, is charged at its staying
    price: exact for the current labelling and an overestimate after the move, so a move never
    raises the modelled latency it reports.
    """
    flow = FlowGraph()
    vertex = {i: flow.add_node() for i in movable}

    def unary(node: int, keep: float, move: float) -> None:
        flow.add_edge(FlowGraph.SOURCE, vertex[node], move)  # cut when the node moves
        flow.add_edge(vertex[node], FlowGraph.SINK, keep)  # cut when it keeps its label

    def when_some_present(consumers: list[int], moved: bool, cost: float, producer: int | None,
                          producer_moved: bool | None) -> None:
        """Charge `cost` when some of `consumers` is moved (`moved`) or kept, and, unless
        `producer_moved` is None, the producer is moved (True) or kept (False)."""
        aux = flow.add_node()
        if producer_moved is None:
            ends = (FlowGraph.SOURCE, aux) if moved else (aux, FlowGraph.SINK)
        else:
            ends = (vertex[producer], aux) if not producer_moved else (aux, vertex[producer])
        flow.add_edge(*ends, cost)
        for c in consumers:
            flow.add_edge(*((aux, vertex[c]) if moved else (vertex[c], aux)), _NEVER)

    for i in movable:
        unary(i, costs[i][labels[i]], costs[i][alpha])
    for tensor in graph.tensors.values():
        producer = tensor.producer
        source = HOST if producer is None else labels[producer]
        movers = [c for c in set(tensor.consumers) if c in vertex]
        fixed = {labels[c] for c in tensor.consumers if c not in vertex}
        if tensor.is_output:
            fixed.add(HOST)
        for dst in fixed | {labels[c] for c in movers} | ({alpha} if movers else set()):
            # consumers on `dst` when they move (dst is alpha) or when they keep their label
            present = movers if dst == alpha else [c for c in movers if labels[c] == dst]
            moved = dst == alpha
            stay = copy_seconds(tensor.nbytes, perf[source], perf[dst]) if source != dst else 0.0
            if producer not in vertex:
                if stay and dst not in fixed and present:
                    when_some_present(present, moved, stay, None, None)
                continue
            go = copy_seconds(tensor.nbytes, perf[alpha], perf[dst]) if alpha != dst else 0.0
            if dst in fixed:
                unary(producer, stay, go)
            elif present and dst == alpha:
                when_some_present(present, True, stay, producer, False)
            elif present and dst == source:
                when_some_present(present, False, go, producer, True)
            elif present:
                when_some_present(present, False, stay, None, None)
                if go > stay:
                    when_some_present(present, False, go - stay, producer, True)
    source_side = flow.min_cut()
    return [alpha if i in vertex and vertex[i] not in source_side else label
            for i, label in enumerate(labels)]


def _copies(graph: OpGraph, labels: list[int]) -> list[tuple[str, int, int, int]]:
    """Every cross-device copy of `labels`: (tensor name, bytes, from device, to device)."""
    copies = []
    for tensor in graph.tensors.values():
        src = HOST if tensor.producer is None else labels[tensor.producer]
        destinations = {labels[c] for c in tensor.consumers} | ({HOST} if tensor.is_output else set())
        for dst in sorted(destinations - {src}):
            copies.append((tensor.var.name, tensor.nbytes, src, dst))
    return copies


def _modelled_seconds(graph: OpGraph, perf: list[PerfFacts], labels: list[int],
                      costs: Costs) -> float:
    """Op times on their devices plus every copy's time."""
    return sum(costs[i][label] for i, label in enumerate(labels)) + sum(
        copy_seconds(nbytes, perf[src], perf[dst]) for _, nbytes, src, dst in _copies(graph, labels)
    )


def _report(graph: OpGraph, devices, labels: list[int], reasons: list[str], costs: Costs,
            sources: Sources) -> Placement:
    ops = [
        OpPlacement(node, labels[i], {j: costs[i][j] for j, d in enumerate(devices)
                                      if d.placeable or j == labels[i]}, reasons[i], sources[i])
        for i, node in enumerate(graph.nodes)
    ]
    perf = [d.perf for d in devices]
    return Placement(ops, _copies(graph, labels), _modelled_seconds(graph, perf, labels, costs))
