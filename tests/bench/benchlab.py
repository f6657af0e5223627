"""Where the scheduling benchmarks run: the TCG threading of their guest, and a guest bench's interleaved
rounds run to the end across the guest deaths that threading risks."""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.vm import peers
from tests.vm.lab import Lab, LabBootError, LabDied

# Scheduling benchmarks run under multi-threaded TCG, each vCPU on a host thread of its own, as CPUs are
# independent on a real host. Under the lab's single-threaded TCG the vCPUs share one host thread: two hogs
# on two vCPUs did the work of two on one (951 against 905 bogo-ops in 6 s; 1,886 against 950 multi-
# threaded), so an idle vCPU gives its time to the busy one and a scheduler that leaves a CPU idle gains,
# and a busy vCPU takes its timer interrupt about a millisecond late (tests/vm/wake_trace.py), which no
# scheduler can change. GTHULHU_BENCH_TCG_THREAD=single for the lab's default.
BENCH_TCG_THREAD = os.environ.get("GTHULHU_BENCH_TCG_THREAD", "multi")
# Guest deaths a benchmark resumes after: multi-threaded TCG's int3 hazard (docs/lab.md: 4 in 96 enables of
# the scheduler with qemu 7.2) struck the request pipeline twice in 20 runs (about 8 enables of a sched_ext
# scheduler) on 2026-12-04; each costs a boot and the run it killed.
DEATHS_ALLOWED = int(os.environ.get("GTHULHU_BENCH_DEATHS_ALLOWED", "10"))


def median_range(values: list[float], fmt: str = ".1f") -> str:
    """`median [min-max]` of a figure over runs, as every benchmark table prints it; "-" with no run."""
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _progress_rows(progress: Path) -> list[dict[str, Any]]:
    """The runs a guest wrote to its progress file. A guest that died while writing leaves its last line
    torn: that run is left out (the next boot runs it again); a torn line anywhere else is an error."""
    if not progress.exists():
        return []
    lines = progress.read_text().splitlines()
    rows = [json.loads(line) for line in lines[:-1]]
    if lines:
        try:
            rows.append(json.loads(lines[-1]))
        except json.JSONDecodeError:
            print(f"left out a torn last line of {progress.name}: {lines[-1][:80]!r}", flush=True)
    return rows


def survive(lab: Lab, deaths: list[str], died: LabDied, when: str) -> None:
    """Count a guest death; past DEATHS_ALLOWED raise it, else boot a fresh guest for the caller to go on.
    A boot that hangs counts as a death too and is tried again: an 8-vCPU multi-threaded guest once stopped
    after the firmware's banner (2026-12-05), right after two int3 deaths."""
    while True:
        deaths.append(died.reason)
        lines = died.console.splitlines()
        # the oops's own lines say which death it was (the emulator's int3, or another), the tail only "panic"
        cause = [line for line in lines if re.search(r"Oops|BUG:|RIP:|sched_ext", line)][-4:]
        print(f"the guest died {when} ({died.reason}); console: {cause + lines[-3:]}", flush=True)
        if len(deaths) > DEATHS_ALLOWED:
            raise died
        try:
            lab.ensure_alive()
            return
        except LabBootError as exc:
            died, when = exc, "while booting"


def run_interleaved(lab: Lab, script: str, progress_name: str, budget_s: float, *args: str, seconds: float,
                    rounds: int, stage: Callable[[], list[str]] | None = None) -> dict[str, Any]:
    """Run a guest bench (tests/vm/engine_step_bench.py's `interleave`) and return its JSON. What ended
    before a timeout or a kill is still printed: each result is also written to a progress file as it
    comes (the full JSON comes only at the end). A guest that dies (under multi-threaded TCG the emulator's
    int3 hazard, docs/lab.md) keeps the runs it finished: a fresh guest resumes after them, up to
    DEATHS_ALLOWED times, and the result says how often (`guest_deaths`). `stage` puts what the guest
    needs into each boot's scratch folder and returns the arguments naming it."""
    rows: list[dict[str, Any]] = []
    deaths: list[str] = []
    deadline = time.monotonic() + budget_s
    while True:
        extra = stage() if stage is not None else []
        progress = lab.scratch_host / progress_name  # this boot's: a death's next boot has another folder
        progress.unlink(missing_ok=True)
        died: LabDied | None = None
        try:
            r = lab.python(script, "--seconds", str(seconds), "--rounds", str(rounds), *args, *extra,
                           "--skip", str(len(rows)), "--progress", str(progress),
                           timeout=max(60.0, deadline - time.monotonic()))
        except LabDied as exc:
            died = exc
        finally:
            rows += _progress_rows(progress)
            partial: dict[str, list[dict[str, float]]] = {}
            for row in rows:
                partial.setdefault(row["case"], []).append(row["result"])
            print("\nresults so far: " + json.dumps(partial), flush=True)
        if died is None:
            break
        survive(lab, deaths, died, f"after {len(rows)} runs")
    assert r.returncode == 0, r.stderr[-4000:]
    data: dict[str, Any] = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in data["runs"]}
    for row in rows:
        runs.setdefault(row["case"], []).append(row["result"])
    data["runs"] = runs
    data["tcg_thread"] = lab.tcg_thread
    data["guest_deaths"] = deaths
    return data


def peers_args(lab: Lab) -> Callable[[], list[str]]:
    """A `stage` for run_interleaved: the kernel's reference schedulers (tests/vm/peers.py) into each boot's
    scratch folder, named to the guest script by --peers-dir."""
    return lambda: ["--peers-dir", str(peers.stage(lab.scratch_host, lab.scratch_guest))]
