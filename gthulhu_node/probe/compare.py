"""Evidence on the operator's own host: intents on and off in alternating windows, side by side.

Why alternating windows and not one run each: a host's load drifts (a batch job starts, a model warms
up), and a single "before" and "after" mostly measures the drift. Windows alternate in pairs whose order
flips every pair (on-off, off-on, on-off, ...), so a steady drift lands on both sides alike, and the
spread of the per-window figures says how much of a difference is noise.

What a window measures, for the threads the intents' patterns match (the same threads on both sides):
- the run-queue waits, from the BCC probe's log2 histogram, as the difference between the cumulative
  histograms at the window's ends (percentiles within a power-of-two bucket; the maximum is not
  differentiable and is left out);
- their CPU time, from /proc/<tid>/schedstat (time on a CPU, ns), summed over the threads alive at both
  ends, as CPU cores used on average.
Pure logic over three callables (switch, sample the histogram, sample CPU time), so that it is tested
without a kernel; `gthulhu-node compare` wires it to the agent and the probe.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gthulhu_node.probe.histogram import WaitHistogram

SIDES = ("on", "off")


def difference(after: WaitHistogram, before: WaitHistogram) -> WaitHistogram:
    """The waits recorded between two snapshots of a cumulative histogram (max_ns unknown: 0)."""
    counts = {slot: n - before.counts.get(slot, 0) for slot, n in after.counts.items()}
    return WaitHistogram(counts={s: n for s, n in counts.items() if n > 0},
                         sum_ns=after.sum_ns - before.sum_ns, count=after.count - before.count)


def merged(hists: Iterable[WaitHistogram]) -> WaitHistogram:
    out = WaitHistogram()
    for h in hists:
        out.merge(h)
    return out


def cpu_delta_ns(after: Mapping[int, int], before: Mapping[int, int]) -> int:
    """On-CPU time of the threads alive at both samples (a thread that came or went is left out)."""
    return sum(max(0, after[tid] - before[tid]) for tid in after.keys() & before.keys())


def read_cpu_ns(tids: Iterable[int], proc: Path = Path("/proc")) -> dict[int, int]:
    """Each thread's time on a CPU so far (first field of /proc/<tid>/schedstat); gone threads are skipped."""
    out: dict[int, int] = {}
    for tid in tids:
        try:
            out[tid] = int((proc / str(tid) / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


@dataclass
class Window:
    on: bool
    seconds: float
    waits: WaitHistogram
    cpu_ns: int
    threads: int  # threads measured at the window's end

    @property
    def cpu_cores(self) -> float:
        return self.cpu_ns / 1e9 / self.seconds if self.seconds > 0 else 0.0


def order(pairs: int) -> list[bool]:
    """on, off | off, on | on, off ...: each pair flips, so a steady drift favours neither side."""
    out: list[bool] = []
    for i in range(pairs):
        out += [True, False] if i % 2 == 0 else [False, True]
    return out


def run_windows(
    pairs: int,
    window_s: float,
    switch: Callable[[bool], None],
    sample_waits: Callable[[], WaitHistogram],
    sample_cpu: Callable[[], dict[int, int]],
    *,
    settle_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    progress: Callable[[int, int, bool], None] | None = None,
) -> list[Window]:
    """Switch the intents on or off per window, let the change settle (the agent writes its maps within
    milliseconds; settle_s also lets queues drain), then measure the window."""
    windows: list[Window] = []
    sides = order(pairs)
    for i, on in enumerate(sides):
        if progress is not None:
            progress(i, len(sides), on)
        switch(on)
        sleep(settle_s)
        waits0, cpu0, t0 = sample_waits(), sample_cpu(), clock()
        sleep(window_s)
        waits1, cpu1, t1 = sample_waits(), sample_cpu(), clock()
        windows.append(Window(on, t1 - t0, difference(waits1, waits0), cpu_delta_ns(cpu1, cpu0), len(cpu1)))
    return windows


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 3), "max": round(max(values), 3),
            "stdev": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0}


def summarize(windows: list[Window]) -> dict[str, Any]:
    """Per side: all its windows' waits merged (percentiles in µs), CPU cores, and the spread of the
    per-window p50/p99 and CPU across windows."""
    out: dict[str, Any] = {}
    for side in SIDES:
        mine = [w for w in windows if w.on == (side == "on")]
        if not mine:
            continue
        waits = merged(w.waits for w in mine)
        seconds = sum(w.seconds for w in mine)
        per_p50 = [w.waits.percentile_ns(0.50) / 1e3 for w in mine]
        per_p99 = [w.waits.percentile_ns(0.99) / 1e3 for w in mine]
        per_cpu = [w.cpu_cores for w in mine]
        out[side] = {
            "windows": len(mine),
            "seconds": round(seconds, 3),
            "waits": waits.count,
            "waits_per_s": round(waits.count / seconds, 1) if seconds else 0.0,
            "p50_us": round(waits.percentile_ns(0.50) / 1e3, 1),
            "p90_us": round(waits.percentile_ns(0.90) / 1e3, 1),
            "p99_us": round(waits.percentile_ns(0.99) / 1e3, 1),
            "mean_us": round(waits.sum_ns / waits.count / 1e3, 1) if waits.count else 0.0,
            "cpu_cores": round(sum(w.cpu_ns for w in mine) / 1e9 / seconds, 3) if seconds else 0.0,
            "threads": max(w.threads for w in mine),
            "spread": {"p50_us": _spread(per_p50), "p99_us": _spread(per_p99), "cpu_cores": _spread(per_cpu)},
        }
    return out


def table(summary: Mapping[str, Any], windows: list[Window]) -> str:
    """Both sides in one table, then every window, so a reader sees the noise as well as the means."""
    header = ["", "windows", "waits/s", "p50", "p90", "p99", "p99 range", "mean", "CPU cores", "CPU range"]
    rows = []
    for side in SIDES:
        s = summary.get(side)
        if s is None:
            continue
        p99, cpu = s["spread"]["p99_us"], s["spread"]["cpu_cores"]
        rows.append([f"intents {side}", str(s["windows"]), f"{s['waits_per_s']:g}", _us(s["p50_us"]),
                     _us(s["p90_us"]), _us(s["p99_us"]), f"{_us(p99['min'])}-{_us(p99['max'])}",
                     _us(s["mean_us"]), f"{s['cpu_cores']:.2f}", f"{cpu['min']:.2f}-{cpu['max']:.2f}"])
    lines = _render(header, rows)
    lines += ["", "each window (order flips every pair):"]
    wrows = [[str(i + 1), "on" if w.on else "off", f"{w.seconds:.1f}s", str(w.waits.count),
              _us(w.waits.percentile_ns(0.50) / 1e3), _us(w.waits.percentile_ns(0.99) / 1e3),
              f"{w.cpu_cores:.2f}", str(w.threads)] for i, w in enumerate(windows)]
    lines += _render(["#", "side", "length", "waits", "p50", "p99", "CPU cores", "threads"], wrows)
    return "\n".join(lines)


def _us(value: float) -> str:
    return f"{value / 1e3:.2f} ms" if value >= 1000 else f"{value:.0f} us"


def _render(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                      enumerate(zip(r, widths, strict=True))).rstrip() for r in [header, *rows]]
