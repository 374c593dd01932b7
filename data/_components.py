"""Connected components by large-star / small-star rounds, as array functions over arcs.

Kiveris, Lattanzi, Mirrokni, Rastogi, Vassilvitskii, "Connected Components in MapReduce and
Beyond" (SoCC 2014), §3. The graph is a set of undirected edges between uint64 node ids; each
round is local to a node and its neighbours, so the arcs can be hash-partitioned by source node
and every partition run on its own (`raypai.data._dedup` does, one bucket per Ray task):

- large-star (input: arcs both ways): each node u links each neighbour v > u to
  m = min({u} ∪ neighbours(u)); emitted as the arc v → m (higher to lower);
- small-star (input: arcs from the higher end to the lower): each node u and its neighbours, all
  below it, are linked to m = their smallest; emitted both ways.

Both keep the components, and after O(log² n) rounds every component is a star around its lowest
id: no node has neighbours on both sides, none has two below it. `changes` counts the nodes of a
partition that break that; a large-star round and the small-star round after it that both count 0
everywhere have converged, and that small-star round's `leaves` give each non-centre node its
centre (= the lowest id of its component). Each arc carries the parts of its two ends (`sp`, `dp`),
which the rounds pass along, so a leaf's label can be sent to the part holding its row.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

ARCS = pa.schema([("src", pa.uint64()), ("dst", pa.uint64()), ("sp", pa.int32()), ("dp", pa.int32())])
LEAVES = pa.schema([("id", pa.uint64()), ("cluster", pa.uint64()), ("part", pa.int32())])


def _grouped(arcs: pa.Table):
    """Distinct arcs sorted by (src, dst) as arrays, with each arc's source's first arc (its lowest
    neighbour) and the first/last position of each source's run."""
    src, dst, sp, dp = (arcs.column(c).to_numpy() for c in ARCS.names)
    order = np.lexsort((dst, src))
    src, dst, sp, dp = src[order], dst[order], sp[order], dp[order]
    keep = np.ones(len(src), dtype=bool)  # the same arc may come from several producers
    keep[1:] = (src[1:] != src[:-1]) | (dst[1:] != dst[:-1])
    src, dst, sp, dp = src[keep], dst[keep], sp[keep], dp[keep]
    first = np.ones(len(src), dtype=bool)
    first[1:] = src[1:] != src[:-1]
    heads = np.flatnonzero(first)  # (U,) each node's first arc
    group = np.cumsum(first) - 1  # (E,) node index of each arc
    ends = np.append(heads[1:], len(src))[: len(heads)] - 1  # (U,) each node's last arc; none when no arcs
    return src, dst, sp, dp, heads, group, ends


def _arcs(src, dst, sp, dp) -> pa.Table:
    return pa.table({"src": src, "dst": dst, "sp": sp, "dp": dp}, schema=ARCS)


def large_star(arcs: pa.Table) -> tuple[pa.Table, int]:
    """(arcs for small-star, nodes with neighbours on both sides) from arcs in both directions."""
    src, dst, sp, dp, heads, group, ends = _grouped(arcs)
    low, low_part = dst[heads][group], dp[heads][group]  # (E,) the source's lowest neighbour
    m, pm = np.where(low < src, low, src), np.where(low < src, low_part, sp)
    up = dst > src
    changes = int(((dst[heads] < src[heads]) & (dst[ends] > src[heads])).sum())
    return _arcs(dst[up], m[up], dp[up], pm[up]), changes


def small_star(arcs: pa.Table) -> tuple[pa.Table, int, pa.Table]:
    """(arcs for large-star, nodes with ≥ 2 lower neighbours, leaves) from arcs higher → lower.
    `leaves`: each node with exactly one (lower) neighbour, and that neighbour; complete and final
    when the round has converged."""
    src, dst, sp, dp, heads, group, _ = _grouped(arcs)
    low, low_part = dst[heads][group], dp[heads][group]
    other = dst != low
    lo, lo_p = np.concatenate([low[other], low[heads]]), np.concatenate([low_part[other], low_part[heads]])
    hi, hi_p = np.concatenate([dst[other], src[heads]]), np.concatenate([dp[other], sp[heads]])
    degree = np.diff(np.concatenate([heads, [len(src)]]))
    leaf = heads[degree == 1]
    leaves = pa.table({"id": src[leaf], "cluster": dst[leaf], "part": sp[leaf]}, schema=LEAVES)
    return (
        _arcs(
            np.concatenate([lo, hi]),
            np.concatenate([hi, lo]),
            np.concatenate([lo_p, hi_p]),
            np.concatenate([hi_p, lo_p]),
        ),
        int((degree > 1).sum()),
        leaves,
    )


def both_ways(a: np.ndarray, b: np.ndarray, pa_: np.ndarray, pb: np.ndarray) -> pa.Table:
    """The arcs of edges (a, b) in both directions: the first large-star round's input."""
    return _arcs(np.concatenate([a, b]), np.concatenate([b, a]), np.concatenate([pa_, pb]), np.concatenate([pb, pa_]))
