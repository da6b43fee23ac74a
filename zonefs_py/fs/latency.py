"""Latency histograms for `zonefs-py stat` (and, later, Prometheus).

Log-linear buckets: 4 per power of two of nanoseconds (a value is placed
within 19% of its size), 256 buckets reach past 10^19 ns. Recording is an
integer operation and an increment, cheap enough for every read and write.
Percentiles report the upper edge of the bucket they fall in.
"""

from __future__ import annotations

SUB = 2  # 2**SUB buckets per power of two
NBUCKETS = 256


def _bucket(ns: int) -> int:
    if ns < 8:
        return max(ns, 0)
    top = ns.bit_length() - 1
    return min(NBUCKETS - 1, ((top - SUB + 1) << SUB) + ((ns >> (top - SUB)) & ((1 << SUB) - 1)))


def _upper_ns(bucket: int) -> int:
    if bucket < 8:
        return bucket
    top = (bucket >> SUB) + SUB - 1
    frac = bucket & ((1 << SUB) - 1)
    return ((1 << SUB) + frac + 1) << (top - SUB)


class Histogram:
    __slots__ = ("count", "counts", "max_ns", "total_ns")

    def __init__(self) -> None:
        self.counts = [0] * NBUCKETS
        self.count = 0
        self.total_ns = 0
        self.max_ns = 0

    def record(self, ns: int) -> None:
        self.counts[_bucket(ns)] += 1
        self.count += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def percentile_ns(self, pct: float) -> int:
        if not self.count:
            return 0
        want = self.count * pct / 100.0
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if c and seen >= want:
                return min(_upper_ns(i), self.max_ns)
        return self.max_ns

    def summary(self) -> dict[str, float]:
        """count, mean and p50/p99/p99.9/max in microseconds (since mount)."""
        if not self.count:
            return {"count": 0}
        return {"count": self.count,
                "mean_us": round(self.total_ns / self.count / 1000, 1),
                "p50_us": round(self.percentile_ns(50) / 1000, 1),
                "p99_us": round(self.percentile_ns(99) / 1000, 1),
                "p99.9_us": round(self.percentile_ns(99.9) / 1000, 1),
                "max_us": round(self.max_ns / 1000, 1)}
