"""The reconciler's two hot paths in-process, on whichever checkout is first on sys.path (issue 41: the
core cut must not slow them): a full rematch of 2,000 threads in 200 processes under 1,000 intents (one
in seven of process scope) by `set_policy` without a budget, and 1,000 comm events in and out of the
patterns, one pair per `handle_events` (each a diff and a write to the dry run). CPU time of this
process (`time.process_time`), not wall time: on a shared machine another session's load then costs
preemption it does not count. Prints one JSON line of medians over the repetitions;
tests/bench/revisions.py runs it from an earlier checkout and from this one.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import structlog

from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.intents.parse import parse_intent
from gthulhu_node.matching import PolicySet
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.tasks.events import EventKind, ProcEvent
from gthulhu_node.tasks.procfs import Snapshot, Task


def policy(salt: int) -> PolicySet:
    """1,000 intents over 50 names (`salt` makes every pattern new to the process)."""
    return PolicySet.build([
        (f"b/i{k}", parse_intent({"id": f"i{k}", "commandRegex": f"^w{k % 50}x{{0,{salt}}}$",
                                  "priority": 1 + k % 10, **({"scope": "process"} if k % 7 == 0 else {})}))
        for k in range(1000)
    ])


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    backend = DryRunBackend()
    backend.start()
    r = Reconciler(backend, proc_root=Path("/nonexistent"))
    tasks = {}
    for p in range(200):
        tgid = 100_000 + p * 20
        for t in range(10):
            tasks[tgid + t] = Task(tgid, tgid + t, f"w{(p + t) % 60}", 1000 + tgid + t)
    r.apply_snapshot(Snapshot(tasks))
    policies = [policy(1), policy(2)]
    rematch = []
    for i in range(12):
        t0 = time.process_time()
        r.set_policy(policies[i % 2])
        rematch.append(time.process_time() - t0)
    events = []
    for _ in range(7):
        batch = []
        for tid in list(tasks)[:1000]:
            t = tasks[tid]
            batch += [ProcEvent(EventKind.COMM, tid, t.tgid, 1, "zz-out"),
                      ProcEvent(EventKind.COMM, tid, t.tgid, 1, t.comm)]
        t0 = time.process_time()
        for k in range(0, len(batch), 2):
            r.handle_events(batch[k:k + 2])
        events.append(time.process_time() - t0)
    print(json.dumps({"rematch_ms": statistics.median(rematch[2:]) * 1e3,
                      "events_us_per_pair": statistics.median(events) / 1000 * 1e6}))


if __name__ == "__main__":
    main()
