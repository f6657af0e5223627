"""Where a pipe round trip's time goes (issue 40, item 3), guest side tests/vm/pipe_trace.py: `perf bench
sched pipe` and hackbench timed under EEVDF, ours (no policy) and the kernel's scx_simple in its two modes
(weighted vtime, the minimal vtime scheduler; and FIFO), interleaved in one boot; then one traced pipe run
per case, each wake-up split into its stages, and the struct_ops callbacks' own run time. Prints the
times with ours / EEVDF and peer / EEVDF of the medians, and the stages per wake-up in microseconds.
GTHULHU_BENCH_ROUNDS (default 5) sizes it.

    .venv/bin/python -m pytest -m bench -s -p no:cacheprovider -p no:xdist tests/bench/test_pipe_trace.py
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import pytest

from tests.bench import benchlab
from tests.vm import matrix
from tests.vm.lab import Lab

pytestmark = pytest.mark.bench

ROUNDS = int(os.environ.get("GTHULHU_BENCH_ROUNDS", "5"))
BUDGET_S = ROUNDS * 4 * 120 + 900
STAGES = ("run_to_wake", "queue", "to_run", "wake_to_run_same", "wake_to_run_other")


def median(runs: list[dict[str, Any]], key: str) -> float:
    """The median of one figure over a case's runs."""
    return statistics.median(float(r[key]) for r in runs)


def stage_cell(trace: dict[str, Any], stage: str) -> str:
    """A stage's mean (median) in us, or "-" where the trace has none (no wake-up took that way)."""
    if stage not in trace:
        return "-"
    return f"{trace[stage]['mean']:.1f} ({trace[stage]['p50']:.1f})"


def print_tables(data: dict[str, Any]) -> None:
    runs: dict[str, list[dict[str, Any]]] = data["runs"]
    base = runs["EEVDF"]
    print(f"\npipe and hackbench: lab VM (kernel {data['kernel']}, {data['cpus']} vCPU, TCG thread="
          f"{data.get('tcg_thread', '?')}), {len(base)} interleaved rounds, guest deaths "
          f"{len(data.get('guest_deaths', []))}; median [min-max]")
    print(f"{'case':18}{'pipe -l 20000 s':>24}{'us/round trip':>15}{'hackbench s':>24}"
          f"{'pipe vs EEVDF':>15}{'hackbench vs EEVDF':>20}")
    for case, rs in runs.items():
        pipe, hack = [float(r["pipe_s"]) for r in rs], [float(r["hackbench_s"]) for r in rs]
        trip = statistics.median(pipe) / data["loops"] * 1e6
        vs_pipe = median(rs, "pipe_s") / median(base, "pipe_s")
        vs_hack = median(rs, "hackbench_s") / median(base, "hackbench_s")
        print(f"{case:18}{benchlab.median_range(pipe, '.3f'):>24}{trip:>15.1f}"
              f"{benchlab.median_range(hack, '.3f'):>24}{vs_pipe:>14.2f}x{vs_hack:>19.2f}x")
    print(f"\none traced pipe run per case ({data['traced_loops']} round trips): per round trip, us with "
          "neither, one or both of the pair on a CPU; per wake-up, each stage's mean (median) in us")
    print(f"{'case':18}{'traced trip':>12}{'neither':>9}{'one':>8}{'both':>8}"
          + "".join(f"{s:>19}" for s in STAGES)
          + f"{'other CPU':>10}{'idle target':>12}{'still on':>9}{'IPIs/wake':>10}{'BPF us/wake':>12}")
    for case, t in data["traces"].items():
        ns = sum(v[0] for v in data["callbacks"].get(case, {}).values())
        bpf = ns / 1e3 / (2 * data["loops"])
        occ = t["per_round_trip_us"]
        print(f"{case:18}{t['traced_round_trip_us']:>12.1f}{occ.get('neither', 0):>9.1f}"
              f"{occ.get('one', 0):>8.1f}{occ.get('both', 0):>8.1f}"
              + "".join(f"{stage_cell(t, s):>19}" for s in STAGES)
              + f"{t['where'].get('other_cpu', 0):>10.0%}{t['where'].get('target_was_idle', 0):>12.0%}"
              f"{t['still_on_cpu']:>9.0%}{t['ipis_per_wakeup']:>10.2f}{bpf:>12.2f}")
    for case, cbs in data["callbacks"].items():
        if cbs:
            top = sorted(cbs.items(), key=lambda kv: -kv[1][0])[:6]
            print(f"  {case} callbacks (pipe -l {data['loops']}): " + ", ".join(
                f"{k} {ns / 1e6:.0f} ms / {n:,} calls" for k, (ns, n) in top))


@pytest.mark.parametrize("bench_lab", matrix.BOTH_KERNELS, indirect=True)
@pytest.mark.timeout(BUDGET_S * (benchlab.DEATHS_ALLOWED + 1))
def test_where_a_pipe_round_trip_goes(bench_lab: Lab) -> None:
    data = benchlab.run_interleaved(bench_lab, "tests/vm/pipe_trace.py", "pipe_progress.jsonl", BUDGET_S,
                                    seconds=0, rounds=ROUNDS, stage=benchlab.peers_args(bench_lab))
    print(json.dumps({k: data[k] for k in ("runs", "traces", "callbacks")}))
    print_tables(data)
    for case, rs in data["runs"].items():
        assert len(rs) == ROUNDS, (case, len(rs))
    for case, t in data["traces"].items():
        # nearly every wake-up of the pair was seen whole (a round trip is two of them)
        assert t["wakeups"] >= 1.9 * data["traced_loops"], (case, t["wakeups"])
