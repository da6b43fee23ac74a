"""Latency histograms for `zonefs-py stat` and its Prometheus histograms.

Log-linear buckets: 4 per power of two of nanoseconds (a value is placed
within 19% of its size), 256 buckets reach past 10^19 ns. Recording is an
integer operation and an increment, cheap enough for every read and write.
Percentiles report the upper edge of the bucket they fall in.
"""

from __future__ import annotations

SUB = 2  # 2**SUB buckets per power of two
NBUCKETS = 256
#: Upper bounds (seconds) of the Prometheus histogram buckets in `summary()["histogram"]`.
PROM_BOUNDS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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
    """Latency histogram with log-spaced buckets (2**SUB per power of two of nanoseconds)."""

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

    def cumulative(self, bounds_s: tuple[float, ...] = PROM_BOUNDS_S) -> list[int]:
        """Observations at or below each bound, Prometheus-style (cumulative).

        An observation counts by its log-linear bucket's upper edge: a count is
        never above the true one, and an observation within 19% below a bound
        may be counted at the next bound.
        """
        out = []
        for bound in bounds_s:
            limit_ns = bound * 1e9
            out.append(sum(c for i, c in enumerate(self.counts) if c and _upper_ns(i) <= limit_ns))
        return out

    def summary(self) -> dict[str, object]:
        """count, mean and p50/p99/p99.9/max in microseconds (since mount), and
        `histogram`: cumulative counts at PROM_BOUNDS_S, the sum in seconds and
        `log_linear` (upper edge in ns -> count, non-empty buckets only)."""
        histogram = {"le_seconds": list(PROM_BOUNDS_S), "cumulative": self.cumulative(),
                     "sum_seconds": self.total_ns / 1e9,
                     # The non-empty log-linear buckets, keyed by upper edge in ns:
                     # `stat --watch` takes percentiles of an interval from two of these.
                     "log_linear": {str(_upper_ns(i)): c for i, c in enumerate(self.counts)
                                    if c}}
        if not self.count:
            return {"count": 0, "histogram": histogram}
        return {"count": self.count,
                "mean_us": round(self.total_ns / self.count / 1000, 1),
                "p50_us": round(self.percentile_ns(50) / 1000, 1),
                "p99_us": round(self.percentile_ns(99) / 1000, 1),
                "p99.9_us": round(self.percentile_ns(99.9) / 1000, 1),
                "max_us": round(self.max_ns / 1000, 1),
                "histogram": histogram}
