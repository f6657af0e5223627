"""Log2 histograms of run-queue waits as the BPF program records them, and percentiles read from them.

The kernel side files a wait of `v` ns into slot `bpf_log2l(v)`: slot k (k >= 1) holds [2^(k-1), 2^k) ns,
and slot 1 also holds 0. Percentiles are interpolated linearly inside the slot that holds the rank, so a
figure is exact only to within its bucket (a factor of two); the exact maximum, kept beside the histogram,
caps the top. Pure Python, no BCC: unit-testable and shared by the CLI, the demo and the Prometheus export.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Slots the BPF program keeps (passed to it as -DNSLOTS); the last slot also takes everything longer.
NSLOTS = 40


def slot_bounds(slot: int) -> tuple[int, int]:
    """[low, high) in ns of one slot."""
    if slot <= 1:
        return 0, 2
    return 1 << (slot - 1), 1 << slot


def slot_of(value_ns: int) -> int:
    """The slot the BPF program files `value_ns` into (bpf_log2l semantics, capped at the last slot)."""
    return min(max(value_ns.bit_length(), 1), NSLOTS - 1)


@dataclass
class WaitHistogram:
    """One histogram (an intent's or a thread's) with its exact totals."""

    counts: dict[int, int] = field(default_factory=dict)  # slot -> waits
    sum_ns: int = 0
    count: int = 0
    max_ns: int = 0

    @classmethod
    def from_values(cls, values: Iterable[int]) -> WaitHistogram:
        """Build from raw waits (tests and cross-checks)."""
        hist = cls()
        for v in values:
            hist.counts[slot_of(v)] = hist.counts.get(slot_of(v), 0) + 1
            hist.sum_ns += v
            hist.count += 1
            hist.max_ns = max(hist.max_ns, v)
        return hist

    @property
    def histogram_count(self) -> int:
        return sum(self.counts.values())

    def percentile_ns(self, q: float) -> float:
        """The q-quantile (0 < q <= 1), interpolated within its log2 bucket; 0.0 for an empty histogram.

        A q outside (0, 1] is refused: a percent (99 for 0.99) used to fall through to the maximum, so a
        caller asking for a p99 silently compared maxima."""
        if not 0 < q <= 1:
            raise ValueError(f"percentile_ns takes a fraction in (0, 1], not {q!r}")
        total = self.histogram_count
        if total == 0:
            return 0.0
        rank = q * total
        seen = 0
        for slot in sorted(self.counts):
            n = self.counts[slot]
            if n and seen + n >= rank:
                low, high = slot_bounds(slot)
                if self.max_ns:
                    high = min(high, self.max_ns)
                    low = min(low, high)
                return low + (high - low) * (rank - seen) / n
            seen += n
        return float(self.max_ns)

    def merge(self, other: WaitHistogram) -> None:
        for slot, n in other.counts.items():
            self.counts[slot] = self.counts.get(slot, 0) + n
        self.sum_ns += other.sum_ns
        self.count += other.count
        self.max_ns = max(self.max_ns, other.max_ns)

    def cumulative_buckets(self, slots: range) -> list[tuple[float, int]]:
        """Prometheus-style cumulative buckets: (upper bound in seconds, waits below it) for each slot in
        `slots`, each bound being the slot's exclusive top 2^k ns, then (+Inf, all)."""
        out: list[tuple[float, int]] = []
        ordered = sorted(self.counts.items())
        for k in slots:
            below = sum(n for slot, n in ordered if slot <= k)
            out.append(((1 << k) / 1e9, below))
        out.append((float("inf"), self.histogram_count))
        return out

    def summary(self) -> dict[str, float | int]:
        """The figures people read: percentiles, max and mean in microseconds, and the count."""
        return {
            "count": self.count,
            "p50_us": round(self.percentile_ns(0.50) / 1e3, 1),
            "p90_us": round(self.percentile_ns(0.90) / 1e3, 1),
            "p99_us": round(self.percentile_ns(0.99) / 1e3, 1),
            "max_us": round(self.max_ns / 1e3, 1),
            "mean_us": round(self.sum_ns / self.count / 1e3, 1) if self.count else 0.0,
            "sum_ns": self.sum_ns,
        }


def histograms_from_slots(
    slot_counts: Iterable[tuple[int, int, int]], totals: Mapping[int, tuple[int, int, int]]
) -> dict[int, WaitHistogram]:
    """Group (owner, slot, count) rows and (sum_ns, count, max_ns) totals by owner (an intent or a tid)."""
    out: dict[int, WaitHistogram] = {}
    for owner, slot, n in slot_counts:
        hist = out.setdefault(owner, WaitHistogram())
        hist.counts[slot] = hist.counts.get(slot, 0) + n
    for owner, (sum_ns, count, max_ns) in totals.items():
        hist = out.setdefault(owner, WaitHistogram())
        hist.sum_ns, hist.count, hist.max_ns = sum_ns, count, max_ns
    return out
