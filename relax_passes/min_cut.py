"""Minimum s-t cut by max flow (Dinic's algorithm) on a small graph with float capacities."""

from __future__ import annotations

import collections


class FlowGraph:
    """A directed graph of `n` nodes; node 0 is the source, node 1 the sink."""

    SOURCE = 0
    SINK = 1

    def __init__(self, n: int = 2):
        self._edges: list[list[float | int]] = []  # [to, residual capacity], paired with reverse
        self._adjacent: list[list[int]] = [[] for _ in range(n)]

    def add_node(self) -> int:
        self._adjacent.append([])
        return len(self._adjacent) - 1

    def add_edge(self, u: int, v: int, capacity: float) -> None:
        """An edge u -> v; it is cut (and costs `capacity`) when u is on the source side and v
        on the sink side."""
        if capacity <= 0 or u == v:
            return
        self._adjacent[u].append(len(self._edges))
        self._edges.append([v, capacity])
        self._adjacent[v].append(len(self._edges))
        self._edges.append([u, 0.0])

    def min_cut(self) -> set[int]:
        """The source side of a minimum cut."""
        while True:
            level = self._levels()
            if level[self.SINK] < 0:
                break
            cursor = [0] * len(self._adjacent)
            while self._augment(self.SOURCE, float("inf"), level, cursor) > 0:
                pass
        level = self._levels()
        return {node for node, depth in enumerate(level) if depth >= 0}

    def _levels(self) -> list[int]:
        level = [-1] * len(self._adjacent)
        level[self.SOURCE] = 0
        queue = collections.deque([self.SOURCE])
        while queue:
            u = queue.popleft()
            for e in self._adjacent[u]:
                v, capacity = self._edges[e]
                if capacity > 1e-15 and level[v] < 0:
                    level[v] = level[u] + 1
                    queue.append(v)
        return level

    def _augment(self, u: int, limit: float, level: list[int], cursor: list[int]) -> float:
        if u == self.SINK:
            return limit
        while cursor[u] < len(self._adjacent[u]):
            e = self._adjacent[u][cursor[u]]
            v, capacity = self._edges[e]
            if capacity > 1e-15 and level[v] == level[u] + 1:
                pushed = self._augment(v, min(limit, capacity), level, cursor)
                if pushed > 0:
                    self._edges[e][1] -= pushed
                    self._edges[e ^ 1][1] += pushed
                    return pushed
            cursor[u] += 1
        return 0.0
