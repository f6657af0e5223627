"""The probe's result as a table for people (JSON comes from ProbeResult.to_json)."""

from __future__ import annotations

from gthulhu_node.probe.histogram import WaitHistogram
from gthulhu_node.probe.session import ProbeResult

_COLUMNS = ("count", "p50_us", "p90_us", "p99_us", "max_us", "mean_us")


def _row(label: list[str], hist: WaitHistogram) -> list[str]:
    s = hist.summary()
    return label + [str(s[c]) for c in _COLUMNS]


def _render(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [c.ljust(w) if i < len(header) - len(_COLUMNS) else c.rjust(w) for i, (c, w) in
                 enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return lines


def table(result: ProbeResult) -> str:
    lines = [f"run-queue wait over {result.duration_s:.1f} s, in microseconds (percentiles interpolated "
             "within power-of-two buckets: exact to a factor of two; max and mean are exact)", ""]
    intent_rows = [
        _row([key, str(sum(1 for r, _ in result.threads if r.target.intent == key))], hist)
        for key, hist in sorted(result.intents.items())
    ]
    lines += _render(["INTENT", "THREADS", *(c.upper() for c in _COLUMNS)], intent_rows) if intent_rows \
        else ["no thread matched"]
    if result.threads:
        lines.append("")
        thread_rows = []
        for rec, hist in result.threads:
            t = rec.target
            life = f"{rec.added_s:.1f}-" + ("end" if rec.removed_s is None else f"{rec.removed_s:.1f}")
            thread_rows.append(_row([str(t.tid), str(t.tgid), t.comm, t.intent, life], hist))
        lines += _render(["TID", "TGID", "COMM", "INTENT", "MEASURED_S", *(c.upper() for c in _COLUMNS)],
                         thread_rows)
    if result.map_full_errors:
        lines.append(f"\n{result.map_full_errors} threads were not measured: the target map was full")
    return "\n".join(lines)
