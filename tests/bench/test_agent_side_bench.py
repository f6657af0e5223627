"""Agent-side costs where intents are many (issue 17): applying 1,000 intents, a 10,000-policy REST push,
and the disk cost of a one-intent change after a 10,000-intent push.

Each prints the figure of the current code beside the implementation it replaced, both measured in the
same run where the old path can still be called (kept here as a baseline), and median [min-max] over the
rounds. Figures only, no timed assertions; the assertions are about correctness.
Run: `.venv/bin/python -m pytest -m bench -s -p no:cacheprovider -p no:xdist
tests/bench/test_agent_side_bench.py` (docs/benchmarks.md, "Agent side", has the figures).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

import pytest
import re2
import structlog

from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.intents.model import RE2_MAX_MEM, Intent
from gthulhu_node.intents.parse import parse_intent
from gthulhu_node.matching import CommMatch, CompiledIntent, PolicySet, precedence_rank
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.tasks.procfs import Snapshot, Task

pytestmark = pytest.mark.bench
ROUNDS = 5


def spread(values: Sequence[float], unit: str = "ms", scale: float = 1e3) -> str:
    """median [min-max] of seconds, in `unit`."""
    v = [x * scale for x in values]
    return f"{statistics.median(v):8.1f} [{min(v):.1f}-{max(v):.1f}] {unit}"


@pytest.fixture(autouse=True)
def quiet_logs() -> None:
    """The reconciler logs every applied policy; thousands of lines would time the terminal."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


# ---- 1,000-intent apply ------------------------------------------------------------------------------


def bench_tasks(n: int = 2000) -> dict[int, Task]:
    """A host's worth of threads: workers the intents name, and names no intent matches (kernel
    threads, runtimes), many threads per name as on a real host (about 700 distinct names)."""
    names = (
        [f"worker-{k * 3}" for k in range(300)]
        + [f"worker-{k}_{k % 4}" for k in range(100)]
        + [f"kworker/{k % 8}:{k}" for k in range(150)]
        + [f"tokio-rt-w{k}" for k in range(50)]
        + [f"python3.{k}" for k in range(50)]
        + [f"EngineCore_DP{k}" for k in range(50)]
    )
    return {1000 + t: Task(1000 + t // 4 * 4, 1000 + t, names[t % len(names)], 1) for t in range(n)}


def bench_intents(n: int, salt: int) -> list[tuple[str, Intent]]:
    """`salt` makes every round's patterns new to the process (no compiled pattern cached)."""
    return [
        (f"bench/i{k}", parse_intent({"id": f"i{k}", "commandRegex": f"^worker-{k}(_[0-9]{{1,{salt + 2}}})?$",
                                      "priority": 1 + k % 20, "executionTime": 1_000_000 + k}))
        for k in range(n)
    ]


class PerPatternPolicySet(PolicySet):
    """The replaced matcher: every pattern compiled at build, one RE2 search per (comm, pattern)."""

    @classmethod
    def build_old(cls, intents: Sequence[tuple[str, Intent]]) -> PerPatternPolicySet:
        options = re2.Options()
        options.max_mem = RE2_MAX_MEM
        options.log_errors = False
        return cls(
            CompiledIntent(key, i, re2.compile(i.matching_pattern, options), precedence_rank(key, i))
            for key, i in intents
        )

    def match(self, comm: str) -> CommMatch:
        hit = self._cache.get(comm)
        if hit is not None:
            return hit
        return self._remember(comm, [c for c in self.ordered if c.pattern.search(comm) is not None])


def test_apply_1000_intents_to_2000_threads() -> None:
    """Time from validated intents (as the store holds them) to the entries written: the policy build
    and the reconciler's full recompute. Patterns new to the process each round, so the new code's
    compiled-pattern cache gives it nothing (an apply after validation finds them compiled: "warm")."""
    backend = DryRunBackend()
    backend.start()
    reconciler = Reconciler(backend)
    reconciler.apply_snapshot(Snapshot(bench_tasks()))
    timings: dict[str, list[float]] = {"old": [], "new": [], "new, warm": []}
    entries: dict[str, int] = {}

    def timed(name: str, build: Callable[[], PolicySet]) -> None:
        reconciler.set_policy(PolicySet.empty())
        t0 = time.perf_counter()
        reconciler.set_policy(build())
        timings[name].append(time.perf_counter() - t0)
        entries[name] = len(backend.table)

    for r in range(ROUNDS):
        intents = bench_intents(1000, salt=2 * r)
        timed("old", lambda i=intents: PerPatternPolicySet.build_old(i))  # type: ignore[misc]
        fresh = bench_intents(1000, salt=2 * r + 1)
        timed("new", lambda i=fresh: PolicySet.build(i))  # type: ignore[misc]
        timed("new, warm", lambda i=fresh: PolicySet.build(i))  # type: ignore[misc]
    backend.stop()
    assert entries["old"] == entries["new"] == entries["new, warm"] > 0
    old = statistics.median(timings["old"])
    print(f"\n1,000-intent apply against 2,000 threads ({len({t.comm for t in bench_tasks().values()})} "
          f"names), {ROUNDS} rounds, median [min-max]")
    for name, values in timings.items():
        print(f"  {name:32s} {spread(values)}  {old / statistics.median(values):6.1f}x faster than old")
